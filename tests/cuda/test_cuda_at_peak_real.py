"""at_peak on a real CUDA device: owners from the allocator's history, against torch's counters."""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import memtorch  # noqa: E402

MiB = 2**20


def test_at_peak_names_a_training_step_and_adds_up():
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).to(dev)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 1024, device=dev)
    was_on = torch._C._cuda_isHistoryEnabled()
    for _ in range(2):
        with memtorch.track(model, optimizer=opt) as t:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    at = t.report.at_peak
    assert at is not None, t.report.caveats
    assert at.total == at.peak == t.report.peak  # the replay reaches torch's own peak
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # multiples of 512 B
    k = at.by_kind()
    assert k["parameter"] == params
    assert k["optimizer state"] == 2 * params  # exp_avg and exp_avg_sq, from the first step
    assert torch._C._cuda_isHistoryEnabled() == was_on  # the history's state restored
