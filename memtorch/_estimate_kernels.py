"""What real CPU kernels allocate that their fake kernels do not show.

An entry maps an aten overload to fn(args, kwargs, out) -> extra bytes: it may
fix the fake outputs' sizes in place (before they are counted) and returns the
bytes the real kernel allocates and frees inside itself on top of its outputs
(its transient peak). The ledger counts the outputs, then that transient.

The oneDNN LSTM layer (aten.mkldnn_rnn_layer, which nn.LSTM runs on the CPU):
its fake kernel returns an empty workspace, while the real one returns a
workspace whose size only oneDNN knows (padded per time step and batch, not
linear in small shapes), and both directions allocate scratch space through
PyTorch's allocator. memtorch measures them: the first time a layer shape is
met, it runs that one layer for real, forward and backward, at that shape, with
memtorch.cpu's exact counters, and caches the figures per shape. This is the
one place where estimate() allocates real memory: one layer's input, weights,
outputs and workspace, for a moment. Without exact counters (not Linux) no
correction is made and the estimate says so.
"""

import threading

_lock = threading.Lock()
_rnn_cache = {}  # signature -> (workspace bytes, forward extra, backward extra)
_pending_backward = []  # extras of forward calls whose backward is still to come (FIFO per signature)
notes = set()


def _sig(args):
    import torch

    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((tuple(a.shape), str(a.dtype), a.requires_grad))
        elif isinstance(a, list):
            parts.append(tuple(a))
        else:
            parts.append(a)
    return tuple(parts)


def _probe_rnn(args):
    """(workspace bytes, forward extra, backward extra) of the real kernel at these shapes."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from . import cpu

    def measured(op, *a):
        with cpu.Scope() as s:
            out = op(*a)
        outs = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in out if t is not None}
        return out, s.peak - s.start - sum(outs.values())

    (inp, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden, layers, bias, bidir, batch_first, train) = args
    # The kernel returns its workspace only when grad mode is on and the weights require grad;
    # autograd is below this dispatch level, so no graph is recorded here.
    with _disable_current_modes(), torch.enable_grad():
        real = [
            torch.zeros(tuple(t.shape), dtype=t.dtype).requires_grad_(t.requires_grad)
            for t in (inp, w0, w1, w2, w3, hx, cx)
        ]
        out, fwd_extra = measured(torch.ops.aten.mkldnn_rnn_layer.default, *real, *args[7:])
        ws = out[3].untyped_storage().nbytes()
        grads = [torch.zeros_like(t) for t in out[:3]]
        bwd, bwd_extra = measured(
            torch.ops.aten.mkldnn_rnn_layer_backward.default, *real, out[0], out[1], out[2], *grads,
            reverse, mode, hidden, layers, bias, train, bidir, list(batch_sizes), batch_first, out[3],
        )  # fmt: skip
        del out, grads, bwd, real
    return ws, max(0, fwd_extra), max(0, bwd_extra)


def _rnn_forward(args, kwargs, out):
    from . import cpu

    if not cpu.exact():
        notes.add("the oneDNN LSTM's workspace is not modelled without exact CPU counters")
        return 0
    key = _sig(args)
    with _lock:
        figures = _rnn_cache.get(key)
    if figures is None:
        figures = _probe_rnn(args)
        with _lock:
            _rnn_cache[key] = figures
    ws, fwd_extra, bwd_extra = figures
    w = out[3]
    if ws and w.untyped_storage().nbytes() < ws:
        w.untyped_storage().resize_(ws)
    _pending_backward.append((key, bwd_extra))
    return fwd_extra + _copies(args)


def _copies(args):
    """The kernel makes contiguous copies of non-contiguous tensor arguments (the probe's are contiguous)."""
    import torch

    return sum(
        a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor) and not a.is_contiguous()
    )


def _absent_grads(args):
    """The kernel fills in zeros for gradients autograd passes as undefined (h_n, c_n unused by the
    loss); the probe passed them all."""
    return sum(
        ref.numel() * ref.element_size()
        for ref, grad in ((args[7], args[10]), (args[8], args[11]), (args[9], args[12]))
        if grad is None
    )


def _rnn_backward(args, kwargs, out):
    # the extra measured for the forward of the same shape: its input is args[0]
    more = _copies(args) + _absent_grads(args)
    for i, (key, extra) in enumerate(_pending_backward):
        if key[0][0] == tuple(args[0].shape):
            del _pending_backward[i]
            return extra + more
    return more


_tensor_slots = {}  # op -> positions of its Tensor-typed arguments


def scalar_extra(func, args, out):
    """Bytes a CPU kernel allocates for Python numbers passed where its schema takes a Tensor.

    Measured (tests/test_estimate.py::test_scalar_wrapping): the number becomes an
    8-byte tensor (int64 or float64), cast to the result's dtype when that differs,
    both freed inside the kernel: p.add_(1) on float32 allocates 8 + 4 bytes.
    """
    import torch

    slots = _tensor_slots.get(func)
    if slots is None:
        slots = tuple(
            i for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor" and not a.kwarg_only
        )
        _tensor_slots[func] = slots
    if not slots or not isinstance(out, torch.Tensor):
        return 0
    extra = 0
    for i in slots:
        if i < len(args) and isinstance(args[i], (int, float)) and not isinstance(args[i], bool):
            wrapped = torch.float64 if isinstance(args[i], float) else torch.int64
            extra += 8 + (out.element_size() if out.dtype != wrapped else 0)
    return extra


def kernels_for(device):
    import torch

    _pending_backward.clear()
    return {
        torch.ops.aten.mkldnn_rnn_layer.default: _rnn_forward,
        torch.ops.aten.mkldnn_rnn_layer_backward.default: _rnn_backward,
    }


# ---------------------------------------------------------------------------
# Scratch space of any other CPU kernel, measured on the real kernel per signature

PROBE_CAP = 32 << 20  # bytes of a kernel's arguments and outputs above which it is not probed
_probe_cache = {}
_skip_ops = set()
_writes = {}  # op -> positions of the arguments it writes
# id(fake storage) -> the model's own CPU tensor it stands for, during a dry run: probes read
# the user's weights instead of allocating copies (only kernels that write no argument run)
originals = {}
probe_stats = {"probed": 0, "skipped_large": 0}


def _probe_key(func, args, kwargs):
    import torch

    def one(a):
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), tuple(a.stride()), a.dtype, a.storage_offset(), a.untyped_storage().nbytes())
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):  # fmt: skip
            return a
        raise TypeError

    try:
        # scratch space can depend on the thread count (per-thread buffers): part of the key
        args_key = tuple(one(a) for a in args)
        return (func, args_key, tuple((k, one(v)) for k, v in sorted(kwargs.items())), torch.get_num_threads())
    except TypeError:
        return None


def _probeable(func):
    import torch

    if func in _skip_ops:
        return False
    schema = func._schema
    ok = (
        schema.name.startswith("aten::")
        and torch.Tag.nondeterministic_seeded not in func.tags
        and not any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)  # views
        and schema.name not in ("aten::_local_scalar_dense", "aten::lift_fresh", "aten::detach", "aten::clone",
                                "aten::_to_copy", "aten::copy_", "aten::empty", "aten::empty_strided")
    )  # fmt: skip
    if not ok:
        _skip_ops.add(func)
    return ok


def probe_extra(func, args, kwargs, out):
    """Bytes the real CPU kernel allocates and frees inside itself at these arguments, or None.

    The kernel runs once per signature (shapes, strides, dtypes, other arguments) on
    zero-filled tensors, with memtorch.cpu's exact counters; kernels whose arguments
    exceed PROBE_CAP bytes, random kernels and views are not run (None).
    """
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from . import cpu

    if not _probeable(func) or not cpu.exact():
        return None
    writes = _writes.get(func)
    if writes is None:
        writes = _writes[func] = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    # a kernel that writes an argument runs on zero-filled copies only, never on the model's own tensors
    if writes and any(isinstance(args[i], torch.Tensor) and id(args[i].untyped_storage()) in originals
                      for i in writes if i < len(args)):  # fmt: skip
        return None
    key = _probe_key(func, args, kwargs)
    if key is None:
        return None
    cached = _probe_cache.get(key)
    if cached is not None:
        return cached
    size = 0

    def tensors(a):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                yield from tensors(x)

    seen = set(originals)
    for t in tensors(list(args) + list(kwargs.values())):
        s = t.untyped_storage()
        if id(s) not in seen:
            seen.add(id(s))
            size += s.nbytes()
    for t in tensors(out if isinstance(out, (list, tuple)) else [out]):
        s = t.untyped_storage()
        if id(s) not in seen:
            seen.add(id(s))
            size += s.nbytes()
    if size > PROBE_CAP:  # arguments and outputs together
        probe_stats["skipped_large"] += 1
        return None
    with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
        made = {}

        def real(a):
            if isinstance(a, torch.Tensor):
                sid = id(a.untyped_storage())
                base = made.get(sid)
                orig = originals.get(sid)
                if base is None and orig is not None and orig.dtype == a.dtype:
                    base = made[sid] = orig.detach()
                elif base is None:
                    n = a.untyped_storage().nbytes() // a.element_size() if a.element_size() else 0
                    base = torch.zeros(n, dtype=a.dtype)
                    made[sid] = base
                return base.as_strided(tuple(a.shape), tuple(a.stride()), a.storage_offset())
            if isinstance(a, list):
                return [real(x) for x in a]
            if isinstance(a, tuple):
                return tuple(real(x) for x in a)
            return a

        rargs = [real(a) for a in args]
        rkwargs = {k: real(v) for k, v in kwargs.items()}
        inputs = {id(b.untyped_storage()) for b in made.values()}
        try:
            with cpu.Scope() as s:
                rout = func(*rargs, **rkwargs)
        except Exception:  # noqa: BLE001 - a kernel that rejects zeros: no correction for it
            _probe_cache[key] = 0
            return 0
        new = {}
        for t in tensors(rout if isinstance(rout, (list, tuple)) else [rout]):
            st = t.untyped_storage()
            if id(st) not in inputs:
                new[id(st)] = st.nbytes()
        extra = max(0, s.peak - s.start - sum(new.values()))
        del rout, rargs, rkwargs, made
    probe_stats["probed"] += 1
    _probe_cache[key] = extra
    return extra
