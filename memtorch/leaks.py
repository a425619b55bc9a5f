"""Leaks across steps: judge growth over the whole run, name the tensors kept and who holds them.

Judging: the bytes allocated at each step boundary (t.step()) after the warm-up
steps. A run leaks when its net growth is positive and it grew in at least two
judged steps, or in every judged step: a tensor kept every 50th step is caught,
a cache filled once is not. One rate: the net growth over the judged steps, an
exact fraction of bytes; the evidence (steps that grew, net growth, the largest
step's growth) goes into the report.

Naming, bounded: live tensors are listed by walking the garbage collector's
objects at most twice per block (once at the first judged step that grew, to
know what lived before, and once at the end), each walk capped in time and in
objects; the report says when a walk stopped early. Survivors (new since the
first walk and still alive) are sorted into what is expected to live (the
parameters, gradients and optimizer state of every live optimizer, and tensors
bound to a local variable of a running function, as the current batch is) and
the rest, grouped by kind, with the container that holds them found by
following the garbage collector's referrers (bounded too).
"""

import gc
import sys
import time
import weakref

from .units import format_rate  # its first home: leaks.format_rate still imports
# the result types' home; their old names stay (storage_nbytes too: TensorInfo, built there from a tensor, reads it)
from .reports.leaks import LeakReport, SurvivorGroup, TensorInfo, judge, storage_nbytes

__all__ = ["LeakReport", "SurvivorGroup", "judge", "Scan", "format_rate"]

SCAN_SECONDS = 3.0  # a walk of gc objects stops after this long
SCAN_OBJECTS = 5_000_000  # ... or after this many objects
REFERRER_SECONDS = 2.0  # naming the holders of all groups stops after this long
_HERE = __file__.rsplit("/", 1)[0].rsplit("\\", 1)[0]


# ---------------------------------------------------------------------------
# Bounded scans


class Scan:
    """One bounded walk of gc objects: live tensors of a device type, optimizers, and
    whether it stopped early."""

    def __init__(self, Tensor, Optimizer, device_type, seconds=None, max_objects=None):
        seconds = SCAN_SECONDS if seconds is None else seconds
        max_objects = SCAN_OBJECTS if max_objects is None else max_objects
        self.tensors = {}  # id -> weakref
        self.optimizers = []
        self.stopped_early = False
        t0 = time.perf_counter()
        objs = gc.get_objects()
        try:
            for n, o in enumerate(objs):
                if n % 20000 == 19999 and (time.perf_counter() - t0 > seconds or n >= max_objects):
                    self.stopped_early = True
                    break
                tp = type(o)
                if issubclass(tp, Tensor):
                    try:
                        if o.device.type != device_type:
                            continue
                        self.tensors[id(o)] = weakref.ref(o)
                    except (TypeError, RuntimeError):
                        continue
                elif issubclass(tp, Optimizer):
                    self.optimizers.append(weakref.ref(o))
        finally:
            del objs
        self.seconds = time.perf_counter() - t0


def storage_key(t):
    """The identity of the storage a tensor views: (data pointer, device type); (id, "?") for tensors
    with no single storage (nested, sparse, wrappers). The one definition: tracking uses it too."""
    try:
        return t.untyped_storage().data_ptr(), t.device.type
    except Exception:  # nested, sparse and wrapper tensors have no single storage
        return id(t), "?"


def shape_text(t):
    try:
        return "x".join(str(s) for s in t.shape)
    except Exception:  # a nested tensor has no single shape
        return "nested"


def expected_keys(scan, model_names=()):
    """{storage key: what} of tensors expected to live across steps: parameters and their
    gradients (any leaf that requires grad), and every live optimizer's state."""
    out = {}
    for ref in scan.optimizers:
        opt = ref()
        if opt is None:
            continue
        try:
            for group in opt.param_groups:
                for p in group["params"]:
                    out[storage_key(p)] = "parameter"
                    if p.grad is not None:
                        out[storage_key(p.grad)] = "gradient"
            for st in opt.state.values():
                for v in st.values():
                    if hasattr(v, "untyped_storage"):
                        out.setdefault(storage_key(v), "optimizer state")
        except Exception:
            continue
    for ref in scan.tensors.values():
        t = ref()
        if t is None:
            continue
        try:
            if t.is_leaf and t.requires_grad:
                out.setdefault(storage_key(t), "parameter")
                g = t.grad
                if g is not None:
                    out.setdefault(storage_key(g), "gradient")
        except Exception:
            pass
        del t
    return out


def _may_clear(frame, optimized, snapshot):
    """Whether the f_locals ``snapshot`` of ``frame`` (a dict before Python 3.13, which would keep its
    values alive) may be emptied after reading: not where the frame has a trace function. While a trace
    function runs for a frame (a debugger's, or track()'s at the return of the function that called
    t.step()), the interpreter writes that dict back into the frame's locals when it returns, and an
    emptied one would delete them: a nested function's free variables too, the enclosing function's."""
    return optimized and sys.version_info < (3, 13) and isinstance(snapshot, dict) and frame.f_trace is None


def frame_items(frame):
    """[(name, value)] of ``frame``'s locals, leaving no reference behind where that is safe (_may_clear):
    before Python 3.13 reading f_locals keeps a snapshot dict on the frame that holds the values (a
    batch the loop that caught an out-of-memory error then deletes would stay allocated)."""
    optimized = bool(frame.f_code.co_flags & 0x1)  # CO_OPTIMIZED: a function's fast locals
    try:
        snap = frame.f_locals
    except Exception:
        return []
    try:
        return list(snap.items())
    finally:
        if _may_clear(frame, optimized, snap):
            snap.clear()
        del snap


def stack_locals(skip_prefix=_HERE, depth=50):
    """{id(object): 'local `name` of `function`'} for the locals of the running frames
    outside memtorch (leaves no reference behind)."""
    out = {}
    frame = sys._getframe(1)
    d = 0
    while frame is not None and d < depth:
        if not frame.f_code.co_filename.startswith(skip_prefix):
            for k, v in frame_items(frame):
                out.setdefault(id(v), f"local `{k}` of `{frame.f_code.co_name}`")
        frame = frame.f_back
        d += 1
    return out


def holders(tensors, local_names, deadline, max_referrers=100_000):
    """{id(tensor): "list `losses` (local of `train`)"} for the containers holding ``tensors``.

    Two passes of the garbage collector at most (gc.get_referrers of all the
    tensors at once, then of the containers found), stopped at ``deadline``
    (perf_counter): one call per tensor would walk every object each time."""
    out = {}
    if not tensors or time.perf_counter() > deadline:
        return out
    wanted = {id(t) for t in tensors}
    containers = {}  # id(container) -> (container, [tensor ids])
    for r in gc.get_referrers(*tensors)[:max_referrers]:
        if r is tensors:  # the caller's own list
            continue
        if isinstance(r, (list, tuple, set, frozenset)):
            held = [id(v) for v in r if id(v) in wanted] if len(r) < 1_000_000 else []
        elif isinstance(r, dict):
            held = [id(v) for v in r.values() if id(v) in wanted] if len(r) < 1_000_000 else []
        else:
            continue
        if held:
            containers[id(r)] = (r, held)
    if not containers or time.perf_counter() > deadline:
        return out
    names = {}
    for cid, (c, _) in containers.items():
        label = local_names.get(cid)
        if label is not None:
            name, _, fn = label.partition(" of ")
            names[cid] = f"in {type(c).__name__} {name.replace('local ', '')} (local of {fn})"
    rest = [c for cid, (c, _) in containers.items() if cid not in names]
    if rest and time.perf_counter() < deadline:
        rest_ids = {id(c) for c in rest}
        for r in gc.get_referrers(*rest):
            if isinstance(r, dict):
                is_globals = "__builtins__" in r and isinstance(r.get("__name__"), str)
                for k, v in r.items():
                    if id(v) in rest_ids and isinstance(k, str) and id(v) not in names:
                        where = f"global of {r['__name__']}" if is_globals else "attribute"
                        names[id(v)] = f"in {type(v).__name__} `{k}` ({where})"
    for cid, (c, held) in containers.items():
        label = names.get(cid)
        if label is None:
            if isinstance(c, dict):
                # an object's __dict__: the tensor is an attribute
                keys = [k for k, v in c.items() if id(v) in wanted and isinstance(k, str)]
                label = f"in attribute `{keys[0]}` of an object" if keys else f"in an unnamed {type(c).__name__}"
            else:
                label = f"in an unnamed {type(c).__name__}"
        for i in held:
            out.setdefault(i, label)
    return out
