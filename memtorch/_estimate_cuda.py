"""The CUDA caching allocator's rules, replayed over estimate()'s allocation events.

The rules (PyTorch's c10/cuda/CUDACachingAllocator.cpp, default settings):
- every request is rounded up to a multiple of 512 bytes (512 at least); a
  request of 0 bytes takes no block;
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB;
  larger ones from the large pool: a 20 MiB segment for requests under 10 MiB,
  a segment of the request rounded up to 2 MiB from 10 MiB on;
- a request takes the smallest free block of its pool that fits (best fit);
  the block is split when what remains is at least 512 bytes (small pool) or
  more than 1 MiB (large pool), otherwise the whole block is handed out and
  counted as allocated;
- a freed block merges with free neighbours of its segment; segments are kept
  (reserved) until empty_cache(), which a training step does not call.

memory_allocated() counts the blocks handed out, memory_reserved() the
segments. The CUDA context and the cuBLAS/cuDNN workspaces are not modelled.
"""

import bisect

__all__ = ["round_size", "segment_size", "CachingAllocator", "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER",
           "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE"]  # fmt: skip

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n):
    """Bytes of the block a request of n bytes gets (before any unsplit remainder)."""
    if n <= 0:
        return 0
    if n < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(n):
    """Bytes of the segment cudaMalloc'd for a rounded request of n bytes that no free block fits."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((n + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = ("size", "free", "prev", "next", "small")

    def __init__(self, size, small):
        self.size = size
        self.free = True
        self.prev = self.next = None
        self.small = small


class CachingAllocator:
    """A model of the caching allocator: allocated and reserved bytes after each event."""

    def __init__(self):
        self.allocated = 0
        self.reserved = 0
        self._free = {True: [], False: []}  # small? -> sorted [(size, serial, block)]
        self._serial = 0
        self._blocks = {}  # key -> block handed out

    def _insert(self, b):
        self._serial += 1
        bisect.insort(self._free[b.small], (b.size, self._serial, b))

    def _remove(self, b):
        lst = self._free[b.small]
        for i in range(bisect.bisect_left(lst, (b.size,)), len(lst)):
            if lst[i][2] is b:
                del lst[i]
                return
        raise AssertionError("free block not in its pool")

    def malloc(self, key, nbytes):
        size = round_size(nbytes)
        if size == 0:
            return
        small = size <= SMALL_SIZE
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size,))
        if i < len(lst):
            block = lst.pop(i)[2]
        else:
            seg = segment_size(size)
            self.reserved += seg
            block = _Block(seg, small)
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_SIZE):
            rest = _Block(remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        block.free = False
        self.allocated += block.size
        self._blocks[key] = block

    def free(self, key):
        block = self._blocks.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                self._remove(nb)
                block.size += nb.size
                if nb is block.prev:
                    block.prev = nb.prev
                    if nb.prev is not None:
                        nb.prev.next = block
                else:
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        self._insert(block)

    def replay(self, events, sizes):
        """(allocated, reserved) after each (key, +1/-1) event, sizes[key] the requested bytes."""
        alloc, res = [], []
        for key, sign in events:
            if sign > 0:
                self.malloc(key, sizes[key])
            else:
                self.free(key)
            alloc.append(self.allocated)
            res.append(self.reserved)
        return alloc, res
