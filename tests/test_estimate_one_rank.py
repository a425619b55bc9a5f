"""An estimate with world_size=N gives one rank's figures everywhere (model_states, breakdown, phases, the JSON),
and the whole model's under names that say so (model_states_total)."""

import pytest
from torch import nn

import memtorch

N = 64 * 256 + 256 + 256 * 64 + 64  # the MLP's elements: each of its four parameters splits evenly on 4 and 8 ranks


def _mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


@pytest.mark.parametrize("sharding,n", [("zero3", 8), ("zero2", 4), ("ddp", 4), ("zero1", 4)])
def test_model_states_are_one_ranks(sharding, n):
    whole = memtorch.estimate(_mlp(), (8, 64), world_size=1, device="cpu")
    est = memtorch.estimate(_mlp(), (8, 64), world_size=n, sharding=sharding, device="cpu")
    top = est.per_rank[est.peak_rank]
    states = est.model_states
    assert (states["parameter"], states["gradient"], states["optimizer_state"]) == (
        top["parameter"], top["gradient"], top["optimizer_state"])  # fmt: skip
    steps = 4 * 4  # AdamW's float32 step count, one per parameter, on every rank that steps it
    if sharding in ("zero2", "zero3"):
        # by hand: FSDP keeps 1/n of each parameter, its gradient and its two AdamW moments
        assert states["parameter"] == states["gradient"] == 4 * N // n
        assert states["optimizer_state"] == 2 * 4 * N // n + steps
    elif sharding == "ddp":
        assert states["parameter"] == states["gradient"] == 4 * N
        assert states["optimizer_state"] == 2 * 4 * N + steps
    else:  # zero1: whole parameters per rank, the highest rank's state below the whole model's
        assert states["optimizer_state"] < 2 * 4 * N + steps
    # the whole model's, unsharded: the one-process estimate's, to the byte
    assert est.model_states_total == whole.model_states == whole.model_states_total
    assert whole.model_states_total["optimizer_state"] == 2 * 4 * N + steps
    d = est.to_dict()
    assert d["model_states"] == states and d["model_states_total"] == whole.model_states
    assert d["breakdown"] == {k: v for k, v in est.breakdown.items()} and sum(est.breakdown.values()) == est.peak
    assert est.peak == top["peak"] and est.steady == top["steady"]
    text = str(est)
    assert f"at the peak, rank {est.peak_rank}:" in text and "model states, whole" in text
    assert memtorch.units.format(sum(whole.model_states.values())) in text
