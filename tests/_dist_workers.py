"""One rank of a multi-rank test: ``python tests/_dist_workers.py SCENARIO`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (tests/test_distributed.py starts them).

Each rank prints one JSON line ``RESULT {...}`` with what it saw; the test
compares the ranks' lines with one another and with the hand-derived figures.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import memtorch
from memtorch.errors import BudgetExceeded, MemtorchError

KIB = 1024


def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def own(report):
    """This rank's figures as the test compares them with the gathered row."""
    return {
        "peak_above_start": report.peak_above_start,
        "delta": report.delta,
        "peak": report.peak,
        "phases": {n: p.peak_above_start for n, p in report.phases.items()},
        "rank": report.rank,
        "world_size": report.world_size,
    }


def row(multi, r):
    x = multi.ranks[r]
    return {
        "peak_above_start": x.peak_above_start,
        "delta": x.delta,
        "peak": x.peak,
        "phases": {n: p["peak_above_start"] for n, p in x.phases.items()},
    }


def basic(rank, world):
    memtorch.cpu.start()  # count from the start: no unseen frees
    # 1. rank r allocates (r + 1) * 256 KiB of float32 and frees it: peak above start
    #    is exactly that, delta 0 (by hand: 65,536 * (r + 1) elements * 4 bytes).
    n = (rank + 1) * 256 * KIB // 4
    with memtorch.track() as t:
        x = torch.empty(n, dtype=torch.float32)
        del x
    rep = t.report
    multi = rep.gather()  # dst=0
    everyone = rep.gather(dst=None)
    out = {"own": own(rep), "dst0_is_none": multi is None, "rows": [row(everyone, r) for r in range(world)]}
    out["summary"] = {
        k: getattr(everyone, k)
        for k in ("max_rank", "min_rank", "peak_above_start", "min_peak_above_start", "spread", "imbalance")
    }
    if multi is not None:
        out["text"] = str(multi)
        out["dict"] = multi.to_dict()
        # budgets apply to the highest rank
        limit = everyone.peak_above_start
        multi.check(peak=limit)
        memtorch.assert_budget(multi, peak=limit)
        try:
            memtorch.assert_budget(multi, peak=limit - 1)
            out["over"] = None
        except BudgetExceeded as e:
            out["over"] = str(e)
    # 2. a model with an optimizer: phases are gathered as each rank measured them
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters())
    xb = torch.randn(8 * (rank + 1), 32)
    with memtorch.track(model, optimizer=opt) as t2:
        model(xb).sum().backward()
        opt.step()
        opt.zero_grad()
    m2 = t2.report.gather(dst=None)
    out["own2"] = own(t2.report)
    out["rows2"] = [row(m2, r) for r in range(world)]
    emit(**out)


def failure(rank, world):
    """Rank 1 raises inside its block; every rank must get a clear error, and the group stays usable."""
    memtorch.cpu.start()
    out = {}
    try:
        with memtorch.track() as t:
            if rank == 1:
                raise ValueError("boom on rank one")
    except ValueError:
        pass
    try:
        t.report.gather(timeout=60) if rank != 1 else memtorch.distributed.gather(t, timeout=60)
        out["error"] = None
    except MemtorchError as e:
        out["error"] = str(e)
    # the process group is still usable: a normal gather afterwards
    with memtorch.track() as t:
        pass
    again = t.report.gather(dst=None, timeout=60)
    out["after"] = again.world_size
    # a rank that never arrives: rank 1 skips one gather; rank 0 gives up after 2 s
    if rank == 0:
        try:
            t.report.gather(timeout=2)
            out["timeout"] = None
        except MemtorchError as e:
            out["timeout"] = str(e)
        dist.barrier()
    else:
        dist.barrier()  # rank 0 has given up: arriving now must raise, not hang
        try:
            t.report.gather(timeout=30)
            out["late"] = None
        except MemtorchError as e:
            out["late"] = str(e)
    emit(**out)


def main():
    scenario = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        globals()[scenario](dist.get_rank(), dist.get_world_size())
        dist.barrier()  # leave together: a rank that exits first can break a late one's teardown
    finally:
        dist.destroy_process_group()
    # Gloo's transport threads can still abort a normal interpreter exit ("terminate called
    # without an active exception", seen under load in the full suite); every figure is out.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
