"""memtorch.plan: the sharding arithmetic against formulas worked by hand, ordering, bad input."""

import pytest

from memtorch import planning as mplan
from memtorch.errors import MemtorchError, UnitError
from memtorch.estimator.plan import Breakdown, per_rank, plan_from, zero_model_states

GB = 10**9
MIB = 2**20


# ---------------------------------------------------------------------------
# The ZeRO paper's own example (Rajbhandari et al. 2020, figure 1): a 7.5B-parameter
# model on 64 devices with mixed-precision Adam (K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.


@pytest.mark.parametrize(
    "sharding, expected_gb, by_hand",
    [
        ("ddp", 120, (2 + 2 + 12) * 7.5),  # baseline: 16 bytes per parameter
        ("zero1", 31.4, 4 * 7.5 + 12 * 7.5 / 64),  # P_os
        ("zero2", 16.6, 2 * 7.5 + 14 * 7.5 / 64),  # P_os+g
        ("zero3", 1.88, 16 * 7.5 / 64),  # P_os+g+p
    ],
)
def test_zero_paper_model_states(sharding, expected_gb, by_hand):
    got = zero_model_states(7_500_000_000, 64, sharding) / GB
    assert got == pytest.approx(by_hand)
    assert round(got, 1 if expected_gb > 2 else 2) == expected_gb


# ---------------------------------------------------------------------------
# per_rank on a breakdown written by hand: P = 1000 B (250 fp32 elements: two
# parameters of 150 and 100), G = 1000 B, O = 2000 B (AdamW: two states); the
# one-process peak 5000 B holds all of them plus 1000 B of activations; the
# largest block holds 400 B.

B = Breakdown(
    peak=5000, parameter=1000, gradient=1000, optimizer_state=2000, gradient_at_peak=1000,
    optimizer_state_at_peak=2000, numel=250, largest_block=400, param_numels=(150, 100),
)  # fmt: skip


def test_per_rank_by_hand():
    # ddp: + a second copy of the gradients (buckets)
    assert per_rank(B, 2, "ddp")["peak"] == 5000 + 1000
    assert per_rank(B, 1, "ddp")["peak"] == 5000  # one rank: no wrapper, no buckets
    # zero1-even on 2 ranks: optimizer state 2000 -> 1000
    assert per_rank(B, 2, "zero1-even")["peak"] == 5000 - 2000 + 1000
    # zero1 (torch's ZeroRedundancyOptimizer) on 2 ranks: rank 0 gets the 150-element parameter (60% of
    # the state, 1200), rank 1 the 100 (800); DDP's buckets (1000) on both
    z1 = per_rank(B, 2, "zero1")
    assert z1["rank_peaks"] == [5000 - 2000 + 1200 + 1000, 5000 - 2000 + 800 + 1000]
    assert z1["peak"] == 5200 and z1["peak_rank"] == 0 and z1["optimizer_state"] == 1200
    assert z1["buckets"] == 1000
    # with 600 B of step scratch at the peak (for the 150-element parameter, rank 0's) and a
    # forward/backward peak of 4000: rank 1's step scratch is 600 * 100 / 150 = 400, and its step
    # (5000 - 2000 + 800 - 600 + 400 = 3600) is above its backward (4000 - 2000 + 800 = 2800)
    z1s = per_rank(B._replace(step_scratch_at_peak=600, peak_outside_step=4000), 2, "zero1")
    assert z1s["rank_peaks"] == [4200 + 1000, 3600 + 1000]
    # 3 ranks: the third holds nothing: at the step's moment it keeps the peak without any optimizer
    # state (5000 - 2000 = 3000), above its forward/backward peak without state (4000 - 2000)
    z13 = per_rank(B._replace(peak_outside_step=4000), 3, "zero1")
    assert z13["rank_peaks"] == [4200 + 1000, 3800 + 1000, 3000 + 1000]
    # zero2 on 2 ranks: and gradients 1000 -> 500
    assert per_rank(B, 2, "zero2")["peak"] == 5000 - 2000 + 1000 - 1000 + 500
    # zero3 on 2 ranks: and parameters 1000 -> 500, plus 2 blocks gathered: 2 * (400 - 200)
    z3 = per_rank(B, 2, "zero3")
    assert z3["parameter"] == 500 and z3["gathered"] == 400
    assert z3["peak"] == (5000 - 2000 + 1000 - 1000 + 500) - 1000 + 500 + 400
    # zero3 on 5 ranks: 250 elements split in 50s, 200 B per 1000 B; block 400 -> 80 of its own
    assert per_rank(B, 5, "zero3")["peak"] == 5000 - 2000 + 400 - 1000 + 200 - 1000 + 200 + 2 * (400 - 80)


def test_fsdp_plan_with_step_scratch_and_forward_backward_peak_by_hand():
    # B with 600 B of optimizer-step scratch at the peak and a forward/backward peak of 4000, 2 ranks
    b = B._replace(step_scratch_at_peak=600, peak_outside_step=4000)
    # zero2: the step's moment: 5000 - 2000 + 1000 (state) - 1000 + 500 (gradients) - 600 + 300 (scratch on
    # a shard) = 3200; forward/backward: 4000 - 2000 + 1000 (state) + 500 (the shards beside the gathered
    # parameters) = 3500, the higher
    assert per_rank(b, 2, "zero2")["peak"] == 3500
    # zero3: the step's moment 3200 - 1000 + 500 (parameters) + 2 * (400 - 200) = 3100; forward/backward
    # 4000 - 2000 + 1000 - 1000 + 500 + 2 * 400 (two blocks gathered) = 3300
    assert per_rank(b, 2, "zero3")["peak"] == 3300


def test_uneven_split_pads_or_refuses():
    # 250 elements over 3 ranks: 84 per rank (padded, as FSDP and DeepSpeed do) = 336 B of 1000
    assert per_rank(B, 3, "zero1-even")["optimizer_state"] == 84 * 8
    with pytest.raises(
        MemtorchError, match="world_size 3 does not divide the 250 trainable parameter elements"
    ):
        per_rank(B, 3, "zero1-even", pad=False)
    assert per_rank(B, 3, "ddp", pad=False)["peak"] == 6000  # ddp splits nothing
    assert per_rank(B, 3, "zero1", pad=False)["peak"] == 5200  # whole parameters: nothing to divide


def test_zero1_needs_the_parameters_sizes():
    bare = B._replace(param_numels=None)
    with pytest.raises(MemtorchError, match="zero1.*needs param_numels.*'zero1-even' splits the elements evenly"):
        per_rank(bare, 2, "zero1")
    with pytest.raises(MemtorchError, match="needs each Breakdown's param_numels"):
        plan_from({("fp32", None, 8): bare})
    assert plan_from({("fp32", None, 8): bare}, shardings=["ddp", "zero1-even"]).options


@pytest.mark.parametrize("bad", ["zero4", "fsdp", None, "ZeRO1"])
def test_unknown_sharding_names_the_value(bad):
    with pytest.raises(
        MemtorchError, match=f"unknown sharding {bad!r}: expected one of ddp, zero1, zero1-even, zero2, zero3"
    ):
        per_rank(B, 2, bad)
    with pytest.raises(MemtorchError, match="unknown sharding"):
        plan_from({("fp32", None, 8): B}, shardings=["ddp", bad])


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "8"])
def test_bad_world_size_names_the_value(bad):
    with pytest.raises(MemtorchError, match=f"world_size must be a positive int, got {bad!r}"):
        per_rank(B, bad, "ddp")


# ---------------------------------------------------------------------------
# plan_from: which fit, cheapest first


def test_plan_from_orders_cheapest_first_and_reports_the_margin():
    # device 4000 B: one rank needs 5000 (no); 2 ranks: ddp 6000, zero1 5200, zero1-even 4000 (fits,
    # margin 0)
    p = plan_from({("fp32", None, 8): B}, device_memory=4000, world_sizes=[1, 2, 4])
    assert p.best.world_size == 2 and p.best.sharding == "zero1-even"
    assert p.best.peak == 4000 and p.best.margin == 0
    assert [(o.world_size, o.sharding) for o in p.options][:6] == [
        (1, "ddp"), (2, "ddp"), (2, "zero1"), (2, "zero1-even"), (2, "zero2"), (2, "zero3"),
    ]  # fmt: skip
    assert not p.options[0].fits and p.options[0].margin == -1000
    text = str(p)
    assert "fit in 3.9 KiB per device" in text and "zero1-even" in text
    assert p.to_dict()["best"]["sharding"] == "zero1-even"


def test_checkpointing_and_micro_batch_order():
    small = B._replace(peak=4000)  # e.g. with checkpointing: 1000 B fewer activations
    p = plan_from(
        {("fp32", None, 8): B, ("fp32", "blocks", 8): small, ("fp32", None, 4): small},
        device_memory=4000, world_sizes=[1], global_batch=64,
    )  # fmt: skip
    # one rank: without checkpointing first, at the largest micro-batch (8), which does not fit
    assert [(o.checkpointing, o.micro_batch, o.accumulation, o.fits) for o in p.options] == [
        (None, 8, 8, False), (None, 4, 16, True), ("blocks", 8, 8, True),
    ]  # fmt: skip
    assert p.best.micro_batch == 4


def test_reserve_is_kept_free():
    # on 2 ranks (test_per_rank_by_hand): ddp 6000, zero1 5200, zero1-even 4000, zero2 3500, zero3 3400
    assert plan_from({("fp32", None, 8): B}, device_memory=8000, world_sizes=[2]).best.sharding == "ddp"
    p = plan_from({("fp32", None, 8): B}, device_memory=8000, reserve=4500, world_sizes=[2])
    assert p.best.sharding == "zero2" and p.best.margin == 0  # 8000 - 4500 = 3500 left


def test_world_size_not_dividing_the_global_batch_names_the_value():
    with pytest.raises(MemtorchError, match="world_size 6 does not divide global_batch 64"):
        plan_from({("fp32", None, 8): B}, world_sizes=[2, 6], global_batch=64)
    # by default only the world sizes that divide it are tried
    p = plan_from({("fp32", None, 8): B}, max_world_size=4096, global_batch=96)
    assert sorted({o.world_size for o in p.options}) == [1, 2, 4]  # 8 * 8 = 64 does not divide 96
    assert any("skipped" in n for n in p.notes)


@pytest.mark.slow  # 20,476 options: about 35 s here
def test_thousands_of_world_sizes_are_arithmetic():
    p = plan_from({("fp32", None, 1): B}, world_sizes=list(range(1, 4097)), device_memory=2000)
    assert len(p.options) == 1 + 4095 * 5
    # zero3 on n ranks: 5000 - 2000 - 1000 - 1000 + 16 c + 2 (400 - ceil(400 / n)), c = ceil(250 / n)
    # elements per shard (8 B of state, 4 of gradient, 4 of parameter each): n = 16 gives
    # 1000 + 256 + 2 * 375 = 2006 > 2000; n = 17 gives 1000 + 240 + 2 * 376 = 1992, the first that fits
    assert p.best.world_size == 17 and p.best.sharding == "zero3"
    assert p.best.peak == 1992 and p.best.margin == 8
    assert per_rank(B, 16, "zero3")["peak"] == 2006


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device_memory": "80 GiBs"}, UnitError, "80 GiBs"),
        ({"global_batch": 0}, MemtorchError, "global_batch must be a positive int, got 0"),
        ({"world_sizes": []}, MemtorchError, "world_sizes is empty"),
        ({"world_sizes": [0]}, MemtorchError, "world_size must be a positive int, got 0"),
    ],
)
def test_bad_plan_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_from({("fp32", None, 8): B}, **kwargs)


# ---------------------------------------------------------------------------
# With memtorch.estimate(): the dry runs behind plan()


def test_plan_with_estimate():
    import torch

    import memtorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)
    )  # 9,352 elements
    x = torch.randn(16, 64)
    est = memtorch.estimate(model, x, optimizer="adamw", device="cpu")
    b = mplan.breakdown_of(est, model)
    assert b.numel == 64 * 128 + 128 + 128 * 8 + 8
    assert b.parameter == 4 * b.numel  # fp32
    assert b.largest_block == 4 * (64 * 128 + 128)  # the first Linear
    p = memtorch.plan(model, x, device_memory="1 GiB", world_sizes=[1, 2], precisions=["fp32"],
                      checkpointing=[None], device="cpu", reserve=0)  # fmt: skip
    one = [o for o in p.options if o.world_size == 1][0]
    assert one.peak == est.peak  # one rank: the dry run itself
    z1 = [o for o in p.options if o.world_size == 2 and o.sharding == "zero1"][0]
    z1_est = memtorch.estimate(model, x, optimizer="adamw", device="cpu", world_size=2, sharding="zero1")
    assert z1.peak == z1_est.peak  # plan's figure is estimate()'s for the same configuration
    assert z1.rank_peaks == tuple(r["peak"] for r in z1_est.per_rank)
    assert p.best == one and p.dry_runs == 1


def test_plan_needs_inputs_and_a_module():
    import torch

    import memtorch

    with pytest.raises(MemtorchError, match="needs example inputs"):
        memtorch.plan(torch.nn.Linear(4, 4))
    with pytest.raises(MemtorchError, match="needs a torch.nn.Module, got str"):
        memtorch.plan("model", torch.randn(2, 4))
    with pytest.raises(MemtorchError, match="unknown sharding 'zero9'"):
        memtorch.plan(torch.nn.Linear(4, 4), torch.randn(2, 4), shardings=["zero9"])
    with pytest.raises(MemtorchError, match="micro_batches must be positive ints, got 0"):
        memtorch.plan(torch.nn.Linear(4, 4), torch.randn(2, 4), micro_batches=[0])


def test_plan_of_a_model_without_blocks_leaves_checkpointing_out():
    # the default checkpointing=(None, "blocks") needs an nn.ModuleList; a plain Sequential has none
    import torch

    import memtorch

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    p = memtorch.plan(model, torch.randn(8, 64), device_memory="1 GiB", max_world_size=4)
    assert "checkpointing='blocks' left out" in str(p)
    assert all(not o.checkpointing for o in p.options)


# ---------------------------------------------------------------------------
# One engine: plan()'s figures are estimate()'s, on Hugging Face models built on meta


def _tiny_llama(layers=2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _tiny_gpt2(layers=2):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=64)
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg)


def test_largest_fsdp_unit_is_a_decoder_layer_at_any_depth():
    # LlamaForCausalLM's blocks are model.model.layers.N, two levels down. By hand (hidden 64, intermediate
    # 128, 4 heads of 16, 2 key/value heads): q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down
    # 128x64, two RMSNorm weights of 64: 36,992 fp32 elements. The root keeps the embedding and the output
    # layer (2 x 256 x 64) and the final norm (64): 32,832 elements, fewer.
    pytest.importorskip("transformers")
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert layer == 36992
    assert mplan._largest_block(_tiny_llama()) == 4 * layer
    # GPT2LMHeadModel: transformer.h.N; a block: ln_1, c_attn 64x192 + 192, c_proj 64x64 + 64, ln_2,
    # c_fc 64x256 + 256, c_proj 256x64 + 64; the layer norms 2 x (64 + 64)
    block = 2 * 128 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    assert mplan._largest_block(_tiny_gpt2()) == 4 * block


def test_plan_takes_the_input_specs_estimate_takes():
    import torch

    import memtorch

    pytest.importorskip("transformers")
    model = _tiny_llama(layers=1)
    p = memtorch.plan(model, ((1, 16), torch.long), world_sizes=[1], shardings=["ddp"], precisions=["fp32"],
                      checkpointing=[None], device="cpu", reserve=0, device_memory="1 GiB")  # fmt: skip
    est = memtorch.estimate(model, ((1, 16), torch.long), device="cpu")
    assert [(o.micro_batch, o.peak) for o in p.options] == [(1, est.peak)]


def test_plan_takes_gpu_and_loss_fn_as_estimate_does():
    import torch
    from torch import nn

    import memtorch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    kw = dict(world_sizes=[1], shardings=["ddp"], precisions=["fp32"], checkpointing=[None], reserve=0)
    # the GPU modelled: cuBLAS's workspace is not the same on compute capability 8.0 and 9.0
    peaks = {}
    for gpu in ("a100", "h100"):
        (o,) = memtorch.plan(model, (32, 64), device="cuda", gpu=gpu, device_memory="80 GiB", **kw).options
        est = memtorch.estimate(model, (32, 64), device="cuda", gpu=gpu)
        assert (o.peak, o.reserved) == (est.peak, est.reserved_peak)
        peaks[gpu] = est.peak
    assert peaks["a100"] != peaks["h100"]

    # a loss whose temporary, 32 x 8 x 4096 float32 = 4 MiB, makes the step's peak
    def loss_fn(out, x):
        return (out.unsqueeze(-1) * torch.ones(1, 1, 4096)).sum()

    (o,) = memtorch.plan(model, (32, 64), device="cpu", loss_fn=loss_fn, **kw).options
    est = memtorch.estimate(model, (32, 64), device="cpu", loss_fn=loss_fn)
    plain = memtorch.estimate(model, (32, 64), device="cpu")
    assert o.peak == est.peak and est.peak > 32 * 8 * 4096 * 4 > plain.peak


def test_plan_for_a_gpu_by_name_judges_against_its_memory():
    # one answer per question: plan(gpu="l4") judged against 80 GiB (its default device_memory), so a step
    # whose reserved figure is 30 GiB "fit" an L4 while fit(gpu="l4") said it did not; now the GPU's nominal
    # memory, as fit() takes it, with the same note, the rows those of device_memory="24 GiB"
    import torch
    from torch import nn

    import memtorch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    kw = {"world_sizes": [1], "shardings": ["ddp"], "precisions": ["fp32"], "checkpointing": [None], "device": "cuda"}
    named = memtorch.plan(model, (32, 64), gpu="l4", **kw)
    sized = memtorch.plan(model, (32, 64), gpu="l4", device_memory="24 GiB", **kw)
    assert named.device_memory == sized.device_memory == 24 << 30
    assert [(o.peak, o.reserved, o.fits) for o in named.options] == [(o.peak, o.reserved, o.fits) for o in sized.options]
    assert "note: device memory: the L4 24GB's nominal memory" in str(named)
    assert not any(n.startswith("device memory") for n in sized.notes)  # given: nothing to say
    assert memtorch.plan(model, (32, 64), **kw).device_memory == 80 << 30  # no GPU named: the default
    with pytest.raises(MemtorchError, match="no memory size known for gpu='a100'.*pass device_memory="):
        memtorch.plan(model, (32, 64), gpu="a100", **kw)  # boards of 40 and 80 GB


def test_plan_of_a_bfloat16_model_says_as_given_not_fp32():
    # precision "fp32" casts nothing: for a bfloat16 model its rows are the weights as given, and the table
    # said "fp32" (a fine-tuner read: train in float32); now "as given" with a note, the JSON's value kept
    import json

    import torch
    from torch import nn

    import memtorch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(torch.bfloat16)
    x = torch.ones(32, 64, dtype=torch.bfloat16)
    kw = {"world_sizes": [1], "shardings": ["ddp"], "checkpointing": [None], "device": "cpu"}
    p = memtorch.plan(model, x, precisions=["fp32", "bf16-mixed"], **kw)
    text = str(p)
    assert p.weights == "bfloat16" and " as given " in text and " fp32 " not in text
    assert "note: precision 'as given': the parameters in their own dtypes (bfloat16), no autocast" in text
    assert {o["precision"] for o in json.loads(json.dumps(p.to_dict()))["options"]} == {"fp32", "bf16-mixed"}
    plain = memtorch.plan(model.float(), x.float(), precisions=["fp32"], **kw)  # all float32: fp32 it is
    assert plain.weights is None and " fp32 " in str(plain) and "as given" not in str(plain)


def _same_as_estimate(model, p, spec, device):
    import memtorch

    for o in p.options:
        sharding = o.sharding if o.world_size > 1 else None
        est = memtorch.estimate(model, spec(o.micro_batch), precision=o.precision, device=device,
                                checkpointing=o.checkpointing, world_size=o.world_size, sharding=sharding)  # fmt: skip
        assert (o.peak, o.reserved) == (est.peak, est.reserved_peak), o
        if est.per_rank:
            assert o.rank_peaks == tuple(r["peak"] for r in est.per_rank), o


def test_plan_figure_is_estimates_for_each_configuration():
    import torch

    import memtorch

    pytest.importorskip("transformers")
    model = _tiny_llama(layers=1)
    p = memtorch.plan(model, ((2, 8), torch.long), world_sizes=[3], shardings=["zero1-even", "zero3"],
                      precisions=["fp32"], checkpointing=[None], device="cpu", reserve=0)  # fmt: skip
    assert len(p.options) == 2
    _same_as_estimate(model, p, lambda mb: ((mb, 8), torch.long), "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gpt2])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_plan_figures_are_estimates_over_a_grid(make, device):
    import torch

    import memtorch

    pytest.importorskip("transformers")
    model = make()
    p = memtorch.plan(model, ((2, 16), torch.long), world_sizes=[1, 3, 8], precisions=["fp32", "bf16-mixed"],
                      micro_batches=[1, 2], device=device, reserve=0)  # fmt: skip
    # 2 precisions x 2 checkpointings x 2 micro-batches: 1 rank (ddp) + 2 world sizes x 5 shardings
    assert len(p.options) == 8 * (1 + 2 * 5)
    _same_as_estimate(model, p, lambda mb: ((mb, 16), torch.long), device)


def test_the_table_lists_what_does_not_fit_with_how_far_over():
    import torch

    import memtorch
    from memtorch import units

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    p = memtorch.plan(model, torch.randn(16, 64), world_sizes=[1, 2], shardings=["ddp", "zero3"],
                      precisions=["fp32"], checkpointing=[None], device="cpu", reserve=0,
                      device_memory=240 * 1024)  # fmt: skip
    fits = [o for o in p.options if o.fits]
    over = [o for o in p.options if not o.fits]
    assert fits and over  # the 1- and 2-rank ddp rows hold the whole model: over 240 KiB
    text = str(p)
    for o in over:
        judged = o.peak_upper  # the CPU figure judged (gloo's scratch freed late)
        assert o.margin == 240 * 1024 - judged < 0
        assert f"no, over by {units.format(judged - 240 * 1024)}" in text
    assert text.index("no, over by") > text.index(" yes")  # those that fit first


def test_on_cuda_a_combination_fits_by_its_reserved_figure():
    import torch

    import memtorch

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    kw = dict(world_sizes=[2], shardings=["zero3"], precisions=["fp32"], checkpointing=[None], device="cuda",
              reserve=0)  # fmt: skip
    o = memtorch.plan(model, torch.randn(16, 256), **kw).options[0]
    assert o.peak < o.reserved  # segments hold more than the blocks handed out
    between = memtorch.plan(model, torch.randn(16, 256), device_memory=(o.peak + o.reserved) // 2, **kw)
    assert not between.options[0].fits and between.options[0].margin == (o.peak + o.reserved) // 2 - o.reserved


def test_default_grid_stops_each_combination_at_the_first_world_size_that_fits():
    import torch

    import memtorch

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    x = torch.randn(16, 256)
    kw = dict(precisions=["fp32"], checkpointing=[None], device="cpu", reserve=0, max_world_size=16)
    whole = memtorch.plan(model, x, device_memory="1 GiB", exhaustive=True, **kw).options
    one = [o for o in whole if o.world_size == 1]
    assert len(one) == 1 and one[0].sharding is None  # one process: nothing to shard, no wrapper
    # a budget that the single process misses but sharded ranks meet
    budget = one[0].peak - 1
    full = memtorch.plan(model, x, device_memory=budget, exhaustive=True, **kw)
    short = memtorch.plan(model, x, device_memory=budget, **kw)
    by = {(o.world_size, o.sharding): o for o in full.options}
    for o in short.options:  # every row computed is the exhaustive plan's, to the byte
        assert o == by[(o.world_size, o.sharding)]
    for s in ("ddp", "zero1", "zero1-even", "zero2", "zero3"):
        mine = sorted(o.world_size for o in short.options if o.sharding == s)
        first_fit = next((o.world_size for o in sorted(full.options, key=lambda o: o.world_size)
                          if o.sharding == s and o.fits), None)  # fmt: skip
        assert mine == [2, 4, 8, 16][: len(mine)], s  # from the smallest world size up
        if first_fit is not None:
            assert mine[-1] == first_fit, s  # up to the first that fits, no further
    computed = {(o.world_size, o.sharding) for o in short.options}
    for o in full.options:  # a row left out fits only where a smaller world size of its sharding fits already
        if (o.world_size, o.sharding) not in computed and o.fits:
            assert any(p.fits and p.sharding == o.sharding and p.world_size < o.world_size for p in short.options)
    hidden = len(full.options) - len(short.options)
    assert hidden > 0 and short.hidden == hidden
    assert "larger world size(s) not computed" in str(short)
    assert short.best == full.best


def test_the_table_shows_one_device_first_and_names_it():
    import torch

    import memtorch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    p = memtorch.plan(model, torch.randn(16, 64), world_sizes=[1, 2], shardings=["ddp", "zero3"],
                      precisions=["fp32"], checkpointing=[None], device="cuda", reserve=0,
                      device_memory="1 MiB")  # fmt: skip
    rows = [line for line in str(p).splitlines() if "GPU" in line and "over by" in line]
    assert rows[0].startswith("1 GPU ") and rows[1].startswith("2 GPUs ")  # none fit: one GPU still first
    assert "none of 3 combination(s) fit" in str(p) and "on more, none fit" in str(p)
    assert len(p.to_text(limit=1).splitlines()) < len(p.to_text(limit=None).splitlines())
    assert "more row(s): `memtorch plan ... --all` shows every row" in p.to_text(limit=1)


def test_shardings_none_alone_is_one_device_unwrapped(capsys):
    # the CLI's --shardings none: one process, the row every plan has at world size 1
    import torch

    import memtorch

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    p = memtorch.plan(model, (8, 32), device="cpu", device_memory="1 GiB", shardings=[None], precisions=["fp32"])
    assert [(o.world_size, o.sharding) for o in p.options] == [(1, None)]
    one = memtorch.estimate(model, (8, 32), device="cpu")
    assert p.options[0].peak == one.peak
    with pytest.raises(MemtorchError, match="unknown sharding 'zero9'"):
        memtorch.plan(model, (8, 32), device="cpu", shardings=[None, "zero9"])
