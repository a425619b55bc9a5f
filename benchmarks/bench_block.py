"""Where a track() block opened around every training step spends its time: Tracker(), open and close.

    python benchmarks/bench_block.py [--blocks 150] [--no-write]

Each block is opened right after a training step, as a loop that opens one per step does, so its code
runs with the caches the step left (cold): the medians of Tracker() (made per step by such a loop),
__enter__ and __exit__, per configuration, interleaved; track(model, optimizer) also by the general path
(the steps any block can take) beside the per-step path such a loop's blocks take (counting held, no
timeline: Tracker._enter_lean and _finish_lean). Then, for track(model, optimizer), what each part
of the block would save if it cost nothing (the part replaced by a stub that returns at once; the report's
figures are then wrong: a measurement of cost only), and the block's bare C calls with none of the Python
around them (scope, ModuleMarks and its hooks, the log, the names): the floor of a block of this design.
Writes the "block" section of BENCHMARKS.md.
"""

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import memtorch  # noqa: E402
from benchmarks._common import machine, write_section  # noqa: E402
from benchmarks.bench_track import make_mlp, make_transformer, train_step  # noqa: E402
from memtorch import _C, cpu, tracking  # noqa: E402

warnings.filterwarnings("ignore")
MODELS = [("MLP 256-512-512-10, batch 64, Adam", make_mlp), (
    "nn.TransformerEncoder, 2 layers, d_model 128, batch 16 x 32 tokens, Adam", make_transformer)]


# The general path: the same block opened and ended by the steps every block can take (Tracker._lean off),
# beside the per-step path a loop's blocks take (Tracker._enter_lean, _finish_lean): what that path saves.
GENERAL = "track(model, optimizer), by the general path"


def _configs(model, opt):
    return {
        "track(model, optimizer)": {"model": model, "optimizer": opt},
        GENERAL: {"model": model, "optimizer": opt},
        "track(model)": {"model": model},
        "track(optimizer=opt)": {"optimizer": opt},
        "track() counters only": {},
    }


def _stubs(model):
    """name -> (install, restore) of a part of the block replaced by a stub (cost only)."""
    plan = tracking._plan_of(model)
    fp, real_fp = plan.fp, _C.modules_fingerprint
    real_known, real_any, real_walk = tracking.Tracker._known_storages, tracking._any_compiled, tracking.Tracker._walk_names

    def walk_open_only(self, full=True, **kw):
        return real_walk(self, full=full, **kw) if full else {}

    def setter(obj, name, value):
        return lambda: setattr(obj, name, value)

    return {
        "the model's fingerprint check (Tracker())": (setter(_C, "modules_fingerprint", lambda mods: fp),
                                                       setter(_C, "modules_fingerprint", real_fp)),
        "the known storages (open)": (setter(tracking.Tracker, "_known_storages", lambda self, *a: None),
                                      setter(tracking.Tracker, "_known_storages", real_known)),
        "the torch.compile check (close)": (setter(tracking, "_any_compiled", lambda refs: False),
                                            setter(tracking, "_any_compiled", real_any)),
        "the names walk of the close": (setter(tracking.Tracker, "_walk_names", walk_open_only),
                                         setter(tracking.Tracker, "_walk_names", real_walk)),
    }


def _skeleton(model, opt):
    """The block's C calls alone, as (open, close): the scope, ModuleMarks with its hooks in and out, the
    log's marks and read, the names of the parameters (cached), the gradients and the sizes at the close."""
    plan = tracking._plan_of(model)  # its names cache filled by the blocks measure() opened before
    direct, optd, cache = tracking._hook_dicts(), tracking._opt_hook_dicts(opt), plan.names

    def open_():
        raw = _C.scope_begin(True)
        procs = cpu._processes()
        tagbase = tracking._next_token() << 24
        m = _C.ModuleMarks(plan.ids, id(model), tagbase, [], torch.is_grad_enabled, None, False)
        m.install(plan.mods, *optd, tuple(tracking._skip_traced(h) for h in (m.pre, m.post, m.opt_pre, m.opt_post)),
                  direct[3])  # fmt: skip
        _C.eventlog_mark(3, 0, tagbase)
        m.params = cache[3]
        _C.counters_serials(cache[4])
        names = dict(cache[6])
        _C.names_walk(names, m.params, None, 2 | 16)
        return raw, procs, m, names

    def close(state):
        raw, _procs, m, names = state
        m.uninstall()
        m.end_phase()
        _C.scope_end(raw[0], raw[1])
        cpu._processes()
        _C.eventlog_mark(3, 0, 0)
        head = _C.eventlog_head()
        _C.eventlog_read_all(raw[4], head, True)
        _C.eventlog_sites(raw[4], head)
        closing = {}
        _C.names_walk(closing, m.params, None, 2 | 16)
        addrs = list(set().union(names, closing))
        dict(zip(addrs, _C.counters_sizes(addrs)))

    return open_, close


def _timed_block(model, opt, x, kw, general=False):
    """(Tracker(), __enter__, __exit__) in ns of a block around a training step, opened right after one;
    general: by the general path (GENERAL)."""
    ns = time.perf_counter_ns
    train_step(model, opt, x)
    a = ns()
    t = memtorch.track(**kw)
    b = ns()
    if general:
        t._lean = False
        b = ns()
    t.__enter__()
    c = ns()
    train_step(model, opt, x)
    d = ns()
    t.__exit__(None, None, None)
    return b - a, c - b, ns() - d


def measure(label, maker, blocks):
    ns = time.perf_counter_ns
    # a model, optimizer and batch of its own per configuration (the same ones), as a loop has: what a
    # block keeps of its model between blocks (its plan, the names of its tensors) is then that loop's
    setups, configs = {}, {}
    for name in _configs(None, None):
        model, opt, x = setups[name] = maker("cpu")
        configs[name] = _configs(model, opt)[name]
        for _ in range(5):
            train_step(model, opt, x)
        with memtorch.track(**configs[name]):  # the first block: plans, caches
            train_step(model, opt, x)
    parts = {name: ([], [], []) for name in configs}
    names = list(configs)
    for i in range(blocks):
        # the order rotated from round to round: a block's cost depends on what ran before it
        for name in names[i % len(names):] + names[:i % len(names)]:
            model, opt, x = setups[name]
            for part, took in zip(parts[name], _timed_block(model, opt, x, configs[name], name == GENERAL)):
                part.append(took)
    model, opt, x = setups["track(model, optimizer)"]
    med = {name: [statistics.median(v) / 1e3 for v in p] for name, p in parts.items()}
    step = []
    for _ in range(blocks // 3 or 1):
        a = ns()
        train_step(model, opt, x)
        step.append(ns() - a)
    step_us = statistics.median(step) / 1e3
    lines = [f"### {label}", "", f"A plain training step here: {step_us:,.0f} us (median of {len(step)}).", "",
             "| block | Tracker() us | open us | close us | total us | % of a step |", "|---|---:|---:|---:|---:|---:|"]
    for name, (i, o, c) in med.items():
        lines.append(f"| {name} | {i:.1f} | {o:.1f} | {c:.1f} | {i + o + c:.1f} | {(i + o + c) / step_us * 100:.1f}% |")

    # what each part would save (stubbed), beside the block as it is, interleaved
    stubs = _stubs(model)
    variants = {"the block as it is": []}
    variants.update({name: [stub] for name, stub in stubs.items()})
    variants["all four above"] = list(stubs.values())
    skeleton_open, skeleton_close = _skeleton(model, opt)
    totals = {name: [] for name in variants}
    totals["its C calls alone (no Python logic)"] = []
    full = configs["track(model, optimizer)"]
    skeleton = "its C calls alone (no Python logic)"
    rows = list(totals)
    for i in range(blocks):
        for name in rows[i % len(rows):] + rows[:i % len(rows)]:  # rotated, as above
            if name == skeleton:
                train_step(model, opt, x)
                a = ns()
                state = skeleton_open()
                b = ns()
                train_step(model, opt, x)  # its hooks in: the step runs them, as in a block
                c = ns()
                skeleton_close(state)
                totals[skeleton].append((b - a) + (ns() - c))
                del state
                continue
            used = variants[name]
            for install, _restore in used:
                install()
            try:
                totals[name].append(sum(_timed_block(model, opt, x, full)))
            finally:
                for _install, restore in used:
                    restore()
    base = statistics.median(totals["the block as it is"]) / 1e3
    lines += ["", "track(model, optimizer), Tracker() + open + close after a step, with a part of it costing nothing "
              "(a stub: the figures are then wrong, a measurement of cost only):", "",
              "| block | us | saves us |", "|---|---:|---:|"]
    for name, v in totals.items():
        m = statistics.median(v) / 1e3
        lines.append(f"| {name} | {m:.1f} | {base - m:+.1f} |")
    return lines + [""]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=150, help="blocks per configuration (each after a step)")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = [
        "## track() opened around every step: where a block's time goes",
        "",
        f"Machine: {machine()}",
        f"memtorch CPU counters: {cpu.mechanism()} (exact: {cpu.exact()}); torch on 1 thread.",
        "",
        f"Each block opened right after a training step (as a loop with a block per step opens it: its code "
        f"runs with the caches the step left), {args.blocks} per configuration, interleaved in an order rotated "
        "from round to round, each configuration with a model, optimizer and batch of its own; medians of wall "
        "time (perf_counter_ns) of Tracker() (a loop makes one per step), __enter__ and __exit__. The general "
        "path: the same block opened and ended by the steps any block can take, beside the per-step path a "
        "loop's blocks take (Tracker._enter_lean, _finish_lean). "
        "`python benchmarks/bench_block.py` rewrites this section.",
        "",
    ]
    for label, maker in MODELS:
        lines += measure(label, maker, args.blocks)
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("block", text)


if __name__ == "__main__":
    main()
