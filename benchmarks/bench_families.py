"""The family table (issue 36): each family of tests/test_family_sweep.py, its CPU estimate against track()
of the real training step (two AdamW steps, counted from before the model exists), fp32 and bf16-mixed
autocast, without and with block checkpointing where the model has a ModuleList of blocks; and the H200 cases
kept in tests/data/h200 against their true max_memory_allocated(). Writes BENCHMARKS.md's "families" section.

    python benchmarks/bench_families.py [--no-write]
"""

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import memtorch  # noqa: E402
from memtorch import cpu  # noqa: E402

from _common import machine, write_section  # noqa: E402


CAVEAT = (
    "The `blocks` rows' real step is the model's own gradient checkpointing where it has one (transformers' "
    "`activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})`, formerly `gradient_checkpointing_enable`: each "
    "GradientCheckpointingLayer recomputed, run without its cache), else this script's wrapping of each block "
    "of the outermost ModuleLists in `torch.utils.checkpoint(..., use_reentrant=False)`: what "
    "`estimate(checkpointing='blocks')` models. The float32 rows, with and without checkpointing, are the "
    "truth the sweep holds, to the byte (tests/test_family_sweep.py). In the bf16 model rows a mixture of "
    "experts' figure is a bound: the experts' grouped matrix products take scratch in bfloat16 on the CPU "
    "that grows with the largest expert's share of the tokens, counted for every token sent to one expert "
    "(the estimate's note says so); ViT's can differ by a few hundred bytes either way from run to run (the "
    "CPU attention backward's scratch is per thread and varies from call to call; the estimate counts the "
    "most of up to 16 runs of that kernel and its note says so where the runs differed)."
)


def _has_blocks(model):
    return any(isinstance(m, torch.nn.ModuleList) and len(m) for m in model.modules())


def _real(sweep, name, precision, ckpt):
    """track()'s peak of two real steps (autocast for bf16-mixed; when ckpt, the model's own gradient
    checkpointing, else torch.utils.checkpoint on each block of its outermost ModuleLists), counted from
    before the model exists."""
    import torch.utils.checkpoint as tc

    cast = precision == "bf16 model"  # the model and its floating-point inputs in bfloat16, no autocast

    def batch_of(name):
        b = sweep._batch(name)
        return {k: v.to(torch.bfloat16) if cast and v.is_floating_point() else v for k, v in b.items()}

    def prepare(model):
        if cast:
            model = model.to(torch.bfloat16)
        if ckpt and getattr(model, "supports_gradient_checkpointing", False):
            # transformers' own gradient checkpointing, as its users turn it on (what estimate's "blocks"
            # models: each block under torch.utils.checkpoint, run without its cache)
            sweep._hf_checkpointing(model)
        elif ckpt:
            from memtorch.estimator.estimate import block_names

            for _name, block in block_names(model):  # the outermost lists' blocks, as estimate's "blocks"
                block.forward = (lambda f: lambda *a, **k: tc.checkpoint(f, *a, use_reentrant=False, **k))(
                    block.forward
                )
        return model

    def run(model, batch, opt):
        ctx = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if precision == "bf16-mixed"
            else contextlib.nullcontext()
        )
        with ctx:
            out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out  # the output kept until the step ends, as estimate()'s keep_output=True

    warm = prepare(sweep._model(name))
    run(warm, batch_of(name), torch.optim.AdamW(warm.parameters(), foreach=False))
    del warm
    gc.collect()
    cpu.start()
    base = cpu.allocated()
    model = prepare(sweep._model(name))
    batch = batch_of(name)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    with memtorch.track() as t:
        for _ in range(2):
            run(model, batch, opt)
    measured = t.report.peak - base
    del opt
    plain = sweep._model(name)  # the estimate's model: unwrapped (estimate checkpoints the blocks itself)
    if cast:
        plain = plain.to(torch.bfloat16)
    est = memtorch.estimate(plain, batch, device="cpu", precision="fp32" if cast else precision,
                            checkpointing="blocks" if ckpt else None)  # fmt: skip
    return measured, est.peak, t.report.exact


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    import test_family_sweep as sweep

    rows = []
    for name in sorted(sweep.FAMILIES):
        blocks = _has_blocks(sweep._model(name))
        for precision in ("fp32", "bf16-mixed", "bf16 model"):
            for ckpt in (False, True) if blocks else (False,):
                try:
                    real, est, exact = _real(sweep, name, precision, ckpt)
                    err = (est - real) / real
                    rows.append((name, precision, "blocks" if ckpt else "-", real, est, est - real,
                                 f"{100 * err:+.3f}%" + ("" if exact else " (track not exact)")))  # fmt: skip
                except Exception as e:  # a setting the family refuses: said in the table
                    rows.append((name, precision, "blocks" if ckpt else "-", None, None, None,
                                 f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))  # fmt: skip
                print(rows[-1], flush=True)
    cases = json.loads((ROOT / "tests" / "data" / "h200" / "cases.json").read_text())
    md = [
        "## Families: the CPU estimate against track(), and the H200 cases against their truth",
        "",
        f"`python benchmarks/bench_families.py` on {machine()}.",
        "",
        "Each family of `tests/test_family_sweep.py` (small configurations, batch 2, sequence 16): "
        "`estimate(device='cpu')` of a training step against `track()` of two real AdamW steps of the same "
        "model and batch, counted from before the model exists, each step's output kept until the step ends as "
        "`estimate()`'s `keep_output=True` keeps it (bf16-mixed: the forward under CPU autocast; blocks: the "
        "model's own gradient checkpointing, see below; bf16 model: the model and its floating-point inputs "
        "in bfloat16, estimated with precision='fp32', which casts nothing). Bytes.",
        "",
        "| family | precision | checkpointing | track() | estimate() | difference | error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, prec, ck, real, est, diff, err in rows:
        cells = ["-" if v is None else f"{v:,}" for v in (real, est, diff)]
        md.append(f"| {name} | {prec} | {ck} | {cells[0]} | {cells[1]} | {cells[2]} | {err} |")
    off = [f"{n} {p}{' blocks' if c == 'blocks' else ''} ({e})" for n, p, c, r, _s, d, e in rows
           if r is None or abs(d) > 0.001 * r]  # fmt: skip
    inexact = [f"{n} {p}{' blocks' if c == 'blocks' else ''} ({d:+,} B)" for n, p, c, r, _s, d, _e in rows
               if r is not None and d != 0]  # fmt: skip
    md += ["", f"Rows more than 0.1% off or refused ({len(off)} of {len(rows)}): " + ("; ".join(off) or "none") + ".",
           f"Rows not to the byte ({len(inexact)} of {len(rows)}): " + ("; ".join(inexact) or "none") + ".",
           "", CAVEAT, "", "The H200 cases (tests/data/h200/cases.json, true figures measured on the GPU): the "
               "\"estimate\" section's CUDA table (`benchmarks/bench_estimate.py`) checks each against its "
               f"max_memory_allocated() ({len(cases.get('cases', cases))} steps).", ""]  # fmt: skip
    text = "\n".join(md)
    print(text)
    if not args.no_write:
        write_section("families", text)


if __name__ == "__main__":
    main()
