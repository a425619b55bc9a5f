"""Cost of at_peak's source lines (src/sites.c): what one allocation of 4 KiB or more,
made in a track() block outside its phases, pays for its line, and what the allocation
hook pays with no block open.

  sites               torch.empty(1024) (4 KiB) in a loop inside `with memtorch.track(model):`,
                      outside any phase, with the lines taken (the default threshold) and
                      not taken (_C.eventlog_sites_config(0, ...)); one process, paired
                      rounds in alternating order, the median of the per-round differences
  hook, no block      _C._counters_bench: posix_memalign + free through the hooks minus
                      called directly, counters installed, no event log running

    python benchmarks/bench_sites.py [--rounds 21] [--n 2000] [--no-write]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import memtorch  # noqa: E402
from benchmarks._common import machine, write_section  # noqa: E402
from memtorch import _C  # noqa: E402


def per_alloc_ns(model, n):
    with memtorch.track(model):
        t0 = time.thread_time_ns()
        for _ in range(n):
            torch.empty(1024)  # 4 KiB, outside any phase
        return (time.thread_time_ns() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--n", type=int, default=2000, help="allocations per block")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    memtorch.cpu.start()
    model = torch.nn.Linear(4, 4)
    prev = _C.eventlog_sites_config(0, 0)
    _C.eventlog_sites_config(*prev)
    on, off = [], []
    try:
        for r in range(args.rounds):
            for with_sites in (True, False) if r % 2 else (False, True):
                _C.eventlog_sites_config(prev[0] if with_sites else 0, prev[1])
                (on if with_sites else off).append(per_alloc_ns(model, args.n))
    finally:
        _C.eventlog_sites_config(*prev)
    hook = {64: [], 8192: []}
    for _ in range(args.rounds):
        for size in hook:
            direct, hooked = _C._counters_bench(100_000, size)
            hook[size].append(hooked - direct)
    memtorch.cpu.stop()
    diff = statistics.median(a - b for a, b in zip(on, off))
    md = [
        "## at_peak's source lines: cost",
        "",
        f"Machine: {machine()}",
        "",
        "| what | ns |",
        "|---|---:|",
        f"| torch.empty(1024) in a block outside phases, lines taken (median) | {statistics.median(on):.0f} |",
        f"| the same, lines not taken (median) | {statistics.median(off):.0f} |",
        f"| a line, per allocation of 4 KiB or more (median of {args.rounds} paired rounds) | {diff:.0f} |",
        f"| allocation hook with no block open, 64 B (median) | {statistics.median(hook[64]):.1f} |",
        f"| allocation hook with no block open, 8 KiB (median) | {statistics.median(hook[8192]):.1f} |",
        "",
        f"Reproduce: `python benchmarks/bench_sites.py --rounds {args.rounds} --n {args.n}`",
    ]
    text = "\n".join(md)
    print(text)
    if not args.no_write:
        write_section("sites", text)


if __name__ == "__main__":
    main()
