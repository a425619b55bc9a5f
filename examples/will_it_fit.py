"""Will it fit? GPT-2 small (124M parameters) on one 24 GB L4, without a GPU and without weights.

    python examples/will_it_fit.py

The model is built on the meta device from its configuration (nothing allocated); every figure below is
memtorch.estimate()'s for the configuration it names: plan(), fit() and advise() ask the same engine and
share its dry runs, so they agree with each other and with estimate() to the byte.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

import memtorch

logging.set_verbosity_error()
with torch.device("meta"):
    model = GPT2LMHeadModel(GPT2Config())  # 124M parameters, 12 blocks, 1024 positions
ids = ((16, 1024), torch.long)  # a batch of 16 sequences of 1024 tokens
batch = {"input_ids": ids, "labels": ids}
step = dict(optimizer="adamw", precision="bf16-mixed", gpu="l4")

# 1. Does the step fit? (the caching allocator's reserved figure is what the device must hold)
est = memtorch.estimate(model, batch, **step)
print(
    f"estimate: peak {memtorch.units.format(est.peak)}, reserved {memtorch.units.format(est.reserved_peak)}"
)

# 2. The largest batch that fits one L4 (24 GiB, 1 GiB kept free for the CUDA context)
print(memtorch.fit(model, batch, **step), end="\n\n")

# 3. What to change to train the batch of 16 on it, in the order one would try it
print(memtorch.advise(model, batch, budget="24 GiB", **step), end="\n\n")

# 4. Every way to train it on 24 GiB devices, cheapest first
print(memtorch.plan(model, batch, device_memory="24 GiB", gpu="l4", precisions=["bf16-mixed"]))
