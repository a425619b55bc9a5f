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


def _rnn_backward(args, kwargs, out):
    # the extra measured for the forward of the same shape: its input is args[0]
    for i, (key, extra) in enumerate(_pending_backward):
        if key[0][0] == tuple(args[0].shape):
            del _pending_backward[i]
            return extra + _copies(args)
    return _copies(args)


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
