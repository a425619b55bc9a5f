"""Cost of the CPU allocation counters: plain vs counting (memtorch.cpu.Scope), in one process.

Workloads: an allocation-heavy loop (torch.empty(256) in a loop), a small MLP
training step and a small transformer training step (the issue's target:
counting at most 1% slower than plain). The profiler with profile_memory=True
runs the same steps as the peer that also sees every CPU allocation.
Plain and counted rounds are interleaved; ratios are medians of per-round
ratios. Writes the "counters" section of BENCHMARKS.md.

    python benchmarks/bench_counters.py            # full run
    python benchmarks/bench_counters.py --quick    # smoke run, writes nothing
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._common import machine, write_section  # noqa: E402
from memtorch import cpu  # noqa: E402


def mlp_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def run():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return run


def transformer_step():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True,
                                             dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 32, 64)

    def run():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return run


def timed(fn, number):
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def compare(fn, number, rounds):
    """Median seconds per call (plain, counting, counting+timeline, profiler) and median ratios.

    Each round runs plain, counting, plain, timeline, plain, profiler, plain:
    every measured run is divided by the mean of the plain runs on both sides
    of it, so slow drifts of a shared machine cancel out.
    """
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()  # warm up
    res = {"plain": [], "count": [], "timeline": [], "profiler": []}
    ratios = {"count": [], "timeline": [], "profiler": []}

    def under(kind):
        if kind == "count":
            return cpu.Scope()
        if kind == "timeline":
            return cpu.Scope(timeline=True)
        return profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    for _ in range(rounds):
        before = timed(fn, number)
        res["plain"].append(before)
        for kind in ("count", "timeline", "profiler"):
            with under(kind):
                t = timed(fn, number)
            after = timed(fn, number)
            res["plain"].append(after)
            res[kind].append(t)
            ratios[kind].append(t / ((before + after) / 2))
            before = after
    med = {k: statistics.median(v) for k, v in res.items()}
    return med, {k: statistics.median(v) for k, v in ratios.items()}


def hook_cost(n, rounds):
    """(plain ns per torch.empty(256) + free, extra ns when counting, extra ns with timeline)."""
    empty = torch.empty

    def loop():
        t0 = time.perf_counter()
        for _ in range(n):
            empty(256)
        return (time.perf_counter() - t0) / n * 1e9

    loop()
    plain, extra, extra_tl = [], [], []
    for _ in range(rounds):
        a = loop()
        with cpu.Scope():
            b = loop()
        c = loop()
        with cpu.Scope(timeline=True):
            d = loop()
        e = loop()
        plain += [a, c, e]
        extra.append(b - (a + c) / 2)
        extra_tl.append(d - (c + e) / 2)
    return statistics.median(plain), statistics.median(extra), statistics.median(extra_tl)


def c_hook_cost(rounds, n=200_000):
    """Median ns of posix_memalign(64, 256) + free direct and through the hooks (timed in C)."""
    from memtorch import _C

    direct, extra = [], []
    with cpu.Scope():
        for _ in range(rounds):
            d, h = _C._counters_bench(n, 256)
            direct.append(d)
            extra.append(h - d)
    return statistics.median(direct), statistics.median(extra)


def chained_hook_cost(rounds, n=200_000):
    """Like c_hook_cost, with another tool (the _C stand-in) under memtorch's hooks: the
    hooks then forward to it through their re-entrancy guard (the slow path)."""
    from memtorch import _C

    extra = []
    # The tool must sit under memtorch (installed first, forwarding to libc), as
    # memray does when its Tracker starts before memtorch installs: release
    # memtorch's own held installation first, and take it back after.
    cpu.keep_counting(False)
    _C._counters_tool("chain")
    try:
        with cpu.Scope():
            assert _C._counters_slot_info("posix_memalign")[2] != _C._counters_slot_info("posix_memalign")[0]
            for _ in range(rounds):
                d, h = _C._counters_bench(n, 256)
                extra.append(h - d)
    finally:
        _C._counters_tool("uninstall")
        cpu.keep_counting(True)
    return statistics.median(extra)


def scope_cost(n=2000, rounds=9):
    """Median us of opening and closing a cpu.Scope (includes the hooks' integrity check)."""
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            with cpu.Scope():
                pass
        per.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(per)


def allocations_per_call(fn):
    from memtorch import _C

    with cpu.Scope():
        before = _C.counters_stats()[2]
        fn()
        return _C.counters_stats()[2] - before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not cpu.exact():
        print(f"exact mechanism unavailable ({cpu.fallback_reason()}): nothing to measure")
        return
    torch.set_num_threads(1)  # one intra-op thread: steadier on a shared machine
    rounds = 3 if args.quick else 25
    n_alloc = 5_000 if args.quick else 20_000
    plain_ns, extra_ns, extra_tl_ns = hook_cost(n_alloc, 5 if args.quick else 41)
    print(f"torch.empty(256): plain {plain_ns:.0f} ns, +{extra_ns:.0f} ns counting, +{extra_tl_ns:.0f} ns timeline",
          flush=True)
    c_direct_ns, c_extra_ns = c_hook_cost(5 if args.quick else 21)
    print(f"C: posix_memalign+free {c_direct_ns:.0f} ns, hooks add {c_extra_ns:.0f} ns", flush=True)
    chained_ns = chained_hook_cost(5 if args.quick else 21)
    scope_us = scope_cost(500 if args.quick else 2000)
    print(f"chained under another tool: hooks add {chained_ns:.0f} ns; Scope open+close {scope_us:.1f} us",
          flush=True)
    work = [
        ("MLP 256-512-512-10, batch 64, Adam step", mlp_step(), 5 if args.quick else 10),
        ("Transformer encoder 2x(d=64, ff=128), batch 4x32, AdamW step", transformer_step(),
         5 if args.quick else 10),
    ]
    rows = []
    for name, fn, number in work:
        med, ratio = compare(fn, number, rounds)
        n = allocations_per_call(fn)
        est = n * c_extra_ns * 1e-9 / med["plain"] * 100
        rows.append(
            f"| {name} | {med['plain'] * 1e3:.3f} ms | {n} | {est:.2f}% | {ratio['count']:.3f}x | "
            f"{ratio['timeline']:.3f}x | {ratio['profiler']:.3f}x |"
        )
        print(rows[-1], flush=True)
    md = "\n".join(
        [
            "## CPU allocation counters (memtorch.cpu)",
            "",
            f"Machine: {machine()}",
            "",
            "Command: `python benchmarks/bench_counters.py`",
            "",
            "Hook cost, timed in C (`_C._counters_bench`: `posix_memalign(64, 256)` + `free` called "
            "directly and through the hooks while counting, median of 200,000-call rounds): direct "
            f"{c_direct_ns:.0f} ns, the hooks add **{c_extra_ns:.0f} ns** per allocation + free. "
            "The same seen from Python, median over interleaved rounds of a `torch.empty(256)` loop "
            f"({n_alloc:,} calls a round) plain and inside `memtorch.cpu.Scope()`: plain {plain_ns:.0f} ns, "
            f"counting adds {extra_ns:.0f} ns, counting with `timeline=True` adds {extra_tl_ns:.0f} ns "
            "(noisier: a shared machine). With another tool's hooks under memtorch's (the `_C` "
            "stand-in tool, chained as memray is when it starts first), memtorch's hooks add "
            f"{chained_ns:.0f} ns over calling that tool directly (the path with the re-entrancy guard). "
            f"Opening and closing a `cpu.Scope()`, the integrity check of the hooks' slots included: "
            f"{scope_us:.1f} us.",
            "",
            "Training steps: plain vs inside `Scope()`, `Scope(timeline=True)` and "
            "`torch.profiler.profile(profile_memory=True)`. Ratios: median over "
            f"{rounds} rounds of each run against the mean of the plain runs just before and after it "
            "(one intra-op thread). \"estimated\" = CPU allocations per step x the C hook cost above / "
            "plain step time: the cost the hooks add, free of the timing noise of a shared machine.",
            "",
            "| step | plain | CPU allocations per step | estimated counting cost | counting / plain | "
            "timeline / plain | profiler / plain |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    if args.quick:
        print(md)
    else:
        write_section("counters", md)


if __name__ == "__main__":
    main()
