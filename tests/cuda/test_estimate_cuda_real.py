"""estimate(device="cuda") against the real GPU's counters, in a fresh process (cuBLAS workspaces are
allocated once per process and thread, so the measured step must be the process's first)."""

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, torch
sys.path.insert(0, {data!r})
import cases, memtorch
m, inputs, loss_fn, opt, precision, ck = cases.build({case!r})
est = memtorch.estimate(m, *inputs, optimizer=opt, loss_fn=loss_fn, precision=precision, device="cuda",
                        keep_output=False)
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
cases.measured_loop(m, inputs, loss_fn, cases.make_optimizer(opt, m.parameters()), precision)
print(json.dumps(dict(est=est.peak, true=torch.cuda.max_memory_allocated() - base,
                      est_reserved=est.reserved_peak, true_reserved=torch.cuda.max_memory_reserved())))
"""


@pytest.mark.parametrize("case", ["mlp-fp32", "lstm-fp32", "encoder-fp32"])
def test_estimate_against_this_gpu(case):
    data = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "h200")
    out = subprocess.run([sys.executable, "-c", CHILD.format(data=data, case=case)], capture_output=True,
                         text=True, check=True, timeout=600)  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(case, r)
    assert abs(r["est"] - r["true"]) <= 0.03 * r["true"], r
