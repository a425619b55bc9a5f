"""memtorch.cpu: exact CPU tensor bytes, checked against hand counts and independent measurements.

Every expected figure is derived in the test from shapes and dtypes (with the
derivation written out), from the tensors' own untyped_storage().nbytes(), or
from the profiler's memory events of the same run.
"""

import gc
import random
import sys
import threading
import time
from typing import List

import numpy as np
import pytest
import torch

import memtorch
from memtorch import _C, cpu
from memtorch.errors import MemtorchError

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact mechanism is Linux-only")

MiB = 1024 * 1024


# These tests check the installation mechanism itself.
pytestmark = pytest.mark.usefixtures("raw_counters")


@pytest.fixture
def exact_mode(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "libc10-got")
    assert cpu.mechanism() == "libc10-got"


# ---------------------------------------------------------------------------
# The first test: one tensor of known size.


@linux_only
def test_empty_1000x1000_is_exactly_4000000_bytes(exact_mode):
    with cpu.Scope() as s:
        before = cpu.allocated()
        x = torch.empty(1000, 1000)
        # 1000 * 1000 float32 elements, 4 bytes each
        assert cpu.allocated() - before == 1000 * 1000 * 4 == 4_000_000
        assert s.current - before == 4_000_000
        del x
        assert cpu.allocated() == before
        assert s.peak - before == 4_000_000
    assert s.exact and s.mechanism == "libc10-got"
    assert s.delta == 0 and s.peak_above_start == 4_000_000


@linux_only
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.bool,
                                   torch.complex64, torch.int64])
def test_each_dtype_counts_its_storage_nbytes(exact_mode, dtype):
    with cpu.Scope() as s:
        t = torch.empty(37, 11, dtype=dtype)
        # independent: the storage's own size, and the hand count numel * itemsize
        assert s.delta == t.untyped_storage().nbytes() == 37 * 11 * t.element_size()
        v = t[3:5]  # a view allocates nothing
        assert s.delta == t.untyped_storage().nbytes()
        del t, v
        assert s.delta == 0


@linux_only
def test_zero_bytes_and_resize(exact_mode):
    with cpu.Scope() as s:
        t = torch.empty(0)  # c10::alloc_cpu returns NULL for 0 bytes, nothing allocated
        assert s.delta == 0
        t.resize_(250)  # a new 250 * 4 = 1000-byte storage
        assert s.delta == 1000 == t.untyped_storage().nbytes()
        t.resize_(500)  # grows: new 2000-byte block, the old 1000 bytes freed
        assert s.delta == 2000
        assert s.peak_above_start == 1000 + 2000  # both alive during the copy
        del t
        assert s.delta == 0


# ---------------------------------------------------------------------------
# Hand-counted MLP forward + backward + SGD step.


@linux_only
def test_mlp_step_peak_matches_hand_count(exact_mode):
    B, I, H, O = 64, 32, 128, 16
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(I, H, bias=False), torch.nn.ReLU(), torch.nn.Linear(H, O, bias=False)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # plain SGD: no state, in-place update
    x = torch.randn(B, I)
    g = torch.randn(B, O)  # the output gradient, given: no ones_like/expand from a .sum()
    f = 4  # float32 bytes
    with cpu.Scope(timeline=True) as s:
        out = model(x)
        out.backward(g)
        opt.step()
        after_step = s.delta
        del out
        opt.zero_grad()  # set_to_none: frees both .grad
    # Forward (Sequential drops each intermediate when it rebinds `input`):
    #   z1 = x @ W1.t()        +B*H   (mm; MmBackward keeps x and W1, both old)
    #   a1 = relu(z1)          +B*H   (ReluBackward keeps its result a1)
    #   z1 dropped             -B*H
    #   out = a1 @ W2.t()      +B*O   (MmBackward keeps a1 and W2)
    # Backward (engine order):
    #   MmBackward(layer 2):   W2 grad = (g.t() @ a1).t()  +O*H   (becomes W2.grad, stolen, no copy)
    #                          a1 grad = g @ W2            +B*H
    #   ReluBackward:          z1 grad = threshold_backward +B*H   <- peak: 3BH + BO + OH
    #                          a1 grad freed, a1 released  -2*B*H
    #   MmBackward(layer 1):   W1 grad = (z1grad.t() @ x).t() +H*I (x needs no grad: no input grad)
    #                          z1 grad freed               -B*H
    # SGD step: p.add_(grad, alpha=-lr) in place: 0.
    # After the step: out + W2.grad + W1.grad = BO + OH + HI.
    peak_elems = 3 * B * H + B * O + O * H
    assert 3 * B * H + B * O + O * H > B * O + O * H + H * I  # the backward peak is the highest point
    assert s.peak_above_start == peak_elems * f == 110_592
    assert after_step == (B * O + O * H + H * I) * f == 28_672
    assert s.delta == 0
    # The same story event by event (bytes / 4):
    _, b = s.timeline()
    steps = [int(d) // f for d in np.diff(b) if d != 0]
    BH, BO, OH, HI = B * H, B * O, O * H, H * I
    assert steps == [BH, BH, -BH, BO, OH, BH, BH, -BH, -BH, HI, -BH, -BO, -HI, -OH]


# ---------------------------------------------------------------------------
# Independent measurement: the profiler's own memory events.


def _profiler_memory_events(prof):
    """nbytes of each CPU allocation (+) and free (-) the profiler saw, in order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events if str(e.device_type()).endswith("CPU")]


@linux_only
def test_counters_agree_with_profiler_memory_events(exact_mode):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(20, 48)
    # No cycle collection inside the window: it could free a tensor from
    # before the scope, which the profiler reports and the counters ignore.
    gc.collect()
    gc.disable()
    try:
        with cpu.Scope(timeline=True) as s:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                for _ in range(2):
                    loss = model(x).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    del loss
            delta, peak = s.delta, s.peak_above_start
    finally:
        gc.enable()
    prof_deltas = _profiler_memory_events(prof)
    _, b = s.timeline()
    ours = [int(d) for d in np.diff(b)]
    ours = [d for d in ours if d != 0]
    # The profiler hears about each allocation from c10's CPU allocator itself
    # (reportMemoryUsage), not from the import table: an independent witness.
    assert ours == prof_deltas
    running = np.cumsum([0] + prof_deltas)
    assert peak == running.max()
    assert delta == running[-1]
    # Adam's state: exp_avg + exp_avg_sq per parameter (+ a 4-byte float32 `step`
    # tensor each), survives the block: 2 * params * 4 + 4 per parameter tensor.
    n_params = sum(p.numel() for p in model.parameters())
    assert delta == 2 * n_params * 4 + 4 * len(list(model.parameters()))


# ---------------------------------------------------------------------------
# Scopes: nesting, reset_peak, allocations from before installation.


@linux_only
def test_nested_scopes_keep_their_own_peaks(exact_mode):
    with cpu.Scope() as outer:
        a = torch.empty(MiB // 4)  # 1 MiB
        with cpu.Scope() as inner:
            assert inner.start == outer.start + MiB
            b = torch.empty(2 * MiB // 4)  # 2 MiB
            del b
            c = torch.empty(MiB // 8)  # 0.5 MiB
        assert inner.peak_above_start == 2 * MiB
        assert inner.delta == MiB // 2
        del c
        d = torch.empty(MiB // 2 // 4)  # 0.5 MiB: below the earlier high
        # outer's high was a + b = 3 MiB, untouched by the inner scope closing
        assert outer.peak_above_start == 3 * MiB
        del a, d
    assert outer.peak_above_start == 3 * MiB and outer.delta == 0
    # a closed scope keeps its figures
    assert inner.peak_above_start == 2 * MiB


@linux_only
def test_reset_peak_does_not_disturb_scopes(exact_mode):
    with cpu.Scope() as s:
        big = torch.empty(4 * MiB // 4)
        del big
        assert cpu.peak() - s.start == 4 * MiB
        cpu.reset_peak()
        assert cpu.peak() == cpu.allocated() == s.start
        small = torch.empty(MiB // 4)
        assert cpu.peak() - s.start == MiB
        assert s.peak_above_start == 4 * MiB
        with cpu.Scope() as inner:
            cpu.reset_peak()
            del small
        assert inner.peak == inner.start
    assert s.peak_above_start == 4 * MiB


@linux_only
def test_allocations_from_before_installation_are_ignored(exact_mode):
    assert not cpu.installed()
    old = torch.empty(1000, 1000)
    with cpu.Scope() as s:
        assert s.start == 0  # first installation: counters start at zero
        del old  # freed while counting, allocated before: not in the table
        assert cpu.allocated() == 0
        new = torch.empty(10)
        assert cpu.allocated() == 40
        del new
        assert cpu.allocated() == 0
    assert s.peak == 40


@linux_only
def test_counts_outside_scopes_only_while_installed(exact_mode):
    assert cpu.allocated() == 0 and cpu.peak() == 0  # nothing counting
    cpu.install()
    try:
        assert cpu.installed()
        x = torch.empty(256)
        assert cpu.allocated() == 1024
    finally:
        cpu.uninstall()
    assert cpu.allocated() == 0
    del x


# ---------------------------------------------------------------------------
# Threads.

_THREAD_N = 2000
_THREAD_ELEMS = 250


def _script_fns():
    @torch.jit.script
    def fill(n: int, size: int) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        for _ in range(n):
            out.append(torch.empty(size))
        return out

    @torch.jit.script
    def fork_two(n: int, size: int) -> List[torch.Tensor]:
        # torch.jit.fork runs `fill` on PyTorch's inter-op thread pool (a C++
        # thread that never holds the GIL) while the caller, running
        # TorchScript without the GIL too, fills its own list at the same time.
        f1 = torch.jit.fork(fill, n, size)
        mine = fill(n, size)
        return torch.jit.wait(f1) + mine

    return fork_two


@linux_only
def test_threads_lose_nothing(exact_mode):
    """Python threads and PyTorch's own C++ threads allocate at once, with 2 intra-op threads.

    Two Python threads allocate through torch.empty; two more run TorchScript
    (without the GIL), each filling a list while a forked task fills another
    on the inter-op pool. In torch 2.13 the CPU kernels allocate their outputs
    on the calling thread (the profiler's memory events of 18 parallel ops all
    came from the caller), so PyTorch's C++ threads are exercised through the
    inter-op pool instead of intra-op kernels.
    """
    fork_two = _script_fns()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    kept = {}
    barrier = threading.Barrier(4)

    def python_worker(name):
        barrier.wait()
        mine = []
        for i in range(_THREAD_N):
            mine.append(torch.empty(_THREAD_ELEMS))
            if i % 100 == 0:
                tmp = torch.randn(64, 64) @ torch.randn(64, 64)  # intra-op parallel, freed
                del tmp
        kept[name] = mine

    def cpp_workers(name):
        barrier.wait()
        kept[name] = fork_two(_THREAD_N, _THREAD_ELEMS)

    try:
        with cpu.Scope() as s:
            threads = [threading.Thread(target=python_worker, args=(f"py{i}",)) for i in range(2)]
            threads += [threading.Thread(target=cpp_workers, args=(f"jit{i}",)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            n_tensors = sum(len(v) for v in kept.values())
            assert n_tensors == 6 * _THREAD_N
            # each kept tensor: 250 float32 = 1000 bytes; the temporaries are all freed
            assert s.delta == 6 * _THREAD_N * _THREAD_ELEMS * 4
            assert s.delta == sum(t.untyped_storage().nbytes() for v in kept.values() for t in v)
            kept.clear()
            # An inter-op worker drops its own reference to the list it
            # returned a moment after the future completes: wait for it.
            deadline = time.monotonic() + 10
            while s.delta != 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert s.delta == 0
    finally:
        torch.set_num_threads(old_threads)


@linux_only
def test_jit_fork_allocations_come_from_another_thread():
    """The premise of the thread test: fork_two allocates off the Python thread."""
    from torch.profiler import ProfilerActivity, profile

    fork_two = _script_fns()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        r = fork_two(5, 10)
    events = prof.profiler.kineto_results.events()
    mem_tids = {e.start_thread_id() for e in events if e.name() == "[memory]"}
    # the profiler numbers threads from 1, the profiling (Python) thread first:
    # half the tensors come from the caller, half from an inter-op thread
    assert len(r) == 10 and 1 in mem_tids and len(mem_tids) == 2
    del r


# ---------------------------------------------------------------------------
# The interposer: refcount, restoring the GOT, refusing misuse.


@linux_only
def test_install_is_refcounted_and_restores_the_got(exact_mode):
    pm_before = _C._counters_slot_info("posix_memalign")
    free_before = _C._counters_slot_info("free")
    assert pm_before[0] != pm_before[3]  # not patched: slot != our hook
    cpu.install()
    cpu.install()  # second install: refcount only, no second patching
    try:
        assert _C.counters_installed() == 2
        pm = _C._counters_slot_info("posix_memalign")
        assert pm[0] == pm[3]  # slot -> hook
        assert pm[1] == pm_before[0]  # saved original is what was there
        fr = _C._counters_slot_info("free")
        assert fr[0] == fr[3] and fr[1] == free_before[0]
        cpu.uninstall()
        assert _C._counters_slot_info("posix_memalign")[0] == pm[3]  # still patched
    finally:
        cpu.uninstall()
    assert _C.counters_installed() == 0
    assert _C._counters_slot_info("posix_memalign")[0] == pm_before[0]
    assert _C._counters_slot_info("free")[0] == free_before[0]
    with pytest.raises(MemtorchError, match="without a matching install"):
        cpu.uninstall()


@linux_only
def test_c_level_misuse_is_refused(exact_mode):
    with pytest.raises(RuntimeError, match="not installed"):
        _C.counters_uninstall()
    with pytest.raises(RuntimeError, match="not installed"):
        _C.scope_open(False)
    with pytest.raises(RuntimeError, match="not installed"):
        _C.scope_begin(False)  # never patches: it only adds to an installation
    assert _C.counters_installed() == 0 and _C.counters_open_scopes() == 0
    with cpu.Scope() as s:
        sid, gen = s._handle
        with pytest.raises(RuntimeError, match="scopes are open"):
            _C.counters_uninstall()
        with pytest.raises(RuntimeError, match="closed"):
            _C.scope_read(sid, gen + 1000)
        with pytest.raises(ValueError, match="no scope"):
            _C.scope_read(64, gen)
        with pytest.raises(TypeError):
            _C.scope_close(sid)
    with pytest.raises(RuntimeError, match="already closed"):
        _C.scope_close(sid, gen)
    with pytest.raises(RuntimeError, match="already closed"):
        _C.scope_end(sid, gen)
    with pytest.raises(ValueError, match="no import slot"):
        _C._counters_slot_info("malloc")
    with pytest.raises(RuntimeError, match="not installed"):
        _C._counters_bench(10, 64)
    with pytest.raises(ValueError, match="positive"):
        _C._counters_bench(0, 64)


@linux_only
def test_scope_begin_and_end_take_and_give_back_one_installation(exact_mode):
    """scope_begin/scope_end (what a Scope uses once counting is held) are install + open and
    close + uninstall in one call each; the figures and statistics match the separate calls."""
    cpu.start()
    base = _C.counters_installed()
    sid, gen, start, t0, ev0, lost0, unseen0, unseen_b0 = _C.scope_begin(False)
    assert _C.counters_installed() == base + 1 and _C.counters_open_scopes() == 1
    st = _C.counters_stats()
    assert (lost0, unseen0, unseen_b0) == (st[1], st[4], st[5])
    assert start == _C.counters_current() and t0 > 0 and ev0 == _C.eventlog_head()
    x = torch.empty(1000, dtype=torch.uint8)
    peak_seen = _C.counters_current()
    del x
    out = _C.scope_end(sid, gen)
    assert out[0] == start and out[1] == _C.counters_current() and out[2] == peak_seen
    assert out[2] - start == 1000  # the storage's own bytes, freed before the end
    assert out[8:] == tuple(_C.counters_stats()[i] for i in (1, 4, 5))
    assert _C.counters_installed() == base and _C.counters_open_scopes() == 0
    with pytest.raises(RuntimeError, match="already closed"):
        _C.scope_end(sid, gen)
    assert _C.counters_installed() == base  # a refused end gives back nothing


@linux_only
def test_bench_helper_goes_through_the_hooks(exact_mode):
    with cpu.Scope() as s:
        n0 = _C.counters_stats()[2]
        direct, hooked = _C._counters_bench(1000, 256)
        # 1000 hooked allocations counted (and freed); the direct ones not
        assert _C.counters_stats()[2] - n0 == 1000
        assert s.delta == 0 and s.peak_above_start == 256
        assert direct > 0 and hooked > 0


@linux_only
def test_at_most_64_scopes(exact_mode):
    scopes = [cpu.Scope().open() for _ in range(64)]
    try:
        with pytest.raises(RuntimeError, match="too many open CPU counter scopes"):
            cpu.Scope().open()
    finally:
        for s in scopes:
            s.close()
    assert cpu._debug_leftovers() == []


@linux_only
def test_table_holds_many_pointers_exactly(exact_mode):
    """Drive the pointer table through growth and deletion with fake addresses."""
    rng = random.Random(1)
    with cpu.Scope() as s:
        base = 0x7E00_0000_0000
        # 64-byte aligned addresses, as posix_memalign returns, in clusters
        addrs = [base + 64 * i for i in range(20000)] + [base + (1 << 30) + 4096 * i for i in range(5000)]
        sizes = {a: rng.randrange(1, 10_000) for a in addrs}
        for a in addrs:
            _C._counters_inject(a, sizes[a])
        assert s.delta == sum(sizes.values())
        assert _C.counters_stats()[0] == len(addrs)
        rng.shuffle(addrs)
        half, rest = addrs[: len(addrs) // 2], addrs[len(addrs) // 2 :]
        for a in half:
            _C._counters_inject(a, -1)
        _C._counters_inject(0x1234_5640, -1)  # unknown pointer: ignored
        assert s.delta == sum(sizes[a] for a in rest)
        for a in rest:
            _C._counters_inject(a, -1)
        assert s.delta == 0 and _C.counters_stats()[0] == 0
        with pytest.raises(ValueError):
            _C._counters_inject(0, 5)


# ---------------------------------------------------------------------------
# The Python facade.


@linux_only
def test_scope_misuse_gives_clear_errors(exact_mode):
    s = cpu.Scope()
    with pytest.raises(MemtorchError, match="not been opened"):
        s.peak
    with pytest.raises(TypeError, match="must be a bool"):
        cpu.Scope(timeline="yes")
    with s:
        with pytest.raises(MemtorchError, match="without timeline=True"):
            s.timeline()
    s.close()  # idempotent
    with pytest.raises(MemtorchError, match="only once"):
        s.open()
    assert "closed" in repr(s) and "not opened" in repr(cpu.Scope())


@linux_only
def test_timeline_live_and_closed(exact_mode):
    with cpu.Scope(timeline=True) as s:
        a = torch.empty(100)
        t_live, b_live = s.timeline()
        b = torch.empty(50)
        del a, b
    t, v = s.timeline()
    assert t.dtype == np.int64 and v.dtype == np.int64
    assert list(b_live - s.start) == [0, 400]
    # open point, +400, +200, -400, -200, close point
    assert list(v - s.start) == [0, 400, 600, 200, 0, 0]
    assert np.all(np.diff(t) >= 0)
    assert s.timeline_dropped == 0


def test_bad_mechanism_env_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "magic")
    with pytest.raises(MemtorchError, match="MEMTORCH_CPU_MECHANISM='magic' is not one of"):
        cpu.mechanism()


def test_rss_fallback_is_labelled_approximate(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "rss")
    assert cpu.mechanism() == "rss-fallback"
    assert cpu.exact() is False
    assert "forced" in cpu.fallback_reason()
    page = 4096
    # free heap memory glibc kept from earlier tests is resident already: reusing it would not grow
    # the resident set, so give it back to the system first (malloc_trim also releases mid-heap pages)
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)
    with cpu.Scope(timeline=True) as s:
        x = torch.ones(64 * MiB // 4)  # 64 MiB, every page written
        grown = s.current - s.start
        del x
    assert s.exact is False and s.mechanism == "rss-fallback"
    # RSS counts the whole process: the 64 MiB shows, give or take what else moved
    assert 0.8 * 64 * MiB <= grown <= 1.3 * 64 * MiB
    assert s.peak_above_start >= grown - page
    t, v = s.timeline()
    assert len(t) == len(v) >= 3
    assert cpu.allocated() > 0 and cpu.peak() >= cpu.allocated() - page
    cpu.reset_peak()
    assert cpu._debug_leftovers() == []


def test_exports():
    assert memtorch.cpu is cpu
    for name in ("allocated", "peak", "reset_peak", "exact", "mechanism", "Scope", "_debug_leftovers"):
        assert callable(getattr(cpu, name))
    assert isinstance(cpu.exact(), bool)
    assert cpu.mechanism() in ("libc10-got", "rss-fallback")


def _wait_child(pid, seconds):
    """The child's wait status; a child still running after ``seconds`` is killed and the test fails."""
    import os
    import signal

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child was still running after {seconds} s (a deadlock in the child)")


@linux_only
def test_fork_while_counting_leaves_a_working_child(exact_mode):
    """fork() (DataLoader workers) with threads allocating must not deadlock the child's hooks."""
    import os
    import warnings

    stop = threading.Event()

    def churn():
        while not stop.is_set():
            torch.empty(100)

    with cpu.Scope() as s:
        t = threading.Thread(target=churn)
        t.start()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
                pid = os.fork()
            if pid == 0:  # child: allocate through the (inherited) hooks, report by exit code
                before = _C.counters_current()
                x = torch.empty(1000)
                ok = _C.counters_current() - before == 4000
                del x
                os._exit(0 if ok else 1)
            status = _wait_child(pid, 120)
        finally:
            stop.set()
            t.join()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert s.delta == 0


@linux_only
def test_transparent_huge_page_path_and_bind_now():
    """c10's other allocation path (THP_MEM_ALLOC_ENABLE: page alignment + madvise), with eager binding."""
    import os
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import torch
        from memtorch import cpu
        with cpu.Scope() as s:
            x = torch.empty(4 * 1024 * 1024 // 4)  # 4 MiB >= c10's 2 MiB THP threshold
            print(s.delta, x.untyped_storage().nbytes(), x.data_ptr() % 4096)
            del x
            print(s.delta)
        """
    )
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1", LD_BIND_NOW="1", MEMTORCH_CPU_MECHANISM="libc10-got")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.split("\n")[:2]
    delta, nbytes, misalign = map(int, first.split())
    assert delta == nbytes == 4 * MiB
    assert misalign == 0  # page-aligned: the THP path was taken
    assert int(second) == 0


@linux_only
def test_a_dropped_open_scope_is_closed(exact_mode):
    s = cpu.Scope().open()
    assert _C.counters_open_scopes() == 1 and cpu.installed()
    del s  # no reference left: closed by its finalizer, installation released
    gc.collect()
    assert _C.counters_open_scopes() == 0 and not cpu.installed()
    assert cpu._debug_leftovers() == []


@linux_only
def test_keep_counting_sees_frees_across_scopes(exact_mode):
    """With memtorch's own installation held (the default), a later scope sees
    the free of a tensor allocated in an earlier one: 1000 float32 = 4000 B."""
    cpu.keep_counting(True)
    with cpu.Scope() as s1:
        x = torch.ones(1000)
    assert s1.delta == 4000
    assert _C.counters_installed() == 1  # held, no scope open
    with cpu.Scope() as s2:
        del x
    assert s2.delta == -4000 and s2.unseen_frees == 0
    cpu.stop()
    assert _C.counters_installed() == 0
    cpu.stop()  # idempotent


@linux_only
def test_unseen_frees_are_counted(exact_mode):
    """Without the held installation, a tensor made before the scope and freed
    inside it is invisible to delta, but counted as an unseen free of at least
    its 4000 bytes (malloc's usable size may be larger)."""
    x = torch.ones(1000)
    with cpu.Scope() as s:
        del x
    assert s.delta == 0
    assert s.unseen_frees == 1 and s.unseen_bytes >= 4000


def test_keep_counting_rejects_non_bool():
    with pytest.raises(TypeError, match="bool"):
        cpu.keep_counting("yes")


@linux_only
def test_start_counts_tensors_made_before_the_first_scope(exact_mode):
    """start() before a tensor is made: its later free inside a scope is seen
    (1000 float32 = 4000 B); start() is idempotent and stop() restores."""
    cpu.start()
    cpu.start()
    assert _C.counters_installed() == 1 and cpu._debug_leftovers() == []
    x = torch.ones(1000)
    with cpu.Scope() as s:
        del x
    assert s.delta == -4000 and s.unseen_frees == 0
    cpu.stop()
    assert _C.counters_installed() == 0


def test_a_range_older_than_the_ring_reads_empty(exact_mode):
    """Once the event log has wrapped, a range that ended before its oldest kept event
    reads as nothing kept and everything lost (it used to ask NumPy for a negative size)."""
    from memtorch import _C

    with cpu.Scope(timeline=True):
        for _ in range(70_000):  # 140,000 events: more than the ring's 131,072
            torch.empty(1)
    head = _C.eventlog_head()
    assert head > 131_072
    t, b, dropped = _C.eventlog_read(0, 10)
    assert len(t) == len(b) == 0 and dropped == 10
    ev, dropped = _C.eventlog_read_all(0, 10)
    assert len(ev) == 0 and dropped == 10
    ev, dropped = _C.eventlog_read_all(head - 5, head)
    assert len(ev) == 5 and dropped == 0
    raw, dropped = _C.eventlog_read_all(0, 10, True)
    assert raw == b"" and dropped == 10


def test_raw_read_is_the_arrays_bytes(exact_mode):
    """eventlog_read_all(..., raw=True): the same rows as bytes (what track() keeps until its
    report is read), read back with the array's dtype."""
    import numpy as np

    from memtorch import _C

    with cpu.Scope(timeline=True) as s:
        kept = [torch.empty(n) for n in (3, 5, 7)]
        del kept[1]
        head = _C.eventlog_head()
    ev, dropped = _C.eventlog_read_all(s._ev0, head)
    raw, dropped_raw = _C.eventlog_read_all(s._ev0, head, True)
    assert type(raw) is bytes and len(ev) >= 4 and (dropped, dropped_raw) == (0, 0)
    back = np.frombuffer(raw, dtype=ev.dtype)
    assert back.tolist() == ev.tolist()
    assert [int(d) for d in back["delta"] if d] == [12, 20, 28, -20]  # float32: 4 bytes each
    assert _C.eventlog_read_all(s._ev0, head, False)[0].tolist() == ev.tolist()
    with pytest.raises(TypeError, match="2 arguments"):
        _C.eventlog_read_all(0, 1, True, 4)
