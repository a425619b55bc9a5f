"""estimate(device="cuda") against this machine's GPU: one fresh process per training step.

For each step (the five cases of tests/data/h200/cases.py, fp32 and bf16-mixed, and the two
transformer cases with checkpointing: 12 steps), a child process builds the model, estimates the
step for this GPU (estimate(device="cuda"), the GPU's own rules: gpu=None reads it), then runs the
measured loop of cases.py on the GPU (two steps: forward, loss, the output deleted, backward,
optimizer step, zero_grad) and reads torch.cuda.max_memory_allocated() / max_memory_reserved()
counted from before the model was moved there. A fresh process each: cuBLAS's workspaces are
allocated once per process and thread, so the measured step is the process's first, as the
estimate models it.

Writes the section "estimate-gpu" of BENCHMARKS.md: the GPU, torch and CUDA versions, and per
step the estimated and true peak and reserved peak with the error.

    python benchmarks/bench_estimate_gpu.py [--no-write] [--cases mlp-fp32,gpt2-fp32] [--device cpu]

--device cpu is a dry run of the script on a machine without CUDA: estimate(device="cpu") against
track()'s peak of the same loop on the CPU (small cases only: the GPU cases take minutes there).
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, write_section  # noqa: E402

DATA = ROOT / "tests" / "data" / "h200"
# (case of cases.py, precision, checkpointing)
STEPS = [(c, p, None) for c in ("mlp-fp32", "gpt2-fp32", "resnet18-fp32", "lstm-fp32", "encoder-fp32")
         for p in ("fp32", "bf16-mixed")] + [("gpt2-fp32", "bf16-mixed", "blocks"), ("encoder-fp32", "fp32", "blocks")]

CHILD = r"""
import contextlib, json, sys, time, torch
sys.path.insert(0, {data!r})
import cases, memtorch
from memtorch import cpu
device, precision, ck = {device!r}, {precision!r}, {ck!r}
m, inputs, loss_fn, opt, _, _ = cases.build({case!r})
t0 = time.perf_counter()
est = memtorch.estimate(m, *inputs, optimizer=opt, loss_fn=loss_fn, precision=precision, device=device,
                        checkpointing=ck, keep_output=False)
seconds = time.perf_counter() - t0
if device == "cuda":
    ctx = memtorch.checkpointing(m, ck) if ck else contextlib.nullcontext()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with ctx:
        cases.measured_loop(m, inputs, loss_fn, cases.make_optimizer(opt, m.parameters()), precision)
    true, reserved = torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved()
else:  # dry run: the CPU's exact counters around the same loop, from before the model is counted
    cpu.start()
    base = cpu.allocated()
    m, inputs, loss_fn, opt, _, _ = cases.build({case!r})
    ctx = memtorch.checkpointing(m, ck) if ck else contextlib.nullcontext()
    with ctx, memtorch.track() as t:
        cases.measured_loop(m, inputs, loss_fn, cases.make_optimizer(opt, m.parameters()), precision, device="cpu")
    true, reserved = t.report.peak - base, None
print(json.dumps(dict(est=est.peak, true=true, est_reserved=est.reserved_peak, true_reserved=reserved,
                      seconds=seconds)))
"""

ENV = r"""
import json, torch
d = dict(torch=torch.__version__, cuda=torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(gpu=p.name, cc=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version())
print(json.dumps(d))
"""


def run(case, precision, ck, device, timeout):
    code = CHILD.format(data=str(DATA), case=case, precision=precision, ck=ck, device=device)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def num(v):
    return "" if v is None else f"{v:,}"


def pct(est, true):
    return "" if est is None or not true else f"{100 * (est - true) / true:+.1f}%"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated cases of cases.py (default: all)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=int, default=300, help="seconds per step")
    args = ap.parse_args()
    only = set(filter(None, args.cases.split(",")))
    steps = [s for s in STEPS if not only or s[0] in only]
    env = json.loads(subprocess.run([sys.executable, "-c", ENV], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])  # fmt: skip
    if args.device == "cuda" and "gpu" not in env:
        sys.exit("no CUDA device: run with --device cpu for a dry run")
    rows, within, t0 = [], 0, time.perf_counter()
    for case, precision, ck in steps:
        r = run(case, precision, ck, args.device, args.timeout)
        name = f"{case.rsplit('-', 1)[0]} {precision}" + (f", checkpointing {ck}" if ck else "")
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error']} | | | | | |")
            print(name, "FAILED", r["error"], flush=True)
            continue
        ok = abs(r["est"] - r["true"]) <= 0.05 * r["true"]
        within += ok
        rows.append(
            f"| {name} | {num(r['est'])} | {num(r['true'])} | {pct(r['est'], r['true'])} | "
            f"{num(r['est_reserved'])} | {num(r['true_reserved'])} | {pct(r['est_reserved'], r['true_reserved'])} |"
        )
        print("done:", rows[-1], flush=True)
    where = (f"{env['gpu']} (compute capability {env['cc']}), torch {env['torch']}, CUDA {env['cuda']}, "
             f"cuDNN {env.get('cudnn')}" if args.device == "cuda" else f"CPU dry run, torch {env['torch']}")  # fmt: skip
    lines = [
        f"Measured on {where}, {time.strftime('%Y-%m-%d')}; {time.perf_counter() - t0:.0f} s.",
        "",
        "estimate(device=\"cuda\") of each step (the GPU's own rules) against two real steps in a fresh "
        "process: torch.cuda.max_memory_allocated() counted from before the model was moved to the GPU, "
        "and max_memory_reserved(). Bytes.",
        "",
        "| step | estimated peak | true peak | error | estimated reserved | true reserved | error |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Peak within 5%: {within} of {len(steps)}.",
        "",
        "Rewrite with `python benchmarks/bench_estimate_gpu.py` on a CUDA machine (benchmarks/device_check.sh runs it).",
    ]
    print("\n".join(lines))
    if not args.no_write and args.device == "cuda":
        write_section("estimate-gpu", "## estimate against this GPU\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
