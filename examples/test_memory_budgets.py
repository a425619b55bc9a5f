"""Memory budgets on a training step, checked by pytest on a CPU-only CI machine.

Copy this file next to your tests and adapt the model and the budgets. With memtorch
installed the plugin loads by itself (pytest11 entry point):

    pytest examples/test_memory_budgets.py                      # budgets pass or fail
    pytest examples/test_memory_budgets.py --memtorch-report    # a table of every tracked test
    pytest examples/test_memory_budgets.py --memtorch-save=memory.json
    pytest examples/test_memory_budgets.py --memtorch-compare=memory.json --memtorch-fail-on-increase=5%

From a source checkout, add `-p memtorch.pytest_plugin`. On CPU the counters are exact:
the same test gives the same peak, to the byte, on every run, so a budget (or a saved
baseline) does not need slack for noise, only for the changes you accept.

Sizes: KiB/MiB are 1024-based, kB/MB 1000-based. The model, 784 -> 128 -> 10, holds
784*128 + 128 + 128*10 + 10 = 101,770 float32 parameters = 407,080 B (397.5 KiB).
"""

import pytest
import torch

import memtorch

BATCH = 64


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def batch():
    return torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))


# Only the test body is measured (not the fixtures), above what was live when it started.
# What the body holds at its peak, counted by hand:
#   the batch: x 64*784*4 = 200,704 B, y 64 int64 = 512 B
#   activations kept for backward: fc1 out and relu out 64*128*4 = 32,768 B each,
#     fc2 out (the logits) 64*10*4 = 2,560 B
#   gradients, one per parameter: 407,080 B
#   = 676,392 B (660.5 KiB), plus backward's short-lived temporaries, each no larger
#   than an activation or a gradient above. 1 MiB (1,048,576 B) leaves them 372,184 B.
@pytest.mark.memory_budget(peak="1 MiB", device="cpu")
def test_sgd_training_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def adam(model):
    # One step here, outside the measured body, so that Adam's state (2 tensors per
    # parameter: 2 * 407,080 B) already exists when the body starts.
    opt = torch.optim.Adam(model.parameters())
    x, y = batch()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return opt


# A steady training loop keeps nothing from one step to the next: per-step leak 0 B,
# and once the body returns (its batch and loss gone) nothing it allocated is left: delta 0 B.
# Peak: the SGD step's 676,392 B above, plus Adam's update, which makes temporaries the
# size of a parameter (the largest, fc1.weight, is 401,408 B: e.g. sqrt(v) + eps); three
# of those at once give 676,392 + 3 * 401,408 = 1,880,616 B, under 2 MiB (2,097,152 B).
@pytest.mark.memory_budget(peak="2 MiB", leak="0 B", delta="0 B", device="cpu")
def test_adam_loop_does_not_leak(model, adam, memtorch_tracker):
    for _ in range(3):
        x, y = batch()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        adam.step()
        adam.zero_grad()
        memtorch_tracker.step()  # a step boundary, for the leak figure


# Without a marker, the memtorch_tracker fixture tracks the body for a test that
# checks its own figures. Under no_grad nothing is kept for backward: at its peak the
# body holds x (200,704 B), the fc1 and relu outputs (32,768 B each) and the logits
# (2,560 B) = 268,800 B at most, well under 512 KiB (524,288 B).
def test_inference_keeps_no_graph(model, memtorch_tracker):
    with torch.no_grad():
        logits = model(batch()[0])
    assert logits.shape == (BATCH, 10)
    assert memtorch_tracker.report.peak_above_start <= memtorch.units.parse("512 KiB")
