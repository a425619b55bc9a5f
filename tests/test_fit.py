"""memtorch.fit(): the largest batch / sequence length / number of new tokens whose estimated step fits.

Held against a brute-force search by estimate() (every value in a range), against real steps tracked on
the CPU (the answer stays within the device, one more exceeds it), and against estimate() at the answer
and the value above it on cuda (the caching allocator's model) and for generation."""

import gc

import pytest
import torch
from torch import nn

import memtorch
from memtorch import cpu
from memtorch.errors import MemtorchError
from memtorch.estimator.estimate import _make_optimizer, default_loss


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _judged(est):
    return est.reserved_peak if est.device == "cuda" else est.peak


def test_fit_equals_a_brute_force_search_by_estimate():
    model = mlp()
    # the budget between the estimates at batch 40 and 41 (CPU: the peak is judged)
    at = {b: memtorch.estimate(model, (b, 32), device="cpu").peak for b in range(1, 61)}
    assert all(at[b] < at[b + 1] for b in range(1, 60))  # the peak rises with every sample here
    budget = (at[40] + at[41]) // 2
    brute = max(b for b in at if at[b] <= budget)
    assert brute == 40
    f = memtorch.fit(model, (8, 32), device_memory=budget, reserve=0, device="cpu")
    assert (f.value, f.next_value) == (40, 41)
    assert f.figures["peak"] == at[40] and f.next_figures["peak"] == at[41]
    assert f.figures["judged"] <= budget < f.next_figures["judged"]
    assert [v for v, _ in f.tried][:2] == [8, 16]  # the inputs' batch and twice it
    assert all(j == at[v] for v, j in f.tried if v in at)


def _real_peak(batch):
    """track()'s peak of two real CPU steps of mlp() at ``batch``, counted from before the model is built
    (estimate()'s peak counts the model and inputs too)."""
    cpu.start()
    gc.collect()
    base = cpu.allocated()
    model, x = mlp(), torch.randn(batch, 32)
    opt = _make_optimizer("adamw", list(model.parameters()), "cpu")
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(2):
            out = model(x)
            loss = default_loss(out, x)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = None
    assert t.report.exact
    return t.report.peak - base


def test_a_real_step_at_the_answer_fits_and_one_more_does_not():
    budget = 300 * 1024
    f = memtorch.fit(mlp(), (8, 32), device_memory=budget, reserve=0, device="cpu")
    assert 1 < f.value and f.next_value == f.value + 1
    assert _real_peak(f.value) <= budget < _real_peak(f.value + 1)


def test_cuda_is_judged_on_the_reserved_figure_and_agrees_with_estimate():
    model = mlp()
    kw = dict(device="cuda", gpu="h100", optimizer="adamw")
    f = memtorch.fit(model, (64, 32), device_memory="96 MiB", reserve=0, **kw)
    assert f.judged == "reserved" and f.value >= 1
    here = memtorch.estimate(model, (f.value, 32), **kw)
    above = memtorch.estimate(model, (f.next_value, 32), **kw)
    assert (f.figures["peak"], f.figures["reserved"]) == (here.peak, here.reserved_peak)
    assert here.reserved_peak <= 96 << 20 < above.reserved_peak
    assert f.next_value == f.value + 1


def test_a_gpu_name_gives_its_memory_and_the_reserve_is_kept_free():
    model = mlp()
    f = memtorch.fit(model, (64, 32), gpu="l4", reserve="1 GiB")
    assert f.device_memory == 24 << 30 and f.reserve == 1 << 30
    assert f.figures["judged"] <= (23 << 30) < f.next_figures["judged"]
    assert any("L4 24GB's nominal memory" in n for n in f.notes)
    assert "24.0 GiB per GPU (1.0 GiB kept free)" in str(f)


def test_nothing_fits_says_so():
    f = memtorch.fit(mlp(), (8, 32), device_memory=1024, reserve=0, device="cpu")
    assert f.value == 0 and f.next_value == 1 and f.figures is None and not f.fits
    assert "not even 1" in str(f)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_sequence_length_is_capped_by_the_model_positions():
    model = _tiny_gpt2()
    ids = ((2, 8), torch.long)
    big = memtorch.fit(
        model, {"input_ids": ids, "labels": ids}, vary="seq", device_memory="1 GiB", reserve=0, device="cpu"
    )
    assert big.value == 64 and big.next_value is None  # n_positions: the real model refuses more
    assert any("64 positions" in n for n in big.notes)
    # a budget between the estimates at sequence lengths 20 and 21
    at = {
        L: memtorch.estimate(
            model, {"input_ids": ((2, L), torch.long), "labels": ((2, L), torch.long)}, device="cpu"
        ).peak
        for L in (20, 21)
    }
    f = memtorch.fit(
        model,
        {"input_ids": ids, "labels": ids},
        vary="seq",
        device_memory=(at[20] + at[21]) // 2,
        reserve=0,
        device="cpu",
    )
    assert (f.value, f.figures["peak"], f.next_figures["peak"]) == (20, at[20], at[21])


@pytest.mark.slow
def test_new_tokens_of_generation():
    model = _tiny_gpt2()
    prompt = ((2, 4), torch.long)
    at = {
        n: memtorch.estimate(model, prompt, training=False, max_new_tokens=n, device="cpu").peak
        for n in (27, 28)
    }
    assert at[27] < at[28]  # past the prompt's forward, the KV cache makes the peak
    f = memtorch.fit(
        model,
        prompt,
        vary="max_new_tokens",
        max_new_tokens=16,
        device_memory=(at[27] + at[28]) // 2,
        reserve=0,
        device="cpu",
        max_value=60,
    )
    assert (f.value, f.figures["peak"], f.next_figures["peak"]) == (27, at[27], at[28])
    assert f.config["training"] is False


def _figures(peaks, judged=None):
    """Figures of one value whose estimate's phases peak at ``peaks`` ({phase: bytes})."""
    from memtorch.estimator.engine import Figures

    peak = max(peaks.values())
    judged = peak if judged is None else judged
    return Figures(peak, None, peak, (peak,), (peak,), judged, None, None, dict(peaks))


def test_each_phase_has_its_own_line():
    from memtorch.estimator.fit import _line_guess

    # the optimizer's phase is the peak at 1 and 2 (it rises 10 a sample), the backward's rises 100 a sample
    # from below it: the line of the step's peak would say 91 for 1900, the backward's line meets it at 19
    done = {
        1: _figures({"backward": 100, "optimizer": 1000}),
        2: _figures({"backward": 200, "optimizer": 1010}),
    }
    assert _line_guess(done, (1, 2), 1900) == 19
    assert _line_guess(done, (1, 2), 1100) == 11
    assert _line_guess(done, (1, 2), 1000) == 1  # the optimizer's 1000 at batch 1 fits exactly
    assert _line_guess(done, (1, 2), 999) == 0  # below it nothing does
    # a phase that does not rise and is over the budget already: the answer is below the pair
    flat = {1: _figures({"forward": 500, "optimizer": 900}), 2: _figures({"forward": 600, "optimizer": 900})}
    assert _line_guess(flat, (1, 2), 800) == 0


def test_the_judged_excess_over_the_peak_is_scaled_with_it():
    from memtorch.estimator.fit import _line_guess

    # on cuda the reserved figure's excess over the peak grows with the peak (fragmentation, measured 3% to
    # 24% on Llama shapes): the budget is scaled by the peak's share of the judged figure at the nearer value
    done = {10: _figures({"backward": 1000}, judged=1250), 11: _figures({"backward": 1100}, judged=1375)}
    # budget 2500 at 4/5 is a peak of 2000: 10 + (2000 - 1000) / 100
    assert _line_guess(done, (10, 11), 2500) == 20


def test_a_batch_of_1_starts_the_search_at_2():
    model = _tiny_llama()

    def ids(b):
        return {"input_ids": ((b, 32), torch.long), "labels": ((b, 32), torch.long)}

    at = {b: memtorch.estimate(model, ids(b), device="cpu") for b in (1, 2, 8, 9)}
    # at batch 1 and 2 the optimizer's phase is the step's peak; from 2 on the backward's: batch 1's events
    # predict no other value, 2's and 4's every one
    assert at[1].phases["optimizer"].peak == at[1].peak and at[9].phases["backward"].peak == at[9].peak
    f = memtorch.fit(model, ids(1), device_memory=at[8].peak + 1000, reserve=0, device="cpu")
    assert (f.value, f.next_value) == (8, 9) and at[9].peak > at[8].peak + 1000
    # from batch 1 the search took 5 dry runs (1, 2, then the phases' lines); from 2, the prediction's 4
    assert [v for v, _ in f.tried] == [2, 4, 8, 9]
    # where 2 does not fit, 1 is run: the answer is 1 (or nothing)
    f = memtorch.fit(model, ids(1), device_memory=at[1].peak + 8, reserve=0, device="cpu")
    assert (f.value, f.next_value) == (1, 2) and at[2].peak > at[1].peak + 8
    assert [v for v, _ in f.tried] == [2, 1]
    # max_value=1: the cap itself is the start
    f = memtorch.fit(model, ids(1), device_memory=at[8].peak, reserve=0, device="cpu", max_value=1)
    assert f.value == 1 and [v for v, _ in f.tried] == [1]


def test_without_a_prediction_each_phase_gets_its_line(monkeypatch):
    from memtorch.estimator import fit as fit_module

    model = _tiny_llama()

    def ids(b):
        return {"input_ids": ((b, 32), torch.long), "labels": ((b, 32), torch.long)}

    at = {b: memtorch.estimate(model, ids(b), device="cpu") for b in (2, 4, 8, 9)}
    # events that predict nothing (as a batch of 1's against 2's): the phases' lines through 2 and 4 guess
    monkeypatch.setattr(fit_module, "_predictor", lambda *a, **k: None)
    f = memtorch.fit(model, ids(2), device_memory=at[8].peak + 1000, reserve=0, device="cpu")
    assert (f.value, f.next_value) == (8, 9)
    assert [v for v, _ in f.tried] == [2, 4, 8, 9]  # the backward's line through 2 and 4 meets the budget at 8


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(vary="width", device_memory="1 GiB"), "vary='width'"),
        (dict(), "needs device_memory="),
        (dict(gpu="h800"), "no memory size known for gpu='h800'"),
        (dict(device_memory="1 MiB"), "the reserve"),
        (dict(device_memory="2 GiB", max_value=0), "max_value"),
        (dict(device_memory="2 GiB", max_new_tokens=4), "pass training=False"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(MemtorchError, match=match):
        memtorch.fit(mlp(), (8, 32), **kw)


def test_needs_inputs_and_a_module():
    with pytest.raises(MemtorchError, match="needs example inputs"):
        memtorch.fit(mlp(), device_memory="1 GiB")
    with pytest.raises(MemtorchError, match="needs a torch.nn.Module"):
        memtorch.fit("model", (8, 32), device_memory="1 GiB")


def test_cli_fit_prints_the_api_answer(tmp_path, monkeypatch, capsys):
    from memtorch import cli

    (tmp_path / "fitmods.py").write_text(
        "import torch\nfrom torch import nn\n\ndef mlp():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    budget = 300 * 1024
    f = memtorch.fit(mlp(), (8, 32), device_memory=budget, reserve=0, device="cpu")
    assert (
        cli.main(
            [
                "fit",
                "fitmods:mlp",
                "--input",
                "8x32",
                "--device-memory",
                str(budget),
                "--reserve",
                "0",
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"the largest batch that fits in {memtorch.units.format(budget)} per device is {f.value:,}" in out
    assert cli.main(["fit", "fitmods:mlp", "--input", "8x32", "--device", "cpu", "--quiet"]) == 2
    assert "needs --device-memory" in capsys.readouterr().err


class _TableEngine:
    """An engine whose figures come from a table: peak(v) = 100 MiB + v MiB, reserved = peak + excess(v)."""

    device = "cuda"
    defaulted = False

    def __init__(self, excess):
        self.excess = excess

    def figures(self, precision, checkpointing, inputs, **kw):
        from memtorch.estimator.engine import Figures

        v = inputs.batch_size()
        peak = (100 + v) << 20
        reserved = peak + self.excess(v)
        return Figures(peak, reserved, None, (peak,), None, reserved, None, None, {"backward": peak})


def test_a_reserved_figure_that_jumps_past_the_peak_is_said():
    # reserved 2 MiB over the peak up to batch 20, 60 MiB over it from 21 (a segment more), 2 MiB again from
    # 24: 20 fits a 124 MiB budget, 21 does not, and 24 would (not tried)
    def excess(v):
        return (60 << 20) if 21 <= v <= 23 else (2 << 20)

    f = memtorch.fit(mlp(), (8, 32), device_memory=124 << 20, reserve=0, _engine=_TableEngine(excess))
    assert (f.value, f.next_value) == (20, 21)
    assert any("reserved figure rises by 59.0 MiB where the peak rises by 1.0 MiB" in n for n in f.notes), (
        f.notes
    )
    # a reserved figure that follows the peak: no such note
    f = memtorch.fit(
        mlp(), (8, 32), device_memory=124 << 20, reserve=0, _engine=_TableEngine(lambda v: 2 << 20)
    )
    assert (f.value, f.next_value) == (22, 23)
    assert not any("reserved figure rises" in n for n in f.notes), f.notes


def _tiny_llama(layers=2):
    """A small Llama (64 wide, vocabulary 1024), seeded; test_advise and test_estimate build theirs here."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _ids(b, s=128):
    return {"input_ids": ((b, s), torch.long), "labels": ((b, s), torch.long)}


def test_figures_predicted_from_two_dry_runs_are_estimates_at_values_not_run():
    """Two dry runs whose events are the same, each storage's size on its line: the allocator's replay gives
    estimate()'s own peak and reserved figure at values never run, to the byte (cuda: the caching
    allocator's model), and nothing where the two runs' events differ."""
    from memtorch import _inputs
    from memtorch.estimator import fit as fit_mod
    from memtorch.estimator.engine import Engine

    model = _tiny_llama()
    given = _inputs.read((_ids(2),))
    for device, gpu in (("cuda", "l4"), ("cpu", None)):
        eng = Engine(model, given, device=device, gpu=gpu)
        done = {v: eng.figures(inputs=given.with_batch(v)) for v in (2, 4)}
        ledgers = {v: eng.ledger(inputs=given.with_batch(v)) for v in (2, 4)}
        predicted = fit_mod._predictor(ledgers, done, (2, 4), eng.predicted)
        assert predicted is not None
        for v in (3, 9, 17, 30):
            est = memtorch.estimate(model, _ids(v), device=device, gpu=gpu)
            judged = est.reserved_peak if device == "cuda" else est.peak
            assert predicted(v) == (est.peak, judged), (device, v)
    # a checkpointed run's events are not the plain run's: no prediction from the two
    eng = Engine(model, given, device="cpu")
    done = {2: eng.figures(inputs=given.with_batch(2)), 4: eng.figures("fp32", "blocks", given.with_batch(4))}
    ledgers = {
        2: eng.ledger(inputs=given.with_batch(2)),
        4: eng.ledger("fp32", "blocks", given.with_batch(4)),
    }
    assert fit_mod._predictor(ledgers, done, (2, 4), eng.predicted) is None


@pytest.mark.parametrize("sharding", ["ddp", "zero1", "zero3"])
def test_per_rank_figures_predicted_from_two_dry_runs_are_the_engines_at_values_not_run(sharding):
    """With several ranks each prediction replays every rank of the same events with the sizes on their lines:
    the highest rank's peak and reserved figure are the engine's (estimate(world_size=..., sharding=...)'s)."""
    from memtorch import _inputs
    from memtorch.estimator import fit as fit_mod
    from memtorch.estimator.engine import Engine

    model = _tiny_llama()
    given = _inputs.read((_ids(2),))
    eng = Engine(model, given, gpu="l4", units=True)
    kw = dict(world_size=4, sharding=sharding)
    done = {v: eng.figures(inputs=given.with_batch(v), **kw) for v in (2, 4)}
    ledgers = {v: eng.ledger(inputs=given.with_batch(v)) for v in (2, 4)}
    predicted = fit_mod._predictor(ledgers, done, (2, 4), lambda led, sizes: eng.predicted(led, sizes, **kw))
    assert predicted is not None
    for v in (3, 11):
        real = eng.figures(inputs=given.with_batch(v), **kw)
        assert predicted(v) == (real.peak, real.judged), (sharding, v)


@pytest.mark.slow
def test_fit_on_cuda_finds_the_largest_batch_where_the_reserved_figure_falls_back():
    """On cuda the caching allocator's segments make the reserved figure fall back at some batches: the
    answer is the largest batch that fits (a brute-force search by estimate()), the smaller ones that do not
    fit are named, and four dry runs find it."""
    model = _tiny_llama()
    at = {}
    for b in range(1, 41):
        est = memtorch.estimate(model, _ids(b), gpu="l4")
        at[b] = (est.peak, est.reserved_peak)
    falls = [b for b in range(2, 41) if at[b][1] < at[b - 1][1]]
    assert falls, "no batch here whose reserved figure falls below the one before"
    budget = at[falls[0]][1]  # that batch fits, the one before it does not
    assert at[falls[0] - 1][1] > budget
    can = [b for b in at if at[b][0] <= budget]  # above these even the peak is over the budget
    assert max(can) < 40
    fitting = [b for b in can if at[b][1] <= budget]
    brute = max(fitting)
    holes = [b for b in range(1, brute) if at[b][1] > budget]
    f = memtorch.fit(model, _ids(2), device_memory=budget, reserve=0, gpu="l4")
    assert (f.value, f.next_value) == (brute, brute + 1)
    assert f.figures["judged"] == at[brute][1] and f.next_figures["judged"] == at[brute + 1][1]
    assert len(f.tried) == 4
    from memtorch.estimator.fit import _ranges

    assert any(f"batch={_ranges(holes)} predicted over the budget" in n for n in f.notes), (holes, f.notes)
    assert any(f"no batch above {brute} is predicted to fit: to {max(can)}" in n for n in f.notes), f.notes
