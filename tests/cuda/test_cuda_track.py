"""memtorch.cuda and track() on a real CUDA device, against torch.cuda's own counters.

Sizes are multiples of 512 B, the caching allocator's block rounding, so the
hand counts are exact: a float32 tensor of 1 Mi elements takes 4 MiB.
"""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import memtorch  # noqa: E402

MiB = 2**20


def test_counters_equal_torch():
    dev = torch.device("cuda")
    x = torch.empty(MiB, device=dev)  # 4 MiB
    assert memtorch.cuda.allocated() == torch.cuda.memory_allocated()
    assert memtorch.cuda.reserved() == torch.cuda.memory_reserved()
    assert memtorch.cuda.peak() == torch.cuda.max_memory_allocated()
    assert memtorch.cuda.reserved_peak() == torch.cuda.max_memory_reserved()
    assert memtorch.cuda.stats()["allocated_bytes.all.current"] == torch.cuda.memory_allocated()
    free, total = memtorch.cuda.mem_info()
    assert (free, total) == torch.cuda.mem_get_info() or abs(free - torch.cuda.mem_get_info()[0]) < 64 * MiB
    # the driver sees more than torch: at least the context sits outside the allocator
    assert total - free >= torch.cuda.memory_reserved()
    assert memtorch.cuda.outside_torch() >= 0
    assert x.numel() == MiB


def test_reset_peak_is_torchs_reset():
    x = torch.empty(2 * MiB, device="cuda")  # 8 MiB
    del x
    memtorch.cuda.reset_peak()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()


def test_block_figures_exact_on_cuda():
    torch.cuda.synchronize()
    with memtorch.track(device="cuda") as t:
        a = torch.empty(MiB, device="cuda")  # 4 MiB
        b = torch.empty(2 * MiB, device="cuda")  # 8 MiB
        del a
    r = t.report
    assert r.device == f"cuda:{torch.cuda.current_device()}"
    assert r.delta == 8 * MiB
    # torch's peak rose to start + 12 MiB inside the block (unless it was higher before)
    if r.exact:
        assert r.peak_above_start == 12 * MiB
    else:
        assert r.peak_upper >= r.start + 12 * MiB
    assert r.reserved_peak >= r.peak
    assert b.numel() == 2 * MiB


def test_nesting_keeps_users_peak_and_outer_peak():
    torch.cuda.reset_peak_memory_stats()  # the user's own counter, from a clean start
    big = torch.empty(16 * MiB, device="cuda")  # 64 MiB
    del big
    users_peak = torch.cuda.max_memory_allocated()
    base = torch.cuda.memory_allocated()
    with memtorch.track(device="cuda") as outer:
        x = torch.empty(10 * MiB, device="cuda")  # 40 MiB
        with memtorch.track(device="cuda") as inner:
            y = torch.empty(5 * MiB, device="cuda")  # 20 MiB
            del y
        z = torch.empty(10 * MiB, device="cuda")  # 40 MiB: outer reaches 80 MiB > the old 64 MiB
        del x, z
    assert torch.cuda.max_memory_allocated() == max(users_peak, base + 80 * MiB)  # never reset
    # inner: 60 MiB stayed below the older 64 MiB peak: a sampled lower bound with the old peak above
    assert inner.report.peak_above_start >= 0
    assert inner.report.exact or inner.report.peak_upper == users_peak
    # outer rose above every older peak: exact
    assert outer.report.exact and outer.report.peak_above_start == 80 * MiB


def test_training_step_phases_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 1024, device="cuda")
    p_bytes = sum(p.numel() * 4 for p in model.parameters())
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t.step()
    r = t.report
    assert r.device.startswith("cuda")
    assert set(r.phases) == {"forward", "backward", "optimizer"}
    # Adam's state: two tensors per parameter, created in the first step (512-byte rounding is exact here)
    assert r.leak.steps[0] >= 2 * p_bytes
    assert r.leak.steps[1:] == [0, 0]
    assert r.reserved_peak >= r.peak


def test_fast_counters_equal_memory_stats():
    x = torch.empty(MiB, device="cuda")  # 4 MiB
    from memtorch import cuda as mcuda

    idx = torch.cuda.current_device()
    st = torch.cuda.memory_stats(idx)
    fast = mcuda._counters(idx)
    assert tuple(fast) == (
        st["allocated_bytes.all.current"],
        st["allocated_bytes.all.peak"],
        st["reserved_bytes.all.current"],
        st["reserved_bytes.all.peak"],
    )
    assert x.numel() == MiB
