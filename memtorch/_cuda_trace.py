"""Who held the bytes at a block's peak on CUDA: the caching allocator's own trace, replayed.

On CUDA the bytes are torch's caching allocator's, not memtorch's: the C event
log (memtorch.peak) never sees them. torch keeps its own history of every
allocation and free when ``torch.cuda.memory._record_memory_history`` is on
(``_snapshot()["device_traces"]``: action, address, size, time). A track()
block that names owners turns that history on for its duration (``Recording``:
no Python stacks, the cheapest setting; the user's own recording is reused
and left on, and the state before the block is restored exactly: torch clears
the history when recording is turned off), reads it once when it closes, and
the replay (``replay``) runs when the report is first read:

* **Block sizes.** A trace entry carries the *requested* size; torch's
  counters count the allocator's *block*, rounded up to 512 B and, in the
  large pool (blocks over 1 MiB), the whole free block when what would be left
  is 1 MiB or less (the allocator does not split it). The replay keeps the
  layout of every segment (segment_alloc/free, which blocks are taken) and so
  sizes each block as the allocator did: its figure equals
  ``max_memory_allocated()`` on the shipped H200 traces, to the byte.
* **Owners.** The block's hooks keep marks with wall-clock times (module
  forward entered/left, phase begun/ended) and names walks (parameters,
  buffers, gradients, optimizer state, the batch, by storage address); trace
  times are the same clock (CLOCK_REALTIME, microseconds). Each allocation
  live at the peak is named by address when a walk saw it alive, else filed
  under the module whose forward or the phase that was running when it was
  made, with memtorch.peak's vocabulary (``attribute_cuda``; this module reads
  peak's words, peak never imports it). A trace time is a whole microsecond:
  an allocation made within 1 µs of a mark is filed by the middle of its
  microsecond and said in a note.
* cuBLAS keeps one workspace per handle (one per thread: the forward's and
  the autograd engine's) for the life of the process; an unnamed allocation of
  exactly its size, made in the block and never freed, is named as such.

What it does not see: memory outside torch's allocator (the CUDA context,
NCCL's buffers), and with ``expandable_segments`` or ``max_split_size_mb`` set
the block sizes are the requested ones rounded (a note says so).
"""

import bisect
import os
import time
from . import units
from .reports.peak import AtPeak, Owner
from ._torch import torch as _load_torch  # the loader only: torch itself loads on first call

__all__ = ["Recording", "Replayed", "replay", "tags_over_time", "cublas_workspace_bytes",
           "cublaslt_workspace_bytes", "workspaces", "attribute_cuda", "MAX_ENTRIES"]

MAX_ENTRIES = 1 << 19  # a block's own history: the latest 524,288 entries (a few hundred bytes each)

KIB, MIB = 1024, 1024 * 1024
K_MIN_BLOCK = 512  # every block is rounded up to 512 B
K_SMALL = MIB  # blocks up to 1 MiB come from the small pool (2 MiB segments)

# marks kept by track()'s hooks: (time.time_ns(), kind, number)
ENTER, EXIT, PHASE, PHASE_END = 1, 2, 3, 4


def _torch():
    return _load_torch()


# --- recording ---------------------------------------------------------------

_lock = None
_ours = [0]  # open Recordings that turned the history on (the first turns it on, the last off)


def _history_on(torch):
    f = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(f()) if f is not None else False


class Recording:
    """The allocator's history for one block: ``start()`` when it opens, ``stop()`` when it
    closes (returns the snapshot, or None); never leaves the history in another state than
    it found it. ``marks`` and ``names`` are filled by the block's hooks."""

    __slots__ = ("index", "own", "t0_ns", "t1_ns", "marks", "names", "why_not", "params", "state_n", "_open")

    def __init__(self, index):
        self.index = index
        self.own = False
        self.t0_ns = self.t1_ns = 0
        self.marks = []  # (ns, kind, number)
        self.names = []  # (ns, {address: (name, kind, None, shape, dtype)})
        self.why_not = None
        self.params = None  # the parameters walked: (name, weakref, name of its gradient)
        self.state_n = 0  # entries of the optimizer's state when its names were last read
        self._open = False

    @classmethod
    def maybe_start(cls, index):
        """A started Recording, or None where this torch has no allocator history to record
        (at_peak is then None; the block itself is unchanged)."""
        torch = _torch()
        if not hasattr(torch._C, "_cuda_record_memory_history") or not hasattr(torch.cuda.memory, "_snapshot"):
            return None  # a torch built without CUDA (tests fake the counters only)
        try:
            return cls(index).start()
        except (RuntimeError, AttributeError, TypeError):  # no history here: no at_peak, same block
            return None

    def pending(self, start, peak, exact, mod_rows, caveats):
        """Stop (reading the history) and return what computes the block's AtPeak when the
        report is first read, or None when the history could not be read (said in caveats).
        start, peak, exact: the block's counters; mod_rows: its ModuleStats rows."""
        import functools

        try:
            snap = self.stop()
        except Exception as e:  # a torch that cannot read its history: no at_peak, the block is kept
            caveats.append(f"who held the bytes at the peak is not known: reading the allocator's history failed ({e})")
            return None
        if snap is None:
            caveats.append(f"who held the bytes at the peak is not known: {self.why_not}")
            return None
        return functools.partial(
            _at_peak, snap, self.index, start, peak, exact, self.marks, self.names, mod_rows,
            self.t0_ns if not self.own else None, self.t1_ns, self.own, caveats,
        )  # fmt: skip

    def start(self):
        """Turn the history on unless it is on already (then it is the user's: reused, left on)."""
        global _lock
        torch = _torch()
        if _lock is None:
            import threading

            _lock = threading.Lock()
        with _lock:
            if _history_on(torch):
                self.own = False
            else:
                # no stacks (context=None): the cheapest recording; the replay needs none
                torch.cuda.memory._record_memory_history(
                    "all", context=None, stacks="python", max_entries=MAX_ENTRIES
                )
                _ours[0] += 1
                self.own = True
        self._open = True
        self.t0_ns = time.time_ns()
        return self

    def stop(self, read=True):
        """Read the history (``read``) and restore the state found at start(). Returns
        torch.cuda.memory._snapshot()'s dict, or None (not read, or the history was turned
        off inside the block: ``why_not`` says so). Never raises for a stopped Recording."""
        if not self._open:
            return None
        self._open = False
        self.t1_ns = time.time_ns()
        torch = _torch()
        snap = None
        try:
            if read:
                if _history_on(torch):
                    snap = torch.cuda.memory._snapshot()
                else:
                    self.why_not = "the allocator's history was turned off inside the block"
        finally:
            if self.own:
                with _lock:
                    _ours[0] -= 1
                    if _ours[0] == 0 and _history_on(torch):
                        torch.cuda.memory._record_memory_history(None)  # off: torch clears the history too
        return snap


def _at_peak(snap, index, start, peak, exact, marks, names, mod_rows, t0_ns, t1_ns, own, caveats):
    """The deferred part of a CUDA block's end: its AtPeak (attribute_cuda)."""
    try:
        cap = tuple(_torch().cuda.get_device_capability(index))
    except Exception:  # no device left to ask (the report read later): the default workspace size
        cap = None
    rows = [(r.name, r.type) for r in mod_rows]
    at = attribute_cuda(
        snap, index, start, peak, exact, marks, names, rows, t0_ns, t1_ns, workspaces(cap), own,
    )  # fmt: skip
    at.notes += [c for c in caveats if c not in at.notes]
    return at


def input_names(args, tensor_type):
    """{address: (name, "input", None, shape, dtype)} of the tensors among a forward's
    arguments (the batch): "input", or "input j" when there are several arguments."""
    out = {}
    n = len(args) if isinstance(args, tuple) else 0
    for j in range(min(n, 64)):
        a = args[j]
        if isinstance(a, tensor_type):
            out.setdefault(a.untyped_storage().data_ptr(), ("input" if n == 1 else f"input {j}", "input", None,
                                                            tuple(a.shape), str(a.dtype).replace("torch.", "")))
    return out


def cublas_workspace_bytes(capability=None, env=None):
    """The bytes of one cuBLAS workspace as torch sizes it: CUBLAS_WORKSPACE_CONFIG
    (``:SIZE_KiB:COUNT`` pairs), else 32 MiB on compute capability 9.x and 10.x
    (measured on an H200: 33,554,432 B), else 4096 KiB x 2 + 16 KiB x 8."""
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if env is None else env
    if env:
        total, parts = 0, [p for p in env.split(":") if p]
        try:
            for size, count in zip(parts[0::2], parts[1::2]):
                total += int(size) * KIB * int(count)
            if total:
                return total
        except ValueError:
            pass
    if capability is not None and capability[0] in (9, 10):
        return 4096 * KIB * 8
    return 4096 * KIB * 2 + 16 * KIB * 8


def cublaslt_workspace_bytes(env=None):
    """The bytes of cuBLASLt's workspace as torch sizes it: CUBLASLT_WORKSPACE_SIZE (KiB),
    else 1 MiB (on the H200 the first ``F.linear`` with a bias allocates it beside the
    cuBLAS workspace)."""
    env = os.environ.get("CUBLASLT_WORKSPACE_SIZE") if env is None else env
    try:
        return int(env) * KIB if env else MIB
    except ValueError:
        return MIB


def workspaces(capability=None):
    """{bytes: owner name} of the workspaces cuBLAS keeps for the process (peak.py's names)."""
    # lazy: peak loads _C and NumPy; only this path needs it (importing _cuda_trace stays cheap)
    from .peak import WORKSPACE, WORKSPACE_LT

    out = {cublaslt_workspace_bytes(): WORKSPACE_LT}
    out[cublas_workspace_bytes(capability)] = WORKSPACE
    return out


# --- the replay --------------------------------------------------------------


def _divisions(settings):
    d = (settings or {}).get("roundup_power2_divisions") or {}
    try:
        return [int(d[k]) for k in sorted(d, key=int)]
    except (TypeError, ValueError):
        return []


def round_size(size, divisions=()):
    """The allocator's block size for a request (CUDACachingAllocator's round_size)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    div = 0
    if divisions:
        log = size.bit_length() - 1
        start = MIB.bit_length() - 1  # the intervals start at 1 MiB
        div = divisions[0 if log < start else min(log - start, len(divisions) - 1)]
    if div > 1 and size > K_MIN_BLOCK * div:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (div.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


class Replayed:
    """What the replay of a device's trace found (all sizes are the allocator's blocks).

    peak_delta: the highest running total in the window above its start; peak_at: the trace
    index of the allocation that reached it (-1: nothing rose above the start); end_delta:
    the total at the window's end above its start; live: [(address, bytes, alloc time_us,
    free time_us or None)] allocated in the window and live at peak_at; pre_live: the same
    for blocks from before the window (alloc time None) whose size is known; estimated:
    bytes freed in the window whose block size was only rounded (no layout to size it);
    events: allocations and frees in the window; notes."""

    __slots__ = ("peak_delta", "peak_at", "end_delta", "live", "pre_live", "estimated", "events", "notes", "kept")

    def __init__(self):
        self.peak_delta = self.end_delta = self.estimated = self.events = 0
        self.peak_at = -1
        self.live = []
        self.pre_live = []
        self.kept = set()  # addresses allocated in the window and never freed in it
        self.notes = []


def _blocks_at_end(segs):
    """{address: block dict} of every block of the snapshot's segments."""
    out = {}
    for s in segs:
        a = s["address"]
        for b in s.get("blocks") or ():
            out[a] = b
            a += b["size"]
    return out


_TAKEN = ("active_allocated", "active_pending_free", "active_awaiting_free")


def replay(snapshot, device=0, t0_us=None, t1_us=None):
    """Replay the history of ``device`` in ``snapshot`` (torch.cuda.memory._snapshot()'s
    dict) over the window [t0_us, t1_us] (None: the whole trace): the live set at the
    window's highest point, each block sized as the caching allocator sized it."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    settings = snapshot.get("allocator_settings") or {}
    divs = _divisions(settings)
    expandable = bool(settings.get("expandable_segments"))
    max_split = settings.get("max_split_size", -1)
    max_split = None if max_split is None or max_split < 0 else max_split
    out = Replayed()
    if expandable:
        out.notes.append("expandable segments are on: block sizes are the requests rounded to 512 B")
    segs_end = [s for s in snapshot.get("segments") or () if s.get("device", device) == device]
    end_blocks = _blocks_at_end(segs_end)

    # the segments that existed when the trace began: those at the end, undone backwards
    active = {s["address"]: s["total_size"] for s in segs_end}
    for e in reversed(trace):
        if e["action"] == "segment_alloc":
            active.pop(e["addr"], None)
        elif e["action"] == "segment_free":
            active[e["addr"]] = e["size"]
    seg_starts = sorted(active)

    # blocks taken when the trace began: allocated at the end and never allocated in the
    # trace (their sizes exact), and those freed in the trace before any allocation there
    alloc_addrs = {e["addr"] for e in trace if e["action"] == "alloc"}
    occ = {a: b["size"] for a, b in end_blocks.items() if b.get("state") in _TAKEN and a not in alloc_addrs}
    known = set(occ)  # blocks from before the window whose size is not a guess
    seen = set()
    for e in trace:
        if e["action"] == "alloc":
            seen.add(e["addr"])
        elif e["action"] == "free_requested" and e["addr"] not in seen and e["addr"] not in occ:
            occ[e["addr"]] = round_size(e["size"], divs)
            seen.add(e["addr"])
    starts = sorted(occ)
    occ0 = dict(occ)

    def seg_end(a):
        i = bisect.bisect_right(seg_starts, a) - 1
        if i >= 0 and a < seg_starts[i] + active[seg_starts[i]]:
            return seg_starts[i] + active[seg_starts[i]]
        return None

    # pass 1: the size of every block (the allocator's layout), the running total, the peak
    n = len(trace)
    sizes = [0] * n  # bytes of each alloc / free_requested event
    window = [False] * n
    pre = dict(occ)  # blocks from before the window, live: address -> bytes
    taken = {}  # address -> bytes of blocks allocated in the trace and not yet freed
    in_window = t0_us is None
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        act = e["action"]
        t = e.get("time_us", 0)
        if not in_window and t >= t0_us:
            in_window = True
        if t1_us is not None and t > t1_us:
            break
        window[i] = in_window
        if act == "segment_alloc":
            active[e["addr"]] = e["size"]
            bisect.insort(seg_starts, e["addr"])
        elif act == "segment_free":
            if active.pop(e["addr"], None) is not None:
                del seg_starts[bisect.bisect_left(seg_starts, e["addr"])]
        elif act == "alloc":
            a = e["addr"]
            b = r = round_size(e["size"], divs)
            if r > K_SMALL and not expandable:
                end = seg_end(a)
                if end is not None:
                    j = bisect.bisect_right(starts, a)
                    extent = (starts[j] if j < len(starts) and starts[j] < end else end) - a
                    if extent >= r and (extent - r <= K_SMALL or (max_split is not None and extent >= max_split)):
                        b = extent  # what would be left is too small to split off: the whole block
            sizes[i] = b
            occ[a] = b
            bisect.insort(starts, a)
            if in_window:
                taken[a] = b
                cur += b
                if cur > peak:
                    peak, peak_at = cur, i
            else:
                pre[a] = b
                known.add(a)
        elif act == "free_requested":
            a = e["addr"]
            if a in taken:
                b = taken.pop(a)
            elif a in pre:
                b = pre.pop(a)
                if a not in known and in_window:
                    out.estimated += b
            else:
                b = round_size(e["size"], divs)
                if in_window:
                    out.estimated += b
            sizes[i] = b
            if in_window:
                cur -= b
        elif act == "free_completed":
            a = e["addr"]
            if occ.pop(a, None) is not None:
                j = bisect.bisect_left(starts, a)
                if j < len(starts) and starts[j] == a:
                    del starts[j]
        if in_window and act in ("alloc", "free_requested"):
            out.events += 1
    out.peak_delta, out.peak_at, out.end_delta = peak, peak_at, cur
    out.kept = set(taken)

    # pass 2: the live set at the peak, then when each of its blocks was freed
    live = {}  # address -> (bytes, alloc time_us): made in the window
    pre_live = dict(occ0)  # address -> bytes: made before the window
    upto = peak_at if peak_at >= 0 else (window.index(True) - 1 if True in window else n - 1)
    for i in range(upto + 1):
        e = trace[i]
        act = e["action"]
        if act == "alloc":
            if window[i]:
                live[e["addr"]] = (sizes[i], e.get("time_us", 0))
            else:
                pre_live[e["addr"]] = sizes[i]
        elif act == "free_requested":
            if live.pop(e["addr"], None) is None:
                pre_live.pop(e["addr"], None)
    freed = {}  # address -> time_us of its first free after the peak (its life's end, for names)
    for i in range(upto + 1, n):
        e = trace[i]
        if e["action"] == "free_requested":
            freed.setdefault(e["addr"], e.get("time_us", 0))
    out.live = [(a, b, t, freed.get(a)) for a, (b, t) in live.items()]
    out.pre_live = [(a, b, None, freed.get(a)) for a, b in pre_live.items()]
    return out


def tags_over_time(marks):
    """[(ns, row, phase code)] change points of the owner (innermost running module's row or
    -1, phase code 0..3) from the hooks' marks, in time order."""
    stack = []
    phase = 0
    out = []
    for t, kind, n in sorted(marks, key=lambda m: m[0]):
        if kind == ENTER:
            stack.append(n)
        elif kind == EXIT:
            for j in range(len(stack) - 1, -1, -1):
                if stack[j] == n:
                    del stack[j:]
                    break
        elif kind == PHASE:
            phase = n
        elif kind == PHASE_END:
            phase = 0
        out.append((t, stack[-1] if stack else -1, phase))
    return out


def owner_at(changes, times, t_us):
    """(row, phase code, ambiguous) at trace time ``t_us`` (the middle of its microsecond);
    ``times`` is [c[0] for c in changes]. ambiguous: a mark lies within that microsecond."""
    lo, hi = t_us * 1000, t_us * 1000 + 999
    j = bisect.bisect_right(times, lo + 500) - 1
    amb = bisect.bisect_right(times, hi) != bisect.bisect_left(times, lo)
    if j < 0:
        return -1, 0, amb
    _, row, phase = changes[j]
    return row, phase, amb


def name_of(a, t0_us, t1_us, snaps):
    """The name a walk gave address ``a`` while the storage made at t0_us (None: before the
    trace) and freed at t1_us (None: not in the window) lived, else None."""
    for t_ns, names in snaps:
        if t0_us is not None and t_ns < t0_us * 1000:
            continue
        if t1_us is not None and t_ns > t1_us * 1000 + 999:
            continue
        n = names.get(a)
        if n is not None:
            return n
    return None


# --- the owners at the peak -------------------------------------------------


def attribute_cuda(snapshot, device, start, peak, peak_exact, marks, snapshots, rows, t0_ns=None, t1_ns=None,
                   workspaces=None, own=True):
    """Who held the bytes at a CUDA block's peak, from the allocator's history.

    snapshot: torch.cuda.memory._snapshot()'s dict read when the block closed; device: its
    index; start: the block's allocated bytes when it opened; peak: the block's peak from
    the counters (absolute), a lower bound when not ``peak_exact``; marks: the hooks'
    (time.time_ns(), kind, number) (ENTER, EXIT, PHASE, PHASE_END above);
    snapshots: [(time.time_ns(), {address: (name, kind, None, shape, dtype)})] names walks;
    rows: the modules' (name, type) by row; t0_ns/t1_ns: the block's open and close (None:
    the whole trace is the block's); workspaces: {bytes: name} of the libraries' workspaces
    (an unnamed block of exactly that size, made by a module or the backward and never freed
    in the block, is named so; None: none);
    own: the history was the block's own (started empty), not the user's.
    Returns an AtPeak with the CPU's vocabulary."""
    # lazy: peak loads _C and NumPy; only this path needs it (importing _cuda_trace stays cheap)
    from .peak import PHASE_NAMES, module_of, owner_label

    t0_us = None if t0_ns is None else t0_ns // 1000
    t1_us = None if t1_ns is None else t1_ns // 1000 + 1
    r = replay(snapshot, device, t0_us, t1_us)
    notes = list(r.notes)
    exact = not notes
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    if own and len(trace) >= MAX_ENTRIES:
        exact = False
        notes.append(
            f"the allocator's history kept only its latest {MAX_ENTRIES} entries: "
            "bytes allocated before the oldest one kept are grouped as not identified"
        )
    changes = tags_over_time(marks)
    times = [c[0] for c in changes]
    owners = {}
    storages = []

    modules = {r[0] for r in rows}

    def add(name, kind, phase, nbytes, shape=None, dtype=None, group=False, row=-1):
        o = owners.get((name, kind))
        if o is None:
            if kind == "activation" and 0 <= row < len(rows):
                module = rows[row][0]
            else:
                module = module_of(name, kind, modules)
            o = owners[(name, kind)] = Owner(name, kind, phase, module=module)
        o.nbytes += nbytes
        o.count += 1
        if not group:
            storages.append((name, kind, phase, nbytes, shape, dtype))

    snaps = sorted(snapshots, key=lambda s: s[0])
    in_block = ambiguous = 0
    for a, size, t_alloc, t_free in r.live:
        in_block += size
        row, code, amb = owner_at(changes, times, t_alloc)
        phase = PHASE_NAMES.get(code)
        named = name_of(a, t_alloc, t_free, snaps)
        if named is not None:
            add(named[0], named[1], phase, size, named[3], named[4])
            continue
        if amb:
            ambiguous += size
        ws = workspaces.get(size) if workspaces else None
        if ws is not None and a in r.kept and (row >= 0 or phase in ("forward", "backward")):
            add(ws, "workspace", phase, size)
            continue
        label, kind = owner_label(row, phase, rows)
        add(label, kind, phase if kind != "other" else None, size, row=row)
    at = start + r.peak_delta
    pre_named = pre_total = 0
    for a, size, _, t_free in r.pre_live:
        pre_total += size
        named = name_of(a, None, t_free, snaps)
        if named is not None:
            add(named[0], named[1], None, size, named[3], named[4])
            pre_named += size
    pre_rest = at - in_block - pre_named
    if pre_total + in_block != at:
        exact = False
        notes.append(
            "the replay of the allocator's history and the counters disagree by "
            f"{units.format(abs(pre_total + in_block - at))} at the block's start"
        )
    if pre_rest:
        add("other, allocated before the block, not identified", "other", None, pre_rest, group=True)
    if r.estimated:
        exact = False
        notes.append(
            f"{units.format(r.estimated)} freed in the block were allocated before the history began: "
            "their blocks' sizes are the requests rounded to 512 B"
        )
    if ambiguous:
        notes.append(
            f"{units.format(ambiguous)} were allocated within a microsecond of a module or phase boundary "
            "(the history's clock): filed by the middle of their microsecond"
        )
    reported = int(peak)
    if peak_exact:
        if at != reported:
            exact = False
            notes.append(
                f"the allocator's history reaches {units.format(at)} at its highest, the counters "
                f"{units.format(reported)}: the difference is not replayed"
            )
            add("not replayed: the history missed the peak", "other", None, reported - at, group=True)
    elif at >= reported:
        notes.append(
            "the counters only bound this block's peak (it stayed below an older peak of the device): "
            f"the allocator's history gives it, {units.format(at)}"
        )
        reported = at
    return AtPeak(reported, list(owners.values()), storages, exact, notes, {r[0]: r[1] for r in rows})
