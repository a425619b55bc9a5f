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
from memtorch.estimation import _make_optimizer, default_loss


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
