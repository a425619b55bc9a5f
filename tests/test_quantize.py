"""Quantized base weights (memtorch._quantize): bitsandbytes' own layers put in as transformers'
BitsAndBytesConfig puts them, and estimate()'s dry run of them.

Expected figures: bitsandbytes' own quantization of real weights on the CPU (the tensors it keeps,
their nbytes), hand counts from its storage rules (functional.quantize_4bit / quantize_blockwise,
Int8Params), transformers' own replace_with_bnb_linear for which layers are converted, and track()
of real QLoRA steps on the CPU for the estimate.
"""

import copy
import gc
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # bitsandbytes looks for a CPU kernel on the Hub at import

import pytest
import torch
from torch import nn

import memtorch
from memtorch import cpu
from memtorch._quantize import apply
from memtorch.errors import MemtorchError

# peft 0.21 reads transformers' deprecated is_gradient_checkpointing (peft_model.py:184)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _bnb():
    return pytest.importorskip("bitsandbytes")


def _llama(device="cpu", **kw):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, **kw)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


def _lora(model):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(512, 1024)
        self.down = nn.Linear(1024, 512)
        self.head = nn.Linear(512, 4)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def _warm(kind, double_quant):
    """bitsandbytes' process-wide caches (functional.name2qmap's dynamic map, backends.utils'
    4-bit codes) made before a measurement starts: they are the process's, not a model's."""
    apply(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)), kind, double_quant=double_quant)


_stepped = set()


def _warm_step(kind, double_quant):
    """One real LoRA step on a quantized Llama before a measurement, once per process: the process's first
    such step keeps 16 B of its own for the process (measured: 16 B still allocated once that model, its
    optimizer and report are gone, none after the second step), which a measurement made from before the
    model exists would count as the model's (the test passed only after another test had stepped)."""
    if (kind, double_quant) not in _stepped:
        test_estimate = pytest.importorskip("test_estimate")
        model = _lora(apply(_llama(), kind, double_quant=double_quant))
        test_estimate.real_steps(model, torch.randint(0, 256, (2, 16)), "adamw")
        _stepped.add((kind, double_quant))


# ---------------------------------------------------------------- input checks


def test_bad_arguments_are_clear_errors():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(MemtorchError, match="quantize must be one of 'nf4', 'fp4', 'int8'; got 'int4'"):
        apply(m, "int4")
    with pytest.raises(MemtorchError, match="compute_dtype must be"):
        apply(m, "nf4", compute_dtype=torch.int8)
    with pytest.raises(MemtorchError, match="skip must be a list"):
        apply(m, "nf4", skip="lm_head")
    with pytest.raises(MemtorchError, match="quantizes an nn.Module"):
        apply({"w": torch.zeros(2)}, "nf4")


def test_without_bitsandbytes_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    with pytest.raises(MemtorchError, match=r"pip install bitsandbytes"):
        apply(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), "nf4")


def test_refuses_double_quant_for_int8_a_quantized_model_and_a_peft_model():
    _bnb()
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    with pytest.raises(MemtorchError, match="double_quant applies to 4-bit"):
        apply(m, "int8", double_quant=True)
    q = apply(m, "nf4")
    with pytest.raises(MemtorchError, match=r"quantized already \(0: Linear4bit\)"):
        apply(q, "nf4")
    with pytest.raises(MemtorchError, match="before LoRA"):
        apply(_lora(_llama("meta")), "nf4")


# ---------------------------------------------------------------- which layers, and the user's model


def test_the_users_model_is_not_changed():
    _bnb()
    model = Net()
    before = [(n, type(m), m._forward_pre_hooks.copy()) for n, m in model.named_modules()]
    tensors = [(n, id(p), p.data_ptr(), p.dtype, p.requires_grad) for n, p in model.named_parameters()]
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    q = apply(model, "nf4", double_quant=True)
    assert q is not model
    assert [(n, type(m), m._forward_pre_hooks) for n, m in model.named_modules()] == before
    assert [
        (n, id(p), p.data_ptr(), p.dtype, p.requires_grad) for n, p in model.named_parameters()
    ] == tensors
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())
    assert type(q.up).__name__ == "Linear4bit" and type(model.up) is nn.Linear


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("skip", [None, ["up_proj"]])
def test_converts_the_layers_transformers_converts(tied, skip):
    """transformers' own replace_with_bnb_linear, with the skip list its bitsandbytes quantizer
    builds (quantizer_bnb_4bit.py: get_modules_to_not_convert(model, llm_int8_skip_modules,
    _keep_in_fp32_modules)), converts the same modules."""
    _bnb()
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    model = _llama("meta", tie_word_embeddings=tied)
    theirs = copy.deepcopy(model)
    not_convert = HfQuantizer.get_modules_to_not_convert(theirs, skip, theirs._keep_in_fp32_modules)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    replace_with_bnb_linear(theirs, modules_to_not_convert=not_convert, quantization_config=config)
    ours = apply(model, "nf4", skip=skip)

    def kinds(m):
        return {n: type(x).__name__ for n, x in m.named_modules()}

    assert kinds(ours) == kinds(theirs)
    # a skip list replaces transformers' defaults (as llm_int8_skip_modules does): lm_head is converted then
    assert kinds(ours)["lm_head"] == ("Linear" if skip is None else "Linear4bit")
    assert kinds(ours)["model.layers.0.mlp.up_proj"] == ("Linear4bit" if skip is None else "Linear")
    assert kinds(ours)["model.layers.0.self_attn.q_proj"] == "Linear4bit"


def test_gpt2_conv1d_layers_quantized_as_transformers_does():
    """GPT-2's Conv1D layers (weight [in, out]) are converted too, the weight quantized as [out, in]
    (transformers transposes it before quantizing): the same modules as replace_with_bnb_linear, an
    output within 4-bit error of the original, and a LoRA step on the CPU whose estimate is within
    0.1% of track() (measured: 64 B under)."""
    _bnb()
    transformers = pytest.importorskip("transformers")
    test_estimate = pytest.importorskip("test_estimate")
    import pathlib

    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    config = transformers.AutoConfig.from_pretrained(
        pathlib.Path(__file__).parent / "data" / "configs" / "gpt2"
    )
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    theirs = copy.deepcopy(base)
    not_convert = HfQuantizer.get_modules_to_not_convert(theirs, None, theirs._keep_in_fp32_modules)
    replace_with_bnb_linear(theirs, modules_to_not_convert=not_convert,
                            quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True))  # fmt: skip
    ours = apply(base, "nf4")
    assert {n: type(m).__name__ for n, m in ours.named_modules()} == {
        n: type(m).__name__ for n, m in theirs.named_modules()
    }
    x = torch.randn(2, 5, config.n_embd)
    with torch.no_grad():
        want = base.transformer.h[0].attn.c_attn(x)
        got = ours.transformer.h[0].attn.c_attn(x).float()
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    peft = pytest.importorskip("peft")
    _warm("nf4", False)
    cpu.start()
    gc.collect()
    b0 = cpu.allocated()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model = peft.get_peft_model(apply(base, "nf4"), peft.LoraConfig(r=4, target_modules=["c_attn"]))
    report, opt = test_estimate.real_steps(model, ids, "adamw")
    real = report.peak - b0
    del opt
    est = memtorch.estimate(model, ids, optimizer="adamw", device="cpu")
    assert est.peak == real, (est.peak, real)


# ---------------------------------------------------------------- storage: exact, as bitsandbytes keeps it


def _hand_4bit(out_f, in_f, nested):
    """Bytes bitsandbytes keeps for one 4-bit weight (functional.quantize_4bit, blocksize 64): the
    packed uint8 weight, absmax per block, the 16-value code; nested: uint8 absmax, a float32 offset,
    float32 absmax per 256 blocks, a copy of the 256-value dynamic map (quantize_blockwise)."""
    n = out_f * in_f
    blocks = -(-n // 64)
    if nested:
        return (n + 1) // 2 + blocks + 4 + 4 * -(-blocks // 256) + 4 * 256 + 4 * 16
    return (n + 1) // 2 + 4 * blocks + 4 * 16


def _state_tensors(w):
    """The weight and every tensor of its QuantState (4-bit) or its CB/SCB (int8), by role."""
    qs = getattr(w, "quant_state", None)
    if qs is None:
        return {"weight": w.data, "SCB": w.SCB}
    out = {"weight": w.data, "absmax": qs.absmax, "code": qs.code}
    if qs.nested:
        out.update(offset=qs.offset, nested_absmax=qs.state2.absmax, nested_code=qs.state2.code)
    return out


def _layout(tensors):
    return {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}


def _unique_bytes(tensors):
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("shape", [(40, 96), (7, 33), (640, 64)])
@pytest.mark.parametrize("kind,nested", [("nf4", False), ("fp4", False), ("nf4", True), ("int8", False)])
def test_quantized_storage_is_bitsandbytes_own(shape, kind, nested):
    """A layer built on the meta device holds the tensors bitsandbytes' own quantization of real
    weights keeps (same roles, shapes, dtypes), and their bytes are the hand count; apply() on real
    weights quantizes with bitsandbytes, and inspect() sees all of it (the state is registered as
    buffers)."""
    bnb = _bnb()
    out_f, in_f = shape
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=False)
    if kind == "int8":
        real = bnb.nn.Linear8bitLt(in_f, out_f, bias=False, has_fp16_weights=False, threshold=6.0)
    else:
        real = bnb.nn.Linear4bit(in_f, out_f, bias=False, compress_statistics=nested, quant_type=kind)
    real.load_state_dict(lin.state_dict())
    real = real.to("cpu")  # bitsandbytes quantizes here (Params4bit.to / Int8Params.to)
    theirs = _state_tensors(real.weight)
    with torch.device("meta"):
        meta_model = nn.Sequential(nn.Linear(in_f, out_f, bias=False), nn.Linear(2, 2))
    ours_meta = _state_tensors(apply(meta_model, kind, double_quant=nested)[0].weight)
    assert _layout(ours_meta) == _layout(theirs)
    hand = out_f * in_f + 4 * out_f if kind == "int8" else _hand_4bit(out_f, in_f, nested)
    assert _unique_bytes(theirs.values()) == hand
    ours_real = apply(nn.Sequential(lin, nn.Linear(2, 2)), kind, double_quant=nested)[0]
    assert _unique_bytes(_state_tensors(ours_real.weight).values()) == hand
    assert memtorch.inspect(ours_real).total == hand


def test_a_quantized_model_holds_what_inspect_counts():
    """cpu.allocated() after apply() on a real model is inspect()'s total: nothing bitsandbytes
    keeps is out of the walker's sight."""
    _bnb()
    base = _llama()
    _warm("nf4", True)
    cpu.start()
    gc.collect()
    b0 = cpu.allocated()
    q = apply(base, "nf4", double_quant=True)
    gc.collect()
    assert cpu.allocated() - b0 == memtorch.inspect(q).total


# ---------------------------------------------------------------- estimate() vs track() of real steps


def _llama_states(kind, nested, itemsize=4):
    """Hand count of the tiny Llama's parameters and buffers after apply() and LoRA r=8 on q_proj, v_proj
    (the adapters in float32, as peft makes them; the rest in a dtype of ``itemsize`` bytes)."""
    d, ff, layers, vocab, kv = 64, 128, 2, 256, 32
    linears = [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff)]  # q k v o gate up down
    lora = 8 * d + d * 8 + 8 * d + kv * 8  # q_proj: A [8, 64], B [64, 8]; v_proj: B [32, 8]
    dense = 2 * vocab * d + (2 * layers + 1) * d  # embeddings, lm_head, norms
    rotary = 2 * itemsize * 8  # inv_freq and original_inv_freq, head_dim / 2
    if kind == "int8":
        weights = sum(o * i for o, i in linears) * layers
        state = sum(4 * o for o, _ in linears) * layers
    else:
        weights = sum(o * i // 2 for o, i in linears) * layers
        state = sum(_hand_4bit(o, i, nested) - o * i // 2 for o, i in linears) * layers
    return {"parameter": itemsize * dense + 4 * lora * layers + weights, "buffer": state + rotary}


@pytest.mark.parametrize(
    "kind,nested,dtype",
    [("nf4", False, "float32"), ("nf4", True, "float32"), ("fp4", False, "float32"), ("int8", False, "float32"),
     ("nf4", True, "bfloat16"), ("int8", False, "bfloat16")],
)  # fmt: skip
def test_qlora_step_estimate_matches_track(kind, nested, dtype):
    """A real LoRA step on a Llama with bitsandbytes' quantized base (forward, backward, AdamW) on
    the CPU, tracked, against estimate(device="cpu") of the same model (the base in float32, or in
    bfloat16 as QLoRA users load it): equal to the byte in every case (it was 32 B under, the Python
    numbers each adapter scales by, which autograd keeps, until the dry run counted them)."""
    _bnb()
    test_estimate = pytest.importorskip("test_estimate")
    base = _llama().to(getattr(torch, dtype))
    _warm(kind, nested)
    _warm_step(kind, nested)
    cpu.start()
    gc.collect()
    b0 = cpu.allocated()
    ids = torch.randint(0, 256, (2, 16))
    model = _lora(apply(base, kind, double_quant=nested))
    report, opt = test_estimate.real_steps(model, ids, "adamw")
    real = report.peak - b0
    opt.zero_grad(set_to_none=True)
    del opt
    est = memtorch.estimate(model, ids, optimizer="adamw", device="cpu")
    assert est.peak == real, (est.peak, real)
    itemsize = getattr(torch, dtype).itemsize
    assert est.model_states["parameter"] == _llama_states(kind, nested, itemsize)["parameter"]
    assert est.model_states["buffer"] == _llama_states(kind, nested, itemsize)["buffer"]
    assert est.model_states["gradient"] == 4 * 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_autocast_step_estimate_matches_track(kind):
    """precision="bf16-mixed": the same real step under CPU autocast (forward and loss; backward
    after it), tracked, against the estimate. Measured: 48 B under (-0.009%)."""
    _bnb()
    from memtorch.estimator.estimate import _make_optimizer, default_loss

    base = _llama()
    _warm(kind, False)
    _warm_step(kind, False)
    cpu.start()
    gc.collect()
    b0 = cpu.allocated()
    ids = torch.randint(0, 256, (2, 16))
    model = _lora(apply(base, kind))
    opt = _make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], "cpu")
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(ids)
                loss = default_loss(out, ids)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = None
    real = t.report.peak - b0
    del opt
    est = memtorch.estimate(model, ids, optimizer="adamw", device="cpu", precision="bf16-mixed")
    assert est.peak == real, (est.peak, real)


def test_the_dequantized_weight_is_in_the_forward():
    """bitsandbytes' 4-bit forward dequantizes the whole weight into the compute dtype before its
    matmul (backends/default/ops.py _gemm_4bit_default_impl), and backward dequantizes it again,
    into the dtype the weight was quantized from, then casts (autograd/_functions.py
    MatMul4Bit.backward): each phase's peak as track() measures it, within 16 B (measured: 8 B), and
    the step's peak to the byte. The biases are float32 and the compute dtype bfloat16: the first
    forward casts them in place (Linear4bit.forward: bias.data = bias.data.to(x.dtype)), freeing the
    float32 storage, in the real step and in the dry run alike (counting starts before the model is
    built, so that the free of storage made before it is seen)."""
    _bnb()
    test_estimate = pytest.importorskip("test_estimate")
    _warm("nf4", True)
    _warm_step("nf4", True)
    cpu.start()
    gc.collect()
    b0 = cpu.allocated()
    base = Net()
    x = torch.randn(4, 512)
    model = _lora_net(apply(base, "nf4", double_quant=True))
    del base
    report, opt = test_estimate.real_steps(model, x, "adamw")
    assert model.base_model.model.up.base_layer.bias.dtype == torch.bfloat16
    real = report.peak - b0
    del opt
    # the estimate of the model as it was before its first step: biases in float32
    model = _lora_net(apply(Net(), "nf4", double_quant=True))
    est = memtorch.estimate(model, x, optimizer="adamw", device="cpu")
    for phase in ("forward", "backward"):
        assert abs(est.phases[phase].peak_above_start - report.phases[phase].peak_above_start) <= 16, phase
    assert est.peak == real, (est.peak, real)
    # up's weight (1024 x 512) dequantized: 1 MiB in bfloat16 in forward; 2 MiB in float32 plus its
    # 1 MiB bfloat16 cast in backward
    assert est.phases["forward"].peak_above_start > 1024 * 512 * 2
    assert est.phases["backward"].peak_above_start > 1024 * 512 * 6


def _lora_net(model):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["up", "down"]))


@pytest.mark.parametrize("kind,nested", [("nf4", True), ("int8", False)])
def test_meta_model_estimates_as_the_real_one(kind, nested):
    """The model memtorch builds on the meta device (no weights) estimates as the same model with
    real weights, quantized by bitsandbytes."""
    _bnb()
    ids = torch.randint(0, 256, (2, 16))
    ests = [memtorch.estimate(_lora(apply(_llama(dev), kind, double_quant=nested)), ids, optimizer="adamw",
                              device="cpu") for dev in ("cpu", "meta")]  # fmt: skip
    assert ests[0].peak == ests[1].peak
    assert ests[0].model_states == ests[1].model_states


def test_cast_precision_leaves_the_quantization_state_float32():
    """precision="bf16-true" casts floating parameters and buffers; bitsandbytes keeps absmax and the
    codes in float32 (its kernels check it), and so does the estimate."""
    _bnb()
    model = _lora_net(apply(Net(), "nf4", double_quant=True))
    fp32 = memtorch.estimate(model, (4, 512), optimizer="adamw", device="cpu")
    x = torch.zeros(4, 512, dtype=torch.bfloat16)  # a bfloat16 model takes bfloat16 inputs
    bf16 = memtorch.estimate(model, x, optimizer="adamw", device="cpu", precision="bf16-true")
    assert bf16.model_states["buffer"] == fp32.model_states["buffer"] > 0


def test_notes_say_what_the_base_is():
    _bnb()
    model = _lora_net(apply(Net(), "nf4", double_quant=True))
    est = memtorch.estimate(model, (4, 512), optimizer="adamw", device="cpu")
    line = "nf4 4-bit base weights (bitsandbytes, blocks of 64, double quantization), compute dtype bfloat16"
    assert line in est.notes
    plain = memtorch.estimate(Net(), (4, 512), optimizer="adamw", device="cpu")
    assert not any("bitsandbytes" in n for n in plain.notes)
    int8 = memtorch.estimate(_lora_net(apply(Net(), "int8")), (4, 512), optimizer="adamw", device="cuda")
    assert "int8 base weights (bitsandbytes LLM.int8, outlier threshold 6.0)" in int8.notes
    assert any(n.startswith("int8 on cuda: ") for n in int8.notes)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_estimate_leaves_the_quantized_model_as_it_was(kind):
    """The dry run gives its fake weights a quantization state (4-bit) or a state of their own for the
    call (int8): the model's real state, its bias's dtype and its output are the same afterwards."""
    _bnb()
    model = _lora_net(apply(Net(), kind))
    x = torch.randn(4, 512)
    with torch.no_grad():
        before = model(x)
    up = model.base_model.model.up.base_layer
    state = (up.weight.quant_state, up.weight.data_ptr()) if kind == "nf4" else (up.state.CB, up.state.SCB)
    biases = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters() if n.endswith("bias")}
    memtorch.estimate(model, x, optimizer="adamw", device="cpu")
    memtorch.estimate(model, x, optimizer="adamw", device="cuda")
    after_state = (
        (up.weight.quant_state, up.weight.data_ptr()) if kind == "nf4" else (up.state.CB, up.state.SCB)
    )
    assert all(a is b or a == b for a, b in zip(after_state, state))
    assert {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters() if n.endswith("bias")} == biases
    with torch.no_grad():
        assert torch.equal(model(x), before)


# ---------------------------------------------------------------- cuda: bitsandbytes' kernel choice


def test_cuda_takes_bitsandbytes_own_kernel_choice():
    """bitsandbytes' heuristic (backends/cuda/ops.py _gemm_4bit_use_custom_cuda), run on the modelled
    GPU: its fused kernel for up to 4 rows of A (_GEMM_4BIT_CUSTOM_FLOOR_M), dequantize + linear for
    a training step's thousands of rows."""
    _bnb()
    from memtorch.estimator.allocator import GPU
    from memtorch._quantize import _bnb_heuristic

    decide = _bnb_heuristic(GPU("H100", (9, 0), sms=132))
    assert decide(torch.bfloat16, 1, 4096, 4096) and decide(torch.bfloat16, 4, 4096, 4096)
    assert not decide(torch.bfloat16, 1024, 4096, 4096)


def _cuda_gemm_4bit(M, N, K, nested):
    """(transient bytes, bytes left allocated) of one bitsandbytes::gemm_4bit on fake tensors, with the
    kernel table of estimate(device="cuda") on an H100."""
    from memtorch.estimator.allocator import GPU
    from memtorch.estimator.kernels import CudaState, cuda_kernels
    from memtorch.estimator.dispatch import Ledger, _accounting_mode, fake_mode

    ledger = Ledger()
    blocks = N * K // 64
    with (
        fake_mode(),
        _accounting_mode(ledger, cuda_kernels(CudaState(GPU("H100", (9, 0), sms=132))), [False]),
    ):
        A = torch.empty(M, K, dtype=torch.bfloat16)
        B = torch.empty(N * K // 2, 1, dtype=torch.uint8)
        if nested:
            kw = {"absmax_8bit": torch.empty(blocks, dtype=torch.uint8), "absmax_code": torch.empty(256),
                  "absmax_offset": torch.empty(())}  # fmt: skip
            absmax = torch.empty(-(-blocks // 256))
        else:
            kw, absmax = {}, torch.empty(blocks)
        before = ledger.current
        out = torch.ops.bitsandbytes.gemm_4bit.default(A, B, [N, K], absmax, 64, "nf4", **kw)
        assert tuple(out.shape) == (M, N) and out.dtype == torch.bfloat16
        after = ledger.current
    return ledger.peak - after, after - before


@pytest.mark.parametrize("nested", [False, True])
def test_cuda_gemm_4bit_allocates_as_its_kernels(nested):
    """2048 rows: the dequantize-then-linear fallback (backends/cuda/ops.py _dequant_linear_fallback):
    the weight dequantized to bfloat16 (N x K x 2 B) and, nested, the absmax dequantized and offset
    (2 x 4 B per block) live until linear's output exists, with the cuBLAS workspace linear takes.
    4 rows: the fused kernel, its output alone."""
    _bnb()
    N, K = 1024, 512
    transient, kept = _cuda_gemm_4bit(2048, N, K, nested)
    assert transient == N * K * 2 + (2 * 4 * N * K // 64 if nested else 0)
    assert kept == 2048 * N * 2 + 32 * 1024 * 1024  # the output, and the H100's 32 MiB cuBLAS workspace
    assert _cuda_gemm_4bit(4, N, K, nested) == (0, 4 * N * 2)


# ---------------------------------------------------------------- command line


def test_cli_quantize_flags():
    """memtorch estimate CONFIG --quantize nf4 --double-quant: the model load_model builds on the meta
    device, quantized here; the figure printed is estimate()'s of the same model."""
    import io
    import json
    import pathlib

    _bnb()
    pytest.importorskip("peft")
    from memtorch import cli

    config = pathlib.Path(__file__).parent / "data" / "configs" / "llama" / "config.json"
    argv = ["estimate", str(config), "--batch", "2", "--seq", "32", "--lora", "r=8,targets=q_proj,v_proj",
            "--quantize", "nf4", "--double-quant", "--device", "cpu"]  # fmt: skip
    out = io.StringIO()
    assert cli.main(argv, out=out) == 0
    text = out.getvalue()
    assert (
        "note: nf4 4-bit base weights (bitsandbytes, blocks of 64, double quantization), compute dtype bfloat16"
        in text
    )
    assert "Linear4bit" in text
    out = io.StringIO()
    assert cli.main([*argv, "--format", "json"], out=out) == 0
    model = memtorch.load_model(
        str(config), lora="r=8,targets=q_proj,v_proj", quantize="nf4", double_quant=True
    )
    from memtorch.models import example_inputs

    est = memtorch.estimate(model, example_inputs(model, 2, 32), device="cpu")
    assert json.loads(out.getvalue())["peak"] == est.peak


def test_cli_double_quant_needs_quantize(capsys):
    import io
    import pathlib

    from memtorch import cli

    config = pathlib.Path(__file__).parent / "data" / "configs" / "llama" / "config.json"
    code = cli.main(
        ["estimate", str(config), "--batch", "2", "--seq", "8", "--double-quant"], out=io.StringIO()
    )
    assert code == 2
    assert (
        "--double-quant quantizes the 4-bit scales: it goes with --quantize nf4 or fp4"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_moving_the_model_keeps_one_copy_of_the_state(kind):
    """model.to(device) copies every buffer, while bitsandbytes moves the quantization state itself
    (Params4bit.to, Int8Params.to): the layers point their buffers at the moved state again, so the
    model holds it once. Simulated with an _apply that copies every tensor (a move to another device
    is not possible here: bitsandbytes' layers refuse .to("meta"))."""
    _bnb()
    q = apply(Net(), kind, double_quant=kind == "nf4")
    before = memtorch.inspect(q).total
    q._apply(lambda t: t.clone())
    assert memtorch.inspect(q).total == before
    up = q.up

    def same(a, b):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    if kind == "nf4":
        assert same(up.weight_absmax, up.weight.quant_state.absmax)
        assert same(up.weight_quant_map, up.weight.quant_state.code)
    else:
        assert same(up.weight_SCB, up.weight.SCB)
    c = copy.deepcopy(q)
    c._apply(lambda t: t.clone())
    assert memtorch.inspect(c).total == before


def test_int8_out_of_training_runs_and_says_what_it_leaves_out():
    """Out of training Linear8bitLt runs LLM.int8's matmul, whose outlier columns have a size that
    depends on the data (the fake kernel's output is dynamic): the dry run counts none and says so;
    4-bit inference is exact (measured: 0 B on this Llama)."""
    _bnb()
    est = memtorch.estimate(
        apply(_llama("meta"), "int8").eval(),
        torch.zeros(2, 16, dtype=torch.int64, device="meta"),
        device="cpu",
        training=False,
    )
    assert any(n.startswith("int8 out of training (LLM.int8's matmul)") for n in est.notes)
    base = _llama()
    _warm("nf4", False)
    cpu.start()
    gc.collect()
    b0 = cpu.allocated()
    ids = torch.randint(0, 256, (2, 16))
    model = apply(base, "nf4").eval()
    with torch.inference_mode(), memtorch.track(model) as t:
        out = model(ids)
        del out
    est = memtorch.estimate(model, ids, device="cpu", training=False)
    assert est.peak == t.report.peak - b0, (est.peak, t.report.peak - b0)


def test_bitsandbytes_is_imported_without_its_hub_warning():
    # bitsandbytes' CPU backend on a CPU with AVX512-BF16 fetches a kernel from the Hub at import and logs a
    # warning offline; the import memtorch causes (quantize=, a LoRA row through peft) keeps it quiet and puts
    # the logger's level back
    import subprocess

    code = (
        "import logging, sys\n"
        "log = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
        "if sys.argv[1] == 'plain':\n"
        "    import bitsandbytes\n"
        "else:\n"
        "    from memtorch import models\n"
        "    models._peft()\n"
        "    assert 'bitsandbytes' in sys.modules and log.level == logging.NOTSET, log.level\n"
        "    assert logging.getLogger('kernels').level == logging.NOTSET\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for k in ("LD_PRELOAD", "PYTHONMALLOC"):
        env.pop(k, None)
    runs = {
        how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, env=env, timeout=300)
        for how in ("plain", "memtorch")
    }
    assert runs["memtorch"].returncode == 0, runs["memtorch"].stderr
    assert "Failed to load" not in runs["memtorch"].stderr
    # nor the kernels package's line for the kernel it would fetch (HF_HUB_OFFLINE=1: "Skipping publisher
    # trust check for 'kernels-community/quantization-bitsandbytes'"), which `memtorch advise` printed above
    # its report
    assert "Skipping publisher trust check" not in runs["memtorch"].stderr, runs["memtorch"].stderr
    # where bitsandbytes does warn (this machine's CPU), memtorch's import is what silenced it
    if "Failed to load" in runs["plain"].stderr:
        assert runs["plain"].stderr.count("Failed to load") == 1
