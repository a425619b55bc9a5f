"""estimate(device="cuda", world_size=N, sharding=...): per-rank figures through the caching allocator's model,
checked by hand counts. No GPU needed.
"""

import pytest
import torch
from torch import nn

import memtorch


def _block(n):
    """The caching allocator's rounding of one request: 512 B blocks."""
    return -(-n // 512) * 512


def _rnn(kind):
    torch.manual_seed(0)
    return getattr(nn, kind)(64, 64, num_layers=2)


# nn.LSTM(64, 64, num_layers=2): per layer weight_ih (256, 64), weight_hh (256, 64), bias_ih (256), bias_hh (256):
# 2 * (16,384 + 16,384 + 256 + 256) = 66,560 fp32 elements, 266,240 B. nn.GRU: 3 gates, 192 rows: 2 * (12,288 +
# 12,288 + 192 + 192) = 49,920 elements, 199,680 B. On CUDA the parameters are views of one flat buffer (cuDNN's,
# nn.RNNBase.flatten_parameters) and their gradients views of one flat dw (_cudnn_rnn_backward): one storage each,
# that every rank holds once.
RNN = {"LSTM": (4, 266_240), "GRU": (3, 199_680)}


def _fsdp_shard_bytes(gates, n):
    """FSDP2's per-rank padded shards of the RNN's 8 parameters, each its own block: ceil(rows / n) rows."""
    rows = -(-gates * 64 // n)
    return 2 * (2 * _block(rows * 64 * 4) + 2 * _block(rows * 4))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_flat_rnn_weights_are_one_storage_per_rank(kind, n):
    gates, whole = RNN[kind]
    model = _rnn(kind)
    assert sum(p.numel() * 4 for p in model.parameters()) == whole
    x = torch.empty(16, 8, 64, device="meta")
    for sharding in ("ddp", "zero1"):
        est = memtorch.estimate(model, x, device="cuda", world_size=n, sharding=sharding)
        for r in est.per_rank:
            # the whole model once, and DDP's buckets one copy of the gradients (whole is a multiple of 512)
            assert (r["parameter"], r["gradient"], r["communication_buckets"]) == (whole, whole, whole), sharding
    for sharding in ("zero2", "zero3"):
        est = memtorch.estimate(model, x, device="cuda", world_size=n, sharding=sharding)
        shard = _fsdp_shard_bytes(gates, n)
        rows = -(-gates * 64 // n)
        # the reduce-scatter's output: 1/n of the padded flat gradients, one block
        grads = _block(2 * (2 * rows * 64 + 2 * rows) * n * 4 // n)
        # AdamW's exp_avg and exp_avg_sq of each parameter's own rows (the chunk, unpadded), each its own block
        state = 0
        for rank in range(n):
            own = max(0, min(rows, gates * 64 - rank * rows))
            state = max(state, 2 * 2 * (2 * _block(own * 64 * 4) + 2 * _block(own * 4)))
        for r in est.per_rank:
            assert r["parameter"] == shard, sharding
            assert r["gradient"] == grads, sharding
        assert max(r["optimizer_state"] for r in est.per_rank) == state
        # the one unit (the root): every parameter's padded rows, gathered
        assert [u["gathered_bytes"] for u in est.fsdp_units] == [4 * 2 * (2 * rows * 64 + 2 * rows) * n]


def test_flat_rnn_figures_by_hand_at_four_ranks():
    # The figures of issue 36's row, counted once more with the numbers written out (LSTM, 4 ranks):
    # ddp: parameters 266,240 B on every rank (one flat buffer), not 8 x 266,240 = 2,129,920.
    # zero2: 64 rows a rank: weights 64 x 64 x 4 = 16,384 B, biases 64 x 4 = 256 B -> a 512 B block:
    # 2 x (2 x 16,384 + 2 x 512) = 67,584 B of parameters; gradients 66,560 x 4 / 4 = 66,560 B;
    # AdamW's two moments of the same rows: 2 x 67,584 = 135,168 B.
    x = torch.empty(16, 8, 64, device="meta")
    ddp = memtorch.estimate(_rnn("LSTM"), x, device="cuda", world_size=4, sharding="ddp")
    assert ddp.per_rank[0]["parameter"] == 266_240
    # and DDP's buckets on top of the one-process step: its peak plus one copy of the gradients
    one = memtorch.estimate(_rnn("LSTM"), x, device="cuda")
    assert ddp.peak == one.peak + 266_240
    # zero1 (ZeroRedundancyOptimizer: largest first, to the emptiest rank): each rank one 256 x 64 weight and one
    # bias, AdamW's two moments of each: 2 x (65,536 + 1,024) = 133,120 B
    z1 = memtorch.estimate(_rnn("LSTM"), x, device="cuda", world_size=4, sharding="zero1")
    assert [r["optimizer_state"] for r in z1.per_rank] == [133_120] * 4
    z2 = memtorch.estimate(_rnn("LSTM"), x, device="cuda", world_size=4, sharding="zero2")
    r = z2.per_rank[0]
    assert (r["parameter"], r["gradient"], r["optimizer_state"]) == (67_584, 66_560, 135_168)


def test_plan_passes_the_rnn_rank_figures_on():
    model = _rnn("LSTM")
    x = torch.empty(16, 8, 64, device="meta")
    p = memtorch.plan(model, x, device_memory="1 GiB", world_sizes=[4], precisions=["fp32"], checkpointing=[None],
                      device="cuda", reserve=0)  # fmt: skip
    assert {o.sharding for o in p.options} >= {"ddp", "zero2"}
    for o in p.options:
        est = memtorch.estimate(model, x, device="cuda", world_size=4, sharding=o.sharding)
        assert o.rank_peaks == tuple(r["peak"] for r in est.per_rank), o.sharding


# ---------------------------------------------------------------------------
# The breakdown sums to the peak


def test_an_unsplit_block_is_its_own_line_by_hand():
    from memtorch.estimator.allocator import CachingAllocator

    MiB = 1 << 20
    alloc = CachingAllocator()
    # 3 MiB: a large request under 10 MiB takes a 20 MiB segment, split (17 MiB left, over 1 MiB)
    alloc.malloc("a", 3 * MiB)
    alloc.free("a")
    alloc.malloc("b", 3 * MiB)
    # 16.5 MiB fits the 17 MiB free block; 0.5 MiB left is not over 1 MiB: the block is handed out whole
    alloc.malloc("c", 33 * MiB // 2)
    assert alloc.allocated == 20 * MiB
    assert alloc.unsplit == {"c": MiB // 2}
    assert 3 * MiB + 33 * MiB // 2 + alloc.unsplit["c"] == alloc.allocated


def _encoder(d=64, heads=4, ff=256, layers=2):
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ff, batch_first=True), layers)


def _lstm():
    torch.manual_seed(0)
    return nn.LSTM(64, 64, num_layers=2)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


SUMS = [
    # a bf16 TransformerEncoder at batch 32 x 256 whose peak holds a 1 MiB unsplit remainder
    ("encoder", _encoder, (32, 256, 64), "bf16-mixed"),
    ("encoder-fp32", lambda: _encoder(96, 4, 384), (32, 256, 96), "fp32"),
    ("lstm", _lstm, (16, 8, 64), "fp32"),
    ("mlp", _mlp, (64, 256), "bf16-mixed"),
]


@pytest.mark.parametrize("name, make, shape, precision", SUMS, ids=[s[0] for s in SUMS])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_breakdown_sums_to_the_peak(name, make, shape, precision, device):
    x = torch.empty(*shape, device="meta")
    est = memtorch.estimate(make(), x, device=device, precision=precision)
    assert sum(est.breakdown.values()) == est.peak
    if device == "cuda" and name == "encoder":
        assert est.breakdown["allocator_rounding"] == 1 << 20  # the case this checks: the remainder is there
        text = str(est)
        assert "allocator rounding" in text
    if device == "cpu":
        assert "allocator_rounding" not in est.breakdown  # PyTorch's CPU allocator rounds nothing
    for sharding in ("ddp", "zero2"):
        ranks = memtorch.estimate(make(), x, device=device, precision=precision, world_size=2, sharding=sharding)
        assert sum(ranks.breakdown.values()) == ranks.peak, sharding
        for r in ranks.per_rank:
            assert sum(r["breakdown"].values()) == r["peak"], (sharding, r["rank"])


def test_printed_shares_sum_to_a_hundred():
    est = memtorch.estimate(_encoder(), torch.empty(32, 256, 64, device="meta"), device="cuda",
                            precision="bf16-mixed")  # fmt: skip
    text = str(est).split("at the peak:")[1].split("\n\n")[0]
    shares = [float(line.rsplit(None, 1)[1].rstrip("%")) for line in text.splitlines()[3:] if line.endswith("%")]
    assert abs(sum(shares) - 100) <= 0.05 * len(shares)  # each printed to 0.1%


# ---------------------------------------------------------------------------
# zero1-even: DeepSpeed's one flat fp32 partition per parameter group


def _small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))  # 2,048 + 64 + 512 + 8 = 2,632 elements


@pytest.mark.parametrize("world", [3, 4, 5])
def test_zero1_even_state_is_one_flat_partition_per_group(world):
    # DeepSpeed (stage_1_and_2.py) pads the group's 2,632 elements to a multiple of 2 * world and gives each rank
    # single_partition_of_fp32_groups[0]: one fp32 tensor of 2 * ceil(2632 / 2w) elements; the optimizer steps
    # that one tensor, so exp_avg and exp_avg_sq are one tensor each of the partition, each one block of the
    # caching allocator (Adam's step count stays in host memory on CUDA). Per-parameter slices, each rounded
    # to 512 B, would hold more: at 4 ranks 2,048 + 512 + 512 + 512 B a moment instead of one 3,072 B block.
    partition = 2 * -(-2632 // (2 * world))
    fp32 = memtorch.estimate(_small_mlp(), (4, 32), device="cuda", world_size=world, sharding="zero1-even")
    zero = memtorch.estimate(_small_mlp(), (4, 32), device="cuda", precision="mixed-zero", world_size=world,
                             sharding="zero1-even")  # fmt: skip
    for r in fp32.per_rank:
        assert r["optimizer_state"] == 2 * _block(4 * partition)
    for r in zero.per_rank:  # and the fp32 master weights of the partition, one more flat tensor
        assert r["optimizer_state"] == 3 * _block(4 * partition)
    if world == 4:
        assert fp32.per_rank[0]["optimizer_state"] == 2 * 3072 < 2 * (2048 + 3 * 512)


def test_zero1_even_flat_per_group_with_two_groups():
    # two parameter groups (weights; biases): each its own flat partition, padded on its own.
    # weights 2,048 + 512 = 2,560 elements, 4 ranks: 640 each (2,560 B, one 2,560 B block);
    # biases 64 + 8 = 72 elements, padded to 72 (a multiple of 8): 18 each (72 B, a 512 B block).
    model = _small_mlp()
    ws = [p for n, p in model.named_parameters() if n.endswith("weight")]
    bs = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": ws}, {"params": bs, "weight_decay": 0.0}])
    est = memtorch.estimate(model, (4, 32), optimizer=opt, device="cuda", world_size=4, sharding="zero1-even")
    for r in est.per_rank:
        assert r["optimizer_state"] == 2 * (_block(4 * 640) + _block(4 * 18)) == 2 * (2560 + 512)


def test_zero1_even_state_is_a_quarter_of_the_whole_at_four_ranks():
    # issue 36: BERT on cuda, 4 ranks, the largest rank's optimizer state was 0.275-0.281 of the whole (every
    # parameter's slice rounded); one flat partition per group is a quarter of the elements, in one block per
    # moment, so at most a quarter of the whole (whose per-parameter tensors are rounded each) plus one block.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=1000)  # fmt: skip
    model = transformers.BertForMaskedLM(config)
    n = sum(p.numel() for p in model.parameters())
    x = ((2, 32), torch.long)
    whole = memtorch.estimate(model, x, device="cuda").model_states["optimizer_state"]
    est = memtorch.estimate(model, x, device="cuda", world_size=4, sharding="zero1-even")
    partition = 2 * -(-n // 8)
    for r in est.per_rank:
        assert r["optimizer_state"] == 2 * _block(4 * partition)
        assert r["optimizer_state"] <= whole / 4 + 1024


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_fsdp_rnn_forward_copies_the_weights_for_cudnn(kind, monkeypatch):
    # Under FSDP2 each unsharded parameter is its own tensor (copied out of the all-gather), so cuDNN's
    # try_get_weight_buf finds no flat buffer and _cudnn_rnn copies the weights into one of its own
    # (num_weights elements: the model's 266,240 B for the LSTM, 199,680 B for the GRU, one block), saved for
    # backward beside the reserve. The rank's peak (in forward) holds it; DDP's ranks read the flat parameters in
    # place and hold none.
    from memtorch.estimator import kernels as _estimate_kernels

    _gates, whole = RNN[kind]
    x = torch.empty(16, 8, 64, device="meta")

    def peaks():
        return {s: memtorch.estimate(_rnn(kind), x, device="cuda", world_size=4, sharding=s).peak
                for s in ("ddp", "zero2", "zero3")}  # fmt: skip

    with_copy = peaks()
    monkeypatch.setattr(_estimate_kernels, "_cudnn_rnn_after", lambda state: lambda *a: None)
    without = peaks()
    assert with_copy["ddp"] == without["ddp"]
    assert with_copy["zero2"] - without["zero2"] == whole == _block(whole)
    assert with_copy["zero3"] - without["zero3"] == whole


def test_flat_rnn_weights_have_no_one_original(monkeypatch):
    # The probes read a fake storage's real values from the original tensor it stands for
    # (_estimate_kernels.originals, by storage). cuDNN's flat buffer is one storage that all 8 parameters view:
    # no one parameter is its original (taking the last, a 256-element bias, made a 256 x 64 weight's view run
    # out of bounds), so none is recorded for it; the CPU's parameters, each its own storage, each are.
    from memtorch.estimator import kernels as _estimate_kernels

    class Recording(dict):
        def __init__(self):
            super().__init__()
            self.set = []

        def __setitem__(self, k, v):
            self.set.append(v)
            super().__setitem__(k, v)

    x = torch.empty(16, 8, 64, device="meta")
    for device, expected in (("cuda", 0), ("cpu", 8)):
        rec = Recording()
        monkeypatch.setattr(_estimate_kernels, "originals", rec)
        memtorch.estimate(_rnn("LSTM"), x, device=device)
        assert len(rec.set) == expected, device
