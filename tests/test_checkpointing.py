"""track() beside torch.utils.checkpoint (issue 23 row 10): a module's forward that autograd runs
again during backward is shown as a recomputation, apart from the forwards.

The model: two blocks Linear(64, 128) -> ReLU -> Linear(128, 64), input 32 x 64 fp32. Hand counts:
a block's output is 32x64x4 = 8,192 B; the first Linear's and the ReLU's outputs are 32x128x4 =
16,384 B each. Without checkpointing a block leaves alive ReLU's output (saved by ReLU and by the
second Linear) and its own output: 24,576 B; the first Linear's output dies once ReLU ran.
Checkpointed, the forward keeps only the block's output (8,192 B). In backward the block runs again:
non-reentrant checkpointing stops as soon as the tensors backward needs are back (after the second
Linear saved its input, before its output is kept), leaving ReLU's output: 16,384 B; reentrant
checkpointing runs the whole block and keeps its output too: 24,576 B.
"""

import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import memtorch
from memtorch import tracking

ACT, OUT = 32 * 128 * 4, 32 * 64 * 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.r, self.b = torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.b(self.r(self.a(x)))


class Net(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.how = how

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.how is None else checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return x


class _NotLinux:
    """sys as a non-Linux process sees it: track() takes its Python hooks (no event log)."""

    def __getattr__(self, name):
        return "darwin" if name == "platform" else getattr(sys, name)


@pytest.fixture(params=["event log", "python hooks"])
def path(request, monkeypatch):
    if request.param == "python hooks":
        monkeypatch.setattr(tracking, "sys", _NotLinux())
    return request.param


def _step(how):
    torch.manual_seed(0)
    net = Net(how)
    x = torch.randn(32, 64, requires_grad=how == "reentrant")  # reentrant needs an input that wants grad
    with memtorch.track(net) as t:
        net(x).sum().backward()
    return t


@pytest.mark.parametrize(
    "how, alive, again",
    [(None, ACT + OUT, 0), ("non-reentrant", OUT, ACT), ("reentrant", OUT, ACT + OUT)],
)
def test_recomputation_is_its_own_column(path, how, alive, again):
    t = _step(how)
    assert t._evmode == (path == "event log")
    r = t.report
    rows = {m.name: m for m in r.modules}
    assert r.phases["forward"].calls == 1  # the recomputation is not another forward of the model
    for name in ("blocks.0", "blocks.1"):
        row = rows[name]
        assert (row.calls, row.activation_bytes) == (1, alive)
        assert (row.recomputed, row.recomputed_bytes) == ((0, 0) if how is None else (1, again))
        assert row.exact
    assert rows["blocks.0.a"].calls == 1 and rows["blocks.0.a"].recomputed == (how is not None)
    # the root: the two blocks' outputs, and with checkpointing the CPU RNG state that each
    # checkpoint keeps to replay dropout (torch.get_rng_state(): its nbytes)
    rng = 0 if how is None else 2 * torch.get_rng_state().nbytes
    assert rows[""].activation_bytes == (2 * (ACT + OUT) if how is None else 2 * OUT + rng)
    assert rows[""].recomputed == 0


def test_recomputation_in_text_and_dict_only_when_there_is_one():
    plain, ckpt = _step(None).report, _step("non-reentrant").report
    for text in (str(plain), plain.to_text()):
        assert "recomputed" not in text
    for text in (str(ckpt), ckpt.to_text()):
        assert "recomputed calls" in text and "left alive by recomputing" in text
    row = next(m for m in ckpt.to_dict()["modules"] if m["name"] == "blocks.0")
    assert (row["calls"], row["recomputed"], row["recomputed_bytes"]) == (1, 1, ACT)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the event log is Linux's")
@pytest.mark.slow  # 140,000 events
def test_recomputations_stay_right_when_the_event_log_wraps():
    """The ring of 131,072 events wraps between steps: the recomputations' calls and bytes come from
    the hooks' own counts (marks.c recompute_totals), as the forwards' do."""
    from memtorch import _C

    torch.manual_seed(0)
    net = Net("non-reentrant")
    x = torch.randn(32, 64)
    steps = 3
    with memtorch.track(net) as t:
        for i in range(steps):
            net(x).sum().backward()
            if i == 0:
                _C._counters_bench(70_000, 64)
    r = t.report
    assert r.at_peak is not None and not r.at_peak.exact  # the log did wrap
    row = {m.name: m for m in r.modules}["blocks.1"]
    assert (row.calls, row.recomputed) == (steps, steps)
    assert (row.activation_bytes, row.recomputed_bytes) == (OUT, ACT)
