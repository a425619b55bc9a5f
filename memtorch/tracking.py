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
optimizer's step pre-hook to its post-hook.

Per module (modules=True): ``activation_bytes`` is the bytes a module's forward
leaves allocated when it returns (its output plus what autograd saved for
backward, minus what it freed), summed over its calls and divided by the number
of forwards of the model; ``peak_above_start`` the largest peak above the
allocation at entry over its calls.

Steps and leaks: t.step() marks a step boundary. After ``warmup`` steps (the
first step creates gradients and optimizer state), the growth of allocated
bytes per step is the leak; when it is positive memtorch scans live tensors
(only then: a scan costs about 0.1 s) and names those created during a growing
step that are still alive at the end, and the tensors holding an autograd graph
at a step boundary (e.g. a loss summed across steps without .item()).

memtorch keeps no strong reference to the user's tensors: hooks never capture
inputs or outputs, and named survivors are held by weakref.
"""

import functools
import gc
import html
import sys
import threading
import time
import weakref

from . import cpu, cuda, units
from .errors import DeviceUnavailable, MemtorchError

__all__ = ["track", "Tracker", "TrackReport", "PhaseStats", "ModuleStats", "LeakReport", "TensorInfo"]

PHASES = ("forward", "backward", "optimizer")

_HERE = __file__.rsplit("/", 1)[0].rsplit("\\", 1)[0]  # memtorch's own folder: frames to skip
_lock = threading.Lock()
_active = []  # open Trackers, process-wide (for _debug_leftovers)


_torch_mod = None


def _torch():
    global _torch_mod
    if _torch_mod is None:
        from ._torch import torch

        _torch_mod = torch()
    return _torch_mod


def _debug_leftovers():
    """Open trackers and hook handles not removed (empty when clean)."""
    with _lock:
        found = [f"tracker {t._describe()} still open" for t in _active]
    return found


# ---------------------------------------------------------------------------
# Report objects


class PhaseStats:
    """One phase (forward, backward, optimizer) aggregated over its occurrences.

    calls: occurrences; delta: sum of (end - start) bytes; peak: the highest
    absolute bytes; peak_above_start: the largest (peak - start) of one
    occurrence; seconds: total time; exact: every peak exact.
    """

    __slots__ = ("name", "calls", "delta", "peak", "peak_above_start", "seconds", "exact")

    def __init__(self, name):
        self.name = name
        self.calls = 0
        self.delta = 0
        self.peak = 0
        self.peak_above_start = 0
        self.seconds = 0.0
        self.exact = True

    def _add(self, start, end, peak, exact, seconds):
        self.calls += 1
        self.delta += end - start
        self.peak = max(self.peak, peak)
        self.peak_above_start = max(self.peak_above_start, peak - start)
        self.seconds += seconds
        self.exact = self.exact and bool(exact)

    def __repr__(self):
        return (
            f"PhaseStats({self.name!r}, calls={self.calls}, delta={self.delta}, "
            f"peak_above_start={self.peak_above_start}, exact={self.exact})"
        )


class ModuleStats:
    """One module's forward: see the module docstring for the definitions."""

    __slots__ = (
        "name", "type", "calls", "activation_bytes", "activation_total", "peak_above_start", "exact", "_measured",
    )  # fmt: skip

    def __init__(self, name, type_name):
        self.name = name
        self.type = type_name
        self.calls = 0
        self._measured = 0  # calls whose figures are known (event-log mode can drop old events)
        self.activation_bytes = 0
        self.activation_total = 0
        self.peak_above_start = 0
        self.exact = True

    def __repr__(self):
        return (
            f"ModuleStats({self.name or '(model)'!r}, {self.type}, calls={self.calls}, "
            f"activation_bytes={self.activation_bytes}, peak_above_start={self.peak_above_start})"
        )


class TensorInfo:
    """A live tensor described without keeping it alive (``ref`` is a weakref)."""

    __slots__ = ("shape", "dtype", "device", "nbytes", "has_graph", "graph_bytes", "step", "name", "ref")

    def __init__(self, tensor, step=None, name=None, graph_bytes=None):
        self.shape = tuple(tensor.shape)
        self.dtype = str(tensor.dtype).replace("torch.", "")
        self.device = str(tensor.device)
        self.nbytes = _storage_nbytes(tensor)
        self.has_graph = tensor.grad_fn is not None
        self.graph_bytes = graph_bytes
        self.step = step
        self.name = name
        try:
            self.ref = weakref.ref(tensor)
        except TypeError:
            self.ref = None

    def describe(self):
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        text = f"{self.name or 'tensor'}: {self.dtype}[{shape}] {units.format(self.nbytes)}"
        if self.has_graph:
            text += " holds an autograd graph"
            if self.graph_bytes:
                text += f" keeping {units.format(self.graph_bytes)} of saved tensors"
        if self.step is not None:
            text += f" (created in step {self.step})"
        return text

    def __repr__(self):
        return f"TensorInfo({self.describe()})"


class LeakReport:
    """Growth of allocated bytes per step.

    steps: growth of each step (bytes, warm-up steps included); warmup: how many
    leading steps are not judged; per_step: mean growth of the judged steps
    (floor); leaking: every judged step grew; survivors: TensorInfo of tensors
    created during a growing step and alive at the end, or holding a graph at a
    step boundary.
    """

    __slots__ = ("steps", "warmup", "per_step", "leaking", "survivors", "exact")

    def __init__(self, steps, warmup, survivors, exact):
        self.steps = list(steps)
        self.warmup = warmup
        judged = self.steps[warmup:]
        self.per_step = sum(judged) // len(judged) if judged else None
        self.leaking = bool(judged) and all(g > 0 for g in judged)
        self.survivors = list(survivors)
        self.exact = exact

    def __str__(self):
        if self.per_step is None:
            return f"leak: not judged ({len(self.steps)} step(s), warm-up {self.warmup})"
        growth = ", ".join(units.format_delta(g) for g in self.steps)
        head = (
            f"leak: {units.format_delta(self.per_step)} per step after {self.warmup} warm-up step(s)"
            f"{' (LEAKING)' if self.leaking else ''}; steps: {growth}"
        )
        lines = [head] + ["  survivor " + s.describe() for s in self.survivors]
        return "\n".join(lines)

    def __repr__(self):
        return f"LeakReport(per_step={self.per_step}, leaking={self.leaking}, survivors={len(self.survivors)})"


class TrackReport:
    """What a track() block measured. All sizes are ints of bytes.

    device, exact, mechanism; start, end, delta (= end - start), peak (absolute),
    peak_above_start (peak - start: what the block itself needed at its peak);
    peak_upper (CUDA, when the peak is a lower bound: an upper bound), reserved_peak
    (CUDA); phases {name: PhaseStats}; modules [ModuleStats]; timeline
    (times_ns since the first event, bytes) NumPy arrays or None; leak
    (LeakReport or None); largest [TensorInfo]; seconds; steps.
    """

    def __init__(self, **kw):
        self.device = kw["device"]
        self.exact = kw["exact"]
        self.mechanism = kw["mechanism"]
        self.start = kw["start"]
        self.end = kw["end"]
        self.delta = self.end - self.start
        self.peak = kw["peak"]
        self.peak_above_start = self.peak - self.start
        self.peak_upper = kw.get("peak_upper")
        self.reserved_peak = kw.get("reserved_peak")
        self.phases = kw.get("phases", {})
        self.modules = kw.get("modules", [])
        self.timeline = kw.get("timeline")
        self.leak = kw.get("leak")
        self.largest = kw.get("largest", [])
        self.seconds = kw.get("seconds", 0.0)
        self.steps = kw.get("steps", 0)
        # True for a snapshot read inside the block (figures so far).
        self.live = kw.get("live", False)
        # CPU: frees the counters saw of storages allocated before counting
        # began, and their (malloc-usable) bytes: delta and peak are then
        # upper bounds. Zero when counting was already running (the default
        # after the first block: memtorch.cpu.keep_counting()).
        self.unseen_frees = kw.get("unseen_frees", 0)
        self.unseen_bytes = kw.get("unseen_bytes", 0)
        # Under an initialised torch.distributed process group: this process's rank and the world size.
        self.rank = kw.get("rank")
        self.world_size = kw.get("world_size")

    def gather(self, group=None, dst=0, timeout=60.0):
        """Every rank's figures on ``dst`` (a MultiRankReport; None elsewhere): see memtorch.distributed.gather."""
        from .distributed import gather

        return gather(self, group=group, dst=dst, timeout=timeout)

    def check(self, peak=None, delta=None, leak=None):
        """Raise memtorch.BudgetExceeded if a figure exceeds its budget (sizes as in memtorch.units.parse)."""
        from .budget import assert_budget

        assert_budget(self, peak=peak, delta=delta, leak=leak)

    # -- presentation ------------------------------------------------------
    def _summary_rows(self):
        f = units.format
        rows = [
            ("start", f(self.start), ""),
            ("end", f(self.end), units.format_delta(self.delta)),
            ("peak", f(self.peak), f"{units.format_delta(self.peak_above_start)} above start"),
        ]
        if not self.exact and self.peak_upper is not None:
            rows.append(("peak at most", f(self.peak_upper), "counters cannot be more precise (sampled)"))
        if self.reserved_peak is not None:
            rows.append(("reserved peak", f(self.reserved_peak), "held by the caching allocator"))
        if self.unseen_frees:
            rows.append((
                "unseen frees", f(self.unseen_bytes),
                f"{self.unseen_frees} free(s) of memory allocated before counting began: delta and peak may be "
                "that much too high (memtorch.cpu.start() at start-up counts from the start)",
            ))  # fmt: skip
        return rows

    def _phase_rows(self):
        return [
            (
                p.name,
                str(p.calls),
                units.format_delta(p.delta),
                units.format(p.peak_above_start) + ("" if p.exact else " (at least)"),
                f"{p.seconds * 1e3:.1f} ms",
            )
            for p in self.phases.values()
            if p.calls
        ]

    def _module_rows(self, limit=30):
        mods = self.modules
        if len(mods) > limit:
            mods = sorted(mods, key=lambda m: -m.activation_bytes)[:limit]
        return [
            (
                m.name or "(model)",
                m.type,
                str(m.calls),
                units.format(m.activation_bytes),
                units.format(m.peak_above_start) + ("" if m.exact else " (at least)"),
            )
            for m in mods
            if m.calls
        ]

    def _title(self):
        how = "exact" if self.exact else "not exact"
        return (
            f"memtorch.track on {self.device} ({how}, {self.mechanism}){' so far' if self.live else ''}; "
            f"{self.seconds * 1e3:.1f} ms"
            + (f", {self.steps} step(s)" if self.steps else "")
        )

    def __str__(self):
        out = [self._title()]
        out += _table(["", "bytes", ""], self._summary_rows())
        phases = self._phase_rows()
        if phases:
            out.append("")
            out += _table(["phase", "calls", "delta", "peak above start", "time"], phases)
        mods = self._module_rows()
        if mods:
            out.append("")
            out += _table(["module", "type", "calls", "left alive (activations)", "peak inside"], mods)
        if self.leak is not None:
            out.append("")
            out.append(str(self.leak))
        if self.largest:
            out.append("")
            out.append("largest live tensors at the end:")
            out += ["  " + t.describe() for t in self.largest]
        return "\n".join(out)

    def _repr_html_(self):
        parts = [f"<p><b>{html.escape(self._title())}</b></p>"]
        parts.append(_html_table(["", "bytes", ""], self._summary_rows()))
        phases = self._phase_rows()
        if phases:
            parts.append(_html_table(["phase", "calls", "delta", "peak above start", "time"], phases))
        mods = self._module_rows()
        if mods:
            parts.append(_html_table(["module", "type", "calls", "left alive (activations)", "peak inside"], mods))
        if self.leak is not None:
            parts.append("<pre>" + html.escape(str(self.leak)) + "</pre>")
        if self.largest:
            items = "".join(f"<li>{html.escape(t.describe())}</li>" for t in self.largest)
            parts.append(f"<p>largest live tensors at the end:</p><ul>{items}</ul>")
        return "<div>" + "".join(parts) + "</div>"

    def __repr__(self):
        return (
            f"TrackReport(device={self.device!r}, exact={self.exact}, start={self.start}, end={self.end}, "
            f"peak={self.peak}, peak_above_start={self.peak_above_start})"
        )


def _rank_info():
    """{"rank", "world_size"} under an initialised torch.distributed process group, else {}."""
    if "torch.distributed" not in sys.modules:
        return {}
    from .distributed import rank_info

    return rank_info()


def _table(header, rows):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _html_table(header, rows):
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def module_figures(times, nbytes, starts, ends, known_from=None):
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


def _storage_nbytes(t):
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # sparse, nested, meta-less wrappers
        return int(t.numel() * t.element_size())


def _storage_key(t):
    try:
        return t.untyped_storage().data_ptr(), t.device.type
    except Exception:
        return id(t), "?"


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


def _graph_bytes(t, limit=200_000):
    """Bytes of unique storages saved for backward in the graph behind ``t`` (0 without a graph).

    Leaves that require grad (parameters), and views of them saved by an op, are
    left out: the graph does not keep them alive.
    """
    Tensor = _torch().Tensor
    root = t.grad_fn
    if root is None:
        return 0
    seen_nodes = {id(root)}
    stack = [root]
    keys = {}
    leaves = set()
    while stack and len(seen_nodes) < limit:
        node = stack.pop()
        var = getattr(node, "variable", None)  # AccumulateGrad: the leaf (a parameter)
        if isinstance(var, Tensor):
            leaves.add(_storage_key(var))
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
                    k = _storage_key(v)
                    if k not in keys:
                        keys[k] = _storage_nbytes(v)
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen_nodes:
                seen_nodes.add(id(nxt))
                stack.append(nxt)
    return sum(n for k, n in keys.items() if k not in leaves)


def _local_name(frame, t):
    """The name of a local of ``frame`` bound to ``t``, or None; leaves no reference behind.

    Before Python 3.13, reading a function frame's f_locals stores a snapshot
    dict on the frame that would keep ``t`` alive after the user deletes it: that
    snapshot is emptied again (the interpreter refills it from the real locals
    before any use). From 3.13 f_locals is a live view that holds nothing.
    """
    import sys

    optimized = bool(frame.f_code.co_flags & 0x1)  # CO_OPTIMIZED: a function's fast locals
    try:
        snapshot = frame.f_locals
    except Exception:
        return None
    try:
        for k, v in snapshot.items():
            if v is t:
                return f"{k} (in {frame.f_code.co_name})"
        return None
    finally:
        if optimized and sys.version_info < (3, 13) and isinstance(snapshot, dict):
            snapshot.clear()
        del snapshot


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


# ---------------------------------------------------------------------------
# Tracker


def _parse_device(device, model):
    torch = _torch()
    if device is None or (isinstance(device, str) and device == "auto"):
        if model is not None:
            for p in model.parameters():
                return _parse_device(p.device, None)
            for b in model.buffers():
                return _parse_device(b.device, None)
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
    raise DeviceUnavailable(f"memtorch.track cannot count device type {dev.type!r}: only 'cpu' and 'cuda'")


class Tracker:
    """A track() block: context manager and decorator. See memtorch.tracking."""

    def __init__(
        self, model=None, optimizer=None, device="auto", timeline=False, modules=True, leaks=True, warmup=1, largest=0
    ):
        torch = _torch()
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"track(model=...) expects a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"track(optimizer=...) expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"track(warmup=...) expects an int >= 0, got {warmup!r}")
        if isinstance(largest, bool) or not isinstance(largest, int) or largest < 0:
            raise ValueError(f"track(largest=...) expects an int >= 0, got {largest!r}")
        # the decorator's arguments; model and optimizer only by weakref
        self._args = dict(device=device, timeline=timeline, modules=modules, leaks=leaks, warmup=warmup, largest=largest)
        self._model = None if model is None else weakref.ref(model)
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        self._kind, self._index = _parse_device(device, model)
        self._timeline = bool(timeline)
        self._modules_on = bool(modules) and model is not None
        self._leaks = bool(leaks)
        self._warmup = warmup
        self._largest = largest
        self._report = None
        self._open = False
        self._last = None  # decorator: the Tracker of the last call

    # -- counters ----------------------------------------------------------
    def _open_scope(self, timeline=False):
        if self._kind == "cpu":
            s = cpu.Scope(timeline=timeline)
            s.__enter__()
            return s
        r = cuda._read(self._index)
        for o in self._cuda_open:  # the opening read is a sample for the enclosing scopes
            o.see(r)
        s = cuda.Scope(self._index, timeline=timeline)
        s.open(r)
        self._cuda_open.append(s)
        return s

    def _close_scope(self, s):
        """Close ``s``; returns (start, end, peak, exact)."""
        if self._kind == "cpu":
            end = s.current
            s.close()
            return s.start, end, s.peak, bool(s.exact)
        r = cuda._read(self._index)
        for o in self._cuda_open:
            o.see(r)
        s.close(r)
        if s in self._cuda_open:
            self._cuda_open.remove(s)
        return s.start, s._end, s.peak, s.exact

    def _sample(self):
        """Feed one reading to every open CUDA scope (CPU scopes count every allocation)."""
        if self._kind == "cuda" and self._cuda_open:
            r = cuda._read(self._index)
            for o in self._cuda_open:
                o.see(r)

    def _current(self):
        if self._kind == "cpu":
            return self._scope.current
        return cuda._read(self._index).allocated

    # -- phases ------------------------------------------------------------
    def _begin_phase(self, name):
        self._end_phase()
        self._phase = (name, self._open_scope(), time.perf_counter())

    def _end_phase(self):
        ph = self._phase
        if ph is None:
            return
        self._phase = None
        name, s, t0 = ph
        start, end, peak, exact = self._close_scope(s)
        self._phases[name]._add(start, end, peak, exact, time.perf_counter() - t0)

    def _root_pre(self):
        self._root_depth += 1
        if self._root_depth == 1:
            self._forwards += 1
            self._begin_phase("forward")

    def _root_post(self):
        self._root_depth -= 1
        if self._root_depth == 0:
            self._end_phase()
            if _torch().is_grad_enabled():
                self._begin_phase("backward")

    def _opt_pre(self, optimizer, args, kwargs):
        self._begin_phase("optimizer")

    def _opt_post(self, optimizer, args, kwargs):
        self._end_phase()

    # -- modules -----------------------------------------------------------
    # Two global module hooks per block (torch.nn.modules.module.register_module_forward_*)
    # instead of two per module: registering and removing ~50 handles per block cost more
    # than the block's own counting. They filter the model's modules by id.

    def _pre(self, module, args):
        k = id(module)
        if k == self._root_id:
            self._root_pre()
        i = self._ids.get(k)
        if i is not None:
            if self._evmode:
                self._marks.append((time.monotonic_ns(), i, 0))
            else:
                self._mod_stack.append((i, self._open_scope()))

    def _post(self, module, args, output):  # never keeps ``output``
        k = id(module)
        i = self._ids.get(k)
        if i is not None and self._evmode:
            self._marks.append((time.monotonic_ns(), i, 1))
        elif i is not None:
            stack = self._mod_stack
            for j in range(len(stack) - 1, -1, -1):
                if stack[j][0] == i:
                    _, s = stack.pop(j)
                    self._record_module(i, s)
                    break
        if k == self._root_id:
            self._root_post()

    def _record_module(self, i, s):
        start, end, peak, exact = self._close_scope(s)
        row = self._mod_rows[i]
        row.calls += 1
        row._measured += 1
        row.activation_total += end - start
        row.peak_above_start = max(row.peak_above_start, peak - start)
        row.exact = row.exact and exact

    def _record_marks(self, t, b, t_end):
        """Per-module figures from the event log and the hooks' timestamps (event-log mode)."""
        pairs = []
        open_calls = {}
        for when, i, post in self._marks:
            if not post:
                open_calls.setdefault(i, []).append(when)
            elif open_calls.get(i):
                pairs.append((open_calls[i].pop(), when, i))
        for i, starts in open_calls.items():  # interrupted forwards end with the block
            pairs += [(tp, t_end, i) for tp in starts]
        self._marks = []
        if not pairs:
            return
        # the log and the hooks share one clock only if the log's first event (the
        # block's opening) lies between the timestamps taken around the opening
        same_clock = len(t) > 0 and self._tb <= t[0] <= self._ta
        # the log starts with the opening (time, start); when the ring wrapped, the events
        # between it and the first retained one are lost: calls begun before are unknown
        dropped = getattr(self._scope, "timeline_dropped", 0)
        known_from = t[1] if dropped and len(t) > 1 else None
        tp = [p[0] for p in pairs]
        tq = [p[1] for p in pairs]
        act, pas, valid = module_figures(t, b, tp, tq, known_from)
        for (_, _, i), a, p, ok in zip(pairs, act.tolist(), pas.tolist(), valid.tolist()):
            row = self._mod_rows[i]
            row.calls += 1
            if ok:
                row._measured += 1
                row.activation_total += a
                row.peak_above_start = max(row.peak_above_start, p)
            row.exact = row.exact and ok and bool(same_clock)

    def _install_hooks(self):
        from torch.nn.modules import module as torch_module

        h = self._handles
        model = None if self._model is None else self._model()
        if model is not None:
            self._root_id = id(model)
            if self._modules_on:
                for i, (name, mod) in enumerate(model.named_modules()):
                    self._mod_rows.append(ModuleStats(name, type(mod).__name__))
                    self._ids[id(mod)] = i
            h.append(torch_module.register_module_forward_pre_hook(self._pre))
            h.append(torch_module.register_module_forward_hook(self._post, always_call=True))
        del model
        opt = None if self._optimizer is None else self._optimizer()
        if opt is not None:
            h.append(opt.register_step_pre_hook(self._opt_pre))
            h.append(opt.register_step_post_hook(self._opt_post))

    def _remove_hooks(self):
        while self._handles:
            self._handles.pop().remove()

    # -- block -------------------------------------------------------------
    def __enter__(self):
        if self._open:
            raise MemtorchError("this track() block is already open; use a new memtorch.track() to nest blocks")
        self._open = True
        self._report = None
        self._handles = []
        self._cuda_open = []
        self._phase = None
        self._phases = {name: PhaseStats(name) for name in PHASES}
        self._mod_rows = []
        self._mod_stack = []
        self._marks = []  # event-log mode: (monotonic ns, row index, 0 pre / 1 post)
        # Event-log mode: with exact counters on Linux, module hooks only take a timestamp
        # and the per-module figures come from the block's event log at the end (a Scope
        # per module call costs several microseconds). Same clock: CLOCK_MONOTONIC.
        self._evmode = (
            self._modules_on and self._kind == "cpu" and sys.platform.startswith("linux") and cpu.exact()
        )
        self._ids = {}  # id(module) -> row index, for the model's modules
        self._root_id = None
        self._root_depth = 0
        self._forwards = 0
        self._boundaries = []
        self._snap = None
        self._suspects = {}  # id -> (TensorInfo, created in a growing step)
        self._thread = threading.get_ident()
        self._t0 = time.perf_counter()
        with _lock:
            _active.append(self)
        try:
            self._tb = time.monotonic_ns()
            self._scope = self._open_scope(timeline=self._timeline or self._evmode)
            self._ta = time.monotonic_ns()
            self._boundaries.append(self._scope.start)
            self._install_hooks()
        except BaseException:
            self._cleanup()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and "torch.distributed" in sys.modules:
            from .distributed import note_failure

            self._failure = f"{exc_type.__name__}: {exc}"
            note_failure(exc)  # the other ranks' gather() raises instead of waiting; never raises
        try:
            report = self._finish()
        except Exception:
            if exc_type is None:
                self._cleanup()
                raise
            report = None  # never replace the user's exception with ours
        self._cleanup()
        self._report = report
        return False

    def _cleanup(self):
        """Remove every hook and close every scope; never raises for a closed block."""
        try:
            self._remove_hooks()
        finally:
            scopes = [s for _, s in self._mod_stack]
            self._mod_stack.clear()
            if self._phase is not None:
                scopes.append(self._phase[1])
                self._phase = None
            scope = getattr(self, "_scope", None)
            if scope is not None:
                scopes.append(scope)
            for s in scopes:
                s.close()
            self._cuda_open = []
            self._ids = {}
            self._scope = None
            self._snap = None
            self._open = False
            with _lock:
                if self in _active:
                    _active.remove(self)

    def _finish(self):
        self._remove_hooks()
        while self._mod_stack:  # forwards interrupted by an exception
            i, s = self._mod_stack.pop()
            self._record_module(i, s)
        self._end_phase()
        t_end = time.monotonic_ns()
        start, end, peak, exact = self._close_scope(self._scope)
        timeline = None
        if self._timeline or self._evmode:
            t, b = self._scope.timeline()
            if self._evmode:
                self._record_marks(t, b, t_end)
            if self._timeline:
                timeline = (t - t[0] if len(t) else t, b)
        seconds = time.perf_counter() - self._t0
        extra = _rank_info()
        if self._kind == "cpu":
            mechanism = cpu.mechanism()
            exact = exact and cpu.exact()
            device = "cpu"
            extra["unseen_frees"] = self._scope.unseen_frees
            extra["unseen_bytes"] = self._scope.unseen_bytes
        else:
            mechanism = f"torch.cuda counters ({self._scope.how})"
            device = f"cuda:{self._index}"
            extra["reserved_peak"] = self._scope.reserved_peak
            if not exact:
                extra["peak_upper"] = self._scope.peak_upper
        forwards = max(1, self._forwards)
        if self._mod_rows and 0 < self._mod_rows[0]._measured < self._mod_rows[0].calls:
            # the event log dropped the oldest forwards: average over the measured ones
            forwards = self._mod_rows[0]._measured
        for row in self._mod_rows:
            row.activation_bytes = row.activation_total // forwards
        leak = None
        steps = len(self._boundaries) - 1
        if steps > 0:
            growth = [b - a for a, b in zip(self._boundaries, self._boundaries[1:])]
            survivors = self._survivors() if self._suspects else []
            leak = LeakReport(growth, min(self._warmup, steps), survivors, exact)
        largest = []
        if self._largest:
            largest = self._scan_largest(self._largest)
        return TrackReport(
            device=device, exact=exact, mechanism=mechanism, start=start, end=end, peak=peak,
            phases={k: v for k, v in self._phases.items() if v.calls}, modules=list(self._mod_rows),
            timeline=timeline, leak=leak, largest=largest, seconds=seconds, steps=steps, **extra,
        )  # fmt: skip

    def _snapshot(self):
        """A report of the open block so far: start, current as end, peak so far, steps."""
        self._sample()
        s = self._scope
        extra = _rank_info()
        if self._kind == "cpu":
            start, end, peak = s.start, s.current, s.peak
            exact, mechanism, device = bool(s.exact) and cpu.exact(), cpu.mechanism(), "cpu"
        else:
            start, end, peak = s.start, s.current, s.peak
            exact, mechanism, device = False, f"torch.cuda counters ({s.how or 'sampled'})", f"cuda:{self._index}"
            extra["reserved_peak"] = s.reserved_peak
        leak = None
        steps = len(self._boundaries) - 1
        if steps > 0:
            growth = [b - a for a, b in zip(self._boundaries, self._boundaries[1:])]
            leak = LeakReport(growth, min(self._warmup, steps), [], exact)
        return TrackReport(
            device=device, exact=exact, mechanism=mechanism, start=start, end=end, peak=max(peak, end),
            phases={k: v for k, v in self._phases.items() if v.calls}, modules=list(self._mod_rows),
            leak=leak, seconds=time.perf_counter() - self._t0, steps=steps, live=True, **extra,
        )  # fmt: skip

    def _scan_largest(self, n):
        snap = _live_tensors(self._kind)
        seen = {}
        for ref in snap.values():
            t = ref()
            if t is None:
                continue
            k = _storage_key(t)
            if k not in seen:
                seen[k] = TensorInfo(t)
            del t
        return sorted(seen.values(), key=lambda s: -s.nbytes)[:n]

    # -- steps -------------------------------------------------------------
    def step(self):
        """Mark a step boundary (call it at the end of each training step)."""
        if not self._open:
            raise MemtorchError("Tracker.step() called outside its block: call it inside `with memtorch.track() as t:`")
        self._end_phase()
        self._sample()
        now = self._current()
        self._boundaries.append(now)
        k = len(self._boundaries) - 1  # the step just finished, 1-based
        if not self._leaks:
            return
        if k > self._warmup and now - self._boundaries[-2] > 0:
            self._probe(k)
        else:
            self._snap = None

    def _probe(self, k):
        """Step k grew after warm-up: note tensors holding a graph, and those new since the last probe."""
        snap = _live_tensors(self._kind)
        prev = self._snap
        for key, ref in snap.items():
            t = ref()
            if t is None:
                continue
            is_new = prev is not None and (key not in prev or prev[key]() is not t)
            old = self._suspects.get(key)
            if (is_new or t.grad_fn is not None) and (old is None or old[0].ref is None or old[0].ref() is not t):
                info = TensorInfo(t, step=k)
                self._suspects[key] = (info, is_new)
            del t
        self._snap = snap

    def _survivors(self):
        """Suspects still alive: new in a growing step, or holding a graph that keeps saved tensors."""
        out = []
        for info, is_new in self._suspects.values():
            t = None if info.ref is None else info.ref()
            if t is None:
                continue
            info.has_graph = t.grad_fn is not None
            info.graph_bytes = _graph_bytes(t) if info.has_graph else None
            if is_new or info.graph_bytes:
                out.append(info)
            del t
        out.sort(key=lambda s: -(s.nbytes + (s.graph_bytes or 0)))
        for info in out[:5]:
            t = info.ref()
            if t is not None:
                info.name = _name_of(t)
            del t
        return out

    # -- report and decorator ----------------------------------------------
    @property
    def report(self):
        """The TrackReport of the finished block (of the last call when used as a decorator)."""
        if self._last is not None:
            return self._last.report
        if self._report is None:
            if self._open:
                return self._snapshot()
            raise MemtorchError("no report: this track() block has not run (or ended with an exception)")
        return self._report

    def __call__(self, fn):
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

        wrapper.tracker = self
        return wrapper

    def _describe(self):
        return f"on {self._kind}{'' if self._index is None else ':' + str(self._index)} (opened in thread {self._thread})"


def track(model=None, optimizer=None, device="auto", timeline=False, modules=True, leaks=True, warmup=1, largest=0):
    """Measure the memory of a block: ``with memtorch.track(model, optimizer=opt) as t: ...``.

    Also a decorator: ``@memtorch.track()`` tracks each call, the report of the
    last call at ``f.tracker.report``. After the block, ``t.report`` is a
    TrackReport. model/optimizer add phases (forward, backward, optimizer) and,
    with modules=True, per-module figures; device is "auto" (the device of the
    model's first parameter or buffer; the CPU without a model), "cpu", "cuda",
    "cuda:N" or a torch.device; timeline=True records (time,
    bytes); leaks=True judges per-step growth after ``warmup`` steps marked
    with t.step(); largest=N lists the N largest live tensors at the end (a
    scan of all live objects: about 0.1 s).
    """
    return Tracker(model, optimizer, device, timeline, modules, leaks, warmup, largest)
