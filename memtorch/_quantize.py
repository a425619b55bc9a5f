"""Quantized base weights (QLoRA): nn.Linear replaced by bitsandbytes' own layers, as transformers'
BitsAndBytesConfig does, so that estimate() runs bitsandbytes' real modules on its fake tensors.

``apply(model, "nf4" | "fp4" | "int8")`` returns a copy of the model whose Linear layers are
bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``, with their weights already quantized: the packed
weight and the quantization state bitsandbytes keeps, tensor for tensor (shapes, dtypes). On the
meta device (a model memtorch built from a config) nothing is
allocated; a model holding real weights is quantized by bitsandbytes itself. peft's LoRA then wraps
these layers as it wraps a model loaded in 4 or 8 bits (its bitsandbytes LoRA layers).

What bitsandbytes allocates, per quantized Linear of ``n = out * in`` weights (bitsandbytes 0.50:
bitsandbytes/functional.py quantize_4bit and quantize_blockwise, nn/modules.py Params4bit,
Int8Params):

- 4-bit: the packed weight, uint8 of shape ((n + 1) // 2, 1); absmax, float32 per block of 64
  weights (ceil(n / 64)); the 16-value code (float32, one tensor per layer). With double
  quantization the absmax is uint8 per block, plus a float32 offset (a 0-d tensor), the nested
  absmax (float32 per 256 blocks) and the 256-value dynamic map (float32: quantize_blockwise
  stores ``code.to(device, copy=True)``, a copy per layer of the map it caches in
  functional.name2qmap; that cached one is the process's, not the model's).
- int8 (LLM.int8): the int8 weight (n bytes) and SCB, the float32 scale per output row.

The quantization state lives outside ``_parameters``, where no walker looks; each built layer also
registers it as non-persistent buffers (``weight_absmax``, ``weight_quant_map``, and with double
quantization ``weight_offset``, ``weight_nested_absmax``, ``weight_nested_quant_map``; int8:
``weight_SCB``), views of the very tensors bitsandbytes holds, so that inspect(), track() and
estimate() count them. The float32 ones are held as int32 views of their storage (same bytes): a
cast of the model's floating tensors (``model.half()``, estimate's ``precision="bf16-true"``) leaves
them float32, as bitsandbytes keeps them; after a move (``model.to(device)`` copies buffers, while
bitsandbytes moves its state itself) each layer points its buffers at the moved state again, so the
state is held once. In the dry run the weight is a plain fake tensor, so a
forward pre-hook gives it a QuantState (4-bit) or the layer's state its CB/SCB (int8) made of the
fake buffers.

The step: bitsandbytes' Python code runs as it is (its autograd functions, peft's bitsandbytes
LoRA layers); its operators have fake kernels, and the 4-bit matmul, whose fake kernel shows only
its output, runs as the target device's kernel allocates (kernel_rules: the dequantized weight).
Measured against track() of a real LoRA step on the CPU (tests/test_quantize.py): 32 B under, as
the same Llama without quantization. A bias not in the compute dtype is cast in place at the first
forward (Linear4bit.forward: bias.data = bias.data.to(x.dtype)), in the dry run as in the real step.
Not modelled: int8 on cuda in training (bitsandbytes' LLM.int8 matmul, whose outlier columns depend
on the data: the estimate takes its CPU path, MatMul8bitFp, and says so), and int8 out of training
(the same matmul: outliers counted as none, its kernels' scratch not counted; said in the notes).
"""

import copy
import functools
import re
import sys
import warnings

from ._torch import torch as _load_torch  # the loader only: torch itself loads on first call
from .errors import MemtorchError

KINDS = ("nf4", "fp4", "int8")
BLOCKSIZE = 64  # bitsandbytes' 4-bit block (Params4bit's default, as transformers uses it)
NESTED_BLOCKSIZE = 256  # quantize_4bit(compress_statistics=True): quantize_blockwise(blocksize=256)
INT8_THRESHOLD = 6.0  # BitsAndBytesConfig(llm_int8_threshold=6.0)


def quiet_import():
    """bitsandbytes, imported without its CPU backend's warning (None when it is not installed).

    On a CPU with AVX512-BF16 its import fetches a fused 4-bit kernel from the Hub and logs a warning when
    it cannot (offline; with HF_HUB_OFFLINE=1 the kernels package logs that it skips a check instead).
    memtorch runs no real 4-bit matmul, so the import memtorch causes (its own, or peft's before a LoRA
    row) prints neither, nor tqdm's warning in a notebook without ipywidgets, which the import reaches;
    the loggers' levels are put back after."""
    import logging

    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    # its CPU backend's logger, and the kernels package's (offline: "Skipping publisher trust check")
    logs = [logging.getLogger(name) for name in ("bitsandbytes.backends.cpu.ops", "kernels")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        # its import reaches tqdm.auto (through the kernels package and huggingface_hub), which warns in a
        # notebook without ipywidgets ("IProgress not found"): not from an import memtorch causes
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="IProgress not found")
            import bitsandbytes
    except ImportError:
        return None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return bitsandbytes


def _bnb():
    bnb = quiet_import()
    if bnb is None:
        raise MemtorchError("quantize= runs bitsandbytes' own layers: install it (pip install bitsandbytes)")
    return bnb


def _check(quantize, compute_dtype, skip):
    torch = _load_torch()
    if quantize not in KINDS:
        raise MemtorchError(f"quantize must be one of {', '.join(map(repr, KINDS))}; got {quantize!r}")
    if compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise MemtorchError(
            f"compute_dtype must be torch.bfloat16, torch.float16 or torch.float32; got {compute_dtype!r}"
        )
    if skip is not None and (isinstance(skip, str) or not all(isinstance(s, str) for s in skip)):
        raise MemtorchError(f"skip must be a list of module names or patterns; got {skip!r}")


def _should_convert(name, patterns):
    """transformers' rule (quantizers/quantizers_utils.py should_convert_module): a pattern skips a
    module when it matches the name from the start up to a module boundary, as a regular expression
    with that boundary, or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in patterns)


def default_skip(model):
    """The modules transformers keeps unquantized when no ``llm_int8_skip_modules`` is given: for a
    transformers model, its get_keys_to_not_convert() (tied weights, the output embeddings, the module
    of the last parameter) and ``_keep_in_fp32_modules``; for any other module, the module of the
    last parameter (the rule of get_keys_to_not_convert that needs no transformers API)."""
    named = list(model.named_parameters())
    last = [named[-1][0].rsplit(".", 1)[0]] if named and "." in named[-1][0] else []
    if not _is_transformers(model):
        return last
    from transformers.quantizers.base import get_keys_to_not_convert

    keys = list(get_keys_to_not_convert(model))
    keys.extend(getattr(model, "_keep_in_fp32_modules", None) or [])
    return sorted(set(keys))


def _is_transformers(model):
    mod = sys.modules.get("transformers")
    return mod is not None and isinstance(model, mod.PreTrainedModel)


def _convertible(module):
    """type(module) is nn.Linear, or transformers' Conv1D (GPT-2's), as replace_with_bnb_linear takes."""
    torch = _load_torch()
    return type(module) is torch.nn.Linear or _is_conv1d(module)


def _is_conv1d(module):
    pt = sys.modules.get("transformers.pytorch_utils")
    return pt is not None and isinstance(module, pt.Conv1D)


def apply(model, quantize, *, double_quant=False, compute_dtype=None, skip=None):
    """A copy of ``model`` with its Linear layers replaced by bitsandbytes' quantized ones.

    quantize: "nf4" or "fp4" (``bnb.nn.Linear4bit``, blocks of 64, uint8 storage) or "int8"
    (``bnb.nn.Linear8bitLt``, LLM.int8 with outlier threshold 6.0, no fp16 weights), as
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=...)`` / ``load_in_8bit=True``.
    double_quant: bnb_4bit_use_double_quant (4-bit only). compute_dtype: bnb_4bit_compute_dtype (4-bit
    only: LLM.int8 computes in the input's dtype), torch.bfloat16 by default (the value QLoRA users set; bitsandbytes' own default, None, computes in
    the input's dtype).
    skip: module names or patterns left unquantized, with transformers' matching rule; None: the
    ones transformers skips by default (see default_skip); as with ``llm_int8_skip_modules``, a list
    replaces those defaults.

    Only ``type(m) is nn.Linear`` (and transformers' Conv1D) is converted. The model given is never
    changed: the copy is deep (free on the meta device). Its quantized layers are frozen, as
    transformers leaves them; the other parameters keep their requires_grad.
    """
    torch = _load_torch()
    if compute_dtype is None:
        compute_dtype = torch.bfloat16
    _check(quantize, compute_dtype, skip)
    if not isinstance(model, torch.nn.Module):
        raise MemtorchError(f"apply() quantizes an nn.Module; got {type(model).__name__}")
    if double_quant and quantize == "int8":
        raise MemtorchError("double_quant applies to 4-bit quantization (nf4, fp4), not int8")
    bnb = _bnb()
    for name, m in model.named_modules():
        if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            raise MemtorchError(f"the model is quantized already ({name or 'the root'}: {type(m).__name__})")
        if type(m).__name__ == "PeftModel" or hasattr(m, "peft_config"):
            raise MemtorchError(
                "quantize the base model before LoRA is applied (as transformers loads a quantized base "
                "and peft wraps it): this model is a PeftModel already"
            )
    patterns = default_skip(model) if skip is None else list(skip)
    model = copy.deepcopy(model)
    targets = [
        (n, m) for n, m in model.named_modules() if n and _convertible(m) and _should_convert(n, patterns)
    ]
    for name, m in targets:
        if quantize == "int8":
            new = _int8_layer(bnb, m)
        else:
            new = _4bit_layer(bnb, m, quantize, double_quant, compute_dtype)
        new.source_cls = type(m)  # as replace_with_bnb_linear records it
        model.set_submodule(name, new)
    # the flags transformers' quantizers set after loading (quantizer_bnb_4bit.py, quantizer_bnb_8bit.py,
    # base.py): peft reads is_loaded_in_4bit/8bit to wrap these layers with its bitsandbytes LoRA layers
    setattr(model, "is_loaded_in_8bit" if quantize == "int8" else "is_loaded_in_4bit", True)
    model.is_quantized = True
    model.quantization_method = "bitsandbytes"
    return model


def _weight_of(m):
    """(out_features, in_features, weight as [out, in]) of a Linear or a Conv1D ([in, out])."""
    w = m.weight
    if _is_conv1d(m):
        return w.shape[1], w.shape[0], w.detach().t()
    return w.shape[0], w.shape[1], w.detach()


def _f32_view(t):
    """An int32 view of a float32 tensor's storage: the same bytes, not cast by model.half()."""
    torch = _load_torch()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _4bit_layer(bnb, m, quant_type, double_quant, compute_dtype):
    torch = _load_torch()
    F = bnb.functional
    out_f, in_f, w = _weight_of(m)
    bias = m.bias
    new = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=compute_dtype,
                            compress_statistics=double_quant, quant_type=quant_type,
                            quant_storage=torch.uint8, device="meta")  # fmt: skip
    if w.device.type == "meta":
        n = out_f * in_f
        blocks = -(-n // BLOCKSIZE)
        meta = {"device": "meta"}
        packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, **meta)
        code = torch.empty(16, dtype=torch.float32, **meta)  # get_4bit_type(): a new tensor per call
        if double_quant:
            state2 = F.QuantState(absmax=torch.empty(-(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32, **meta),
                                  code=torch.empty(256, dtype=torch.float32, **meta), blocksize=NESTED_BLOCKSIZE,
                                  dtype=torch.float32)  # fmt: skip
            qs = F.QuantState(absmax=torch.empty(blocks, dtype=torch.uint8, **meta), shape=torch.Size((out_f, in_f)),
                              dtype=w.dtype, blocksize=BLOCKSIZE, code=code, quant_type=quant_type,
                              offset=torch.empty((), dtype=torch.float32, **meta), state2=state2)  # fmt: skip
        else:
            qs = F.QuantState(absmax=torch.empty(blocks, dtype=torch.float32, **meta),
                              shape=torch.Size((out_f, in_f)), dtype=w.dtype, blocksize=BLOCKSIZE, code=code,
                              quant_type=quant_type)  # fmt: skip
        new.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=qs, blocksize=BLOCKSIZE,
                                       compress_statistics=double_quant, quant_type=quant_type,
                                       quant_storage=torch.uint8, module=new, bnb_quantized=True)  # fmt: skip
        new.quant_state = qs
    else:
        # bitsandbytes quantizes on the weight's device when a not yet quantized Params4bit is moved
        # there (Params4bit.to -> _quantize)
        p = bnb.nn.Params4bit(w.contiguous(), requires_grad=False, blocksize=BLOCKSIZE,
                              compress_statistics=double_quant, quant_type=quant_type,
                              quant_storage=torch.uint8, module=new)  # fmt: skip
        new.weight = p.to(w.device)
        qs = new.weight.quant_state
    if bias is not None:
        new.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
    # the AVX512-BF16 CPU path repacks the weight for inference (Linear4bit.forward); the estimate
    # follows the dequantize-then-matmul path every device runs in training
    new.support_avx512bf16_for_cpu = False
    new.requires_grad_(False)
    _state_buffers(new)
    new.register_forward_pre_hook(_bind_4bit)
    new._apply = functools.partial(_apply_then_share, new)
    return new


def _state_buffers(module):
    """Register (again) the layer's quantization state as its non-persistent buffers: views of the very
    tensors bitsandbytes reads (the QuantState's, or Int8Params'/MatmulLtState's SCB)."""
    w = module._parameters["weight"]
    qs = getattr(w, "quant_state", None)
    if qs is not None:
        states = {"weight_absmax": qs.absmax, "weight_quant_map": qs.code}
        if qs.nested:
            states.update(weight_offset=qs.offset, weight_nested_absmax=qs.state2.absmax,
                          weight_nested_quant_map=qs.state2.code)  # fmt: skip
    else:
        scb = getattr(w, "SCB", None)
        states = {"weight_SCB": scb if scb is not None else module.state.SCB}
    for key, t in states.items():
        module.register_buffer(key, _f32_view(t), persistent=False)


def _apply_then_share(module, fn, recurse=True):
    """The layer's _apply (model.to(device), .cuda(), .half()): nn.Module's, then the buffers pointed
    at the state bitsandbytes moved itself (Params4bit.to moves the QuantState, Int8Params.to and
    Linear8bitLt.to the SCB), so that a move leaves one copy of it, not two."""
    torch = _load_torch()
    out = torch.nn.Module._apply(module, fn, recurse)
    _state_buffers(module)
    return out


def _bind_4bit(module, args):
    """Give a weight that lost its QuantState (the dry run's fake) one made of the layer's buffers."""
    torch = _load_torch()
    w = module._parameters["weight"]
    if getattr(w, "quant_state", None) is not None:
        return
    F = sys.modules["bitsandbytes"].functional
    b = module._buffers
    like = module.quant_state
    _note(_describe_4bit(module))

    def f32(key):
        return b[key].view(torch.float32) if b[key].dtype == torch.int32 else b[key]

    state2 = None
    if like.nested:
        state2 = F.QuantState(absmax=f32("weight_nested_absmax"), code=f32("weight_nested_quant_map"),
                              blocksize=like.state2.blocksize, dtype=like.state2.dtype)  # fmt: skip
    w.quant_state = F.QuantState(absmax=f32("weight_absmax"), shape=like.shape, code=f32("weight_quant_map"),
                                 blocksize=like.blocksize, quant_type=like.quant_type, dtype=like.dtype,
                                 offset=f32("weight_offset") if like.nested else None, state2=state2)  # fmt: skip


def _int8_layer(bnb, m):
    torch = _load_torch()
    out_f, in_f, w = _weight_of(m)
    bias = m.bias
    new = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False,
                              threshold=INT8_THRESHOLD, device="meta")  # fmt: skip
    if w.device.type == "meta":
        cb = torch.empty((out_f, in_f), dtype=torch.int8, device="meta")
        scb = torch.empty(out_f, dtype=torch.float32, device="meta")
        new.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    else:
        # what Int8Params.to(device) runs from the CPU (int8_vectorwise_quant of the fp16 weight), on the
        # weight's own device (to() quantizes only a weight coming from the CPU)
        p = bnb.nn.Int8Params(w.contiguous(), requires_grad=False, has_fp16_weights=False)
        new.weight = p._quantize(w.device)
    if bias is not None:
        new.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
    new.requires_grad_(False)
    _state_buffers(new)
    new.register_forward_pre_hook(_bind_int8)
    new.register_forward_hook(_unbind_int8, always_call=True)
    new._apply = functools.partial(_apply_then_share, new)
    return new


def _bind_int8(module, args):
    """Linear8bitLt reads its int8 weight and row scales from weight.CB/SCB, moved into its
    MatmulLtState at the first forward (Linear8bitLt.init_8bit_state), and its autograd function keeps
    that state for backward. For the dry run's fake weight: a copy of the state made of the fakes,
    for this call only (the layer's own state is put back after the forward, _unbind_int8)."""
    torch = _load_torch()
    w = module._parameters["weight"]
    if isinstance(w, sys.modules["bitsandbytes"].nn.Int8Params):
        # Linear8bitLt.to moves its state's SCB after _apply: point the buffer at the one it reads
        scb, buf = module.state.SCB, module._buffers["weight_SCB"]
        if scb is not None and w.SCB is None and scb.untyped_storage() is not buf.untyped_storage():
            _state_buffers(module)
        return
    _note(f"int8 base weights (bitsandbytes LLM.int8, outlier threshold {module.state.threshold})")
    if _run["gpu"] is not None:
        _note("int8 on cuda: bitsandbytes runs LLM.int8's int8 matmul (MatMul8bitLt, whose outlier columns "
              "depend on the data); the estimate follows its dequantize-then-matmul path (MatMul8bitFp, the "
              "CPU's), not modelled for the GPU")  # fmt: skip
    state = copy.copy(module.state)
    if not module.training and state.threshold > 0:
        # out of training, LLM.int8 (MatMul8bitLt) computes the input's columns above the threshold apart,
        # in 16 bits: how many depends on the values (its fake kernel's output size is dynamic)
        _note("int8 out of training (LLM.int8's matmul): its outlier columns (inputs above the threshold, "
              "multiplied in 16 bits) depend on the data and are counted as none, and the scratch of "
              "bitsandbytes' int8 kernels (the int32 product, its dequantization) is not counted: the "
              "estimate is low (10% under a real forward of a small Llama on the CPU)")  # fmt: skip
        state.threshold = 0.0
    state.CB = w
    state.SCB = module._buffers["weight_SCB"].view(torch.float32)
    w.CB = w.SCB = None  # the fake weight: nothing for init_8bit_state to move
    module.__dict__["_memtorch_state"] = module.state
    module.state = state


def _unbind_int8(module, args, out):
    real = module.__dict__.pop("_memtorch_state", None)
    if real is not None:
        module.state = real


# ---------------------------------------------------------------------------
# bitsandbytes' 4-bit matmul in the dry run
#
# Its custom operators have fake kernels (bitsandbytes/_ops.py register_fake), so FakeTensorMode
# runs them, but a fake kernel shows its output only. bitsandbytes::gemm_4bit dequantizes the whole
# weight into the compute dtype before a plain linear, and that out x in temporary is what a 4-bit
# forward costs. Backward (autograd/_functions.py:365-386 MatMul4Bit.backward) calls F.dequantize_4bit
# (the nested absmax dequantized and offset in place, then the weight in the dtype it was quantized
# from) and torch.matmul itself: operators the dry run sees one by one, whose kernels allocate their
# output alone (bitsandbytes 0.50.2, cuda: backends/cuda/ops.py:335-339 dequantize_blockwise, :423-433
# dequantize_4bit; CPU: backends/cpu/ops.py:94-99 and :139-178), as their fake kernels show.


_run = {
    "notes": None,
    "given": set(),
    "gpu": None,
}  # the dry run under way: its notes set, what was put there


def _note(text):
    """A line for the estimate's notes (only a dry run's fake layers call this: real ones return first)."""
    if _run["notes"] is not None:
        _run["notes"].add(text)
        _run["given"].add(text)


def _describe_4bit(module):
    qs = module.quant_state
    dq = ", double quantization" if qs.nested else ""
    dtype = (
        str(module.compute_dtype).replace("torch.", "") if module.compute_dtype is not None else "the input's"
    )
    return f"{qs.quant_type} 4-bit base weights (bitsandbytes, blocks of {qs.blocksize}{dq}), compute dtype {dtype}"


def kernel_rules(gpu=None, notes=None):
    """{operator: fn} for bitsandbytes' operators in estimate()'s kernel tables (estimator.kernels wraps
    each fn as a Composite: run under the accounting mode, each operator inside it counted): the CPU's
    (gpu None) or the CUDA GPU ``gpu``'s (an estimator.allocator.GPU). Empty while bitsandbytes is not
    loaded (no bitsandbytes layer can exist then). notes: the set the estimate's notes are read from
    (estimator.kernels.notes); the quantized layers of this dry run describe themselves there, and
    the previous run's lines are taken out."""
    if notes is not None:
        notes.difference_update(_run["given"])
        _run.update(notes=notes, given=set(), gpu=gpu)
    if "bitsandbytes" not in sys.modules:
        return {}
    torch = _load_torch()
    op = torch.ops.bitsandbytes.gemm_4bit.default
    if gpu is not None:
        return {op: _cuda_gemm_4bit(gpu)}
    if torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::gemm_4bit", "CPU"):
        return {}  # a CPU kernel of its own (not this bitsandbytes): only its output is counted
    from bitsandbytes.backends.default import ops

    # bitsandbytes' own implementation, the one its CPU backend runs (backends/default/ops.py:323-345,
    # _gemm_4bit_default_impl: nested absmax dequantized to float32 and offset, the weight dequantized
    # to A's dtype, torch.nn.functional.linear)
    return {op: ops._gemm_4bit_default_impl}


def _cuda_gemm_4bit(gpu):
    """bitsandbytes::gemm_4bit as its CUDA kernel allocates (bitsandbytes 0.50.2,
    backends/cuda/ops.py:934-983): past M = 1536 rows of A (_gemm_4bit_custom_max_m, :926), or with K
    not a multiple of the block size (:956), or where bitsandbytes' per-architecture heuristic
    (_gemm_4bit_use_custom_cuda, :584, run here on the modelled GPU's compute capability and SM count)
    says so, _dequant_linear_fallback (:904-916): the nested absmax dequantized into a float32 buffer
    and offset into another (both held to the end), the weight dequantized into an [N, K] buffer in
    A's dtype, then F.linear. Otherwise the fused kernel (_gemm_4bit_kernel_impl, :846-900): A made
    contiguous, one output."""
    torch = _load_torch()
    use_custom = _bnb_heuristic(gpu)

    def run(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
            absmax_offset=None):  # fmt: skip
        K = A.shape[-1]
        M = A.numel() // K
        N = shapeB[0]
        custom = M <= 1536 and K % blocksize == 0 and use_custom(A.dtype, M, N, K)
        if custom:
            A = A.contiguous()
            return torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)
        if absmax_8bit is not None:
            absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
            absmax = absmax_dq + absmax_offset  # noqa: F841 - held to the return, as in the fallback
        B_dq = torch.empty(tuple(shapeB), dtype=A.dtype, device=A.device)
        return torch.nn.functional.linear(A, B_dq, bias)

    return run


_heuristics = {}


def _bnb_heuristic(gpu):
    """fn(dtype, M, N, K) -> bitsandbytes' choice of its fused 4-bit kernel on ``gpu``: its own
    _gemm_4bit_use_custom_cuda, read from its source (the module itself imports only with CUDA) and run
    with the GPU's (SM count, major, minor) in place of the device query. None found (another
    bitsandbytes): always the dequantize-then-linear path, the one that allocates more."""
    import ast
    import pathlib

    torch = _load_torch()
    key = (gpu.sms, gpu.capability)
    if key in _heuristics:
        return _heuristics[key]
    fn = None
    try:
        path = pathlib.Path(sys.modules["bitsandbytes"].__file__).parent / "backends" / "cuda" / "ops.py"
        tree = ast.parse(path.read_text())
        body = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "_gemm_4bit_use_custom_cuda":
                node.decorator_list = []
                body.append(node)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_GEMM_4BIT_CUSTOM_FLOOR_M" for t in node.targets
            ):
                body.append(node)
        if len(body) == 2:
            scope = {"torch": torch, "_gpu_dispatch_props": lambda index: (gpu.sms, *gpu.capability)}
            exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), scope)  # noqa: S102
            decide = scope["_gemm_4bit_use_custom_cuda"]
            fn = lambda dtype, M, N, K: bool(decide(0, dtype, M, N, K))
    except (OSError, SyntaxError):
        fn = None
    if fn is None:
        fn = lambda dtype, M, N, K: False
    _heuristics[key] = fn
    return fn
