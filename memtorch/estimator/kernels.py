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

import contextlib
import threading

from ..errors import MemtorchError
from .._quantize import kernel_rules  # bitsandbytes' operators (empty unless bitsandbytes is loaded)


class Around:
    """A kernel table entry that runs in place of the operator: fn(ledger, func, args, kwargs) -> outputs.
    extra(func, args, kwargs, out): bytes the kernel allocates and frees inside itself once its outputs
    exist (counted after them), or None for none."""

    def __init__(self, fn, extra=None):
        self.fn = fn
        self.extra = extra

    def __call__(self, ledger, func, args, kwargs):
        return self.fn(ledger, func, args, kwargs)


class Composite:
    """A kernel table entry for a kernel that runs as Python-level operators (bitsandbytes' 4-bit
    matmul): fn(*args, **kwargs) -> outputs, run under the accounting mode in place of the operator,
    so that each operator inside it is counted (and probed) as it runs."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


_lock = threading.Lock()
_rnn_cache = {}  # signature -> (workspace bytes, forward extra, backward extra)
_pending_backward = []  # extras of forward calls whose backward is still to come (FIFO per signature)
notes = set()
_said = {}  # (operator, dtype) -> (its note in notes, the bytes it says): one note each, the widest


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

    # lazy: cpu loads _C and NumPy; only this path needs it (importing kernels stays cheap)
    from .. import cpu

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
    # lazy: cpu loads _C and NumPy; only this path needs it (importing kernels stays cheap)
    from .. import cpu

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


def _slots(func):
    slots = _tensor_slots.get(func)
    if slots is None:
        slots = tuple(
            i for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor" and not a.kwarg_only
        )
        _tensor_slots[func] = slots
    return slots


def scalar_extra(func, args, out):
    """Bytes a CPU kernel allocates for Python numbers passed where its schema takes a Tensor.

    Measured (tests/test_estimate.py::test_scalar_wrapping): the number becomes an
    8-byte tensor (int64 or float64), cast to the result's dtype when that differs,
    both freed inside the kernel: p.add_(1) on float32 allocates 8 + 4 bytes.
    """
    import torch

    slots = _slots(func)
    if not slots or not isinstance(out, torch.Tensor):
        return 0
    extra = 0
    for i in slots:
        if i < len(args) and isinstance(args[i], (int, float)) and not isinstance(args[i], bool):
            wrapped = torch.float64 if isinstance(args[i], float) else torch.int64
            extra += 8 + (out.element_size() if out.dtype != wrapped else 0)
    return extra


def saved_number_names(func, args):
    """Names of ``func``'s Tensor arguments given a Python number in ``args`` (autograd saves such a wrapped
    number under ``_saved_<name>`` where its formula needs it: ``x * 2.0``'s MulBackward0 keeps 8 bytes)."""
    return tuple(
        func._schema.arguments[i].name for i in _slots(func)
        if i < len(args) and isinstance(args[i], (int, float)) and not isinstance(args[i], bool)
    )


def kernels_for(device):
    import torch

    _pending_backward.clear()
    return {
        # autograd's in-place sum of a second gradient, tried before the operator runs (its other calls run
        # and are probed as any other)
        "before": {torch.ops.aten.add.Tensor: accumulate_in_place, torch.ops.aten.dropout.default: _dropout_off},
        torch.ops.aten.mkldnn_rnn_layer.default: _rnn_forward,
        torch.ops.aten.mkldnn_rnn_layer_backward.default: _rnn_backward,
        torch.ops.aten._grouped_mm.default: _grouped_mm(cuda=False),
        torch.ops.aten.mse_loss.default: _reduced_loss_cpu,
        torch.ops.aten.smooth_l1_loss.default: _reduced_loss_cpu,
        **{op: Composite(fn) for op, fn in kernel_rules(notes=notes).items()},
    }


def _grouped_mm(cuda):
    """aten._grouped_mm (mixture-of-experts layers: transformers' grouped_mm experts) as the real
    kernels allocate: its output alone, in out_dtype or the inputs' dtype. Its fake (meta) kernel
    refuses every dtype but bfloat16 (it checks the CUDA fast path's conditions), while the real
    kernels run any floating dtype (the CPU's, and CUDA's outside its bf16 fast path, as a loop of
    matrix products into the one output): a float32 MoE model ran on the CPU and failed in the
    dry run. CUDA pads the output's last dimension to 16 bytes (as torch's own meta function does
    on a CUDA build, _create_grouped_mm_output_tensor); the CPU does not.

    The router sends tokens to experts by their values, which fakes do not hold; along this path no size
    depends on where they go (the tokens are sorted by expert into tensors of every routed token, the
    output is one, offs one number per expert): real steps of the family sweep's Mixtral and Qwen2-MoE
    on four different batches each took the same peak, the estimate's (tests/test_family_sweep.py)."""

    def run(ledger, func, args, kwargs):
        import torch

        names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
        given = dict(zip(names, args), **kwargs)
        a, b, offs = given["mat_a"], given["mat_b"], given.get("offs")
        dtype = given.get("out_dtype") or a.dtype
        if a.dim() == 2:
            size = [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
        else:
            size = [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]
        if not cuda:
            return torch.empty(size, dtype=dtype, device=a.device)
        align = 16 // dtype.itemsize
        padded = (size[-1] + align - 1) // align * align
        stride = [size[1] * padded, padded, 1] if (a.dim() == 2) == (b.dim() == 2) else [padded, 1]
        return torch.empty_strided(size, stride, dtype=dtype, device=a.device)

    return Around(run, None if cuda else _grouped_mm_scratch)


def _grouped_mm_scratch(func, args, kwargs, out):
    """The CPU kernel's scratch, measured on the real kernel as any other's (probe_extra). In bfloat16 it
    multiplies each expert's rows in float32 copies, so the scratch grows with the largest expert's share
    of the tokens, which the router decides by value (the family sweep's Mixtral: 38,528 B for an even
    split, 42,624 B for every row to one expert). It is measured with every row in one group, the most,
    and a note says by how much an even split takes less. float32 takes none."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    given = dict(zip(names, args), **kwargs)
    offs, a, b = given.get("offs"), given["mat_a"], given["mat_b"]
    if offs is None or (a.dim() == 3 and b.dim() == 3):
        return probe_extra(func, args, kwargs, out)  # no split by value: measured as it is
    # what offs splits: a's rows (2d x 3d, the forward), the inner dimension (2d x 2d, a weight's gradient),
    # b's columns (3d x 2d)
    rows = a.size(0) if b.dim() == 3 else a.size(1) if a.dim() == 2 else b.size(1)
    groups = offs.size(0)
    with _disable_current_modes():  # real tensors: the splits' values, which the probe runs on
        one = torch.full((groups,), rows, dtype=offs.dtype)
        even = torch.tensor([-(-rows * (i + 1) // groups) for i in range(groups)], dtype=offs.dtype)
    most = probe_extra(func, args, kwargs, out, values=lambda t: one if t is offs else None)
    if most:
        typical = probe_extra(func, args, kwargs, out, values=lambda t: even if t is offs else None) or 0
        if most > typical:
            # one note per dtype, with the largest difference of any call (reset_notes empties both per estimate)
            dtype = str(a.dtype).replace("torch.", "")
            _say_widest(("grouped_mm", dtype), most - typical, (
                f"the experts' grouped matrix products (a mixture of experts) in {dtype} on the CPU take scratch "
                "space that grows with the largest expert's share of the tokens, which the router decides by "
                "value: counted for every token routed to one expert, the most (up to "
                f"{most - typical:,} B a call more than an even split)"
            ))  # fmt: skip
    return most


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


class KernelRefuses(MemtorchError):
    """The real kernel raises at arguments its fake kernel accepts (a dtype its meta kernel does not check, an
    index out of range): the real step would fail there. ``error`` is the real kernel's exception."""

    def __init__(self, func, error):
        self.func, self.error = func, error
        words = str(error).strip().splitlines()[0] if str(error).strip() else ""
        super().__init__(f"{type(error).__name__}: {words}")


def _refuses(func, call, made, error):
    """Whether ``error``, raised by the real kernel on the probe's stand-ins, is the real step's: it raises
    again with the stand-ins of unknown value filled with ones instead of zeros (an argument check, a known
    index out of range; not a kernel that rejects zeros as values, such as a singular matrix)."""
    name = func._schema.name
    if "linalg" in name or "cholesky" in name:  # they judge the values themselves
        return False
    for base in made:
        base.fill_(1)
    try:
        call()
    except type(error) as again:
        return str(again) == str(error)
    except Exception:  # noqa: BLE001 - another complaint: about the values
        return False
    return False


def check_real(func, args, kwargs, out, values=None):
    """Run the real CPU kernel at these arguments (as probe_extra does, without counting) where no probe
    ran (a kernel the device's table models, the CUDA step): raises KernelRefuses where it would fail."""
    probe_extra(func, args, kwargs, out, values, count=False)


def probe_extra(func, args, kwargs, out, values=None, count=True):
    """Bytes the real CPU kernel allocates and frees inside itself at these arguments, or None.

    The kernel runs once per signature (shapes, strides, dtypes, other arguments) on
    zero-filled tensors, or on the tensors' values where values(fake) knows them (a position
    index made by torch.arange: dispatch._Known), with memtorch.cpu's exact counters;
    kernels whose arguments exceed PROBE_CAP bytes, random kernels and views are not run (None).
    A kernel that raises at arguments its fake kernel accepted raises KernelRefuses (see _refuses).
    count=False: the kernel runs for its checks only (check_real; no counters needed), None.
    """
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    # lazy: cpu loads _C and NumPy; only this path needs it (importing kernels stays cheap)
    from .. import cpu

    if not _probeable(func) or (count and not cpu.exact()):
        return None
    writes = _writes.get(func)
    if writes is None:
        writes = _writes[func] = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    # a kernel that writes an argument runs on zero-filled copies only, never on the model's own tensors
    # (the lists a foreach kernel writes included)
    if writes and any(isinstance(t, torch.Tensor) and id(t.untyped_storage()) in originals
                      for i in writes if i < len(args)
                      for t in (args[i] if isinstance(args[i], (list, tuple)) else (args[i],))):  # fmt: skip
        return None
    known = {}  # id(fake tensor) -> its known value, a real tensor
    if values is not None:
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and (v := values(t)) is not None:
                    known[id(t)] = v
    key = _probe_key(func, args, kwargs)
    if key is None:
        return None
    if known:  # the values are part of the signature
        with _disable_current_modes():
            key += tuple((v.dtype, tuple(v.reshape(-1).tolist())) for v in known.values())
    key += (count,)
    cached = _probe_cache.get(key)
    if cached is not None:
        extra, grown, spread = cached
        if spread is not None:  # this estimate's notes say it too (they are cleared per estimate)
            _spread_note(func, *spread)
        _grow_outputs(out, grown)
        return extra if count else None
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
            if isinstance(a, torch.Tensor) and id(a) in known:
                return known[id(a)].clone()  # a copy: a kernel may write it
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

        try:
            rargs = [real(a) for a in args]
            rkwargs = {k: real(v) for k, v in kwargs.items()}
        except RuntimeError:  # a view beyond its fake storage (a modelled kernel's own layout): not run
            _probe_cache[key] = (0, (), None)
            return 0 if count else None
        inputs = {id(b.untyped_storage()) for b in made.values()}
        try:
            with cpu.Scope() if count else contextlib.nullcontext() as s:
                rout = func(*rargs, **rkwargs)
        except Exception as e:  # noqa: BLE001 - the real step's error, or a kernel that rejects zeros
            zeros = [b for sid, b in made.items() if sid not in originals]
            # only the forward's refusals are the step's: a backward kernel's arguments are the dry run's own
            # model of autograd (under autocast its gradients' dtypes can differ from the real run's, and a
            # real bf16-mixed step with LayerNorm or BatchNorm was refused)
            in_backward = torch._C._current_autograd_node() is not None
            if not in_backward and _refuses(func, lambda: func(*rargs, **rkwargs), zeros, e):
                raise KernelRefuses(func, e) from e
            _probe_cache[key] = (0, (), None)
            return 0 if count else None
        if not count:
            _probe_cache[key] = (0, (), None)
            return None

        def outputs(rout):
            n = 0
            for t in tensors(rout if isinstance(rout, (list, tuple)) else [rout]):
                st = t.untyped_storage()
                if id(st) not in inputs:
                    n += st.nbytes()
            return n

        extra = max(0, s.peak - s.start - outputs(rout))
        grown = _larger_outputs(out, rout, inputs)
        del rout
        spread = None
        threads = torch.get_num_threads()
        if extra and threads > 1:
            # a parallel kernel's scratch can depend on how its threads interleave (per-thread buffers held
            # at once or one after another: the CPU flash attention's backward in bfloat16 took 38,564 to
            # 52,648 B at one signature on 2 threads): run again, and where runs differ, more, for the most
            seen = [extra]
            for _ in range(_RUNS - 1):
                try:
                    with cpu.Scope() as s:
                        rout = func(*rargs, **rkwargs)
                except Exception:  # noqa: BLE001 - a kernel that wrote its stand-ins so as to refuse them now
                    break
                seen.append(max(0, s.peak - s.start - outputs(rout)))
                del rout
                if len(seen) == _RUNS_SAME and len(set(seen)) == 1:
                    break
            if len(set(seen)) > 1:
                extra = max(seen)
                first = next(tensors(list(args)), None)
                dtype = "" if first is None else str(first.dtype).replace("torch.", "")
                spread = (dtype, min(seen), extra, len(seen), threads)
                _spread_note(func, *spread)
        del rargs, rkwargs, made
    probe_stats["probed"] += 1
    _probe_cache[key] = (extra, grown, spread)
    _grow_outputs(out, grown)
    return extra


_RUNS_SAME = 8  # runs of a parallel kernel that, all equal, say its scratch does not vary
_RUNS = 16  # runs where they differ: the figure is the most of them


def _spread_note(func, dtype, low, high, runs, threads):
    """The note of a kernel whose scratch varied from run to run (probe_extra): one per operator and dtype,
    with the widest spread of any of its signatures in this estimate."""
    name = str(func.overloadpacket).replace("aten.", "", 1)
    _say_widest((func.overloadpacket, dtype), high - low, (
        f"{name} ({dtype}) on the CPU with {threads} threads takes scratch space that depends on how its "
        f"threads interleave, which changes from run to run ({low:,} to {high:,} B in {runs} runs of the real "
        "kernel at one shape): counted at the most seen, which the real step may not reach, or rarely exceed; "
        "torch.set_num_threads(1) makes it exact"
    ))  # fmt: skip


def _say_widest(key, amount, note):
    """``note`` among the notes in place of ``key``'s earlier one where it says more bytes (``amount``): one
    note per key in an estimate, the widest."""
    said, before = _said.get(key, (None, 0))
    if amount > before:
        notes.discard(said)
        notes.add(note)
        _said[key] = (note, amount)


def reset_notes():
    """Empty the notes (and what they keep of their figures): an estimate's are its own."""
    notes.clear()
    _said.clear()


def _leaves(out):
    """The tensors of a kernel's outputs, in the order the accounting mode counts them (dispatch)."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _larger_outputs(fake, real, inputs):
    """((output index, bytes), ...): the real kernel's new output storages larger than the fake's. A reduced
    loss is one: mse_loss, smooth_l1_loss, binary_cross_entropy and soft_margin_loss with reduction mean or
    sum return a 0-dim tensor whose storage is the unreduced loss's (the structured kernel's meta function
    makes the output at the inputs' broadcast shape, then resizes it to a scalar, which keeps the storage):
    a loss over (2, 16, 4) float32 holds 512 B, not 4 B, while it lives (measured, tests/test_estimate.py)."""
    fakes, reals = _leaves(fake), _leaves(real)
    if len(fakes) != len(reals):
        return ()
    grown = []
    for i, (f, r) in enumerate(zip(fakes, reals)):
        n = r.untyped_storage().nbytes()
        if id(r.untyped_storage()) not in inputs and n > f.untyped_storage().nbytes():
            grown.append((i, n))
    return tuple(grown)


def _grow_outputs(out, grown):
    """The fake outputs' storages made as large as the real kernel's (_larger_outputs), before they are
    counted."""
    if grown:
        leaves = _leaves(out)
        for i, n in grown:
            st = leaves[i].untyped_storage()
            if st.nbytes() < n:
                st.resize_(n)


# ---------------------------------------------------------------------------
# The CUDA step (estimate(device="cuda")): the kernels torch runs on the target GPU
#
# The dry run's fake tensors say "cpu" (a CPU-only torch cannot make CUDA tensors that autograd
# accepts), so the device-dependent choices made inside composite operators would be the CPU's.
# CudaRouting (a TorchFunctionMode, above autograd) takes the CUDA branch of those choices itself:
# SDPA's backend (sdp_utils.cpp), the fused dropout kernel (Dropout.cpp: native_dropout on CUDA,
# a float noise tensor on the CPU) and cuDNN's recurrent layers (RNN.cpp: _cudnn_rnn). Below
# autograd, cuda_kernels() adds what the CUDA kernels allocate beside their outputs: cuBLAS and
# cuBLASLt workspaces, cuDNN RNN reserve and workspace, and the cuDNN RNN backward (no fake kernel).


class CudaState:
    """Per dry run: the GPU modelled, the cuBLAS/cuBLASLt handles that already hold a workspace
    (per thread: the Python thread runs forward and optimizer, the autograd engine's device thread
    runs backward), and what was routed (for the report)."""

    def __init__(self, gpu):
        self.gpu = gpu
        self.blas = {}  # thread -> ledger key of its cuBLAS workspace
        self.blas_lt = {}
        self.routed = {}  # what -> count
        self.unmodelled = set()
        # training _cudnn_rnn calls that read the parameters' own flat buffer in place: [(ledger position before
        # its outputs, key of that buffer, key of its reserve)]. Where the parameters are not one buffer (FSDP2's
        # unsharded parameters, each its own tensor) cuDNN copies them into a flat weight_buf of its own, which
        # autograd saves with the reserve (derivatives.yaml: result4 with result3) until the backward is done
        self.rnn_in_place = []

    def count(self, what):
        self.routed[what] = self.routed.get(what, 0) + 1


def _thread():
    import torch

    return "autograd" if torch._C._current_graph_task_id() != -1 else "main"


def _lt_ok(args, kwargs, out):
    """addmm_out_cuda_impl's isInputCompliesAddmmCudaLt (Blas.cpp): a bias vector, beta 1, 2-D
    contiguous result, float types, every matrix dimension above 1."""
    import torch

    self_, m1, m2 = args[0], args[1], args[2]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    if beta != 1 or not isinstance(out, torch.Tensor) or out.dim() != 2 or not out.is_contiguous():
        return False
    if m1.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return False
    if not self_.is_contiguous() or self_.dim() == 0 or self_.squeeze().dim() != 1 or self_.shape[-1] != m2.shape[1]:
        return False
    return min(m1.shape[0], m1.shape[1], m2.shape[0], m2.shape[1]) > 1


def _blas_after(state, lt=False):
    def after(ledger, args, kwargs, out):
        thread = _thread()
        if thread not in state.blas:
            state.blas[thread] = ledger.add_extra(state.gpu.cublas_workspace, "workspace", transient=False)
        if lt and thread not in state.blas_lt and _lt_ok(args, kwargs, out):
            state.blas_lt[thread] = ledger.add_extra(state.gpu.cublaslt_workspace, "workspace", transient=False)

    return after


def _reduce_after(state):
    # lazy: allocator loads only when an estimate's dry run needs it
    from .allocator import reduce_staging

    def after(ledger, args, kwargs, out):
        """A sum or mean split across thread blocks (Reduce.cuh): its staging buffer and semaphores,
        taken after the output and given back when the kernel ends, semaphores first (the DataPtrs'
        order)."""
        import torch

        x = args[0]
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.is_complex():
            return
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = range(x.dim())
        elif isinstance(dims, int):
            dims = [dims]
        dims = {d % max(1, x.dim()) for d in dims}
        acc = 8 if x.dtype == torch.float64 else 4  # acc_type: double for double, float otherwise
        shape, strides = tuple(x.shape), x.stride()
        buffer, semaphores = reduce_staging(shape, strides, dims, acc, state.gpu, x.storage_offset())
        if buffer:
            key = ledger.add_extra(buffer, "temporary", transient=False)
            ledger.add_extra(semaphores)
            ledger.free_key(key)

    return after


def _reduced_loss_size(args, kwargs, out):
    """Bytes of the unreduced loss of aten.mse_loss or aten.smooth_l1_loss (the inputs' broadcast shape in
    the output's dtype), or 0 where the kernel is not the structured one that keeps it: reduction "none"
    (its output is that shape already), smooth_l1_loss with beta 0 (l1_loss's path)."""
    import torch

    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    beta = args[3] if len(args) > 3 else kwargs.get("beta", 1.0)
    if reduction == 0 or beta == 0 or not isinstance(out, torch.Tensor):
        return 0
    return torch.broadcast_shapes(args[0].shape, args[1].shape).numel() * out.element_size()


def _reduced_loss_output(args, kwargs, out):
    """The 0-dim result keeps the unreduced loss's storage: the structured kernel's meta function (shared by
    every device, Loss.cpp) makes the output at the broadcast shape, then resizes it to a scalar. Grown before
    the output is counted; what the kernel frees inside it is _reduced_loss_after's."""
    n = _reduced_loss_size(args, kwargs, out)
    if n > out.untyped_storage().nbytes():
        out.untyped_storage().resize_(n)
    return 0


def _reduced_loss_cpu(args, kwargs, out):
    """mse_loss and smooth_l1_loss on the CPU at any size (the probe, which grows any kernel's outputs to the
    real ones, skips arguments over PROBE_CAP): the result grown as on every device, and the elementwise loss
    freed inside the kernel, its transient (the CPU's mean_out and sum_out allocate nothing more: measured, the
    probe's 512 B for a (2, 16, 4) float32 loss)."""
    _reduced_loss_output(args, kwargs, out)
    return _reduced_loss_size(args, kwargs, out)


def _reduced_loss_after(state):
    # lazy: allocator loads only when an estimate's dry run needs it
    from .allocator import reduce_staging

    def after(ledger, args, kwargs, out):
        """Inside mse_loss_out / smooth_l1_loss_out with a reduction: the elementwise loss into a new tensor
        of the broadcast shape (the TensorIterator's output), then mean_out or sum_out of it into the result
        (a reduction over every dimension: its staging buffer and semaphores, as _reduce_after), the loss
        freed when the kernel returns."""
        import torch

        n = _reduced_loss_size(args, kwargs, out)
        if not n:
            return
        shape = tuple(torch.broadcast_shapes(args[0].shape, args[1].shape))
        loss = ledger.add_extra(n, "temporary", transient=False)
        strides = torch.empty(shape, device="meta").stride()  # the new tensor's: contiguous
        acc_bytes = 8 if out.dtype == torch.float64 else 4
        buffer, semaphores = reduce_staging(shape, strides, set(range(len(shape))), acc_bytes, state.gpu, 0)
        if buffer:
            key = ledger.add_extra(buffer, "temporary", transient=False)
            ledger.add_extra(semaphores)
            ledger.free_key(key)
        ledger.free_key(loss)

    return after


def _layer_norm_backward_after(ledger, args, kwargs, out):
    """layer_norm_backward_cuda allocates dX, dgamma and dbeta, then its kernel reads the incoming gradient
    through a contiguous copy, freed when it ends: the gradient of a sum, expanded from one number, is
    copied whole (the encoder's trace: 8 MiB after the 2 KiB dgamma and dbeta, freed at once)."""
    import torch

    grad = args[0]
    if isinstance(grad, torch.Tensor) and not grad.is_contiguous():
        ledger.add_extra(grad.numel() * grad.element_size())


def _dropout_mask_first(ledger, func, args, kwargs):
    """dropout_cuda (Dropout.cu) allocates the bool mask before the output: the caching allocator hands
    out blocks in that order (the encoder's trace: 2 MiB mask, then the 8 MiB output)."""
    import torch

    out = func(*args, **kwargs)
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        ledger.add_storage(out[1].untyped_storage())
    return out


def _efficient_attention_backward(state):
    def run(ledger, func, args, kwargs):
        """_efficient_attention_backward (attention_backward.cu) on CUDA, in its order: a contiguous copy of
        the incoming gradient (in the kernel's B x M x H x K layout), grad_q, grad_k and grad_v, then
        delta: where the kernel does not compute it (float32), (grad_out * out).sum(-1) made contiguous
        as B x H x M floats, its two temporaries freed at once; then the kernel's workspace, and at the
        end delta and the copy. The workspace, for float32 heads of at most 64 on compute capability
        8.0 on (the 64 x 64 kernel, split keys on), holds per batch and head a GradQTempStorage, 4 ints and
        64 x 64 floats, per block of 64 queries and 64 columns (kernel_backward.h workspace_size). Checked
        against the encoder's trace, float32 heads of 64 on the H200."""
        import torch

        grad_out, query, key, value, out = args[0], args[1], args[2], args[3], args[5]
        result = func(*args, **kwargs)
        B, H, M, K = query.shape
        Kv = value.shape[-1]
        g = grad_out.transpose(1, 2)
        copy = None
        if not g.is_contiguous():
            copy = ledger.add_extra(g.numel() * g.element_size(), "temporary", transient=False)
        for t in result[:3]:
            if isinstance(t, torch.Tensor):
                ledger.add_storage(t.untyped_storage())
        fp32 = query.dtype == torch.float32
        if fp32:
            product = ledger.add_extra(B * M * H * Kv * 4, "temporary", transient=False)
            summed = ledger.add_extra(B * M * H * 4, "temporary", transient=False)
            delta = ledger.add_extra(B * H * M * 4, "temporary", transient=False)
            ledger.free_key(summed)
            ledger.free_key(product)
        else:
            # the half kernels compute delta themselves into an empty B x H x M float tensor
            delta = ledger.add_extra(B * H * M * 4, "temporary", transient=False)
        workspace = None
        if fp32 and max(K, Kv) <= 64 and state.gpu.capability >= (8, 0):
            per_head = -(-M // 64) * -(-K // 64) * (4 + 64 * 64)
            workspace = ledger.add_extra(B * H * (-(-per_head // 4) * 4) * 4, "workspace", transient=False)
        # delta lives in the launching lambda, the workspace and the copy in the function: freed in that order
        ledger.free_key(delta)
        if workspace is not None:
            ledger.free_key(workspace)
        if copy is not None:
            ledger.free_key(copy)
        return result

    return Around(run)


def accumulate_in_place(args, kwargs):
    """autograd's InputBuffer::accumulate adds a second gradient for the same input in place into the
    first when it holds that tensor's only reference (can_accumulate_inplace); a fake tensor counts as
    a tensor subclass there and gets the out-of-place sum, one more gradient-sized block (the encoder's
    residual connections, 8 MiB each in its trace: none there; a selective scan's state gradients, one
    per time step, on the CPU). The in-place sum (aten.add_) where the real step makes it, else None:
    the operator runs as it is (aten.add of another kind, or outside a backward)."""
    import sys

    import torch
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    a = args[0]
    b = args[1] if len(args) > 1 else None
    # a tensor a Python backward holds by a name (a custom autograd.Function's) is not the buffer's: only
    # the references of this call itself, 4 as measured here (the args tuple, this frame, the check), leave it to
    # autograd's buffer alone; its storage's only references are its tensor's and the Python storage
    # object this check makes
    if torch._C._current_graph_task_id() == -1 or sys.getrefcount(a) > 4 or len(args) != 2 or kwargs:
        return None
    alike = isinstance(b, torch.Tensor) and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
    only = torch._C._storage_Use_Count(a.untyped_storage()._cdata) == 2
    if alike and only and not a._is_view() and dense(a):
        return torch.ops.aten.add_.Tensor(a, b)
    return None


def _dropout_off(args, kwargs):
    """aten.dropout reaching the dry run whole (under inference_mode) in eval or with p = 0: the CPU kernel
    returns its input itself (at::dropout's short cut), where the fake's decomposition clones it (one more
    hidden-state-sized tensor per dropout of an inference or generate estimate). None: it runs as it is."""
    names = ("input", "p", "train")
    given = dict(zip(names, args), **kwargs)
    if not given.get("train", True) or given.get("p", 0.5) == 0:
        return given["input"]
    return None


def _grad_accumulate(ledger, func, args, kwargs):
    """aten.add.Tensor on CUDA (a kernel modelled whole): accumulate_in_place, else the operator."""
    out = accumulate_in_place(args, kwargs)
    return func(*args, **kwargs) if out is None else out


_RNN_MODES = {0: "RNN_RELU", 1: "RNN_TANH", 2: "LSTM", 3: "GRU"}


def _cudnn_rnn_forward(state):
    # lazy: allocator loads only when an estimate's dry run needs it
    from .allocator import rnn_sizes

    def fix(args, kwargs, out):
        (inp, weight, stride0, weight_buf, hx, cx, mode, hidden, proj, layers, batch_first, dropout, train,
         bidir, batch_sizes) = args[:15]  # fmt: skip
        if not train:
            return 0
        seq = len(batch_sizes) if batch_sizes else inp.shape[1 if batch_first else 0]
        batch = batch_sizes[0] if batch_sizes else inp.shape[0 if batch_first else 1]
        reserve, workspace = rnn_sizes(_RNN_MODES.get(mode, "LSTM"), seq, batch, inp.shape[-1], hidden, layers,
                                       2 if bidir else 1, inp.element_size())  # fmt: skip
        r = out[3]
        if r.untyped_storage().nbytes() < reserve:
            r.untyped_storage().resize_(reserve)
        state.count("cuDNN RNN")
        return workspace

    return fix


def _cudnn_rnn_after(state):
    """Note each training _cudnn_rnn that reads the parameters' flat buffer in place (CudaState.rnn_in_place)."""

    def post(ledger, args, kwargs, out):
        weight_buf, train = args[3], args[12]
        if not train or weight_buf is None:
            return
        buf = ledger.key_of(weight_buf)
        reserve = ledger.key_of(out[3])
        first = ledger.key_of(out[0])
        if buf is None or reserve is None or ledger.info[buf][3] != "parameter":
            return
        pos = len(ledger.events)
        while pos > 0 and ledger.events[pos - 1] != (first, 1):
            pos -= 1
        state.rnn_in_place.append((pos - 1 if pos else len(ledger.events), buf, reserve))

    return post


def _cudnn_rnn_backward(state):
    """_cudnn_rnn_backward as RNN.cpp runs it: zeros for undefined output gradients, a contiguous
    copy of the output gradient, then backward_input (dx, dhx, dcx, workspace) and
    backward_weight (a flat dw like the weight buffer, workspace)."""
    # lazy: allocator loads only when an estimate's dry run needs it
    from .allocator import rnn_sizes

    def run(ledger, func, args, kwargs):
        import torch

        (inp, weight, stride0, weight_buf, hx, cx, output, grad_output, grad_hy, grad_cy, mode, hidden, proj,
         layers, batch_first, dropout, train, bidir, batch_sizes, dropout_state, reserve, mask) = args  # fmt: skip
        seq = len(batch_sizes) if batch_sizes else inp.shape[1 if batch_first else 0]
        batch = batch_sizes[0] if batch_sizes else inp.shape[0 if batch_first else 1]
        _r, workspace = rnn_sizes(_RNN_MODES.get(mode, "LSTM"), seq, batch, inp.shape[-1], hidden, layers,
                                  2 if bidir else 1, inp.element_size())  # fmt: skip
        held = []
        if grad_hy is None:
            held.append(ledger.add_extra(hx.numel() * hx.element_size(), "temporary", transient=False))
        if grad_cy is None and cx is not None:
            held.append(ledger.add_extra(cx.numel() * cx.element_size(), "temporary", transient=False))
        dy = None
        if grad_output is not None and not grad_output.is_contiguous():
            dy = ledger.add_extra(grad_output.numel() * grad_output.element_size(), "temporary", transient=False)
        dx = torch.empty(tuple(inp.shape), dtype=inp.dtype)
        dhx = torch.empty(tuple(hx.shape), dtype=hx.dtype)
        dcx = torch.empty(tuple(cx.shape), dtype=cx.dtype) if cx is not None else None
        for t in (dx, dhx, dcx):
            if t is not None:
                ledger.add_storage(t.untyped_storage())
        ledger.add_extra(workspace)
        if dy is not None:
            ledger.free_key(dy)
        dws = []
        if mask[3]:
            flat = torch.empty(weight_buf.numel(), dtype=weight_buf.dtype)
            ledger.add_storage(flat.untyped_storage())
            offset = 0
            for w in weight:
                dws.append(flat[offset: offset + w.numel()].view(tuple(w.shape)))
                offset += w.numel()
            ledger.add_extra(workspace)
        for k in held:
            ledger.free_key(k)
        return dx, dhx, dcx, dws

    return Around(run)


def _conv_transposes(state, *tensors):
    """Bytes of a cuDNN convolution's workspace: cuDNN's NHWC engines (the ones its heuristics chose
    for most float convolutions in the measured H200 traces, cuDNN 9.19) transpose each NCHW operand
    into the workspace, plus 16 B; a 1x1 filter needs no transposition (KCRS == KRSC), nor does a
    channels-last tensor. Engines that work in place (some 1x1 and depthwise convolutions) or use
    split-K scratch differ: not exact."""
    import torch

    total = 0
    for t, is_filter in tensors:
        if t is None or t.dim() < 3:
            continue
        if is_filter and all(d == 1 for d in t.shape[2:]):
            continue
        fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d if t.dim() == 5 else None
        if fmt is not None and t.is_contiguous(memory_format=fmt) and not t.is_contiguous():
            continue
        total += t.numel() * t.element_size()
    return total + 16 if total else 0


def _cudnn_conv(state, args):
    import torch

    x, w = args[0], args[1]
    groups = args[8] if len(args) > 8 else 1
    if not torch.backends.cudnn.enabled or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if groups > 1 and groups == x.shape[1]:  # depthwise: torch's own kernels, no workspace
        return False
    return x.dim() in (3, 4, 5)


def _conv_forward(state):
    def fix(args, kwargs, out):
        if not _cudnn_conv(state, args):
            return 0
        state.count("cuDNN convolution")
        return _conv_transposes(state, (args[0], False), (out, False), (args[1], True))

    return fix


def _conv_backward(state):
    """convolution_backward as cuDNN runs it: grad_input and its workspace (dgrad: grad_output,
    filter, grad_input transposed), then grad_weight and its workspace (wgrad: input, grad_output,
    grad_weight), then the bias gradient."""

    def run(ledger, func, args, kwargs):
        out = func(*args, **kwargs)
        grad_out, x, w = args[0], args[1], args[2]
        conv_args = (x, w, None, args[4], args[5], args[6], args[7], args[8], args[9])
        if not _cudnn_conv(state, conv_args):
            return out
        dx, dw, db = out
        if dx is not None:
            ledger.add_storage(dx.untyped_storage())
            ledger.add_extra(_conv_transposes(state, (grad_out, False), (w, True), (dx, False)))
        if dw is not None:
            ledger.add_storage(dw.untyped_storage())
            ledger.add_extra(_conv_transposes(state, (x, False), (grad_out, False), (dw, True)))
        return out

    return Around(run)


def _host_rng(slots):
    """The fused attention kernels' RNG seed and offset: host tensors (or none), no device memory."""

    def fix(args, kwargs, out):
        import torch

        for i in slots:
            t = out[i] if i < len(out) else None
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                t.untyped_storage().resize_(0)
        return 0

    return fix


def cuda_kernels(state):
    """The kernel table for estimate(device="cuda") (see dispatch._accounting_mode)."""
    import torch

    aten = torch.ops.aten
    after = {}
    for op in (aten.mm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default, aten.mv.default,
               aten.addmv.default, aten.dot.default, aten.vdot.default, aten.mm.out, aten.bmm.out):  # fmt: skip
        after[op] = _blas_after(state)
    for op in (aten.addmm.default, aten._addmm_activation.default, aten.addmm.out):
        after[op] = _blas_after(state, lt=True)
    for op in (aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default):
        after[op] = _reduce_after(state)
    after[aten.native_layer_norm_backward.default] = _layer_norm_backward_after
    for op in (aten.mse_loss.default, aten.smooth_l1_loss.default):
        after[op] = _reduced_loss_after(state)
    after[aten._cudnn_rnn.default] = _cudnn_rnn_after(state)
    return {
        "probe": False,  # the CPU kernels' scratch space is not the GPU's
        "scalars": False,  # Python numbers passed to CUDA kernels stay on the host
        "after": after,
        aten._cudnn_rnn.default: _cudnn_rnn_forward(state),
        aten._cudnn_rnn_backward.default: _cudnn_rnn_backward(state),
        aten._scaled_dot_product_efficient_attention.default: _host_rng((2, 3)),
        aten._scaled_dot_product_cudnn_attention.default: _host_rng((6, 7)),
        aten._scaled_dot_product_flash_attention.default: _host_rng((6, 7)),
        aten.convolution.default: _conv_forward(state),
        aten.convolution_backward.default: _conv_backward(state),
        aten._grouped_mm.default: _grouped_mm(cuda=True),
        aten.native_dropout.default: Around(_dropout_mask_first),
        aten.add.Tensor: Around(_grad_accumulate),
        aten.mse_loss.default: _reduced_loss_output,
        aten.smooth_l1_loss.default: _reduced_loss_output,
        aten._scaled_dot_product_efficient_attention_backward.default: _efficient_attention_backward(state),
        **{op: Composite(fn) for op, fn in kernel_rules(state.gpu, notes=notes).items()},
    }


def _python_clone(func, cache={}):  # noqa: B006 - a cache of clones, one per torch function
    """A copy of a Python torch function (torch.nn.functional's) whose own __torch_function__ check is
    off, so that a mode stays in force for the calls inside it (torch pops the mode while its
    __torch_function__ runs). Only its globals differ: the names it calls resolve to the same
    objects."""
    import types

    clone = cache.get(func)
    if clone is None:
        g = dict(func.__globals__)
        for name in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
            if name in g:
                g[name] = _never
        clone = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
        clone.__kwdefaults__ = func.__kwdefaults__
        cache[func] = clone
    return clone


def _never(*args, **kwargs):
    return False


def cuda_routing(state):
    """The TorchFunctionMode that takes CUDA's branch of device-dependent composite operators."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    # lazy: allocator loads only when an estimate's dry run needs it
    from .allocator import sdpa_backend

    aten = torch.ops.aten
    VF = torch._C._VariableFunctions
    gpu = state.gpu

    def native_dropout(x, p, train):
        if train and 0 < p < 1 and x.numel() > 0:
            state.count("dropout (fused, bool mask)")
            return aten.native_dropout.default(x, p, True)[0]
        return None

    def dropout_fn(input, p=0.5, training=True, inplace=False):
        if not inplace and isinstance(input, torch.Tensor):
            out = native_dropout(input, p, training)
            if out is not None:
                return out
        return F.dropout(input, p, training, inplace)

    def vf_dropout(input, p, train):
        out = native_dropout(input, p, train)
        return out if out is not None else VF.dropout(input, p, train)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu") and query.dtype == torch.float32:
            # CUDA autocast runs scaled_dot_product_attention in the low dtype (its lower_precision_fp
            # list); this mode sees the call before the dispatcher's autocast does
            low = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(low), key.to(low), value.to(low)
        kind = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, gpu, enable_gqa)
        state.count(f"attention: {kind}")
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:
            # convert_boolean_attn_mask: 0 where attending, -inf elsewhere, in the query's dtype
            mask = torch.where(mask, 0.0, float("-inf")).to(query.dtype)
        if kind == "efficient":
            if mask is not None and mask.shape[-1] % 16:
                # preprocess_mask: the bias's last dimension padded to a multiple of 16
                pad = 16 - mask.shape[-1] % 16
                mask = F.pad(mask, (0, pad))[..., : mask.shape[-1]]
            if mask is not None:
                mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return aten._scaled_dot_product_efficient_attention.default(
                query, key, value, mask, grad, dropout_p, is_causal, scale=scale)[0]
        if kind == "cudnn":
            return aten._scaled_dot_product_cudnn_attention.default(
                query, key, value, mask, grad, dropout_p, is_causal, False, scale=scale)[0]
        if kind == "flash":
            d = query.shape[-1]
            if d % 8:  # pad_last_dim<8>: copies of q, k, v padded with zeros
                pad = 8 - d % 8
                query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
            out = aten._scaled_dot_product_flash_attention.default(
                query, key, value, dropout_p, is_causal, False, scale=scale if scale is not None else d ** -0.5)[0]
            return out[..., :d] if d % 8 else out
        # math: the composite, whose dropout is the fused kernel on CUDA
        return _python_clone_math(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)

    def _python_clone_math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
        state.unmodelled.add("the math attention fallback keeps its dropout mask as the CPU's composite does")
        return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    def rnn(mode):
        def run(*args, **kwargs):
            # _VF.lstm(input, hx, flat_weights, bias, num_layers, dropout, train, bidirectional, batch_first)
            # (the packed form, with batch_sizes second, is not routed)
            if len(args) != 9 or not isinstance(args[1], (list, tuple, torch.Tensor)) or (
                    isinstance(args[1], torch.Tensor) and args[1].dim() == 1):
                state.unmodelled.add("packed sequences through recurrent layers run the CPU's kernel")
                return getattr(VF, mode)(*args, **kwargs)
            inp, hx, weights, has_bias, layers, dropout, train, bidir, batch_first = args
            hx_list = list(hx) if isinstance(hx, (list, tuple)) else [hx]
            h0 = hx_list[0]
            c0 = hx_list[1] if len(hx_list) > 1 else None
            hidden = c0.shape[2] if c0 is not None else h0.shape[2]
            proj = h0.shape[2] if c0 is not None and c0.shape[2] != h0.shape[2] else 0
            weights = list(weights)
            if torch.is_autocast_enabled("cpu") and inp.is_floating_point():
                # CUDA autocast casts _cudnn_rnn's input, hidden state and each weight to the low
                # dtype (the dry run stands CPU autocast in for CUDA's)
                low = torch.get_autocast_dtype("cpu")
                inp, h0 = inp.to(low), h0.to(low)
                c0 = c0.to(low) if c0 is not None else None
                weights = [w.to(low) for w in weights]
            buf = _flat_buffer(weights)
            if buf is None:
                # try_get_weight_buf failed: _cudnn_rnn copies the weights into a flat buffer of its own
                buf = torch.cat([w.detach().reshape(-1) for w in weights])
            nparams = (4 if has_bias else 2) + (1 if proj else 0)
            code = {"lstm": 2, "gru": 3, "rnn_tanh": 1, "rnn_relu": 0}[mode]
            with torch.autocast("cpu", enabled=False):
                out = aten._cudnn_rnn.default(inp, weights, nparams, buf, h0, c0, code, hidden, proj, layers,
                                              batch_first, dropout, train, bidir, [], None)  # fmt: skip
            if mode == "lstm":
                return out[0], out[1], out[2]
            return out[0], out[1]

        return run

    def linear(input, weight, bias=None):
        """at::linear's last branch (Linear.cpp): an input neither 2-D (addmm) nor contiguous (flattened to
        one addmm) goes through matmul, and the bias is added in place to its output. On fake tensors
        torch takes the out-of-place add meant for tensor subclasses, a second output-sized block
        (the encoder's packed in-projection of its transposed input, 24 MiB, not in the trace). Under
        autocast the dispatcher casts linear's arguments first: left to it."""
        if (bias is None or not isinstance(input, torch.Tensor) or input.dim() == 2 or input.is_contiguous()
                or torch.is_autocast_enabled("cpu")):
            return F.linear(input, weight, bias)
        return torch.matmul(input, weight.t()).add_(bias)

    handlers = {
        torch._C._nn.linear: linear,
        torch._C._nn.scaled_dot_product_attention: sdpa,
        F.dropout: dropout_fn,
        VF.dropout: vf_dropout,
        VF.lstm: rnn("lstm"),
        VF.gru: rnn("gru"),
        VF.rnn_tanh: rnn("rnn_tanh"),
        VF.rnn_relu: rnn("rnn_relu"),
    }
    # nn.MultiheadAttention (need_weights=False, as nn.TransformerEncoderLayer calls it) reaches SDPA
    # from inside multi_head_attention_forward, where torch has popped this mode
    nested = {F.multi_head_attention_forward}
    if not torch.backends.cudnn.enabled:
        for f in (VF.lstm, VF.gru, VF.rnn_tanh, VF.rnn_relu):
            handlers.pop(f)

    class CudaRouting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            h = handlers.get(func)
            if h is not None:
                return h(*args, **kwargs)  # torch has popped this mode: the fallbacks run as given
            if func in nested:
                # torch's Python functions that call SDPA or dropout from inside them
                with self:
                    return _python_clone(func)(*args, **kwargs)
            return func(*args, **kwargs)

    return CudaRouting()


def _flat_buffer(weights):
    """The weight buffer cuDNN reads when the weights are consecutive views of one storage (as
    nn.LSTM.flatten_parameters() leaves them on CUDA), else None (try_get_weight_buf)."""
    import torch

    if not weights:
        return None
    st = weights[0].untyped_storage()
    expected = weights[0].storage_offset()
    for w in weights:
        if w.untyped_storage() is not st and w.untyped_storage()._cdata != st._cdata:
            return None
        if w.storage_offset() != expected or not w.is_contiguous():
            return None
        expected += w.numel()
    base = torch.empty(0, dtype=weights[0].dtype)
    base.set_(st, weights[0].storage_offset(), (expected - weights[0].storage_offset(),), (1,))
    return base
