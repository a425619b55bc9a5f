"""estimate(..., training=False, max_new_tokens=N): generate()'s own decoding loop on fake tensors, for the
encoder-decoder and speech families as for decoders, held against track() of the real generate()."""

import gc

import pytest
import torch

import memtorch
from memtorch import cpu

transformers = pytest.importorskip("transformers")


def _model(kind):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "whisper":
        # 16 source positions: input features of 2 x 16 = 32 frames
        cfg = transformers.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                         num_mel_bins=80, max_source_positions=16, max_target_positions=128,
                                         vocab_size=1000, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2)  # fmt: skip
        model = transformers.WhisperForConditionalGeneration(cfg)
    elif kind == "t5":
        cfg = transformers.T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
        model = transformers.T5ForConditionalGeneration(cfg)
    else:
        cfg = transformers.BartConfig(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                                      decoder_ffn_dim=128, max_position_embeddings=256)  # fmt: skip
        model = transformers.BartForConditionalGeneration(cfg)
    # no end-of-sequence token: the real generate() runs the whole length (min_new_tokens would add a
    # logits processor, and its copies of the scores, that a run without it does not have)
    model.generation_config.eos_token_id = None
    return model.eval()


def _input(kind):
    if kind == "whisper":
        return torch.randn(4, 80, 32)
    return torch.randint(3, 1000, (4, 16))


def _measured(kind, n):
    """track()'s peak of the real generate(), counted from before the model and its input exist."""
    gc.collect()
    cpu.start()
    base = cpu.allocated()
    model, x = _model(kind), _input(kind)
    with memtorch.track() as t:
        out = model.generate(x, max_new_tokens=n)
        shape = tuple(out.shape)
        del out
    assert t.report.exact
    return t.report.peak - base, shape, model, x


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["whisper", "t5", "bart"])
def test_encoder_decoder_generation_runs_the_decoding_loop(kind):
    _model(kind).generate(_input(kind), max_new_tokens=2)  # generate's lazy imports
    peaks = []
    for n in (4, 16, 48):
        measured, shape, model, x = _measured(kind, n)
        assert shape[1] >= n  # the real run made every token (Whisper drops its start token, T5/BART keep it)
        est = memtorch.estimate(model, x, training=False, max_new_tokens=n, device="cpu")
        assert abs(est.peak - measured) <= 0.001 * measured, (n, est.peak, measured)
        peaks.append(est.peak)
        del model, x, est
    # by hand: the decoder's self-attention cache, 2 layers x (k, v) x 4 sequences x 64 float32 a token, is
    # alive at the end; 44 tokens more of it at least
    assert peaks[0] < peaks[1] < peaks[2]
    assert peaks[2] - peaks[0] >= 2 * 2 * 4 * 64 * 4 * (48 - 4)


def test_whisper_decodes_n_tokens_on_fakes():
    """The decoder runs once per new token (the prefill makes the first), the encoder once."""
    model, x = _model("whisper"), _input("whisper")
    calls = []
    handles = [model.model.encoder.register_forward_pre_hook(lambda m, a: calls.append("encoder")),
               model.model.decoder.register_forward_pre_hook(lambda m, a: calls.append("decoder"))]  # fmt: skip
    try:
        memtorch.estimate(model, x, training=False, max_new_tokens=5, device="cpu")
    finally:
        for h in handles:
            h.remove()
    assert calls == ["encoder"] + ["decoder"] * 5


def test_generate_keywords_are_the_real_calls():
    """generate()'s own keywords ride in the mapping of inputs: min_new_tokens adds its logits processor
    (a masked copy of the scores each step), in the estimate as in the real call. Measured in a fresh
    interpreter: a first generate() of a length leaves 40 KiB cached in the process (the estimate models that
    first call), so a worker that already generated that length measures less."""
    import json
    import pathlib
    import subprocess
    import sys

    code = (
        "import gc, json, sys\n"
        f"sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})\n"
        "import memtorch\nfrom memtorch import cpu\nimport test_estimate_generate as T\n"
        "model = T._model('whisper'); model.generation_config.eos_token_id = 2; x = T._input('whisper')\n"
        "model.generate(x, max_new_tokens=2, min_new_tokens=2); del model\n"  # generate's lazy imports
        "gc.collect(); cpu.start(); base = cpu.allocated()\n"
        "model, x = T._model('whisper'), T._input('whisper'); model.generation_config.eos_token_id = 2\n"
        "with memtorch.track() as t:\n"
        "    out = model.generate(x, max_new_tokens=8, min_new_tokens=8); del out\n"
        "est = memtorch.estimate(model, {'input_features': x, 'min_new_tokens': 8}, training=False, "
        "max_new_tokens=8, device='cpu')\n"
        "plain = memtorch.estimate(model, x, training=False, max_new_tokens=8, device='cpu')\n"
        "print(json.dumps([t.report.peak - base, est.peak, plain.peak]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    measured, est, plain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(est - measured) <= 0.001 * measured, (est, measured)
    assert plain < est  # without the processor's copies


def test_generate_rows_read_as_tracks():
    # issue 37 item 7: an estimate of generate() and track() of the real call print the same module rows:
    # the calls per module (one forward per new token) and "left alive" per forward, not summed over them;
    # an eval Dropout is its input itself (at::dropout's short cut), not a copy the fake's decomposition made
    import transformers

    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, 128, (2, 8))
    est = memtorch.estimate(model, ids, training=False, max_new_tokens=8, device="cpu")
    with memtorch.track(model) as t:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    real = {r.name: (r.calls, r.activation_bytes) for r in t.report.modules}
    mine = {r.name: (r.calls, r.activation_bytes) for r in est.modules}
    assert real["transformer.drop"] == mine["transformer.drop"] == (8, 0)
    for name in ("", "transformer", "transformer.wte", "transformer.h.0.mlp.c_fc", "lm_head"):
        assert mine[name] == real[name], name
    # the same words: what the forwards make (the KV cache, each token's scratch) is "activation" in both
    kinds = t.report.at_peak.by_kind()
    assert est.breakdown["temporary"] < 64 and kinds.get("temporary", 0) == 0
    assert abs(est.breakdown["activation"] - kinds["activation"]) <= 0.03 * kinds["activation"]
