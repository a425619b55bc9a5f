"""gather() over NCCL on real CUDA devices (skipped without CUDA; the logic is tested on CPU in
tests/test_distributed.py). One rank per device: NCCL refuses two ranks on one GPU.

Sizes are multiples of 512 B (the caching allocator's rounding), so the hand counts are exact.
"""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import memtorch

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]


def test_one_rank_nccl_gather(tmp_path):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        with memtorch.track(device="cuda") as t:
            x = torch.empty(MiB, device="cuda")  # 4 MiB
            del x
        assert t.report.rank == 0 and t.report.world_size == 1
        multi = t.report.gather(timeout=60)
        assert multi.world_size == 1 and multi.device == "cuda:0"
        assert multi.ranks[0].peak_above_start == t.report.peak_above_start == 4 * MiB
    finally:
        dist.destroy_process_group()
        memtorch.distributed._rounds.clear()


_WORKER = r"""
import os, sys, json, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import memtorch
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
with memtorch.track(device="cuda") as t:
    x = torch.empty((rank + 1) * 2**20, device="cuda")  # 4 MiB on rank 0, 8 MiB on rank 1
    del x
multi = t.report.gather(dst=None, timeout=60)
print("RESULT " + json.dumps([r.peak_above_start for r in multi.ranks]), flush=True)
dist.destroy_process_group()
"""


def test_two_ranks_nccl_gather(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL runs one rank per device)")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
        procs.append(subprocess.Popen([sys.executable, str(script), str(ROOT)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][0]
        assert json.loads(line[7:]) == [4 * MiB, 8 * MiB]
