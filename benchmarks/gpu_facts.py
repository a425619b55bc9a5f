"""What a fresh process does on this GPU, against what estimate(device="cuda") assumes.

Each question runs in its own fresh process (cuBLAS's workspaces are per process and thread):
- bf16-first: the first matmul of the process is bf16. Does it allocate the cuBLAS workspace the
  estimate adds (memtorch.estimator.allocator.GPU.cublas_workspace), as the first fp32 matmul does
  (facts.json: 33,554,432 B on the H200)? facts.json's after_first_bf16_matmul = 0 was read after an fp32 matmul.
- fp32-first: the same for an fp32 matmul (the known figure, as a control).
- sdpa-dropout-<p>: which attention kernel a bf16 SDPA forward+backward with dropout p runs, against
  memtorch.estimator.allocator.sdpa_backend (torch 2.12+ leaves cuDNN for a p that is not a multiple of 1/16).

Prints one line per question ("agrees" / "DIFFERS") and a JSON object; exit status 0 when all agree,
1 when one differs, 2 without CUDA.

    python benchmarks/gpu_facts.py [--json FILE]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MATMUL = r"""
import json, torch
from memtorch.estimator.allocator import resolve_gpu
dtype = getattr(torch, {dtype!r})
a = torch.randn(256, 256, device="cuda", dtype=dtype)
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
c = a @ a
torch.cuda.synchronize()
grown = torch.cuda.memory_allocated() - before - c.untyped_storage().nbytes()
print(json.dumps({{"measured": grown, "modelled": resolve_gpu().cublas_workspace}}))
"""

SDPA = r"""
import json, torch
import torch.nn.functional as F
from memtorch.estimator.allocator import resolve_gpu, sdpa_backend
q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    F.scaled_dot_product_attention(q, q, q, dropout_p={p!r}).sum().backward()
names = {{e.key for e in prof.key_averages()}}
ran = sorted(k for k in ("cudnn", "flash", "efficient", "math")
             if any(f"_scaled_dot_product_{{k}}_attention" in n for n in names))
if not ran and any("_scaled_dot_product_attention_math" in n for n in names):
    ran = ["math"]
m = q.detach().to("meta").requires_grad_()
modelled = sdpa_backend(m, m, m, None, {p!r}, False, resolve_gpu())
print(json.dumps({{"measured": ",".join(ran) or "?", "modelled": modelled}}))
"""


def child(code):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["rc %d" % r.returncode])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the answers to this file")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_facts: no usable CUDA device; nothing to measure")
        return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
          f"cuDNN {torch.backends.cudnn.version()}")  # fmt: skip
    answers = {
        "bf16-first": child(MATMUL.format(dtype="bfloat16")),
        "fp32-first": child(MATMUL.format(dtype="float32")),
    }
    for p in (0.1, 0.125):
        answers[f"sdpa-dropout-{p}"] = child(SDPA.format(p=p))
    status = 0
    for name, a in answers.items():
        if "error" in a:
            verdict, status = f"ERROR {a['error']}", 1
        elif a["measured"] == a["modelled"]:
            verdict = "agrees"
        else:
            verdict, status = "DIFFERS", 1
        print(f"{name:22} measured {a.get('measured')!s:>12}  modelled {a.get('modelled')!s:>12}  {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(answers, f, indent=1)
    print(json.dumps(answers))
    return status


if __name__ == "__main__":
    sys.exit(main())
