"""CUDA memory counters: a thin layer over ``torch.cuda``, never a re-implementation.

    memtorch.cuda.allocated()   bytes of live tensors (torch.cuda.memory_allocated;
                                blocks rounded up to 512 B by the caching allocator)
    memtorch.cuda.reserved()    bytes the caching allocator holds from the driver
    memtorch.cuda.peak()        torch's peak of allocated() since its last reset
    memtorch.cuda.reset_peak()  torch.cuda.reset_peak_memory_stats: GLOBAL to the device
    memtorch.cuda.mem_info()    (free, total) from the driver (torch.cuda.mem_get_info);
                                total - free includes the CUDA context and other
                                processes, which PyTorch's own counters never see
    memtorch.cuda.outside_torch()  total - free - reserved: the context, cuBLAS/cuDNN
                                workspaces outside the allocator, other processes
    memtorch.cuda.stats()       the raw torch.cuda.memory_stats() dict

Every function takes ``device``: None (the current device), an int, "cuda",
"cuda:N" or a torch.device. Without CUDA each raises
memtorch.errors.DeviceUnavailable saying so.

Nested peaks. torch keeps one peak per device and its only reset is global, so
track() never resets it: blocks get their own peak from :func:`block_peak`, a
pure function of counters read at entry, at exit and at sample points (phase
and step boundaries). It is exact when the device's peak rose during the block
or when the block started at the device's peak; otherwise it is the largest
value seen at the sample points, a lower bound, flagged ``exact=False``, with
the device's peak at entry as an upper bound. A budget never passes on such a
range (memtorch.budget: inconclusive). :func:`reset_peak` (memtorch's, not
torch's) keeps the blocks open on the device exact: each folds the counters
read just before the reset into its own peak (:func:`combine_peaks`). The
pytest plugin calls it at the start of a budgeted CUDA test whose device peak
is above what is allocated, so that every budgeted test starts at the peak.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Literal, Union

from . import words
from .errors import DeviceUnavailable
from ._torch import torch as _load_torch  # the loader only: torch itself loads on first call

if TYPE_CHECKING:  # annotations only: importing this module loads neither torch nor NumPy
    import numpy as np
    import torch

# what a device argument may be: an index, "cuda", "cuda:N", a torch.device, or None (the current device)
_Device = Union[int, str, "torch.device", None]

__all__ = [
    "is_available",
    "allocated",
    "reserved",
    "peak",
    "reserved_peak",
    "reset_peak",
    "mem_info",
    "outside_torch",
    "stats",
    "block_peak",
    "combine_peaks",
    "BlockPeak",
    "MECHANISM",
]

# The start of a CUDA TrackReport's ``mechanism``: memtorch.budget reads a CUDA report's
# inexact peak as a range (lower bound, peak_upper), never as a figure.
MECHANISM = words.CUDA_MECHANISM

# The Scopes open now, process-wide (reset_peak folds into them; _debug_leftovers).
_open_scopes = weakref.WeakSet()

# Keys of torch.cuda.memory_stats() that memtorch reads.
ALLOCATED = "allocated_bytes.all.current"
ALLOCATED_PEAK = "allocated_bytes.all.peak"
RESERVED = "reserved_bytes.all.current"
RESERVED_PEAK = "reserved_bytes.all.peak"


_torch_mod = None


def _torch():
    """The torch module (imported on first use). Its ``cuda`` attribute is read at each call
    (tests put a fake torch.cuda there)."""
    global _torch_mod
    if _torch_mod is None:
        _torch_mod = _load_torch()
    return _torch_mod


def _available():
    """True when torch can use a CUDA device (tests replace this to fake a device)."""
    return _torch().cuda.is_available()


def is_available() -> bool:
    """True when CUDA can be used (torch.cuda.is_available())."""
    return bool(_available())


def _require():
    if _available():
        return
    torch = _torch()
    built = getattr(torch.version, "cuda", None)
    why = (
        f"this torch {torch.__version__} is built without CUDA"
        if not built
        else f"torch {torch.__version__} is built for CUDA {built} but finds no usable device"
    )
    raise DeviceUnavailable(f"CUDA is not available: {why}; memtorch.cuda needs a CUDA device")


def _index(device):
    """The CUDA device index for ``device`` (None: current device). Raises DeviceUnavailable."""
    _require()
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise ValueError(f"not a CUDA device: {device!r}")
    if isinstance(device, int):
        index = device
    else:
        torch = _torch()
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"not a CUDA device: {device!r} ({e})") from None
        if dev.type != "cuda":
            raise ValueError(f"not a CUDA device: {device!r} (type {dev.type!r}); use memtorch.cpu for the CPU")
        index = _current_device() if dev.index is None else dev.index
    count = _device_count()
    if not 0 <= index < count:
        raise DeviceUnavailable(f"CUDA device {index} does not exist: this process sees {count} device(s)")
    return index


def _current_device():
    return int(_torch().cuda.current_device())


def _device_count():
    return int(_torch().cuda.device_count())


def _memory_stats(index):
    """torch.cuda.memory_stats for one device index (tests replace this to fake counters)."""
    return _torch().cuda.memory_stats(index)


def stats(device: _Device = None) -> dict[str, Any]:
    """The raw ``torch.cuda.memory_stats(device)`` dict (a copy)."""
    return dict(_memory_stats(_index(device)))


def allocated(device: _Device = None) -> int:
    """Bytes held by live tensors on the device (torch.cuda.memory_allocated)."""
    return int(_memory_stats(_index(device)).get(ALLOCATED, 0))


def reserved(device: _Device = None) -> int:
    """Bytes the caching allocator holds from the driver (torch.cuda.memory_reserved)."""
    return int(_memory_stats(_index(device)).get(RESERVED, 0))


def peak(device: _Device = None) -> int:
    """torch's peak of allocated() since its last (global) reset (torch.cuda.max_memory_allocated)."""
    return int(_memory_stats(_index(device)).get(ALLOCATED_PEAK, 0))


def reserved_peak(device: _Device = None) -> int:
    """torch's peak of reserved() since its last reset (torch.cuda.max_memory_reserved)."""
    return int(_memory_stats(_index(device)).get(RESERVED_PEAK, 0))


def reset_peak(device: _Device = None) -> None:
    """torch.cuda.reset_peak_memory_stats(device), keeping memtorch's open blocks exact.

    torch's reset is global to the device: afterwards torch.cuda.max_memory_allocated()
    and max_memory_reserved() (and every "peak" of memory_stats()) give the peak since
    the reset, for every reader (your own code, other tools): the older peak is gone.
    memtorch's track() blocks open on the device when it is called through this
    function keep their figures: each folds the counters read just before the reset
    into its peak. A reset made by calling torch directly inside a block leaves that
    block's peak a lower bound with no upper bound (its budgets are inconclusive).
    memtorch.track() never resets; the pytest plugin does, through this function, at
    the start of a budgeted CUDA test (see memtorch.pytest_plugin).
    """
    index = _index(device)
    scopes = [s for s in list(_open_scopes) if s.index == index and s._open]
    before = _read(index) if scopes else None
    # (an allocation made by another thread between this read and the reset is not seen
    # by the open scopes' peaks before the reset; the reset is the user's, not a hook's)
    _reset_peak(index)
    if scopes:
        after = _read(index)
        for s in scopes:
            s._fold(before, after)


def _reset_peak(index):
    _torch().cuda.reset_peak_memory_stats(index)


def mem_info(device: _Device = None) -> tuple[int, int]:
    """(free, total) bytes of the device as the driver sees them (torch.cuda.mem_get_info).

    ``total - free`` includes the CUDA context (hundreds of MiB), libraries'
    workspaces and other processes: memory that torch's counters never count.
    """
    free, total = _mem_get_info(_index(device))
    return int(free), int(total)


def _mem_get_info(index):
    return _torch().cuda.mem_get_info(index)


def outside_torch(device: _Device = None) -> int:
    """Bytes in use on the device but outside torch's caching allocator.

    ``total - free - reserved``: the CUDA context, allocations by libraries that
    bypass the allocator, and other processes on the same device.
    """
    index = _index(device)
    free, total = mem_info(index)
    return int(total - free - reserved(index))


# ---------------------------------------------------------------------------
# Nesting-safe block peaks: pure logic, tested on CPU with faked counters.


class BlockPeak:
    """The peak of one block, from counters read at entry, exit and sample points.

    ``peak`` is the block's largest value of the counter (exact when ``exact``,
    else a lower bound); ``upper`` an upper bound (== peak when exact, None when
    torch's peak was reset inside the block and no bound is known).
    """

    __slots__ = ("peak", "exact", "upper", "how")
    peak: int  # the block's largest counter value (exact when exact, else a lower bound)
    exact: bool  # peak is the block's own
    upper: int | None  # an upper bound (== peak when exact; None: none known)
    how: str  # how it was found (a sentence)

    def __init__(self, peak: int, exact: bool, upper: int | None, how: str) -> None:
        self.peak = int(peak)
        self.exact = bool(exact)
        self.upper = None if upper is None else int(upper)
        self.how = how

    def __repr__(self):
        return f"BlockPeak(peak={self.peak}, exact={self.exact}, upper={self.upper}, how={self.how!r})"


def block_peak(start: int, start_peak: int, end: int, end_peak: int, seen_max: int | None = None) -> BlockPeak:
    """The peak of a block from the device counters read around it, never resetting them.

    start, end: the counter (e.g. allocated bytes) at entry and exit;
    start_peak, end_peak: torch's running peak of it at entry and exit;
    seen_max: the largest value read at sample points inside the block (or None).

    * end_peak > start_peak: torch's peak rose inside the block, so the block's
      peak is end_peak, exactly (nothing before the block reached it).
    * end_peak == start_peak == start: the block began at the running peak and
      never passed it: its peak is start_peak, exactly.
    * end_peak == start_peak > start: the block stayed at or below an older peak;
      counters alone cannot tell how high it went: the largest value seen is a
      lower bound and start_peak an upper bound.
    * end_peak < start_peak: someone reset torch's peak inside the block; end_peak
      is a value reached inside the block, so it joins the lower bound.
    """
    seen = max(start, end) if seen_max is None else max(start, end, seen_max)
    if end_peak > start_peak:
        return BlockPeak(end_peak, True, end_peak, "peak rose in block")
    if end_peak < start_peak:
        return BlockPeak(max(seen, end_peak), False, None, "peak reset in block")
    if start_peak == start:
        return BlockPeak(start_peak, True, start_peak, "block started at peak")
    if seen >= start_peak:  # a sample reached the old peak: it is the maximum
        return BlockPeak(start_peak, True, start_peak, "sample reached peak")
    return BlockPeak(seen, False, start_peak, "below an older peak: sampled")


def combine_peaks(first: BlockPeak, then: BlockPeak) -> BlockPeak:
    """The peak of a block made of two parts (a BlockPeak each), e.g. around a reset of torch's peak.

    The block's peak is the larger of the parts' peaks: at least the larger lower
    bound; at most the larger upper bound (unknown if either is). Exact when both
    parts are, or when the larger lower bound reaches every upper bound.
    """
    low = max(first.peak, then.peak)
    if first.exact and then.exact:
        return BlockPeak(low, True, low, "exact across a memtorch.cuda.reset_peak()")
    upper = None if first.upper is None or then.upper is None else max(first.upper, then.upper)
    if upper is not None and low >= upper:
        return BlockPeak(low, True, low, "exact across a memtorch.cuda.reset_peak()")
    part = first if not first.exact else then
    return BlockPeak(low, False, upper, f"{part.how}, across a memtorch.cuda.reset_peak()")


def _debug_leftovers():
    """The CUDA Scopes still open (tests' autouse check: a finished test leaves none)."""
    return [f"open cuda.Scope on device {s.index}" for s in list(_open_scopes) if s._open]


class _Reading:
    """One read of a device's counters: allocated, its peak, reserved, its peak."""

    __slots__ = ("allocated", "peak", "reserved", "reserved_peak")

    def __init__(self, allocated, peak, reserved, reserved_peak):
        self.allocated = int(allocated)
        self.peak = int(peak)
        self.reserved = int(reserved)
        self.reserved_peak = int(reserved_peak)


def _counters(index):
    """(allocated, its peak, reserved, its peak) of one device; tests replace this with a fake.

    Reads torch's nested stats dict: torch.cuda.memory_stats() (and every
    torch.cuda.memory_allocated() call) flattens ~100 keys in Python, which is
    too slow for a read at every module hook.
    """
    st = _torch().cuda.memory.memory_stats_as_nested_dict(index)
    a = st.get("allocated_bytes", {}).get("all", {})
    r = st.get("reserved_bytes", {}).get("all", {})
    return a.get("current", 0), a.get("peak", 0), r.get("current", 0), r.get("peak", 0)


def _read(index):
    return _Reading(*_counters(index))


class Scope:
    """A CUDA counting scope with the same reading interface as memtorch.cpu.Scope.

    Open it with ``with`` (or __enter__) and feed it samples with ``see()``; at
    close() its peak comes from block_peak(). ``start``, ``current``, ``peak``,
    ``peak_above_start``, ``exact`` as in memtorch.cpu.Scope, plus
    ``reserved_peak`` and ``peak_upper``. Never resets torch's counters.
    """

    def __init__(self, device: _Device = None, timeline: bool = False, _index_checked: int | None = None) -> None:
        # _index_checked: a device index the caller has already checked (track()'s scopes: one
        # check per block, not one per phase and step)
        self.index = _index(device) if _index_checked is None else _index_checked
        self._timeline = bool(timeline)
        self._times = []
        self._bytes = []
        self._open = False
        self._closed = False
        self._seen = 0
        self._seen_reserved = 0
        self.start = self.peak = 0
        self.reserved_start = self.reserved_peak = 0
        self.exact = False
        self.reserved_exact = False
        self.peak_upper: int | None = None
        self.how = ""
        self._end = None
        self._r0 = None
        # the parts before each memtorch.cuda.reset_peak() in the block (BlockPeak), or None
        self._carry = None
        self._carry_reserved = None

    def __enter__(self) -> Scope:
        return self.open()

    def open(self, reading: Any = None) -> Scope:
        """Enter the scope, from ``reading`` (a _Reading shared with other scopes) or a fresh read."""
        if self._open or self._closed:
            raise RuntimeError("a Scope can be entered only once")
        import time

        r = _read(self.index) if reading is None else reading
        self._r0 = r
        self._open = True
        _open_scopes.add(self)
        self.start = self.peak = self._seen = r.allocated
        self.reserved_start = self.reserved_peak = self._seen_reserved = r.reserved
        if self._timeline:
            self._times.append(time.perf_counter_ns())
            self._bytes.append(r.allocated)
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def see(self, reading: Any = None) -> None:
        """Take one sample (or use ``reading``, a _Reading shared by several scopes)."""
        if not self._open:
            return
        r = _read(self.index) if reading is None else reading
        if r.allocated > self._seen:
            self._seen = r.allocated
        if r.reserved > self._seen_reserved:
            self._seen_reserved = r.reserved
        if self._timeline:
            import time

            self._times.append(time.perf_counter_ns())
            self._bytes.append(r.allocated)

    @property
    def current(self) -> int:
        if self._closed:
            return self._end
        return _read(self.index).allocated

    @property
    def peak_above_start(self) -> int:
        return self.peak - self.start

    def _parts(self, r):
        """(allocated, reserved) BlockPeaks of the part since the last reset (or the open), to ``r``."""
        r0 = self._r0
        p = block_peak(r0.allocated, r0.peak, r.allocated, r.peak, self._seen)
        rp = block_peak(r0.reserved, r0.reserved_peak, r.reserved, r.reserved_peak, self._seen_reserved)
        return p, rp

    def _so_far(self, reading=None):
        """The open scope's (allocated, reserved) peaks up to ``reading``: BlockPeaks, exact or bounded."""
        r = _read(self.index) if reading is None else reading
        self.see(r)
        p, rp = self._parts(r)
        if self._carry is not None:
            p, rp = combine_peaks(self._carry, p), combine_peaks(self._carry_reserved, rp)
        return p, rp

    def _fold(self, before, after):
        """memtorch.cuda.reset_peak() ran: ``before`` read just before it, ``after`` just after."""
        self.see(before)
        p, rp = self._parts(before)
        self._carry = p if self._carry is None else combine_peaks(self._carry, p)
        self._carry_reserved = rp if self._carry_reserved is None else combine_peaks(self._carry_reserved, rp)
        self._r0 = after  # the next part starts at the reset
        self._seen, self._seen_reserved = after.allocated, after.reserved

    def close(self, reading: Any = None) -> None:
        if not self._open:
            self._closed = True
            return
        r = _read(self.index) if reading is None else reading
        self.see(r)
        self._open = False
        self._closed = True
        _open_scopes.discard(self)
        self._end = r.allocated
        p, rp = self._parts(r)
        if self._carry is not None:
            p, rp = combine_peaks(self._carry, p), combine_peaks(self._carry_reserved, rp)
        self.peak, self.exact, self.peak_upper, self.how = p.peak, p.exact, p.upper, p.how
        self.reserved_peak, self.reserved_exact = rp.peak, rp.exact

    def timeline(self) -> tuple[np.ndarray, np.ndarray]:
        import numpy as np

        return np.asarray(self._times, dtype=np.int64), np.asarray(self._bytes, dtype=np.int64)
