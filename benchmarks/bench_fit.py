"""fit(): how many dry runs it makes to find the largest batch (or sequence length) that fits (issue 34).

Six searches on 4-layer shapes built on the meta device (no weights), each started from a small value
(the inputs' batch of 1 or 2, where the optimizer's phase is still the step's peak): a Llama-2-7B shape
(hidden 4096, intermediate 11008, vocabulary 32000, 512 tokens) on an L4, on an H100 in bf16-mixed, on
an A100-80GB with block checkpointing and on the CPU with 20 GiB; GPT-2's shape (768 wide, 512 tokens)
on an L4, and by sequence length on a T4. For each: the answer, the values the dry runs were made at,
and the check that estimate() at the answer fits and at the value above it does not (the script asserts
it), and that every smaller value its notes name as predicted not to fit does not (estimate() at each).
The ideal is four dry runs (two to predict from, the answer and the value above it).

    python benchmarks/bench_fit.py [--no-write]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import memtorch  # noqa: E402
from benchmarks._common import machine, write_section  # noqa: E402


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(n_layer=4))


def ids(b, s):
    return {"input_ids": ((b, s), torch.long), "labels": ((b, s), torch.long)}


CASES = [
    ("Llama shape, L4", llama, ids(2, 512), dict(gpu="l4")),
    ("Llama shape, H100, bf16-mixed", llama, ids(2, 512), dict(gpu="h100", precision="bf16-mixed")),
    ("Llama shape, A100-80GB, block checkpointing", llama, ids(2, 512),
     dict(gpu="a100-80gb", checkpointing="blocks")),
    ("Llama shape, CPU, 20 GiB", llama, ids(1, 256), dict(device="cpu", device_memory="20 GiB")),
    ("GPT-2 shape, L4", gpt2, ids(2, 512), dict(gpu="l4")),
    ("GPT-2 shape, T4, by sequence length", gpt2, ids(2, 128), dict(gpu="t4", vary="seq")),
]  # fmt: skip


def _named_holes(notes):
    """The smaller values a fit's notes name as predicted not to fit ('batch=5, 7, 82-85 predicted ...')."""
    for n in notes:
        if n.startswith("not every smaller"):
            spec = n.split("=", 1)[1].split(" predicted", 1)[0]
            out = []
            for part in spec.split(", "):  # ranges apart by ", ", thousands by a bare ","
                lo, _, hi = part.replace(",", "").partition("-")
                out += list(range(int(lo), int(hi or lo) + 1))
            return out
    return []


def _ranges(values):
    return memtorch.estimator.fit._ranges(values) if values else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()
    rows = []
    for name, make, inputs, kw in CASES:
        model = make()
        t0 = time.perf_counter()
        f = memtorch.fit(model, inputs, **kw)
        seconds = time.perf_counter() - t0
        vary = kw.get("vary", "batch")
        est_kw = {k: v for k, v in kw.items() if k not in ("vary", "device_memory")}
        budget = f.device_memory - f.reserve

        def judged(v):
            (b, s) = inputs["input_ids"][0]
            e = memtorch.estimate(model, ids(v, s) if vary == "batch" else ids(b, v), **est_kw)
            return e.peak if e.device == "cpu" else e.reserved_peak

        assert judged(f.value) <= budget, name
        if f.next_value is not None:
            assert judged(f.next_value) > budget, name
        holes = _named_holes(f.notes)
        assert all(judged(v) > budget for v in holes), (name, holes)
        tried = ", ".join(str(v) for v, _ in f.tried)
        print(f"{name}: {vary} {f.value} ({len(f.tried)} dry runs at {tried}), {seconds:.1f} s", flush=True)
        rows.append((name, vary, f.value, f.next_value, len(f.tried), tried, _ranges(holes) or "-", seconds))
    md = [
        "## fit(): dry runs to the largest batch that fits",
        "",
        f"`python benchmarks/bench_fit.py` on {machine()}.",
        "",
        "Four-layer shapes on the meta device, AdamW, each search started from a small value (the optimizer's "
        "phase is the step's peak there, the backward's at the answer). The script asserts that estimate() at "
        "the answer fits and at the value above it does not, and that each smaller value the notes name as "
        "predicted not to fit (the caching allocator's segments) does not: estimate() at each. Four dry runs is "
        "the least a search can make (two to predict from, the answer and the value above it).",
        "",
        "| search | varies | answer | does not fit | dry runs | at | smaller, not fitting (checked) | seconds |",
        "|---|---|---:|---:|---:|---|---|---:|",
    ]
    md += [
        f"| {n} | {v} | {a} | {'-' if b is None else b} | {r} | {t} | {h} | {s:.1f} |"
        for n, v, a, b, r, t, h, s in rows
    ]
    md.append("")
    text = "\n".join(md)
    print(text)
    if not args.no_write:
        write_section("fit", text)


if __name__ == "__main__":
    main()
