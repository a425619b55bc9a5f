"""bitsandbytes' 8-bit optimizers on a real GPU against estimate(device="cuda") (memtorch._optimizers), in
a fresh process (cuBLAS workspaces are allocated once per process and thread).

On a GPU bitsandbytes' update is one fused kernel per parameter: no tensor beyond the state. A paged
optimizer's state of parameters of 1e5 elements or more is CUDA managed memory, which
torch.cuda.max_memory_allocated() does not count: the estimate counts it in its peak (and says so in a
note), so the measured figure is the estimate less those bytes.
"""

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, torch, memtorch
import bitsandbytes as bnb
from torch import nn
torch.manual_seed(0)
# a weight of 2**20 elements (8-bit, paged when paged), one of 16384 (8-bit, never paged: under 1e5), biases
# of 1024 and 16 (32-bit state)
m = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16))
x = torch.randn(64, 1024)
est = memtorch.estimate(m, x, optimizer={name!r}, device="cuda", keep_output=False)
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
m, x = m.cuda(), x.cuda()
opt = {{"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}}[{name!r}](m.parameters())
for _ in range(2):
    loss = m(x).sum()
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
state = {{}}
for st in opt.state.values():
    for v in st.values():
        if isinstance(v, torch.Tensor):
            state[v.untyped_storage().data_ptr()] = (v.untyped_storage().nbytes(), bool(getattr(v, "is_paged", False)))
print(json.dumps(dict(est=est.peak, true=torch.cuda.max_memory_allocated() - base,
                      est_state=est.model_states["optimizer_state"],
                      paged=sum(b for b, p in state.values() if p),
                      state=sum(-(-b // 512) * 512 for b, p in state.values() if not p))))
"""


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_bnb_8bit_on_this_gpu(name):
    pytest.importorskip("bitsandbytes")
    out = subprocess.run([sys.executable, "-c", CHILD.format(name=name)], capture_output=True, text=True,
                         check=True, timeout=600)  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(name, r)
    paged = r["paged"]
    assert (paged > 0) is (name == "paged_adamw8bit")
    # the state: each tensor a caching-allocator block (512 B granularity); the paged ones at their bytes
    assert r["est_state"] == r["state"] + paged
    assert abs(r["est"] - paged - r["true"]) <= 0.03 * r["true"], r
