"""Type stubs for memtorch._C (the C core): the walker, module setup, the counters and event log."""

from typing import Any, Callable, Optional, Sequence

import numpy as np
import numpy.typing as npt

# NumPy dtype of a walker row (src/rows.h mt_row), fields in this order:
#   numel i8          elements
#   nbytes i8         logical bytes: numel * element size (-1: past int64, see report.py)
#   storage u8        storage key: the c10::StorageImpl address (untyped_storage()._cdata);
#                     for an ndarray: id of the base array owning the memory (or of the
#                     foreign owner; or the tensor storage key for tensor.numpy())
#   storage_nbytes i8 bytes of the whole storage the occurrence keeps alive
#   tensor u8         id of the tensor met (of the whole tensor for sparse / quantized parts)
#   data u8           address of the storage's (or the array owner's) first byte, 0 if none/unknown
#   path i4           index into `paths`
#   module i4         index into `modules` (owning module), -1 for none
#   dtype i4          index into `dtypes` (torch dtypes without the "torch." prefix; numpy's str)
#   device i2         index into `devices` (str(torch.device); "cpu" for ndarrays)
#   category u1       0 parameter, 1 buffer, 2 gradient, 3 optimizer_state, 4 tensor, 5 array, 6 attribute
#   requires_grad ?
row_dtype: np.dtype

# The modules met by the walk, in pre-order: (paths, type names, links) where links is an
# int32 array (n, 2): each entry's parent index and the index of the entry the same module
# was first met under (a submodule registered under two names), -1 for none.
Modules = tuple[list[str], list[str], np.ndarray]

def _set_types(tensor: type, parameter: type, module: type, optimizer: type, /) -> None: ...
def _walker_setup(info: dict[str, Any], /) -> None:
    """info: 'dtypes' {torch.dtype: (name, itemsize, quantized, per_byte)}, 'layouts' (strided,
    sparse_coo, sparse_csr, sparse_csc, sparse_bsr, sparse_bsc), 'per_channel' (qschemes),
    'classify' (callable(type) -> 0 plain, 1 __tensor_flatten__, 2 check the storage has data),
    'dataclass_fields' (callable(type) -> names or None), 'script_tables' (callable(module)
    -> 3 dicts or None), 'iterables', 'namespaces' (tuples of types), 'masked_type' (type or
    None), 'module_skip' (frozenset). Checked here: a malformed table raises TypeError."""

def _walk(
    obj: Any, optimizer: Optional[Any], /
) -> tuple[np.ndarray, list[str], list[str], list[str], Modules]:
    """(rows, paths, dtypes, devices, modules): one row per tensor occurrence of obj
    (a module or any nest of containers), then of optimizer (a torch.optim.Optimizer or None)."""

# Counters and event log (src/counters.c, src/interpose_*.c, src/eventlog.c).
def counters_install() -> None: ...
def counters_uninstall() -> None: ...
def counters_installed() -> int: ...
def counters_probe() -> str | None: ...
def counters_mechanism() -> str | None: ...
def counters_current() -> int: ...
def counters_peak() -> int: ...
def counters_last_failure() -> tuple[int, int, int, int, int, int]: ...
def counters_reset_peak() -> None: ...
def counters_adopt(ptrs: Sequence[int], sizes: Sequence[int], /) -> int: ...  # storages made before counting began
def counters_stats() -> tuple[int, int, int, int, int, int, int, int]: ...
# live entries, lost, allocations, frees, unseen frees, unseen bytes, foreign frees, hook losses
def counters_check() -> int: ...  # slots found without our hooks (then patched again)
def counters_loss_info() -> tuple[int, str | None, str | None]: ...  # losses, object path, symbol
def counters_restarted() -> int: ...  # CLOCK_MONOTONIC ns of the first restart after a loss, 0: none
def counters_open_scopes() -> int: ...
def counters_rss() -> tuple[int, int]: ...  # resident set size, high-water mark (bytes; -1 unknown)
def scope_open(timeline: bool, /) -> tuple[int, int, int, int, int]: ...  # id, generation, start, time_ns, event index
def scope_read(id: int, generation: int, /) -> tuple[int, int, int, int, int, int]: ...
# start, current, peak, hook lost, other threads' bytes, other threads' allocations
def scope_close(id: int, generation: int, /) -> tuple[int, int, int, int, int, int, int, int]: ...
# start, end, peak, time_ns, event index, hook lost, other threads' bytes, other threads' allocations
def eventlog_read(
    first: int, last: int, /
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]: ...  # times_ns, bytes, dropped
# events (index, time, bytes, ptr, delta, kind, tag) as an array (raw: its bytes), dropped
def eventlog_read_all(first: int, last: int, raw: bool = ..., /) -> tuple[Any, int]: ...
def eventlog_mark(kind: int, number: int, tag: int, /) -> None: ...  # kind 1 enter, 2 exit, 3 tag
def counters_sizes(ptrs: Sequence[int], /) -> list[int]: ...  # counted size per address, -1 if none
def counters_serials(ptrs: Sequence[int], /) -> list[int]: ...  # allocation number per address, -1 if none
def eventlog_head() -> int: ...

# One pass over a block's log (src/replay.c).
def eventlog_replay(
    events: npt.NDArray[np.void], start: int, dropped: int, peak: int, token: int, nrows: int, queries: list[int], /
) -> tuple[int, int, int, bool, npt.NDArray[np.int64], int, npt.NDArray[np.int64], npt.NDArray[np.int64],
           list[tuple[int, int, int, int]]]: ...
# (base, k, at, reached, live (m, 5), freed_before, firsts (q, 3), modules (nrows, 5), phases)
def eventlog_names(
    live: npt.NDArray[np.int64], snapshots: list[tuple[int, dict[int, tuple[Any, ...]]]], queries: list[int],
    firsts: npt.NDArray[np.int64], k: int, sizes: dict[int, int], /,
) -> tuple[list[tuple[Any, ...] | None], list[tuple[tuple[Any, ...], int]]]: ...

# An estimate's allocation sequence replayed, as a sum or through the caching allocator's model (src/allocmodel.c).
def alloc_replay(
    events: npt.ArrayLike, sizes: npt.ArrayLike, cuda: bool, /
) -> tuple[npt.NDArray[np.int64], int, int, int | None, npt.NDArray[np.int64], int]: ...
# (curve, peak, at, reserved, live keys at the peak, their blocks' unsplit bytes)

# Storage addresses by name (src/names.c).
def names_walk(names: dict[int, tuple[Any, ...]], params: list[tuple[str, Any]], state: dict[Any, Any] | None,
               want: int, /) -> None: ...
# modules or weakrefs to them; None: one is dead
def modules_compiled(modules: Sequence[Any], wrapper: type | None, /) -> bool: ...
def modules_fingerprint(modules: Sequence[Any], /) -> int | None: ...

# Source lines of large allocations outside a block's phases (src/sites.c).
def eventlog_sites(
    first: int, last: int, /
) -> tuple[list[tuple[int, str | None, int, str | None, int]], int, int, int]: ...
# ([(index, file, line, function, bytes)], oldest index kept, min_bytes, missed)
def eventlog_sites_config(min_bytes: int, owner_mask: int, /) -> tuple[int, int]: ...  # previous values
def monotonic_ns() -> int: ...

# test-only
def _counters_slot_info(name: str, /) -> tuple[int, int, int, int]: ...  # slot now, saved, real, hook
def _counters_inject(address: int, size: int, /) -> None: ...
def _counters_bench(n: int, size: int, /) -> tuple[float, float]: ...  # ns direct, ns through the hooks
def _counters_set_target(name: str, /) -> None: ...  # a stand-in for libc10.so (tests)
def _counters_tool(action: str, /) -> int: ...  # 'chain'|'naive'|'libc'|'uninstall'|'calls' -> calls seen

class ModuleMarks:  # track()'s module and optimizer hooks in event-log mode (marks.c)
    depth: int
    forwards: int
    root: int  # id() of the model, or of the first of its modules whose forward ran (0: none)
    phase_code: int
    phases: tuple[tuple[int, float], tuple[int, float], tuple[int, float]]
    state_n: int
    params: list[tuple[str, Any]] | None
    last_inputs: list[int]
    closure_hook: Callable[[Any, Any], Any] | None
    in_backward: Callable[[], int] | None  # autograd's graph task id (-1: none): a call inside is a recomputation
    @property
    def recompute_totals(self) -> list[tuple[int, int, int]]: ...
    @property
    def pre_id(self) -> int | None: ...
    def __init__(
        self, ids: dict[int, int], root_id: int, tagbase: int, snapshots: list[Any],
        grad_enabled: Callable[[], bool], timeline: list[Any] | None = ..., shapes: bool = ...,
    ) -> None: ...
    def pre(self, module: Any, args: Any, kwargs: Any = ..., /) -> None: ...
    def post(self, module: Any, args: Any, output: Any, /) -> None: ...
    def opt_pre(self, optimizer: Any, args: Any, kwargs: Any, /) -> Any: ...
    def resume_optimizer(self) -> None: ...
    def opt_post(self, optimizer: Any, args: Any, kwargs: Any, /) -> None: ...
    def snapshot(self, names: dict[int, tuple[Any, ...]], /) -> None: ...
    def begin_phase(self, code: int, /) -> None: ...
    def end_phase(self) -> None: ...
    def set_model(self, ids: dict[int, int], root_id: int, /) -> None: ...
    def install(
        self, modules: list[Any] | None, opt_pre_hooks: dict[int, Any] | None, opt_post_hooks: dict[int, Any] | None,
        hooks: tuple[Any, Any, Any, Any], handle_class: Any, /,
    ) -> None: ...
    def uninstall(self) -> None: ...
    def top(self) -> int: ...
