"""estimate(): a training step's memory before running it.

    est = memtorch.estimate(model, torch.randn(64, 784), optimizer="adamw")
    print(est); est.peak; est.breakdown; est.check(peak="2 GiB")

How. The user's own model runs one forward, loss, backward and optimizer step,
twice (the first step creates the optimizer's state lazily, the second has it
in its peak), on fake tensors that own no memory (see dispatch). Every
storage an operator creates is counted as allocated at its nbytes and freed
when the storage dies, as PyTorch's CPU allocator would see it; CPU kernels
that allocate what their fake kernels do not show are modelled in
_kernels. Model states (parameters, buffers, gradients, optimizer
state) come out of the same run, so they are exact to the byte.

Kernel scratch space. Most CPU kernels allocate nothing beyond their outputs, but
some allocate temporaries inside (a convolution's reordered tensors, a batch
norm backward's buffer, a Python number wrapped into a tensor). estimate()
runs each such kernel once per signature (shapes, strides, dtypes, arguments)
on zero-filled real tensors under memtorch.cpu's exact counters and caches what
it allocated beyond its outputs; kernels whose tensors exceed 32 MiB, random
kernels and views are not run, and the report's notes say how many were left
out. So estimate() does allocate real memory, up to 32 MiB at a time for these
probes (and one LSTM layer's tensors, see kernels), never the model's
parameters.

Per rank (world_size > 1, sharding=...): the same dry run, replayed once per
distinct rank with what that rank holds and its wrapper's buffers inserted where
the wrapper allocates them (DDP's buckets, ZeroRedundancyOptimizer's partition,
FSDP2's all-gather and reduce-scatter); ranks holds the rules and the
torch source each follows. For FSDP the dry run records where each unit's
forward, backward start and backward end fall (_unit_hooks).

This module is memtorch.estimator.estimate (first named memtorch.estimation, which
stays): inside the package, importing it never shadows the function ``memtorch.estimate``.

What the figures are: ``peak`` is the step's high-water mark of tensor bytes,
parameters, buffers and the example inputs included; ``steady`` is what stays
between steps (parameters, buffers, optimizer state, the inputs); ``breakdown``
splits the peak by category (the words of track()'s and inspect()'s reports).
``device="cuda"`` applies the CUDA caching allocator's rules to each allocation
(see allocator); the kernels are still the CPU's, and the CUDA context
(hundreds of MiB) is outside the counters and outside this estimate.
"""

import contextlib
import inspect
import contextvars
import functools
import gc
import importlib
import weakref

from .. import errors, units, words
from .dispatch import (Ledger, _accounting_mode, _DataDependent, _torch, eager_where_known, fake_like,
                            fake_mode, host_factories)
from ..errors import MemtorchError
from ..reports.estimate import Estimate  # the result type's home; its old name stays
from ..reports.track import ModuleStats, PhaseStats
from .. import _inputs
from . import kernels as _kernels, ranks as _ranks, replay as _replay
from .kernels import cuda_kernels, cuda_routing, CudaState, kernels_for
from .allocator import resolve_gpu, round_size
from .ranks import resolve_units, unit_params

__all__ = ["estimate", "Estimate", "checkpointing", "default_loss", "OPTIMIZERS", "PRECISIONS", "SHARDINGS"]

CATEGORIES = words.ESTIMATE_CATEGORIES
PHASES = words.PHASES

OPTIMIZERS = (
    "sgd", "sgd-momentum", "adam", "adamw", "amsgrad", "adagrad", "rmsprop",
    "sgd-foreach", "sgd-momentum-foreach", "adam-foreach", "adamw-foreach", "amsgrad-foreach",
    "adagrad-foreach", "rmsprop-foreach",
    "sgd-fused", "sgd-momentum-fused", "adam-fused", "adamw-fused", "amsgrad-fused", "adagrad-fused",
    # bitsandbytes' (memtorch._optimizers: stand-ins with their state rules; bitsandbytes need not be installed)
    "adamw8bit", "adam8bit", "paged_adamw8bit", "paged_adamw", "lion", "lion8bit", "paged_lion8bit",
    # TrainingArguments(optim=...)'s bitsandbytes names, as transformers' Trainer builds them (8-bit state:
    # nn.Embedding weights' in 32 bits)
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "lion_32bit",
    "paged_lion_8bit", "paged_lion_32bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
    # transformers' Adafactor as TrainingArguments(optim="adafactor") builds it; torch.optim.Adafactor
    "adafactor", "adafactor-torch", "adafactor-torch-foreach",
)  # fmt: skip
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true", "mixed-zero", "fp16-zero")
SHARDINGS = (None, "ddp", "zero1", "zero1-even", "zero2", "zero3")
DEVICES = ("cpu", "cuda")
DEFAULT_DEVICE = "cuda"  # one default for estimate(), plan(), advise() and the CLI: the question is a GPU's

# memtorch.plan() sets a list here: each estimate() made meanwhile appends its dry run (ledger, hooks, facts)
# and its one-process (peak, reserved peak), so that plan() replays every world size and sharding with the
# very code estimate() reports from (_rank_results)
_KEEP_RUNS = contextvars.ContextVar("memtorch_keep_runs", default=None)
# memtorch.estimator.engine sets (fsdp_units,) here: a one-process estimate() records where FSDP's hooks would run (the
# dry run is otherwise the same), so that zero2/zero3 ranks can be replayed from it
_RECORD_UNITS = contextvars.ContextVar("memtorch_record_units", default=None)


# ---------------------------------------------------------------------------
# The report


# ---------------------------------------------------------------------------
# Arguments


def default_loss(output, *inputs, **kw_inputs):
    """The loss estimate() uses without loss_fn: the output's ``.loss`` when the model computes one
    (a Hugging Face model given labels), else the sum of every floating-point tensor in the output."""
    # lazy: _inputs loads only when an estimate's dry run needs it
    from .._inputs import default_loss as loss

    return loss(output, *inputs, **kw_inputs)


def _make_optimizer(optimizer, params, device, allow_item=None, originals=None, model=None):
    """The optimizer estimate() steps over ``params`` (fake tensors in a dry run) for the target ``device``:
    a name of OPTIMIZERS, a copy of an optimizer's class and settings, or what a factory returns.
    bitsandbytes' optimizers (an instance, or what a factory returns) become their stand-ins
    (memtorch._optimizers) with the same settings: their own step cannot run on fake tensors.
    allow_item: the dry run's switch that lets .item() answer (a bitsandbytes constructor called by a
    factory reads the quantization map it builds). originals: the user's parameters that ``params``
    stand for, in order, and model: theirs (bitsandbytes' per-parameter overrides, the Trainer's 32-bit
    embeddings)."""
    torch = _torch()
    if isinstance(optimizer, torch.optim.Optimizer):
        if _is_bnb(optimizer):
            return _stand_in(optimizer, params, device, originals)
        # defaults may hold keys the constructor does not take (AdamW: decoupled_weight_decay)
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        return cls(params, **{k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted})
    if callable(optimizer) and not isinstance(optimizer, str):
        if allow_item is not None:
            allow_item[0] = True
        try:
            opt = optimizer(params)
        finally:
            if allow_item is not None:
                allow_item[0] = False
        if not isinstance(opt, torch.optim.Optimizer):
            raise MemtorchError(
                f"optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer"
            )
        if _is_bnb(opt):
            # its state is not made yet; what its constructor allocated goes with it
            return _stand_in(opt, params, device, originals)
        return opt
    name = optimizer.lower()
    if name in _BNB_NAMES:
        # lazy: the stand-ins subclass torch.optim.Optimizer (importing estimation stays torch-free)
        from .. import _optimizers

        return _optimizers.by_name(name, params, device, originals, model)
    variant = {}
    base = name
    for suffix, kw in (("-foreach", {"foreach": True}), ("-fused", {"fused": True})):
        if name.endswith(suffix):
            base, variant = name[: -len(suffix)], kw
    if not variant:
        # The step the target device would run by default: foreach on CUDA, a loop on the CPU.
        variant = {"foreach": device == "cuda"}
    o = torch.optim
    if base == "sgd":
        return o.SGD(params, lr=1e-3, **variant)
    if base == "sgd-momentum":
        return o.SGD(params, lr=1e-3, momentum=0.9, **variant)
    if base == "adam":
        return o.Adam(params, lr=1e-3, **variant)
    if base == "adamw":
        return o.AdamW(params, lr=1e-3, **variant)
    if base == "amsgrad":
        return o.Adam(params, lr=1e-3, amsgrad=True, **variant)
    if base == "adagrad":
        return o.Adagrad(params, lr=1e-2, **variant)
    if base == "rmsprop":
        return o.RMSprop(params, lr=1e-2, **variant)
    if base == "adafactor-torch":
        return o.Adafactor(params, lr=1e-2, **variant)
    if base == "adafactor":
        return _hf_adafactor(params)
    raise AssertionError(base)  # names are checked before


# the names memtorch._optimizers builds (kept here so that checking a name loads nothing)
_BNB_NAMES = OPTIMIZERS[OPTIMIZERS.index("adamw8bit") : OPTIMIZERS.index("adafactor")]


def _is_bnb(optimizer):
    """Whether ``optimizer`` is one of bitsandbytes' (by its class's module: bitsandbytes is never imported)."""
    return type(optimizer).__module__.split(".")[0] == "bitsandbytes" and hasattr(optimizer, "optimizer_name")


def _stand_in(optimizer, params, device, originals=None):
    # lazy: the stand-ins subclass torch.optim.Optimizer (importing estimation stays torch-free)
    from .. import _optimizers

    try:
        return _optimizers.from_bnb(optimizer, params, device, originals)
    except ValueError as e:
        raise MemtorchError(str(e)) from None


def _hf_adafactor(params):
    """transformers' Adafactor as ``TrainingArguments(optim="adafactor")`` builds it
    (transformers/trainer_optimizer.py, _get_adafactor: scale_parameter=False, relative_step=False, the
    learning rate given: TrainingArguments' default 5e-5)."""
    try:
        from transformers.optimization import Adafactor
    except ImportError:
        raise MemtorchError(
            "optimizer 'adafactor' is transformers' Adafactor (as TrainingArguments(optim='adafactor') builds "
            "it), and transformers is not installed: pip install transformers, or use 'adafactor-torch' "
            "(torch.optim.Adafactor)"
        ) from None
    return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False)


def _check_args(optimizer, precision, device, world_size, sharding, checkpointing, loss_fn):
    torch = _torch()
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise MemtorchError(f"unknown optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}, "
                                "a torch.optim.Optimizer, or a callable taking the parameters")  # fmt: skip
    elif not (callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer)):
        raise MemtorchError(f"optimizer must be a name or a callable taking the parameters, got {type(optimizer).__name__}")
    if precision not in PRECISIONS:
        raise MemtorchError(f"unknown precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    dev = str(device)
    if dev.split(":")[0] not in DEVICES:
        raise MemtorchError(f"unknown device {device!r}: expected 'cpu' or 'cuda' (the rules of that device's allocator)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MemtorchError(f"world_size must be a positive int, got {world_size!r}")
    if sharding not in SHARDINGS:
        raise MemtorchError(
            f"unknown sharding {sharding!r}: expected one of ddp, zero1, zero1-even, zero2, zero3 (or None)"
        )
    if checkpointing is not None and checkpointing != "blocks" and not (
        isinstance(checkpointing, (list, tuple)) and all(isinstance(n, str) for n in checkpointing)
    ):
        raise MemtorchError(f"checkpointing must be None, 'blocks' or a list of module names, got {checkpointing!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise MemtorchError(f"loss_fn must be callable as loss_fn(output, *inputs), got {type(loss_fn).__name__}")


# ---------------------------------------------------------------------------
# Checkpointing


def block_names(model):
    """[(name, module)] of the blocks checkpointing="blocks" recomputes: each block of the outermost
    nn.ModuleLists. A list inside a block (T5Block.layer) is recomputed with its block, as transformers'
    gradient checkpointing recomputes T5Block alone (checkpoints nested in a checkpoint would recompute
    again, and keep other tensors)."""
    torch = _torch()
    blocks = []
    for name, lst in model.named_modules():
        if not isinstance(lst, torch.nn.ModuleList) or not len(lst):
            continue
        if any(name.startswith(b + ".") for b, _ in blocks):
            continue
        blocks += [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(lst)]
    return blocks


def _checkpoint_targets(model, spec):
    if spec == "blocks":
        blocks = block_names(model)
        if not blocks:
            raise MemtorchError(
                "checkpointing='blocks' found no nn.ModuleList of blocks in the model: "
                "pass the names of the modules to recompute, e.g. ['encoder.0', 'encoder.1']"
            )
        return [m for _, m in blocks]
    named = dict(model.named_modules())
    missing = [n for n in spec if n not in named]
    if missing:
        raise MemtorchError(f"checkpointing: no module named {', '.join(map(repr, missing))} in the model")
    return [named[n] for n in spec]


# A checkpointed module's cache arguments, as transformers' gradient checkpointing sets them
# (GradientCheckpointingLayer; the models set use_cache=False): a cache written in the forward
# would be written again by the recomputation (a different step, and a different number of
# saved tensors: torch's CheckpointError).
_NO_CACHE = {"use_cache": False, "past_key_values": None, "past_key_value": None, "layer_past": None, "cache": None}


def _without_cache(sig, args, kwargs, dropped):
    """(args, kwargs) of a call of a forward with signature ``sig`` (None: unknown), with the
    cache arguments of _NO_CACHE set as transformers sets them under checkpointing, passed by
    keyword or by position (GPT2Block takes its cache second); the names changed are added
    to ``dropped``."""
    if sig is None or not any(k in sig.parameters for k in _NO_CACHE):
        return args, kwargs
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:  # the call itself is wrong: let the forward say so
        return args, kwargs
    for k, off in _NO_CACHE.items():
        v = bound.arguments.get(k)
        if v is not None and v is not False:
            bound.arguments[k] = off
            dropped.add(k)
    return bound.args, bound.kwargs


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def checkpointing(model, spec, _on_call=None, _dropped=None):
    """Run ``model`` with the modules ``spec`` names ("blocks": each block of the outermost nn.ModuleLists)
    recomputed in backward (torch.utils.checkpoint, non-reentrant); restores them on exit.
    A checkpointed module runs without a KV cache (use_cache=False, past_key_values=None, as
    transformers' gradient checkpointing does); ``_dropped`` (a set) gets the argument names so set.

    estimate(checkpointing=...) uses it; use it around a real step to measure the same step.
    """
    from torch.utils.checkpoint import checkpoint

    dropped = set() if _dropped is None else _dropped

    if spec is None:
        yield model
        return
    mods = _checkpoint_targets(model, spec)
    patched, flagged = [], []
    try:
        for m in mods:
            if "forward" in m.__dict__:
                raise MemtorchError(f"checkpointing: module {type(m).__name__} already has a patched forward")
            orig = m.forward

            def fwd(*args, _orig=orig, _sig=_signature(orig), **kwargs):
                args, kwargs = _without_cache(_sig, args, kwargs, dropped)
                if _on_call is None:
                    return checkpoint(_orig, *args, use_reentrant=False, **kwargs)
                return checkpoint(_on_call(_orig), *args, use_reentrant=False, **kwargs)

            m.forward = fwd
            patched.append(m)
        if spec == "blocks":
            flagged = _hf_checkpointing_flags(model)
            if flagged:
                dropped.add(_HF_FLAG)
        yield model
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
        for m, had in flagged:
            if m is None:  # a config whose use_cache was turned off (had: its value)
                had[0].use_cache = had[1]
                continue
            m.gradient_checkpointing = False
            if not had:
                m.__dict__.pop("_gradient_checkpointing_func", None)


_HF_FLAG = "gradient_checkpointing"  # in checkpointing()'s _dropped: transformers' flags were set (the note says so)


def _call_through(function, *args, **kwargs):
    return function(*args, **kwargs)


def _hf_checkpointing_flags(model):
    """transformers' gradient checkpointing also sets ``gradient_checkpointing = True`` on every module that
    has the flag, and some act on it outside the recomputed layers: T5's attention without a relative bias
    makes its zero position bias require grad (a gradient of the scores' shape in backward), the stacks turn
    use_cache off. Set here on such modules (the layers transformers itself would checkpoint,
    GradientCheckpointingLayer's, are recomputed by this module's wrapping instead); a stack that still
    calls ``self._gradient_checkpointing_func(layer, ...)`` gets one that calls the layer, whose wrapped
    forward recomputes. A flagged module's config with use_cache on has it off meanwhile: what transformers
    does then in a training step, without the warning it logs once a process for it ("`use_cache=True` is
    incompatible with gradient checkpointing"), which the user's own checkpointed run would then not print.
    Returns [(module, whether it had its own function)] and [(None, (config, its use_cache))] to restore."""
    flagged, configs = [], []
    for m in model.modules():
        flag = m.__dict__.get("gradient_checkpointing")
        if flag is not False or any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__):
            continue
        had = "_gradient_checkpointing_func" in m.__dict__
        if not had:
            m._gradient_checkpointing_func = _call_through
        m.gradient_checkpointing = True
        flagged.append((m, had))
        cfg = getattr(m, "config", None)
        if getattr(cfg, "use_cache", None) is True and all(c is not cfg for _, (c, _) in configs):
            configs.append((None, (cfg, True)))
            cfg.use_cache = False
    return flagged + configs


# ---------------------------------------------------------------------------
# The dry run


class _Hooks:
    """Module forward hooks (per-module figures) and phase spans, recorded as event indices."""

    def __init__(self, ledger, model):
        self.ledger = ledger
        self.rows = []
        self.ids = {}
        for i, (name, mod) in enumerate(model.named_modules()):
            self.rows.append(ModuleStats(name, type(mod).__name__))
            self.ids[id(mod)] = i
        self.stack = []
        self.calls = []  # (row, start event index, end event index)
        self.spans = []  # (phase, start, end)
        self.steps = []  # event index where each step starts
        self.recording = False
        self.handles = []

    def pre(self, mod, args):
        i = self.ids.get(id(mod))
        if i is not None and self.recording:
            self.stack.append((i, len(self.ledger.events), self.ledger.current))
        self.ledger.module = i if i is not None else self.ledger.module

    def post(self, mod, args, out):
        i = self.ids.get(id(mod))
        if i is None or not self.recording:
            return
        if self.ledger.saved_numbers:
            self.ledger.settle_saved_numbers()  # what the module's last operator kept, inside its call
        for j in range(len(self.stack) - 1, -1, -1):
            if self.stack[j][0] == i:
                _, start, _cur = self.stack.pop(j)
                self.calls.append((i, start, len(self.ledger.events)))
                break
        self.ledger.module = self.stack[-1][0] if self.stack else None

    def install(self):
        from torch.nn.modules import module as torch_module

        self.handles.append(torch_module.register_module_forward_pre_hook(self.pre))
        self.handles.append(torch_module.register_module_forward_hook(self.post, always_call=True))

    def remove(self):
        while self.handles:
            self.handles.pop().remove()

    @contextlib.contextmanager
    def phase(self, name):
        self.ledger.phase = name
        start = len(self.ledger.events)
        try:
            yield
        finally:
            if self.ledger.saved_numbers:
                self.ledger.settle_saved_numbers()
            self.spans.append((name, start, len(self.ledger.events)))
            self.ledger.phase = None


@contextlib.contextmanager
def _capturable_on_fakes(opt):
    """A capturable optimizer (CUDA graphs: its step counts and bias corrections on the GPU) stepping the
    dry run's parameters, which are fake tensors on the CPU: torch asserts that a capturable step's
    tensors are on a GPU, so the optimizer modules' list of such devices includes the CPU while the dry
    run steps (restored on exit; another thread's real step meanwhile only has that assert loosened)."""
    if not any(g.get("capturable") for g in opt.param_groups):
        yield
        return
    saved = []
    try:
        modules = ("optimizer", "adam", "adamw", "adamax", "adadelta", "asgd", "nadam", "radam", "rmsprop", "rprop")
        for name in modules:
            try:
                mod = importlib.import_module(f"torch.optim.{name}")
            except ImportError:
                continue
            orig = getattr(mod, "_get_capturable_supported_devices", None)
            if orig is None:
                continue
            saved.append((mod, orig))
            mod._get_capturable_supported_devices = lambda *a, _o=orig, **k: [*_o(*a, **k), "cpu"]
        yield
    finally:
        for mod, orig in saved:
            mod._get_capturable_supported_devices = orig


@contextlib.contextmanager
def _swapped(model, fakes):
    """The model's parameters and buffers replaced by fakes (``fakes``: id of the original -> fake)
    for the whole step (backward recomputation included); restored on exit, errors included."""
    saved = []
    try:
        for mod in model.modules():
            for table in (mod._parameters, mod._buffers):
                for k, v in list(table.items()):
                    if v is not None and id(v) in fakes:
                        saved.append((table, k, v))
                        table[k] = fakes[id(v)]
        yield
    finally:
        for table, k, v in reversed(saved):
            table[k] = v
        for mod in model.modules():
            # recurrent layers cache their weights in _flat_weights at each forward: point them back
            # at the restored parameters, not at the fakes
            if callable(getattr(mod, "_update_flat_weights", None)):
                mod._update_flat_weights()


def _own(ledger, trainable, masters, grad_of):
    """Give each parameter's storages (itself, its gradient, its master copy) its index as owner.
    A storage several parameters view (cuDNN's flat RNN weights, their flat gradient) is owned by -1
    and its views listed (ledger.views); ledger.elements is a storage's own elements, not a view's.
    A function, so that no loop variable keeps a gradient alive past zero_grad."""
    for i, t in enumerate(trainable):
        if t.grad is not None and ledger.key_of(t.grad) is not None:
            grad_of[ledger.key_of(t.grad)] = i
        for x in (t, t.grad) + ((masters[i], masters[i].grad) if masters is not None else ()):
            if x is not None and ledger.key_of(x) is not None:
                _own_view(ledger, ledger.key_of(x), x, i)


def _own_view(ledger, key, x, i):
    """Record that parameter i's tensor x (a view of storage ``key``, or all of it) is i's."""
    whole = x.untyped_storage().nbytes() // max(1, x.element_size())
    ledger.elements[key] = whole
    if x.numel() == whole:
        ledger.owner[key] = i
        return
    parts = ledger.views.setdefault(key, [])
    if not any(p[2] == i for p in parts):
        parts.append((x.storage_offset(), x.numel(), i))
    ledger.owner[key] = -1


def _unit_hooks(stack, units, ledger, hooks, record):
    """Record, as ledger positions, where FSDP2 would run its hooks for each unit: pre/post forward
    (module hooks), pre-backward (a hook on the forward's outputs, the first to fire) and
    post-backward (an identity autograd function on the forward's inputs that need a gradient, as
    FSDP2's RegisterPostBackwardFunction; units without such inputs are left to the end of backward)."""
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

    torch = _torch()

    class PostBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, u, *xs):
            ctx.u = u
            return xs

        @staticmethod
        def backward(ctx, *grads):
            record.append((len(ledger.events), "post_bwd", ctx.u))
            return (None,) + grads

    fired = {}

    def pre(mod, args, kwargs, u):
        if not hooks.recording:
            return None
        record.append((len(ledger.events), "fwd_pre", u))
        fired[u] = False
        flat, spec = tree_flatten((args, kwargs))
        idx = [j for j, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        outs = PostBackward.apply(u, *[flat[j] for j in idx])
        for j, o in zip(idx, outs):
            flat[j] = o
        return tree_unflatten(flat, spec)

    def post(mod, args, kwargs, out, u):
        if not hooks.recording:
            return None
        record.append((len(ledger.events), "fwd_post", u))

        def on_grad(_g, u=u):
            if not fired.get(u):
                fired[u] = True
                record.append((len(ledger.events), "pre_bwd", u))

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_grad)
        return None

    for u, (_, mod) in enumerate(units):
        h1 = mod.register_forward_pre_hook(functools.partial(pre, u=u), with_kwargs=True)
        h2 = mod.register_forward_hook(functools.partial(post, u=u), with_kwargs=True)
        stack.callback(h1.remove)
        stack.callback(h2.remove)


def _end_facts(ledger, trainable, cuda_state=None):
    """The facts _report reads of a run with no optimizer (training=False)."""
    end_live = set(ledger.live.values())
    if cuda_state is not None:  # the cuBLAS workspaces stay with their handles
        end_live |= set(cuda_state.blas.values()) | set(cuda_state.blas_lt.values())
    return {
        "grad_keys": {}, "state_keys": set(), "end_live": end_live, "last_state": set(),
        "end_current": ledger.current, "param_groups": [], "param_shapes": [tuple(t.shape) for t in trainable],
        "param_bytes": [t.numel() * t.element_size() for t in trainable],
        "param_numels": [t.numel() for t in trainable], "trainable_numel": sum(t.numel() for t in trainable),
    }  # fmt: skip


class _StopGeneration(Exception):
    """Raised by the forward pre-hook when generate() would run one forward more than asked."""


def _inference(model, finputs, ledger, hooks, stack, fakes, autocast, low, max_new_tokens, allow_item, cuda_state):
    """training=False: one forward under torch.inference_mode, or model.generate() for max_new_tokens
    tokens; the output is dropped at the end (it is the caller's, not the model's, to keep).
    cuda_state: device "cuda"'s kernels (CUDA's branch of the composite operators), else None."""
    torch = _torch()
    stack.enter_context(_swapped(model, fakes))
    if cuda_state is not None:
        stack.enter_context(cuda_routing(cuda_state))
    hooks.install()
    stack.callback(hooks.remove)
    hooks.steps.append(len(ledger.events))
    ctx = torch.autocast("cpu", dtype=low) if autocast else contextlib.nullcontext()
    with hooks.phase("forward"):
        hooks.recording = True
        with torch.inference_mode(), ctx:
            if max_new_tokens is None:
                out = finputs.call(model)
            else:
                out = _generate(model, finputs, max_new_tokens, allow_item, hooks)
        hooks.recording = False
        del out


def _generate(model, finputs, max_new_tokens, allow_item, hooks):
    """model.generate(*args, max_new_tokens=N, **kwargs) on the fake tensors, N tokens long.

    generate()'s own decoding loop runs (the encoder once for an encoder-decoder, then the model once per
    token). What it decides from tensor values computed from constants alone gets the real answer
    (dispatch._Known: Whisper's loop over the audio's segments is entered); a question on values the
    model computes is answered for the longest run (is a special token negative, is the input
    right-padded, has every sequence finished: False), so no sequence stops early at an end-of-sequence
    token, and the run is stopped as the forward for token N + 1 begins (the prefill makes token 1;
    tokens 2..N take one forward each). generate()'s keywords (min_new_tokens, num_beams) ride in the
    mapping of inputs, as in the real call.
    """
    forwards = [0]
    stopped = []
    depth = [0]

    def pre(mod, args):
        depth[0] += 1
        if depth[0] > 1:
            return  # the wrapped model's forward inside the wrapper's: one forward
        forwards[0] += 1
        if forwards[0] > max_new_tokens:
            stopped.append(len(hooks.ledger.events))
            raise _StopGeneration

    def post(mod, args, out):
        depth[0] -= 1

    # a wrapper's generate() may call the wrapped model's forward, not its own (peft's PeftModel: the base
    # model's generate() calls the base model): both counted, a forward inside another once
    mods = [model]
    base = getattr(model, "get_base_model", None)
    if callable(base) and base() is not model:
        mods.append(base())
    handles = [h for m in mods for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    allow_item[0] = "generate"
    try:
        return model.generate(*finputs.args, max_new_tokens=max_new_tokens, **finputs.kwargs)
    except _StopGeneration:
        # the forward begun and stopped is not one of the run's
        hooks.calls = [c for c in hooks.calls if c[1] < stopped[0]]
        return None
    finally:
        allow_item[0] = False
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the dry run, as it was after: a full collection walks every
    object of the process (0.14-0.16 s in one holding an 80-layer Llama shape, 15% of its estimate), and the
    dry run's storages are freed by their reference counts, not by it (the ledger is the same either way:
    tests/test_estimate.py). What the run leaves in cycles is collected at the next collection after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _unique_tensors(named):
    """[(names, tensor)] with each tensor object once (tied weights share one entry)."""
    by_id = {}
    for name, t in named:
        entry = by_id.get(id(t))
        if entry is None:
            by_id[id(t)] = ([name], t)
        else:
            entry[0].append(name)
    return list(by_id.values())


def _cudnn_flat_weights(model, params, dt):
    """{id(parameter): fake} for the recurrent layers' parameters, views of one flat buffer per layer
    as nn.RNNBase.flatten_parameters() leaves them on CUDA (cuDNN then reads them in place), after
    the separate copies model.to("cuda") made first."""
    torch = _torch()
    out = {}
    for mod in model.modules():
        if not isinstance(mod, torch.nn.RNNBase) or not torch.backends.cudnn.enabled:
            continue
        # the parameters themselves (_flat_weights may still hold an earlier dry run's fakes)
        weights = [mod._parameters.get(n) for n in getattr(mod, "_flat_weights_names", [])]
        weights = [w for w in weights if w is not None]
        if not weights or len({w.dtype for w in weights}) != 1 or any(id(w) in out for w in weights):
            continue
        dtype = dt(weights[0])
        total = sum(w.numel() for w in weights)
        # model.to("cuda") moves each parameter, then flatten_parameters() copies them into one
        # buffer and frees the moved ones: their blocks stay cached in the allocator's segments
        moved = [fake_like(w, "cpu", dtype=dtype, requires_grad=False) for w in weights]
        buf = torch.empty(total, dtype=dtype)
        del moved
        offset = 0
        for w in weights:
            f = buf[offset : offset + w.numel()].view(tuple(w.shape)).detach()  # a leaf sharing the buffer
            if w.requires_grad:
                f.requires_grad_(True)
            out[id(w)] = f
            offset += w.numel()
    return out


def _dry_run(model, inputs, optimizer, loss_fn, precision, device, checkpoint_spec, steps=2, units=None,
             gpu=None, keep_output=True, training=True, max_new_tokens=None, replay=False):
    """Run the steps on fake tensors; returns (ledger, hooks, facts).

    inputs: a memtorch._inputs.Inputs (model(*args, **kwargs)). training=False: one forward under
    torch.inference_mode, or with max_new_tokens, model.generate() (see _generate).

    device "cuda": the step the GPU ``gpu`` (an allocator.GPU) runs: its kernels' choices and
    workspaces (_kernels.cuda_kernels / cuda_routing), cuDNN's flat RNN weights.
    keep_output: the model's output stays alive until the step ends (else it is freed before backward).

    units: [(name, module)] FSDP would wrap (innermost first, the root last): their forward, the
    start of their backward and its end are recorded as ledger positions (facts["unit_events"]).
    replay: identical blocks are replayed rather than run (replay.py); raises replay.Mismatch where the
    blocks turn out not to repeat (the caller runs the step again without).
    """
    torch = _torch()

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}
    prec_kind = precision.split("-")[1] if "-" in precision else None
    low = half.get(precision.split("-")[0], torch.bfloat16)
    cast_params = prec_kind in ("true", "zero")
    autocast = prec_kind == "mixed"

    ledger = Ledger()
    hooks = _Hooks(ledger, model)
    allow_item = [False]
    facts = {}
    cuda_state = None
    if device == "cuda":
        cuda_state = CudaState(gpu)
        facts["cuda_state"] = cuda_state
    params = _unique_tensors(model.named_parameters(remove_duplicate=False))
    buffers = _unique_tensors(model.named_buffers(remove_duplicate=False))
    grads_keys, state_keys = set(), set()
    state_names = facts["state_names"] = {}  # state key -> its name in the optimizer's state (zero1-even's flats)
    # checkpoint keeps the RNG states: host tensors, on the CPU's counters but not on a GPU's
    rng_bytes = 0
    if checkpoint_spec is not None and device != "cuda":
        rng_bytes = torch.get_rng_state().untyped_storage().nbytes()
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_mode())
        kernels = cuda_kernels(cuda_state) if cuda_state is not None else kernels_for("cpu")
        # CUDA's autocast is modelled by the CPU's: the CPU kernels' dtype rules are not the GPU's there
        check = not (cuda_state is not None and autocast)
        accounting = stack.enter_context(_accounting_mode(ledger, kernels, allow_item, check=check))
        stack.enter_context(eager_where_known(accounting.known))
        ledger.phase = "setup"

        def dt(t):
            return low if cast_params and t.is_floating_point() else t.dtype

        flat = _cudnn_flat_weights(model, params, dt) if cuda_state is not None else {}
        fparams = [(names, flat.get(id(p)) if id(p) in flat else
                    fake_like(p, "cpu", dtype=dt(p), requires_grad=p.requires_grad)) for names, p in params]  # fmt: skip
        del flat
        fbufs = [(names, fake_like(b, "cpu", dtype=dt(b), requires_grad=False)) for names, b in buffers]
        ledger.mark([ledger.key_of(t) for _, t in fparams], "parameter")
        ledger.mark([ledger.key_of(t) for _, t in fbufs], "buffer")
        # a float32 input given as a shape (a meta tensor: no data) is the step's input in the parameters' dtype
        # (as Lightning's bf16-true casts it); a tensor given is taken as it is (a float32 one the real step refuses)
        finputs = inputs.map(lambda t: fake_like(t, "cpu", dtype=low if cast_params and t.is_meta and
                                                 t.dtype == torch.float32 else None))  # fmt: skip
        ledger.mark([ledger.key_of(t) for t in finputs.tensors()], "input")
        for (_, p), (_, f) in zip(params + buffers, fparams + fbufs):
            # a fake whose storage is not the tensor's own (cuDNN's flat RNN weights: one storage several
            # parameters view) has no one original
            if (p.device.type == "cpu" and p.dtype == f.dtype and not p.is_sparse
                    and f.untyped_storage().nbytes() == p.untyped_storage().nbytes()):
                _kernels.originals[id(f.untyped_storage())] = p  # detached when probed
        stack.callback(_kernels.originals.clear)
        fakes = {id(p): f for (_, p), (_, f) in zip(params, fparams)}
        fakes.update({id(b): f for (_, b), (_, f) in zip(buffers, fbufs)})
        trainable = [t for _, t in fparams if t.requires_grad]
        orig_index = {}
        for (_, p), (_, f) in zip(params, fparams):
            if f.requires_grad:
                orig_index[id(p)] = len(orig_index)
        facts["param_keys"] = [ledger.key_of(t) for _, t in fparams]
        facts["param_keys_trainable"] = [ledger.key_of(t) for t in trainable]
        for i, t in enumerate(trainable):
            _own_view(ledger, ledger.key_of(t), t, i)
        facts["unit_events"] = []
        if units is not None:
            facts["units"] = unit_params(units, orig_index)
            facts["unit_names"] = [name for name, _ in units]
            order = {id(m): j for j, (_, m) in enumerate(model.named_modules())}
            facts["unit_module_order"] = sorted(range(len(units)), key=lambda u: order[id(units[u][1])])
            _unit_hooks(stack, units, ledger, hooks, facts["unit_events"])
        if not training:
            facts["optimizer_name"] = None
            _inference(model, finputs, ledger, hooks, stack, fakes, autocast, low, max_new_tokens, allow_item,
                       cuda_state)  # fmt: skip
            facts.update(_end_facts(ledger, trainable, cuda_state))
            ledger.closed = True
            return ledger, hooks, facts
        if not trainable:
            raise MemtorchError(
                "the model has no parameter that requires grad: there is no training step to estimate "
                "(training=False estimates a forward)"
            )
        if precision in ("mixed-zero", "fp16-zero"):
            # 16-bit parameters and gradients; fp32 master weights that the optimizer steps (ZeRO/DeepSpeed).
            masters = [fake_like(t, "cpu", dtype=torch.float32, requires_grad=True) for t in trainable]
            ledger.mark([ledger.key_of(t) for t in masters], "optimizer_state")
            state_keys.update(ledger.key_of(t) for t in masters)
            state_names.update((ledger.key_of(t), "fp32 master weights") for t in masters)
            opt_params = masters
        else:
            masters = None
            opt_params = trainable
        # on CUDA, tensors the optimizer makes without a device are host memory (host_factories); entered for
        # its constructor too: Adagrad makes its state there
        on_host = functools.partial(host_factories, ledger) if cuda_state is not None else contextlib.nullcontext
        with on_host():
            originals = [p for (_, p), (_, f) in zip(params, fparams) if f.requires_grad]
            opt = _make_optimizer(optimizer, opt_params, device, allow_item, originals, model)
            del originals
        if device == "cuda":
            stack.enter_context(_capturable_on_fakes(opt))
        facts["optimizer_name"] = optimizer if isinstance(optimizer, str) else type(opt).__name__
        ledger.phase = None
        rng_held = []
        dropped_cache = facts["cache_dropped"] = set()  # cache arguments the checkpointed blocks ran without
        grad_of = {}

        def on_call(fn):
            # checkpoint keeps the CPU RNG state (a real tensor, unseen by the fake run) from the forward until
            # its frame goes: the frame holds the function it recomputes (``run``), so the copy is freed when
            # ``run`` is (the block's backward done, its saved tensors released), as the real frame frees it
            key = ledger.add_extra(rng_bytes, "activation", transient=False)
            calls = [0]
            held = [True]

            def free_forward_copy():
                if held[0] and not ledger.closed:
                    held[0] = False
                    ledger.free_key(key)

            def run(*a, **k):
                calls[0] += 1
                if calls[0] != 2:
                    return fn(*a, **k)
                # recomputation: torch.random.fork_rng keeps a copy of the current state while this one recomputes
                fork = ledger.add_extra(rng_bytes, "temporary", transient=False)
                try:
                    # autograd runs the recomputation without the forward's TorchFunctionModes:
                    # CUDA's routing is entered again, so that it takes the forward's kernels
                    with routing[0] if routing else contextlib.nullcontext():
                        return fn(*a, **k)
                finally:
                    ledger.free_key(fork)

            weakref.finalize(run, free_forward_copy)
            rng_held.append(free_forward_copy)  # one still held when backward returns is freed then
            return run

        routing = []  # CUDA's kernel routing (a TorchFunctionMode), for on_call's recomputations
        stack.enter_context(checkpointing(model, checkpoint_spec, _on_call=on_call, _dropped=dropped_cache))
        stack.enter_context(_swapped(model, fakes))
        if cuda_state is not None:
            routing.append(cuda_routing(cuda_state))
            stack.enter_context(routing[0])
        hooks.install()
        stack.callback(hooks.remove)
        replayer = None
        if replay:
            # after checkpointing's: a block's forward is the checkpointed one, replayed whole
            replayer = _replay.Replayer(ledger, hooks, model, facts["unit_events"]).install()
            stack.callback(replayer.remove)
        loss_fn = loss_fn or default_loss
        loss_args = finputs.as_tuple()
        for _step in range(steps):
            hooks.steps.append(len(ledger.events))
            if replayer is not None:
                replayer.new_step()
            with hooks.phase("forward"):
                hooks.recording = True
                ctx = torch.autocast("cpu", dtype=low) if autocast else contextlib.nullcontext()
                with ctx:
                    out = finputs.call(model)
                hooks.recording = False
            with hooks.phase("backward"):
                with torch.autocast("cpu", dtype=low) if autocast else contextlib.nullcontext():
                    loss = loss_fn(out, *loss_args)
                if not keep_output:
                    del out
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise MemtorchError("loss_fn must return a one-element tensor (the loss)")
                loss.backward()
                del loss
                if replayer is not None:
                    replayer.check()
                while rng_held:
                    rng_held.pop()()
                grads_keys.update(ledger.key_of(t.grad) for t in trainable if t.grad is not None)
            allow_item[0] = True
            _own(ledger, trainable, masters, grad_of)  # whose is what, for the per-rank figures
            ledger.attribute = True
            with hooks.phase("optimizer"), on_host():
                if masters is not None:
                    for m, p in zip(masters, trainable):
                        m.grad = None if p.grad is None else p.grad.to(torch.float32)
                    for p in trainable:
                        p.grad = None
                opt.step()
                if masters is not None:
                    with torch.no_grad():
                        for m, p in zip(masters, trainable):
                            p.copy_(m)
            ledger.attribute = False
            # zero_grad outside the phase, as track() sees a step (its hooks wrap step() only)
            opt.zero_grad(set_to_none=True)
            out = None  # a loop's step ends: the output it kept goes
            if replayer is not None:
                replayer.end_step()
            allow_item[0] = False
            index = {id(t): i for i, t in enumerate(opt_params)}
            for p_, st in opt.state.items():
                for name, v in st.items():
                    if isinstance(v, torch.Tensor) and ledger.key_of(v) is not None:  # None: host memory
                        state_keys.add(ledger.key_of(v))
                        state_names[ledger.key_of(v)] = name  # which state (exp_avg, ...): one flat per group
                        if id(p_) in index:
                            ledger.owner[ledger.key_of(v)] = index[id(p_)]
                            ledger.elements[ledger.key_of(v)] = v.numel()
        facts["replayed"] = 0 if replayer is None else replayer.replayed
        facts["paged"] = [(t.untyped_storage().nbytes(), t.numel()) for t in getattr(opt, "paged", ())]
        facts["bnb_stand_in"] = getattr(opt, "name", None) if type(opt).__name__ == "BnbStandIn" else None
        index = {id(t): i for i, t in enumerate(opt_params)}
        facts["param_groups"] = [[index[id(p_)] for p_ in g["params"] if id(p_) in index] for g in opt.param_groups]
        facts["param_shapes"] = [tuple(t.shape) for t in trainable]
        facts["param_bytes"] = [t.numel() * t.element_size() for t in trainable]  # its own, not its storage's
        facts["param_numels"] = [t.numel() for t in trainable]
        facts["grad_keys"] = grad_of
        facts["state_keys"] = set(state_keys) - {None}
        facts["fparams"] = fparams
        facts["trainable_numel"] = sum(t.numel() for t in trainable)
        ledger.mark(grads_keys, "gradient")
        ledger.mark(state_keys, "optimizer_state")
        facts["end_live"] = set(ledger.live.values())
        if cuda_state is not None:  # the cuBLAS workspaces stay with their handles
            facts["end_live"] |= set(cuda_state.blas.values()) | set(cuda_state.blas_lt.values())
        facts["last_state"] = facts["state_keys"] & facts["end_live"]
        facts["end_current"] = ledger.current
        del opt, fparams, fbufs, finputs, fakes, trainable, masters, opt_params, loss_args
        facts.pop("fparams")
        ledger.closed = True
    return ledger, hooks, facts


def _classify(ledger, hooks, training=True):
    """Give every unlabelled allocation a category: activation (made in forward, alive after it) or temporary.
    training=False (a forward under inference_mode, generate()): whatever the forward makes is an activation,
    as track() names what a module's forward allocates (its KV cache, its per-token scratch)."""
    end_of_fwd = sorted(e for ph, _s, e in hooks.spans if ph == "forward")
    freed_at = {}
    for i, (key, sign) in enumerate(ledger.events):
        if sign < 0:
            freed_at[key] = i
    alloc_at = {}
    for i, (key, sign) in enumerate(ledger.events):
        if sign > 0 and key not in alloc_at:
            alloc_at[key] = i
    import bisect

    for key, info in ledger.info.items():
        if info[3] is not None:
            continue
        if info[1] == "forward" and not training:
            info[3] = "activation"
        elif info[1] == "forward":
            j = bisect.bisect_left(end_of_fwd, alloc_at[key])
            fwd_end = end_of_fwd[j] if j < len(end_of_fwd) else len(ledger.events)
            info[3] = "activation" if freed_at.get(key, len(ledger.events)) >= fwd_end else "temporary"
        else:
            info[3] = "temporary"


def estimate(
    model,
    *inputs,
    optimizer="adamw",
    loss_fn=None,
    precision="fp32",
    device=None,
    checkpointing=None,
    world_size=1,
    sharding=None,
    fsdp_units=None,
    gpu=None,
    keep_output=True,
    training=True,
    max_new_tokens=None,
):
    """Estimate the memory of one training step of ``model`` on ``inputs`` without running it for real.

    inputs: example tensors (real, meta or fake; their values are never read),
    shapes such as (64, 784) (float32), (shape, dtype) pairs, specs such as
    "8x128:int64", and, last, a mapping of keyword inputs ({"input_ids": ids,
    "labels": ids}: the model is called as model(**batch)); see
    memtorch._inputs. training=False: the memory of a forward under
    torch.inference_mode (no gradients, no optimizer); with max_new_tokens, of
    model.generate(*inputs, max_new_tokens=...) (the prompt's KV cache grown
    by that many tokens, no sequence stopping early). optimizer: a
    name (memtorch.estimator.estimate.OPTIMIZERS: sgd, sgd-momentum, adam, adamw,
    amsgrad, adagrad, rmsprop, and -foreach/-fused variants; bitsandbytes'
    adamw8bit, adam8bit, paged_adamw8bit, paged_adamw, lion (its 32-bit
    Lion), lion8bit, paged_lion8bit; adafactor: transformers' Adafactor as
    TrainingArguments(optim="adafactor") builds it; adafactor-torch:
    torch.optim.Adafactor), an optimizer to copy the class and settings of,
    or a callable taking the parameters. bitsandbytes' optimizers, by name,
    instance or factory, run as stand-ins (memtorch._optimizers) with their
    settings (min_8bit_size, optim_bits, is_paged): the same state tensors
    (8-bit state1/state2 with a float32 absmax per 256 elements and the
    shared 256-entry qmap1/qmap2 from min_8bit_size (4096) elements up,
    float32 state below) and, on the CPU, the temporaries of bitsandbytes'
    CPU step; on cuda the step is one fused kernel. A paged optimizer's
    state (parameters of 1e5 elements or more) is CUDA managed memory:
    counted in the peak as device memory, named in a note, though
    torch.cuda's counters do not show it and the driver may page it out.
    TrainingArguments' names (adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit,
    paged_adamw_32bit, lion_8bit, lion_32bit, paged_lion_8bit,
    paged_lion_32bit, rmsprop_bnb, rmsprop_bnb_8bit, rmsprop_bnb_32bit) are
    the optimizers transformers' Trainer builds: with 8-bit state it keeps
    nn.Embedding weights' state in 32 bits (adamw8bit does not). A
    bitsandbytes instance's GlobalOptimManager overrides (optim_bits,
    min_8bit_size per parameter) are carried over.
    loss_fn(output, *inputs) -> loss (inputs as given, the mapping included);
    default: the output's .loss when it has one (a Hugging Face model given
    labels), else the sum of the output's floating-point tensors. precision:
    fp32, bf16-mixed/fp16-mixed (autocast), bf16-true/fp16-true (parameters cast), mixed-zero/fp16-zero (bf16/fp16
    parameters and gradients, fp32 master weights and optimizer state, as
    ZeRO/DeepSpeed). device: "cuda" (the default, as for plan() and advise()
    and the CLI: the question is a GPU's; the CUDA caching allocator's rules)
    or "cpu" (PyTorch's CPU allocator: what track() measures on the CPU).
    checkpointing: None, "blocks" or module names recomputed in backward.
    world_size, sharding: per-rank figures (Estimate.per_rank, one entry per rank; peak, steady, breakdown, phases
    and model_states are the highest rank's, peak_rank that rank; model_states_total the whole model's) for
    ddp (DistributedDataParallel), zero1 (torch's ZeroRedundancyOptimizer
    under DDP: whole parameters per rank, so ranks differ), zero1-even
    (DeepSpeed ZeRO stage 1: optimizer state split evenly by elements, each parameter group padded as DeepSpeed pads it),
    zero2 / zero3 (FSDP2 fully_shard with reshard_after_forward False /
    True). fsdp_units (zero2/zero3): the modules fully_shard is called on
    before the root: None for each block of every nn.ModuleList (without one,
    each child of the model holding parameters), or a list of module names
    and/or module types, or a predicate (name, module) -> bool. gpu
    (device="cuda"): the GPU whose step is modelled: a name ("h100", "h200",
    "a100", "l4", ... see memtorch.estimator.allocator.GPUS) or a compute
    capability ("9.0", (9, 0)); default: this machine's GPU, else an
    H100-class device. keep_output: the model's output stays alive through
    backward and the optimizer step, as in a loop ``out = model(x); loss =
    loss_fn(out, x); loss.backward(); opt.step()``; False frees it before
    backward (a loop that deletes it). A compiled model (torch.compile) is estimated as its eager program, said
    in a note. A step whose real kernels would raise (an int64 input to a float Linear, a float32 input under
    bf16-true, more positions than a position embedding has) raises MemtorchError with the real error's
    words; under bf16-true/fp16-true and the -zero precisions a float32 input given as a shape is taken in
    the parameters' dtype. Returns an Estimate.
    """
    import time

    torch = _torch()
    t0 = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise MemtorchError(errors.not_a_module("estimate", model))
    compiled = _compiled(model)
    while hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):  # torch.compile(model)
        model = model._orig_mod
    defaulted = device is None
    if defaulted:
        device = DEFAULT_DEVICE
    _check_args(optimizer, precision, device, world_size, sharding, checkpointing, loss_fn)
    if not inputs:
        raise MemtorchError("estimate() needs example inputs: estimate(model, x) with a tensor or a shape")
    inputs = _inputs.read(inputs)
    if training not in (True, False):
        raise MemtorchError(f"training must be True or False, got {training!r}")
    if max_new_tokens is not None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise MemtorchError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if training:
            raise MemtorchError("max_new_tokens estimates generation: pass training=False with it")
        if not callable(getattr(model, "generate", None)):
            raise MemtorchError(
                f"max_new_tokens: {type(model).__name__} has no generate() method (a Hugging Face "
                "GenerationMixin model has one)"
            )
    if not training and (world_size > 1 or sharding is not None or checkpointing is not None):
        raise MemtorchError(
            "training=False estimates one process's forward: world_size, sharding and checkpointing apply to "
            "training steps"
        )
    device = str(device).split(":")[0]
    if not isinstance(keep_output, bool):
        raise MemtorchError(f"keep_output must be True or False, got {keep_output!r}")
    target = None
    if device == "cuda":
        try:
            target = resolve_gpu(gpu)
        except ValueError as e:
            raise MemtorchError(str(e)) from None
    elif gpu is not None:
        raise MemtorchError(f"gpu={gpu!r} applies to device='cuda', not to device={device!r}")
    if world_size > 1 and sharding is None:
        sharding = "ddp"
    fsdp_mods = None
    if fsdp_units is not None and sharding not in ("zero2", "zero3"):
        raise MemtorchError(
            f"fsdp_units applies to sharding='zero2' or 'zero3' (FSDP), not to sharding={sharding!r}"
        )
    if world_size > 1 and sharding in ("zero2", "zero3"):
        fsdp_mods = resolve_units(model, fsdp_units, torch)
    elif training and _RECORD_UNITS.get() is not None:
        fsdp_mods = resolve_units(model, _RECORD_UNITS.get()[0], torch)
    notes = []
    if compiled:
        notes.append(
            f"the model is compiled (torch.compile: {', '.join(compiled)}): this estimate models the eager program, "
            "each operator as PyTorch runs it uncompiled (the compiled code is run eagerly here); the compiled "
            "program may hold less (fused kernels keep no intermediates between the operators they fuse, "
            "AOTAutograd may save fewer tensors for backward) or more (CUDA graphs' memory pools)"
        )
    skipped0 = _kernels.probe_stats["skipped_large"]
    # the kernels' notes are this dry run's: one an earlier estimate left (another model's LSTM) is not this one's
    _kernels.reset_notes()
    try:
        # whatever torch.compile wraps (the model, a submodule, a function its forward calls) runs eagerly
        with torch.compiler.set_stance("force_eager"), _collector_paused():
            run = functools.partial(
                _dry_run, model, inputs, optimizer, loss_fn, precision, device, checkpointing, units=fsdp_mods,
                gpu=target, keep_output=keep_output, training=training, max_new_tokens=max_new_tokens,
            )
            try:
                ledger, hooks, facts = run(replay=training and _replay.ENABLED)
            except _replay.Mismatch:  # the blocks do not repeat: the step runs whole
                _kernels.reset_notes()
                _kernels.probe_stats["skipped_large"] = skipped0
                ledger, hooks, facts = run(replay=False)
    except _kernels.KernelRefuses as e:
        raise MemtorchError(_refused(e, training, max_new_tokens, precision, inputs)) from e.error
    except _DataDependent as e:
        raise MemtorchError(
            f"the model {e}: estimate() runs it on fake tensors that hold no values, so a step whose "
            "memory depends on tensor values cannot be estimated"
        ) from None
    except MemtorchError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with what failed
        run = "training step" if training else ("generate call" if max_new_tokens else "forward")
        raise MemtorchError(_explain(e, run)) from e
    _classify(ledger, hooks, training)
    skipped = _kernels.probe_stats["skipped_large"] - skipped0
    if skipped:
        notes.append(
            f"{skipped} kernel call(s) with more than {units.format(_kernels.PROBE_CAP)} of tensors were not "
            "measured on the real kernel: their scratch space inside the kernel is not in the estimate"
        )
    notes += sorted(_kernels.notes)
    if facts.get("cache_dropped"):
        dropped = set(facts["cache_dropped"])
        what = []
        if dropped - {_HF_FLAG}:
            what.append("the checkpointed blocks ran with "
                        + ", ".join(f"{k}={_NO_CACHE[k]}" for k in sorted(dropped - {_HF_FLAG})))  # fmt: skip
        if _HF_FLAG in dropped:
            what.append("the modules with a gradient_checkpointing flag had it set (the model turns its cache off)")
        notes.append(f"{' and '.join(what)}, as transformers' gradient checkpointing runs them "
                     "(a cache written in the forward would be written again by the recomputation)")
    # lazy: cpu loads _C and NumPy; only this path needs it (importing estimation stays cheap)
    from .. import cpu

    if device != "cuda" and not cpu.exact():
        notes.append(
            "this process has no exact CPU counters (memtorch.cpu.mechanism() is not libc10-got): the scratch "
            "space CPU kernels allocate inside themselves was not measured and is not in the estimate"
        )
    if defaulted:
        notes.insert(0, f"device={DEFAULT_DEVICE!r} by default (the question is a GPU's; as plan(), advise() and "
                        "the CLI): device='cpu' models PyTorch's CPU allocator, what track() measures on the CPU")
    if facts.get("bnb_stand_in"):
        notes.append(
            f"the optimizer, {facts['bnb_stand_in']}, is a stand-in that allocates what bitsandbytes' does "
            "(memtorch._optimizers: its state and step rules as of bitsandbytes 0.50), not bitsandbytes itself"
        )
    if facts.get("bnb_stand_in") and world_size > 1 and sharding not in (None, "ddp"):
        notes.append(
            f"per-rank optimizer state of {facts['bnb_stand_in']}: the one-process state shared out as the sharding "
            "shares torch's optimizer state; bitsandbytes on a shard applies min_8bit_size and its 256-element "
            "absmax blocks to the rank's own part and each rank keeps its own 256-entry maps: not modelled"
        )
    if facts.get("paged"):
        paged = sum(b for b, _ in facts["paged"])
        notes.append(
            f"{len(facts['paged'])} state tensor(s) of the paged optimizer, {units.format(paged)} in all (bitsandbytes "
            "puts the state of parameters of at least 100000 elements there), are CUDA managed memory: counted in "
            "the peak and the optimizer state as device memory (resident while the step runs; modelled here as "
            "caching-allocator blocks), though torch.cuda.memory_allocated() and memory_reserved() do not show "
            "them, and under memory pressure the driver pages them out to host memory instead of failing"
        )
    est = _report(
        ledger, hooks, facts, device, precision, world_size, sharding, notes, time.perf_counter() - t0, checkpointing
    )
    est.training = training
    est.max_new_tokens = max_new_tokens
    est.inputs = inputs.describe()
    if precision == "fp32":  # no cast: the parameters' own dtypes, which the title names where not all float32
        est._weights = weights_as_given(model)
    if not training:
        est.mechanism = "estimate (dry run on fake tensors, " + (
            f"generate, {max_new_tokens} new tokens)" if max_new_tokens else "forward under inference_mode)")
    return est


def weights_as_given(model):
    """The parameters' floating-point dtypes where not all float32 ("bfloat16", "bfloat16, float32"), else
    None: what precision "fp32", which casts nothing, keeps, and what every report names instead of "fp32"."""
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()})
    return ", ".join(dtypes) if dtypes and dtypes != ["float32"] else None


def _compiled(model):
    """Names of the modules of ``model`` that torch.compile wraps (torch.compile(module)) or compiled in
    place (module.compile()): "(model)" for the model itself."""
    from torch._dynamo.eval_frame import OptimizedModule

    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, OptimizedModule) or mod.__dict__.get("_compiled_call_impl") is not None:
            if not any(name == n or name.startswith(n + ".") for n in names if n):
                names.append(name or "(model)")
        if name == "" and isinstance(mod, OptimizedModule):
            break  # its _orig_mod's modules are the same model's
    return names


def _refused(e, training, max_new_tokens, precision, inputs):
    """The message of a step the real kernels refuse (_kernels.KernelRefuses): the real error's words."""
    torch = _torch()
    run = "training step" if training else ("generate call" if max_new_tokens else "forward")
    text = (f"the model's {run} fails as the real one would: {e} (the real CPU kernel of {e.func} raises at these "
            "arguments, which the fake tensors' kernel accepts)")  # fmt: skip
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision.split("-")[0])
    floats = {t.dtype for t in inputs.tensors() if t.is_floating_point()}
    if precision.endswith("-true") and low is not None and floats - {low}:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in floats - {low}))
        text += (f"; precision={precision!r} casts the parameters to {str(low).replace('torch.', '')}, not the "
                 f"inputs ({names}): pass them in {str(low).replace('torch.', '')}, as Lightning's "
                 f"{precision} precision casts them")  # fmt: skip
    return text


def _explain(e, run="training step"):
    name = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else name
    if "DataDependent" in name or "data-dependent" in text.lower():
        return (f"the model runs an operation whose output depends on tensor values ({text}); estimate() runs "
                "the step on fake tensors that hold no values")  # fmt: skip
    if "Unsupported" in name or "meta" in text.lower() or "no fake impl" in text.lower():
        return (f"an operation of the model cannot run on fake tensors ({name}: {text}): a custom operator "
                "needs a meta/fake kernel for estimate() to run it")  # fmt: skip
    return f"the model's {run} failed on fake tensors: {name}: {text}"


def _report(ledger, hooks, facts, device, precision, world_size, sharding, notes, seconds, checkpointing=None):
    info = ledger.info
    sizes = None
    reserved_peak = reserved_steady = None
    unsplit = 0
    # the sequence runs in C (_ranks.replay); allocator.CachingAllocator is its reference
    requested = _ranks.base_sizes(ledger).array
    if device == "cuda":
        curve, peak, _at, reserved_peak, live, unsplit = _ranks.replay(ledger, requested, cuda=True)
        reserved_steady = reserved_peak  # segments are kept: the last figure is the highest
        sizes = {k: _cuda_block(v[0]) for k, v in info.items()}
        notes += _cuda_notes(facts.get("cuda_state"))
    else:
        curve, peak, _at, _reserved, live, _unsplit = _ranks.replay(ledger, requested)

    def size(k):
        return info[k][0] if sizes is None else sizes[k]

    breakdown = dict.fromkeys(CATEGORIES, 0)
    for k in live:
        breakdown[info[k][3]] += size(k)
    if sizes is not None:  # the blocks handed out whole beyond their rounded requests: the peak counts them
        breakdown[words.ALLOCATOR_ROUNDING] = unsplit
    end_live = facts["end_live"]
    steady = sum(size(k) for k in end_live)
    # Model states, exact: every storage ever given the category (gradients and optimizer state
    # are all alive together at their own high points).
    states = dict.fromkeys(("parameter", "buffer", "gradient", "optimizer_state"), 0)
    last_grads = _grads_of_last_step(ledger)
    for k, v in info.items():
        if v[3] in ("parameter", "buffer", "optimizer_state") and k in end_live:
            states[v[3]] += size(k)
        elif v[3] == "gradient" and k in last_grads:
            states["gradient"] += size(k)
    # The tables describe one step, as track() describes a step: the last one, which has the
    # optimizer's state (the first creates it); the peak is already that step's or higher.
    last = hooks.steps[-1] if hooks.steps else 0
    phases = {}
    for name, s, e in hooks.spans:
        if s < last:
            continue
        ps = phases.setdefault(name, PhaseStats(name))
        before = curve[s - 1] if s > 0 else 0
        end = curve[e - 1] if e > 0 else 0
        top = max(curve[s:e], default=before)
        ps._add(before, end, max(top, before), True, 0.0)
    # the model's own forwards in the step (generate(): one per new token), by which "left alive" is averaged,
    # as track() averages it
    forwards = max(1, sum(1 for i, s, _e in hooks.calls if i == 0 and s >= last))
    for i, s, e in hooks.calls:
        if s < last:
            continue
        row = hooks.rows[i]
        before = curve[s - 1] if s > 0 else 0
        end = curve[e - 1] if e > 0 else 0
        row.calls += 1
        row.activation_total += end - before
        row.peak_above_start = max(row.peak_above_start, max(curve[s:e], default=before) - before)
    for row in hooks.rows:
        row.activation_bytes = row.activation_total // forwards
    # for memtorch.estimator.plan's zero1 arithmetic: the parameters' sizes and the step's scratch at the peak
    step_scratch = sum(size(k) for k in live if info[k][3] == "temporary" and info[k][1] == "optimizer")
    one_process = (peak, reserved_peak)  # the step on one process, before any per-rank figures
    states_total = dict(states)  # the whole model's, unsharded, whatever the ranks
    per_rank = peak_rank = fsdp_units = None
    peak_upper = None
    if world_size > 1:
        facts["last_grads"] = last_grads
        per_rank = _rank_results(ledger, hooks, facts, device, world_size, sharding)
        top = max(per_rank, key=lambda d: d["peak"])  # the first rank holding the most
        peak_rank = top["rank"]
        notes.append(_RANK_NOTES[sharding].format(n=world_size))
        notes.append(
            "per rank: the inputs given are one rank's batch; each rank's figures replay this step's "
            "allocations with what that rank holds, and its wrapper's own buffers where the wrapper allocates them"
        )
        if sharding in ("zero2", "zero3"):
            notes.append(
                "FSDP units: " + ", ".join(u["name"] for u in _ranks.unit_sizes(facts, world_size))
                + ("; device='cpu': gloo's all-gather and reduce-scatter use a scratch tensor as large as the "
                   "gathered output / the reduce-scatter input, included" if device == "cpu" else
                   "; device='cuda': NCCL's collectives are taken to allocate no tensor of their own")
            )  # fmt: skip
            if checkpointing is not None:
                notes.append("with checkpointing, FSDP gathering a unit again for its recomputation is not modelled")
            notes.append("the module table is one process's forward: FSDP's all-gathers inside a unit's forward "
                         "are in the rank's peak and phases, not in the modules' rows")  # fmt: skip
        if device == "cuda":
            notes.append("per rank on cuda: each rank's allocations replayed through the caching allocator's "
                         "model; allocated and reserved figures are that rank's")  # fmt: skip
        if sharding in ("zero2", "zero3"):
            fsdp_units = _ranks.unit_sizes(facts, world_size)
            if device == "cpu" and any(r["peak_upper"] > r["peak"] for r in per_rank):
                notes.append(
                    "gloo frees a collective's scratch when its worker thread next runs, which can be after the "
                    "collective returns: peak_upper (per rank and here) is the peak with each scratch freed only "
                    "once the next collective's is allocated; a measured peak lies between peak and peak_upper"
                )
        peak, steady = top["peak"], top["steady"]
        # one rank's model states, that rank's (buffers are whole on every rank); the model's in states_total
        states = {"parameter": top["parameter"], "buffer": states_total["buffer"], "gradient": top["gradient"],
                  "optimizer_state": top["optimizer_state"]}  # fmt: skip
        peak_upper = max(r["peak_upper"] for r in per_rank)
        if device == "cuda":
            # the highest rank's segments; the model keeps segments (no empty_cache), so they stay
            reserved_peak = reserved_steady = max(r["reserved_peak"] for r in per_rank)
        extra = ("communication",) + ((words.ALLOCATOR_ROUNDING,) if device == "cuda" else ())
        breakdown = {c: top["breakdown"].get(c, 0) for c in CATEGORIES + extra}
        phases = {}
        for (_n, s, _e), (name, start, end, high) in zip(hooks.spans, top["spans"]):
            if s >= last:  # the last step's, as above
                phases.setdefault(name, PhaseStats(name))._add(start, end, high, True, 0.0)
    kept = _KEEP_RUNS.get()
    if kept is not None:
        kept.append((ledger, hooks, facts, one_process))
    return Estimate(
        device=device, precision=precision, optimizer=facts["optimizer_name"], world_size=world_size,
        sharding=sharding, checkpointing=checkpointing, peak=peak, steady=steady,
        breakdown={k: v for k, v in breakdown.items()},
        model_states=states, model_states_total=states_total, phases=phases, modules=hooks.rows,
        reserved_peak=reserved_peak, reserved_steady=reserved_steady, per_rank=per_rank, peak_rank=peak_rank,
        fsdp_units=fsdp_units, peak_upper=peak_upper, notes=notes, seconds=seconds,
        _param_numels=facts["param_numels"], _param_groups=facts["param_groups"], _step_scratch_at_peak=step_scratch,
    )  # fmt: skip


# Measured (tests/data/h200/resnet18-fp32.snapshot.pickle.gz, H200, cuDNN 9.19, ResNet-18 fp32, batch 32): the
# bytes of the segments cudaMalloc'd for a cuDNN convolution workspace in its training steps, and the largest
# workspace (conv1's grad_weight pass); tests/test_estimate_cuda.py reads both off the trace
CUDNN_CONV_FACT = (876_609_536, 134_522_000)


def _cuda_notes(state):
    """What estimate(device="cuda") modelled and what it did not, for the report."""
    if state is None:
        return []
    gpu = state.gpu
    routed = ", ".join(f"{k} x{v}" for k, v in sorted(state.routed.items()))
    notes = [
        f"device='cuda': modelled the step on {gpu.describe()}, torch {'.'.join(map(str, gpu.torch_version))}'s "
        "rules: the kernels torch picks "
        "there (SDPA backend, fused dropout, cuDNN RNN" + (f"; here: {routed}" if routed else "") + "), "
        f"a cuBLAS workspace of {gpu.cublas_workspace:,} B per thread that multiplies matrices (the Python "
        f"thread and the autograd engine's), a {gpu.cublaslt_workspace:,} B cuBLASLt one per thread that adds a "
        "bias in the GEMM, and the caching allocator's 512 B blocks and segments; these workspaces stay "
        "allocated for the process, as in a fresh process's first steps",
        "device='cuda': not modelled: the CUDA context (typically 300-600 MiB per process, outside "
        "torch.cuda.memory_allocated()), NCCL's buffers, CUDA autocast's own "
        "cast lists (precision='*-mixed' runs the CPU's), and a torch.compile'd graph's fusion",
    ]
    if state.routed.get("cuDNN convolution"):
        notes.append(
            "device='cuda': reserved_peak can be low for convolutions: each cuDNN convolution pass allocates the "
            "workspace of the engine cuDNN's heuristics pick for its shape (Conv_v8.cpp: plan.getWorkspaceSize()), "
            "a size only cuDNN knows; memtorch models it as the transposed copies of the operands (NHWC engines), "
            "which many passes match and weight-gradient engines exceed. Measured on an H200 (cuDNN 9.19): a "
            f"ResNet-18 step (batch 32) made {CUDNN_CONV_FACT[0]:,} B of segments for its convolution workspaces, "
            f"{CUDNN_CONV_FACT[1]:,} B for the largest one, and this estimate's reserved_peak is 25% below its "
            "true one (BENCHMARKS.md, 'estimate on CUDA')"
        )
    if any(k.startswith("cuDNN RNN") for k in state.routed):
        notes.append("device='cuda': cuDNN RNN reserve and workspace sizes follow a layout inferred from one "
                     "measured LSTM (see memtorch.estimator.allocator.rnn_sizes): not exact for other shapes or modes")
    notes += sorted("device='cuda': " + u for u in state.unmodelled)
    return notes


def _rank_results(ledger, hooks, facts, device, world_size, sharding):
    """Every rank's figures (memtorch.estimator.ranks.per_rank) from one classified dry run: what estimate()
    reports for world_size > 1, and what plan() reads for each world size and sharding."""
    if "last_grads" not in facts:
        facts["last_grads"] = _grads_of_last_step(ledger)
    facts["device"] = device
    cuda = device == "cuda"
    return _ranks.per_rank(ledger, hooks, facts, world_size, sharding, _cuda_block if cuda else None, cuda)


def _cuda_block(n):
    return round_size(n)


def _grads_of_last_step(ledger):
    """Keys of the gradients alive together at the end of the last backward."""
    grads = [k for k, v in ledger.info.items() if v[3] == "gradient"]
    if not grads:
        return set()
    # the gradients of the last step are the last allocated ones with that category
    live, best = set(), set()
    gset = set(grads)
    for key, sign in ledger.events:
        if key not in gset:
            continue
        if sign > 0:
            live.add(key)
        else:
            if len(live) >= len(best):
                best = set(live)
            live.discard(key)
    if len(live) >= len(best):
        best = set(live)
    return best


_RANK_NOTES = {
    "ddp": "per-rank figures for ddp on {n} ranks: each rank holds the whole model and the DDP Reducer's "
    "gradient buckets (together one copy of the gradients, from wrapping on)",
    "zero1": "per-rank figures for zero1 on {n} ranks: torch's ZeroRedundancyOptimizer under DDP: whole "
    "parameters assigned to ranks greedily by size, each rank keeping optimizer state and computing the "
    "step only for its own (so ranks differ), plus DDP's gradient buckets",
    "zero1-even": "per-rank figures for zero1-even on {n} ranks: DeepSpeed's ZeRO stage 1, each parameter group "
    "padded to a multiple of 2 x {n} elements and split into {n} equal partitions, each rank keeping the "
    "optimizer state and step temporaries of its partition, one flat tensor per group and state as DeepSpeed "
    "steps its flat fp32 partition; DeepSpeed's own communication buffers are not modelled",
    "zero2": "per-rank figures for zero2 on {n} ranks: FSDP2 fully_shard(reshard_after_forward=False) on each "
    "unit then the root: parameters, gradients and optimizer state sharded (padded to whole rows), each unit's "
    "parameters gathered from its forward to the end of its backward, all-gather and reduce-scatter buffers "
    "included",
    "zero3": "per-rank figures for zero3 on {n} ranks: FSDP2 fully_shard(reshard_after_forward=True) on each "
    "unit then the root: as zero2, but each unit's parameters (the root's excepted) freed after its forward and "
    "gathered again for its backward, with the next unit's all-gather prefetched",
}
