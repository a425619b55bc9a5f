"""Stand-ins for optimizers whose real step cannot run on fake tensors: bitsandbytes' 8-bit, 32-bit and
paged optimizers (AdamW8bit, PagedAdamW8bit, Lion, Lion8bit, ...).

Their real step hands each tensor's address to a C kernel (ctypes) and reads values with ``.item()``, so
estimate()'s dry run cannot run it. A stand-in is a ``torch.optim.Optimizer`` whose step allocates what
the real one allocates, in its order, and nothing else: the same state tensors (keys, dtype, shape,
sharing) and, on the CPU, the same temporaries as bitsandbytes' CPU kernels; its arithmetic is not
bitsandbytes' (never train with it). bitsandbytes is never imported here: the rules below are read from
its source (0.50), named where each is used:

- bitsandbytes/optim/optimizer.py, ``Optimizer8bit.__init__``/``fill_qmap``: an 8-bit optimizer builds two
  quantization maps of 256 float32 at construction (``dynamic``, signed, and ``udynamic``), in host
  memory; ``init_state`` moves them to the parameter's device once (``.to(p.device)``: the same tensor on
  the CPU, one copy each on a GPU) and every 8-bit parameter's state holds that one tensor (``qmap1``,
  ``qmap2``): one storage for all parameters.
- ``Optimizer2State.init_state`` (Adam, AdamW, LAMB) / ``Optimizer1State.init_state`` (Lion, SGD with
  momentum, RMSprop, Adagrad, LARS): ``step`` a Python int; a parameter of fewer than ``min_8bit_size``
  (4096) elements, or any parameter when optim_bits is 32, keeps ``state1`` (and ``state2``) as float32
  tensors like the parameter; a larger one keeps them as uint8 and a float32 ``absmax1`` (``absmax2``) of
  one entry per block of 256 elements; ``unorm_vec`` (one float32) when max_unorm > 0 (LAMB, LARS).
  bitsandbytes 0.50 has no ``block_wise`` or ``percentile_clipping`` switch: 8-bit state is always
  block-wise, and no gradient-norm history (``gnorm_vec``) is kept.
- ``Optimizer8bit.get_config``: bitsandbytes' GlobalOptimManager may override optim_bits, min_8bit_size
  or max_unorm per parameter (``override_config``, ``register_module_override``); transformers' Trainer
  overrides every nn.Embedding weight to 32 bits when it builds an 8-bit optimizer
  (``Trainer.create_optimizer``): the TrainingArguments names in BNB_NAMES do the same.
- ``Optimizer8bit.get_state_buffer``: paged optimizers on a GPU put ``state1``/``state2`` of parameters
  of at least 100000 elements (1e5) in CUDA unified (managed) memory, outside PyTorch's caching
  allocator; on the CPU they are ordinary tensors (bitsandbytes warns and falls back).
- the step on a GPU is one fused kernel per parameter (bitsandbytes/backends/cuda/ops.py): no tensor is
  allocated beyond the state. On the CPU it runs bitsandbytes/backends/cpu/ops.py
  (``_optimizer_update_32bit_cpu``, ``_optimizer_update_8bit_blockwise_cpu``): PyTorch operations whose
  temporaries the stand-in makes with the same operations, and the C library's block-wise
  (de)quantization, whose outputs (``torch.empty``) it makes too. Whatever the C library allocates with
  malloc is not PyTorch's memory, on the host or on the stand-in's books.
"""

import math

import torch

__all__ = ["BNB_NAMES", "KINDS", "BnbStandIn", "by_name", "from_bnb"]

BLOCKSIZE = 256  # Optimizer2State/Optimizer1State.init_state: absmax per block of 256 elements
QMAP_SIZE = 256  # functional.create_dynamic_map: 2**8 float32 entries
PAGED_MIN = 100000  # Optimizer8bit.get_state_buffer: paged when p.numel() >= 1e5

# bitsandbytes' optimizer_name -> number of state tensors (Optimizer2State or Optimizer1State)
KINDS = {"adam": 2, "lamb": 2, "lion": 1, "momentum": 1, "rmsprop": 1, "adagrad": 1, "lars": 1}

_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
_LION = {"lr": 1e-4, "betas": (0.9, 0.99), "eps": 0.0, "weight_decay": 0.0}
# TrainingArguments' defaults (learning_rate 5e-5, adam_beta1/2, adam_epsilon, weight_decay 0)
_TRAINER = {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_TRAINER_RMSPROP = {"lr": 5e-5, "betas": (0.99, 0.0), "eps": 1e-8, "weight_decay": 0.0}

# memtorch's names -> (bitsandbytes class, kind, optim_bits, is_paged, settings, trainer). The first group
# is bitsandbytes' classes built by hand with their defaults; the second TrainingArguments(optim=...)'s
# names as transformers' Trainer builds them (trainer_optimizer._get_bitsandbytes_optimizer: bnb's AdamW,
# Lion or RMSprop with optim_bits 8 or 32 and is_paged; Trainer.create_optimizer: with 8-bit state, every
# nn.Embedding weight's state in 32 bits, through GlobalOptimManager.register_module_override).
BNB_NAMES = {
    "adamw8bit": ("AdamW8bit", "adam", 8, False, _ADAM, False),
    "adam8bit": ("Adam8bit", "adam", 8, False, dict(_ADAM, weight_decay=0.0), False),
    "paged_adamw8bit": ("PagedAdamW8bit", "adam", 8, True, _ADAM, False),
    "paged_adamw": ("PagedAdamW", "adam", 32, True, _ADAM, False),
    "lion": ("Lion", "lion", 32, False, _LION, False),
    "lion8bit": ("Lion8bit", "lion", 8, False, _LION, False),
    "paged_lion8bit": ("PagedLion8bit", "lion", 8, True, _LION, False),
    "adamw_bnb_8bit": ("AdamW", "adam", 8, False, _TRAINER, True),
    "adamw_8bit": ("AdamW", "adam", 8, False, _TRAINER, True),
    "paged_adamw_8bit": ("AdamW", "adam", 8, True, _TRAINER, True),
    "paged_adamw_32bit": ("AdamW", "adam", 32, True, _TRAINER, True),
    "lion_8bit": ("Lion", "lion", 8, False, _TRAINER, True),
    "lion_32bit": ("Lion", "lion", 32, False, _TRAINER, True),
    "paged_lion_8bit": ("Lion", "lion", 8, True, _TRAINER, True),
    "paged_lion_32bit": ("Lion", "lion", 32, True, _TRAINER, True),
    "rmsprop_bnb": ("RMSprop", "rmsprop", 32, False, _TRAINER_RMSPROP, True),
    "rmsprop_bnb_8bit": ("RMSprop", "rmsprop", 8, False, _TRAINER_RMSPROP, True),
    "rmsprop_bnb_32bit": ("RMSprop", "rmsprop", 32, False, _TRAINER_RMSPROP, True),
}
# the keys of bitsandbytes' per-parameter configuration (Optimizer8bit.get_config) that change memory
_MEMORY_KEYS = ("optim_bits", "min_8bit_size", "max_unorm")


class BnbStandIn(torch.optim.Optimizer):
    """What a bitsandbytes optimizer of ``kind`` (its optimizer_name: adam, lion, momentum, rmsprop,
    adagrad, lamb, lars) allocates, stepping on ``device`` ("cpu" or "cuda": the target of the estimate;
    the parameters may be fake tensors on the CPU for either). The settings are bitsandbytes' own
    (optim_bits, min_8bit_size, is_paged, max_unorm, lr, betas, eps, weight_decay). ``paged`` lists the
    state tensors that bitsandbytes would put in CUDA managed memory (device "cuda" only). overrides:
    {id(parameter): {optim_bits, min_8bit_size, max_unorm}}, per parameter, as bitsandbytes'
    GlobalOptimManager overrides them (Optimizer8bit.get_config)."""

    def __init__(self, params, kind="adam", optim_bits=8, min_8bit_size=4096, is_paged=False, device="cpu",
                 lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_unorm=0.0, name=None,
                 overrides=None):  # fmt: skip
        if kind not in KINDS:
            raise ValueError(f"bitsandbytes optimizer {kind!r}: the stand-in knows {', '.join(KINDS)}")
        if optim_bits not in (8, 32):
            raise ValueError(f"optim_bits must be 8 or 32 (bitsandbytes' state widths), got {optim_bits!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.kind, self.states = kind, KINDS[kind]
        self.optim_bits, self.min_8bit_size, self.is_paged = optim_bits, min_8bit_size, is_paged
        self.max_unorm, self.device = max_unorm, device
        self.name = name or f"{'paged ' if is_paged else ''}{kind} {optim_bits}-bit"
        self.overrides = {k: {c: v[c] for c in _MEMORY_KEYS if c in v} for k, v in (overrides or {}).items()}
        self.paged = []
        self.name2qmap = {}
        self._qmaps_on_device = False
        if optim_bits == 8:
            self._fill_qmap()

    def _fill_qmap(self):
        # fill_qmap(): two 256-entry float32 maps, made without a device (host memory)
        self.name2qmap["dynamic"] = torch.zeros(QMAP_SIZE, dtype=torch.float32)
        self.name2qmap["udynamic"] = torch.zeros(QMAP_SIZE, dtype=torch.float32)

    def _config(self, p):
        cfg = {
            "optim_bits": self.optim_bits,
            "min_8bit_size": self.min_8bit_size,
            "max_unorm": self.max_unorm,
        }
        cfg.update(self.overrides.get(id(p), {}))
        return cfg

    def __repr__(self):
        return f"BnbStandIn({self.name}, min_8bit_size={self.min_8bit_size}, device={self.device!r})"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                if self.device == "cpu":
                    self._cpu_update(group, p, state)
                elif self._config(p)["max_unorm"] > 0.0 and state["state1"].dtype == torch.float32:
                    # functional.optimizer_update_32bit: the parameter's norm, before the fused kernel
                    torch.norm(p.data.float())
                # else on a GPU: one fused kernel, nothing allocated
        return loss

    # -- state (Optimizer2State/Optimizer1State.init_state) -----------------------------------------------

    def _buffer(self, p, dtype):
        buf = torch.zeros_like(p, dtype=dtype, device=p.device)
        if self.is_paged and self.device == "cuda" and p.numel() >= PAGED_MIN:
            self.paged.append(buf)
        return buf

    def _init_state(self, p, state):
        cfg = self._config(p)
        if cfg["optim_bits"] not in (8, 32):
            raise ValueError(
                f"optim_bits must be 8 or 32 (bitsandbytes' state widths), got {cfg['optim_bits']!r}"
            )
        eight = cfg["optim_bits"] == 8 and p.numel() >= cfg["min_8bit_size"]
        state["step"] = 0
        if not eight:
            state["state1"] = self._buffer(p, torch.float32)
            if self.states == 2:
                state["state2"] = self._buffer(p, torch.float32)
        else:
            if "dynamic" not in self.name2qmap:  # a 32-bit optimizer with a parameter overridden to 8 bits
                self._fill_qmap()
            if self.device == "cuda" and not self._qmaps_on_device:
                # .to(p.device): a copy of each map on the GPU (the 1-state optimizers move only 'dynamic');
                # the host maps are dropped as name2qmap takes the copies
                moved = ("dynamic", "udynamic") if self.states == 2 else ("dynamic",)
                for key in moved:
                    self.name2qmap[key] = torch.empty(QMAP_SIZE, dtype=torch.float32, device=p.device)
                self._qmaps_on_device = True
            state["state1"] = self._buffer(p, torch.uint8)
            state["qmap1"] = self.name2qmap["dynamic"]
            if self.states == 2:
                state["state2"] = self._buffer(p, torch.uint8)
                state["qmap2"] = self.name2qmap["udynamic"]
            blocks = -(-p.numel() // BLOCKSIZE)
            state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
            if self.states == 2:
                state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        if cfg["max_unorm"] > 0.0:
            state["unorm_vec"] = torch.zeros((1,), device=p.device)

    # -- the CPU step (bitsandbytes/backends/cpu/ops.py) -------------------------------------------------

    def _cpu_update(self, group, p, state):
        g = p.grad
        if state["state1"].dtype == torch.uint8:
            self._cpu_8bit(group, p, g, state)
        else:
            self._cpu_32bit(group, p, g, state)

    def _cpu_32bit(self, group, p, g, state):
        # functional.optimizer_update_32bit: the parameter's norm when max_unorm > 0 (LAMB, LARS)
        max_unorm = self._config(p)["max_unorm"]
        param_norm = torch.norm(p.data.float()) if max_unorm > 0.0 else 0.0
        b1, b2 = group["betas"][0], group["betas"][1]
        eps, wd, lr, step = group["eps"], group["weight_decay"], group["lr"], state["step"]
        s1, s2 = state["state1"], state.get("state2")
        # _optimizer_update_32bit_cpu
        g_float = g.float() * 1.0  # gnorm_scale
        p_float = p.data.float()
        if self.kind in ("adam", "lamb"):
            s1.mul_(b1).add_(g_float, alpha=1.0 - b1)
            s2.mul_(b2).addcmul_(g_float, g_float, value=1.0 - b2)
            c1, c2 = 1.0 - b1**step, math.sqrt(1.0 - b2**step)
            if wd > 0.0:
                p_float.mul_(1.0 - lr * wd)
            update = s1 / (s2.sqrt() + eps * c2)
            scale = self._norm_scale(update, state, param_norm, max_unorm)
            p_float.add_(update, alpha=-lr * c2 / c1 * scale)
        elif self.kind in ("momentum", "lars"):
            g_wd = g_float.add(p_float, alpha=wd) if wd > 0.0 else g_float
            if step == 1:
                s1.copy_(g_wd)
            else:
                s1.mul_(b1).add_(g_wd)
            scale = self._norm_scale(s1, state, param_norm, max_unorm)
            p_float.add_(s1, alpha=-lr * scale)
        elif self.kind == "lion":
            if wd > 0.0:
                p_float.mul_(1.0 - lr * wd)
            update = s1.mul(b1).add(g_float, alpha=1.0 - b1)
            p_float.add_(update.sign(), alpha=-lr)
            s1.mul_(b2).add_(g_float, alpha=1.0 - b2)
        elif self.kind == "rmsprop":
            g_wd = g_float.add(p_float, alpha=wd) if wd > 0.0 else g_float
            s1.mul_(b1).addcmul_(g_wd, g_wd, value=1.0 - b1)
            update = g_wd / (s1.sqrt() + eps)
            scale = self._norm_scale(update, state, param_norm, max_unorm)
            p_float.add_(update, alpha=-lr * scale)
        else:  # adagrad
            g_wd = g_float.add(p_float, alpha=wd) if wd > 0.0 else g_float
            s1.addcmul_(g_wd, g_wd, value=1.0)
            update = g_wd / (s1.sqrt() + eps)
            p_float.add_(update, alpha=-lr)
        p.data.copy_(p_float)

    def _norm_scale(self, update, state, param_norm, max_unorm):
        # _compute_update_norm_and_scale: the update's norm, read as a number, when max_unorm > 0
        if max_unorm <= 0.0:
            return 1.0
        unorm = torch.norm(update).item()
        state["unorm_vec"].fill_(unorm)
        limit = max_unorm * float(param_norm)
        return limit / unorm if unorm > limit and unorm > 0 else 1.0

    def _cpu_8bit(self, group, p, g, state):
        b1, b2 = group["betas"][0], group["betas"][1]
        eps, wd, lr, step = group["eps"], group["weight_decay"], group["lr"], state["step"]
        # _dequant_blockwise_fp32_direct: dequantize_blockwise's output, torch.empty_like(A, dtype=float32)
        s1 = _dequantized(state["state1"])
        s2 = _dequantized(state["state2"]) if self.states == 2 else None
        grad = g.float() * 1.0  # gnorm_scale
        p_fp32 = p.data.float()
        if self.kind in ("adam", "lamb"):
            s1.mul_(b1).add_(grad, alpha=1.0 - b1)
            s2.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
            c1, c2 = 1.0 - b1**step, math.sqrt(1.0 - b2**step)
            denom = (s2.sqrt() / c2).add_(eps)
            if wd > 0.0:
                p_fp32.mul_(1.0 - lr * wd)
            p_fp32.addcdiv_(s1, denom, value=-lr / c1)
        elif self.kind in ("momentum", "lars"):
            grad.add_(p_fp32, alpha=wd)
            if step == 1:
                s1.copy_(grad)
            else:
                s1.mul_(b1).add_(grad)
            p_fp32.add_(s1, alpha=-lr)
        elif self.kind == "lion":
            if wd > 0.0:
                p_fp32.mul_(1.0 - lr * wd)
            update_dir = torch.sign(s1.mul(b1) + grad.mul(1.0 - b1))
            p_fp32.add_(update_dir, alpha=-lr)
            s1.mul_(b2).add_(grad, alpha=1.0 - b2)
        elif self.kind == "rmsprop":
            grad.add_(p_fp32, alpha=wd)
            s1.mul_(b1).addcmul_(grad, grad, value=1.0 - b1)
            p_fp32.addcdiv_(grad, s1.sqrt().add_(eps), value=-lr)
        else:  # adagrad
            grad.add_(p_fp32, alpha=wd)
            s1.addcmul_(grad, grad, value=1.0)
            p_fp32.addcdiv_(grad, s1.sqrt().add_(eps), value=-lr)
        p.data.copy_(p_fp32)
        _requantize(s1, state["state1"], state["absmax1"])
        if s2 is not None:
            _requantize(s2, state["state2"], state["absmax2"])


def _dequantized(state):
    """dequantize_blockwise on the CPU: a float32 tensor like the uint8 state (zeros here: the stand-in's
    arithmetic is not bitsandbytes')."""
    return torch.empty_like(state.contiguous(), dtype=torch.float32).zero_()


def _requantize(values, state, absmax):
    """_quant_blockwise_fp32_direct: quantize_blockwise returns a new absmax (float32, one per block of 256)
    and a new uint8 tensor, which are copied into the state and dropped."""
    a = values.contiguous()
    blocks = -(-a.numel() // BLOCKSIZE)
    new_absmax = torch.empty((blocks,), device=a.device, dtype=torch.float32)
    out = torch.empty(a.shape, device=a.device, dtype=torch.uint8)
    state.copy_(out.zero_())
    absmax.copy_(new_absmax.fill_(1.0))


def from_bnb(optimizer, params, device, originals=None):
    """The stand-in for a bitsandbytes optimizer instance, with its settings (optimizer_name, optim_bits,
    min_8bit_size, is_paged, max_unorm, its defaults), over ``params``; ``originals``: the real parameters
    the params stand for, in order (None: params themselves), whose overrides in bitsandbytes'
    GlobalOptimManager (optimizer.mng) are carried over."""
    kind = getattr(optimizer, "optimizer_name", None)
    if kind not in KINDS:
        raise ValueError(
            f"{type(optimizer).__name__} (bitsandbytes' {kind!r} update) has no stand-in: estimate() knows "
            f"bitsandbytes' {', '.join(sorted(KINDS))} optimizers"
        )
    args = optimizer.args
    d = optimizer.defaults
    return BnbStandIn(
        params, kind=kind, optim_bits=args.optim_bits, min_8bit_size=args.min_8bit_size,
        is_paged=bool(getattr(optimizer, "is_paged", False)), device=device, lr=d.get("lr", 1e-3),
        betas=d.get("betas", (0.9, 0.999)), eps=d.get("eps", 1e-8), weight_decay=d.get("weight_decay", 0.0),
        max_unorm=getattr(args, "max_unorm", 0.0), name=type(optimizer).__name__,
        overrides=_manager_overrides(getattr(optimizer, "mng", None), params, originals),
    )  # fmt: skip


def by_name(name, params, device, originals=None, model=None):
    """The stand-in of one of BNB_NAMES. A Trainer's name (TrainingArguments.optim) with 8-bit state keeps
    the state of ``model``'s nn.Embedding weights in 32 bits, as Trainer.create_optimizer does
    (``originals``: the real parameters the params stand for, in order; None: params themselves)."""
    cls, kind, bits, paged, settings, trainer = BNB_NAMES[name]
    overrides = None
    if trainer and bits == 8 and model is not None:
        params = list(params)
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        overrides = {
            id(f): {"optim_bits": 32} for f, r in zip(params, originals or params) if id(r) in embeddings
        }
    label = f"{cls} (TrainingArguments optim={name!r})" if trainer else cls
    return BnbStandIn(params, kind=kind, optim_bits=bits, is_paged=paged, device=device, name=label,
                      overrides=overrides, **settings)  # fmt: skip


def _manager_overrides(mng, params, originals):
    """{id(param): config} from bitsandbytes' GlobalOptimManager: its per-parameter configurations
    (pid2config) and its module overrides (module_weight_config_triple, applied by the first step's
    check_overrides, which replaces the parameter's configuration)."""
    if mng is None:
        return None
    by_id = dict(getattr(mng, "pid2config", {}) or {})
    for module, attr, config in getattr(mng, "module_weight_config_triple", ()) or ():
        w = getattr(module, attr, None)
        if w is not None:
            by_id[id(w)] = config
    params = list(params)
    return {id(f): by_id[id(r)] for f, r in zip(params, originals or params) if id(r) in by_id}
