"""memtorch.cuda on a CPU machine: the error without CUDA, and the peak logic with faked counters.

FakeDevice plays torch's caching allocator counters: allocated / its peak,
reserved / its peak; its reset raises, so any test passes only if memtorch
never resets torch's (global) peak.
"""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import memtorch  # noqa: E402
from memtorch import cuda as mcuda  # noqa: E402
from memtorch.cuda import block_peak  # noqa: E402
from memtorch.errors import DeviceUnavailable  # noqa: E402

# --- without CUDA ------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("fn", ["allocated", "reserved", "peak", "reserved_peak", "reset_peak", "mem_info", "stats",
                                "outside_torch"])  # fmt: skip
def test_without_cuda_every_counter_says_so(fn):
    with pytest.raises(DeviceUnavailable, match="CUDA is not available: .*memtorch.cuda needs a CUDA device"):
        getattr(memtorch.cuda, fn)()
    assert memtorch.cuda.is_available() is False


# --- block_peak: the pure rule -------------------------------------------------


def test_block_peak_rose_in_block_is_exact():
    # device peak 100 before; block from 50 rose to 300: the block's peak is 300
    p = block_peak(start=50, start_peak=100, end=60, end_peak=300)
    assert (p.peak, p.exact, p.upper) == (300, True, 300)


def test_block_peak_started_at_peak_is_exact():
    # block started at the running peak (200) and never passed it
    p = block_peak(start=200, start_peak=200, end=120, end_peak=200)
    assert (p.peak, p.exact) == (200, True)


def test_block_peak_below_older_peak_is_a_bounded_guess():
    # an older peak of 1000; the block went from 10 to 20 and was sampled at 80
    p = block_peak(start=10, start_peak=1000, end=20, end_peak=1000, seen_max=80)
    assert (p.peak, p.exact, p.upper) == (80, False, 1000)
    p = block_peak(start=10, start_peak=1000, end=20, end_peak=1000)
    assert (p.peak, p.exact, p.upper) == (20, False, 1000)
    # a sample that reached the older peak proves it
    p = block_peak(start=10, start_peak=1000, end=20, end_peak=1000, seen_max=1000)
    assert (p.peak, p.exact) == (1000, True)


def test_block_peak_after_a_reset_inside():
    # someone reset torch's peak inside the block: end_peak (40) was reached inside it
    p = block_peak(start=30, start_peak=500, end=10, end_peak=40, seen_max=35)
    assert (p.peak, p.exact, p.upper) == (40, False, None)


# --- faked device ------------------------------------------------------------


class FakeDevice:
    """Counters like torch's caching allocator; blocks rounded up to 512 B, segments of 2 MiB."""

    def __init__(self):
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self.reserved_peak = 0
        self.free_bytes = 80 * 2**30
        self.total = 80 * 2**30 + 500 * 2**20  # 500 MiB of context outside torch

    def alloc(self, n):
        n = -(-n // 512) * 512
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        while self.reserved < self.allocated:
            self.reserved += 2 * 2**20
            self.free_bytes -= 2 * 2**20
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        return n

    def free(self, n):
        self.allocated -= -(-n // 512) * 512

    def stats(self, index):
        assert index == 0
        return {
            mcuda.ALLOCATED: self.allocated,
            mcuda.ALLOCATED_PEAK: self.peak,
            mcuda.RESERVED: self.reserved,
            mcuda.RESERVED_PEAK: self.reserved_peak,
            "num_alloc_retries": 0,
        }

    def counters(self, index):
        assert index == 0
        return self.allocated, self.peak, self.reserved, self.reserved_peak

    def reset(self, index):
        raise AssertionError("memtorch reset torch's global peak")


@pytest.fixture
def fake(monkeypatch):
    dev = FakeDevice()
    monkeypatch.setattr(mcuda, "_available", lambda: True)
    monkeypatch.setattr(mcuda, "_device_count", lambda: 1)
    monkeypatch.setattr(mcuda, "_current_device", lambda: 0)
    monkeypatch.setattr(mcuda, "_memory_stats", dev.stats)
    monkeypatch.setattr(mcuda, "_counters", dev.counters)
    monkeypatch.setattr(mcuda, "_mem_get_info", lambda i: (dev.free_bytes, dev.total))
    return dev


def test_counters_read_torch(fake, monkeypatch):
    fake.alloc(1000)  # rounded to 1024
    fake.alloc(3 * 2**20)  # 3 MiB: two 2 MiB segments
    assert mcuda.allocated() == 1024 + 3 * 2**20
    assert mcuda.allocated("cuda:0") == mcuda.allocated(0) == mcuda.allocated(torch.device("cuda"))
    assert mcuda.reserved() == 4 * 2**20
    assert mcuda.peak() == 1024 + 3 * 2**20
    assert mcuda.stats()["num_alloc_retries"] == 0
    assert mcuda.mem_info() == (fake.free_bytes, fake.total)
    # total - free - reserved: the 500 MiB the fake puts outside torch
    assert mcuda.outside_torch() == 500 * 2**20
    calls = []
    monkeypatch.setattr(mcuda, "_reset_peak", lambda i: calls.append(i))
    mcuda.reset_peak()
    assert calls == [0]


def test_bad_cuda_devices(fake):
    with pytest.raises(DeviceUnavailable, match="CUDA device 3 does not exist: this process sees 1 device"):
        mcuda.allocated(3)
    with pytest.raises(ValueError, match="not a CUDA device: 'cpu'"):
        mcuda.allocated("cpu")
    with pytest.raises(ValueError, match="not a CUDA device"):
        mcuda.allocated("nonsense")


class Allocating(nn.Module):
    """A module whose forward allocates `keep` bytes (kept) and `temp` bytes (freed) on the fake device."""

    def __init__(self, dev, keep, temp):
        super().__init__()
        self.dev, self.keep, self.temp = dev, keep, temp
        self.lin = nn.Identity()

    def forward(self, x):
        self.dev.alloc(self.temp)
        self.dev.free(self.temp)
        self.dev.alloc(self.keep)
        return self.lin(x)


def test_nested_cuda_blocks_keep_their_peaks(fake):
    fake.alloc(10 * 2**20)  # 10 MiB before anything
    with memtorch.track(device="cuda") as outer:
        fake.alloc(4 * 2**20)  # outer: 14 MiB
        with memtorch.track(device="cuda:0") as inner:
            fake.alloc(2 * 2**20)  # 16 MiB: the running peak rises
            fake.free(2 * 2**20)
        fake.free(4 * 2**20)
    i, o = inner.report, outer.report
    assert i.device == o.device == "cuda:0"
    assert i.exact and i.peak == 16 * 2**20 and i.peak_above_start == 2 * 2**20 and i.delta == 0
    assert o.exact and o.peak == 16 * 2**20 and o.peak_above_start == 6 * 2**20 and o.delta == 0
    assert o.reserved_peak == 16 * 2**20
    assert fake.peak == 16 * 2**20  # torch's own counter untouched


def test_cuda_block_below_an_older_peak_is_flagged(fake):
    fake.alloc(100 * 2**20)
    fake.free(100 * 2**20)  # the device's peak is 100 MiB from before
    model = nn.Sequential(Allocating(fake, keep=1024, temp=8192), Allocating(fake, keep=512, temp=0))
    with memtorch.track(model, device="cuda") as t:
        model(torch.ones(2))
    r = t.report
    assert not r.exact
    assert r.peak_upper == 100 * 2**20
    assert r.delta == 1024 + 512
    # the temporaries (8192) happened between samples: only what the hooks saw is claimed
    assert r.peak_above_start == 1024 + 512
    assert "peak at most" in str(r)
    # per-module figures are not read on CUDA (a counter read per module boundary): absent, and said
    assert r.modules == [] and any("Per-module figures are not measured on CUDA" in c for c in r.caveats)
    assert r.phases["forward"].delta == 1024 + 512 and not r.phases["forward"].exact


def test_cuda_phases_and_modules_with_rising_peak(fake):
    model = nn.Sequential(Allocating(fake, keep=4096, temp=1 << 20), Allocating(fake, keep=1024, temp=0))
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with memtorch.track(model, optimizer=opt, device="cuda") as t:
        model(torch.ones(2))  # a forward with grad enabled: a backward phase follows
        fake.alloc(2048)  # "backward"
        opt.step()
        t.step()
    r = t.report
    assert r.exact  # every peak rose to a new device peak: exact
    assert r.phases["forward"].delta == 4096 + 1024
    # forward peak: module 0's temporary 1 MiB on top of nothing
    assert r.phases["forward"].peak_above_start == 1 << 20
    assert r.phases["backward"].delta == 2048
    assert r.phases["optimizer"].delta == 0
    assert r.modules == []  # not measured on CUDA (see test_cuda_block_below_an_older_peak_is_flagged)
    assert r.leak.steps == [4096 + 1024 + 2048]
    assert r.reserved_peak == 2 * 2**20


def test_cuda_timeline_from_samples(fake):
    model = nn.Sequential(Allocating(fake, keep=512, temp=0))
    with memtorch.track(model, device="cuda", timeline=True) as t:
        model(torch.ones(2))
    times, nbytes = t.report.timeline
    assert len(times) == len(nbytes) >= 3
    assert nbytes[0] == 0 and nbytes[-1] == 512


def test_track_auto_without_model_is_the_cpu_even_with_cuda(fake, monkeypatch):
    # what a block counts must not depend on whether earlier code touched the GPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with memtorch.track() as t:
        pass
    assert t.report.device == "cpu"
    with memtorch.track(nn.Linear(2, 2)) as t:  # a model on the CPU
        pass
    assert t.report.device == "cpu"
    with memtorch.track(device="cuda") as t:
        pass
    assert t.report.device == "cuda:0"


def test_first_step_peak_on_cuda_is_the_blocks_peak_so_far(fake):
    # start 0; module 0 allocates a 1 MiB temporary, frees it, keeps 4096 B; module 1 keeps 1024 B;
    # 2048 B after the forward: step 1's peak is the 1 MiB temporary (torch's peak rose to it), end 7168 B
    model = nn.Sequential(Allocating(fake, keep=4096, temp=1 << 20), Allocating(fake, keep=1024, temp=0))
    with memtorch.track(model, device="cuda") as t:
        model(torch.ones(2))
        fake.alloc(2048)
        t.step()
    assert t.report.step_series == [(1 << 20, 4096 + 1024 + 2048)]


# --- memtorch.cuda.reset_peak keeps open blocks exact; a raw reset leaves them bounded ---------


def _fake_reset(fake):
    def reset(index):
        assert index == 0
        fake.peak, fake.reserved_peak = fake.allocated, fake.reserved

    return reset


def test_combine_peaks():
    from memtorch.cuda import BlockPeak, combine_peaks

    exact = combine_peaks(BlockPeak(100, True, 100, "a"), BlockPeak(80, True, 80, "b"))
    assert (exact.peak, exact.exact, exact.upper) == (100, True, 100)
    # a range [10, 100] then an exact 150: the block's peak is 150, exactly
    p = combine_peaks(BlockPeak(10, False, 100, "sampled"), BlockPeak(150, True, 150, "rose"))
    assert (p.peak, p.exact, p.upper) == (150, True, 150)
    # a range [10, 100] then an exact 50: at least 50, at most 100
    p = combine_peaks(BlockPeak(10, False, 100, "sampled"), BlockPeak(50, True, 50, "rose"))
    assert (p.peak, p.exact, p.upper) == (50, False, 100) and "sampled" in p.how
    p = combine_peaks(BlockPeak(10, False, None, "reset"), BlockPeak(500, True, 500, "rose"))
    assert (p.peak, p.exact, p.upper) == (500, False, None)


def test_memtorch_reset_peak_keeps_an_open_block_exact(fake, monkeypatch):
    monkeypatch.setattr(mcuda, "_reset_peak", _fake_reset(fake))
    MiB = 2**20
    with memtorch.track(device="cuda") as outer:  # starts at 0, the device's peak
        fake.alloc(48 * MiB)
        fake.free(48 * MiB)  # the block's peak: 48 MiB, torch's too
        memtorch.cuda.reset_peak()  # torch's peak is now 0: the outer block must not lose its 48 MiB
        assert fake.peak == 0
        with memtorch.track(device="cuda") as inner:  # starts at the (new) peak: exact
            fake.alloc(16 * MiB)
            fake.free(16 * MiB)
    assert outer.report.exact and outer.report.peak_above_start == 48 * MiB
    assert inner.report.exact and inner.report.peak_above_start == 16 * MiB
    assert mcuda._debug_leftovers() == []


def test_memtorch_reset_peak_inside_keeps_the_later_rise(fake, monkeypatch):
    monkeypatch.setattr(mcuda, "_reset_peak", _fake_reset(fake))
    MiB = 2**20
    with memtorch.track(device="cuda") as t:
        fake.alloc(8 * MiB)
        fake.free(8 * MiB)
        memtorch.cuda.reset_peak()
        fake.alloc(20 * MiB)  # above the 8 MiB before the reset
        fake.free(20 * MiB)
    assert t.report.exact and t.report.peak_above_start == 20 * MiB
    assert t.report.reserved_peak == 20 * MiB  # ten 2 MiB segments, kept by the fake's allocator


def test_raw_torch_reset_in_block_has_no_upper_bound_and_its_budget_is_inconclusive(fake, monkeypatch):
    MiB = 2**20
    fake.alloc(64 * MiB)  # held from before the block: the device's peak is 64 MiB, at the start too
    with memtorch.track(device="cuda") as t:
        fake.free(64 * MiB)
        _fake_reset(fake)(0)  # torch.cuda.reset_peak_memory_stats() called by the measured code
        fake.alloc(16 * MiB)
        fake.free(16 * MiB)
    r = t.report
    # torch's peak ends at 16 MiB, below the 64 MiB at the start: a reset, seen; the block's peak
    # is at least its start (64 MiB: 0 above start) and nothing bounds it from above
    assert not r.exact and r.peak_upper is None and r.peak_above_start == 0
    with pytest.raises(memtorch.BudgetInconclusive, match="no upper bound.*reset inside the block"):
        r.check(peak="32 MiB")
    with pytest.raises(memtorch.BudgetInconclusive):
        memtorch.assert_budget(r, peak="1 GiB")  # no upper bound: no limit passes


# --- the cost of tracking on CUDA: counter reads per block and step, never per module ----------


def _tracked_steps(monkeypatch, width, steps):
    """Reads of torch.cuda's counters made by track(model, optimizer) over ``steps`` steps of a model
    of ``width`` Linear+ReLU pairs, on a fake torch.cuda."""
    from fake_cuda import FakeCuda

    fake = FakeCuda(torch.cuda)
    monkeypatch.setattr(torch, "cuda", fake)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(width) for m in (nn.Linear(4, 4), nn.ReLU())])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2, 4)
        with memtorch.track(model, optimizer=opt, device="cuda") as t:
            fake.calls.clear()  # what the block's steps read, from here
            for _ in range(steps):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                t.step()
            during = fake.reads()
        r = t.report
        assert set(r.phases) == {"forward", "backward", "optimizer"} and r.steps == steps
        return during, fake.reads(), fake.calls
    finally:
        monkeypatch.setattr(torch, "cuda", fake._real)


def test_tracked_step_reads_cuda_counters_per_step_not_per_module(monkeypatch):
    # one read where a figure needs it: the forward begins; forward -> backward; backward ->
    # optimizer; the optimizer ends; t.step() (one read shared by the step's end and the next
    # step's start): 5 per step, whatever the model's size (the module hooks read nothing)
    small1, _, _ = _tracked_steps(monkeypatch, width=2, steps=1)
    small3, total3, calls = _tracked_steps(monkeypatch, width=2, steps=3)
    big3, big_total3, _ = _tracked_steps(monkeypatch, width=20, steps=3)  # 41 modules
    assert big3 == small3 and big_total3 == total3
    assert small3 - small1 == 2 * 5  # per step
    assert small1 == 5
    assert total3 == small3 + 1  # and one read for the block's close
    assert calls["reset_peak_memory_stats"] == 0  # track() never resets torch's peak


def test_live_report_inside_a_cuda_block_has_the_peak_so_far(fake):
    MiB = 2**20
    with memtorch.track(device="cuda") as t:
        fake.alloc(8 * MiB)
        fake.free(8 * MiB)
        r = t.report  # a snapshot: torch's peak rose by 8 MiB since the block began
        assert r.live and r.exact and r.peak_above_start == 8 * MiB and r.delta == 0
        with pytest.raises(memtorch.BudgetExceeded, match="^peak 8.0 MiB exceeds budget 4.0 MiB"):
            r.check(peak="4 MiB")
    fake.alloc(16 * MiB)
    fake.free(16 * MiB)  # an older peak of 16 MiB above what follows
    with memtorch.track(device="cuda") as t:
        fake.alloc(2 * MiB)
        r = t.report  # below the older peak: between 2 MiB and 16 MiB so far
        assert not r.exact and r.peak_above_start == 2 * MiB and r.peak_upper - r.start == 16 * MiB
        with pytest.raises(memtorch.BudgetInconclusive):
            r.check(peak="4 MiB")
        fake.free(2 * MiB)


def test_cuda_block_hooks_only_the_models_root(fake):
    # no per-module figures on CUDA: no global module hook either, which would send every module
    # call of the process through torch's slow path; the root's two hooks give the phases
    import torch.nn.modules.module as tmod

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with memtorch.track(model, device="cuda") as t:
        assert not tmod._global_forward_pre_hooks and not tmod._global_forward_hooks
        assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
        assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks
        model(torch.ones(1, 2))
    assert not model._forward_pre_hooks and not model._forward_hooks and not model._forward_hooks_always_called
    assert t.report.phases["forward"].calls == 1
