"""Per-rank memory of a DDP training step, gathered on rank 0.

Run on one machine with two CPU ranks:

    torchrun --standalone --nproc_per_node=2 examples/ddp_torchrun.py

(``python examples/ddp_torchrun.py`` starts that command for you.) Each rank
measures its own process with memtorch's CPU counters; ``t.report.gather()``
brings every rank's figures to rank 0 over torch.distributed (gloo here, NCCL
on GPUs) and prints one row per rank, the highest, the lowest and the
imbalance. The budget then applies to the rank that peaked highest.
"""

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import memtorch


def main():
    memtorch.cpu.start()  # count from the start, so every free is seen
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # uneven data: the last rank gets a larger batch, so the ranks differ
    batch = 64 if rank < world - 1 else 128
    g = torch.Generator().manual_seed(rank)
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(3):
            x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t.step()
    print(f"rank {rank}: peak {memtorch.units.format(t.report.peak_above_start)} above block start", flush=True)
    multi = t.report.gather()  # every rank calls it; the report lands on rank 0
    if rank == 0:
        print(multi)
        multi.check(peak="64 MiB")  # the highest rank's peak must stay within 64 MiB
        print("budget: every rank within 64 MiB")
    dist.barrier()  # every rank leaves together: a rank that exits first can break a late one's teardown
    dist.destroy_process_group()
    # gloo's transport threads can still abort a normal interpreter exit under load ("terminate called
    # without an active exception", seen once in CI after every figure was printed): leave at once
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:  # started without torchrun: start two ranks with it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        print("$ torchrun --standalone --nproc_per_node=2", os.path.relpath(__file__), flush=True)
        sys.exit(subprocess.call(cmd))
