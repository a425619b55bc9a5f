"""Cost of memtorch.track() on a small transformer training step, beside its peers.

One process, interleaved rounds; each round times K steps of every configuration:
  plain                      the bare step
  track() counters           one `with memtorch.track():` block per step
  track(model, optimizer)    one block per step with phases and per-module figures
  torch.profiler             profile(activities=[CPU], profile_memory=True) around the K steps
  MemTracker                 torch.distributed._tools.mem_tracker, `with mt:` around the K steps
                             (mt.reset_mod_stats() after each step, else step 2 raises)
Each round times every configuration once, in an order rotated from round to
round; a configuration's ratio is the median over rounds of (its time / the
plain time of the same round), which cancels most of the drift of a shared
machine. torch runs on --threads threads
(default 1) to keep other processes' load from dominating the figures.

Peaks: one warmed-up step measured by each tool: memtorch's peak above start,
the profiler's peak above start from its raw [memory] events (running sum of
allocation sizes), and MemTracker's peak (absolute, of the tensors it tracks)
minus its current total at entry.

    python benchmarks/bench_track.py [--rounds 30] [--steps 5] [--threads 1] [--clock auto|thread|wall]
                                     [--device cpu|cuda] [--no-write]
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import memtorch  # noqa: E402
from benchmarks._common import machine, write_section  # noqa: E402

warnings.filterwarnings("ignore")


def make(device):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32, 128, device=device)
    return model, opt, x


def train_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def quiet():
    """Silence the profiler's start/stop lines, which kineto writes to file descriptors 1 and 2."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [devnull]:
            os.close(fd)


def profiler_peak(events, device_type):
    """Peak above start of the running sum of [memory] event sizes for one device type."""
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == device_type)
    run = peak = 0
    for _, n in mem:
        run += n
        peak = max(peak, run)
    return peak, len(mem)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5, help="steps per configuration per round")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument(
        "--clock",
        choices=("auto", "thread", "wall"),
        default="auto",
        help="thread: CPU time of the main thread (with 1 torch thread on the CPU all the work runs there, "
        "and other processes' load barely shows); wall: perf_counter; auto: thread on CPU with 1 thread",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    device = args.device
    K = args.steps
    if args.threads:
        torch.set_num_threads(args.threads)
    clock_name = args.clock
    if clock_name == "auto":
        clock_name = "thread" if (device == "cpu" and torch.get_num_threads() == 1) else "wall"
    clock = time.thread_time if clock_name == "thread" else time.perf_counter
    model, opt, x = make(device)
    for _ in range(3):
        train_step(model, opt, x)  # optimizer state exists from here on
    dev_type = torch.device(device).type

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev_type == "cuda" else [])
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception as e:  # noqa: BLE001
        MemTracker = None
        mt_error = f"{type(e).__name__}: {e}"

    def run_plain():
        for _ in range(K):
            train_step(model, opt, x)

    def run_counters():
        for _ in range(K):
            with memtorch.track(device=device):
                train_step(model, opt, x)

    def run_full():
        for _ in range(K):
            with memtorch.track(model, optimizer=opt, device=device):
                train_step(model, opt, x)

    def run_profiler():
        with quiet(), profile(activities=activities, profile_memory=True):
            for _ in range(K):
                train_step(model, opt, x)

    mt_holder = {}

    def run_memtracker():
        mt = mt_holder.get("mt")
        if mt is None:
            mt = mt_holder["mt"] = MemTracker()
            mt.track_external(model, opt)
        with mt:
            for _ in range(K):
                train_step(model, opt, x)
                mt.reset_mod_stats()

    configs = [
        ("plain", run_plain),
        ("track() counters only", run_counters),
        ("track(model, optimizer) full", run_full),
    ]
    notes = []
    try:
        run_profiler()
        configs.append(("torch.profiler profile_memory", run_profiler))
    except Exception as e:  # noqa: BLE001
        notes.append(f"torch.profiler did not run here: {type(e).__name__}: {e}")
    if MemTracker is not None:
        try:
            run_memtracker()
            configs.append(("MemTracker", run_memtracker))
        except Exception as e:  # noqa: BLE001
            notes.append(f"MemTracker did not run here: {type(e).__name__}: {e}")
    else:
        notes.append(f"MemTracker could not be imported: {mt_error}")

    times = {name: [] for name, _ in configs}
    for rnd in range(args.rounds):
        # rotate the order each round, so that no configuration always follows the same one
        for name, fn in configs[rnd % len(configs):] + configs[: rnd % len(configs)]:
            sync(device)
            t0 = clock()
            fn()
            sync(device)
            times[name].append((clock() - t0) / K)
    med = {name: statistics.median(v) for name, v in times.items()}
    ratio_of = {
        name: statistics.median(t / p for t, p in zip(v, times["plain"])) for name, v in times.items()
    }
    targets = {"track() counters only": 1.01, "track(model, optimizer) full": 1.05}

    # --- fixed cost of a block, without the step (fastest of many: noise only adds) ---
    def empty_counters():
        with memtorch.track(device=device):
            pass

    def empty_full():
        with memtorch.track(model, optimizer=opt, device=device):
            pass

    overhead = {}
    for name, fn in (("track() counters only", empty_counters), ("track(model, optimizer) full", empty_full)):
        best = float("inf")
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        overhead[name] = best

    # --- peaks of one warmed-up step, each tool on its own -------------------
    with memtorch.track(model, optimizer=opt, device=device) as t:
        train_step(model, opt, x)
    r = t.report
    with memtorch.track(device=device) as t2:
        train_step(model, opt, x)
    peaks = [("memtorch track(model, optimizer) peak above start", r.peak_above_start, r.exact)]
    peaks.append(("memtorch track() peak above start", t2.report.peak_above_start, t2.report.exact))
    prof_peak = None
    try:
        with quiet(), profile(activities=activities, profile_memory=True) as prof:
            train_step(model, opt, x)
        from torch.autograd import DeviceType

        pdev = DeviceType.CUDA if dev_type == "cuda" else DeviceType.CPU
        prof_peak, n_events = profiler_peak(prof.profiler.kineto_results.events(), pdev)
        peaks.append((f"torch.profiler peak above start ({n_events} memory events)", prof_peak, True))
    except Exception as e:  # noqa: BLE001
        notes.append(f"profiler peak not read: {type(e).__name__}: {e}")
    if any(n.startswith("MemTracker") for n, _ in configs):
        try:
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                cur = mt.get_tracker_snapshot("current")
                start_total = sum(v.get("Total", 0) for d, v in cur.items() if torch.device(d).type == dev_type)
                train_step(model, opt, x)
                mt.reset_mod_stats()
                pk = mt.get_tracker_snapshot("peak")
            mt_peak = sum(v.get("Total", 0) for d, v in pk.items() if torch.device(d).type == dev_type)
            peaks.append(("MemTracker peak (absolute, tracked tensors)", mt_peak, None))
            peaks.append(("MemTracker peak above its total at entry", mt_peak - start_total, None))
        except Exception as e:  # noqa: BLE001
            notes.append(f"MemTracker peak not read: {type(e).__name__}: {e}")

    # --- write -----------------------------------------------------------------
    fmt = memtorch.units.format
    lines = [
        "## track(): cost on a training step, and peaks beside the peers",
        "",
        f"Machine: {machine()}",
        f"memtorch CPU counters: {memtorch.cpu.mechanism()} (exact: {memtorch.cpu.exact()})"
        if dev_type == "cpu"
        else f"device: {torch.cuda.get_device_name()}",
        "",
        f"Model: nn.TransformerEncoder, 2 layers, d_model 128, 4 heads, feed-forward 256, batch 16 x 32 "
        f"tokens, Adam, on {device}. {args.rounds} interleaved rounds of {K} steps per configuration; "
        f"time per step is the median over rounds, the ratio the median of per-round ratios to the plain "
        f"step. track() opens one block per step; the profiler and MemTracker one context per round. "
        f"Clock: {'CPU time of the main thread (time.thread_time)' if clock_name == 'thread' else 'wall (perf_counter)'}.",
        "",
        "| configuration | ms / step (median) | ratio to plain (median of rounds) | ratio of fastest rounds | target |",
        "|---|---:|---:|---:|---|",
    ]
    for name, _ in configs:
        ratio = ratio_of[name]  # the target is judged on this one
        target = targets.get(name)
        verdict = "" if target is None else f"<= {target:.2f}: {'met' if ratio <= target else 'MISSED'}"
        fastest = min(times[name]) / min(times["plain"])
        lines.append(f"| {name} | {med[name] * 1e3:.3f} | {ratio:.3f} | {fastest:.3f} | {verdict} |")
    if clock_name == "thread":
        lines += [
            "",
            "With the thread clock, work a tool does in threads of its own (the profiler's collection) "
            "is not counted: run with `--clock wall` for its full cost.",
        ]
    lines += [
        "",
        "Fixed cost of opening and closing an empty block (fastest of 200): "
        + "; ".join(f"{n}: {v * 1e6:.0f} us ({v / min(times['plain']) * 100:.2f}% of the fastest plain step)"
                    for n, v in overhead.items())
        + ". Full tracking adds its module hooks' cost on each forward on top of this.",
    ]  # fmt: skip
    lines += ["", "Peak of one warmed-up step, as each tool sees it:", "", "| measured by | bytes | |", "|---|---:|---|"]
    for name, value, exact in peaks:
        tag = "" if exact is None else ("exact" if exact else "not exact")
        lines.append(f"| {name} | {value:,} ({fmt(value)}) | {tag} |")
    mem_full = peaks[0][1]
    if prof_peak is not None:
        agree = "agree exactly" if mem_full == prof_peak else f"differ by {mem_full - prof_peak:+,} bytes"
        lines += ["", f"memtorch and the profiler's memory events {agree} on the peak above start."]
    lines += ["", *[f"Note: {n}" for n in notes]] if notes else []
    lines += [
        "",
        f"Reproduce: `python benchmarks/bench_track.py --rounds {args.rounds} --steps {K} "
        f"--threads {args.threads} --clock {args.clock} --device {device}`",
    ]
    text = "\n".join(lines)
    print(text)
    print()
    print(r)
    if not args.no_write:
        write_section("track" if dev_type == "cpu" else "track-cuda", text)


if __name__ == "__main__":
    main()
