"""Out of memory: a report of who held the memory when an allocation failed.

Inside ``memtorch.track()`` a block that an out-of-memory error leaves (``torch.OutOfMemoryError`` on
CUDA; c10's "can't allocate memory" RuntimeError on the CPU) attaches a report to the error
(``err.memtorch_report``, an OomReport) and prints it once to stderr:

- the bytes the failing allocation asked for (from the error's own words);
- the bytes held when it failed, by kind (parameters, gradients, optimizer state, activations...), by
  owner (module paths, ``exp_avg``) and by tensor: on the CPU the block's event log cut where the C hook
  saw posix_memalign fail (exact: the failing operator's own temporaries included); on CUDA the caching
  allocator's snapshot when the error reached the block (reserved beside allocated, and the largest free
  block: fragmentation shows as a large reserved figure whose largest free block is smaller than the
  request), named by the block's walk of the model and optimizer;
- the phase and the module running.

For code with no block, one switch: ``memtorch.on_oom()`` (or ``MEMTORCH_ON_OOM=1`` in the environment,
read when memtorch is imported) prints the same report for an out-of-memory error that ends the program
(sys.excepthook and threading.excepthook, chained to what was there), from what is alive then: the
traceback's frames keep the failing code's locals, so the tensors they hold are named by the local and
the module or optimizer that owns them. ``memtorch.on_oom(False)`` removes it.

Under torch.distributed each rank prints its own, headed with its rank.
"""

import re
import sys

from .leaks import frame_items
from .reports.oom import OomReport  # the result type's home (no torch)

__all__ = ["on_oom", "is_oom", "report_of", "ENV"]

ENV = "MEMTORCH_ON_OOM"

# c10's CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1152921504606846976
# bytes. Error code 12 (Cannot allocate memory)"; the CUDA caching allocator: "CUDA out of memory. Tried to
# allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which ..."
_CPU = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_CUDA = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]i?B|B|bytes)")
_CUDA_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def is_oom(exc):
    """("cpu" | "cuda", bytes asked for or None) when ``exc`` is an out-of-memory error, else None."""
    if exc is None:
        return None
    torch = sys.modules.get("torch")
    text = str(exc)
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_type is not None and isinstance(exc, oom_type) or "CUDA out of memory" in text:
        m = _CUDA.search(text)
        asked = None
        if m and m.group(2) in _CUDA_UNITS:
            asked = int(round(float(m.group(1)) * _CUDA_UNITS[m.group(2)]))
        if "can't allocate memory" in text:  # torch raises OutOfMemoryError for the CPU too
            m = _CPU.search(text)
            return "cpu", int(m.group(1)) if m else None
        return "cuda", asked
    if isinstance(exc, RuntimeError) and "can't allocate memory" in text:
        m = _CPU.search(text)
        return "cpu", int(m.group(1)) if m else None
    return None


def _rank():
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a half-torn-down process group: no rank to print
        return None
    return None


def attach(exc, report, file=None, show=True):
    """Attach ``report`` to ``exc`` (``exc.memtorch_report``) and print it once (to stderr; show=False:
    not yet, a block enclosing the one that made it prints). A report with the live set at the failure
    replaces one without (a nested block with no event log)."""
    old = getattr(exc, "memtorch_report", None)
    if old is None or (old.at_failure is None and report.at_failure is not None):
        try:
            exc.memtorch_report = report
        except AttributeError:  # an exception type without a __dict__: printed only
            pass
    else:
        report = old
    if not show or getattr(exc, "_memtorch_printed", False):
        return
    try:
        exc._memtorch_printed = True
    except AttributeError:
        pass
    out = sys.stderr if file is None else file
    try:
        print(str(report), file=out, flush=True)
    except Exception:  # a report must never replace the user's error
        pass


def cuda_figures(index=None, snapshot=None):
    """(allocated, reserved, largest free block, {address: (size, requested)} of the allocated blocks,
    capacity) of a CUDA device from the caching allocator's snapshot (torch.cuda.memory_snapshot(),
    or ``snapshot``: a list of segments as it returns them)."""
    if snapshot is None:
        import torch

        snapshot = torch.cuda.memory_snapshot()
    allocated = reserved = largest = 0
    blocks = {}
    for seg in snapshot:
        if index is not None and seg.get("device", index) != index:
            continue
        reserved += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "inactive":
                largest = max(largest, b["size"])
            elif b["state"].startswith("active"):
                allocated += b["size"]
                blocks[b["address"]] = (b["size"], b.get("requested_size", b["size"]))
    capacity = None
    torch = sys.modules.get("torch")
    if torch is not None and snapshot is not None:
        try:
            if torch.cuda.is_available():
                capacity = torch.cuda.get_device_properties(index or 0).total_memory
        except Exception:
            capacity = None
    return allocated, reserved, largest, blocks, capacity


def report_of(exc, tb=None):
    """An OomReport for an out-of-memory error caught outside a block: what is alive now, named by the
    traceback's locals (``tb``, default the error's) and the modules and optimizers they hold. None when
    ``exc`` is no out-of-memory error."""
    found = is_oom(exc)
    if found is None:
        return None
    kind, asked = found
    # lazy: the counters (and _C, NumPy) load only when an error is reported: importing oom stays torch-free
    from . import cpu

    # lazy: as above (peak loads the report types and words)
    from .peak import AtPeak, Owner, module_of

    import torch

    tb = exc.__traceback__ if tb is None else tb
    names, modules = _names_from_frames(tb)
    notes = []
    held = reserved = largest = capacity = None
    owners = {}
    device = kind
    if kind == "cuda":
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        device = f"cuda:{index}"
        held, reserved, largest, blocks, capacity = cuda_figures(index)
        named = 0
        for t, (name, what) in _live_tensors(torch, "cuda", names):
            size = blocks.get(t.untyped_storage().data_ptr())
            if size is None:
                continue
            _add(owners, name, what, size[0])
            named += size[0]
        if held > named:
            _add(owners, UNNAMED, "other", held - named)
        notes.append("taken when the error reached the top level: the failing operator's own temporaries "
                     "were freed by then; run the step in memtorch.track() for the figures at the failure")  # fmt: skip
    else:
        count, size, at_bytes, _head, _tag, _ns = cpu._counters_last_failure()
        if count and cpu.installed():
            held = at_bytes
        seen = set()
        total = 0
        for t, (name, what) in _live_tensors(torch, "cpu", names):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in seen or key == 0:
                continue
            seen.add(key)
            _add(owners, name, what, st.nbytes())
            total += st.nbytes()
        if held is None:
            notes.append("memtorch's CPU counters were not running: the bytes held are the live tensors' own "
                         "(memtorch.cpu.start() at start-up counts every allocation)")  # fmt: skip
            held = total
        elif held > total:
            _add(owners, "not named (freed as the error unwound, or held by no local)", "other", held - total)
        notes.append("named from the traceback's locals when the error reached the top level; memtorch.track() "
                     "around the step gives the live set at the failure itself, by module and phase")  # fmt: skip
    mods = set(modules)
    at = AtPeak(held or 0, [Owner(n, k, None, b, c, module_of(n, k, mods)) for (n, k), (b, c) in owners.items()],
                [], True, [], modules)  # fmt: skip
    report = OomReport(device, asked, held, reserved, largest, capacity, None, None, at,
                       _first_line(exc), _rank(), False, notes)  # fmt: skip
    return report


def _first_line(exc):
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _add(owners, name, kind, nbytes):
    b, c = owners.get((name, kind), (0, 0))
    owners[(name, kind)] = (b + nbytes, c + 1)


def _names_from_frames(tb):
    """{id(tensor): (name, kind)} of the tensors the traceback's frames hold: the modules' parameters,
    buffers and gradients, the optimizers' state, and plain locals."""
    import torch

    out = {}
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    param_names = {}
    optimizers = []
    modules = {}  # the outermost module's {dotted name: type name}, for the by-module table
    # modules from the outermost frame in: the model's own names ("2.0.weight"), not a submodule's ("0.weight")
    for frame in frames:
        for _, value in frame_items(frame):
            if isinstance(value, torch.nn.Module):
                if not modules:
                    modules = {n: type(m).__name__ for n, m in value.named_modules()}
                for n, p in value.named_parameters():
                    param_names.setdefault(id(p), n)
                    out.setdefault(id(p), (n, "parameter"))
                    if p.grad is not None:
                        out.setdefault(id(p.grad), (f"{n}.grad", "gradient"))
                for n, b in value.named_buffers():
                    out.setdefault(id(b), (n, "buffer"))
            elif isinstance(value, torch.optim.Optimizer) and all(value is not o for o in optimizers):
                optimizers.append(value)
    for frame in reversed(frames):  # plain tensors from the innermost frame out: the most specific name
        where = frame.f_code.co_name
        for var, value in frame_items(frame):
            if isinstance(value, torch.Tensor):
                out.setdefault(id(value), (f"local `{var}` of `{where}`", "activation" if value.grad_fn is not None
                                           else "other"))  # fmt: skip
    del frames
    for (
        opt
    ) in optimizers:  # the state by its parameter's name ("0.weight.exp_avg"), as memtorch's walks name it
        for p, state in opt.state.items():
            pname = param_names.get(id(p), "a parameter no local module holds")
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out.setdefault(id(v), (f"{pname}.{k}", "optimizer state"))
    return out, modules


def _live_tensors(torch, device, names):
    """(tensor, (name, kind)) of the live tensors on ``device`` ("cpu"/"cuda"), through the garbage
    collector (unnamed ones as 'unnamed tensors')."""
    import gc

    tensor = torch.Tensor
    for obj in gc.get_objects():
        # type(), not isinstance(): a module-level proxy (torch.distributed.reduce_op) warns when asked
        if not issubclass(type(obj), tensor):
            continue
        try:
            if obj.device.type != device or obj.is_meta:
                continue
            obj.untyped_storage().data_ptr()  # a fake or functional tensor has no memory: not one that holds any
        except Exception:  # noqa: BLE001 - a tensor with no data pointer, or one being torn down
            continue
        yield obj, names.get(id(obj), ("tensors no local names", "other"))


# -- the switch for code with no block ---------------------------------------------------------------

_installed = {}  # "sys" / "threading": the hook that was there before ours


def on_oom(enable=True, file=None):
    """Print a post-mortem for an out-of-memory error that ends the program (or a thread), for code with
    no memtorch.track() block: sys.excepthook and threading.excepthook chained to the hooks that were
    there. enable=False removes them. The environment variable MEMTORCH_ON_OOM=1 turns it on when memtorch
    is imported."""
    import threading

    if not enable:
        if "sys" in _installed:
            sys.excepthook = _installed.pop("sys")
        if "threading" in _installed:
            threading.excepthook = _installed.pop("threading")
        return
    if "sys" in _installed:
        return
    before = sys.excepthook
    before_t = threading.excepthook

    def hook(exc_type, exc, tb):
        _report_quietly(exc, tb, file)
        before(exc_type, exc, tb)

    def hook_t(args):
        _report_quietly(args.exc_value, args.exc_traceback, file)
        before_t(args)

    _installed["sys"], _installed["threading"] = before, before_t
    sys.excepthook = hook
    threading.excepthook = hook_t


def _report_quietly(exc, tb, file):
    try:
        if getattr(exc, "memtorch_report", None) is not None:
            report = exc.memtorch_report  # a block made it, at the failure: print it if not yet
        else:
            report = report_of(exc, tb)
        if report is not None:
            attach(exc, report, file)
    except Exception as e:  # the user's error is what matters: say ours in one line
        print(f"memtorch: the out-of-memory report failed: {type(e).__name__}: {e}", file=sys.stderr)


UNNAMED = "not named: activations and temporaries no walk of the model or optimizer names"


def decode_tag(tag, token):
    """(phase, module row) an owner tag says (memtorch.peak.make_tag), or (None, None) when the tag is
    another block's (or none)."""
    # lazy: peak loads with tracking; this function is only called from there
    from .peak import PHASE_NAMES, TAG_BITS

    if tag >> TAG_BITS != token:
        return None, None
    row = ((tag >> 2) & ((1 << (TAG_BITS - 2)) - 1)) - 1
    return PHASE_NAMES.get(tag & 3), (row if row >= 0 else None)


_real_cuda_figures = cuda_figures  # the function itself, whatever a test patches in its place
