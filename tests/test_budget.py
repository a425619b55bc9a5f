"""memtorch.assert_budget outside pytest: which figure is compared, the verdict line, the breakdown."""

from types import SimpleNamespace

import pytest

import memtorch
from memtorch import units
from memtorch.budget import assert_budget, breakdown, check_budget, format_pair, verdict_line


def fake_report(start=1000, peak=5000, end=1500, per_step=None, **extra):
    """A report with hand-chosen figures: peak_above_start = peak - start, delta = end - start."""
    leak = None if per_step is None else SimpleNamespace(per_step=per_step, survivors=[])
    report = SimpleNamespace(
        device="cpu",
        exact=True,
        start=start,
        end=end,
        delta=end - start,
        peak=peak,
        peak_above_start=peak - start,
        reserved_peak=None,
        phases={},
        modules=[],
        leak=leak,
        largest=[],
    )
    vars(report).update(extra)
    return report


def test_peak_is_compared_with_peak_above_start_not_the_absolute_peak():
    r = fake_report(start=1000, peak=5000)  # the block itself allocated 4000 B at its peak
    assert_budget(r, peak=4000)  # equal is within budget
    assert_budget(r, peak="4 kB")  # 4 kB = 4000 B
    with pytest.raises(memtorch.BudgetExceeded) as e:
        assert_budget(r, peak=3999)
    assert e.value.failures == [("peak", 4000, 3999)]
    assert e.value.report is r


def test_decimal_and_binary_units_are_not_confused():
    # 4,000,000 B is more than 3 MB (3,000,000 B) and less than 4 MiB (4,194,304 B).
    r = fake_report(start=0, peak=4_000_000, end=0)
    assert_budget(r, peak="4 MiB")
    with pytest.raises(memtorch.BudgetExceeded) as e:
        assert_budget(r, peak="3 MB")
    # 4,000,000 / 2**20 = 3.81 -> "3.8 MiB"; 3,000,000 / 2**20 = 2.86 -> "2.9 MiB";
    # the excess 1,000,000 B / 1024 = 976.56 -> "976.6 KiB".
    # The decimal budget is also shown as written.
    first = str(e.value).splitlines()[0]
    assert first == "peak 3.8 MiB exceeds budget 2.9 MiB (3 MB) by 976.6 KiB"
    assert first == (
        f"peak {units.format(4_000_000)} exceeds budget {units.format(3_000_000)} (3 MB) by {units.format(1_000_000)}"
    )
    # Given in bytes or binary units, the budget is shown in binary units only.
    with pytest.raises(memtorch.BudgetExceeded) as e:
        assert_budget(r, peak="3.5 MiB")  # 3,670,016 B; the excess 329,984 B = 322.25 KiB
    assert str(e.value).splitlines()[0] == "peak 3.8 MiB exceeds budget 3.5 MiB by 322.2 KiB"


def test_delta_and_leak_budgets():
    r = fake_report(start=1000, end=1600, per_step=256)
    assert_budget(r, delta=600, leak=256)
    with pytest.raises(memtorch.BudgetExceeded) as e:
        assert_budget(r, peak="1 MiB", delta="512 B", leak="0 B")
    assert e.value.failures == [("delta", 600, 512), ("leak", 256, 0)]
    lines = str(e.value).splitlines()
    assert lines[0] == "delta 600 B exceeds budget 512 B by 88 B"
    assert lines[1] == "leak 256 B exceeds budget 0 B by 256 B"
    assert lines[2] == ""
    assert lines[3].startswith("memtorch breakdown (device cpu, exact counters)")


def test_leak_per_step_list_means_every_step():
    r = fake_report(per_step=[0, 100, 40])
    assert check_budget(r, leak=100) == []
    assert check_budget(r, leak=99) == [("leak", 100, 99)]


def test_leak_budget_without_steps_is_a_clear_error():
    with pytest.raises(memtorch.MemtorchError, match=r"t\.step\(\)"):
        assert_budget(fake_report(per_step=None), leak="0 B")


def test_bad_size_is_a_unit_error():
    with pytest.raises(memtorch.UnitError, match="cannot parse size '64 MiBs'|unknown unit 'MiBs'"):
        assert_budget(fake_report(), peak="64 MiBs")


def test_nothing_given_checks_nothing():
    assert check_budget(fake_report()) == []


def test_verdict_never_prints_two_different_counts_the_same():
    # pytest-memray printed "limited to 3.8MiB but allocated 3.8MiB". Here:
    # 4,000,000 B = 3.8147 MiB and 3,990,000 B = 3.8052 MiB agree at 1 and 2 decimals
    # ("3.8", "3.81") and differ at 3 ("3.815" vs "3.805").
    assert format_pair(4_000_000, 3_990_000) == ("3.815 MiB", "3.805 MiB")
    # 4,000,000 B and 3,999,999 B agree to 3 decimals: the exact bytes are shown.
    assert verdict_line("peak", 4_000_000, 3_999_999) == "peak 4000000 B exceeds budget 3999999 B by 1 B"


def test_breakdown_lists_phases_modules_and_largest_tensors():
    r = fake_report(
        phases={"forward": SimpleNamespace(peak_above_start=2048, delta=1024)},
        modules=[
            SimpleNamespace(name="fc1", type="Linear", activation_bytes=512, peak_above_start=512),
            SimpleNamespace(name="fc2", type="Linear", activation_bytes=4096, peak_above_start=4096),
        ],
        largest=[SimpleNamespace(shape=(64, 128), dtype="float32", nbytes=32768, has_graph=True)],
        per_step=0,
    )
    text = breakdown(r)
    assert "    forward  peak +2.0 KiB above phase start, delta +1.0 KiB" in text
    # fc2 holds more (4096 > 512) and is listed first.
    assert text.index("fc2 (Linear)") < text.index("fc1 (Linear)")
    assert "    32.0 KiB  (64, 128) float32, holds autograd graph" in text
    assert "  leak: +0 B per step, 0 tensor(s) kept unexpectedly" in text


def test_assert_budget_on_a_real_track():
    torch = pytest.importorskip("torch")
    with memtorch.track(device="cpu") as t:
        x = torch.empty(1000, 1000)  # float32: 1000 * 1000 * 4 = 4,000,000 B
        del x
    memtorch.assert_budget(t.report, peak="4 MiB")  # the package-level name is this function
    with pytest.raises(memtorch.BudgetExceeded) as e:
        memtorch.assert_budget(t.report, peak="3 MB")
    assert e.value.failures == [("peak", 4_000_000, 3_000_000)]


def test_assert_budget_accepts_the_tracker_itself():
    torch = pytest.importorskip("torch")
    with memtorch.track() as t:
        a = torch.ones(1000, 1000)  # 4,000,000 bytes
    memtorch.assert_budget(t, peak="10 MiB")  # the Tracker: its report is judged
    if memtorch.cpu.exact():
        # "at least" when the counters saw frees of memory allocated before counting began (an earlier
        # test's): the figure is then an upper bound, and its lower bound is still over
        with pytest.raises(memtorch.BudgetExceeded, match=r"^peak (at least )?3\.8 MiB exceeds budget 1\.0 MiB"):
            memtorch.assert_budget(t, peak="1 MiB")
    del a


def test_assert_budget_on_something_else_says_what_it_expects():
    with pytest.raises(TypeError, match=r"expects the report of a track\(\) block \(t\.report\) or the tracker itself \(t\), got int"):
        memtorch.assert_budget(3, peak="1 MiB")


def test_assert_budget_on_a_tracker_that_has_not_run():
    t = memtorch.track()
    with pytest.raises(memtorch.MemtorchError, match="has not run"):
        memtorch.assert_budget(t, peak="1 MiB")


# --- a figure only bounded never passes ------------------------------------------------------

MiB = 2**20


def cuda_bounded(start=10 * MiB, low=40 * MiB, upper=100 * MiB):
    """A CUDA report whose block stayed below an older device peak: its peak above start is at
    least ``low`` and at most ``upper`` (None: no upper bound), as memtorch.cuda.block_peak gives."""
    return fake_report(
        start=start, peak=start + low, end=start, device="cuda:0", exact=False,
        mechanism="torch.cuda counters (below an older peak: sampled)",
        peak_upper=None if upper is None else start + upper,
    )  # fmt: skip


def test_bounds_that_straddle_the_budget_fail_inconclusive():
    r = cuda_bounded()  # 40 MiB <= peak above start <= 100 MiB
    failures = check_budget(r, peak="64 MiB")
    assert failures == [("peak", 40 * MiB, 64 * MiB)] and failures[0].inconclusive
    assert failures[0].upper == 100 * MiB
    with pytest.raises(memtorch.BudgetInconclusive) as e:
        assert_budget(r, peak="64 MiB")
    assert isinstance(e.value, memtorch.BudgetExceeded)  # `except BudgetExceeded` still catches it
    first = str(e.value).splitlines()[0]
    assert first.startswith(
        "peak budget 64.0 MiB inconclusive: the peak is between 40.0 MiB and 100.0 MiB, not an exact figure, "
        "because the block stayed below a peak the device reached before it"
    )
    assert "it does not pass. For an exact figure: call memtorch.cuda.reset_peak()" in first
    assert "memtorch breakdown (device cuda:0, counters that bound the peak: at most 110.0 MiB)" in str(e.value)


def test_bounds_both_under_the_budget_pass():
    r = cuda_bounded()
    assert check_budget(r, peak="100 MiB") == []  # the upper bound is at the limit: within
    assert_budget(r, peak="1 GiB")


def test_bounds_both_over_the_budget_fail_exceeded():
    r = cuda_bounded()
    with pytest.raises(memtorch.BudgetExceeded) as e:
        assert_budget(r, peak="32 MiB")
    assert type(e.value) is memtorch.BudgetExceeded  # over for sure, not inconclusive
    assert e.value.failures == [("peak", 40 * MiB, 32 * MiB)] and not e.value.failures[0].inconclusive
    assert str(e.value).splitlines()[0].startswith("peak at least 40.0 MiB exceeds budget 32.0 MiB by at least 8.0 MiB")
    # the lower bound exactly at the limit is not over: the limit lies between the bounds
    with pytest.raises(memtorch.BudgetInconclusive):
        assert_budget(r, peak="40 MiB")


def test_no_upper_bound_never_passes():
    r = cuda_bounded(upper=None)  # torch's peak was reset inside the block
    with pytest.raises(memtorch.BudgetInconclusive, match=r"at least 40\.0 MiB, with no upper bound"):
        assert_budget(r, peak="1 TiB")


def test_exceeded_wins_over_inconclusive():
    r = cuda_bounded()
    r.end, r.delta = r.start + 1024, 1024  # delta: exact
    with pytest.raises(memtorch.BudgetExceeded) as e:
        assert_budget(r, peak="64 MiB", delta=1023)
    assert type(e.value) is memtorch.BudgetExceeded
    assert [f.inconclusive for f in e.value.failures] == [True, False]


def test_cpu_unseen_frees_make_an_upper_bound():
    # the counters saw frees of 3000 B allocated before counting began: peak and delta may be up to
    # 3000 B too high, so the figures 4000 B and 500 B are bounded by [1000, 4000] and [-2500, 500]
    r = fake_report(start=1000, peak=5000, end=1500, unseen_bytes=3000, unseen_frees=2)
    assert_budget(r, peak=4000, delta=500)  # upper bounds at the limits: within
    with pytest.raises(memtorch.BudgetInconclusive, match="memtorch.cpu.start"):
        assert_budget(r, peak=2000)
    with pytest.raises(memtorch.BudgetExceeded) as e:
        assert_budget(r, peak=999)
    assert type(e.value) is memtorch.BudgetExceeded


def test_a_multi_rank_figure_is_bounded_by_its_ranks():
    ranks = [
        SimpleNamespace(rank=0, **vars(fake_report(start=0, peak=50 * MiB, end=0))),
        SimpleNamespace(rank=1, **vars(cuda_bounded(start=0, low=40 * MiB, upper=100 * MiB))),
    ]
    multi = SimpleNamespace(**vars(fake_report(start=0, peak=50 * MiB, end=0)), ranks=ranks, rank=None)
    multi.exact = False
    with pytest.raises(memtorch.BudgetInconclusive, match="on rank 1, the block stayed below"):
        assert_budget(multi, peak="64 MiB")
    assert_budget(multi, peak="100 MiB")
    with pytest.raises(memtorch.BudgetExceeded):
        assert_budget(multi, peak="45 MiB")  # rank 0's exact 50 MiB is over


def test_an_estimate_is_not_read_as_a_bound():
    # an Estimate has exact=False (a model, not a measurement) and no counters' mechanism: judged as is
    r = fake_report(start=0, peak=50 * MiB, end=0, device="cuda", exact=False)
    assert check_budget(r, peak="50 MiB") == []


@pytest.mark.skipif(not memtorch.cpu.exact(), reason="at_peak needs the exact CPU counters")
def test_breakdown_owners_sizes_are_right_aligned():
    # the owners at the peak, as at_peak prints them: "   512 B  input" above "    16 B  bias" (was: each
    # size where its own width left it, "    16 B" one column left of "    512 B")
    import torch

    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memtorch.track(model, opt) as t:
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    lines = breakdown(t.report, owners=10).splitlines()
    start = next(i for i, x in enumerate(lines) if "who held the bytes at the peak" in x) + 1
    rows = []
    for x in lines[start:]:
        if not x.startswith("    ") or x.startswith("    note:"):
            break
        rows.append(x)
    ends = {r.index("  ", len(r) - len(r.lstrip())) for r in rows}  # where each size ends: one column
    assert len(rows) >= 3 and len(ends) == 1, rows
    assert len({len(r.split()[0]) for r in rows}) > 1, rows  # sizes of several widths: the case checked
