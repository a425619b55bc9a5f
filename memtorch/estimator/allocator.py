"""The target GPU's rules for estimate(device="cuda"): which GPU, the kernels torch picks there, the
libraries' workspaces, and the CUDA caching allocator's rounding, replayed over the dry run's events.

The GPU (GPU, resolve_gpu): a name ("h100", "a100", "l4", ...) or a compute capability; by default
the machine's GPU if it has one, else an H100-class device (compute capability 9.0).

Libraries (torch's own sources, named where each rule is used):
- cuBLAS (aten/src/ATen/cuda/CublasHandlePool.cpp): each thread's cuBLAS handle gets a workspace
  through the caching allocator at its first GEMM, kept for the process: CUBLAS_WORKSPACE_CONFIG,
  by default 4096 KiB x 8 = 32 MiB on compute capability 9.0, 4096 KiB x 2 + 16 KiB x 8 elsewhere;
  cuBLASLt (addmm with a bias vector) a second one of CUBLASLT_WORKSPACE_SIZE (1024 KiB). The
  forward runs on the Python thread, the backward on the autograd engine's device thread: one each.
- SDPA (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): sdpa_backend() follows
  select_sdp_backend's checks (dtype, head dim, mask, causal shapes, compute capability) and its
  priority order (cuDNN attention first on 9.0 and 10.0 with cuDNN >= 9.9).
- cuDNN RNN: rnn_sizes() (reserve and workspace, see there).
- Reductions (aten/src/ATen/native/cuda/Reduce.cuh): reduce_staging() follows setReduceConfig; a
  reduction split across thread blocks takes a staging buffer and semaphores from the caching
  allocator for the kernel's duration, sized from the GPU's SM count.

The rules (PyTorch's c10/cuda/CUDACachingAllocator.cpp, default settings):
- every request is rounded up to a multiple of 512 bytes (512 at least); a
  request of 0 bytes takes no block;
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB;
  larger ones from the large pool: a 20 MiB segment for requests under 10 MiB,
  a segment of the request rounded up to 2 MiB from 10 MiB on;
- a request takes the smallest free block of its pool that fits (best fit), the
  lowest address among equal sizes (BlockComparatorSize); the model lays the
  segments out in the order they were reserved (cudaMalloc's addresses are the
  driver's: an assumption);
  the block is split when what remains is at least 512 bytes (small pool) or
  more than 1 MiB (large pool), otherwise the whole block is handed out and
  counted as allocated;
- a freed block merges with free neighbours of its segment; segments are kept
  (reserved) until empty_cache(), which a training step does not call.

memory_allocated() counts the blocks handed out, memory_reserved() the
segments.
"""

import bisect
import os
import re

__all__ = ["GPU", "GPUS", "GPU_MEMORY", "resolve_gpu", "sdpa_backend", "rnn_sizes", "reduce_staging", "round_size", "segment_size", "CachingAllocator", "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER",
           "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE"]  # fmt: skip

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


# name -> (full name, compute capability, cuDNN version assumed); the cuDNN of torch's CUDA wheels
GPUS = {
    "h100": ("NVIDIA H100", (9, 0)),
    "h200": ("NVIDIA H200", (9, 0)),
    "gh200": ("NVIDIA GH200", (9, 0)),
    "b200": ("NVIDIA B200", (10, 0)),
    "a100": ("NVIDIA A100", (8, 0)),
    "a10": ("NVIDIA A10", (8, 6)),
    "a10g": ("NVIDIA A10G", (8, 6)),
    "rtx4090": ("NVIDIA GeForce RTX 4090", (8, 9)),
    "l4": ("NVIDIA L4", (8, 9)),
    "l40s": ("NVIDIA L40S", (8, 9)),
    "v100": ("NVIDIA V100", (7, 0)),
    "t4": ("NVIDIA T4", (7, 5)),
}
DEFAULT_GPU = "h100"
# name -> streaming multiprocessors (the SXM parts, NVIDIA's specifications): Reduce.cuh sizes its
# grid from them
SMS = {"h100": 132, "h200": 132, "gh200": 132, "b200": 148, "a100": 108, "a10": 72, "a10g": 80, "l4": 58,
       "l40s": 142, "v100": 80, "t4": 40}
# name -> (bytes, name) of the board's memory as NVIDIA specifies it ("80GB" of HBM3 on an H100: the
# memory chips' 80 GiB), for fit(gpu=...) without device_memory=; names whose boards come in several sizes
# carry the size. torch's total_memory reports a little less (what the driver keeps): pass device_memory=
# torch.cuda.get_device_properties(0).total_memory for the exact figure.
GPU_MEMORY = {
    "h100": (80 << 30, "H100 80GB"), "h200": (141 << 30, "H200 141GB"), "a100-40gb": (40 << 30, "A100 40GB"),
    "a100-80gb": (80 << 30, "A100 80GB"), "a10": (24 << 30, "A10 24GB"), "a10g": (24 << 30, "A10G 24GB"),
    "l4": (24 << 30, "L4 24GB"), "l40s": (48 << 30, "L40S 48GB"), "rtx4090": (24 << 30, "RTX 4090 24GB"),
    "t4": (16 << 30, "T4 16GB"), "v100-16gb": (16 << 30, "V100 16GB"), "v100-32gb": (32 << 30, "V100 32GB"),
}  # fmt: skip
CUDNN_VERSION = 91900  # cuDNN of torch 2.11+ CUDA wheels (measured: 9.19 on the H200)


class GPU:
    """The device modelled: name, compute capability (major, minor), cuDNN version, and the
    workspace sizes torch's handles get there."""

    def __init__(self, name, capability, cudnn=CUDNN_VERSION, source="given", torch_version=None, sms=None):
        self.name = name
        # multiProcessorCount; a GPU given by its compute capability only: an H100's, the default device
        self.sms = int(sms) if sms else SMS[DEFAULT_GPU]
        self.capability = (int(capability[0]), int(capability[1]))
        self.cudnn = int(cudnn)
        self.source = source  # "given", "this machine", "default"
        # (major, minor) of the torch whose kernel choices are modelled: this process's torch by default
        self.torch_version = tuple(torch_version) if torch_version is not None else _this_torch()

    @property
    def threads_per_sm(self):
        """maxThreadsPerMultiProcessor (CUDA's compute capability table)."""
        if self.capability in ((7, 5),):
            return 1024
        if self.capability in ((8, 6), (8, 9)) or self.capability[0] == 12:
            return 1536
        return 2048

    @property
    def cublas_workspace(self):
        """Bytes of a cuBLAS handle's workspace (CublasHandlePool.cpp parseChosenWorkspaceSize)."""
        val = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if val:
            found = re.findall(r":([0-9]+):([0-9]+)", val)
            if found:
                return sum(int(a) * 1024 * int(b) for a, b in found)
        return 4096 * 8 * 1024 if self.capability == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8

    @property
    def cublaslt_workspace(self):
        """Bytes of a cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE KiB, 1024 by default), at most the
        cuBLAS one (getCUDABlasLtWorkspaceSize)."""
        try:
            kib = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024"))
        except ValueError:
            kib = 1024
        return min(kib * 1024, self.cublas_workspace)

    def describe(self):
        major, minor = self.capability
        return f"{self.name} (compute capability {major}.{minor}, {self.source})"

    def __repr__(self):
        return f"GPU({self.name!r}, {self.capability})"


def _this_torch():
    """(major, minor) of the torch imported here ("2.13.0+cpu" -> (2, 13))."""
    import torch

    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def resolve_gpu(gpu=None):
    """A GPU from a name ("h100"), a compute capability ("9.0", (9, 0), 9.0) or None (this machine's
    GPU when torch sees one, else an H100-class device). Raises ValueError for anything else."""
    if isinstance(gpu, GPU):
        return gpu
    if gpu is None:
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                cudnn = torch.backends.cudnn.version() or CUDNN_VERSION
                sms = torch.cuda.get_device_properties().multi_processor_count
                return GPU(torch.cuda.get_device_name(), (major, minor), cudnn, "this machine", sms=sms)
        except Exception:  # noqa: BLE001 - a broken CUDA setup: model the default device
            pass
        name, cap = GPUS[DEFAULT_GPU]
        return GPU(name, cap, source="default: no GPU here", sms=SMS[DEFAULT_GPU])
    if isinstance(gpu, str):
        key = gpu.strip().lower().replace("nvidia", "").replace(" ", "").replace("-", "")
        sized = re.fullmatch(r"(.+?)-(\d+)gb", gpu.strip().lower().replace("nvidia", "").replace(" ", ""))
        if key not in GPUS and sized:  # a name with its board's memory ("a100-80gb", GPU_MEMORY's names)
            key = sized.group(1).replace("-", "")
        if key in GPUS:
            name, cap = GPUS[key]
            return GPU(name, cap, sms=SMS.get(key))
        m = re.fullmatch(r"(?:sm_?)?(\d+)\.(\d)", key) or re.fullmatch(r"sm_?(\d)(\d)", key)
        if m:
            return GPU(f"compute capability {m.group(1)}.{m.group(2)}", (int(m.group(1)), int(m.group(2))))
    elif isinstance(gpu, (tuple, list)) and len(gpu) == 2 and all(isinstance(v, int) for v in gpu):
        return GPU(f"compute capability {gpu[0]}.{gpu[1]}", tuple(gpu))
    elif isinstance(gpu, float) and not isinstance(gpu, bool):
        major, minor = str(gpu).split(".")
        return GPU(f"compute capability {major}.{minor[:1]}", (int(major), int(minor[:1])))
    raise ValueError(
        f"unknown gpu {gpu!r}: a name ({', '.join(sorted(GPUS))}), a compute capability such as "
        "'9.0' or (9, 0), or None for this machine's GPU"
    )


# ---------------------------------------------------------------------------
# SDPA: the backend torch's select_sdp_backend picks on this GPU (sdp_utils.cpp)


def _sdpa_flash_ok(q, k, v, has_mask, dropout, is_causal, gpu, needs_grad):
    if has_mask or q.dtype not in _half() or gpu.capability < (8, 0) or gpu.capability > (12, 1):
        return False
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1] and d <= 256):
        return False
    sm86_89 = (8, 6) <= gpu.capability <= (8, 9) or (12, 0) <= gpu.capability <= (12, 1)
    if needs_grad and sm86_89 and ((192 < d <= 224) or (d > 224 and dropout > 0)):
        return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    return k.shape[1] != 0 and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] % k.shape[1] == 0


def _sdpa_efficient_ok(q, k, v, gpu, enable_gqa):
    if gpu.capability < (5, 0) or gpu.capability > (12, 1):
        return False
    allowed = _half() + (_float(),) if gpu.capability >= (8, 0) else (_fp16(), _float())
    if q.dtype not in allowed:
        return False
    # minimum_gemm_alignment: 128 bits with tensor cores (half types from 7.0), else 4 elements
    align = 8 if q.dtype in _half() and gpu.capability >= (7, 0) else 4
    d, dv = q.shape[-1], v.shape[-1]
    if not (d == k.shape[-1] and d % align == 0 and d > 0 and dv % align == 0 and dv > 0):
        return False
    return q.shape[1] == k.shape[1] == v.shape[1]  # no grouped-query attention


def _cudnn_mask_ok(q, k, mask):
    """torch's attn-mask rule for cuDNN attention (check_attn_mask_shape): no mask, or one that
    needs no gradient (Swin's learned relative-position bias does: not cuDNN), 2-D or 4-D, each of
    its dimensions the one it broadcasts against (batch, heads, query and key lengths) or 1."""
    if mask is None:
        return True
    if mask.requires_grad or mask.dim() not in (2, 4):
        return False
    want = (q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])[-mask.dim():]
    return all(m in (w, 1) for m, w in zip(mask.shape, want))


def _sdpa_cudnn_ok(q, k, v, dropout, gpu, mask=None):
    if q.dtype not in _half() or not ((8, 0) <= gpu.capability <= (12, 1)) or gpu.cudnn < 90000:
        return False
    if not _cudnn_mask_ok(q, k, mask):
        return False
    if dropout > 0 and 91100 < gpu.cudnn < 91400:
        return False
    # torch 2.12+ (PR 174245): some cuDNN kernels round the dropout probability to 1/16, so torch sends a
    # dropout that is not a multiple of 1/16 (0.1, ...) elsewhere; torch 2.11 (the H200's) still ran cuDNN
    if dropout > 0 and gpu.torch_version >= (2, 12) and (dropout * 16) % 1 != 0:
        return False
    limit = 256 if gpu.cudnn >= 91000 and gpu.capability == (9, 0) else 128
    d, dv, s_q, s_k = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    if d > limit or dv > limit or d % 8 or dv % 8 or s_k == 1 or (s_q == 1 and dropout > 0):
        return False
    return q.shape[0] == k.shape[0] == v.shape[0]


def _half():
    import torch

    return (torch.float16, torch.bfloat16)


def _fp16():
    import torch

    return torch.float16


def _float():
    import torch

    return torch.float32


def sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, gpu, enable_gqa=False):
    """'cudnn', 'flash', 'efficient' or 'math': the kernel torch's select_sdp_backend runs for these
    (dense) arguments on ``gpu``, with every backend enabled (torch's default)."""
    if not (q.dim() == k.dim() == v.dim() == 4) or 0 in (q.shape[-2], k.shape[-2]):
        return "math"
    needs_grad = any(t.requires_grad for t in (q, k, v))
    if any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (q, k, v)):
        return "math"
    order = ["flash", "efficient", "math", "cudnn"]
    if gpu.cudnn >= 90900 and gpu.capability in ((9, 0), (10, 0)) and os.environ.get(
        "TORCH_CUDNN_SDPA_PREFERRED", "1"
    ).lower() not in ("0", "false", "off", "no"):
        order = ["cudnn", "flash", "efficient", "math"]
    for b in order:
        if b == "cudnn" and _sdpa_cudnn_ok(q, k, v, dropout_p, gpu, attn_mask):
            return b
        if b == "flash" and _sdpa_flash_ok(q, k, v, attn_mask is not None, dropout_p, is_causal, gpu, needs_grad):
            return b
        if b == "efficient" and not enable_gqa and _sdpa_efficient_ok(q, k, v, gpu, enable_gqa):
            return b
        if b == "math":
            return b
    return "math"


# ---------------------------------------------------------------------------
# cuDNN RNN


def rnn_sizes(mode, seq, batch, input_size, hidden, layers, directions, elem):
    """(reserve bytes, workspace bytes) cuDNN 9 gives a training RNN (cudnnGetRNNTempSpaceSizes).

    cuDNN does not document these sizes. The layout below is read off the one measured case
    (H200, cuDNN 9.19, LSTM 512 -> 1024, 2 layers, 128 steps, batch 32, float32: reserve
    184,549,632 B, workspace 170,394,112 B, tests/data/h200): the reserve keeps, per step and
    batch row, every layer's gate activations and cell state (LSTM: 4H + H) plus the hidden
    output of every layer but the last (that one is the output itself), and 256 B; the workspace
    holds the gates of every layer for seq + 2 steps, and 512 B. For GRU (3 gates) and plain RNNs
    (1) the gate count is swapped in; those are not measured.
    """
    gates = {"LSTM": 4, "GRU": 3}.get(mode, 1)
    cell = 1 if mode == "LSTM" else 0
    per_row = layers * directions * (gates + cell) * hidden + (layers - 1) * directions * hidden
    reserve = seq * batch * per_row * elem + 256
    workspace = layers * directions * (gates + cell) * hidden * (seq + 2) * batch * elem + 512
    return reserve, workspace


def _last_pow2(n):
    """Reduce.cuh's last_pow2: the largest power of two at most n, 1 at least."""
    return max(1, 1 << (int(n).bit_length() - 1)) if n > 0 else 1


def reduce_staging(shape, strides, dims, acc_size, gpu, offset=0):
    """(staging buffer, semaphores) bytes a CUDA reduction of a tensor takes for the kernel's duration;
    (0, 0) when it is not split across thread blocks.

    Follows setReduceConfig (aten/src/ATen/native/cuda/Reduce.cuh) for one reduction of the input
    ``shape``/``strides`` (elements, ``offset`` its storage offset) over ``dims``, accumulated in
    ``acc_size``-byte values: TensorIterator drops size-1 dimensions, puts the reduced ones first,
    each group by stride, and merges adjacent ones; the block's width goes along the faster of the
    two groups, vectorized by 4 along it when its stride is 1; the input is split across warps when
    each thread would sum at least min(16 x block height, 256) values, and across blocks when it would
    still sum 256 or more and the outputs' blocks leave SMs idle (ctas_per_output, from the SM count
    and the threads an SM holds). Then launch_reduce_kernel allocates global_memory_size() and
    semaphore_size() bytes: acc_size x outputs x ctas_per_output, x block width x output vector when
    the block does not reduce along x; an int per output block.
    """
    def groups(reduced):
        dims_ = enumerate(zip(shape, strides))
        group = sorted((st, n) for i, (n, st) in dims_ if n != 1 and (i in dims) == reduced)
        merged = []
        for st, n in group:
            if merged and merged[-1][0] * merged[-1][1] == st:
                merged[-1] = (merged[-1][0], merged[-1][1] * n)
            else:
                merged.append((st, n))
        return merged

    red, kept = groups(True), groups(False)
    inputs, outputs = 1, 1
    for _, n in red:
        inputs *= n
    for _, n in kept:
        outputs *= n
    if not red or inputs * outputs == 0:
        return 0, 0
    fastest = not kept or red[0][0] < kept[0][0]  # reduction_on_fastest_striding_dimension
    dim0, dim1 = (inputs, outputs) if fastest else (outputs, inputs)
    stride = red[0][0] if fastest else kept[0][0]
    out_vec = 1
    if stride == 1:
        if fastest and dim0 > 128 and len(red) == 1:
            dim0 //= 4  # vectorize along the input: input_vec_size is vt0, 4
        elif not fastest:
            # get_output_vec_size: 4, halved until it divides the input's offset, the outputs' extent
            # along the block and every other stride of the input
            out_vec = 4
            while any(v % out_vec for v in [offset, kept[0][1]] + [st for st, _ in red + kept[1:]]):
                out_vec //= 2
    dim0 //= out_vec
    # set_block_dimension
    most = 512 // out_vec
    d0 = most if dim0 >= most else _last_pow2(dim0)
    d1 = most if dim1 >= most else _last_pow2(dim1)
    width = min(d0, 32)
    height = min(d1, most // width)
    width = min(d0, most // height)
    threads = width * height
    step_in = step_out = 1
    if fastest:
        step_in *= width
    else:
        step_out *= width
    split_warps = -(-inputs // step_in) >= min(height * 16, 256)
    if split_warps:
        step_in *= height
    else:
        step_out *= height
    per_thread = -(-inputs // step_in)
    grid = -(-(outputs // out_vec) // step_out)
    target = gpu.sms * (gpu.threads_per_sm // threads)
    if not split_warps or per_thread < 256 or grid > target:
        return 0, 0
    ctas = max(min(-(-target // grid), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return 0, 0
    size = acc_size * outputs * ctas
    if not fastest:
        size *= width * out_vec
    return size, 4 * grid


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
    __slots__ = ("size", "free", "prev", "next", "small", "addr")

    def __init__(self, size, small, addr=0):
        self.size = size
        self.free = True
        self.prev = self.next = None
        self.small = small
        self.addr = addr


class CachingAllocator:
    """A model of the caching allocator: allocated and reserved bytes after each event."""

    def __init__(self):
        self.allocated = 0
        self.reserved = 0
        # small? -> sorted [(size, address, block)]; addresses are unique (segments laid out one after
        # another, never given back), so equal sizes order by address and blocks are never compared
        self._free = {True: [], False: []}
        self._blocks = {}  # key -> block handed out
        # key -> bytes of its block beyond its rounded request: a free block too little larger to be split
        # (a large block's remainder of 1 MiB or less, a small one's under 512 B) is handed out whole, and
        # allocated counts all of it; set at malloc, kept after the free (keys are given out once)
        self.unsplit = {}

    def _insert(self, b):
        bisect.insort(self._free[b.small], (b.size, b.addr, b))

    def _remove(self, b):
        lst = self._free[b.small]
        i = bisect.bisect_left(lst, (b.size, b.addr))
        if i == len(lst) or lst[i][2] is not b:
            raise AssertionError("free block not in its pool")
        del lst[i]

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
            block = _Block(seg, small, self.reserved)
            self.reserved += seg
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_SIZE):
            rest = _Block(remaining, small, block.addr + size)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        block.free = False
        self.allocated += block.size
        self._blocks[key] = block
        if block.size > size:
            self.unsplit[key] = block.size - size

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
                    block.addr = nb.addr
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
