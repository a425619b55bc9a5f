"""advise(): what to change to train a model in less memory, in the order a user would try it.

    adv = memtorch.advise(model, x, optimizer="adamw", budget="80 GiB")
    print(adv); adv.items[0].after; adv.items[0].fits; adv.to_dict()

The rows come by group (memtorch.reports.advice.GROUPS): first what keeps the model and what it learns,
cheapest in step time first (activation checkpointing of the repeated blocks, mixed precision, a smaller
micro-batch with gradient accumulation, plan()'s cheapest configuration that fits, CPU offload and 8-bit
optimizer state); then what changes how or what it learns (16-bit weights, another optimizer, freezing);
then what changes the model, only when asked (remove_layers=True: fewer blocks; resize: a smaller width);
then what else was found (modules never called, parameters without gradient, mostly-zero weights).

Every step figure is memtorch.estimate()'s for that configuration, from the engine plan() and fit() use
(memtorch.estimator.engine: each configuration dry-run once, so advise's rows, plan's table and fit's answer
agree to the byte and share their dry runs); a row judged against the budget is judged as plan() judges
(the reserved figure on cuda, the peak on the CPU, plus the reserve). Each row says how its figure was
obtained (``basis``):

- "estimated by memtorch.estimate" / "by memtorch.plan": a dry run on fake tensors (no real memory);
- "estimated by arithmetic": counted on the estimate (CPU offload: no configuration estimate() runs),
  never judged against a budget (the 8-bit state row is estimate()'s step with optimizer="adamw8bit");
- "exact arithmetic": counted from the tensors memtorch.inspect() walks (a float32 parameter is 4
  bytes, 2 in bfloat16; Adam keeps two buffers of each parameter's size);
- "measured" (measure=True only): two real training steps of a copy of the model, each variant tracked
  by memtorch.track() (exact CPU counters);
- sparse storage: counted (a CSR matrix holds rows + 1 and nnz int64 indices and nnz values) and
  measured on the converted tensor, which must agree.

This module is memtorch.estimator.advise (first named memtorch.advice, which stays): inside the package,
importing it never shadows the function ``memtorch.advise``.

The user's model and optimizer are never changed: a variant is estimated on a copy (measured on a deep
copy with measure=True). Savings are each estimated alone; they do not add up.
"""

import copy
import functools
import gc

from .. import errors, units
from ..errors import MemtorchError
from .engine import DEFAULT_DEVICE_NOTE  # cheap: the engine loads estimation when it runs
from ..reports.advice import EXACT, ESTIMATED, GROUPS, MEASURED, Advice, Suggestion  # the result types' home
from .._torch import torch as _load_torch  # the loader only: torch itself loads on first call

__all__ = ["advise", "Advice", "Suggestion", "GROUPS"]


# ---------------------------------------------------------------------------
# helpers


def _torch():
    return _load_torch()


def default_loss(output, *inputs, **kw_inputs):
    """The loss of estimate(), plan() and advise() without loss_fn (memtorch._inputs.default_loss):
    the output's ``.loss`` when the model computes one, else the sum of its floating-point tensors."""
    # lazy: _inputs loads only when an estimate's dry run needs it
    from .._inputs import default_loss as loss

    return loss(output, *inputs, **kw_inputs)


def _copy_optimizer(optimizer, params, device="cpu"):
    """An optimizer over ``params`` as ``optimizer`` says (None: none): a name (estimate's names),
    an optimizer whose class and settings are copied, or a factory taking the parameters; the one
    rule of memtorch.estimate (estimation._make_optimizer)."""
    # lazy: estimation loads only when this path runs (importing advice stays cheap)
    from .estimate import _make_optimizer

    if optimizer is None:
        return None
    return _make_optimizer(optimizer, params, device)


def _storage_rows(mm):
    """One row per unique storage (first occurrence): the walker's attribution."""
    return mm.to_numpy()[mm._first]


# precision -> (autocast dtype, parameter dtype) of a measured run
_MEASURABLE = {"fp32": (None, None), "bf16-mixed": ("bfloat16", None), "fp16-mixed": ("float16", None),
               "bf16-true": (None, "bfloat16"), "fp16-true": (None, "float16")}  # fmt: skip


def _step_peak(model, inputs, optimizer, loss_fn, autocast=None, checkpoint=(), dtype=None, steps=2, base=None):
    """Run ``steps`` training steps of a deep copy of ``model``; return a dict of figures.

    peak: bytes held by the copy (parameters, buffers) + the block's largest rise
    above its start (gradients, optimizer state, activations, temporaries): the
    step's peak apart from the inputs, which every variant shares.
    """
    torch = _torch()
    # lazy: tracking loads _C and NumPy; only this path needs it (importing advice stays cheap)
    from .. import inspection, tracking

    base = base or {}
    amp, cast = _MEASURABLE[base.get("precision", "fp32")]
    if autocast is None and amp is not None:
        autocast = (_device_type(model, ()), getattr(torch, amp))
    if dtype is None and cast is not None:
        dtype = getattr(torch, cast)
    try:
        probe = copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001 - re-raised with what failed
        raise MemtorchError(
            f"advise() measures steps on a copy of the model, and copy.deepcopy(model) failed: {type(e).__name__}: {e}"
        ) from e
    probe.zero_grad(set_to_none=True)
    probe.train()
    if dtype is not None:  # the whole model and the floating-point inputs in ``dtype``
        probe.to(dtype)
        inputs = inputs.map(lambda x: x.to(dtype) if x.is_floating_point() else x)
    named = dict(probe.named_modules())
    for name in checkpoint:
        _checkpoint(named[name])
    opt = _copy_optimizer(optimizer, [p for p in probe.parameters() if p.requires_grad], _device_type(probe, ()))
    base_bytes = inspection.inspect(probe).total
    loss_args = inputs.as_tuple()
    # garbage in reference cycles (an earlier copy, say) freed by the collector inside the block
    # would lower the rise measured: collect it first
    gc.collect()
    ctx = (lambda: torch.autocast(autocast[0], dtype=autocast[1])) if autocast else None
    with tracking.track(probe, optimizer=opt, leaks=False) as t:
        for _ in range(steps):
            probe.zero_grad(set_to_none=True)
            if ctx is not None:
                with ctx():
                    out = inputs.call(probe)
                    loss = loss_fn(out, *loss_args)
            else:
                out = inputs.call(probe)
                loss = loss_fn(out, *loss_args)
            del out
            loss.backward()
            del loss
            if opt is not None:
                opt.step()
    r = t.report
    for name in checkpoint:  # the patched forward refers to its module: break the cycle
        named[name].__dict__.pop("forward", None)
    result = {
        "peak": base_bytes + r.peak_above_start,
        "report": r,
        "exact": r.exact,
        "basis": MEASURED,
        "modules": {m.name: m for m in r.modules},
        "no_grad": [n for n, p in probe.named_parameters() if p.requires_grad and p.grad is None],
        "probe": probe,
        "optimizer": opt,
    }
    return result


def _step_estimate(model, inputs, optimizer, loss_fn, autocast=None, checkpoint=(), dtype=None, base=None,
                   engine=None, batch=None):  # fmt: skip
    """The figures of a step from memtorch.estimate (a dry run on fake tensors, no real memory): the user's
    model through advise's engine (memtorch.estimator.engine: each configuration dry-run once, plan's and fit's
    rows from the same runs), a changed copy (fewer blocks, another width) by estimate() itself."""
    torch = _torch()
    # lazy: estimation loads only when this path runs (importing advice stays cheap)
    from .estimate import estimate

    base = dict(base or {})
    if autocast is not None:
        base["precision"] = {torch.bfloat16: "bf16-mixed", torch.float16: "fp16-mixed"}[autocast[1]]
    elif dtype is not None:
        base["precision"] = {torch.bfloat16: "bf16-true", torch.float16: "fp16-true"}[dtype]
    if checkpoint:
        base["checkpointing"] = checkpoint if checkpoint == "blocks" else list(checkpoint)
    run_inputs = inputs if batch is None else inputs.with_batch(batch)
    if dtype is not None and autocast is None:
        # the whole model in ``dtype``: its floating-point inputs too, as _step_peak measures it (estimate's
        # precision='bf16-true' casts the parameters only, as the user's own step would cast the batch)
        run_inputs = run_inputs.map(lambda x: x.to(dtype) if x.is_floating_point() else x)
    if engine is not None and model is engine.model:
        f = engine.figures(base["precision"], base.get("checkpointing"), run_inputs,
                           world_size=base.get("world_size", 1), sharding=base.get("sharding"))  # fmt: skip
        est = engine.run(base["precision"], base.get("checkpointing"), run_inputs)
        peak, reserved, judged = f.peak, f.reserved, f.judged
    else:
        for key in ("gpu", "fsdp_units"):  # given only when set (an estimate() that lacks them still runs)
            if base.get(key) is None:
                base.pop(key, None)
        est = estimate(model, *run_inputs.as_tuple(), optimizer=optimizer, loss_fn=loss_fn,
                       keep_output=engine.fixed["keep_output"] if engine is not None else True, **base)  # fmt: skip
        peak, reserved = est.peak, est.reserved_peak
        judged = reserved if reserved is not None else (est.peak_upper or est.peak)
    return {
        "peak": int(peak),
        "reserved": reserved,
        "judged": int(judged),
        "report": est,
        "exact": True,
        "basis": ESTIMATED,
        "modules": {m.name: m for m in est.modules},
        "no_grad": None,  # not known from a dry run
        "probe": None,
        "optimizer": None,
    }


class _Runner:
    """Runs (or estimates) a training step of a model variant on the user's inputs (an _inputs.Inputs),
    in the configuration ``base`` (precision, device, ...: estimate()'s arguments)."""

    def __init__(self, inputs, optimizer, loss_fn, how, base, engine=None):
        self.inputs, self.optimizer, self.loss_fn, self.how, self.base = inputs, optimizer, loss_fn, how, base
        self.engine = engine

    def __call__(self, model, **kw):
        if self.how == "estimate":
            return _step_estimate(model, self.inputs, self.optimizer, self.loss_fn, base=self.base,
                                  engine=self.engine, **kw)  # fmt: skip
        if kw.get("checkpoint") == "blocks":
            kw["checkpoint"] = _block_names(model)
        run = _step_peak(model, self.inputs if kw.get("batch") is None else self.inputs.with_batch(kw["batch"]).real(),
                         self.optimizer, self.loss_fn, base=self.base,
                         **{k: v for k, v in kw.items() if k != "batch"})  # fmt: skip
        run["judged"] = run["peak"]
        run["reserved"] = None
        return run


def _checkpoint(module):
    from torch.utils.checkpoint import checkpoint

    orig = module.forward

    @functools.wraps(orig)
    def fwd(*args, **kwargs):
        return checkpoint(orig, *args, use_reentrant=False, **kwargs)

    module.forward = fwd


def _fmt(n):
    return units.format(n)


def _both(n):
    """'10.0 KiB (10,240 B)', or '808 B' where the two would repeat each other."""
    text = units.format(n)
    return text if text.endswith(" B") and not text.endswith("iB") else f"{text} ({n:,} B)"


def _measured(*runs):
    """The basis of a figure from step runs: 'measured', 'estimated', or why it is not exact (CUDA: sampled peaks)."""
    if any(r.get("basis") == ESTIMATED for r in runs):
        return ESTIMATED + " by memtorch.estimate"
    if all(r["exact"] for r in runs):
        return MEASURED
    return MEASURED + " (not exact: the counters sampled the peak)"


def _source(run):
    if run.get("basis") == ESTIMATED:
        return "memtorch.estimate: a dry run on fake tensors"
    return "two steps of a copy, memtorch.track"


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


# ---------------------------------------------------------------------------
# the suggestions


def _precision(mm, items, notes):
    """Parameters, gradients and optimizer state in bfloat16 instead of float32: exact arithmetic."""
    rows = _storage_rows(mm)
    sel = (rows["dtype"] == "float32") & (
        (rows["category"] == "parameter")
        | (rows["category"] == "gradient")
        | (rows["category"] == "optimizer_state")
    )
    # Adam's 'step' counters are float32 scalars that stay float32: only tensors with more than one element
    sel &= ~((rows["category"] == "optimizer_state") & (rows["numel"] <= 1))
    fp32 = int(rows["storage_nbytes"][sel].sum())
    if not fp32:
        notes.append("16-bit parameters: no float32 parameters, gradients or optimizer state to halve")
        return
    by = {
        c: int(rows["storage_nbytes"][sel & (rows["category"] == c)].sum())
        for c in ("parameter", "gradient", "optimizer_state")
    }
    words = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer state"}
    parts = [f"{words[c]} {_fmt(b)}" for c, b in by.items() if b]
    now = parts[0] if len(parts) == 1 else ", ".join(parts) + f", {_fmt(fp32)} in all"
    items.append(
        Suggestion(
            "bf16_weights",
            "Keep parameters, gradients and optimizer state in bfloat16 (pure bf16 training)",
            fp32 // 2,
            EXACT,
            "model.to(torch.bfloat16) before creating the optimizer (consider fp32 master weights, e.g. an "
            "optimizer with Kahan summation, if accuracy suffers)",
            f"in float32 now: {now}; in bfloat16, half: {_fmt(fp32 // 2)}"
            + ("" if by["gradient"] else " (no gradients exist yet: after backward they add as much again)"),
            group="changes the training",
            code=_code("bf16_weights"),
        )
    )


def _precision_step(model, run, base, items, notes, budget=None, reserve=0, amp=None):
    """bf16 weights over a whole step (measured or estimated), in place of the held-bytes arithmetic. amp:
    the autocast dtype of the step as given ("bfloat16", "float16"), or None."""
    torch = _torch()
    mine = [s for s in items if s.kind == "bf16_weights"]
    if not mine:
        return
    step = run
    try:
        run = step(model, dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        notes.append(f"bf16 weights: a bfloat16 copy of the model did not run ({type(e).__name__}: {e}); "
                     "the saving counts the bytes held only")  # fmt: skip
        return
    s = mine[0]
    held = s.detail
    s.saves = base["peak"] - run["peak"]
    s.basis = _measured(base, run)
    s.before, s.after = base["peak"], run["peak"]
    s.fits, s.judged_after = _judge(run, budget, reserve), run["judged"]
    s.detail = (
        f"step peak {_fmt(base['peak'])} "
        + ("in float32" if amp is None else f"with float32 weights under {amp} autocast")
        + f", {_fmt(run['peak'])} with the model and inputs in bfloat16 "
        f"({_source(run)}); of which held throughout: {held}"
    )


def _sparse(model, items, notes, threshold):
    """Parameters that are mostly zero, and whether sparse storage would really be smaller."""
    torch = _torch()
    seen = set()
    for name, p in model.named_parameters():
        if p.device.type == "meta" or p.numel() < 16 or p.layout != torch.strided:
            continue
        key = p.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        with torch.no_grad():
            nnz = int(torch.count_nonzero(p))
        zeros = 1 - nnz / p.numel()
        if zeros < threshold:
            continue
        dense = p.numel() * p.element_size()
        # COO: an int64 index per dimension per non-zero, and the values
        coo = p.dim() * nnz * 8 + nnz * p.element_size()
        options = [("COO", coo, "w.to_sparse()")]
        if p.dim() == 2:
            # CSR: rows + 1 int64 row pointers, an int64 column index per non-zero, the values
            csr = (p.shape[0] + 1) * 8 + nnz * 8 + nnz * p.element_size()
            options.append(("CSR", csr, "w.to_sparse_csr().clone()"))
        measured, direct_csr = _sparse_measured(p)
        for fmt_, size_, _ in options:  # the arithmetic, held against the real tensors
            if measured.get(fmt_) != size_:
                raise AssertionError(f"{name}: {fmt_} measured {measured.get(fmt_)} B, counted {size_} B")
        fmt, size, code = min(options, key=lambda o: o[1])
        detail = (
            f"{name}: {zeros:.1%} zeros ({nnz:,} of {p.numel():,} non-zero, {_dtype_name(p.dtype)}); dense "
            f"{_both(dense)}; " + "; ".join(f"{f} {_both(s)}" for f, s, _ in options)
        )
        if direct_csr is not None and fmt == "CSR" and direct_csr != size:
            detail += (
                f"; w.to_sparse_csr() alone holds {_both(direct_csr)}: its column indices keep the whole COO "
                "index storage alive, .clone() drops it"
            )
        if size >= dense:
            notes.append(f"sparse storage: {detail}: sparse would not be smaller")
            continue
        items.append(
            Suggestion(
                "sparse",
                f"Store {name} as a sparse {fmt} tensor",
                dense - size,
                MEASURED,
                f"keep the weight as {code} and use torch.sparse.mm in the forward (inference, or training "
                "with a fixed sparsity pattern); note that torch.nn.utils.prune keeps a dense mask and the "
                "original weight, so it adds memory instead",
                detail,
                before=dense,
                after=size,
            )
        )


def _sparse_measured(p):
    """{format: bytes} of p converted for real (memtorch.sizeof), and to_sparse_csr()'s bytes before .clone()."""
    import warnings

    # lazy: inspection loads _C and NumPy; only this path needs it (importing advice stays cheap)
    from ..inspection import sizeof

    w = p.detach()
    out = {"COO": sizeof(w.to_sparse()).total}
    direct = None
    if w.dim() == 2:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
            c = w.to_sparse_csr()
            direct = sizeof(c).total
            out["CSR"] = sizeof(c.clone()).total
    return out, direct


def _dead(mm, base, items, notes):
    """Modules never called in the forward, and parameters that receive no gradient."""
    called = set()
    for n, m in base["modules"].items():  # a container (nn.ModuleList) is used when a module inside it runs
        if m.calls:
            parts = n.split(".") if n else []
            called.update(".".join(parts[:k]) for k in range(len(parts) + 1))
    rows = {r.name: r for r in mm.modules}
    dead = []
    for name, m in base["modules"].items():
        if name in called:
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent != "" and parent not in called:
            continue  # inside a dead parent: counted with it
        row = rows.get(name)
        if row is None or row.subtree == 0:
            continue
        dead.append((name, m.type, row.subtree))
    if dead:
        total = sum(b for _, _, b in dead)
        items.append(
            Suggestion(
                "unused_modules",
                "Remove modules the forward never calls: "
                + ", ".join(n for n, _, _ in dead[:4])
                + (f" and {len(dead) - 4} more" if len(dead) > 4 else ""),
                total,
                MEASURED if base["basis"] == MEASURED else ESTIMATED + " by memtorch.estimate (calls of its dry run)",
                "delete them from the model (or stop creating them); check first that no other code path calls them",
                "; ".join(f"{n} ({t}) holds {_fmt(b)}" for n, t, b in dead)
                + " (bytes from inspect: parameters, buffers, their gradients and optimizer state; "
                "calls counted by track() over the steps run)",
            )
        )
    dead_names = {n for n, _, _ in dead}
    none = []
    probe = base["probe"]
    if base["no_grad"] is None:
        notes.append("parameters without gradient: not known from an estimate (advise(measure=True) runs the steps)")
        return
    for name, p in probe.named_parameters():
        if not p.requires_grad:
            continue
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        if any(mod == d or mod.startswith(d + ".") for d in dead_names):
            continue
        if name in base["no_grad"]:
            none.append((name, p.numel() * p.element_size()))
    if none:
        total = sum(b for _, b in none)
        items.append(
            Suggestion(
                "no_gradient",
                "Parameters that receive no gradient: "
                + ", ".join(n for n, _ in none[:4])
                + (f" and {len(none) - 4} more" if len(none) > 4 else ""),
                total,
                MEASURED,
                "if they are not meant to learn, freeze them (p.requires_grad_(False)) and leave them out of the "
                "optimizer; if they do not affect the output, remove them",
                "; ".join(f"{n} {_fmt(b)}" for n, b in none)
                + " (their bytes; .grad stayed None after backward in the steps run)",
            )
        )


def _optimizer(mm_opt, optimizer, items, notes, device="cpu"):
    """Switching to SGD (no state) or SGD with momentum (one buffer per parameter): exact arithmetic
    from the measured state of the optimizer after a step of the copy."""
    torch = _torch()
    if optimizer is None:
        notes.append("optimizer: none given, no optimizer state to cut")
        return
    rows = _storage_rows(mm_opt)
    state = rows[rows["category"] == "optimizer_state"]
    total = int(state["storage_nbytes"].sum())
    params = rows[(rows["category"] == "parameter") & rows["requires_grad"]]
    pbytes = int(params["storage_nbytes"].sum())
    name = type(optimizer).__name__
    basis = MEASURED
    how_known = f"{name} holds {_fmt(total)} of state after a step ({len(state)} tensors)"
    if total == 0 and not optimizer.state:
        # before its first step: the state each optimizer creates, counted from the parameters
        total, how_known = _state_arithmetic(optimizer, params, device)
        basis = EXACT
        if total is None:
            notes.append(
                f"optimizer: {name}'s state does not exist before its first step; pass inputs to measure it"
            )
            return
    if total == 0:
        notes.append(f"optimizer: {name} keeps no state")
        return
    items.append(
        Suggestion(
            "optimizer_sgd",
            f"Train with plain SGD instead of {name}",
            total,
            basis,
            "torch.optim.SGD(model.parameters(), lr=...) (no state; expect to retune the learning rate)",
            f"{how_known}; SGD without momentum holds none",
            before=total,
            after=0,
            group="changes the training",
            code=_code("optimizer_sgd"),
        )
    )
    momentum = pbytes  # one buffer per trainable parameter, of its size and dtype
    if total - momentum > 0 and not isinstance(optimizer, torch.optim.SGD):
        items.append(
            Suggestion(
                "optimizer_momentum",
                f"Train with SGD with momentum instead of {name}",
                total - momentum,
                EXACT,
                "torch.optim.SGD(model.parameters(), lr=..., momentum=0.9) (one buffer per parameter)",
                f"{how_known}; SGD with momentum holds one buffer per trainable parameter: {_fmt(momentum)}",
                before=total,
                after=momentum,
                group="changes the training",
                code=_code("optimizer_momentum"),
            )
        )


def _state_arithmetic(optimizer, params, device="cpu"):
    """(bytes, explanation) of the state ``optimizer`` creates at its first step on ``device``, or (None, '')
    for classes not modelled. params: the trainable parameter rows."""
    torch = _torch()
    o = torch.optim
    pbytes = int(params["storage_nbytes"].sum())
    n = len(params)
    name = type(optimizer).__name__
    d = optimizer.defaults
    if isinstance(optimizer, (o.Adam, o.AdamW)):
        k = 3 if d.get("amsgrad") else 2
        # a float32 'step' scalar per parameter, on the parameters' device when fused or capturable,
        # else in host memory: the CPU's own on device="cpu", none of a GPU's
        on_device = d.get("fused") or d.get("capturable")
        step = 4 if on_device or device == "cpu" else 0
        keys = "exp_avg, exp_avg_sq" + (", max_exp_avg_sq" if k == 3 else "")
        total = k * pbytes + step * n
        if not step:
            return total, (
                f"{name} creates {keys} of each parameter's size ({k} x {_fmt(pbytes)}) at its first step: "
                f"{_fmt(total)} (its 'step' scalar per parameter is in host memory, none on {device})"
            )
        return total, (
            f"{name} creates {keys} of each parameter's size ({k} x {_fmt(pbytes)}) and a 'step' scalar per "
            f"parameter ({n} x {step} B) at its first step: {_fmt(total)}"
        )
    if isinstance(optimizer, o.SGD):
        total = pbytes if d.get("momentum") else 0
        return (
            total,
            f"{name} creates {'one momentum buffer per parameter' if total else 'no state'}: {_fmt(total)}",
        )
    return None, ""


def _freeze(mm_opt, model, optimizer, items, notes, device="cpu"):
    """Freezing the largest trainable child saves its gradients and its optimizer state (exact arithmetic)."""
    children = list(model.named_children())
    if len(children) < 2:
        return
    rows = _storage_rows(mm_opt)
    modules = {r.name: r for r in mm_opt.modules}
    best = None
    for name, child in children:
        r = modules.get(name)
        if r is None:
            continue
        trainable = sum(p.numel() * p.element_size() for p in child.parameters() if p.requires_grad)
        if trainable and (best is None or trainable > best[1]):
            best = (name, trainable, r)
    if best is None:
        return
    name, grad_bytes, _row = best
    # a child that holds every trainable parameter (a language model whose head's weight is tied to the
    # embedding inside its body): freezing it leaves nothing to learn, no training to advise
    child = dict(children)[name]
    inside = {id(p) for p in child.parameters() if p.requires_grad}
    if all(id(p) in inside for p in model.parameters() if p.requires_grad):
        shared = any(p.requires_grad for n, c in children if n != name for p in c.parameters())
        notes.append(
            f"freezing: {name} ({type(child).__name__}) holds every trainable parameter of the model"
            + (" (another module's are the same tensors: tied)" if shared else "")
            + ": freezing it would leave nothing to learn"
        )
        return
    state = rows[rows["category"] == "optimizer_state"]
    child_state = sum(
        int(b) for p, b in zip(state["path"].tolist(), state["storage_nbytes"].tolist()) if _under(p, name)
    )
    if child_state == 0 and optimizer is not None and not optimizer.state:
        # no state exists yet (an estimate, or before the first step): the same arithmetic as _optimizer
        rows_p = rows[(rows["category"] == "parameter") & rows["requires_grad"]]
        mine = rows_p[[_in_module(p, name) for p in rows_p["path"].tolist()]]
        counted, _ = _state_arithmetic(optimizer, mine, device)
        child_state = counted or 0
    saves = grad_bytes + child_state
    items.append(
        Suggestion(
            "freeze",
            f"Freeze {name} ({type(child).__name__}): it stops learning",
            saves,
            EXACT,
            f"model.{name}.requires_grad_(False) and leave its parameters out of the optimizer",
            f"its gradients {_fmt(grad_bytes)} (one per trainable parameter, same size) + its optimizer state "
            f"{_fmt(child_state)}" + ("" if optimizer is not None else " (no optimizer given)"),
            group="changes the training",
            code=_code("freeze", what=name),
        )
    )


def _in_module(path, name):
    return path.startswith(name + ".")


def _under(path, name):
    """Whether an optimizer-state row ('optimizer.state[<parameter name>].<key>') belongs to module ``name``."""
    if not path.startswith("optimizer.state[") or "]" not in path:
        return False
    param = path[len("optimizer.state[") : path.index("]")]
    return param.startswith(name + ".")


def _autocast(model, run, base, items, notes, budget=None, reserve=0):
    """Mixed precision: forward and loss under bf16 autocast (estimate(precision="bf16-mixed"))."""
    torch = _torch()
    dev = base.get("device_type") or _device_type(model, run.inputs)
    step = run
    try:
        run = step(model, autocast=(dev, torch.bfloat16))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        notes.append(f"bf16 autocast: the model did not run under torch.autocast: {type(e).__name__}: {e}")
        return
    saves = base["peak"] - run["peak"]
    detail = f"step peak {_fmt(base['peak'])} in float32, {_fmt(run['peak'])} under bf16 autocast on {dev}"
    if saves <= 0:
        notes.append(f"bf16 autocast: no saving ({detail})")
        return
    items.append(_changed(
        "autocast_bf16", "Mixed precision: forward and loss under bf16 autocast", base, run,
        "activations in bfloat16, parameters and optimizer state kept in float32 (fp16 on CUDA also needs "
        "torch.amp.GradScaler)", detail + f" ({_source(run)})", "keeps the model", budget, reserve,
        _code("autocast_bf16", dev=dev)))  # fmt: skip


def _peak_phase(report):
    phases = [p for p in report.phases.values() if p.calls]
    return max(phases, key=lambda p: p.peak).name if phases else None


def _device_type(model, inputs):
    for p in model.parameters():
        return p.device.type
    for x in (inputs.tensors() if hasattr(inputs, "tensors") else inputs):
        if hasattr(x, "device"):
            return x.device.type
    return "cpu"


def _checkpoint_blocks(model, base):
    """The units estimate(checkpointing="blocks") recomputes (each block of the outermost nn.ModuleLists);
    without a ModuleList, the siblings that hold the most activations together (e.g. the layers of a
    Sequential)."""
    mods = base["modules"]
    names = _block_names(model)
    if names:
        total = sum(mods[n].activation_bytes for n in names if n in mods)
        return (total, names[0].rsplit(".", 1)[0] if "." in names[0] else "", names)
    groups = {}
    for name, m in mods.items():
        if not name or not m.calls:
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        groups.setdefault(parent, []).append((name, m))
    named = dict(model.named_modules())
    best = None
    for parent, members in groups.items():
        members = [(n, m) for n, m in members if len(list(named[n].children())) > 0 or len(members) > 1]
        if len(members) < 2:
            continue
        total = sum(m.activation_bytes for _, m in members)
        if best is None or total > best[0]:
            best = (total, parent, [n for n, _ in members])
    return best


def _block_names(model):
    """The names of the units estimate(checkpointing="blocks") recomputes (estimation.block_names)."""
    # lazy: estimation loads only when this path runs (importing advice stays cheap)
    from .estimate import block_names

    return [n for n, _ in block_names(model)]


# The one line that makes each change, in the user's framework (memtorch.advise(framework=...)): the plain
# torch call, Hugging Face's TrainingArguments, Lightning's Trainer. {mb}, {k}, {n}, {what}: the row's figures.
CODE = {
    "checkpointing": {
        "torch": "out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) for each block "
                 "(a Hugging Face model: model.activation_checkpointing_enable(), formerly "
                 "gradient_checkpointing_enable())",
        "transformers": "TrainingArguments(..., activation_checkpointing=True) (older transformers: "
                        "gradient_checkpointing=True)",
        "lightning": "Trainer(strategy=FSDPStrategy(activation_checkpointing_policy={{Block}})), or "
                     "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) in forward",
    },
    "autocast_bf16": {
        "torch": "with torch.autocast('{dev}', dtype=torch.bfloat16): loss = loss_fn(model(x))",
        "transformers": "TrainingArguments(..., bf16=True)",
        "lightning": "Trainer(..., precision='bf16-mixed')",
    },
    "micro_batch": {
        "torch": "micro-batches of {mb}, loss / {k} backward each, optimizer.step() every {k}",
        "transformers": "TrainingArguments(..., per_device_train_batch_size={mb}, gradient_accumulation_steps={k})",
        "lightning": "DataLoader(..., batch_size={mb}) and Trainer(..., accumulate_grad_batches={k})",
    },
    "sharding": {
        "torch": "{torch_sharding}",
        "transformers": "{hf_sharding}",
        "lightning": "{pl_sharding}",
    },
    "cpu_offload": {
        "torch": "fully_shard(module, offload_policy=CPUOffloadPolicy()) (FSDP2; the step runs on the CPU)",
        "transformers": "TrainingArguments(..., fsdp='full_shard offload auto_wrap'), or a DeepSpeed config with "
                        "zero_optimization.offload_optimizer.device='cpu'",
        "lightning": "Trainer(..., strategy='deepspeed_stage_2_offload')",
    },
    "optimizer_8bit": {
        "torch": "bitsandbytes.optim.AdamW8bit(model.parameters(), lr=...) in place of torch.optim.AdamW",
        "transformers": "TrainingArguments(..., optim='adamw_bnb_8bit')",
        "lightning": "return bitsandbytes.optim.AdamW8bit(self.parameters(), lr=...) from configure_optimizers",
    },
    "bf16_weights": {
        "torch": "model.to(torch.bfloat16) before creating the optimizer (pure bf16 training)",
        "transformers": "from_pretrained(..., torch_dtype=torch.bfloat16) and TrainingArguments(..., bf16=True)",
        "lightning": "Trainer(..., precision='bf16-true')",
    },
    "optimizer_sgd": {
        "torch": "torch.optim.SGD(model.parameters(), lr=...)",
        "transformers": "TrainingArguments(..., optim='sgd')",
        "lightning": "return torch.optim.SGD(self.parameters(), lr=...) from configure_optimizers",
    },
    "optimizer_momentum": {
        "torch": "torch.optim.SGD(model.parameters(), lr=..., momentum=0.9)",
        "transformers": "an optimizer of your own: Trainer(..., optimizers=(torch.optim.SGD(model.parameters(), "
                        "lr=..., momentum=0.9), None))",
        "lightning": "return torch.optim.SGD(self.parameters(), lr=..., momentum=0.9) from configure_optimizers",
    },
    "lora": {
        "torch": "model = peft.get_peft_model(model, peft.LoraConfig(r={r}, lora_alpha={alpha}, "
                 "target_modules={targets}))",
        "transformers": "model = peft.get_peft_model(model, peft.LoraConfig(r={r}, lora_alpha={alpha}, "
                        "target_modules={targets})) before Trainer(...)",
        "lightning": "self.model = peft.get_peft_model(self.model, peft.LoraConfig(r={r}, lora_alpha={alpha}, "
                     "target_modules={targets})) in the LightningModule's __init__",
    },
    "qlora": {
        "torch": "the model loaded with from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
                 "bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)), "
                 "then peft.get_peft_model(model, peft.LoraConfig(r={r}, lora_alpha={alpha}, target_modules={targets}))",
        "transformers": "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
                        "bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, "
                        "bnb_4bit_compute_dtype=torch.bfloat16)) and peft.get_peft_model(model, "
                        "peft.LoraConfig(r={r}, lora_alpha={alpha}, target_modules={targets}))",
        "lightning": "the same in the LightningModule's __init__ (transformers' BitsAndBytesConfig, then peft)",
    },
    "freeze": {
        "torch": "model.{what}.requires_grad_(False), and its parameters left out of the optimizer",
        "transformers": "model.{what}.requires_grad_(False) before Trainer(...)",
        "lightning": "self.{what}.requires_grad_(False) in the LightningModule's __init__ (or the "
                     "BackboneFinetuning callback)",
    },
}
FRAMEWORKS = ("torch", "transformers", "lightning")

_SHARDING_CODE = {
    "ddp": ("DistributedDataParallel(model)", "torchrun --nproc-per-node {n} train.py (the Trainer wraps DDP)",
            "Trainer(..., strategy='ddp', devices={n})"),
    "zero1": ("ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW) under DDP",
              "a DeepSpeed config with zero_optimization.stage 1", "Trainer(..., strategy='deepspeed_stage_1', "
              "devices={n})"),
    "zero1-even": ("DeepSpeed ZeRO stage 1 (zero_optimization.stage 1)",
                   "a DeepSpeed config with zero_optimization.stage 1",
                   "Trainer(..., strategy='deepspeed_stage_1', devices={n})"),
    "zero2": ("fully_shard(block, reshard_after_forward=False) for each block, then the root (FSDP2)",
              "TrainingArguments(..., fsdp='shard_grad_op auto_wrap')",
              "Trainer(..., strategy=FSDPStrategy(sharding_strategy='SHARD_GRAD_OP'), devices={n})"),
    "zero3": ("fully_shard(block) for each block, then the root (FSDP2)",
              "TrainingArguments(..., fsdp='full_shard auto_wrap')", "Trainer(..., strategy='fsdp', devices={n})"),
}  # fmt: skip


def _code(kind, **fill):
    """{framework: line} of a change, its figures filled in."""
    lines = CODE.get(kind)
    if lines is None:
        return {}
    return {fw: text.format(**fill) for fw, text in lines.items()}


def _judge(run, budget, reserve):
    """Whether a run's judged figure (reserved on cuda) and the reserve fit the budget (None: no budget)."""
    if budget is None or run is None:
        return None
    return run["judged"] + reserve <= budget


def _changed(kind, title, base, run, how, detail, group, budget, reserve, code=None):
    """A Suggestion from a run of the step with the change: the peak before and after, whether it fits."""
    return Suggestion(kind, title, base["peak"] - run["peak"], _measured(base, run), how, detail,
                      before=base["peak"], after=run["peak"], group=group, fits=_judge(run, budget, reserve),
                      code=code or {}, judged_after=run["judged"])  # fmt: skip


def _checkpointing(model, run, base, items, notes, budget=None, reserve=0):
    found = _checkpoint_blocks(model, base)
    if found is None or found[0] == 0:
        notes.append("gradient checkpointing: no group of sibling blocks holding activations")
        return
    total, _parent, names = found
    step = run
    blocks = names == _block_names(model)  # estimate(checkpointing="blocks")'s units: plan's dry run
    try:
        run = step(model, checkpoint="blocks" if blocks else names)
    except Exception as e:  # noqa: BLE001
        notes.append(
            f"gradient checkpointing of {', '.join(names)}: the model did not run: {type(e).__name__}: {e}"
        )
        return
    saves = base["peak"] - run["peak"]
    label = names[0] + (f" .. {names[-1]}" if len(names) > 1 else "")
    detail = (
        f"{len(names)} blocks ({label}) leave {_fmt(total)} of activations per forward; step peak "
        f"{_fmt(base['peak'])} without, {_fmt(run['peak'])} with checkpointing ({_source(run)})"
    )
    if saves <= 0:
        notes.append(f"gradient checkpointing: no saving ({detail})")
        return
    items.append(_changed(
        "checkpointing", f"Activation checkpointing of {label}", base, run,
        "recompute each block's forward in backward (about one more forward of time)", detail,
        "keeps the model", budget, reserve, _code("checkpointing")))  # fmt: skip


def _repeated_container(model):
    """(name, container) of the largest nn.ModuleList / nn.Sequential of >= 2 blocks of one type."""
    torch = _torch()
    best = None
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) >= 2:
            kinds = {type(c) for c in m}
            if len(kinds) == 1 and (best is None or len(m) > len(best[1])):
                best = (name, m)
    return best


def _with_depth(model, name, keep):
    smaller = copy.deepcopy(model)
    parent = smaller
    parts = name.split(".") if name else []
    for part in parts[:-1]:
        parent = getattr(parent, part)
    old = getattr(parent, parts[-1]) if parts else smaller
    torch = _torch()
    blocks = list(old)[:keep]
    new = torch.nn.ModuleList(blocks) if isinstance(old, torch.nn.ModuleList) else type(old)(*blocks)
    if not parts:
        return new
    setattr(parent, parts[-1], new)
    if hasattr(parent, "num_layers"):  # nn.TransformerEncoder/Decoder keep the count beside the list
        parent.num_layers = keep
    return smaller


def _depth(model, step, base, budget, items, notes, reserve=0):
    found = _repeated_container(model)
    if found is None:
        notes.append("smaller depth: no nn.ModuleList / nn.Sequential of identical blocks to shorten")
        return
    name, cont = found
    n = len(cont)
    lo, hi, fit = 1, n - 1, None  # largest keep in [1, n-1] whose peak fits
    tried, run_of = {}, {}
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            run = step(_with_depth(model, name, mid))
        except Exception as e:  # noqa: BLE001
            notes.append(
                f"smaller depth: {name or 'the model'} with {mid} blocks did not run: {type(e).__name__}: {e}"
            )
            return
        tried[mid] = run["peak"]
        run_of[mid] = run
        if run["judged"] + reserve <= budget:
            fit, lo = mid, mid + 1
        else:
            hi = mid - 1
    runs = ", ".join(f"{k} blocks {_fmt(v)}" for k, v in sorted(tried.items()))
    if fit is None:
        notes.append(
            f"smaller depth: even 1 of the {n} blocks of {name} does not fit {_fmt(budget)} ({runs})"
        )
        return
    items.append(
        Suggestion(
            "depth",
            f"Keep {fit} of the {n} blocks in {name or 'the model'} to fit the budget",
            base["peak"] - tried[fit],
            _measured(base, run_of[fit]),
            f"build the model with {fit} blocks instead of {n} (then retrain)",
            f"step peak with {n} blocks {_fmt(base['peak'])}; {_source(run_of[fit])}: {runs}; budget {_fmt(budget)}",
            before=base["peak"],
            after=tried[fit],
            group="changes the model",
            fits=True,
            judged_after=run_of[fit]["judged"],
        )
    )


def _width(model, step, base, budget, resize, items, notes, reserve=0):
    """resize(factor) -> a model of width x factor: the largest of a few factors that fits, measured."""
    tried, run_of = {}, {}
    fit = None
    for factor in (0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125):
        try:
            run = step(resize(factor))
        except Exception as e:  # noqa: BLE001
            notes.append(f"smaller width: resize({factor}) did not run: {type(e).__name__}: {e}")
            return
        tried[factor] = run["peak"]
        run_of[factor] = run
        if run["judged"] + reserve <= budget:
            fit = factor
            break
    runs = ", ".join(f"x{k} {_fmt(v)}" for k, v in tried.items())
    if fit is None:
        notes.append(f"smaller width: no factor down to 0.125 fits {_fmt(budget)} ({runs})")
        return
    items.append(
        Suggestion(
            "width",
            f"Width x {fit} fits the budget",
            base["peak"] - tried[fit],
            _measured(base, run_of[fit]),
            f"resize({fit}): the model your resize() builds at {fit:g} of the width",
            f"step peak now {_fmt(base['peak'])}; {_source(run_of[fit])}: {runs}; budget {_fmt(budget)}",
            before=base["peak"],
            after=tried[fit],
            group="changes the model",
            fits=True,
            judged_after=run_of[fit]["judged"],
        )
    )


# ---------------------------------------------------------------------------


def advise(
    model, *inputs, optimizer="adamw", budget=None, loss_fn=None, precision="fp32", device=None, gpu=None,
    checkpointing=None, world_size=1, sharding=None, fsdp_units=None, keep_output=True, reserve="1 GiB",
    remove_layers=False, resize=None, sparse_threshold=0.5, measure=False, framework=None,
):
    """What to change to train ``model`` in less memory, in the order a user would try it, each with the
    step's estimated peak after the change, whether it fits the budget, and the one line that makes it.

    inputs: an example batch, read as estimate() reads it (tensors, shapes, (shape, dtype) pairs,
    '8x128:int64' specs, a mapping of keyword inputs passed as model(**batch); memtorch._inputs); without
    it only what inspect() can count is advised. optimizer, loss_fn, precision, device, gpu, checkpointing,
    world_size, sharding, fsdp_units, keep_output: the configuration advised, as estimate() takes them and
    with its defaults (optimizer "adamw", device "cuda"). budget: a size ("80 GiB"): each change is judged
    as plan() and fit() judge, its reserved figure on cuda (the peak on the CPU) plus ``reserve`` against
    the budget; the sharding row is plan()'s cheapest configuration that fits it; by default, with inputs
    on cuda, the nominal memory of the GPU ``gpu`` names (as fit() and plan() take it), else none.
    framework: whose one-line changes are printed ("torch", "transformers", "lightning"; default: the
    model's, a Hugging Face PreTrainedModel or a LightningModule, else torch); to_dict() has all three.

    The rows, by group: what keeps the model and what it learns, cheapest in step time first (activation
    checkpointing of the repeated blocks, mixed precision, a smaller micro-batch with gradient accumulation,
    plan()'s sharding, CPU offload of the optimizer state, 8-bit optimizer state); then what changes how or
    what it learns (16-bit weights, another optimizer, freezing); then, only when asked (remove_layers=True,
    resize(factor) -> model), fewer blocks or a smaller width; then what else was found (modules never
    called, parameters without gradient, mostly-zero weights). Every step figure is estimate()'s for that
    configuration (memtorch.estimator.engine: the same dry runs as plan() and fit()); measure=True runs real steps
    of copies under track() instead (a model on the device advised, one process). Returns an Advice.
    """
    torch = _torch()
    # lazy: inspection loads _C and NumPy; only this path needs it (importing advice stays cheap)
    from .. import _inputs, inspection
    # lazy: estimation loads only when this path runs (importing advice stays cheap)
    from .estimate import DEFAULT_DEVICE, _check_args

    if not isinstance(model, torch.nn.Module):
        raise TypeError(errors.not_a_module("advise", model))
    if optimizer is not None and not (
        isinstance(optimizer, (str, torch.optim.Optimizer)) or callable(optimizer)
    ):
        raise TypeError(
            "advise(optimizer=...) expects a name ('adamw'), a torch.optim.Optimizer or a callable taking the "
            f"parameters, got {type(optimizer).__name__}"
        )
    defaulted = device is None and gpu is None
    device = DEFAULT_DEVICE if device is None else str(device).split(":")[0]
    budget_source = None
    if budget is not None:
        budget = units.parse(budget)
    elif inputs and gpu is not None and device == "cuda":
        # the GPU named: its memory is the budget of the step, as fit() and plan() take it ("a100": boards
        # of two sizes, an error as theirs)
        # lazy: the engine loads estimation only when this path runs (importing advice stays cheap)
        from .engine import device_memory_of

        budget, budget_source = device_memory_of(None, gpu, "advise()", keyword="budget")
    keep = units.parse(reserve)
    if budget is not None and keep >= budget:
        raise MemtorchError(f"advise(): the reserve ({_fmt(keep)}, kept free for what no estimate sees: the CUDA "
                            f"context) leaves nothing of the budget {_fmt(budget)}: pass reserve=0 or a smaller one")  # fmt: skip
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"advise(loss_fn=...) expects a callable (output, *inputs) -> loss, got {type(loss_fn).__name__}"
        )
    if resize is not None and not callable(resize):
        raise TypeError(
            f"advise(resize=...) expects a callable (factor) -> model, got {type(resize).__name__}"
        )
    if not (isinstance(sparse_threshold, (int, float)) and 0 < sparse_threshold < 1):
        raise ValueError(
            f"advise(sparse_threshold=...) expects a fraction in (0, 1), got {sparse_threshold!r}"
        )
    if framework is None:
        framework = _framework_of(model)
    elif framework not in FRAMEWORKS:
        raise ValueError(f"advise(framework=...) expects one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    _check_args(optimizer if optimizer is not None else "sgd", precision, device, world_size, sharding,
                checkpointing, None)  # fmt: skip
    inputs = _inputs.read(inputs, "advise()")
    if (budget is not None or resize is not None or remove_layers) and not inputs:
        raise MemtorchError(
            "advise(budget=..., resize=... or remove_layers=True) needs example inputs to estimate a step: "
            "advise(model, x, ...)"
        )
    if measure not in (True, False):
        raise ValueError(f"advise(measure=...) expects True or False, got {measure!r}")
    loss_fn = default_loss if loss_fn is None else loss_fn
    items, notes = [], []
    tensors = list(model.parameters()) + list(model.buffers())
    on_meta = any(t.device.type == "meta" for t in tensors)
    home = tensors[0].device.type if tensors else "cpu"
    if fsdp_units is not None and sharding not in ("zero2", "zero3"):
        raise MemtorchError(
            f"advise(fsdp_units=...) applies to sharding='zero2' or 'zero3' (FSDP), not to sharding={sharding!r}"
        )
    if measure and on_meta and inputs:
        raise MemtorchError("advise(measure=True) cannot run a model on the meta device: leave measure=False (estimate)")
    if measure and (world_size > 1 or sharding is not None or checkpointing is not None):
        raise MemtorchError(
            "advise(measure=True) runs real steps of one process as it is: world_size, sharding and checkpointing "
            "need estimated figures (measure=False)"
        )
    if measure and precision not in _MEASURABLE:
        raise MemtorchError(f"advise(measure=True) cannot run precision {precision!r}: leave measure=False (estimate)")
    if measure and home != device:
        raise MemtorchError(f"advise(measure=True) runs the model where it lives ({home}): pass device={home!r}")
    base_cfg = {"precision": precision, "device": device, "gpu": gpu, "checkpointing": checkpointing,
                "world_size": world_size, "sharding": sharding, "fsdp_units": fsdp_units,
                "device_type": device}  # fmt: skip
    if defaulted:
        notes.append(DEFAULT_DEVICE_NOTE)
    # the optimizer as one object, for the arithmetic of its state (never stepped)
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    opt_inst = optimizer if isinstance(optimizer, torch.optim.Optimizer) else (
        _copy_optimizer(optimizer, params, device) if optimizer is not None and params else None)  # fmt: skip
    held = inspection.inspect(model, optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None)
    base = engine = None
    est_cfg = {k: v for k, v in base_cfg.items() if k != "device_type"}
    if inputs:
        if not measure:
            # lazy: the engine loads estimation only when this path runs (importing advice stays cheap)
            from .engine import Engine

            engine = Engine(model, inputs, optimizer=optimizer if optimizer is not None else "sgd", loss_fn=loss_fn,
                            device=device, gpu=gpu, keep_output=keep_output, fsdp_units=fsdp_units,
                            units=budget is not None or sharding in ("zero2", "zero3"))  # fmt: skip
        run_inputs = inputs.real(home) if measure else inputs
        run = _Runner(run_inputs, optimizer, loss_fn, "measure" if measure else "estimate", est_cfg, engine)
        base = run(model)
        base["device_type"] = device if not measure else home
        if base["probe"] is not None:
            # the copy after its steps: gradients of the last backward and the optimizer's state exist
            mm_step = inspection.inspect(base["probe"], optimizer=base["optimizer"])
        else:
            mm_step = held
    else:
        mm_step = held
    amp, cast = _MEASURABLE.get(precision, (None, "zero"))
    if base is not None:
        where = _peak_phase(base["report"])
        if where not in (None, "forward", "backward"):
            notes.append(
                f"the step peaks in its {where} phase, when activations are freed: changes to activations "
                "(autocast, checkpointing) cannot lower that peak"
            )
        if budget is not None:
            verdict = "fits" if base["judged"] + keep <= budget else "does not fit"
            source = "" if budget_source is None else f"; {_fmt(budget)} is {budget_source}"
            judged = _judged_words(base, keep)
            notes.append(f"budget: the step as it is {verdict} {_fmt(budget)} ({judged}){source}")
        # keeps the model and what it learns, cheapest in step time first
        if checkpointing is None:
            _checkpointing(model, run, base, items, notes, budget, keep)
        if amp is None and cast is None:
            _autocast(model, run, base, items, notes, budget, keep)
        _micro_batch(model, run, base, inputs, items, notes, budget, keep, engine, est_cfg)
        if budget is not None:
            _sharding(model, inputs, engine, base, budget, keep, est_cfg, precision, items, notes)
        _offload_and_8bit(model, opt_inst, base, budget, items, notes, run if not measure else None, keep,
                          framework)  # fmt: skip
    # changes how or what the model learns
    if cast is None:
        _precision(mm_step, items, notes)
        if base is not None:
            _precision_step(model, run, base, items, notes, budget, keep, amp)
    else:
        notes.append(f"16-bit parameters: precision {precision!r} has them already")
    stepped = base is not None and base["optimizer"] is not None
    opt_now = base["optimizer"] if stepped else opt_inst
    _optimizer(mm_step, opt_now, items, notes, device)
    _freeze(mm_step, base["probe"] if base is not None and base["probe"] is not None else model, opt_now, items,
            notes, device)  # fmt: skip
    if base is not None and not measure:
        _lora(model, run, base, budget, items, notes, keep)
    # changes the model: only when asked
    if base is not None and budget is not None and base["judged"] + keep > budget:
        if remove_layers:
            _depth(model, run, base, budget, items, notes, keep)
        if resize is not None:
            _width(model, run, base, budget, resize, items, notes, keep)
    elif remove_layers or resize is not None:
        notes.append("fewer blocks or a smaller width: not looked for, the step fits the budget as it is"
                     if budget is not None else "fewer blocks or a smaller width: looked for only with a budget")  # fmt: skip
    # what else was found
    _sparse(model, items, notes, sparse_threshold)
    if base is not None:
        _dead(mm_step, base, items, notes)
    reference = base["peak"] if base is not None else held.total
    items = _grouped(items)
    small = [s for s in items if s.saves < 0.01 * reference and s.fits is not True]
    if small:
        items = [s for s in items if s not in small]
        notes += _considered(small, "step peak" if base is not None else "bytes held", reference)
    basis = None if base is None else (MEASURED + ", inputs apart" if base["basis"] == MEASURED
                                       else f"estimated on {device}, as memtorch.estimate()")  # fmt: skip
    return Advice(type(model).__name__, items, None if base is None else base["peak"], held.total, budget, notes,
                  basis, None if base is None else base.get("reserved"), keep, framework)  # fmt: skip


def _framework_of(model):
    """The framework whose one-line changes fit ``model``: transformers for a PreTrainedModel, lightning for a
    LightningModule, else torch (by the classes' module names: neither package is imported)."""
    for cls in type(model).__mro__:
        mod = cls.__module__ or ""
        if cls.__name__ == "PreTrainedModel" and mod.startswith("transformers"):
            return "transformers"
        if cls.__name__ == "LightningModule" and (mod.startswith("lightning") or mod.startswith("pytorch_lightning")):
            return "lightning"
    return "torch"


def _judged_words(run, reserve):
    what = "reserved" if run.get("reserved") is not None else "peak"
    text = f"{what} {_fmt(run['judged'])}"
    return text + (f" + {_fmt(reserve)} kept free" if reserve else "")


def _largest_divisor(n, at_most):
    """The largest divisor of n that is at most ``at_most`` (1 at least)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def _micro_batch(model, run, base, inputs, items, notes, budget, reserve, engine, cfg):
    """A smaller micro-batch with gradient accumulation (the same batch per optimizer step): with a budget the
    step does not meet, the largest micro-batch that fits (memtorch.fit) among the batch's divisors; else
    half the batch."""
    batch = inputs.batch_size()
    if batch is None or batch < 2:
        notes.append("smaller micro-batch: the inputs have no batch of 2 or more to split")
        return
    mb = batch // 2
    how_found = "half the batch"
    states = getattr(base["report"], "model_states", None) or {}
    held = sum(states.get(c, 0) for c in ("parameter", "buffer", "gradient", "optimizer_state"))
    if budget is not None and cfg["world_size"] == 1 and held + reserve > budget:  # one process holds them all
        notes.append(f"smaller micro-batch: the model states alone (parameters, gradients, optimizer state: "
                     f"{_fmt(held)}) do not fit {_fmt(budget)}, whatever the micro-batch")  # fmt: skip
        return
    if budget is not None and base["judged"] + reserve > budget and engine is not None:
        # lazy: fitting loads only when this path runs (importing advice stays cheap)
        from .fit import fit

        f = fit(model, *inputs.as_tuple(), device_memory=budget, reserve=reserve, max_value=batch - 1,
                _engine=engine, precision=cfg["precision"], checkpointing=cfg["checkpointing"],
                world_size=cfg["world_size"], sharding=cfg["sharding"])  # fmt: skip
        if f.value == 0:
            notes.append(f"smaller micro-batch: not even a micro-batch of 1 fits {_fmt(budget)} (memtorch.fit)")
            mb = 1
            how_found = "the smallest micro-batch"
        else:
            mb = f.value
            how_found = f"the largest that fits (memtorch.fit: {f.value})"
    mb = _largest_divisor(batch, mb)
    skipped = []  # divisors below fit()'s answer whose own estimate does not fit
    while True:
        k = batch // mb
        if k == 1:
            return
        try:
            after = run(model, batch=mb)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            notes.append(f"smaller micro-batch: a step at batch {mb} did not run: {type(e).__name__}: {e}")
            return
        # on cuda a smaller micro-batch than fit()'s answer may not fit (the caching allocator's segments: fit's
        # notes name them): the next divisor down, while fit() found one that fits
        if how_found == "half the batch" or mb == 1 or after["judged"] + reserve <= budget:
            break
        skipped.append(mb)
        mb = _largest_divisor(batch, mb - 1)
    why = f"{how_found}, a divisor of {batch}"
    if skipped:
        names = ", ".join(str(d) for d in skipped)
        why = (f"the largest divisor of {batch} that fits: memtorch.fit finds {f.value}, but {names} "
               f"{'does' if len(skipped) == 1 else 'do'} not (the caching allocator's segments)")  # fmt: skip
    detail = (f"step peak {_fmt(base['peak'])} at batch {batch}, {_fmt(after['peak'])} at micro-batch {mb} "
              f"({why}) with {k} accumulation steps ({_source(after)})")  # fmt: skip
    if after["peak"] >= base["peak"]:
        notes.append(f"smaller micro-batch: no saving ({detail})")
        return
    items.append(_changed(
        "micro_batch", f"Micro-batches of {mb} with {k} gradient accumulation steps (the same batch of {batch})",
        base, after, f"{k} forward/backward passes of {mb} samples per optimizer step (about as fast per sample "
        "when the micro-batch still fills the device)", detail, "keeps the model", budget, reserve,
        _code("micro_batch", mb=mb, k=k)))  # fmt: skip


def _considered(small, what, reference):
    """The notes for the rows left out of the table (each saves under 1% of ``reference`` and does not make
    the step fit): those that save a little, and apart from them those that raise ``what`` (a saving below
    0 is no saving: "+" and the bytes it adds)."""
    saving = [s for s in small if s.saves >= 0]
    raising = [s for s in small if s.saves < 0]
    notes = []
    if saving:
        notes.append(
            f"also considered, each saving under 1% of the {what} ({_fmt(reference)}): "
            + "; ".join(f"{s.title} ({_fmt(s.saves)})" for s in sorted(saving, key=lambda s: -s.saves))
        )
    if raising:
        notes.append(
            f"also considered, each raising the {what} ({_fmt(reference)}): "
            + "; ".join(f"{s.title} (+{_fmt(-s.saves)})" for s in sorted(raising, key=lambda s: s.saves))
        )
    return notes


def _sharding(model, inputs, engine, base, budget, reserve, cfg, precision, items, notes):
    """plan()'s cheapest configuration that fits the budget, quoted as plan prints it (the same engine: its
    dry runs are advise's own)."""
    if engine is None:
        notes.append("sharding: plan() estimates it; advise(measure=True) runs real steps of one process")
        return
    # lazy: planning loads only when this path runs (importing advice stays cheap)
    from .plan import plan

    # the precision asked for, and mixed precision beside fp32 (plan's default pair; a bf16-mixed step is not
    # planned in fp32 again: it holds more)
    precisions = [precision] + (["bf16-mixed"] if precision == "fp32" else [])
    ckpts = [None, "blocks"] if cfg["checkpointing"] is None else [cfg["checkpointing"]]
    try:
        p = plan(model, *inputs.as_tuple(), device_memory=budget, reserve=reserve, precisions=precisions,
                 checkpointing=ckpts, optimizer=engine.fixed["optimizer"], device=engine.device, gpu=cfg["gpu"],
                 fsdp_units=cfg.get("fsdp_units"), loss_fn=engine.fixed["loss_fn"],
                 keep_output=engine.fixed["keep_output"], _engine=engine)  # fmt: skip
    except MemtorchError as e:
        notes.append(f"sharding: memtorch.plan did not run: {e}")
        return
    best = p.best
    if best is None:
        notes.append(f"sharding: memtorch.plan finds no configuration that fits {_fmt(budget)} ({len(p.options)} "
                     f"computed, {p.hidden} larger world sizes left out as its notes say)")  # fmt: skip
        return
    devices = f"{best.world_size} GPU" + ("s" if best.world_size > 1 else "") if engine.device == "cuda" else \
        f"{best.world_size} process" + ("es" if best.world_size > 1 else "")  # fmt: skip
    parts = [devices] + ([best.sharding] if best.sharding else []) + [p.precision_label(best.precision)] + (
        [f"checkpointing {best.checkpointing}"] if best.checkpointing else [])  # fmt: skip
    judged = best.reserved if best.reserved is not None else best.peak_upper
    same = [s for s in items if best.world_size == 1 and s.after == best.peak and s.judged_after == judged
            and s.kind in ("checkpointing", "autocast_bf16", "micro_batch")]  # fmt: skip
    if same:
        # plan's answer is one device with a change a row above already makes: that row, not a second one
        notes.append("sharding: not needed; memtorch.plan's cheapest configuration that fits is "
                     f"{', '.join(parts)} (peak {_fmt(best.peak)}), the figures of the row '{same[0].title}'")
        return
    # plan's judged figure (above): the reserved segments on cuda, the peak with gloo's scratch late on the
    # CPU
    n = best.world_size
    fill = {"torch_sharding": "", "hf_sharding": "", "pl_sharding": ""}
    if best.sharding:
        t, h, lt = _SHARDING_CODE[best.sharding]
        fill = {"torch_sharding": t.format(n=n), "hf_sharding": h.format(n=n), "pl_sharding": lt.format(n=n)}
    else:
        fill = {k: "one device: the rows above make the change" for k in fill}
    title = ("Shard: " if n > 1 else "One device: ") + ", ".join(parts) + " (memtorch.plan's cheapest that fits)"
    items.append(Suggestion(
        "sharding", title, base["peak"] - best.peak, ESTIMATED + " by memtorch.plan",
        (f"train on {n} ranks with {best.sharding}" if n > 1 else "train on one device") + (
            f", micro-batch {best.micro_batch}" if best.micro_batch != inputs.batch_size() else ""),
        f"per-rank peak {_fmt(best.peak)}" + (f", reserved {_fmt(best.reserved)}" if best.reserved is not None
                                              else "")
        + f"; memtorch.plan(..., device_memory={_fmt(budget)!r}): {len(p.fits)} of {len(p.options)} configurations "
        "computed fit; cheapest first: fewest devices, then no checkpointing, then the sharding that communicates "
        "least",
        before=base["peak"], after=best.peak, group="keeps the model", fits=True, code=_code("sharding", **fill),
        judged_after=judged))  # fmt: skip


def _offload_and_8bit(model, opt_inst, base, budget, items, notes, run=None, reserve=0, framework="torch"):
    """The optimizer state held in CPU memory (arithmetic on the estimate: not a configuration estimate()
    runs, so not judged against the budget), and bitsandbytes' 8-bit AdamW in place of Adam/AdamW:
    estimate()'s step with optimizer="adamw8bit", or "adamw_bnb_8bit" where the printed line is the
    Trainer's (its nn.Embedding weights' state stays in 32 bits), one more dry run (memtorch._optimizers),
    judged as the other step rows."""
    torch = _torch()
    est = base["report"]
    states = getattr(est, "model_states", None)
    at_peak = getattr(est, "breakdown", None) or {}
    state = at_peak.get("optimizer_state", 0) if states is not None else 0
    if state:
        items.append(Suggestion(
            "cpu_offload", "Offload the optimizer state to the CPU", state, ESTIMATED + " by arithmetic",
            "the optimizer state in CPU memory, the step on the CPU (slower)",
            f"the optimizer state alive at the step's peak: {_fmt(state)}, held in CPU memory instead (the "
            "offload's own staging buffers are not counted: not judged against the budget)",
            group="keeps the model", code=_code("cpu_offload")))  # fmt: skip
    if isinstance(opt_inst, (torch.optim.Adam, torch.optim.AdamW)) and states is not None and run is not None:
        trainer = framework == "transformers"
        name = "adamw_bnb_8bit" if trainer else "adamw8bit"
        eight = _eight_bit_step(model, run, name)
        now, after = states.get("optimizer_state", 0), eight["report"].model_states["optimizer_state"]
        if eight["peak"] >= base["peak"]:
            notes.append(
                f"8-bit optimizer state ({name}): state {_fmt(now)} -> {_fmt(after)}, but the step peaks at "
                f"{_fmt(eight['peak'])}, not under {_fmt(base['peak'])}"
                + (" (bitsandbytes' CPU step makes float32 copies of each parameter's states and gradient)"
                   if run.base.get("device") == "cpu" else "")
            )
        else:
            items.append(_changed(
                "optimizer_8bit", "8-bit optimizer state (bitsandbytes AdamW, 8-bit)", base, eight,
                "exp_avg and exp_avg_sq in 8 bits, block-wise scaled (bitsandbytes' state1 and state2)",
                f"{type(opt_inst).__name__} state {_fmt(now)}; 8-bit: uint8 state1 and state2, a float32 absmax "
                f"per 256 elements each and two shared 256-entry maps, float32 state below 4096 elements"
                + (", and nn.Embedding weights' in float32 as the Trainer keeps them" if trainer else "")
                + f": {_fmt(after)}; the step estimated with optimizer={name!r}"
                + ("" if trainer else " (the Trainer's optim='adamw_bnb_8bit' also keeps nn.Embedding weights' "
                                      "state in 32 bits)"),
                "keeps the model", budget, reserve, code=_code("optimizer_8bit")))  # fmt: skip


def _eight_bit_step(model, run, optimizer):
    """The figures of estimate()'s step of ``run``'s configuration with ``optimizer`` (a name)."""
    # lazy: estimation loads only when this path runs (importing advice stays cheap)
    from .estimate import estimate

    cfg = {k: v for k, v in run.base.items() if v is not None or k not in ("gpu", "fsdp_units")}
    keep = run.engine.fixed["keep_output"] if run.engine is not None else True
    est = estimate(model, *run.inputs.as_tuple(), optimizer=optimizer, loss_fn=run.loss_fn, keep_output=keep,
                   **cfg)  # fmt: skip
    judged = est.reserved_peak if est.reserved_peak is not None else (est.peak_upper or est.peak)
    return {"peak": int(est.peak), "reserved": est.reserved_peak, "judged": int(judged), "report": est,
            "exact": True, "basis": ESTIMATED}  # fmt: skip


# LoRA as advise() proposes it: peft's defaults for a rank-16 adapter (alpha 32, no dropout)
_LORA_R, _LORA_ALPHA = 16, 32


def _meta_clone(model):
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same sizes, dtypes and
    requires_grad (nothing of the weights copied, the model given never changed): what peft and
    bitsandbytes' replacement may change in place."""
    torch = _torch()
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        m = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else m
    return copy.deepcopy(model, memo)


def _lora(model, run, base, budget, items, notes, reserve=0):
    """Training LoRA adapters instead of the model (peft's get_peft_model on a meta copy, rank 16 on peft's
    default targets for the model's type, else every nn.Linear), then the same with a 4-bit NF4 base
    (QLoRA: memtorch._quantize, as BitsAndBytesConfig), each estimate()'s step of the copy: changes what is
    trained, labelled so."""
    import importlib.util

    if type(model).__name__.startswith("Peft") or hasattr(model, "peft_config"):
        notes.append("LoRA: the model is a peft model already")
        return
    if importlib.util.find_spec("peft") is None:
        notes.append("LoRA and QLoRA: not estimated, peft is not installed (pip install 'memtorch-probe[finetune]')")
        return
    # lazy: models loads peft's glue only when this path runs (importing advice stays cheap)
    from .. import models

    torch = _torch()
    cfg = getattr(model, "config", None)
    models._peft()  # imported as memtorch imports it (bitsandbytes' import warning kept quiet)
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
    except ImportError:  # another peft layout: every linear layer
        mapping = {}
    # peft's own targets for a transformers family (GPT-2's fused c_attn, a Conv1D), else every linear layer
    # (nn.Linear, transformers' Conv1D) but an output head
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
                      and n and "head" not in n.rsplit(".", 1)[-1]})  # fmt: skip
    targets = list(mapping.get(getattr(cfg, "model_type", None), None) or linears)
    if not targets:
        notes.append("LoRA: the model has no linear layer to put adapters on")
        return
    spec = {"r": _LORA_R, "alpha": _LORA_ALPHA, "targets": targets, "dropout": 0.0}
    if any(type(m).__name__ == "Conv1D" and n.rsplit(".", 1)[-1] in targets for n, m in model.named_modules()):
        spec["fan_in_fan_out"] = True  # transformers' Conv1D keeps its weight transposed (peft warns otherwise)
    fill = {"r": _LORA_R, "alpha": _LORA_ALPHA, "targets": targets}

    def step(quantize):
        clone = _meta_clone(model)
        if quantize:
            # lazy: _quantize loads bitsandbytes only when this row is estimated
            from .. import _quantize

            clone = _quantize.apply(clone, "nf4", double_quant=True)
        clone = models.with_lora(clone, spec)
        return _eight_bit_step(clone, run, run.engine.fixed["optimizer"] if run.engine is not None else "adamw")

    try:
        lora = step(False)
    except Exception as e:  # noqa: BLE001 - a model peft cannot wrap: said, never raised
        notes.append(f"LoRA: not estimated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return
    trained = lora["report"].model_states.get("gradient", 0)
    items.append(_changed(
        "lora", f"LoRA adapters (rank {_LORA_R} on {', '.join(targets)}): only they learn", base, lora,
        "the model frozen, low-rank adapters trained beside its linear layers (peft)",
        f"gradients and optimizer state for the adapters only ({_fmt(trained)} of gradients); the step "
        f"estimated on a copy wrapped by peft.get_peft_model (r={_LORA_R}, alpha={_LORA_ALPHA})",
        "changes the training", budget, reserve, code=_code("lora", **fill)))  # fmt: skip
    if importlib.util.find_spec("bitsandbytes") is None:
        notes.append("QLoRA (a 4-bit base): not estimated, bitsandbytes is not installed")
        return
    try:
        qlora = step(True)
    except Exception as e:  # noqa: BLE001 - said, never raised
        notes.append(f"QLoRA: not estimated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return
    items.append(_changed(
        "qlora", f"QLoRA: a 4-bit NF4 base with LoRA adapters (rank {_LORA_R})", base, qlora,
        "the frozen linear layers' weights in 4 bits (bitsandbytes NF4, double quantization), adapters trained",
        "the base's linear weights packed 2 per byte with their quantization state, dequantized to bfloat16 in "
        "each matmul (forward and backward); the step estimated on a copy (memtorch._quantize, then peft)",
        "changes the training", budget, reserve, code=_code("qlora", **fill)))  # fmt: skip


def _grouped(items):
    """Suggestions of one kind with the same how-to folded into one (25 sparse biases: one row)."""
    out, by = [], {}
    for s in items:
        key = (s.kind, s.how) if s.kind == "sparse" else None
        if key is None:
            out.append(s)
            continue
        by.setdefault(key, []).append(s)
    for (_kind, how), group in by.items():
        if len(group) == 1:
            out.append(group[0])
            continue
        total = sum(g.saves for g in group)
        fmt = group[0].title.rsplit(" ", 2)[-2]
        out.append(Suggestion("sparse", f"Store {len(group)} parameters as sparse {fmt} tensors", total,
                              group[0].basis, how, "; ".join(g.detail for g in group)))  # fmt: skip
    return out
