"""CUDA budgets on a real device: test order never changes a verdict, a bounded peak never passes,
and tracking reads torch's counters per step, not per module.

Sizes are multiples of 512 B (the caching allocator's block rounding), so hand counts are exact:
a float32 tensor of n elements holds 4 * n bytes; 16 Mi elements are 64 MiB.
"""

import os
from importlib import metadata
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import memtorch  # noqa: E402
from memtorch import cuda as mcuda  # noqa: E402
from memtorch import units  # noqa: E402

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]


def _plugin_args():
    eps = metadata.entry_points()
    group = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
    return [] if any(ep.value == "memtorch.pytest_plugin" for ep in group) else ["-p", "memtorch.pytest_plugin"]


def test_budget_verdict_does_not_depend_on_test_order(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(
        test_order="""
        import pytest, torch

        MiB = 2**20

        def test_a_high():
            x = torch.empty(25 * MiB, device="cuda")  # 100 MiB: the device's peak from now on
            del x

        @pytest.mark.memory_budget(peak="32 MiB", device="cuda")
        def test_b_low():
            x = torch.empty(16 * MiB, device="cuda")  # 64 MiB, below the older 100 MiB peak
            del x

        @pytest.mark.memory_budget(peak="128 MiB", device="cuda")
        def test_c_within():
            x = torch.empty(16 * MiB, device="cuda")
            del x
        """
    )
    result = pytester.runpytest_subprocess(*_plugin_args(), "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*::test_b_low OVER BUDGET*"])
    line = f"peak {units.format(64 * MiB)} exceeds budget {units.format(32 * MiB)} by {units.format(32 * MiB)}"
    assert line in result.outlines


def test_a_block_below_an_older_peak_never_passes_on_its_lower_bound():
    torch.cuda.synchronize()
    big = torch.empty(32 * MiB, device="cuda")  # 128 MiB: an older peak above everything below
    del big
    with memtorch.track(device="cuda") as t:
        x = torch.empty(16 * MiB, device="cuda")  # 64 MiB between the block's reads
        del x
    r = t.report
    if r.exact:  # something else on the device made the block start at its peak
        pytest.skip("the device's peak did not stay above the block")
    assert r.peak_above_start < 64 * MiB <= r.peak_upper - r.start
    with pytest.raises(memtorch.BudgetInconclusive, match="memtorch.cuda.reset_peak"):
        r.check(peak="32 MiB")


def test_memtorch_reset_peak_keeps_an_enclosing_block_exact():
    torch.cuda.synchronize()
    mcuda.reset_peak()
    base = torch.cuda.memory_allocated()
    with memtorch.track(device="cuda") as outer:
        x = torch.empty(12 * MiB, device="cuda")  # 48 MiB
        del x
        mcuda.reset_peak()  # torch's peak forgets the 48 MiB; the open block does not
        assert torch.cuda.max_memory_allocated() == base
        y = torch.empty(4 * MiB, device="cuda")  # 16 MiB
        del y
    assert outer.report.exact and outer.report.peak_above_start == 48 * MiB


def test_tracked_step_reads_counters_per_step_not_per_module(monkeypatch):
    reads = []
    real = mcuda._counters
    monkeypatch.setattr(mcuda, "_counters", lambda index: reads.append(index) or real(index))
    model = nn.Sequential(*[m for _ in range(20) for m in (nn.Linear(64, 64), nn.ReLU())]).cuda()  # 41 modules
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, device="cuda")
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(3):
            del reads[:]
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t.step()
            assert len(reads) == 5  # forward begins; -> backward; -> optimizer; optimizer ends; t.step()
    assert t.report.device.startswith("cuda") and t.report.modules == []
