"""Cost of memtorch.track() on three training steps (tiny MLP, MLP, small transformer), beside its peers.

One process, interleaved rounds; each round times K steps of every configuration:
  plain                      the bare step
  track() counters           one `with memtorch.track():` block per step
  track(model, optimizer)    one block per step with phases, per-module figures and the
                             event log that at_peak is computed from (when first read)
  ... by the general path    the same block opened and ended by the steps any block can take, not the
                             per-step path a loop's blocks take (counting held, no timeline:
                             Tracker._enter_lean and _finish_lean): what that path saves, in the same run
  ... + at_peak read         the same, reading t.report.at_peak after each block (the replay)
  callbacks' block           what the transformers and Lightning callbacks do at each step: one block
                             (memtorch.integrations.Session, as they open it) around the K steps, its
                             t.step() and the figures they log after every step (they log every
                             logging interval); the block opened and closed outside the timing
  torch.profiler             profile(activities=[CPU], profile_memory=True) around the K steps
  MemTracker                 torch.distributed._tools.mem_tracker, `with mt:` around the K steps
                             (mt.reset_mod_stats() after each step, else step 2 raises)
Each round times every configuration once, in an order rotated from round to
round, each right beside a plain run of its own (plain first in even rounds,
second in odd ones); a configuration's ratio is the median over rounds of (its
time / the time of the plain run beside it), which cancels most of the drift of
a shared machine (a plain run a few configurations away drifts further). torch runs on --threads threads
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


def make_transformer(device):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32, 128, device=device)
    return model, opt, x


def make_mlp(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(64, 256, device=device)


def make_tiny(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(8, 16, device=device)


MODELS = [
    ("tiny MLP 16-16-4, batch 8, Adam", make_tiny, 1.10, False),
    ("MLP 256-512-512-10, batch 64, Adam", make_mlp, 1.05, False),
    ("nn.TransformerEncoder, 2 layers, d_model 128, 4 heads, feed-forward 256, batch 16 x 32 tokens, Adam",
     make_transformer, 1.05, True),
]


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


def measure(label, maker, full_target, peers, device, K, rounds, clock):
    """Time every configuration on one model; returns (table lines, notes, peaks, report)."""
    model, opt, x = maker(device)
    for _ in range(3):
        train_step(model, opt, x)  # optimizer state exists from here on
    dev_type = torch.device(device).type

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev_type == "cuda" else [])
    MemTracker = mt_error = None
    if peers:
        try:
            from torch.distributed._tools.mem_tracker import MemTracker
        except Exception as e:  # noqa: BLE001
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

    def run_full_general():
        for _ in range(K):
            t = memtorch.track(model, optimizer=opt, device=device)
            t._lean = False  # the steps any block can take, not the per-step path (Tracker._enter_lean)
            with t:
                train_step(model, opt, x)

    def run_full_at_peak():
        for _ in range(K):
            with memtorch.track(model, optimizer=opt, device=device) as t:
                train_step(model, opt, x)
            t.report.at_peak  # the replay of the event log

    session = {}  # the callbacks' block of the round (opened and closed outside the timing)

    def session_open():
        from memtorch.integrations import Session

        session["s"] = Session(print_report=False)
        session["s"].open(model, opt)

    def session_close():
        session.pop("s").close()

    def run_session():
        s = session["s"]
        for _ in range(K):
            train_step(model, opt, x)
            s.step()
            s.figures()

    run_session.before, run_session.after = session_open, session_close

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
        ("track(model, optimizer) full, by the general path", run_full_general),
        ("track(model, optimizer) full, at_peak read", run_full_at_peak),
        ("callbacks' block: t.step() and the logged figures per step", run_session),
    ]
    targets = {
        "track() counters only": 1.01,
        "track(model, optimizer) full": full_target,
        "track(model, optimizer) full, at_peak read": full_target,
        "callbacks' block: t.step() and the logged figures per step": full_target,
    }
    notes = []
    if peers:
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
    ratios = {name: [] for name, _ in configs}

    def timed(fn):
        before, after = getattr(fn, "before", None), getattr(fn, "after", None)
        if before is not None:  # what the configuration opens outside the timing (the callbacks' block)
            before()
        sync(device)
        t0 = clock()
        fn()
        sync(device)
        seconds = (clock() - t0) / K
        if after is not None:
            after()
        return seconds

    others = configs[1:]
    for _, fn in configs:  # one untimed run of each: first calls, caches, the optimizer's hooks
        timed(fn)
    for rnd in range(rounds):
        # rotate the order each round, so that no configuration always follows the same one;
        # each beside a plain run of its own, before it in even rounds and after it in odd ones
        for name, fn in others[rnd % len(others):] + others[: rnd % len(others)]:
            if rnd % 2 == 0:
                p, t = timed(run_plain), timed(fn)
            else:
                t, p = timed(fn), timed(run_plain)
            times[name].append(t)
            times["plain"].append(p)
            ratios[name].append(t / p)
    med = {name: statistics.median(v) for name, v in times.items()}
    ratio_of = {name: statistics.median(v) for name, v in ratios.items() if v}
    ratio_of["plain"] = 1.0

    lines = [
        f"### {label}",
        "",
        "| configuration | ms / step (median) | us over plain (median) | ratio to plain (median of rounds) "
        "| ratio of fastest rounds | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, _ in configs:
        ratio = ratio_of[name]  # the target is judged on this one
        target = targets.get(name)
        verdict = "" if target is None else f"<= {target:.2f}: {'met' if ratio <= target else 'MISSED'}"
        fastest = min(times[name]) / min(times["plain"])
        over = (med[name] - med["plain"]) * 1e6
        lines.append(
            f"| {name} | {med[name] * 1e3:.3f} | {over:+.0f} | {ratio:.3f} | {fastest:.3f} | {verdict} |"
        )

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
    lines += [
        "",
        "Fixed cost of opening and closing an empty block (fastest of 200): "
        + "; ".join(f"{n}: {v * 1e6:.0f} us ({v / min(times['plain']) * 100:.1f}% of the fastest plain step)"
                    for n, v in overhead.items())
        + ".",
    ]  # fmt: skip

    # --- peaks of one warmed-up step, each tool on its own -------------------
    with memtorch.track(model, optimizer=opt, device=device) as t:
        train_step(model, opt, x)
    r = t.report
    with memtorch.track(device=device) as t2:
        train_step(model, opt, x)
    peaks = [("memtorch track(model, optimizer) peak above start", r.peak_above_start, r.exact)]
    peaks.append(("memtorch track() peak above start", t2.report.peak_above_start, t2.report.exact))
    if r.at_peak is not None:
        peaks.append(("memtorch at_peak: sum of its owners' bytes (absolute peak)", r.at_peak.total, r.at_peak.exact))
        peaks.append(("memtorch absolute peak", r.peak, r.exact))
    prof_peak = None
    if peers:
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
    fmt = memtorch.units.format
    lines += ["", "Peak of one warmed-up step, as each tool sees it:", "", "| measured by | bytes | |", "|---|---:|---|"]
    for name, value, exact in peaks:
        tag = "" if exact is None else ("exact" if exact else "not exact")
        lines.append(f"| {name} | {value:,} ({fmt(value)}) | {tag} |")
    if prof_peak is not None:
        mem_full = peaks[0][1]
        agree = "agree exactly" if mem_full == prof_peak else f"differ by {mem_full - prof_peak:+,} bytes"
        lines += ["", f"memtorch and the profiler's memory events {agree} on the peak above start."]
    if r.at_peak is not None:
        lines += ["", "The five largest owners at that peak (`t.report.at_peak`):", "", "```"]
        lines += r.at_peak.lines(limit=5)
        lines += ["```"]
    lines += [f"Note: {n}" for n in notes]
    lines.append("")
    return lines, r


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
    ap.add_argument("--models", default="tiny,mlp,transformer", help="comma-separated subset of tiny,mlp,transformer")
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
    dev_type = torch.device(device).type
    chosen = set(args.models.split(","))
    keys = ["tiny", "mlp", "transformer"]
    lines = [
        "## track(): cost on a training step, and peaks beside the peers",
        "",
        f"Machine: {machine()}",
        f"memtorch CPU counters: {memtorch.cpu.mechanism()} (exact: {memtorch.cpu.exact()})"
        if dev_type == "cpu"
        else f"device: {torch.cuda.get_device_name()}",
        "",
        f"{args.rounds} interleaved rounds of {K} steps per configuration, each beside a plain run of its own; "
        f"time per step is the median over rounds, the ratio the median over rounds of (its time / the plain "
        f"run beside it) (the targets are judged on it). "
        f"track() opens one block per step; the profiler and MemTracker one context per round. torch on "
        f"{torch.get_num_threads()} thread(s). Clock: "
        f"{'CPU time of the main thread (time.thread_time)' if clock_name == 'thread' else 'wall (perf_counter)'}."
        " `full` keeps the event log and computes at_peak and the per-module and per-phase figures when the"
        " report is first read; `full, by the general path` is the same block opened and ended by the steps"
        " any block can take instead of the per-step path (Tracker._enter_lean, _finish_lean) that a loop's"
        " blocks take; `full, at_peak read` reads at_peak after every block. The callbacks' block is"
        " what the transformers and Lightning callbacks cost per training step: one block (opened as they open"
        " it, outside the timing) around the round's steps, t.step() and the figures they log after each step"
        " (they log once per logging interval).",
        "",
    ]
    load0 = os.getloadavg()[0]
    last = None
    for key, (label, maker, target, peers) in zip(keys, MODELS):
        if key in chosen:
            more, last = measure(label, maker, target, peers, device, K, args.rounds, clock)
            lines += more
    if clock_name == "thread":
        lines += [
            "With the thread clock, work a tool does in threads of its own (the profiler's collection) "
            "is not counted: run with `--clock wall` for its full cost.",
            "",
        ]
    lines += [
        f"Load average of the machine (1 min) at the start and the end of the run: {load0:.1f}, "
        f"{os.getloadavg()[0]:.1f} (on {os.cpu_count()} CPUs): a loaded machine makes the ratios noisy, "
        "the fixed costs (fastest of 200) much less so.",
        "",
    ]
    lines += [
        f"Reproduce: `python benchmarks/bench_track.py --rounds {args.rounds} --steps {K} "
        f"--threads {args.threads} --clock {args.clock} --device {device} --models {args.models}`",
    ]
    text = "\n".join(lines)
    print(text)
    print()
    print(last)
    if not args.no_write:
        write_section("track" if dev_type == "cpu" else "track-cuda", text)


if __name__ == "__main__":
    main()
