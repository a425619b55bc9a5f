"""memtorch over torch.distributed: per-rank reports gathered over real gloo ranks.

Multi-rank tests start real processes (tests/_dist_workers.py, one per rank,
gloo on the CPU), each bounded by a timeout so that a hang fails the test
instead of stalling CI. Expected figures are derived by hand (a rank allocates
a known number of bytes) or are each rank's own report, which the gathered
report must reproduce.
"""

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import memtorch
from memtorch import distributed as mdist

# Tests that start ranks are slow (a process per rank, each importing torch): they run in the
# normal pass, not in the sanitizer and -X dev passes (the ranks run no C code these tests target).
slow = pytest.mark.slow
from memtorch.errors import BudgetExceeded, MemtorchError

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_dist_workers.py"
KIB = 1024


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario, world=2, timeout=180):
    """Start `world` ranks of tests/_dist_workers.py SCENARIO; their RESULT dicts, by rank."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        texts = [p.communicate()[0] for p in procs]
        pytest.fail(f"ranks did not finish within {timeout} s (a hang):\n" + "\n".join(texts))
    results = []
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, out
        results.append(json.loads(lines[0][len("RESULT ") :]))
    return results


# ---------------------------------------------------------------------------
# Real ranks


@pytest.fixture(scope="module")
def basic():
    """Two ranks that each allocate a known number of bytes, then gather (tests/_dist_workers.py basic)."""
    return run_ranks("basic", world=2)


@slow
def test_each_rank_knows_its_rank_and_world_size(basic):
    for rank, res in enumerate(basic):
        assert res["own"]["rank"] == rank
        assert res["own"]["world_size"] == 2


@slow
def test_gathered_rows_are_each_ranks_own_figures(basic):
    def figures(own):
        return {k: v for k, v in own.items() if k not in ("rank", "world_size")}

    for res in basic:
        for r in range(2):
            assert figures(basic[r]["own"]) == res["rows"][r]
            assert figures(basic[r]["own2"]) == res["rows2"][r]
            assert set(res["rows2"][r]["phases"]) == {"forward", "backward", "optimizer"}


@slow
def test_gathered_figures_match_what_each_rank_allocated(basic):
    # rank r allocated and freed (r + 1) * 256 KiB: peak above start exactly that, delta 0
    for r in range(2):
        row = basic[0]["rows"][r]
        assert row["peak_above_start"] == (r + 1) * 256 * KIB
        assert row["delta"] == 0
    s = basic[0]["summary"]
    assert s["max_rank"] == 1 and s["min_rank"] == 0
    assert s["peak_above_start"] == 512 * KIB
    assert s["min_peak_above_start"] == 256 * KIB
    assert s["spread"] == 256 * KIB
    assert s["imbalance"] == pytest.approx(512 / 384)  # max / mean of 256 and 512 KiB


@slow
def test_the_report_lives_on_dst_only(basic):
    assert basic[0]["dst0_is_none"] is False
    assert basic[1]["dst0_is_none"] is True
    assert "text" not in basic[1]


@slow
def test_text_and_dict(basic):
    text = basic[0]["text"]
    assert "2 rank(s)" in text
    assert "rank 1 holds the most, peak 512.0 KiB above its block start" in text
    assert "256.0 KiB" in text and "imbalance: highest / mean = 1.333" in text
    d = basic[0]["dict"]
    assert d["world_size"] == 2 and d["max_rank"] == 1
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    json.dumps(d)


@slow
def test_budget_applies_to_the_highest_rank(basic):
    over = basic[0]["over"]
    assert over.startswith("peak 512.000 KiB exceeds budget 511.999 KiB by 1 B"), over
    assert "rank 1 holds the most" in over


@pytest.mark.slow
def test_a_rank_that_raised_or_never_came_gives_a_clear_error_on_every_rank():
    res = run_ranks("failure", world=2)
    for r in range(2):
        err = res[r]["error"]
        assert err is not None and "rank 1: ValueError: boom on rank one" in err, err
        assert res[r]["after"] == 2  # the group is still usable afterwards
    assert "timed out after 2 s: rank(s) 1 did not call gather()" in res[0]["timeout"]
    assert "rank 0: gave up after 2 s waiting for rank(s) [1]" in res[1]["late"]


# ---------------------------------------------------------------------------
# In this process: a one-rank group, and no group at all


def test_gather_without_a_process_group_is_a_clear_error():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with memtorch.track() as t:
        pass
    assert t.report.rank is None and t.report.world_size is None
    with pytest.raises(MemtorchError, match="needs an initialised torch.distributed process group"):
        t.report.gather()


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()
        mdist._rounds.clear()


def test_one_rank_gather(one_rank_group):
    import torch

    with memtorch.track() as t:
        x = torch.empty(1000, dtype=torch.float64)
        del x
    assert t.report.rank == 0 and t.report.world_size == 1
    multi = t.report.gather()
    assert multi.world_size == 1
    assert multi.ranks[0].peak_above_start == t.report.peak_above_start == 8000
    assert multi.imbalance == 1.0 and multi.spread == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dst": 3}, r"dst must be one of the group's ranks \[0\] or None \(every rank\), got 3"),
        ({"dst": "0"}, r"got '0'"),
        ({"timeout": 0}, r"timeout must be a positive number of seconds, got 0"),
        ({"timeout": float("nan")}, r"got nan"),
    ],
)
def test_bad_gather_arguments(one_rank_group, kwargs, match):
    with memtorch.track() as t:
        pass
    with pytest.raises(MemtorchError, match=match):
        t.report.gather(**kwargs)


def test_gather_of_something_else_is_a_type_error(one_rank_group):
    with pytest.raises(TypeError, match="takes a TrackReport .* got int"):
        mdist.gather(5)


def test_collective_device_follows_the_backend(monkeypatch):
    import torch

    assert mdist._device_for("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MemtorchError, match="backend is NCCL but this process has no CUDA device"):
        mdist._device_for("nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert mdist._device_for("nccl") == torch.device("cuda", 3)


# ---------------------------------------------------------------------------
# The multi-rank arithmetic, from figures written by hand


def _rank(rank, start, peak, end, leak=None, phases=None, exact=True):
    return mdist.RankReport({
        "rank": rank, "world_size": 3, "device": "cpu", "exact": exact, "mechanism": "test",
        "start": start, "end": end, "peak": peak, "phases": phases or {}, "modules": [],
        "leak": None if leak is None else {"per_step": leak, "steps": [leak], "warmup": 0, "leaking": leak > 0,
                                           "survivors": []},
    })  # fmt: skip


def test_multi_rank_arithmetic():
    ph = lambda pas: {"forward": {"calls": 1, "delta": 0, "peak": 0, "peak_above_start": pas, "seconds": 0.0,
                                  "exact": True}}  # fmt: skip
    m = mdist.MultiRankReport([
        _rank(2, 100, 400, 150, leak=10, phases=ph(30)),
        _rank(0, 100, 200, 100, leak=0, phases=ph(20)),
        _rank(1, 0, 600, 50, leak=5, phases=ph(70), exact=False),
    ])  # fmt: skip
    assert [r.rank for r in m.ranks] == [0, 1, 2]
    assert m.peak_above_start == 600 and m.max_rank == 1  # peaks above start: 100, 600, 300
    assert m.min_peak_above_start == 100 and m.min_rank == 0
    assert m.mean_peak == pytest.approx(1000 / 3)
    assert m.imbalance == pytest.approx(600 / (1000 / 3))
    assert m.spread == 500
    assert m.delta == 50 and m.delta_rank == 1 or m.delta == 50  # deltas: 0, 50, 50
    assert m.leak.per_step == 10 and m.leak_rank == 2
    assert m.phases["forward"]["peak_above_start"] == 70
    assert m.exact is False and "not exact" in str(m)
    assert "largest leak: rank 2, +10 B per step" in str(m)
    calm = mdist.MultiRankReport([_rank(0, 0, 10, 0, leak=0), _rank(1, 0, 10, 0, leak=-4)])
    assert calm.leak.per_step == 0 and "leak: no rank grew per step after warm-up" in str(calm)
    with pytest.raises(BudgetExceeded, match="leak 10 B exceeds budget 9 B by 1 B"):
        m.check(leak=9)
    m.check(peak=600, delta=50, leak=10)


def test_empty_multi_rank_report_is_an_error():
    with pytest.raises(MemtorchError, match="at least one rank"):
        mdist.MultiRankReport([])
