"""track(): measure the memory of a block of code, per phase, per module and per step.

    with memtorch.track(model, optimizer=opt) as t:
        for x, y in batches:
            loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
            t.step()
    print(t.report)

What a block counts. On the CPU, memtorch.cpu's counters are process-wide: a
block counts the tensor memory allocated and freed by *every thread* of the
process while it is open, not only by the thread that opened it. On CUDA it
counts torch's caching allocator for one device (also process-wide, all
streams). Blocks nest; each gets its own peak (see memtorch.cuda.block_peak for
CUDA, where torch's peak reset is global and memtorch never calls it).

Phases (when a model and/or optimizer is given): "forward" runs from the
model's forward pre-hook to its forward hook; "backward" from the end of a
forward made with grad enabled to the next optimizer step, forward, t.step()
or the end of the block (so it includes the loss); "optimizer" from the
optimizer's step pre-hook to its post-hook. A step that never calls the model
itself but a part of it (a LightningModule's training_step calling
self.model(x)): the first module of the model whose forward runs while none of
the model's does stands for the model from then on (seen by the hooks on
every module: modules=True); a later such forward of another module (the parts
called one by one) is the same forward pass, the code between them filed
under "backward".

Per module (modules=True, on the CPU; on CUDA the counters are read only at the
block's, phases' and steps' boundaries, five reads a training step, and the
module rows are absent, as a caveat says): ``activation_bytes`` is the bytes a module's forward
leaves allocated when it returns (its output plus what autograd saved for
backward, minus what it freed), summed over its calls and divided by the number
of forwards of the model; ``peak_above_start`` the largest peak above the
allocation at entry over its calls.

Who held the bytes at the peak (``t.report.at_peak``, CPU with exact counters,
when a model or optimizer is given): the C event log records every allocation
and free with its address and an owner tag (the innermost module whose forward
runs, the phase); the log is replayed up to the event that reached the peak,
and storages are named by matching addresses with the parameters, gradients,
optimizer state and forward inputs (read when the block opens, around each
optimizer step and when it closes). See memtorch.peak. The replay, like the
per-phase and per-module figures in this mode, runs when the report is first
read.

Steps and leaks: t.step() marks a step boundary and records the step's peak
and end (``report.step_series``). After ``warmup`` steps, growth is judged over
the whole run (memtorch.leaks): leaking when the net growth is positive and
two or more judged steps grew. Live tensors are then listed at most twice per
block (at the first judged step that grew, and at the end; each walk capped in
time and objects, the report says when it stopped early): what is new and
still alive is grouped by kind, what is expected to live (parameters,
gradients, optimizer state, the current batch) is labelled, and the container
holding the rest is named from the garbage collector's referrers.

memtorch keeps no strong reference to the user's tensors: hooks never capture
inputs or outputs, and named survivors are held by weakref.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import time
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeVar

from . import _C, cpu, cuda, units, words
from . import _cuda_trace
from . import leaks, oom
from . import peak as attribution
from .leaks import LeakReport, TensorInfo  # TensorInfo's home: memtorch/reports/leaks.py
from .errors import DeviceUnavailable, MemtorchError
from .reports import render
from .reports.track import ModuleStats, PhaseStats, TrackReport  # the result types' home; old names stay
from ._torch import torch as _load_torch  # the loader only: torch itself loads on first call

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch

_F = TypeVar("_F", bound=Callable[..., Any])  # a function track() decorates: its wrapper has its type

__all__ = ["track", "Tracker", "TrackReport", "PhaseStats", "ModuleStats", "LeakReport", "TensorInfo"]

PHASES = words.PHASES

_HERE = __file__.rsplit("/", 1)[0].rsplit("\\", 1)[0]  # memtorch's own folder: frames to skip
_lock = threading.Lock()
_active = []  # open Trackers, process-wide (for _debug_leftovers)


_torch_mod = None


def _torch():
    global _torch_mod
    if _torch_mod is None:
        _torch_mod = _load_torch()
    return _torch_mod


def _debug_leftovers():
    """Open trackers and hook handles not removed (empty when clean)."""
    with _lock:
        found = [f"tracker {t._describe()} still open" for t in _active]
    return found


# ---------------------------------------------------------------------------
# Report objects


def _rank_info():
    """{"rank", "world_size"} under an initialised torch.distributed process group, else {}."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return {}
    try:
        if not dist.is_initialized():  # cheap: the check before distributed.rank_info's
            return {}
    except Exception:  # noqa: BLE001 - a build without distributed support, or one being torn down
        return {}
    # lazy: distributed loads only when this path runs (importing tracking stays cheap)
    from .distributed import rank_info

    return rank_info()


def module_figures(times: Any, nbytes: Any, starts: Any, ends: Any, known_from: Any = None) -> Any:
    """Bytes left alive and peak above start of calls [start, end] from an event log.

    times/nbytes: the log, (time, allocated bytes after the event), sorted by
    time; starts/ends: each call's timestamps on the same clock. The bytes at a
    timestamp are those after the last event at or before it. Returns int64
    arrays (end bytes - start bytes, peak over the call - start bytes) and a bool
    array, False for calls that began before the log's first event or before
    ``known_from`` (events lost before it).
    """
    import numpy as np

    t = np.asarray(times, dtype=np.int64)
    b = np.asarray(nbytes, dtype=np.int64)
    tp = np.asarray(starts, dtype=np.int64)
    tq = np.asarray(ends, dtype=np.int64)
    n = len(tp)
    if n == 0 or len(t) == 0:
        z = np.zeros(n, dtype=np.int64)
        return z, z.copy(), np.zeros(n, dtype=bool)
    ip = np.searchsorted(t, tp, side="right") - 1
    iq = np.searchsorted(t, tq, side="right") - 1
    valid = ip >= 0
    if known_from is not None:
        valid &= tp >= known_from
    ip = np.maximum(ip, 0)
    iq = np.maximum(iq, ip)
    start = b[ip]
    end = b[iq]
    idx = np.empty(2 * n, dtype=np.intp)
    idx[0::2] = ip
    idx[1::2] = iq + 1
    padded = np.append(b, b[-1])  # iq + 1 may be len(b)
    peak = np.maximum.reduceat(padded, idx)[0::2]
    return end - start, peak - start, valid


# ---------------------------------------------------------------------------
# Live tensors (only scanned when a leak is suspected or largest= asks)


def _live_tensors(device_type):
    """Weak snapshot {id: weakref} of live torch.Tensor objects on a device type."""
    Tensor = _torch().Tensor
    snap = {}
    for o in gc.get_objects():
        if issubclass(type(o), Tensor):  # type(), not isinstance: no __class__ lookup on odd objects
            try:
                if o.device.type != device_type:
                    continue
                snap[id(o)] = weakref.ref(o)
            except (TypeError, RuntimeError):
                continue
    return snap


def _graph_bytes(t, limit=200_000, keys=None, leaves=None, group=None):
    """Bytes of unique storages saved for backward in the graph behind ``t`` (0 without a graph).

    Leaves that require grad (parameters), and views of them saved by an op, are
    left out: the graph does not keep them alive. ``keys``/``leaves`` may be shared
    between calls (storages saved by several graphs count once); ``group`` collects
    (key, bytes) of the storages first seen here.
    """
    Tensor = _torch().Tensor
    root = t.grad_fn
    if root is None:
        return 0
    keys = {} if keys is None else keys
    leaves = set() if leaves is None else leaves
    mine = {}
    seen_nodes = {id(root)}
    stack = [root]
    while stack and len(seen_nodes) < limit:
        node = stack.pop()
        var = getattr(node, "variable", None)  # AccumulateGrad: the leaf (a parameter)
        if isinstance(var, Tensor):
            leaves.add(leaks.storage_key(var))
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except Exception:  # freed buffers raise
                continue
            for v in value if isinstance(value, (list, tuple)) else (value,):
                # leaves that require grad are parameters (or inputs) kept anyway
                if isinstance(v, Tensor) and not (v.is_leaf and v.requires_grad):
                    k = leaks.storage_key(v)
                    if k not in keys:
                        keys[k] = mine[k] = leaks.storage_nbytes(v)
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen_nodes:
                seen_nodes.add(id(nxt))
                stack.append(nxt)
    if group is not None:
        group.examples += [(k, n) for k, n in mine.items() if k not in leaves]
    return sum(n for k, n in mine.items() if k not in leaves)


def _local_name(frame, t):
    """The name of a local of ``frame`` bound to ``t``, or None; leaves no reference behind where that is
    safe (leaks.frame_items)."""
    for k, v in leaks.frame_items(frame):
        if v is t:
            return f"{k} (in {frame.f_code.co_name})"
    return None


def _name_of(t):
    """A variable name referring to ``t`` (a local of a calling frame, a global, an attribute), or None."""
    import sys

    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < 50:  # running frames are not gc-tracked objects: walk the stack
        if not frame.f_code.co_filename.startswith(_HERE):
            name = _local_name(frame, t)
            if name is not None:
                return name
        frame = frame.f_back
        depth += 1
    for ref in gc.get_referrers(t):
        if isinstance(ref, dict):
            for k, v in ref.items():
                if v is t and isinstance(k, str):
                    return k
    return None


class _SavedBytes:
    """Collects (storage key, bytes) pairs from _graph_bytes."""

    __slots__ = ("examples",)

    def __init__(self):
        self.examples = []


def _apply_replay(replayed, n_events, mod_rows, phases):
    """Per-module and per-phase figures from eventlog_replay()'s pass over the marks."""
    if phases:
        names = attribution.PHASE_NAMES
        seen = {name: 0 for name in phases}
        for code, b0, b1, peak in replayed[8]:
            name = names.get(code)
            if name in phases:
                phases[name]._add_bytes(b0, b1, peak, True)
                seen[name] += 1
        for name, p in phases.items():
            p._seen = seen[name]
            if seen[name] < p.calls:  # begun before the oldest event kept
                p.exact = False
    if not n_events:
        return
    mods = replayed[7].tolist()
    n = len(mod_rows)
    for row, (calls, measured, act, above, unmatched) in zip(mod_rows, mods[:n]):
        if not calls:
            continue
        row.calls += calls
        row._measured += measured
        row.activation_total += act
        if measured:
            row.peak_above_start = max(row.peak_above_start, above)
        if unmatched:
            row.exact = False
    # rows n + r: row r's recomputations (marks.c: forwards run inside autograd's backward)
    for row, (calls, measured, act, above, unmatched) in zip(mod_rows, mods[n:]):
        if calls:
            row.recomputed += calls
            row.recomputed_total += act
            if unmatched:
                row.exact = False


_WRAPPED = (
    "the event log keeps the latest 131,072 events and this block made more ({dropped:,} lost): {what} "
    "is the highest over the latest {measured:,} of its {calls:,} {unit}, a lower bound (calls and bytes "
    "left alive are exact: counted by the hooks)"
)


def _apply_totals(totals, rows, phases, dropped):
    """After the event log wrapped: each module's calls and the bytes they left allocated as the
    marks' hooks counted them (exact however long the block), and each phase's delta; the peaks
    inside are those of the calls the log still held, flagged as lower bounds with the reason."""
    mods, deltas, again = totals
    for row, (calls, act, unmatched) in zip(rows, again):
        if calls:
            row.recomputed = calls
            row.recomputed_total = act
            if unmatched:
                row.exact = False
                row.why = f"{unmatched:,} of its {calls:,} recomputations began out of the hooks' sight"
    for row, (calls, act, unmatched) in zip(rows, mods):
        if not calls:
            continue
        measured = row._measured  # calls the replay saw whole (their peaks)
        row.calls = calls
        row.activation_total = act
        row._measured = calls - unmatched
        if unmatched:
            row.exact = False
            row.why = f"{unmatched:,} of its {calls:,} calls began out of the hooks' sight (nested too deep)"
        elif measured < calls:
            row.exact = False
            row.why = _WRAPPED.format(dropped=dropped, what="its peak inside", measured=measured, calls=calls,
                                      unit="calls")
    if phases:
        for name, delta in zip(PHASES, deltas):
            p = phases.get(name)
            if p is None or not p.calls:
                continue
            p.delta = delta
            if not p.exact:
                p.why = _WRAPPED.format(dropped=dropped, what="its peak above start", measured=p._seen,
                                        calls=p.calls, unit="occurrences")


def _splits_recomputation(n):
    """Whether the marks of a block with n module rows mark recomputations as rows n..2n-1
    (as marks.c: row + 1 must fit the tag's 22 bits)."""
    return 2 * n <= (1 << 22) - 1


def _average_modules(rows, forwards):
    forwards = max(1, forwards)
    if rows and 0 < rows[0]._measured < rows[0].calls:
        # the event log dropped the oldest forwards: average over the measured ones
        forwards = rows[0]._measured
    for row in rows:
        row.activation_bytes = row.activation_total // forwards
        row.recomputed_bytes = row.recomputed_total // forwards


def _replay(ev, dropped, start, peak_bytes, snapshots, sizes, token, rows, specs, forwards, caveats, exact,
            phases=None, sites=None, totals=None, other=(0, 0)):
    """The deferred part of a block's end (event-log mode): per-module and per-phase figures, at_peak.
    ``ev``: the block's events as eventlog_read_all(..., raw=True) copied them (bytes);
    ``rows`` (the report's list of ModuleStats) is filled here from ``specs``."""
    import numpy as np

    ev = np.frombuffer(ev, dtype=_log_dtype())
    rows.extend(ModuleStats(*spec) for spec in specs)
    queries = list(sizes)  # every address the walks named (_finish read their sizes)
    # rows len(rows) + r: row r's recomputations (as marks.c marks them when they fit the tag)
    nrows = 2 * len(rows) if _splits_recomputation(len(rows)) else len(rows)
    replayed = cpu._eventlog_replay(ev, start, dropped, peak_bytes, token, nrows, queries)
    _apply_replay(replayed, len(ev), rows, phases)
    if totals is not None:
        _apply_totals(totals, rows, phases, dropped)
    _average_modules(rows, forwards)
    names = [(r.name, r.type) for r in rows]
    if nrows > len(rows):
        names += [(r.name, r.type, "recomputed") for r in rows]
    kept = int((ev["kind"] == 0).sum()) if dropped else len(ev)
    at_peak = attribution.attribute(
        replayed, queries, kept, dropped, peak_bytes, snapshots,
        sizes, token, names, sites=sites,
    )  # fmt: skip
    at_peak.notes += caveats
    if not exact:
        at_peak.exact = False
    if other[1]:
        # the counters are process-wide and the owner tag was this thread's: what other threads
        # allocated is in these figures, and at_peak may file it under this block's phases/modules
        what = f"other threads allocated {units.format(other[0])} ({other[1]:,} allocation(s)) while the block was open"
        why = f"{what}: they are counted in these figures and may be filed under this block's phases and modules"
        at_peak.exact = False
        # one note for one fact: this one replaces the report's caveat about the same bytes
        at_peak.notes = [n for n in at_peak.notes if "were allocated by other threads" not in n]
        at_peak.notes.insert(
            0,
            f"{what}: the CPU counters are process-wide, so they are in the peak; at the peak their storages "
            f"are under '{attribution.OTHER_THREADS}' (or '{attribution.OTHER_IN_BLOCK}' when that thread "
            "tracked a block of its own), never under this block's modules or phases",
        )
        for item in list(rows) + list((phases or {}).values()):
            if item.calls:
                item.exact = False
                item.why = item.why or why
    return at_peak


_token = [0]
_dtype = []  # the numpy dtype of the event log's rows, read once


def _log_dtype():
    if not _dtype:
        _dtype.append(cpu._eventlog_read_all(0, 0)[0].dtype)
    return _dtype[0]


def _outer_tag(inner):
    """The owner tag of the innermost other open block of this thread in event-log mode
    (what its hooks would have set), or 0: restored when ``inner`` ends."""
    if len(_active) < 2:  # ``inner`` alone
        return 0
    me = threading.get_ident()
    with _lock:
        for t in reversed(_active):
            if t is not inner and t._open and t._evmode and t._thread == me:
                return t._top_tag()
    return 0


def _next_token():
    """A block's tag token (1..255, reused round-robin): tells its tags from a nested block's."""
    with _lock:
        _token[0] = _token[0] % 255 + 1
        return _token[0]


_direct = []  # [(pre, post, always-called dicts, RemovableHandle)] or [None]: see _hook_dicts


def _hook_dicts():
    """torch's global forward hook dicts (pre-hooks, hooks, hooks always called) and its
    RemovableHandle when they are where torch 2.x keeps them, else None (then the public
    register_* functions). A block adds its hooks to them directly, under ids from the
    handles' own counter: a RemovableHandle per hook, made and removed once per block,
    cost as much as the rest of the block's start."""
    if not _direct:
        found = None
        try:
            from torch.utils.hooks import RemovableHandle

            m = sys.modules["torch.nn.modules.module"]
            dicts = (
                m._global_forward_pre_hooks, m._global_forward_hooks, m._global_forward_hooks_always_called,
            )  # fmt: skip
            if all(isinstance(d, dict) for d in dicts) and type(RemovableHandle.next_id) is int:  # noqa: E721
                found = dicts + (RemovableHandle,)
        except (ImportError, KeyError, AttributeError):
            pass
        _direct.append(found)
    return _direct[0]


def _opt_hook_dicts(opt):
    """The optimizer's step pre- and post-hook dicts when its class registers them as
    torch.optim.Optimizer does, else None (then opt.register_step_*_hook)."""
    if _hook_dicts() is None:  # no handle counter to take ids from
        return None
    cls, base = type(opt), _torch_mod.optim.Optimizer
    if (
        cls.register_step_pre_hook is base.register_step_pre_hook
        and cls.register_step_post_hook is base.register_step_post_hook
    ):
        pre = opt.__dict__.get("_optimizer_step_pre_hooks")
        post = opt.__dict__.get("_optimizer_step_post_hooks")
        if isinstance(pre, dict) and isinstance(post, dict):
            return pre, post
    return None


def _add_hook(handles, hooks, hook, always=None, front=False):
    """hooks[id] = hook (and always[id] = True), as torch's register_* functions do, with
    an id from RemovableHandle's counter (front: first among the hooks already there, as
    prepend=True); (hooks, id, always) goes to ``handles``, for Tracker._remove_hooks."""
    h = _direct[0][3]
    i = h.next_id
    h.next_id = i + 1
    hooks[i] = hook
    if front and len(hooks) > 1 and hasattr(hooks, "move_to_end"):  # torch's are OrderedDicts
        hooks.move_to_end(i, last=False)
    if always is not None:
        always[i] = True
    handles.append((hooks, i, always))


def _kept_since(first):
    """The addresses (a set) that the allocations logged since event ``first`` still hold now: each
    address whose last allocation event since then is an allocation, not a free. None when the ring
    lost some of those events (then what was kept is not known)."""
    ev, dropped = cpu._eventlog_read_all(first, cpu._eventlog_head())
    if dropped:
        return None
    ev = ev[ev["kind"] == 0]  # allocations and frees, in order
    last = {}
    for ptr, delta in zip(ev["ptr"].tolist(), ev["delta"].tolist()):
        last[ptr] = delta
    return {ptr for ptr, delta in last.items() if delta > 0}


def _in_backward_fn():
    """torch._C._current_graph_task_id (-1 outside autograd's backward), or None on a torch
    without it (then recomputations count as forwards)."""
    f = getattr(_torch_mod._C, "_current_graph_task_id", None)
    return f if callable(f) else None


def _in_backward():
    """True inside autograd's backward (a forward run there is a recomputation)."""
    f = _in_backward_fn()
    return f is not None and f() != -1


def _skip_traced(hook):
    """``hook`` behind a Python function that returns at once while dynamo traces
    (torch.compiler.is_compiling(), which dynamo reads as True): a C hook, or a Python
    one that opens counter scopes, would break the graph (dynamo cannot trace it) and
    the eager code would stay cached after the block. Inside a compiled graph no hook
    of memtorch runs; its modules are one opaque region (see _compiled_rows)."""
    compiling = _torch_mod.compiler.is_compiling

    def hook_unless_traced(*args):
        if compiling():
            return None
        return hook(*args)

    return hook_unless_traced


def _module_hook_dicts(mod):
    """The module's own forward pre-hook, hook and always-called dicts, or None."""
    d = mod.__dict__
    dicts = (d.get("_forward_pre_hooks"), d.get("_forward_hooks"), d.get("_forward_hooks_always_called"))
    return dicts if all(isinstance(x, dict) for x in dicts) else None


def _describe_tensor(t):
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


# ---------------------------------------------------------------------------
# Tracker


def _compiled_kind(module, wrapper):
    """How ``module`` is a torch.compile'd region: "torch.compile" (what torch.compile(module) returns, an
    instance of ``wrapper``, _optimized_module()), "compile()" (module.compile() was called), else None."""
    if wrapper is not None and isinstance(module, wrapper):
        return "torch.compile"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "compile()"
    return None


def _optimized_module():
    """torch.compile's wrapper class (OptimizedModule), read without importing torch._dynamo (a process
    that never compiled has not imported it), or None."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def _any_compiled(refs):
    """Whether a module of ``refs`` (weak references) is a torch.compile'd region (_compiled_notes' regions,
    _compiled_kind's test): one C call at every block's end, not a getattr per module (20 us of a block on
    a 2-layer nn.TransformerEncoder's 23 modules, caches cold after a step)."""
    return _C.modules_compiled(refs, _optimized_module())


def _graphs_compiled():
    """Whether torch.compile has compiled a graph in this process (dynamo's counters; not imported here)."""
    utils = sys.modules.get("torch._dynamo.utils")
    stats = getattr(utils, "counters", {}).get("stats", {}) if utils is not None else {}
    return bool(stats.get("unique_graphs", 0))


def _compiled_notes(named, root_calls):
    """(caveats, [(row name, note)]) for the modules of a block's model that ran as one
    torch.compile'd graph: ``named`` [(name, module)] in pre-order, ``root_calls`` the forwards
    of the root that the hooks saw. memtorch's hooks are skipped while dynamo traces
    (_skip_traced): inside a compiled graph no module's hook runs, so the modules inside one
    have no figures of their own; their bytes are in the row of the first module outside it
    whose hooks ran, or the block's phases. A region is torch.compile(module) (its own hooks
    run outside the graph: its row holds the region's bytes) or module.compile() (its hooks
    run inside: its bytes are in its parent's row)."""
    regions, notes = [], []
    wrapper = _optimized_module()
    for name, mod in named:
        if mod is None or any(r == "" or name == r or name.startswith(r + ".") for r, _ in regions):
            continue
        kind = _compiled_kind(mod, wrapper)
        if kind is not None:
            regions.append((name, kind))
    caveats = []
    for r, how in regions:
        inside = [n for n, _ in named if n != r and (r == "" or n.startswith(r + "."))]
        label = r or "(model)"
        call = "torch.compile" if how == "torch.compile" else f"{r or 'model'}.compile()"
        if how == "torch.compile":
            notes.append((r, f"a torch.compile'd module: its {len(inside):,} module(s) inside run as a compiled "
                             "graph and cannot be split; their bytes are in this row"))
            holder = f"{label}'s row"
        else:
            parent = r.rsplit(".", 1)[0] if "." in r else ""
            # the root's own hooks are in its graph too: no forward or backward phase either
            holder = ("the block's totals, with no phases: the model's own hooks are in the graph too" if r == ""
                      else f"{parent or '(model)'}'s row")  # fmt: skip
            notes.append((r, f"compiled by {call}: it and its {len(inside):,} module(s) inside run as a "
                             f"compiled graph and cannot be split; their bytes are in {holder}"))
        notes += [(n, f"inside the compiled region {label}: cannot be split") for n in inside]
        caveats.append(
            f"{label} is compiled ({call}): "
            f"memtorch's hooks do not run inside a compiled graph, so the {len(inside):,} module(s) inside it "
            f"have no figures of their own; the figures are the compiled program's; their bytes are in {holder}"
        )  # fmt: skip
    if not regions and named and root_calls == 0 and _graphs_compiled():
        caveats.append(
            "the model's forward was not seen in this block and torch.compile has compiled graphs in this "
            "process: if the model ran through its compiled wrapper (compiled = torch.compile(model)), its "
            "hooks ran inside the graph and were compiled away; track the wrapper (memtorch.track(compiled, "
            "...)) for its phases and module rows"
        )  # fmt: skip
    return caveats, notes


def _make_report(scope, kw):
    """A block's TrackReport from what its end read (Tracker._finish); the sentences of the
    closed scope's caveats are written now, into the list the deferred replay shares, and
    the rank and world size read (of torch.distributed's process group when first read)."""
    if type(scope) is cpu._CallScope:  # noqa: E721  (opened and closed by its own C calls: its Scope now)
        scope = scope.scope()
    kw["caveats"].extend(getattr(scope, "caveats", None) or ())
    kw["baseline"] = getattr(scope, "baseline", None) if getattr(scope, "_state", "") != "new" else None
    kw.update(_rank_info())
    leak = kw.get("leak")
    if leak is not None and not leak.exact and leak.why is None:  # the reason travels with the leak figure
        leak.why = " ".join(getattr(scope, "why_not_exact", None) or ()) or None
    return TrackReport(**kw)


def _timed_phases(marks):
    """{name: PhaseStats} of the phases a block's ModuleMarks timed (calls and seconds; their bytes come
    with the replay)."""
    phases = {}
    for name, (calls, seconds) in zip(PHASES, marks.phases):
        if calls:
            p = phases[name] = PhaseStats(name)
            p.calls, p.seconds = calls, seconds
    return phases


def _lean_report(calls, figures):
    """The TrackReport of a block that Tracker._finish_lean ended, from what it read: the phases the marks
    timed, the replay of its log (deferred further: made when at_peak or the module rows are first read)."""
    (start, end, peak_bytes, exact, ev, dropped, snapshots, sizes, token, specs, m, caveats, row_notes, sites,
     other, unseen, seconds, largest_n) = figures  # fmt: skip
    phases = _timed_phases(m)
    # the log wrapped: the calls and bytes the hooks counted
    totals = (m.module_totals, m.phase_deltas, m.recompute_totals) if dropped else None
    rows = []
    pending = functools.partial(
        _replay, ev, dropped, start, peak_bytes, snapshots, sizes, token, rows, specs, m.forwards, caveats,
        exact, phases, sites=sites, totals=totals, other=other,
    )  # fmt: skip
    own = type(calls) is cpu._CallScope  # noqa: E721  (else the Scope made where the hooks were lost)
    kw = {
        "device": "cpu", "exact": exact, "mechanism": cpu.EXACT if own else calls.mechanism, "start": start,
        "end": end, "peak": peak_bytes, "_phases": dict(phases), "_modules": rows, "timeline": None,
        "leak": None, "_largest": [], "seconds": seconds, "steps": 0, "_pending": pending, "step_series": [],
        "_largest_n": largest_n, "caveats": caveats, "marks": [], "_row_notes": row_notes,
        "unseen_frees": unseen[0], "unseen_bytes": unseen[1],
    }  # fmt: skip
    return _make_report(calls, kw)


def _make_counters_report(closed, seconds):
    """The TrackReport of a counters-only block: ``closed`` its closed cpu.Scope, or its cpu._CallScope."""
    s = closed.scope() if type(closed) is cpu._CallScope else closed  # noqa: E721
    kw = dict(
        device="cpu", exact=bool(s._exact) and s._mechanism != cpu.FALLBACK, mechanism=s._mechanism,
        start=s._start, end=s._end, peak=s._peak, seconds=seconds,
        unseen_frees=s.unseen_frees, unseen_bytes=s.unseen_bytes, caveats=[],
    )  # fmt: skip
    return _make_report(s, kw)


def _count_ok(n):
    """An int >= 0 and not a bool (track's warmup= and largest=)."""
    return (type(n) is int or (isinstance(n, int) and not isinstance(n, bool))) and n >= 0  # noqa: E721


def _parse_device(device, first):
    """("cpu"|"cuda", index) for ``device``; "auto" is the device of ``first`` (the model's
    first parameter or buffer), else the CPU."""
    torch = _torch()
    if device is None or (isinstance(device, str) and device == "auto"):
        if first is not None:
            if first.is_cpu:
                return "cpu", None
            return _parse_device(first.device, None)
        # deliberately not "CUDA if initialised": what a block counts must not depend on
        # whether some earlier code happened to touch the GPU
        return "cpu", None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"unknown device {device!r}: expected 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device"
        ) from None
    if dev.type == "cpu":
        return "cpu", None
    if dev.type == "cuda":
        return "cuda", cuda._index(dev)
    hint = ""
    if dev.type == "meta":
        hint = (
            " (the meta device allocates nothing: memtorch.inspect(model) says what a model holds, "
            "memtorch.estimate(...) what a step would need)"
        )
    raise DeviceUnavailable(f"memtorch.track cannot count device type {dev.type!r}: only 'cpu' and 'cuda'{hint}")


_META_HINT = (
    "track() runs the code and counts the memory it really allocates, and a model on the meta "
    "device allocates nothing: use memtorch.inspect(model) for what the model holds, or "
    "memtorch.estimate(model, sample_input, optimizer=...) for what a training step would need"
)


def _unwrap_optimizer(opt, where="track"):
    """The torch.optim.Optimizer whose step() runs the update behind ``opt``: ``opt`` itself,
    or the optimizer a wrapper holds (accelerate's AcceleratedOptimizer ``.optimizer``,
    Lightning's LightningOptimizer ``._optimizer``, any object whose ``.optimizer`` is one).
    A torch optimizer with step hooks of its own (one that wraps another and adds to its
    update) is kept; a TypeError, before any hook goes in, for anything else."""
    Optimizer = _torch().optim.Optimizer
    d = getattr(opt, "__dict__", None)
    if (isinstance(opt, Optimizer) and isinstance(d, dict) and isinstance(d.get("_optimizer_step_pre_hooks"), dict)
            and "optimizer" not in d and "_optimizer" not in d):
        return opt  # a torch optimizer that holds no other: what the loop below returns at its first turn
    o = opt
    for _ in range(8):  # wrappers of wrappers, bounded
        d = getattr(o, "__dict__", None)
        own = isinstance(d, dict) and isinstance(d.get("_optimizer_step_pre_hooks"), dict)
        inner = None
        for attr in ("optimizer", "_optimizer"):
            v = d.get(attr) if isinstance(d, dict) else None
            if v is None and not isinstance(o, Optimizer):
                try:
                    v = getattr(o, attr, None)  # a wrapper's property
                except Exception:  # noqa: BLE001 - a wrapper's property that raises: not a wrapper
                    v = None
            if isinstance(v, Optimizer) and v is not o:
                inner = v
                break
        if inner is None:
            break
        inner_pre = inner.__dict__.get("_optimizer_step_pre_hooks")
        if own and isinstance(o, Optimizer) and d["_optimizer_step_pre_hooks"] is not inner_pre:
            break  # an optimizer with hooks of its own (its step does more than the inner one's)
        o = inner
    if not isinstance(o, Optimizer):
        raise TypeError(
            f"{where}(optimizer=...) expects a torch.optim.Optimizer, got {type(opt).__name__} "
            "(a wrapper is accepted when it holds the optimizer in .optimizer)"
        )
    if not isinstance(o.__dict__.get("_optimizer_step_pre_hooks"), dict):
        raise TypeError(
            f"{where}(optimizer=...): {type(o).__name__} is a torch.optim.Optimizer that never ran "
            "Optimizer.__init__ (it has no step hooks) and holds no optimizer in .optimizer: "
            "pass the optimizer it wraps"
        )
    return o


def _closure_args(tref, args, kwargs):
    """A step pre-hook's answer for ``optimizer.step(closure)`` (args[0] is the optimizer,
    as torch's step wrapper passes it): the same arguments with the closure wrapped, so that
    when it returns the optimizer phase resumes (the closure's forward and backward are
    their own phases); None when the step has no closure. ``tref``: a weakref to the Tracker."""
    closure = kwargs.get("closure") if kwargs else None
    if closure is not None:
        if not callable(closure):
            return None
        kwargs = dict(kwargs)
        kwargs["closure"] = _in_step(tref, closure)
        return args, kwargs
    if len(args) > 1 and args[1] is not None and callable(args[1]):
        return (args[0], _in_step(tref, args[1])) + tuple(args[2:]), kwargs
    return None


def _in_step(tref, closure):
    """``closure``, telling the Tracker behind ``tref`` when it begins and returns (holding no
    reference to it)."""

    def closure_in_step(*args, **kwargs):
        t = tref()
        if t is not None:  # what it does before its forward (zero_grad) is no phase's, as in a plain loop
            t._pause_optimizer()
        del t
        out = closure(*args, **kwargs)
        t = tref()
        if t is not None:
            t._resume_optimizer()
        return out

    return closure_in_step


class _Plan:
    """What a block reads of a model's structure, kept between blocks (the Tracker of a
    training loop opens one per step) while the structure stays the same: the modules by
    name, the parameters and buffers by name. Only weak references: a module or tensor
    the user drops is never kept alive by memtorch."""

    __slots__ = ("mods", "ids", "specs", "params", "buffers", "fp", "names", "__weakref__")

    def __init__(self, model):
        named = _named_modules(model)
        self.mods = [weakref.ref(m) for _, m in named]
        self.ids = {id(m): i for i, (_, m) in enumerate(named)}
        self.specs = [(name, type(m).__name__) for name, m in named]
        self.params, self.buffers, seen = [], [], set()
        for prefix, mod in named:
            pre = prefix + "." if prefix else ""
            for k, p in mod._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((pre + k, weakref.ref(p), pre + k + ".grad"))
            for k, b in mod._buffers.items():
                if b is not None:
                    self.buffers.append((pre + k, weakref.ref(b)))
        self.fp = _C.modules_fingerprint([m for _, m in named])
        # the last block's names of parameters, buffers and optimizer state: (weakref to the
        # optimizer or None, its state count, shape flag, params, addresses, their allocation
        # numbers, {address: name...}); see Tracker._walk_names
        self.names = None

    def first(self):
        """The model's first parameter, else its first buffer, else None."""
        for _, r, _ in self.params:
            t = r()
            if t is not None:
                return t
        for _, r in self.buffers:
            t = r()
            if t is not None:
                return t
        return None


def _named_modules(model):
    """model.named_modules()'s list (pre-order, each module once, at its first name) with a
    stack of its own: torch's recursive generator fails on a model nested deeper than
    Python's recursion limit."""
    out, seen = [], set()
    stack = [("", model)]
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append((prefix, mod))
        kids = mod._modules
        if kids:
            pre = prefix + "." if prefix else ""
            stack.extend((pre + k, m) for k, m in reversed(list(kids.items())) if m is not None)
    return out


_plans = {}  # id(model) -> _Plan; the entry goes when the model does (see _drop_plan)


def _plan_of(model):
    """The model's _Plan, rebuilt when a module, parameter or buffer was added, removed or
    replaced anywhere in it since the last block (or one the plan names was freed)."""
    key = id(model)
    plan = _plans.get(key)
    known = False
    if plan is not None:
        known = plan.mods[0]() is model
        if known and _C.modules_fingerprint(plan.mods) == plan.fp:  # None if a module is gone
            return plan
    plan = _plans[key] = _Plan(model)
    if not known:  # a finalizer, not a reference: the model is never kept alive
        weakref.finalize(model, _drop_plan, key, plan.mods[0])
    return plan


def _drop_plan(key, ref):
    """The model behind ``ref`` is gone: drop its plan (not that of a later model with its id)."""
    plan = _plans.get(key)
    if plan is not None and plan.mods[0] is ref:
        del _plans[key]


def _first_tensor(model):
    """The model's first parameter, else its first buffer, else None."""
    return _plan_of(model).first()


def _on_meta(model):
    t = _first_tensor(model)
    return t is not None and t.device.type == "meta"


_CUDA_NO_MODULES = (
    "Per-module figures are not measured on CUDA: reading torch's counters at every module's entry "
    "and exit cost up to half of a GPU step. The block's and the phases' figures are read at their "
    "boundaries; a CPU run of the same step gives exact per-module figures."
)

# What Tracker.__init__ sets for a block of counters only on the CPU (no model, optimizer or timeline;
# the other arguments as their defaults): what its general path would set for them.
_COUNTERS_ONLY = {
    "_plan": None, "_plan_fresh": False, "_model": None, "_optimizer": None, "_kind": "cpu", "_index": None,
    "_timeline": False, "_lean": False, "_modules_on": False, "_leaks": True, "_warmup": 1, "_largest": 0,
}

# A block's state at its start (Tracker._reset_state), the immutable part.
_FRESH = dict(
    _phase=None,
    _raw=None,  # event-log mode: its scope by its own C calls (cpu._CallScope), until a Scope is made
    _mod_specs=(),  # event-log mode: (name, type name) of the rows, made at the replay
    _marks=None,  # event-log mode: _C.ModuleMarks, the module and optimizer hooks in C
    _at_peak=None,
    _ctrace=None,  # CUDA with a model or optimizer: the allocator's history (_cuda_trace.Recording)
    _cuda_specs=(),  # CUDA at_peak: the modules' (name, type), for its owners' names
    _root_id=None,
    _root_depth=0,
    _forwards=0,
    _depth=0,  # forwards of the model's modules running (the Python hooks; marks.c keeps its own)
    _top=None,  # id() of a module of the model, not the root, whose forward began with none running
    _scan0=None,  # leaks.Scan at the first judged step that grew
    _scan0_step=None,
    # event-log mode: the log's head at the last step boundary while no scan was taken, and the
    # addresses that the step of the scan allocated and still held at its end (None: not known)
    _step_head=None,
    _scan0_fresh=None,
    # the survivors named as the function that called step() returned (a pytest test whose block ends
    # after it: its locals are gone by then): (groups, survivors, notes, function name), or None
    _return_scan=None,
    _return_armed=None,  # the trace function armed for that return (removed at the block's end)
    _return_frame=None,  # (that function's frame, its trace function, its f_trace_lines before) while armed
    _step_scope=None,
    _ended=False,  # _finish_lean ended the block (see _cleanup)
    _adopting=False,  # the optimizer is the first that steps the model's parameters (_hook_any_optimizer)
)


class Tracker:
    """A track() block: context manager and decorator. See memtorch.tracking."""

    # What a Tracker holds before its block opens (class defaults: a block per training
    # step makes one per step, cheaply; __enter__ and _reset_state set them on the instance).
    _report = None
    _open = False
    _last = None  # decorator: the Tracker of the last call
    _evmode = False
    _with_log = False  # run the event log (at_peak) even without a model: the pytest plugin
    _quick = False  # an open counters-only block (_enter_counters)
    _lean = False  # its block may open by _enter_lean (set by __init__)
    _ended = False  # _finish_lean ended the block (see _cleanup)
    _return_armed = None  # the trace function of _arm_return_scan, while armed
    _return_frame = None  # (the frame it traces, its trace function, its f_trace_lines before), while armed
    _return_scan = None
    _fail0 = 0  # CPU: allocations that had failed when the block opened (_C.counters_last_failure)
    _oom = None  # while an out-of-memory error closes the block: what the post-mortem needs
    _scope = None
    _raw = None  # its scope by its own C calls (cpu._CallScope), until a Scope is made
    _marks = None
    _ctrace = None
    _cuda_specs = ()

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: Any = None, device: str | torch.device = "auto",
        timeline: bool = False, modules: bool = True, leaks: bool = True, warmup: int = 1, largest: int = 0,
    ) -> None:  # fmt: skip
        if (
            model is None and optimizer is None and timeline is False and modules is True and leaks is True
            and warmup.__class__ is int and warmup == 1 and largest.__class__ is int and largest == 0
            and (device is None or (device.__class__ is str and (device == "auto" or device == "cpu")))
        ):  # fmt: skip
            # the common `with memtorch.track():` of a loop (a block per step): counters on the CPU, the
            # general path's checks and parsing answered already (see _enter_counters)
            if _torch_mod is None:  # torch loaded, as the general path loads it
                _torch()
            self._args = {"device": device, "timeline": False, "modules": True, "leaks": True, "warmup": 1,
                          "largest": 0}
            self.__dict__.update(_COUNTERS_ONLY)
            return
        torch = _torch_mod or _torch()
        if model is not None and not isinstance(model, torch.nn.Module):
            if callable(model) and not isinstance(model, type) and optimizer is None:
                raise TypeError(
                    "memtorch.track is used as a decorator with parentheses: write @memtorch.track() "
                    f"(or @memtorch.track(model, optimizer)), not @memtorch.track, above {getattr(model, '__name__', 'the function')}"
                )
            raise TypeError(f"track(model=...) expects a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None:
            optimizer = _unwrap_optimizer(optimizer, "track")
        if not _count_ok(warmup):
            raise ValueError(f"track(warmup=...) expects an int >= 0, got {warmup!r}")
        if not _count_ok(largest):
            raise ValueError(f"track(largest=...) expects an int >= 0, got {largest!r}")
        if type(timeline) is not bool or type(modules) is not bool or type(leaks) is not bool:  # noqa: E721
            for flag, value in (("timeline", timeline), ("modules", modules), ("leaks", leaks)):
                if not isinstance(value, bool):
                    raise TypeError(f"track({flag}=...) expects True or False, got {value!r}")
        self._plan = None if model is None else _plan_of(model)  # this block's; see _model_plan
        self._plan_fresh = self._plan is not None
        first = None if model is None else self._plan.first()
        if first is not None and first.is_meta:
            raise DeviceUnavailable(_META_HINT)
        # the decorator's arguments; model and optimizer only by weakref
        self._args = dict(device=device, timeline=timeline, modules=modules, leaks=leaks, warmup=warmup, largest=largest)
        self._model = None if model is None else weakref.ref(model)
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        self._kind, self._index = _parse_device(device, first)
        del first
        self._timeline = bool(timeline)
        self._lean = (
            self._kind == "cpu" and not timeline and (model is not None or optimizer is not None)
            and sys.platform.startswith("linux")  # event-log mode's (see __enter__)
        )  # fmt: skip
        self._modules_on = bool(modules) and model is not None
        self._leaks = bool(leaks)
        self._warmup = warmup
        self._largest = largest

    # -- counters ----------------------------------------------------------
    # CUDA: every read of torch's counters is a torch.cuda.memory_stats call (~40 us with the
    # Python around it on an H200), so a block reads them only where a figure needs them: at
    # its open and close, at phase boundaries (one read shared by the phase that ends and the
    # one that begins) and at t.step(); never at module boundaries (see _model_rows).
    def _read_cuda(self):
        """One read of the device's counters, given to every open CUDA scope as a sample."""
        r = cuda._read(self._index)
        for o in self._cuda_open:
            o.see(r)
        return r

    def _open_scope(self, timeline=False, reading=None, known=None, keep_events=True):
        """Open a counter scope; CUDA: from ``reading`` (a _read_cuda() the caller shares) or a new read;
        CPU: ``known``, storages made before counting began that it counts from (_known_storages);
        keep_events=False: the event log is recorded (timeline=True) for the report alone, which reads it
        whole at the close (_finish), so the scope does not read its timeline again."""
        if self._kind == "cpu":
            s = cpu.Scope(timeline=timeline)
            s._known = known
            s._keep_events = keep_events
            s.__enter__()
            return s
        r = self._read_cuda() if reading is None else reading  # a sample for the enclosing scopes too
        s = cuda.Scope(timeline=timeline, _index_checked=self._index)  # checked by _parse_device
        s.open(r)
        self._cuda_open.append(s)
        return s

    def _open_part_scope(self, reading=None):
        """A scope of a part of the block (a step, a phase, a module's call), which only _close_scope reads:
        on the CPU while counting is held, by its own C calls (no Scope object); else _open_scope's."""
        if self._kind == "cpu" and cpu._held:
            try:
                return cpu._CallScope()
            except RuntimeError:  # another thread stopped counting meanwhile: the Scope's own path
                pass
        return self._open_scope(reading=reading)

    def _close_scope(self, s, reading=None):
        """Close ``s`` (CUDA: at ``reading``, a shared _read_cuda(), or a new read);
        returns (start, end, peak, exact)."""
        if self._kind == "cpu":
            if type(s) is cpu._CallScope:  # noqa: E721
                return s.close()[:4]
            s.close()  # its end is current at the close (the close reads it once, with the hooks' check)
            return s._start, s._end, s._peak, bool(s._exact)  # what close() read (s.exact: False unless exact)
        r = self._read_cuda() if reading is None else reading
        s.close(r)
        if s in self._cuda_open:
            self._cuda_open.remove(s)
        return s.start, s._end, s.peak, s.exact

    def _shared_read(self):
        """CUDA: one _read_cuda() for several scopes closed and opened at one point; CPU: None."""
        return self._read_cuda() if self._kind == "cuda" else None

    def _sample(self):
        """Feed one reading to every open CUDA scope (CPU scopes count every allocation)."""
        if self._kind == "cuda" and self._cuda_open:
            self._read_cuda()

    def _current(self):
        if self._kind == "cpu":
            return self._scope.current
        return cuda._read(self._index).allocated

    # -- phases ------------------------------------------------------------
    def _clock_ns(self):
        """Now on the clock of this block's timeline (CPU event log: CLOCK_MONOTONIC; CUDA: perf_counter)."""
        return time.monotonic_ns() if self._kind == "cpu" else time.perf_counter_ns()

    # Event-log mode: the phases are _C.ModuleMarks's (marks.c), which begins and ends them
    # from its hooks; their figures come from the event log's marks at the end. Else a
    # counter scope per phase, begun and ended by the Python hooks below.
    def _begin_phase(self, name, counted=True):
        """counted=False: the same call of the phase going on (the optimizer's update resumed after its
        step's closure; the forward pass going on in another module: _pre)."""
        r = self._shared_read()  # CUDA: the phase that ends and this one share one read
        self._end_phase(r)
        if self._ctrace is not None:
            self._ctrace.marks.append((time.time_ns(), _cuda_trace.PHASE, attribution.PHASE_CODES[name]))
        if name not in self._phases:
            self._phases[name] = PhaseStats(name)
        self._phase = (name, self._open_part_scope(reading=r), time.perf_counter(), counted)
        if self._timeline:
            self._tl_marks.append((self._clock_ns(), "phase", name))

    def _end_phase(self, reading=None):
        if self._marks is not None:
            self._marks.end_phase()
            return
        ph = self._phase
        if ph is None:
            return
        self._phase = None
        if self._ctrace is not None:
            self._ctrace.marks.append((time.time_ns(), _cuda_trace.PHASE_END, 0))
        name, s, t0, counted = ph
        if self._timeline:
            self._tl_marks.append((self._clock_ns(), "end", name))
        start, end, peak, exact = self._close_scope(s, reading)
        p = self._phases[name]
        if counted:
            p._add(start, end, peak, exact, time.perf_counter() - t0)
        else:
            p._add_bytes(start, end, peak, exact)
            p.seconds += time.perf_counter() - t0

    def _top_tag(self):
        """The owner tag now (event-log mode): the innermost running module's, else the
        block's with its phase."""
        m = self._marks
        return self._tagbase if m is None else m.top()

    def _root_pre(self):
        self._root_depth += 1
        if self._root_depth == 1:
            self._forwards += 1
            self._begin_phase("forward")

    def _root_post(self):
        self._root_depth -= 1
        if self._root_depth == 0:
            self._forward_ended()

    def _forward_ended(self, counted=True):
        if _torch_mod.is_grad_enabled():  # loaded: the block is open
            self._begin_phase("backward", counted)  # ends "forward" (CUDA: at the same read)
        else:
            self._end_phase()

    def _opt_pre(self, optimizer, args, kwargs):
        self._begin_phase("optimizer")
        if self._ctrace is not None:  # the gradients, named while they live (zero_grad may free them)
            self._ctrace.names.append((time.time_ns(), self._cuda_names(full=False, state=False)))
        if len(args) > 1 or kwargs:  # step(closure): see _closure_args
            return _closure_args(weakref.ref(self), args, kwargs)
        return None

    def _opt_post(self, optimizer, args, kwargs):
        self._end_phase()
        ct = self._ctrace
        if ct is not None and len(optimizer.state) != ct.state_n:  # new state (the first step's)
            ct.names.append((time.time_ns(), self._cuda_names(full=False, grads=False)))

    def _pause_optimizer(self):
        """The closure of an optimizer step begins: the optimizer phase ends (_in_step)."""
        if self._open and not self._quick:
            self._end_phase()

    def _resume_optimizer(self):
        """The closure of an optimizer step returned: the optimizer phase again (_in_step)."""
        if not self._open or self._quick:
            return
        if self._marks is not None:
            self._marks.resume_optimizer()
        else:
            self._begin_phase("optimizer", counted=False)

    # An optimizer not given to the block (track(model) around a framework's loop that makes
    # its own): the first optimizer whose step updates the model's parameters is the block's
    # from that step on, seen through torch's global step hooks (every optimizer's step runs
    # them; the others are let through untouched).
    def _hook_any_optimizer(self):
        optim_mod = sys.modules["torch.optim.optimizer"]
        self._adopting = True
        self._foreign = weakref.WeakSet()
        # behind _skip_traced: a compiled opt.step() traces them
        self._handles.append(optim_mod.register_optimizer_step_pre_hook(_skip_traced(self._any_opt_pre)))
        self._handles.append(optim_mod.register_optimizer_step_post_hook(_skip_traced(self._any_opt_post)))

    def _adopted(self, opt):
        """True when ``opt`` is the block's optimizer, made so if it is the first to step the
        model's parameters."""
        if not self._adopting or not self._open:
            return False
        ref = self._optimizer
        if ref is not None:
            return ref() is opt
        if opt in self._foreign:
            return False
        model = None if self._model is None else self._model()
        plan = None if model is None else self._model_plan(model)
        del model
        mine = set() if plan is None else {id(r()) for _, r, _ in plan.params}
        for group in opt.param_groups:
            if any(id(p) in mine for p in group["params"]):
                self._optimizer = weakref.ref(opt)
                return True
        self._foreign.add(opt)
        return False

    def _any_opt_pre(self, opt, args, kwargs):
        if not self._adopted(opt):
            return None
        m = self._marks
        return self._opt_pre(opt, args, kwargs) if m is None else m.opt_pre(opt, args, kwargs)

    def _any_opt_post(self, opt, args, kwargs):
        if self._adopted(opt):
            m = self._marks
            (self._opt_post if m is None else m.opt_post)(opt, args, kwargs)

    def _root_kwargs(self, hook_id):
        """Event-log mode: the root's forward pre-hook (global, id ``hook_id``) is called with the
        forward's kwargs too (torch calls a pre-hook with them when its id is in the module's
        _forward_pre_hooks_with_kwargs), so that a batch given as ``model(**batch)`` is named.
        The entry goes with the block's hooks."""
        model = None if self._model is None else self._model()
        d = None if model is None else model.__dict__.get("_forward_pre_hooks_with_kwargs")
        del model
        if hook_id is not None and isinstance(d, dict) and hook_id not in d:
            d[hook_id] = True
            self._handles.append((d, hook_id, None))

    # -- names for at_peak --------------------------------------------------
    def _walk_names(self, full=True, grads=True, state=True):
        """{address: (name, kind, None, shape, dtype)} of the model's parameters, buffers and
        gradients and the optimizer's state (one read of each; no reference kept).

        full=False (the walks inside the block): only gradients and optimizer state, over
        the parameters the first full walk listed. full=True (a block's start): the names
        of the parameters, buffers and optimizer state come from the model's plan when the
        counters show every one of those storages is still the very allocation named last
        time (same address, same allocation number) and the optimizer has no new state;
        else they are read again. Gradients are always read. Event-log mode only: the
        parameters walked and the optimizer's state count are the block's marks' (marks.c
        walks them again in the optimizer's hooks)."""
        m = self._marks
        shape = 0 if self._largest else 16  # shapes and dtypes only for largest=
        opt = None if self._optimizer is None else self._optimizer()
        st_all = None if opt is None or not (state or full) else opt.state
        if st_all is not None:
            m.state_n = len(st_all)
            if not isinstance(st_all, dict):  # an optimizer of its own kind: read as a dict
                st_all = dict(st_all)
        if not full and m.params is not None:
            del opt
            names = {}
            _C.names_walk(names, m.params, st_all, (2 if grads else 0) | 4 | shape)
            return names
        model = None if self._model is None else self._model()
        plan = None if model is None else self._model_plan(model)
        del model
        cache = None if plan is None else plan.names
        if (
            cache is not None and (None if cache[0] is None else cache[0]()) is opt and cache[1] == m.state_n
            and cache[2] == shape and cpu._counters_serials(cache[4]) == cache[5]
        ):  # fmt: skip
            del opt
            m.params = cache[3]
            names = dict(cache[6])
        else:
            params = [] if plan is None else list(plan.params)
            names = {}
            if plan is not None:
                _C.names_walk(names, plan.buffers, None, 1 | 8 | shape)
            if opt is not None:
                known = {id(r()) for _, r, _ in params}
                for gi, group in enumerate(opt.param_groups):
                    for pi, p in enumerate(group["params"]):
                        if id(p) not in known:
                            name = f"param_groups[{gi}][{pi}]"
                            params.append((name, weakref.ref(p), name + ".grad"))
            m.params = params
            # in C: the names of the parameters and their optimizer state
            _C.names_walk(names, params, st_all, 1 | 4 | shape)
            if plan is not None:
                addrs = list(names)
                plan.names = (
                    None if opt is None else weakref.ref(opt), m.state_n, shape, params, addrs,
                    cpu._counters_serials(addrs), dict(names),
                )  # fmt: skip
            del opt
        _C.names_walk(names, m.params, None, 2 | shape)  # the gradients
        return names

    def _cuda_names(self, full=True, grads=True, state=True):
        """{address: (name, kind, None, shape, dtype)} for CUDA at_peak (no ModuleMarks there):
        with full, the parameters and buffers and the optimizer's state; else the gradients
        (grads) and the optimizer's state (state). One read of each; no reference kept."""
        ct = self._ctrace
        shape = 0 if self._largest else 16
        opt = None if self._optimizer is None else self._optimizer()
        st = None
        if opt is not None and (state or full):
            st = opt.state if isinstance(opt.state, dict) else dict(opt.state)
            ct.state_n = len(st)
        names = {}
        if full or ct.params is None:
            model = None if self._model is None else self._model()
            plan = None if model is None else self._model_plan(model)
            del model
            params = [] if plan is None else list(plan.params)
            if plan is not None:
                _C.names_walk(names, plan.buffers, None, 1 | 8 | shape)
            if opt is not None:
                known = {id(r()) for _, r, _ in params}
                for gi, group in enumerate(opt.param_groups):
                    for pi, p in enumerate(group["params"]):
                        if id(p) not in known:
                            name = f"param_groups[{gi}][{pi}]"
                            params.append((name, weakref.ref(p), name + ".grad"))
            ct.params = params
            _C.names_walk(names, params, st, 1 | 4 | shape)
        elif state and st is not None:
            _C.names_walk(names, ct.params, st, 4 | shape)
        del opt
        if grads:
            _C.names_walk(names, ct.params, None, 2 | shape)
        return names

    # -- modules -----------------------------------------------------------
    # A forward pre-hook and an always-called forward hook on each module of the model, in the
    # module's own hook dicts (_add_module_hooks; ModuleMarks.install in event-log mode): torch's
    # global hooks would make torch warn on every call of a torch.compile'd module. They go
    # straight into the dicts when torch keeps them where 2.x does (_add_hook), behind
    # _skip_traced. A module's forward run inside autograd's backward is a recomputation
    # (torch.utils.checkpoint): counted apart from its forwards, and no forward of the model.

    def _pre(self, module, args):  # the counter-scope hooks; event-log mode has _C.ModuleMarks.pre
        k = id(module)
        i = self._ids.get(k)
        again = (i is not None or k == self._root_id) and _in_backward()
        if i is not None and not again:
            if not self._depth and not self._root_depth and k != self._root_id and self._top is None:
                # a forward of the model's begins while none of its modules runs (as marks.c): before
                # the root ever ran, this module is the root from now on; after, the same pass goes on
                if not self._forwards:
                    self._root_id = k
                else:
                    self._top = k
                    if self._phase is None or self._phase[0] != "forward":
                        self._begin_phase("forward", counted=False)
            self._depth += 1
        if k == self._root_id and not again:
            self._root_pre()
            if self._ctrace is not None:  # the batch, by name
                self._ctrace.names.append((time.time_ns(), _cuda_trace.input_names(args, _torch_mod.Tensor)))
        if i is not None:
            if self._ctrace is not None:
                self._ctrace.marks.append((time.time_ns(), _cuda_trace.ENTER, i))
            if self._kind != "cuda":  # CUDA: no counter read per module (see _model_rows)
                self._mod_stack.append((i, self._open_part_scope(), again))

    def _post(self, module, args, output):  # never keeps ``output``
        k = id(module)
        i = self._ids.get(k)
        again = (i is not None or k == self._root_id) and _in_backward()
        if i is not None:
            if self._ctrace is not None:
                self._ctrace.marks.append((time.time_ns(), _cuda_trace.EXIT, i))
            stack = self._mod_stack  # empty on CUDA
            for j in range(len(stack) - 1, -1, -1):
                if stack[j][0] == i and stack[j][2] == again:
                    _, s, _ = stack.pop(j)
                    self._record_module(i, s, again)
                    break
            if not again and self._depth:
                self._depth -= 1
                if k == self._top and not self._depth:
                    self._top = None
                    self._forward_ended(counted=False)
        if k == self._root_id and not again:
            self._root_post()

    def _record_module(self, i, s, again=False):
        start, end, peak, exact = self._close_scope(s)
        row = self._mod_rows[i]
        if again:  # a recomputation: apart from the forwards
            row.recomputed += 1
            row.recomputed_total += end - start
            row.exact = row.exact and exact
            return
        row.calls += 1
        row._measured += 1
        row.activation_total += end - start
        row.peak_above_start = max(row.peak_above_start, peak - start)
        row.exact = row.exact and exact

    def _install_hooks(self):
        model = None if self._model is None else self._model()
        opt = None if self._optimizer is None else self._optimizer()
        direct = None if self._marks is None else _hook_dicts()
        opt_direct = None if opt is None or direct is None else _opt_hook_dicts(opt)
        if direct is not None and (opt is None or opt_direct is not None):
            # event-log mode: all of the block's hooks in C, put in and taken out in one call each
            # (the model's modules were given to the marks when they were made: __enter__), on
            # each module of the model (its own hook dicts), behind _skip_traced's wrappers
            m = self._marks
            self._marks.install(
                None if model is None else self._hooked_modules(model),
                *(opt_direct if opt is not None else (None, None)),
                tuple(_skip_traced(h) for h in (m.pre, m.post, m.opt_pre, m.opt_post)), direct[3],
            )  # fmt: skip
            self._handles.append(self._marks)
            if model is not None:
                self._root_kwargs(self._marks.pre_id)
                if opt is None:
                    self._hook_any_optimizer()
            return
        if model is not None:
            if self._marks is None:
                self._hook_model(model)
            else:  # the marks have the model's modules already (__enter__)
                self._root_kwargs(self._add_module_hooks(self._marks.pre, self._marks.post))
            if opt is None:
                self._hook_any_optimizer()
        del model
        if opt is not None:
            self._hook_optimizer(opt)

    def _model_plan(self, model):
        """The model's _Plan, checked once per block (its hooks and walks share it)."""
        plan = self._plan
        if plan is None or plan.mods[0]() is not model:
            plan = self._plan = _plan_of(model)
        return plan

    def _hooked_modules(self, model):
        """Weakrefs of the modules that get the block's forward hooks: each module of the model
        with per-module rows, else the root only (its forward makes the phases)."""
        mods = self._model_plan(model).mods
        return mods if self._ids else mods[:1]

    def _model_rows(self, model):
        """The model's root and its modules' rows (event-log mode: made when the report is first read)."""
        self._root_id = id(model)
        # CUDA: no per-module rows. A read of torch's counters at each module's entry and exit
        # cost up to half of a GPU step (ResNet-18 on an H200: 160 reads, ~6.6 ms of 14 ms); the
        # rows would be inexact anyway wherever the device's peak did not rise. The report says so.
        # With the allocator's history on (CUDA at_peak) the modules are still marked, by time
        # only: the attribution needs their entries and exits, not a counter read.
        if self._modules_on and (self._kind == "cpu" or self._ctrace is not None):
            plan = self._model_plan(model)
            if self._evmode:
                self._mod_specs = plan.specs
            elif self._kind == "cpu":
                self._mod_rows = [ModuleStats(*spec) for spec in plan.specs]
            else:
                self._cuda_specs = plan.specs
            self._ids = plan.ids

    def _hook_model(self, model):
        """The model's rows and hooks: a block's start without marks, or a model given by watch()."""
        self._model_rows(model)
        m = self._marks
        if m is not None:  # in C: tags and marks of the model's modules, the phases, the batch's names
            m.set_model(self._ids, self._root_id)
        if m is None and not self._ids:
            # no per-module rows (CUDA): hooks on the root only, for the phases. A global module
            # hook would send every module of the process through torch's slow call path.
            self._handles.append(model.register_forward_pre_hook(_skip_traced(self._pre)))
            self._handles.append(model.register_forward_hook(_skip_traced(self._post), always_call=True))
            return
        pre, post = (self._pre, self._post) if m is None else (m.pre, m.post)
        pre_id = self._add_module_hooks(pre, post)
        if m is not None:
            self._root_kwargs(pre_id)

    def _add_module_hooks(self, pre, post):
        """pre and post (always called) on each module of the model, in its own hook dicts
        (torch's global ones make torch warn on every call of a compiled module), first
        among the module's hooks as global ones would run; behind _skip_traced. Returns the
        id of the root's pre-hook (None: no model)."""
        model = None if self._model is None else self._model()
        if model is None:
            return None
        mods = [r() for r in self._hooked_modules(model)]
        del model
        pre, post = _skip_traced(pre), _skip_traced(post)
        direct = _hook_dicts()
        pre_id = None
        for mod in mods:
            dicts = None if mod is None or direct is None else _module_hook_dicts(mod)
            if dicts is not None:
                _add_hook(self._handles, dicts[0], pre, front=True)
                i = self._handles[-1][1]
                _add_hook(self._handles, dicts[1], post, dicts[2], front=True)  # as always_call=True
            elif mod is not None:
                handle = mod.register_forward_pre_hook(pre, prepend=True)
                self._handles.append(handle)
                i = handle.id
                self._handles.append(mod.register_forward_hook(post, prepend=True, always_call=True))
            else:
                continue
            if pre_id is None:  # the plan's first module is the root
                pre_id = i
        return pre_id

    def _hook_optimizer(self, opt):
        m = self._marks  # event-log mode: the phase and the gradients' and new state's names in C
        pre, post = (self._opt_pre, self._opt_post) if m is None else (m.opt_pre, m.opt_post)
        pre, post = _skip_traced(pre), _skip_traced(post)  # a compiled opt.step() traces them
        direct = _opt_hook_dicts(opt)
        if direct is not None:
            _add_hook(self._handles, direct[0], pre)
            _add_hook(self._handles, direct[1], post)
        else:
            self._handles.append(opt.register_step_pre_hook(pre))
            self._handles.append(opt.register_step_post_hook(post))

    def watch(self, model: torch.nn.Module | None = None, optimizer: Any = None) -> Tracker:
        """Give the block the model and/or optimizer to name (phases, per-module figures,
        at_peak names), also once it is open (the pytest fixture's tracker is). Returns self."""
        torch = _torch()
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch(model=...) expects a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None:
            optimizer = _unwrap_optimizer(optimizer, "watch")
        if model is not None and self._model is not None:
            raise MemtorchError("this tracker already watches a model: one model per block")
        if optimizer is not None and self._optimizer is not None:
            raise MemtorchError("this tracker already watches an optimizer: one optimizer per block")
        if model is not None and _on_meta(model):
            raise DeviceUnavailable(_META_HINT)
        if model is not None:
            self._model = weakref.ref(model)
            self._modules_on = bool(self._args["modules"])
        if optimizer is not None:
            self._optimizer = weakref.ref(optimizer)
            self._adopting = False  # given: its own hooks from here on
        if self._open:
            if self._quick and (model is not None or optimizer is not None):
                self._full_state()  # phases and modules from here on (the event log only if it ran from the start)
            if model is not None:
                self._hook_model(model)
                if self._optimizer is None and not self._adopting:  # found at its first step
                    self._hook_any_optimizer()
            if optimizer is not None:
                self._hook_optimizer(optimizer)
            if self._evmode:  # what lives now, by name
                self._marks.params = None
                self._marks.snapshot(self._walk_names())
        return self

    def _remove_hooks(self):
        handles = self._handles
        while handles:
            h = handles.pop()
            if type(h) is tuple:  # noqa: E721  (_add_hook's)
                hooks, i, always = h
                hooks.pop(i, None)
                if always is not None:
                    always.pop(i, None)
            elif type(h) is _C.ModuleMarks:  # noqa: E721  (its install())
                h.uninstall()
            else:
                h.remove()

    # -- block -------------------------------------------------------------
    def _reset_state(self):
        """The per-block state of the general path (phases, modules, steps, event log)."""
        d = self.__dict__
        if "_handles" in d:  # a Tracker whose block opened before: the immutable part back to the class's
            d.update(_FRESH)
        d["_handles"] = []
        d["_cuda_open"] = []
        d["_phases"] = {}  # name -> PhaseStats, made when the phase first begins
        d["_mod_rows"] = []
        d["_mod_stack"] = []
        d["_snapshots"] = []  # event-log mode: [(log index, {address: name...})] walks
        d["_ids"] = {}  # id(module) -> row index, for the model's modules
        d["_boundaries"] = []
        d["_tl_marks"] = []  # timeline=True: (clock ns, kind, label) of phase starts/ends and steps
        d["_step_series"] = []  # [(peak, end)] per step
        d["_step_lower"] = set()  # CUDA: the steps (0-based) whose peak is a lower bound (cuda.block_peak)

    def __enter__(self) -> Tracker:
        if self._open:
            raise MemtorchError("this track() block is already open; use a new memtorch.track() to nest blocks")
        self._fail0 = cpu._counters_last_failure()[0]  # allocations that had failed before: not this block's
        if (
            self._model is None and self._optimizer is None and not self._with_log and not self._timeline
            and not self._largest and self._kind == "cpu"
        ):  # fmt: skip
            return self._enter_counters()
        if self._lean and cpu._held and self._enter_lean():
            return self
        self._open = True
        self._quick = False
        if not self._plan_fresh:  # a decorator's Tracker: the model may have changed since
            self._plan = None
        self._plan_fresh = False
        self._report = None
        self._reset_state()
        # Event-log mode: with exact counters on Linux, module hooks only take a timestamp
        # and the per-module figures come from the block's event log at the end (a Scope
        # per module call costs several microseconds). Same clock: CLOCK_MONOTONIC.
        self._evmode = (
            (self._model is not None or self._optimizer is not None or self._with_log)
            and self._kind == "cpu" and sys.platform.startswith("linux") and (cpu._held or cpu.exact())
        )  # fmt: skip
        self._thread = threading.get_ident()
        self._t0 = time.perf_counter()
        with _lock:
            _active.append(self)
        try:
            if self._evmode:
                self._tagbase = _next_token() << attribution.TAG_BITS
            if self._kind == "cuda" and (self._model is not None or self._optimizer is not None or self._with_log):
                # at_peak: the allocator's own history for the block (restored as found at the end)
                self._ctrace = _cuda_trace.Recording.maybe_start(self._index)
            known = self._known_storages()
            if self._evmode and not self._timeline and cpu._held:
                # counting held: the scope by its own C call, its Scope made only if asked for while
                # open (_raw_scope) or with the report (_finish); the log runs for the replay
                try:
                    self._raw = cpu._CallScope(True, known)
                except RuntimeError:  # another thread stopped counting meanwhile: the Scope's own path
                    pass
            if self._raw is None:
                self._scope = self._open_scope(timeline=self._timeline or self._evmode, known=known,
                                               keep_events=self._timeline)  # fmt: skip
                if self._evmode and not self._timeline:
                    # the log runs for this block's replay, read once at the end: the scope itself
                    # need not read it again when it closes
                    self._scope._want_timeline = False
            if self._evmode:  # storages live at the start, by address
                model = None if self._model is None else self._model()
                if model is not None:
                    self._model_rows(model)
                del model
                self._marks = _C.ModuleMarks(
                    self._ids, self._root_id or 0, self._tagbase, self._snapshots, _torch_mod.is_grad_enabled,
                    self._tl_marks if self._timeline else None, bool(self._largest),
                )  # fmt: skip
                # step(closure): the closure wrapped by _closure_args (called only for a step given arguments)
                self._marks.closure_hook = functools.partial(_closure_args, weakref.ref(self))
                # a module's forward run inside autograd's backward is a recomputation (checkpointing)
                self._marks.in_backward = _in_backward_fn()
                cpu._eventlog_mark(3, 0, self._tagbase)  # the block's own tag from its start (sites of "other")
                self._step_head = cpu._eventlog_head()  # where the first step's events begin
                self._snapshots.append((self._step_head, self._walk_names()))
            self._boundaries.append((self._scope if self._raw is None else self._raw).start)
            self._install_hooks()
            if self._ctrace is not None:  # storages live at the start, by address
                self._ctrace.names.append((time.time_ns(), self._cuda_names()))
        except BaseException:
            self._cleanup()
            raise
        return self

    def _enter_lean(self):
        """__enter__ of the common block (CPU on Linux with counting held, a model or optimizer, no
        timeline): the general path's event-log mode with its scope by its own C call, in fewer steps (a
        loop that opens a block per training step pays each one with the caches the step left cold). False
        where the general path is needed: torch's hook dicts are not where _hook_dicts and _opt_hook_dicts
        find them (nothing changed yet), or counting stopped meanwhile (what it began undone)."""
        direct = _direct[0] if _direct else _hook_dicts()
        opt = None if self._optimizer is None else self._optimizer()
        opt_direct = None if opt is None or direct is None else _opt_hook_dicts(opt)
        if direct is None or (opt is not None and opt_direct is None):
            return False
        if not self._plan_fresh:  # a decorator's Tracker: the model may have changed since
            self._plan = None
        self._plan_fresh = False
        model = None if self._model is None else self._model()
        plan = None if model is None else self._model_plan(model)
        self._report = None
        self._reset_state()
        self._evmode = True
        self._thread = threading.get_ident()
        self._t0 = time.perf_counter()
        with _lock:
            _active.append(self)
        token = _next_token()
        self._open = True
        self._quick = False
        try:
            try:
                self._raw = raw = cpu._CallScope(True, self._known_storages(plan, opt))
            except RuntimeError:  # another thread stopped counting meanwhile: the general path
                self._cleanup()
                return False
            self._tagbase = tagbase = token << attribution.TAG_BITS
            if model is not None:
                self._model_rows(model)
            m = self._marks = _C.ModuleMarks(
                self._ids, self._root_id or 0, tagbase, self._snapshots, _torch_mod.is_grad_enabled, None,
                bool(self._largest),
            )  # fmt: skip
            m.closure_hook = functools.partial(_closure_args, weakref.ref(self))
            m.in_backward = _in_backward_fn()
            cpu._eventlog_mark(3, 0, tagbase)  # the block's own tag from its start (sites of "other")
            self._step_head = head = cpu._eventlog_head()  # where the first step's events begin
            self._snapshots.append((head, self._walk_names()))
            self._boundaries.append(raw.start)
            # _install_hooks' event-log path: all of the block's hooks in C, in one call
            m.install(
                None if plan is None else plan.mods if self._ids else plan.mods[:1],
                *(opt_direct if opt is not None else (None, None)),
                tuple(_skip_traced(h) for h in (m.pre, m.post, m.opt_pre, m.opt_post)), direct[3],
            )  # fmt: skip
            self._handles.append(m)
            if model is not None:
                self._root_kwargs(m.pre_id)
                if opt is None:
                    self._hook_any_optimizer()
        except BaseException:
            self._cleanup()
            raise
        return True

    def _known_storages(self, plan=False, opt=False):
        """CPU: (address, bytes) of the storages of the model (parameters, buffers, gradients) and the
        optimizer (its state) that PyTorch's CPU allocator made before counting began, so that the block
        counts from what they hold (its start is not 0 B, at_peak names them, their frees are seen:
        cpu.Scope._adopt). Only storages whose memory goes back through libc10's free: resizable (the
        allocator's own; from_numpy, frombuffer, mmap'd and loaded ones are not), not in shared memory,
        not pinned (asked only once CUDA is initialized: the question initializes nothing). The
        optimizer's parameters and gradients count too (a block given only the optimizer holds them as
        the model's would). None when there is nothing to give: the first parameter (the model's, else
        the optimizer's) is counted already (one lookup), or neither model nor optimizer. ``plan`` and
        ``opt``: the model's plan and the optimizer (or None) where the caller has them."""
        if self._kind != "cpu" or (self._model is None and self._optimizer is None) or cpu._counters_open_scopes():
            return None  # another block open: the counters would refuse them (cpu.Scope._adopt)
        if opt is False:
            opt = None if self._optimizer is None else self._optimizer()
        if plan is False:
            model = None if self._model is None else self._model()
            plan = None if model is None else self._model_plan(model)
            del model
        if plan is None and opt is None:
            return None
        if plan is not None:
            first = plan.first()
        else:  # the optimizer's first parameter
            first = next((p for g in opt.param_groups for p in g["params"]), None)
        if first is not None and cpu.installed() and cpu._counters_sizes([first.data_ptr() or 0])[0] >= 0:
            return None  # made while counting: the model's (or the optimizer's) storages are counted already
        del first
        # the optimizer's parameters: the model's (once each: by address below), or all it has without one
        params = [] if opt is None else [p for g in opt.param_groups for p in g["params"]]
        tensors = []
        if plan is not None:
            params = [p for _, ref, _ in plan.params if (p := ref()) is not None] + params
            tensors += [t for _, ref in plan.buffers if (t := ref()) is not None]
        for p in params:
            tensors.append(p)
            if p.grad is not None:
                tensors.append(p.grad)
        if opt is not None:
            tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, _torch_mod.Tensor)]
        del opt, params
        cuda_on = "torch.cuda" in sys.modules and _torch_mod.cuda.is_initialized()
        known = {}
        for t in tensors:
            try:
                if t.device.type != "cpu":
                    continue
                st = t.untyped_storage()
                a, n = st.data_ptr(), st.nbytes()
                ours = a and n and a not in known and st.resizable() and not st.is_shared()
                if ours and not (cuda_on and st.is_pinned()):
                    known[a] = n
            except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass without a plain storage
                continue
        return list(known.items()) or None

    def _enter_counters(self):
        """A block of counters only (CPU, no model, optimizer, timeline or largest=), the
        common `with memtorch.track():` of a loop: one counter scope and nothing else. The
        rest of the block's state is made only if it is asked for while open (t.step(),
        watch(), t.report): _full_state()."""
        self._open = True
        self._quick = True
        self._report = None
        self._evmode = False
        self._phase = None
        self._thread = threading.get_ident()
        self._t0 = time.perf_counter()
        with _lock:
            _active.append(self)  # also what keeps an open block (and its C scope) from being collected
        try:
            if cpu._held:  # counting held: one C call, the Scope object made only if asked for
                try:
                    self._raw = cpu._CallScope()
                    return self
                except RuntimeError:  # another thread stopped counting meanwhile: the Scope's own path
                    pass
            self._scope = cpu.Scope().open()
        except BaseException:
            self._quick = False
            self._reset_state()
            self._cleanup()
            raise
        return self

    def _raw_scope(self):
        """The open cpu.Scope of a block opened by its own C call (counters-only, or event-log mode)."""
        raw, self._raw = self._raw, None
        if raw is not None:
            self._scope = raw.scope()
        return self._scope

    def _full_state(self):
        """A block asked for more while open: its Scope, and a counters-only block the general path's state."""
        self._raw_scope()
        if self._quick:
            self._quick = False
            self._reset_state()
            self._boundaries.append(self._scope.start)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> Literal[False]:
        if exc_type is None and self._quick:
            # the common `with memtorch.track():` of a loop, still counters only: _finish and _cleanup's
            # steps for it alone (a block per step closes with the caches the step left cold)
            try:
                self._report = self._finish_counters()
            finally:
                self._end_counters()
            return False
        if exc_type is not None and "torch.distributed" in sys.modules:
            # lazy: distributed loads only when this path runs (importing tracking stays cheap)
            from .distributed import note_failure

            self._failure = f"{exc_type.__name__}: {exc}"
            note_failure(exc)  # the other ranks' gather() raises instead of waiting; never raises
        found = oom.is_oom(exc) if exc_type is not None else None
        if found is not None:
            try:
                self._oom = self._oom_begin(found, exc)
            except Exception as e:  # the user's error is what matters: ours in one line
                print(f"memtorch: the out-of-memory report failed: {type(e).__name__}: {e}", file=sys.stderr)
        try:
            report = self._finish()
        except Exception:
            if exc_type is None:
                self._cleanup()
                raise
            report = None  # never replace the user's exception with ours
        self._cleanup()
        self._report = report
        if self._oom is not None:
            try:
                # an enclosing block of this thread prints it as the error leaves that block
                me = threading.get_ident()
                inner = any(t is not self and t._open and t._thread == me for t in list(_active))
                oom.attach(exc, self._oom_report(exc), show=not inner)
            except Exception as e:  # the user's error is what matters: ours in one line
                print(f"memtorch: the out-of-memory report failed: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                self._oom = None
        return False

    def _oom_begin(self, found, exc):
        """What the post-mortem needs that closing the block loses: the phase and the modules running."""
        kind, asked = found
        specs = getattr(self, "_mod_specs", ())
        stack = [words.module_label(*specs[i][:2]) if i < len(specs) else None
                 for i, *_ in getattr(self, "_mod_stack", ())]  # fmt: skip
        phase = getattr(self, "_phase", None)
        state = {"kind": kind, "asked": asked, "phase": None if phase is None else phase[0],
                 "module": stack[-1] if stack else None, "at": None, "cuda": None}  # fmt: skip
        if kind == "cuda" and self._kind == "cuda":
            try:
                state["cuda"] = oom.cuda_figures(self._index)
                state["names"] = self._cuda_names(full=True) if self._ctrace is not None else {}
            except Exception as e:  # a snapshot the allocator cannot give: the error's own figures
                state["cuda_error"] = f"{type(e).__name__}: {e}"
        return state

    def _oom_at_failure(self, ev, dropped, start, snapshots, sizes, sites):
        """CPU: the live set when posix_memalign failed, from the block's events before it (the C hook
        noted the log's head then: _C.counters_last_failure), named as at_peak names the peak's."""
        import numpy as np

        count, _size, held, head, tag, _ns = cpu._counters_last_failure()
        if count <= self._fail0:
            return  # no allocation failed in this block: the error was raised as out-of-memory by other code
        arr = np.frombuffer(ev, dtype=_log_dtype())
        arr = arr[arr["index"] < head]
        specs = list(self._mod_specs)
        nrows = 2 * len(specs) if _splits_recomputation(len(specs)) else len(specs)
        queries = list(sizes)
        token = self._tagbase >> attribution.TAG_BITS
        replayed = cpu._eventlog_replay(arr, start, dropped, -1, token, nrows, queries)
        names = [(n, t) for n, t in specs] + ([(n, t, "recomputed") for n, t in specs] if nrows > len(specs) else [])
        kept = int((arr["kind"] == 0).sum()) if dropped else len(arr)
        at = attribution.attribute(replayed, queries, kept, dropped, held, snapshots, sizes, token, names, sites=sites)
        self._oom["at"] = at
        phase, row = oom.decode_tag(tag, token)
        if phase is not None or row is not None:
            self._oom["fail_phase"] = phase
            self._oom["fail_module"] = None if row is None or row >= len(names) else words.module_label(
                *names[row][:2])

    def _oom_report(self, exc):
        """The OomReport of the error that closed this block (see memtorch.oom)."""
        # lazy: the report type loads only when an out-of-memory error closes a block
        from .reports.oom import OomReport

        st = self._oom
        notes = []
        exact = True
        held = reserved = largest = capacity = None
        at = st["at"]
        device = "cpu" if self._kind == "cpu" else f"cuda:{self._index}"
        phase, module = st["phase"], st["module"]
        if st["kind"] == "cpu" and self._kind == "cpu":
            if at is not None:
                held = at.peak
                phase, module = st.get("fail_phase", phase), st.get("fail_module", module)
            else:
                exact = False
                count, _size, held, *_ = cpu._counters_last_failure()
                if count <= self._fail0:
                    held = None
                notes.append("the block kept no event log (no model or optimizer given to track()): the bytes "
                             "held are the counters' when the allocation failed, not named")  # fmt: skip
            if self._report is not None and any(
                c.startswith(cpu.COUNTING_BEGAN) for c in self.report.caveats
            ):  # what the bytes held leave out, as the block's own report says it
                notes.append("counting began when this block opened: the bytes held count the storages allocated "
                             "since and those of the model and optimizer given to it, not others made before it "
                             "(a batch, a dataset); memtorch.cpu.start() at start-up counts them")  # fmt: skip
        elif st["cuda"] is not None:
            held, reserved, largest, blocks, capacity = st["cuda"]
            owners = {}
            named = 0
            for addr, (size, _req) in blocks.items():
                entry = st.get("names", {}).get(addr)
                if entry is not None:
                    name, kind = entry[0], entry[1]
                    b, c = owners.get((name, kind), (0, 0))
                    owners[(name, kind)] = (b + size, c + 1)
                    named += size
            if held > named:
                owners[(oom.UNNAMED, "other")] = (held - named, 0)
            at = attribution.AtPeak(held, [attribution.Owner(n, k, None, b, c, attribution.module_of(
                n, k, {s[0] for s in self._cuda_specs}) if self._cuda_specs else None)
                for (n, k), (b, c) in owners.items()], [], True, [])  # fmt: skip
            exact = False
            notes.append("the caching allocator's snapshot when the error reached the block's end: the failing "
                         "operator's own temporaries were freed by then")  # fmt: skip
            if largest is not None and st["asked"] and largest < st["asked"] < reserved - held:
                notes.append("fragmentation: the free bytes of the reserved segments would hold the request, "
                             "but no free block is that large (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                             "lets segments grow instead)")  # fmt: skip
        else:
            exact = False
            notes.append(st.get("cuda_error") or "no figures of that device in this block")
        return OomReport(device, st["asked"], held, reserved, largest, capacity, phase, module, at,
                         oom._first_line(exc), oom._rank(), exact, notes)  # fmt: skip

    def _cleanup(self):
        """Remove every hook and close every scope; never raises for a closed block."""
        self._disarm_return_scan()
        self._return_scan = None
        if self._ended:  # ended by _finish_lean: its hooks are out and its scope closed already
            self._ended = False
            self._release()
            return
        if self._quick:
            self._end_counters()
            return
        try:
            self._remove_hooks()
        finally:
            ct, self._ctrace = self._ctrace, None
            if ct is not None:
                ct.stop(read=False)  # the allocator's history as the block found it
            scopes = [s for _, s, _ in self._mod_stack]
            self._mod_stack.clear()
            if self._phase is not None:
                scopes.append(self._phase[1])
                self._phase = None
            if getattr(self, "_step_scope", None) is not None:
                scopes.append(self._step_scope)
                self._step_scope = None
            scope = getattr(self, "_scope", None)
            if scope is not None:
                scopes.append(scope)
            raw, self._raw = self._raw, None
            if raw is not None:  # event-log mode's own C scope, ended by an exception before its report
                raw.close()
            for s in scopes:
                s.close()
            self._cuda_open = []
            self._scope = None
            self._release()

    def _end_counters(self):
        """The end of a counters-only block after its report (or an exception): its scope closed if still
        open, the block released."""
        self._quick = False
        try:
            raw, self._raw = self._raw, None
            if raw is not None:  # ended by an exception before its report (_finish_counters)
                raw.close()
            elif self._scope is not None:
                self._scope.close()  # idempotent: _finish_counters closed it already
        finally:
            self._scope = None
            self._release()

    def _release(self):
        """The last of every block's end: the model's rows by id, an optimizer found rather than given
        (the next block looks again), the marks, and the block's place among the open ones."""
        self._ids = {}
        if self._adopting:
            self._adopting = False
            self._optimizer = None
        self._marks = None
        self._open = False
        with _lock:
            if self in _active:
                _active.remove(self)

    def _finish_counters(self):
        """The end of a counters-only block (see _enter_counters)."""
        seconds = time.perf_counter() - self._t0
        raw, self._raw = self._raw, None
        if raw is not None:  # its own C calls: the closed Scope is made with the report
            if not raw.end():
                return functools.partial(_make_counters_report, raw, seconds)
            self._scope = raw.scope()  # hooks lost: where they went is read now
        s = self._scope
        s.close()
        return functools.partial(_make_counters_report, s, seconds)

    def _finish(self):
        if self._quick:
            return self._finish_counters()
        if self._lean and self._evmode and self._raw is not None:
            return self._finish_lean()
        self._remove_hooks()
        while self._mod_stack:  # forwards interrupted by an exception
            i, s, again = self._mod_stack.pop()
            self._record_module(i, s, again)
        r = self._shared_read()  # CUDA: one read closes the phase, the step and the block
        self._end_phase(r)
        if self._step_scope is not None:  # the steps end at the last t.step()
            self._close_scope(self._step_scope, r)
            self._step_scope = None
        if self._evmode:
            cpu._eventlog_mark(3, 0, _outer_tag(self))  # the enclosing block's tag again, if any
            head = cpu._eventlog_head()
            m = self._marks
            self._forwards = m.forwards
            self._phases.update(_timed_phases(m))  # what marks.c timed
        ct = self._ctrace
        if ct is not None:  # the gradients and optimizer state at the end, by address
            ct.names.append((time.time_ns(), self._cuda_names(full=False)))
        calls, self._raw = self._raw, None  # event-log mode's scope by its own C calls (cpu._CallScope)
        if calls is not None:
            figures = calls.close()
            if calls.hooks_lost:  # where they went is read now (the Scope reads it)
                self._scope, calls = calls.scope(), None
        if calls is None:
            start, end, peak_bytes, exact = self._close_scope(self._scope, r)
            if self._kind == "cpu":
                s = self._scope
                ev0, other, unseen = s._ev0, (s._other_bytes, s._other_allocs), (s.unseen_frees, s.unseen_bytes)
                del s
        else:
            start, end, peak_bytes, exact, ev0, other, unseen = figures
        caveats = []  # the closed scope's, filled when the report is made (_make_report)
        if self._kind == "cuda" and self._root_id is not None and self._args["modules"]:
            caveats.append(_CUDA_NO_MODULES)
        more, row_notes = self._compiled_caveats(self._forwards)
        caveats += more
        timeline = None
        extra_marks = []
        pending = None
        if self._evmode:
            # read now (the ring and the counters move on); replayed when the report is first read
            # as bytes: the array is made at the replay
            ev, dropped, sites, snapshots, sizes = self._log_at_end(m, ev0, head, start)
            # the ring lost the oldest events (and marks): the calls and bytes the hooks counted
            totals = (m.module_totals, m.phase_deltas, m.recompute_totals) if dropped else None
            del m
            pending = functools.partial(
                _replay, ev, dropped, start, peak_bytes, snapshots, sizes,
                self._tagbase >> attribution.TAG_BITS, self._mod_rows, self._mod_specs, self._forwards,
                caveats, exact, self._phases, sites=sites, totals=totals,
                other=other,
            )  # fmt: skip
        if self._timeline:
            t, b = self._scope.timeline()
            timeline = (t - t[0] if len(t) else t, b)
            t0 = int(t[0]) if len(t) else 0
            extra_marks = [(ns - t0, kind, label) for ns, kind, label in self._tl_marks]
        seconds = time.perf_counter() - self._t0
        extra = {}  # the rank and world size are read with the report (_make_report)
        if self._kind == "cpu":
            mechanism = self._scope.mechanism if calls is None else cpu.EXACT  # what counted this block
            exact = exact and mechanism != cpu.FALLBACK
            device = "cpu"
            extra["unseen_frees"], extra["unseen_bytes"] = unseen
        else:
            mechanism = f"{cuda.MECHANISM} ({self._scope.how})"
            device = f"cuda:{self._index}"
            extra["reserved_peak"] = self._scope.reserved_peak
            if not exact:
                extra["peak_upper"] = self._scope.peak_upper
        if pending is None and self._mod_rows:
            _average_modules(self._mod_rows, self._forwards)
        if ct is not None:  # CUDA: the history read now, replayed when the report is first read
            self._ctrace = None
            pending = ct.pending(
                start, peak_bytes, exact, [ModuleStats(*spec) for spec in self._cuda_specs], caveats
            )
        leak = None
        steps = len(self._boundaries) - 1
        if steps > 0:
            growth = [b - a for a, b in zip(self._boundaries, self._boundaries[1:])]
            warm = min(self._warmup, steps)
            groups, survivors, notes = [], [], []
            self._disarm_return_scan()
            if self._scan0 is not None and leaks.judge(growth, warm)[0]:
                groups, survivors, notes = self._leak_groups(steps)
                if not groups and self._return_scan is not None and self._return_scan[0]:
                    *found, function = self._return_scan
                    groups, survivors, notes = found
                    notes = list(notes) + [f"the tensors kept were named as `{function}` returned, before the "
                                           "block ended: its locals, which held them, were gone by then"]
            self._return_scan = None
            # the steps whose survivors are named: from the scan's own step where the log says what it kept
            after = (None if self._scan0_step is None
                     else steps - self._scan0_step + (self._scan0_fresh is not None))  # fmt: skip
            leak = LeakReport(growth, warm, survivors, exact, groups, notes, after)
        largest = []
        if self._largest and pending is None:
            largest = self._scan_largest(self._largest)
        phases = self._phases
        kw = dict(
            device=device, exact=exact, mechanism=mechanism, start=start, end=end, peak=peak_bytes,
            _phases={k: phases[k] for k in PHASES if k in phases and phases[k].calls},
            _modules=self._mod_rows if pending is not None else list(self._mod_rows),  # filled at the replay
            timeline=timeline, leak=leak, _largest=largest, seconds=seconds, steps=steps, _pending=pending,
            step_series=self._step_series, _largest_n=self._largest,
            caveats=caveats, marks=extra_marks, _row_notes=row_notes, **extra,
        )  # fmt: skip
        # the TrackReport itself is made when t.report is first read (most loops never read it)
        return functools.partial(_make_report, self._scope if calls is None else calls, kw)

    def _compiled_caveats(self, forwards):
        """(caveats, row notes) of the model's torch.compile'd regions, modules without figures of their
        own (_compiled_notes); ([], []) without a model, or when there is none and the model ran or
        nothing was compiled. ``forwards``: the root's forwards the block's hooks saw."""
        model = None if self._model is None else self._model()
        if model is None:
            return [], []
        plan = self._model_plan(model)
        del model
        if not (_any_compiled(plan.mods) or (forwards == 0 and _graphs_compiled())):
            return [], []
        return _compiled_notes([(name, ref()) for (name, _), ref in zip(plan.specs, plan.mods)], forwards)

    def _log_at_end(self, m, ev0, head, start):
        """Event-log mode's end, read now (the ring and the counters move on): the block's events from
        ``ev0`` to ``head`` and the source lines of "other" (sites.c), the names walked (the gradients
        and any new optimizer state now, then the block's earlier walks, latest first) and the sizes of
        every storage they name now; the out-of-memory post-mortem from them. ``m``: the block's
        ModuleMarks. (ev, dropped, sites, snapshots, sizes)."""
        ev, dropped = cpu._eventlog_read_all(ev0, head, True)
        sites = cpu._eventlog_sites(ev0, head)
        opt = None if self._optimizer is None else self._optimizer()
        new_state = opt is not None and len(opt.state) != m.state_n
        del opt
        snapshots = [(head, self._walk_names(full=False, state=new_state))] + self._snapshots[::-1]
        self._snapshots = []
        addrs = list(set().union(*[names for _, names in snapshots]))
        sizes = dict(zip(addrs, cpu._counters_sizes(addrs)))
        if self._oom is not None and self._oom["kind"] == "cpu":
            self._oom_at_failure(ev, dropped, start, snapshots, sizes, sites)
        return ev, dropped, sites, snapshots, sizes

    def _finish_lean(self):
        """_finish of a block in event-log mode whose scope is still its own C calls (no t.step(), no
        report read while open, no timeline: _enter_lean's, a block per training step): what only the
        block's end can read (the scope's figures, the log, the gradients' names, the sizes now, whether
        a module is compiled) is read now; the rest when the report is first read (_lean_report)."""
        self._remove_hooks()
        m = self._marks
        m.end_phase()
        cpu._eventlog_mark(3, 0, _outer_tag(self))  # the enclosing block's tag again, if any
        head = cpu._eventlog_head()
        calls, self._raw = self._raw, None
        start, end, peak_bytes, exact, ev0, other, unseen = calls.close()
        if calls.hooks_lost:  # where they went is read now (the Scope reads it), as _finish does
            s = calls = calls.scope()
            s.close()
            start, end, peak_bytes, exact, ev0 = s._start, s._end, s._peak, bool(s._exact), s._ev0
            exact = exact and s.mechanism != cpu.FALLBACK
            other, unseen = (s._other_bytes, s._other_allocs), (s.unseen_frees, s.unseen_bytes)
            del s
        # the closed scope's caveats are added to these when the report is made
        caveats, row_notes = self._compiled_caveats(m.forwards)
        ev, dropped, sites, snapshots, sizes = self._log_at_end(m, ev0, head, start)
        seconds = time.perf_counter() - self._t0
        self._ended = True  # what _cleanup has left to do is little (see there)
        token = self._tagbase >> attribution.TAG_BITS
        return functools.partial(_lean_report, calls, (
            start, end, peak_bytes, exact, ev, dropped, snapshots, sizes, token, self._mod_specs, m, caveats,
            row_notes, sites, other, unseen, seconds, self._largest,
        ))  # fmt: skip

    def _snapshot(self):
        """A report of the open block so far: start, current as end, peak so far, steps."""
        self._full_state()
        s = self._scope
        extra = _rank_info()
        if self._kind == "cpu":
            start, end, peak = s.start, s.current, s.peak
            exact, mechanism, device = bool(s.exact) and cpu.exact(), cpu.mechanism(), "cpu"
        else:  # one read: the peak so far by the block's rule (exact, or bounded with its upper bound)
            r = self._read_cuda()
            p, rp = s._so_far(r)
            start, end, peak, exact = s.start, r.allocated, p.peak, p.exact
            mechanism, device = f"{cuda.MECHANISM} ({p.how})", f"cuda:{self._index}"
            extra["reserved_peak"] = rp.peak
            if not exact:
                extra["peak_upper"] = p.upper
        leak = None
        steps = len(self._boundaries) - 1
        if steps > 0:
            growth = [b - a for a, b in zip(self._boundaries, self._boundaries[1:])]
            leak = LeakReport(growth, min(self._warmup, steps), [], exact)
        return TrackReport(
            device=device, exact=exact, mechanism=mechanism, start=start, end=end, peak=max(peak, end),
            _phases={} if self._evmode else {k: v for k, v in self._phases.items() if v.calls},
            _modules=list(self._mod_rows),
            leak=leak, seconds=time.perf_counter() - self._t0, steps=steps, live=True, **extra,
        )  # fmt: skip

    def _scan_largest(self, n):
        snap = _live_tensors(self._kind)
        seen = {}
        for ref in snap.values():
            t = ref()
            if t is None:
                continue
            k = leaks.storage_key(t)
            if k not in seen:
                seen[k] = TensorInfo(t)
            del t
        return sorted(seen.values(), key=lambda s: -s.nbytes)[:n]

    # -- steps -------------------------------------------------------------
    def step(self) -> None:
        """Mark a step boundary (call it at the end of each training step)."""
        if not self._open:
            raise MemtorchError("Tracker.step() called outside its block: call it inside `with memtorch.track() as t:`")
        self._full_state()
        r = self._shared_read()  # CUDA: one read for the phase, the step's end and the next step's start
        self._end_phase(r)
        now = self._current() if r is None else r.allocated
        # the step's peak: the block's peak so far for the first step, then a scope per step
        if self._step_scope is None:
            p = None if r is None else self._scope._so_far(r)[0]
            step_peak, exact = (self._scope.peak, True) if p is None else (p.peak, p.exact)
        else:
            _, _, step_peak, exact = self._close_scope(self._step_scope, r)
            self._step_scope = None
        self._step_series.append((max(step_peak, now), now))
        if r is not None and not exact:  # CUDA: the step stayed below an older peak of the process
            self._step_lower.add(len(self._step_series) - 1)
        self._step_scope = self._open_part_scope(reading=r)
        self._boundaries.append(now)
        k = len(self._boundaries) - 1  # the step just finished, 1-based
        if self._timeline:
            self._tl_marks.append((self._clock_ns(), "step", k))
        if self._leaks and self._scan0 is None and k > self._warmup and now - self._boundaries[-2] > 0:
            # the first judged step that grew: what lives now is not a survivor of later steps
            self._scan0 = leaks.Scan(_torch().Tensor, _torch().optim.Optimizer, self._kind)
            self._scan0_step = k
            # what this step itself kept lives now too: by the event log, its storages are survivors
            self._scan0_fresh = None if self._step_head is None else _kept_since(self._step_head)
            self._arm_return_scan()
        elif self._scan0 is None and self._step_head is not None:
            self._step_head = cpu._eventlog_head()  # where the next step's events begin

    def _arm_return_scan(self):
        """Name the survivors again as the function that calls step() returns, while its locals live.

        A block that ends after that function (the pytest plugin's, around a test) would find the
        containers that kept tensors (a ``losses`` list) gone. A trace function on that one frame sees
        its return; the global one returns None for every other frame (no line events anywhere). Left
        alone when a tracer already runs (a debugger, coverage): then the block's end names what it can.
        """
        if sys.gettrace() is not None:
            return
        frame = sys._getframe(2)  # step()'s caller, outside this module
        while frame is not None and frame.f_code.co_filename.startswith(leaks._HERE):
            frame = frame.f_back
        if frame is None:
            return
        me = weakref.ref(self)
        name = frame.f_code.co_name

        def on_frame(_frame, event, _arg):
            t = me()
            if event == "return" and t is not None and t._open and t._return_armed is not None:
                t._disarm_return_scan(keep_frame=True)
                # the frame's trace function still set while its locals are read: their snapshot is
                # written back into the frame as this function returns (leaks._may_clear)
                found = t._leak_groups(len(t._boundaries) - 1)
                t._disarm_return_scan()
                t._return_scan = (*found, name)
                return None
            return on_frame

        def on_call(_frame, _event, _arg):
            return None  # no other frame is traced

        lines = frame.f_trace_lines  # put back with the trace function (a debugger's later trace reads it)
        frame.f_trace_lines = False
        frame.f_trace = on_frame
        self._return_frame = (frame, on_frame, lines)  # only while armed: the frame is running meanwhile
        del frame
        self._return_armed = on_call
        sys.settrace(on_call)

    def _disarm_return_scan(self, keep_frame=False):
        """The global trace function out, and (unless keep_frame) the armed frame's own: a frame that
        outlives the block (the function that opened it) keeps no trace function of memtorch's."""
        if self._return_armed is not None:
            if sys.gettrace() is self._return_armed:
                sys.settrace(None)
            self._return_armed = None
        if not keep_frame and self._return_frame is not None:
            frame, on_frame, lines = self._return_frame
            self._return_frame = None
            if frame.f_trace is on_frame:
                frame.f_trace = None
                frame.f_trace_lines = lines
            del frame

    def _leak_groups(self, steps):
        """Group the tensors new since the first growing step and alive now (bounded)."""
        torch = _torch()
        scan0 = self._scan0
        fresh = self._scan0_fresh or ()  # kept by the scan's own step: survivors too
        before = set()
        for ref in scan0.tensors.values():
            t = ref()
            if t is not None:
                before.add(leaks.storage_key(t))
            del t
        before.difference_update((a, "cpu") for a in fresh)
        scan = leaks.Scan(torch.Tensor, torch.optim.Optimizer, self._kind)
        notes = []
        if self._scan0_fresh is None:  # CUDA, or the log's ring wrapped in that step
            notes.append(
                f"the tensors kept are named from after step {self._scan0_step}, the first judged step that "
                "grew (the live tensors were listed then): what that step itself kept is in the growth, not named"
            )
        if scan0.stopped_early or scan.stopped_early:
            notes.append(
                f"the search for live tensors stopped early (after {leaks.SCAN_SECONDS:g} s or "
                f"{leaks.SCAN_OBJECTS:,} objects): some kept tensors may be missing"
            )
        expected = leaks.expected_keys(scan)
        if self._evmode:
            for a, named in self._walk_names().items():
                expected.setdefault((a, "cpu"), named[1])
            for a in self._marks.last_inputs:
                expected.setdefault((a, "cpu"), "the current batch (the last forward's input)")
        local_names = leaks.stack_locals()
        # the survivors: new since the first growing step, one tensor per storage
        found = []  # (weakref, key, expected or None, holder or None)
        seen = set()
        for ref in scan.tensors.values():
            t = ref()
            if t is None:
                continue
            key = leaks.storage_key(t)
            if key not in before and key not in seen:
                seen.add(key)
                exp = expected.get(key)
                holder = None
                if exp is None and id(t) in local_names:
                    if t.grad_fn is None:  # the current batch, a running value: replaced next step
                        exp = f"{local_names[id(t)]}, rebound each step"
                    else:  # it may hold every step's graph (a loss summed without .item())
                        holder = local_names[id(t)]
                found.append((ref, key, exp, holder))
            del t
        deadline = time.perf_counter() + leaks.REFERRER_SECONDS
        # graphs first: what a kept graph saves for backward is kept by that graph
        graph_leaves = set()
        graph_of = {}  # key -> [(saved storage key, bytes)] of its graph, each graph on its own
        for ref, key, exp, holder in found:
            t = ref()
            if t is not None and exp is None and t.grad_fn is not None and time.perf_counter() < deadline + 1.0:
                mine = _SavedBytes()
                _graph_bytes(t, keys={}, leaves=graph_leaves, group=mine)
                graph_of[key] = mine.examples
            del t
        saved_by_graph = {k for pairs in graph_of.values() for k, _ in pairs} - graph_leaves
        for k in saved_by_graph:  # a tensor saved by another's graph holds no graph of its own here
            graph_of.pop(k, None)
        unexpected = [r() for r, k, exp, h in found if exp is None and k not in saved_by_graph][:10_000]
        unexpected = [t for t in unexpected if t is not None]
        held_by = leaks.holders(unexpected, local_names, deadline)
        holder_cut = bool(unexpected) and time.perf_counter() > deadline
        del unexpected
        groups = {}
        infos = []
        for ref, key, exp, holder in found:
            t = ref()
            if t is None:
                continue
            has_graph = t.grad_fn is not None
            if exp is None and holder is None:
                if key in saved_by_graph:
                    holder = "saved for backward by the kept graphs"
                else:
                    holder = held_by.get(id(t))
            elif holder is not None:  # a local holding a graph: the container, if one holds it too
                holder = held_by.get(id(t)) or "held by " + holder
            gk = (str(t.dtype).replace("torch.", ""), leaks.shape_text(t), has_graph, holder, exp)
            g = groups.get(gk)
            if g is None:
                g = groups[gk] = leaks.SurvivorGroup(gk[0], gk[1], has_graph, holder, exp)
            g.count += 1
            g.nbytes += leaks.storage_nbytes(t)
            mine = graph_of.get(key, [])
            g.examples += mine
            if exp is None and len(infos) < 50:
                info = TensorInfo(t, name=holder, graph_bytes=sum(n for k, n in dict(mine).items() if k not in graph_leaves))
                infos.append(info)
            del t
        if holder_cut:
            notes.append(f"naming the containers stopped after {leaks.REFERRER_SECONDS:g} s: some are not named")
        for g in groups.values():
            # (key, bytes) of the storages this group's graphs save (parameters left out)
            g.graph_bytes = sum(n for k, n in dict(g.examples).items() if k not in graph_leaves)
            g.examples = []
        out = sorted(groups.values(), key=lambda g: (g.expected is not None, -(g.nbytes + g.graph_bytes)))
        infos.sort(key=lambda i: -(i.nbytes + (i.graph_bytes or 0)))
        return out, infos[:5], notes

    # -- report and decorator ----------------------------------------------
    @property
    def report(self) -> TrackReport:
        """The TrackReport of the finished block (of the last call when used as a decorator)."""
        if self._last is not None:
            return self._last.report
        report = self._report
        if report is None:
            if self._open:
                return self._snapshot()
            raise MemtorchError("no report: this track() block has not run (or ended with an exception)")
        if type(report) is not TrackReport:  # made when first read: see _finish
            report = self._report = report()
        return report

    def __call__(self, fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(f"memtorch.track() decorates a callable, got {type(fn).__name__}")
        args = self._args

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            model = None if self._model is None else self._model()
            optimizer = None if self._optimizer is None else self._optimizer()
            if (self._model is not None and model is None) or (self._optimizer is not None and optimizer is None):
                raise MemtorchError("the model or optimizer given to this memtorch.track() decorator no longer exists")
            inner = Tracker(model, optimizer, **args)
            del model, optimizer
            with inner:
                result = fn(*a, **kw)
            self._last = inner
            return result

        wrapper.tracker = self  # type: ignore[attr-defined]  # f.tracker: the decorator's Tracker
        return wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature

    def to_text(self) -> str:
        """print(t): its report after the block; inside it, a snapshot that says the block is still
        running (figures so far); before it, or after a block that raised, why there is no report."""
        return render("text", self)

    def to_html(self) -> str:
        """The same as HTML: the notebook's view of the Tracker."""
        return render("html", self)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        return self.to_html()

    def _describe(self):
        return f"on {self._kind}{'' if self._index is None else ':' + str(self._index)} (opened in thread {self._thread})"


# The immutable part of a block's state at its start, as class defaults: a Tracker's first block (a
# loop's block per step makes a Tracker per step) reads them there, and _reset_state puts them back on
# the instance only for a Tracker whose block opened before.
for _name, _value in _FRESH.items():
    setattr(Tracker, _name, _value)
del _name, _value


def track(
    model: torch.nn.Module | None = None, optimizer: Any = None, device: str | torch.device = "auto",
    timeline: bool = False, modules: bool = True, leaks: bool = True, warmup: int = 1, largest: int = 0,
) -> Tracker:  # fmt: skip
    """Measure the memory of a block: ``with memtorch.track(model, optimizer=opt) as t: ...``.

    Also a decorator: ``@memtorch.track()`` tracks each call, the report of the
    last call at ``f.tracker.report``. After the block, ``t.report`` is a
    TrackReport. model/optimizer add phases (forward, backward, optimizer) and,
    with modules=True, per-module figures (on the CPU; on CUDA they are not measured:
    a counter read per module boundary costs too much of a GPU step); device is "auto" (the device of the
    model's first parameter or buffer; the CPU without a model), "cpu", "cuda",
    "cuda:N" or a torch.device; timeline=True records (time,
    bytes); leaks=True judges per-step growth after ``warmup`` steps marked
    with t.step(); largest=N lists the N largest live tensors at the end (a
    scan of all live objects: about 0.1 s).
    """
    return Tracker(model, optimizer, device, timeline, modules, leaks, warmup, largest)
