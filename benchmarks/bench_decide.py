"""plan(), advise() and fit() beside one estimate(), on a 7-billion-parameter Llama shape (issue 34).

The model: LlamaConfig(hidden 4096, intermediate 11008, 32 layers, 32 heads, vocabulary 32000) built on the
meta device (no weights), AdamW, bf16-mixed, a batch of 4 x 2048 tokens (input_ids and labels), one
80 GiB GPU (device="cuda", the default; gpu="h100"). In one process, one after the other:

- estimate(): one dry run, the reference time;
- plan(device_memory="80 GiB"): its default grid (fp32 and bf16-mixed, without and with block
  checkpointing, world sizes 1 to 1024 each up to the first that fits, five shardings);
- advise(budget="80 GiB"): every row estimate()'s, plan()'s and fit()'s dry runs shared; twice (the first
  call imports peft and bitsandbytes, for its LoRA and 8-bit rows);
- fit(gpu="h100", vary="batch", checkpointing="blocks", world_size=8, sharding="zero3"): the largest batch per
  rank that fits H100s;
- the same estimate() of an 80-layer shape (the other figures unchanged), twice: how the dry run grows
  with depth.

Each figure is a wall time on this machine, and each ratio is to the estimate() of the same run. The
figures the three print are checked to agree with estimate() for the configuration they name.

    python benchmarks/bench_decide.py [--no-write] [--layers 32]
"""

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import memtorch  # noqa: E402
from benchmarks._common import machine, write_section  # noqa: E402


def llama(layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@contextlib.contextmanager
def dry_runs():
    """[(seconds)] of each estimate() a call makes inside the block (its dry runs: advise() dry-runs each row's
    configuration through estimate(), directly or by the engine plan() and fit() share), measured only."""
    from memtorch.estimator import estimate as module

    real, seen = module.estimate, []

    def timed_estimate(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            seen.append(time.perf_counter() - t0)

    module.estimate = timed_estimate
    try:
        yield seen
    finally:
        module.estimate = real


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = llama(args.layers)
    ids = ((4, 2048), torch.long)
    batch = {"input_ids": ids, "labels": ids}
    kw = dict(optimizer="adamw", precision="bf16-mixed", gpu="h100")
    f = memtorch.units.format
    # the first call pays for what a process does once (imports, kernel probes): the ratios are to a warm one
    _cold, t_cold = timed(lambda: memtorch.estimate(model, batch, **kw))
    est, t_est = timed(lambda: memtorch.estimate(model, batch, **kw))
    print(f"estimate: {t_est:.1f} s, peak {f(est.peak)}, reserved {f(est.reserved_peak)}", flush=True)
    p, t_plan = timed(lambda: memtorch.plan(model, batch, device_memory="80 GiB", gpu="h100"))
    print(
        f"plan: {t_plan:.1f} s, {len(p.fits)} of {len(p.options)} fit, {p.dry_runs} dry runs, best {p.best}",
        flush=True,
    )
    # the floor of plan's time: one estimate() of each configuration of its default grid (each row's figures
    # are one of these dry runs' replayed per rank), one after the other
    t_grid = 0.0
    for prec in ("fp32", "bf16-mixed"):
        for ckpt in (None, "blocks"):
            t_grid += timed(lambda: memtorch.estimate(model, batch, **dict(kw, precision=prec, checkpointing=ckpt)))[1]
    print(f"plan's grid, one estimate() each: {t_grid:.1f} s", flush=True)
    # advise's first call imports peft and bitsandbytes (its LoRA and 8-bit rows): a process does it once
    _adv_cold, t_adv_cold = timed(lambda: memtorch.advise(model, batch, budget="80 GiB", **kw))
    with dry_runs() as adv_runs:
        adv, t_adv = timed(lambda: memtorch.advise(model, batch, budget="80 GiB", **kw))
    print(f"advise: {t_adv:.1f} s (first call {t_adv_cold:.1f} s)", flush=True)
    fit_kw = dict(kw, checkpointing="blocks", world_size=8, sharding="zero3")
    fit, t_fit = timed(lambda: memtorch.fit(model, batch, vary="batch", **fit_kw))
    print(f"fit: {t_fit:.1f} s, batch {fit.value} ({fit.runs} dry runs)", flush=True)
    deep_model = llama(80)  # built on the meta device before the clock starts, as the 32-layer one was
    _deep_cold, t_deep_cold = timed(lambda: memtorch.estimate(deep_model, batch, **kw))
    deep, t_deep = timed(lambda: memtorch.estimate(deep_model, batch, **kw))
    print(f"estimate, 80 layers: {t_deep:.1f} s (first call {t_deep_cold:.1f} s)", flush=True)

    # one answer per question: each figure printed is estimate()'s for the configuration it names
    assert adv.peak == est.peak, (adv.peak, est.peak)
    if p.best is not None:
        b = p.best
        again = memtorch.estimate(
            model,
            {"input_ids": ((b.micro_batch, 2048), torch.long), "labels": ((b.micro_batch, 2048), torch.long)},
            optimizer="adamw",
            precision=b.precision,
            gpu="h100",
            checkpointing=b.checkpointing,
            world_size=b.world_size,
            sharding=b.sharding,
        )
        assert (again.peak, again.reserved_peak) == (b.peak, b.reserved), (again.peak, b)
    at = {"input_ids": ((fit.value, 2048), torch.long), "labels": ((fit.value, 2048), torch.long)}
    assert memtorch.estimate(model, at, **fit_kw).reserved_peak == fit.figures["reserved"]

    rows = [
        ("estimate(), first call of the process", t_cold, f"{t_cold / t_est:.1f}", "the same figures"),
        ("estimate()", t_est, "1.0", f"peak {f(est.peak)}, reserved {f(est.reserved_peak)}"),
        (
            "plan(device_memory='80 GiB')",
            t_plan,
            f"{t_plan / t_est:.1f}",
            f"{len(p.fits)} of {len(p.options)} computed fit ({p.hidden} larger world sizes not computed), "
            f"{p.dry_runs} dry runs; cheapest: "
            + (
                f"{p.best.world_size} GPU(s), {p.best.sharding or '-'}, "
                f"{p.best.precision}, checkpointing {p.best.checkpointing or '-'}, "
                f"reserved {f(p.best.reserved)}"
                if p.best
                else "none"
            ),
        ),
        (
            "estimate() of each configuration of plan's grid, one after the other (fp32 and bf16-mixed, without "
            "and with block checkpointing)",
            t_grid,
            f"{t_grid / t_est:.1f}",
            f"plan() takes {t_plan / t_grid:.2f}x their sum: its 4 dry runs, and each world size and sharding "
            "replayed per rank",
        ),
        (
            "advise(budget='80 GiB'), first call of the process (imports peft and bitsandbytes)",
            t_adv_cold,
            f"{t_adv_cold / t_est:.1f}",
            "the same rows",
        ),
        (
            "advise(budget='80 GiB')",
            t_adv,
            f"{t_adv / t_est:.1f}",
            f"{len(adv.items)} rows; first: {adv.items[0].title if adv.items else '-'}; {len(adv_runs)} dry runs "
            f"(one estimate() per configuration its rows need) took {sum(adv_runs):.1f} s of it "
            f"({sum(adv_runs) / t_est:.1f}x estimate())",
        ),
        (
            "fit(gpu='h100', vary='batch', checkpointing='blocks', world_size=8, sharding='zero3')",
            t_fit,
            f"{t_fit / t_est:.1f}",
            f"batch {fit.value} fits ({fit.runs} dry runs at {', '.join(str(v) for v, _ in fit.tried)})",
        ),
        (
            "estimate(), 80 layers, first call on that model",
            t_deep_cold,
            f"{t_deep_cold / t_est:.1f}",
            "the same figures",
        ),
        ("estimate(), 80 layers", t_deep, f"{t_deep / t_est:.1f}", f"peak {f(deep.peak)}"),
    ]
    md = [
        "## Decisions: plan(), advise() and fit() beside one estimate()",
        "",
        f"`python benchmarks/bench_decide.py` on {machine()}.",
        "",
        f"A {args.layers}-layer Llama-2-7B shape (hidden 4096, intermediate 11008, vocabulary 32000) on the "
        "meta device, AdamW, bf16-mixed, batch 4 x 2048 tokens, one 80 GiB GPU (device cuda, gpu h100). The "
        "ratio is each call's wall time over the second estimate()'s of the same run (the first pays for what a "
        "process does once: imports, kernel probes; so do advise's first call, which imports peft and "
        "bitsandbytes, and the first estimate() of the 80-layer model, built before the clock starts); every "
        "figure the three print was checked against estimate() of the configuration it names (the script "
        "asserts it).",
        "",
        "| call | seconds | x estimate() | what it answered |",
        "|---|---:|---:|---|",
    ]
    md += [f"| {a} | {t:.1f} | {r} | {w} |" for a, t, r, w in rows]
    md.append("")
    text = "\n".join(md)
    print(text)
    if not args.no_write:
        write_section("decide", text)


if __name__ == "__main__":
    main()
