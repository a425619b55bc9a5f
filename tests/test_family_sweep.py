"""The family sweep (issue 36): every family memtorch estimates, small, held to the same checks.

Per family: the CPU estimate of a training step equals track() of the real step (two AdamW steps, counted
from before the model exists) to the byte, with and without checkpointing, and for the model in bfloat16
(bounded where BF16_NEAR says why); a larger batch never estimates lower; inference estimates below
training; the breakdown sums to the peak on the CPU and on cuda; two dry runs give the same figures;
plan() rows equal estimate() of the same configuration (one GPU, and two ranks under zero3); a rank's
optimizer state under zero3 at 4 ranks is about a quarter of the whole. Families whose estimate is known
wrong are marked xfail (strict: a fix shows up as a failure to unmark). The truth checks are slow (a real
step per family); the rest runs in every pass.
"""

import gc

import pytest
import torch
from torch import nn

import memtorch
from memtorch import cpu

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

B, S = 2, 16  # batch and sequence of every family's inputs


def _ids(vocab, n=B, s=S):
    return torch.randint(0, vocab, (n, s))


def _lm(cls, cfg, vocab):
    def make():
        return getattr(transformers, cls)(cfg())

    def batch(n=B):
        ids = _ids(vocab, n)
        return {"input_ids": ids, "labels": ids.clone()}

    return make, batch


def _cfg(name, **kw):
    return lambda: getattr(transformers, name)(**kw)


DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=128, max_position_embeddings=64)  # fmt: skip


def _vision(cls, cfg, image):
    def make():
        return getattr(transformers, cls)(cfg())

    def batch(n=B):
        return {"pixel_values": torch.randn(n, 3, image, image), "labels": torch.zeros(n, dtype=torch.long)}

    return make, batch


def _whisper():
    cfg = _cfg("WhisperConfig", d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
               max_source_positions=16, max_target_positions=32, vocab_size=64, decoder_start_token_id=1,
               pad_token_id=0, eos_token_id=2, bos_token_id=1)  # fmt: skip

    def make():
        return transformers.WhisperForConditionalGeneration(cfg())

    def batch(n=B):
        return {"input_features": torch.randn(n, 16, 32), "labels": _ids(64, n, 8)}

    return make, batch


def _wav2vec2():
    cfg = _cfg("Wav2Vec2Config", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
               num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, num_labels=4,
               do_stable_layer_norm=True, feat_extract_norm="layer", classifier_proj_size=16,
               mask_time_prob=0.0)  # fmt: skip

    def make():
        # (Wav2Vec2ForCTC is refused: CTC's loss reads the labels' values, .item(), which fakes do not hold)
        return transformers.Wav2Vec2ForSequenceClassification(cfg())

    def batch(n=B):
        return {"input_values": torch.randn(n, 400), "labels": torch.zeros(n, dtype=torch.long)}

    return make, batch


def _lora(make_base):
    """A decoder fine-tuned with LoRA, as peft's get_peft_model makes it: the base frozen, adapters on q_proj
    and v_proj (each scales its output by a Python number, which autograd keeps)."""

    def make():
        peft = pytest.importorskip("peft")
        cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(make_base(), cfg)

    return make


class _Loss(nn.Module):
    """A torch module with a loss: forward(x, y) -> a namespace with .loss (as a Hugging Face output)."""

    def __init__(self, body, head):
        super().__init__()
        self.body, self.head = body, head

    def forward(self, x, y):
        out = self.body(x)
        out = out[0] if isinstance(out, tuple) else out
        return transformers.utils.ModelOutput(loss=nn.functional.mse_loss(self.head(out), y))


def _torch(body, head, x_shape, y_shape):
    def make():
        return _Loss(body(), head())

    def batch(n=B):
        return {"x": torch.randn(n, *x_shape), "y": torch.randn(n, *y_shape)}

    return make, batch


FAMILIES = {
    # transformers decoders
    "gpt2": _lm("GPT2LMHeadModel", _cfg("GPT2Config", n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64),
                128),
    "llama": _lm("LlamaForCausalLM", _cfg("LlamaConfig", **DEC), 128),
    # fine-tuning: LoRA adapters on a frozen decoder
    "llama_lora": (_lora(_lm("LlamaForCausalLM", _cfg("LlamaConfig", **DEC), 128)[0]),
                   _lm("LlamaForCausalLM", _cfg("LlamaConfig", **DEC), 128)[1]),
    "mistral": _lm("MistralForCausalLM", _cfg("MistralConfig", **DEC, sliding_window=None), 128),
    "qwen2": _lm("Qwen2ForCausalLM", _cfg("Qwen2Config", **DEC), 128),
    "gemma": _lm("GemmaForCausalLM", _cfg("GemmaConfig", **DEC, head_dim=8), 128),
    "phi": _lm("PhiForCausalLM", _cfg("PhiConfig", **{k: v for k, v in DEC.items()}), 128),
    # mixture of experts
    "mixtral": _lm("MixtralForCausalLM", _cfg("MixtralConfig", **DEC, num_local_experts=4, num_experts_per_tok=2), 128),
    "qwen2_moe": _lm("Qwen2MoeForCausalLM", _cfg("Qwen2MoeConfig", **DEC, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=32), 128),
    # state space
    "mamba": _lm("MambaForCausalLM", _cfg("MambaConfig", hidden_size=32, state_size=8, num_hidden_layers=2,
                                          vocab_size=128, expand=2, conv_kernel=4), 128),
    # encoders
    "bert": _lm("BertForMaskedLM", _cfg("BertConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, vocab_size=128, max_position_embeddings=64), 128),
    "roberta": _lm("RobertaForMaskedLM", _cfg("RobertaConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=64, vocab_size=128, max_position_embeddings=64), 128),
    "distilbert": _lm("DistilBertForMaskedLM", _cfg("DistilBertConfig", dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                    vocab_size=128, max_position_embeddings=64), 128),
    # encoder-decoders
    "t5": _lm("T5ForConditionalGeneration", _cfg("T5Config", d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                                                 vocab_size=128, decoder_start_token_id=0), 128),
    "bart": _lm("BartForConditionalGeneration", _cfg("BartConfig", d_model=32, encoder_layers=1, decoder_layers=1,
                                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                                     encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
                                                     max_position_embeddings=64), 128),
    # vision
    "vit": _vision("ViTForImageClassification", _cfg("ViTConfig", hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, image_size=32,
                                                     patch_size=8, num_labels=4), 32),
    "convnext": _vision("ConvNextForImageClassification", _cfg("ConvNextConfig", hidden_sizes=[16, 32], depths=[1, 1],
                                                               num_stages=2, num_labels=4), 32),
    # speech
    "whisper": _whisper(),
    # torch
    "lstm": _torch(lambda: nn.LSTM(16, 32, num_layers=2, batch_first=True), lambda: nn.Linear(32, 4), (S, 16), (S, 4)),
    "gru": _torch(lambda: nn.GRU(16, 32, num_layers=2, batch_first=True), lambda: nn.Linear(32, 4), (S, 16), (S, 4)),
    "cnn": _torch(lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                        nn.MaxPool2d(2), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                        nn.Flatten()),
                  lambda: nn.Linear(16, 4), (3, 16, 16), (4,)),
    "transformer_encoder": _torch(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True),
                                                                2, enable_nested_tensor=False),
                                  lambda: nn.Linear(32, 4), (S, 32), (S, 4)),
    "mlp": _torch(lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), lambda: nn.Linear(32, 4),
                  (32,), (4,)),
}  # fmt: skip

# the CPU estimate is known off for these (issue 36); a fix turns the strict xfail into a failure to unmark
KNOWN_OFF = {}


def _model(name):
    torch.manual_seed(0)
    return FAMILIES[name][0]()


def _batch(name, n=B):
    torch.manual_seed(1)
    return FAMILIES[name][1](n)


def _step(model, batch, opt):
    out = model(**batch)  # the output kept until the step ends, as estimate()'s keep_output=True
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del out


def _measured(make, name):
    """(track()'s peak of two real AdamW steps of make() on the family's batch, counted from before the model
    exists; the model; the batch). A first step of another make() runs before, for the lazy imports and caches."""
    warm = make()
    _step(warm, _batch(name), torch.optim.AdamW(warm.parameters(), foreach=False))
    del warm
    gc.collect()
    cpu.start()
    base = cpu.allocated()
    model = make()
    batch = _batch(name)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    with memtorch.track() as t:
        for _ in range(2):
            _step(model, batch, opt)
    assert t.report.exact
    return t.report.peak - base, model, batch


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cpu_estimate_is_the_real_step(name, request):
    if name in KNOWN_OFF:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_OFF[name], strict=True))
    measured, model, batch = _measured(lambda: _model(name), name)
    est = memtorch.estimate(model, batch, device="cpu")
    assert est.peak == measured, (est.peak, measured)


# a bfloat16 model's CPU estimate, where it is not to the byte: (estimate - real) / real within these bounds
BF16_NEAR = {
    # the experts' grouped matrix products: their scratch counted for every token routed to one expert (the
    # test below): over, never under (Qwen2-MoE's peak is elsewhere without checkpointing: exact here, and
    # 8,320 B over with it, in BENCHMARKS.md)
    "mixtral": (0.0, 0.05),
    "qwen2_moe": (0.0, 0.05),
    # the CPU flash attention backward's scratch is per thread and varies from call to call, in the real step
    # and in the probe alike (seen: 408 B over, and 408 B under); the probe counts the most of up to 16 runs
    # (tests/test_estimate.py), which the real step may not reach
    "vit": (-0.002, 0.002),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cpu_estimate_of_a_bfloat16_model_is_the_real_step(name, monkeypatch):
    # the model and its floating-point inputs in bfloat16 (precision 'fp32' casts nothing: "as given")
    def batch(n=B, name=name):
        torch.manual_seed(1)
        got = FAMILIES[name][1](n)
        return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in got.items()}

    monkeypatch.setitem(globals(), "_batch", lambda nm, n=B: batch(n))
    measured, model, inputs = _measured(lambda: _model(name).to(torch.bfloat16), name)
    est = memtorch.estimate(model, inputs, device="cpu")
    if name in BF16_NEAR:
        low, high = BF16_NEAR[name]
        assert (1 + low) * measured <= est.peak <= (1 + high) * measured, (est.peak, measured)
    else:
        assert est.peak == measured, (est.peak, measured)


def _hf_checkpointing(model):
    """transformers' own gradient checkpointing, non-reentrant (activation_checkpointing_enable since 5.x; the
    older name warns that it is deprecated)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# the families whose blocks estimate(checkpointing="blocks") recomputes: those with an nn.ModuleList
BLOCKS = sorted(set(FAMILIES) - {"cnn", "gru", "lstm", "mlp"})
KNOWN_OFF_BLOCKS = {}


def test_the_blocks_families_are_those_with_a_module_list():
    with_lists = {n for n in FAMILIES if memtorch.estimator.estimate.block_names(_model(n))}
    assert sorted(with_lists) == BLOCKS


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCKS)
def test_cpu_checkpointed_estimate_is_the_real_step(name, request):
    # the real step: the model's own gradient checkpointing (transformers' gradient_checkpointing_enable), else
    # torch.utils.checkpoint around each block of the outermost ModuleLists, what estimate's "blocks" models
    if name in KNOWN_OFF_BLOCKS:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_OFF_BLOCKS[name], strict=True))
    from torch.utils.checkpoint import checkpoint

    def make():
        model = _model(name)
        if getattr(model, "supports_gradient_checkpointing", False):
            _hf_checkpointing(model)
        else:
            for _n, block in memtorch.estimator.estimate.block_names(model):
                block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)
        return model

    measured, _made, batch = _measured(make, name)
    est = memtorch.estimate(_model(name), batch, device="cpu", checkpointing="blocks")
    assert est.peak == measured, (est.peak, measured)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_routed_experts_take_the_same_memory_wherever_the_tokens_go(name):
    # the router sends tokens to experts by value (which fakes do not hold): two batches route differently,
    # and each real step takes the estimate's peak; the estimate says nothing of routing
    first, model, batch = _measured(lambda: _model(name), name)
    torch.manual_seed(999)
    other = FAMILIES[name][1](B)
    assert not torch.equal(other["input_ids"], batch["input_ids"])
    measured = []
    for b in (batch, other):
        gc.collect()
        cpu.start()
        base = cpu.allocated()
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        with memtorch.track() as t:
            for _ in range(2):
                _step(model, b, opt)
        assert t.report.exact
        measured.append(t.report.peak - base)
        del opt
    est = memtorch.estimate(model, batch, device="cpu")
    # the model exists before these blocks: what they count from differs from _measured's by the same bytes
    assert measured[0] == measured[1]
    assert est.peak == first
    assert not any("route" in n for n in est.notes)


@pytest.mark.slow
def test_bfloat16_experts_on_the_cpu_are_bounded_by_the_most_and_say_so():
    # where the CPU multiplies bfloat16 through float32 copies (this machine's torch did), an expert's scratch
    # grows with its share of the tokens: the estimate counts every token routed to one expert and says so,
    # and the real steps of two routings are under it (the float32 steps above take no such scratch: exact)
    def make(seed):
        torch.manual_seed(seed)
        return FAMILIES["mixtral"][0]().to(torch.bfloat16)

    measured, model, batch = _measured(lambda: make(0), "mixtral")
    other, _, _ = _measured(lambda: make(7), "mixtral")  # another router's weights: another split
    est = memtorch.estimate(model, batch, device="cpu")
    said = [n for n in est.notes if n.startswith("the experts' grouped matrix products")]
    if said:
        assert max(measured, other) <= est.peak <= 1.05 * min(measured, other), (est.peak, measured, other)
        assert "counted for every token routed to one expert, the most (up to " in said[0]
    else:  # a CPU that multiplies bfloat16 natively: no scratch, exact
        assert est.peak == measured == other


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_figures_hang_together(name):
    model = _model(name)
    batch, big = _batch(name), _batch(name, 2 * B)
    one = memtorch.estimate(model, batch, device="cpu")
    again = memtorch.estimate(model, batch, device="cpu")
    assert (one.peak, one.breakdown) == (again.peak, again.breakdown)  # two dry runs, the same figures
    assert sum(one.breakdown.values()) == one.peak
    assert memtorch.estimate(model, big, device="cpu").peak >= one.peak  # a larger batch never lower
    inference = memtorch.estimate(model.eval(), batch, device="cpu", training=False)
    model.train()
    assert inference.peak < one.peak
    gpu = memtorch.estimate(model, batch, device="cuda")
    assert sum(gpu.breakdown.values()) == gpu.peak
    # a step the real one runs is never refused: bf16-mixed autocast (a backward kernel's dtypes under the dry
    # run's autocast once made LayerNorm and BatchNorm steps "fail as the real one would")
    mixed = memtorch.estimate(model, batch, device="cpu", precision="bf16-mixed")
    assert sum(mixed.breakdown.values()) == mixed.peak


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_plan_rows_are_estimates_and_zero3_splits_the_state(name):
    model = _model(name)
    batch = _batch(name)
    p = memtorch.plan(model, batch, device="cuda", device_memory="80 GiB", world_sizes=[1, 2],
                      shardings=["zero3"], precisions=["fp32"], checkpointing=[None], exhaustive=True)  # fmt: skip
    rows = {(o.world_size, o.sharding): o for o in p.options}
    one = memtorch.estimate(model, batch, device="cuda")
    assert (rows[(1, None)].peak, rows[(1, None)].reserved) == (one.peak, one.reserved_peak)
    two = memtorch.estimate(model, batch, device="cuda", world_size=2, sharding="zero3")
    assert (rows[(2, "zero3")].peak, rows[(2, "zero3")].reserved) == (two.peak, two.reserved_peak)
    four = memtorch.estimate(model, batch, device="cpu", world_size=4, sharding="zero3")
    whole = four.model_states_total["optimizer_state"]
    rank = four.model_states["optimizer_state"]
    assert 0.2 * whole <= rank <= 0.3 * whole + 4096, (rank, whole)


# the families with a generate(): decoders, state-space, mixtures of experts, encoder-decoders, speech
GENERATES = ["bart", "gemma", "gpt2", "llama", "llama_lora", "mamba", "mistral", "mixtral", "phi", "qwen2",
             "qwen2_moe", "t5", "whisper"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", GENERATES)
def test_generation_is_the_real_generate(name):
    # estimate(training=False, max_new_tokens=n) against track() of the real model.generate(max_new_tokens=n),
    # counted from before the model exists, no end-of-sequence token (the whole length): within 3% (the
    # issue's bar; measured here -1.6% .. +2.5%), and never lower for more tokens (at these sizes the prompt's
    # forward is the decoders' peak, 4 or 24 new tokens alike; T5's and BART's grow, in both)
    def prepared(model):
        model.eval()
        model.generation_config.eos_token_id = None
        return model

    def inputs():
        return {k: v for k, v in _batch(name).items() if k != "labels"}

    warm = prepared(_model(name))
    warm.generate(**inputs(), max_new_tokens=2)  # generate's lazy imports and caches
    del warm
    estimates = []
    for n in (4, 24):
        gc.collect()
        cpu.start()
        base = cpu.allocated()
        model = prepared(_model(name))
        x = inputs()
        with memtorch.track() as t:
            out = model.generate(**x, max_new_tokens=n)
            assert out.shape[-1] >= n
            del out
        assert t.report.exact
        measured = t.report.peak - base
        est = memtorch.estimate(model, x, device="cpu", training=False, max_new_tokens=n)
        assert abs(est.peak - measured) <= 0.03 * measured, (n, est.peak, measured)
        estimates.append(est.peak)
        del model
    assert estimates[1] >= estimates[0]


def test_a_family_whose_step_reads_tensor_values_is_refused_in_words():
    # wav2vec2's step reads tensor values (.item()): refused, with why, never a silent figure
    make, batch = _wav2vec2()
    torch.manual_seed(0)
    with pytest.raises(memtorch.MemtorchError, match=r"calls \.item\(\).*fake tensors that hold no values"):
        memtorch.estimate(make(), batch(), device="cpu")
