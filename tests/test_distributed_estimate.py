"""estimate()'s per-rank figures: DeepSpeed's padded even split, per-rank reserved figures, gloo's late
scratch held against the real runs of benchmarks/bench_distributed.py."""

import json
import os

import pytest
import torch
from torch import nn

import memtorch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))  # 2,632 elements


@pytest.mark.parametrize("world, partition", [(3, 878), (5, 528), (4, 658), (6, 440)])
def test_zero1_even_pads_each_group_as_deepspeed_does(world, partition):
    # DeepSpeed stage 1/2 (stage_1_and_2.py): a group's 2,632 elements padded to a multiple of 2 * world
    # (nccl_start_alignment_factor 2), then cut into `world` equal partitions: 2 * ceil(2632 / 2w) elements
    # on every rank (3 ranks: 2 * 439 = 878; 5: 2 * 264 = 528; 4: 658 exactly; 6: 2 * 220 = 440).
    # mixed-zero Adam keeps fp32 master weights, exp_avg and exp_avg_sq of the partition: K = 12 bytes an
    # element; DeepSpeed's optimizer steps one flat partition per group, so one step count (4 bytes).
    assert partition == 2 * -(-2632 // (2 * world))
    est = memtorch.estimate(small_mlp(), (4, 32), optimizer="adam", precision="mixed-zero", world_size=world,
                            sharding="zero1-even", device="cpu")  # fmt: skip
    assert len(est.per_rank) == world
    for r in est.per_rank:
        assert r["optimizer_state"] == 12 * partition + 4
        assert (r["parameter"], r["gradient"]) == (2 * 2632, 2 * 2632)


def test_even_partition_by_hand():
    from memtorch.estimator.ranks import even_partition

    # two groups: 10 + 7 elements and 5; 4 ranks pad to multiples of 8: 24 -> 6 each, 8 -> 2 each
    sizes, parts = even_partition([[0, 1], [2]], [10, 7, 5], 4)
    assert sizes == [6, 2]
    assert parts == {0: 10 * 6 // 17, 1: 6 - 10 * 6 // 17, 2: 2}


def test_reserved_figures_are_each_ranks_own():
    # Before, every sharded estimate printed one process's reserved figure beside a rank's peak. A rank
    # holding 1/8 of the model reserves less than the whole process, and at least its own blocks.
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 8))
    x = torch.empty(16, 1024, device="meta")
    one = memtorch.estimate(model, x, device="cuda")
    est = memtorch.estimate(model, x, device="cuda", world_size=8, sharding="zero3")
    assert est.reserved_peak == max(r["reserved_peak"] for r in est.per_rank)
    assert est.peak <= est.reserved_peak < one.reserved_peak
    for r in est.per_rank:
        assert r["peak"] <= r["reserved_peak"] and r["reserved_peak"] % (2 * 2**20) == 0  # whole segments
    assert "reserved" in str(est).split("per rank (zero3")[1]
    cpu = memtorch.estimate(model, x, world_size=2, sharding="zero3", device="cpu")
    assert cpu.reserved_peak is None and all(r["reserved_peak"] is None for r in cpu.per_rank)


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_distributed", os.path.join(ROOT, "benchmarks",
                                                                                     "bench_distributed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(ROOT, "benchmarks", "bench_distributed.json")) as fh:
        return mod, json.load(fh)


@pytest.mark.parametrize("way, world", [("zero2", 2), ("zero3", 4)])
def test_gloo_late_scratch_bounds_the_real_runs(way, world):
    # The two configurations whose real gloo runs (bench_distributed.json, two runs each) peaked differently
    # on rank 0: one run with every scratch freed on time, one with a scratch freed late. Both lie within
    # [peak, peak_upper] of every rank; on time (the lower run) is the peak itself, within 0.1%.
    bench, raw = _bench()
    d = next(d for d in raw if (d["model"], d["way"], d["world"]) == ("mlp", way, world))
    model, inputs = bench.make_model("mlp")
    est = memtorch.estimate(model, *inputs, optimizer="adamw", world_size=world, sharding=way, device="cpu",
                            fsdp_units=[n for n, _ in bench.shard_units(model)])  # fmt: skip
    assert est.peak_upper == max(r["peak_upper"] for r in est.per_rank)
    late = 0
    for measured in d["ranks"]:
        r = est.per_rank[measured["rank"]]
        assert abs(r["peak"] - measured["peak_low"]) <= 0.001 * measured["peak_low"]
        assert r["peak"] * 0.999 <= measured["peak"] <= r["peak_upper"]
        late += measured["peak"] > measured["peak_low"]
    assert late == 1  # rank 0's late run
