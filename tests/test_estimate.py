"""memtorch.estimate(): figures against independent measurements and hand-derived formulas.

Expected figures come from memtorch.track()/memtorch.inspect() on real steps of the
same model (independent of the dry run), from numel * element size by hand, or
from the CUDA caching allocator's documented rules worked out by hand.
"""

import gc

import pytest
import torch
from torch import nn

import memtorch
from memtorch import cpu
from memtorch.errors import BudgetExceeded, MemtorchError
from memtorch.estimation import OPTIMIZERS, _make_optimizer, checkpointing, default_loss

OPTIMIZER_NAMES = ["sgd", "sgd-momentum", "adam", "adamw", "amsgrad", "adagrad", "rmsprop"]


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def real_steps(model, x, optimizer, loss_fn=None, steps=2):
    """Two real steps as estimate() runs them, inside track(); returns (report, optimizer)."""
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    opt = _make_optimizer(optimizer, params, "cpu")
    loss_fn = loss_fn or default_loss
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(steps):
            out = model(x)
            loss = loss_fn(out, x)
            del out
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return t.report, opt


def measured_peak(make_model, make_input, optimizer):
    """track()'s peak of two real steps, counting from before the model is built."""
    cpu.start()
    gc.collect()
    base = cpu.allocated()
    model, x = make_model(), make_input()
    report, opt = real_steps(model, x, optimizer)
    assert report.exact
    return report.peak - base, model, x, opt


# ---------------------------------------------------------------- model states


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_model_states_to_the_byte(name):
    model = small_mlp()
    x = torch.randn(4, 32)
    _report, opt = real_steps(model, x, name)
    default_loss(model(x)).backward()  # gradients present for inspect
    real = memtorch.inspect(model, optimizer=opt).by_category
    opt.zero_grad(set_to_none=True)
    est = memtorch.estimate(model, x, optimizer=name)
    for cat in ("parameter", "gradient", "optimizer_state"):
        assert est.model_states[cat] == real.get(cat, 0), cat


def test_model_states_by_hand():
    model = small_mlp()
    n = sum(p.numel() for p in model.parameters())  # 32*64+64 + 64*8+8 = 2632
    assert n == 2632
    est = memtorch.estimate(model, (4, 32), optimizer="adam")
    assert est.model_states["parameter"] == 4 * n
    assert est.model_states["gradient"] == 4 * n
    # exp_avg and exp_avg_sq per parameter, plus a float32 step scalar per parameter tensor
    assert est.model_states["optimizer_state"] == 8 * n + 4 * 4
    amsgrad = memtorch.estimate(model, (4, 32), optimizer="amsgrad")
    assert amsgrad.model_states["optimizer_state"] == 12 * n + 4 * 4
    sgd = memtorch.estimate(model, (4, 32), optimizer="sgd")
    assert sgd.model_states["optimizer_state"] == 0
    mom = memtorch.estimate(model, (4, 32), optimizer="sgd-momentum")
    assert mom.model_states["optimizer_state"] == 4 * n


# ---------------------------------------------------------------- peak vs track()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_peak_matches_track_mlp(optimizer):
    measured, model, x, _opt = measured_peak(small_mlp, lambda: torch.randn(16, 32), optimizer)
    est = memtorch.estimate(model, x, optimizer=optimizer)
    assert est.peak == measured


def test_peak_matches_track_lstm():
    # nn.LSTM runs oneDNN's kernel on the CPU, whose workspace the fake kernel does not show
    def make():
        torch.manual_seed(0)
        return nn.LSTM(16, 32, 2, batch_first=True)

    measured, model, x, _opt = measured_peak(make, lambda: torch.randn(4, 10, 16), "adam")
    est = memtorch.estimate(model, x, optimizer="adam")
    assert abs(est.peak - measured) <= 0.03 * measured


def test_peak_matches_track_attention():
    def make():
        torch.manual_seed(0)
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 1)

    measured, model, x, _opt = measured_peak(make, lambda: torch.randn(4, 16, 32), "adamw")
    est = memtorch.estimate(model, x, optimizer="adamw")
    assert est.peak == measured


def test_checkpointing_matches_track_and_saves():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 64)
    cpu.start()
    gc.collect()
    base = cpu.allocated()
    model2, x2 = Net(), torch.randn(64, 64)
    with checkpointing(model2, "blocks"):
        report, _ = real_steps(model2, x2, "sgd")
    assert "forward" not in model2.blocks[0].__dict__  # restored
    est = memtorch.estimate(model2, x2, optimizer="sgd", checkpointing="blocks")
    assert est.peak == report.peak - base
    plain = memtorch.estimate(model, x, optimizer="sgd")
    assert est.breakdown["activation"] < plain.breakdown["activation"]


# ---------------------------------------------------------------- no real memory, nothing left behind


def test_real_model_not_copied():
    from memtorch._estimate_kernels import PROBE_CAP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 3072), nn.Linear(3072, 8))  # a 48 MiB weight
    before = [(p, p.detach().clone()) for p in model.parameters()]
    cpu.start()
    with cpu.Scope() as s:
        est = memtorch.estimate(model, (8, 4096), optimizer="adam")
    # real memory: only the kernel probes' zero-filled tensors (at most PROBE_CAP at a time),
    # never a copy of the 48 MiB weight, its gradient or its optimizer state
    assert s.peak - s.start <= PROBE_CAP < 48 << 20
    assert est.model_states["parameter"] == 4 * (4096 * 3072 + 3072 + 3072 * 8 + 8)
    for (p, copy), q in zip(before, model.parameters()):
        assert p is q and torch.equal(p, copy) and p.grad is None


def test_meta_model():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    est = memtorch.estimate(model, (2, 4096), optimizer="sgd")
    n = 4096 * 4096 + 4096 + 4096 * 10 + 10
    assert est.model_states["parameter"] == 4 * n
    assert all(p.device.type == "meta" for p in model.parameters())


def _state_is_clean(model, forwards):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    assert torch.is_grad_enabled()
    assert torch.get_default_device() == torch.device("cpu")
    assert not torch.is_autocast_enabled("cpu")
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert not m._forward_hooks and not m._forward_pre_hooks
    for m, f in zip(model.modules(), forwards):
        assert m.forward.__func__ is f
    for p in model.parameters():
        assert type(p) is nn.Parameter and p.grad is None


# ---------------------------------------------------------------- bad input


class ItemModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y * y.sum().item()


class BranchModel(ItemModel):
    def forward(self, x):
        y = self.lin(x)
        return y if y.sum() > 0 else -y


class NonzeroModel(ItemModel):
    def forward(self, x):
        y = self.lin(x)
        return y[y > 0]


@pytest.mark.parametrize(
    "model_cls, match",
    [(ItemModel, "item"), (BranchModel, "item|bool"), (NonzeroModel, "depends on tensor values|fake")],
)
def test_data_dependent_model(model_cls, match):
    model = model_cls()
    forwards = [type(m).forward for m in model.modules()]
    with pytest.raises(MemtorchError, match=match):
        memtorch.estimate(model, (4, 8), precision="bf16-mixed", checkpointing=None)
    _state_is_clean(model, forwards)


def test_input_rejected_by_model():
    model = small_mlp()
    forwards = [type(m).forward for m in model.modules()]
    with pytest.raises(MemtorchError, match="failed on fake tensors.*same reduction dim"):
        memtorch.estimate(model, (4, 31))
    _state_is_clean(model, forwards)


def test_error_inside_checkpointed_block_restores():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), ItemModel()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model = Net()
    forwards = [type(m).forward for m in model.modules()]
    with pytest.raises(MemtorchError, match="item"):
        memtorch.estimate(model, (2, 8), checkpointing="blocks")
    _state_is_clean(model, forwards)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"optimizer": "adamm"}, "unknown optimizer 'adamm'"),
        ({"optimizer": 3}, "optimizer must be a name"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"sharding": "zero4"}, "unknown sharding 'zero4'"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"world_size": 2.0}, "world_size must be a positive int"),
        ({"world_size": 3, "sharding": "zero3"}, "world_size 3 does not divide the 2632"),
        ({"checkpointing": "everything"}, "checkpointing must be None, 'blocks'"),
        ({"checkpointing": ["nope"]}, "no module named 'nope'"),
        ({"checkpointing": "blocks"}, "found no nn.ModuleList"),
        ({"loss_fn": 3}, "loss_fn must be callable"),
        ({"loss_fn": lambda out, x: out}, "one-element tensor"),
        ({"optimizer": lambda params: 3}, "not a torch.optim.Optimizer"),
    ],
)
def test_bad_arguments(kwargs, match):
    model = small_mlp()
    forwards = [type(m).forward for m in model.modules()]
    with pytest.raises(MemtorchError, match=match):
        memtorch.estimate(model, (4, 32), **kwargs)
    _state_is_clean(model, forwards)


def test_bad_inputs():
    with pytest.raises(MemtorchError, match="needs a torch.nn.Module"):
        memtorch.estimate("model", (4, 32))
    with pytest.raises(MemtorchError, match="needs example inputs"):
        memtorch.estimate(small_mlp())
    with pytest.raises(MemtorchError, match="input 0 is a str"):
        memtorch.estimate(small_mlp(), "x")
    frozen = small_mlp().requires_grad_(False)
    with pytest.raises(MemtorchError, match="no parameter that requires grad"):
        memtorch.estimate(frozen, (4, 32))


# ---------------------------------------------------------------- precision and sharding, by hand


def test_precisions_by_hand():
    model = small_mlp()
    n = 2632
    steps = 4 * 4  # four float32 step scalars (Adam)
    true16 = memtorch.estimate(model, (4, 32), optimizer="adam", precision="bf16-true")
    assert true16.model_states["parameter"] == 2 * n
    assert true16.model_states["gradient"] == 2 * n
    assert true16.model_states["optimizer_state"] == 4 * n + steps
    mixed = memtorch.estimate(model, (4, 32), optimizer="adam", precision="bf16-mixed")
    assert mixed.model_states["parameter"] == 4 * n and mixed.model_states["gradient"] == 4 * n
    zero = memtorch.estimate(model, (4, 32), optimizer="adam", precision="mixed-zero")
    # ZeRO's K = 12: fp32 master weights, exp_avg, exp_avg_sq
    assert zero.model_states["parameter"] == 2 * n
    assert zero.model_states["gradient"] == 2 * n
    assert zero.model_states["optimizer_state"] == 12 * n + steps


@pytest.mark.parametrize("sharding", ["ddp", "zero1", "zero2", "zero3"])
def test_sharding_zero_paper_formulas(sharding):
    model = small_mlp()
    psi, nd, steps = 2632, 4, 16
    one = memtorch.estimate(model, (4, 32), optimizer="adam", precision="mixed-zero")
    est = memtorch.estimate(model, (4, 32), optimizer="adam", precision="mixed-zero", world_size=nd, sharding=sharding)
    k = 12 * psi + steps
    expected = {
        "ddp": (2 * psi, 2 * psi, k, 2 * psi),  # DDP keeps gradient buckets as large as the gradients
        "zero1": (2 * psi, 2 * psi, k // nd, 0),
        "zero2": (2 * psi, 2 * psi // nd, k // nd, 0),
        "zero3": (2 * psi // nd, 2 * psi // nd, k // nd, 0),
    }[sharding]
    r = est.per_rank
    assert (r["parameter"], r["gradient"], r["optimizer_state"], r["communication_buckets"]) == expected
    states_one = 2 * psi + 2 * psi + k
    states_rank = sum(expected[:3])
    # zero3: the whole model is one unit here (no nn.ModuleList): gathered and prefetched, 16-bit
    assert r["gathered_parameters"] == (2 * 2 * psi if sharding == "zero3" else 0)
    assert est.peak <= one.peak - (states_one - states_rank) + expected[3] + 2 * psi + r["gathered_parameters"]
    assert est.world_size == nd and est.sharding == sharding


# ---------------------------------------------------------------- CUDA allocator rules, by hand


def test_cuda_rounding_and_segments():
    from memtorch._estimate_cuda import CachingAllocator, round_size, segment_size

    assert [round_size(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    MiB = 1 << 20
    assert segment_size(512) == 2 * MiB and segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB
    a = CachingAllocator()
    a.malloc(1, 100)  # small pool: one 2 MiB segment, a 512-byte block
    a.malloc(2, 1000)  # same segment, 1024 bytes
    assert (a.allocated, a.reserved) == (1536, 2 * MiB)
    a.malloc(3, 3 * MiB)  # large pool: a 20 MiB segment, split (17 MiB > 1 MiB remain)
    assert (a.allocated, a.reserved) == (1536 + 3 * MiB, 22 * MiB)
    a.free(3)
    a.malloc(4, 19 * MiB + 512)  # fits the merged 20 MiB block; 511.5 KiB remain: not split
    assert (a.allocated, a.reserved) == (1536 + 20 * MiB, 22 * MiB)
    a.free(1)
    a.malloc(5, 512)  # reuses the freed small block
    assert a.reserved == 22 * MiB
    a.malloc(6, 12 * MiB + 1)  # no free block: a segment of 12 MiB + 512 rounded to 2 MiB = 14 MiB
    assert a.reserved == 36 * MiB


def test_cuda_estimate_rounds_each_allocation():
    model = nn.Linear(10, 10)  # weight 400 B, bias 40 B: 512 B blocks on CUDA
    cpu_est = memtorch.estimate(model, (3, 10), optimizer="sgd")
    cuda_est = memtorch.estimate(model, (3, 10), optimizer="sgd", device="cuda")
    assert cpu_est.model_states["parameter"] == 440
    assert cuda_est.model_states["parameter"] == 2 * 512
    assert cuda_est.reserved_peak == 2 << 20  # everything fits one small segment
    assert "CUDA context" in str(cuda_est)


# ---------------------------------------------------------------- the report


def test_report_fields_and_budget():
    est = memtorch.estimate(small_mlp(), torch.randn(4, 32), optimizer="adamw")
    d = est.to_dict()
    for key in ("peak", "delta", "steady", "breakdown", "phases", "modules", "model_states"):
        assert key in d
    assert set(d["phases"]) == {"forward", "backward", "optimizer"}
    assert set(est.breakdown) >= {"parameter", "gradient", "optimizer_state", "activation", "temporary"}
    assert sum(est.breakdown.values()) == est.peak
    assert est.steady == est.model_states["parameter"] + est.model_states["optimizer_state"] + 4 * 4 * 32
    text = str(est)
    assert "peak" in text and "optimizer_state" in text and "estimated, not measured" in text
    assert "<table>" in est._repr_html_()
    est.check(peak=est.peak)
    with pytest.raises(BudgetExceeded, match="peak .* exceeds budget"):
        est.check(peak=est.peak - 1)


def test_shape_inputs_and_dtype_pairs():
    emb = nn.Embedding(100, 16)
    est = memtorch.estimate(emb, ((4, 7), torch.long), optimizer="sgd")
    assert est.breakdown["input"] == 4 * 7 * 8 or est.model_states["parameter"] == 100 * 16 * 4


def test_scalar_wrapping_measured():
    # A Python number where a kernel takes a Tensor: 8 bytes wrapped, cast to the result dtype.
    from memtorch._estimate_kernels import scalar_extra

    cpu.start()
    t = torch.randn(10)
    with cpu.Scope() as s:
        t.add_(1)
    assert s.peak - s.start == scalar_extra(torch.ops.aten.add_.Tensor, (t, 1), t) == 12


# ---------------------------------------------------------------- pytest


def test_pytest_fixture_estimate_budget(pytester):
    pytester.makepyfile(
        """
        import torch
        from torch import nn

        def model():
            return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

        def test_fits(memtorch_estimate):
            est = memtorch_estimate(model(), (4, 32), optimizer="sgd", device="cuda", peak="64 MiB")
            assert est.device == "cuda"

        def test_too_big(memtorch_estimate):
            memtorch_estimate(model(), (4, 32), optimizer="adam", peak="1 KiB")
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*peak * exceeds budget 1.0 KiB by *"])


@torch.library.custom_op("memtorch_test::double_it", mutates_args=())
def _double_it(x: torch.Tensor) -> torch.Tensor:  # a CPU kernel and no fake kernel
    return x * 2


class CustomOpModel(ItemModel):
    def forward(self, x):
        return _double_it(self.lin(x))


def test_custom_op_without_fake_kernel():
    model = CustomOpModel()
    forwards = [type(m).forward for m in model.modules()]
    with pytest.raises(MemtorchError, match="cannot run on fake tensors.*fake kernel"):
        memtorch.estimate(model, (4, 8))
    _state_is_clean(model, forwards)
