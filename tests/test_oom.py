"""The out-of-memory post-mortem (memtorch.oom): a real failing allocation on the CPU inside a block (the bytes
held when it failed checked against the tensors' own nbytes, the phase and module running), the switch for code
with no block (an excepthook), and the CUDA logic on the caching allocator's snapshot of a real H200 step."""

import gzip
import json
import pathlib
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import memtorch
from memtorch import oom

DATA = pathlib.Path(__file__).parent / "data" / "h200"
ASK = 2**50  # float32 elements: 4 PiB, which no allocator gives


class Huge(nn.Module):
    def forward(self, x):
        return x.new_empty(ASK)


class HugeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g.new_empty(ASK)[: g.numel()].view_as(g)


class GradBomb(nn.Module):
    def forward(self, x):
        return HugeGrad.apply(x)


def _model(last):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Sequential(nn.Linear(256, 256), last))


def _nbytes(ts):
    return sum(t.untyped_storage().nbytes() for t in ts)


@pytest.fixture
def counting():
    memtorch.cpu.start()  # every allocation counted, the parameters' too
    yield
    memtorch.cpu.stop()


def test_a_failing_allocation_in_the_forward_leaves_a_report_of_who_held_what(counting, capsys):
    model = _model(Huge())
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    model[0](x).sum().backward()  # gradients and AdamW state of the first Linear only
    opt.step()
    with pytest.raises(RuntimeError, match="can't allocate memory") as err:
        with memtorch.track(model, optimizer=opt):
            model(x)
    r = err.value.memtorch_report
    assert isinstance(r, memtorch.OomReport) and r.device == "cpu" and r.exact
    assert r.requested == ASK * 4
    assert (r.phase, r.module) == ("forward", "2.1 (Huge)")
    # by hand, from the tensors themselves: the parameters, the gradients and state of the first Linear,
    # the input, and the activations backward would need: ReLU's output (saved by ReLU and by 2.0) and 2.0's
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    steps = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and not v.dim()]
    acts = 2 * 32 * 256 * 4
    expected = (
        _nbytes(params) + _nbytes(grads) + _nbytes(state) + _nbytes(steps) + x.untyped_storage().nbytes()
    )
    # the counters are process-wide: what earlier tests of this worker left alive is held too, never as
    # these kinds (it is "other" or not identified), so each kind is exact and the total at least their sum
    kinds = r.by_kind()
    assert kinds["parameter"] == _nbytes(params) and kinds["gradient"] == _nbytes(grads)
    assert kinds["optimizer_state"] == _nbytes(state) + _nbytes(steps)
    assert kinds["input"] == x.untyped_storage().nbytes() and kinds["activation"] == acts
    assert r.held >= expected + acts and r.held == sum(kinds.values())
    err_text = capsys.readouterr().err
    assert err_text.count("memtorch: out of memory on cpu") == 1  # printed once
    assert "running: in the forward, in module 2.1 (Huge)" in err_text and "0.weight.exp_avg" in err_text
    assert json.loads(json.dumps(r.to_dict()))["requested"] == ASK * 4
    assert not any("counting began" in n for n in r.notes)  # counting since the fixture: nothing left out


_FRESH_OOM = """
import json, sys, torch, memtorch
sys.path.insert(0, sys.argv[1])
from test_oom import Huge, _model
model = _model(Huge())
x = torch.randn(32, 64)  # made before counting began: not among the bytes held
try:
    with memtorch.track(model):
        model(x)
except RuntimeError as e:
    r = e.memtorch_report
    print(json.dumps([r.notes, r.by_kind()]))
"""


def test_a_block_that_began_counting_says_what_the_bytes_held_leave_out():
    # in a new process counting begins with the block: the batch made before it is not among the bytes held
    # (was: no word of it), as the block's own report says "Counting began when this block opened"
    if not memtorch.cpu.exact():
        pytest.skip("needs the exact CPU counters")
    here = str(pathlib.Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", _FRESH_OOM, here], capture_output=True, text=True, timeout=300,
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    notes, kinds = json.loads(out.stdout.strip().splitlines()[-1])
    assert "input" not in kinds  # the batch, made before counting began
    assert any(n.startswith("counting began when this block opened") and "(a batch, a dataset)" in n
               for n in notes), notes
    assert "note: counting began when this block opened" in out.stderr  # printed with the report


def test_in_the_backward(counting, capsys):
    model = _model(GradBomb())
    x = torch.randn(8, 64)
    with pytest.raises(RuntimeError) as err:
        with memtorch.track(model):
            model(x).sum().backward()
    r = err.value.memtorch_report
    assert r.phase == "backward" and r.requested == ASK * 4
    assert "running: in the backward" in capsys.readouterr().err


def test_nested_blocks_print_once_the_outer_report_with_the_live_set(counting, capsys):
    model = _model(Huge())
    with pytest.raises(RuntimeError) as err:
        with memtorch.track(model):
            with memtorch.track():  # no model: counters only, no event log of its own
                model(torch.randn(8, 64))
    r = err.value.memtorch_report
    assert r.at_failure is not None and r.module == "2.1 (Huge)"
    assert capsys.readouterr().err.count("memtorch: out of memory") == 1


def test_another_error_leaves_no_report(counting):
    with pytest.raises(ValueError):
        with memtorch.track(_model(nn.Identity())):
            raise ValueError("not memory")
    with pytest.raises(RuntimeError) as err:  # says "out of memory" but no allocation failed in the block
        with memtorch.track(_model(nn.Identity())):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 12 bytes")
    r = err.value.memtorch_report
    assert r.requested == 12 and r.at_failure is None and r.held is None and not r.exact


def test_no_block_the_switch_names_the_tracebacks_locals(counting):
    import io

    out = io.StringIO()
    before = sys.excepthook
    memtorch.on_oom(file=out)
    try:
        assert sys.excepthook is not before

        def train(model, x):
            kept = torch.ones(1000)  # noqa: F841 (a local the report names)
            return model(x)

        model = _model(Huge())
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            fake = torch.empty(8)  # noqa: F841 (a live tensor with no data pointer: passed over, not an error)
        batch = torch.randn(4, 64)
        try:
            train(model, batch)
        except RuntimeError as e:
            sys.excepthook(type(e), e, e.__traceback__)
        # the report read this frame's locals (the traceback's first frame): it keeps no reference to
        # them (before Python 3.13 a read leaves a snapshot of them on the frame), so a batch the loop
        # deletes after the error is freed, as a retry with a smaller one needs
        gone = weakref.ref(batch)
        del batch
        assert gone() is None
    finally:
        memtorch.on_oom(False)
    assert sys.excepthook is before
    text = out.getvalue()
    assert text.startswith("memtorch: out of memory on cpu: the allocation asked for")
    assert "local `kept` of `train` (other)" in text and "0.weight (parameter)" in text


def test_the_environment_switch_reports_an_uncaught_error():
    code = "import memtorch, torch\nmemtorch.cpu.start()\nx = torch.empty(2**50)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, "MEMTORCH_ON_OOM": "1"})  # fmt: skip
    assert proc.returncode == 1
    asked = memtorch.units.format(2**52)  # torch.empty(2**50): float32
    assert f"memtorch: out of memory on cpu: the allocation asked for {asked}" in proc.stderr
    assert "Traceback" in proc.stderr  # the error itself still printed, after the report
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "memtorch: out of memory" not in plain.stderr


def test_cuda_messages_and_the_allocators_figures_from_a_real_snapshot():
    msg = (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "3.56 MiB is free. Including non-PyTorch memory, this process has 79.18 GiB memory in use."
    )
    assert oom.is_oom(RuntimeError(msg)) == ("cuda", 20 << 20)
    assert oom.is_oom(torch.OutOfMemoryError(msg)) == ("cuda", 20 << 20)
    assert oom.is_oom(RuntimeError("shape mismatch")) is None
    segments = json.loads(gzip.open(DATA / "gpt2-fp32.segments.json.gz").read())
    allocated, reserved, largest, blocks, _cap = oom.cuda_figures(0, snapshot=segments)
    # the allocator's own per-segment sums, an independent reading of the same state
    assert allocated == sum(s["allocated_size"] for s in segments) == 892_583_936
    assert reserved == sum(s["total_size"] for s in segments) == 5_316_280_320
    free = [b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive"]
    assert largest == max(free) and sum(free) == reserved - allocated
    assert sum(size for size, _ in blocks.values()) == allocated


def test_cuda_report_outside_a_block_from_a_fake_allocator(monkeypatch):
    segments = json.loads(gzip.open(DATA / "gpt2-fp32.segments.json.gz").read())
    monkeypatch.setattr(oom, "cuda_figures", lambda index=None, snapshot=None: (
        *oom.__dict__["_real_cuda_figures"](index, segments)[:4], 80 << 30))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    free = max(b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive")
    ask = free + (2 << 20)  # more than the largest free block, less than all the free bytes
    e = torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {ask / (1 << 20):.2f} MiB. GPU 0 ...")
    r = oom.report_of(e)
    assert (r.device, r.held, r.reserved, r.largest_free) == ("cuda:0", 892_583_936, 5_316_280_320, free)
    text = str(r)
    assert "caching allocator: allocated 851.2 MiB, reserved 5.0 GiB, largest free block" in text
    assert oom.UNNAMED in text  # no local holds a CUDA tensor here: every block unnamed, and said so


def test_cuda_block_reports_the_allocators_figures_and_fragmentation(monkeypatch):
    from fake_cuda import FakeCuda

    segments = json.loads(gzip.open(DATA / "gpt2-fp32.segments.json.gz").read())
    fake = FakeCuda(torch.cuda)
    fake.memory_snapshot = lambda: segments
    monkeypatch.setattr(torch, "cuda", fake)
    free = max(b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive")
    ask = free + (2 << 20)  # more than any free block, less than the free bytes of all the segments
    with pytest.raises(torch.OutOfMemoryError) as err:
        with memtorch.track(device="cuda"):
            fake.alloc(64 << 20)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {ask / (1 << 20):.2f} MiB. GPU 0"
            )
    r = err.value.memtorch_report
    assert (r.device, r.requested, r.held, r.reserved, r.largest_free) == (
        "cuda:0",
        ask,
        892_583_936,
        5_316_280_320,
        free,
    )
    assert not r.exact and any("fragmentation" in n for n in r.notes)
