"""Where the memory goes: who holds the bytes at a training step's peak, and a leak named.

    python examples/where_memory_goes.py
"""

import json

import torch
from torch import nn

import memtorch

memtorch.cpu.start()  # count from here on: the model's own parameters are then in the figures

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 256)

# 1. One step: who held the bytes at the peak, per kind, then per module, then per tensor (Adam's state by name)
with memtorch.track(model, opt, largest=3) as t:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
at_peak = t.report.at_peak
print(at_peak if at_peak is not None else "at_peak needs the exact CPU counters (Linux)")
if at_peak is not None:
    assert at_peak.total == t.report.peak  # the groups add up to the peak, to the byte

# 2. A leak: each loss kept with its graph, found and named
def train(steps=10):
    losses = []
    with memtorch.track(model, opt) as t:
        for _ in range(steps):
            loss = model(torch.randn(64, 256)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)  # the mistake: loss.item() was meant
            t.step()
    return t.report


report = train()
print(report.leak)

# 3. Everything as JSON, e.g. to log per step
print(json.dumps(report.to_dict()["steps_series"][:3]))
