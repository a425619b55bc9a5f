"""memtorch quickstart: what a small model holds, then after one Adam step.

    python examples/quickstart.py

The model is the seed model 784 -> 128 -> 10 with ReLU: its float32 weights
and biases take (784*128 + 128 + 128*10 + 10) * 4 = 407,080 bytes. After one
Adam step the gradients take as much again, and the optimizer state twice
that plus one 4-byte `step` per parameter tensor. Last, a training step
runs inside `memtorch.track()`, which prints its peak, per phase and per module.
"""

import torch
from torch import nn

import memtorch


class SeedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    # Count CPU tensor memory from the start, so that later blocks also see the
    # frees of tensors made before them (the gradients zero_grad() drops, say).
    memtorch.cpu.start()
    torch.manual_seed(0)
    model = SeedModel()
    print(memtorch.inspect(model))
    print()

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print("after one Adam step:")
    print(memtorch.inspect(model, optimizer=opt))
    print()

    # A second step, tracked: exact CPU bytes of tensor memory, per phase and module.
    with memtorch.track(model, optimizer=opt) as t:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    print(t.report)


if __name__ == "__main__":
    main()
