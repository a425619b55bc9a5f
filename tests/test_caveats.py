"""What the CPU counters cannot see, flagged in the Scope (``caveats``, ``exact``).

Other threads' allocations (the counters are process-wide), DataLoader worker
processes (their batches come through shared memory), frees of memory
allocated before counting began; frees that cannot be tensor storage must not
count as unseen; and the mechanism is named after what is really patched
(a libc10 without a posix_memalign import, as torch's aarch64 builds, falls
back to RSS).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import memtorch
from memtorch import _C, cpu

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact mechanism is Linux-only")
pytestmark = [linux_only, pytest.mark.usefixtures("raw_counters")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMPTY = 1000 * 1000 * 4  # torch.empty(1000, 1000): float32, 4 B each


@pytest.fixture
def exact_mode(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "libc10-got")


# ---------------------------------------------------------------------------
# Other threads.


def test_other_threads_bytes_are_flagged(exact_mode):
    def worker():
        kept.append(torch.empty(1000, 1000))  # 4,000,000 B from another thread

    kept = []
    with cpu.Scope() as s:
        mine = torch.empty(250)  # 1,000 B from this thread: not flagged
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert s.other_thread_bytes == EMPTY and s.other_thread_allocations == 1
    assert s.delta == EMPTY + 1000
    assert s.other_thread_bytes == EMPTY
    assert s.exact  # the figure is the process's exact total; the caveat says whose
    (sentence,) = [c for c in s.caveats if "other threads" in c]
    assert sentence.startswith("3.8 MiB (1 allocation) were allocated by other threads")
    del kept, mine


def test_two_threads_tracking_see_each_others_bytes(exact_mode):
    """Each thread's scope counts the other's 4,000,000 B, and says so."""
    barrier = threading.Barrier(2)
    done = threading.Barrier(2)
    scopes, kept = {}, []

    def run(name):
        with cpu.Scope() as s:
            barrier.wait()
            kept.append(torch.empty(1000, 1000))
            done.wait()
        scopes[name] = s

    threads = [threading.Thread(target=run, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in scopes.values():
        assert s.delta == 2 * EMPTY
        assert s.other_thread_bytes == EMPTY
        assert any("other threads" in c for c in s.caveats)
    del kept


def _began(s):
    """The caveats of Scope s other than the one saying that counting began with it."""
    return [c for c in s.caveats if not c.startswith("Counting began when this block opened")]


def test_a_quiet_scope_has_no_caveats(exact_mode):
    with cpu.Scope() as s:
        x = torch.empty(1000, 1000)
        del x
    assert _began(s) == [] and s.exact and s.peak_above_start == EMPTY
    cpu.install()  # counting already on: the only caveat below is gone too
    try:
        with cpu.Scope() as s:
            x = torch.empty(1000, 1000)
            del x
    finally:
        cpu.uninstall()
    assert s.caveats == [] and s.exact and s.peak_above_start == EMPTY


def test_a_scope_that_begins_counting_says_its_start_is_not_the_tensors_made_before(exact_mode):
    """start counts from zero when counting began with the block, though a tensor made before it is
    alive: the block says so (not inexact: delta and peak above start are exact); a block opened
    while counting is on, and so sees that tensor, does not."""
    kept = torch.empty(1000, 1000)
    with cpu.Scope() as s:
        x = torch.empty(1000, 1000)
        del x
    assert s.start == 0 and s.peak_above_start == EMPTY and s.exact
    assert len(s.caveats) == 1 and "Counting began when this block opened" in s.caveats[0]
    assert "memtorch.cpu.start()" in s.caveats[0]
    cpu.start()
    y = torch.empty(1000, 1000)  # made while counting: in the next block's start
    with cpu.Scope() as s2:
        pass
    assert s2.start >= EMPTY and s2.caveats == []
    del kept, y


# ---------------------------------------------------------------------------
# DataLoader workers.


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((256,), float(i))


def _child():
    pass


# a worker process that never answers is an error after this many seconds, not a hang (DataLoader's timeout)
_WORKER_TIMEOUT = 120


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork start method")
def test_process_counter_is_read_without_advancing_it(worker_start):
    """The processes check reads multiprocessing's counter without moving it, and counts
    each process made between two reads, whichever form the reads took."""
    import multiprocessing

    before = cpu._processes()[0]
    assert cpu._processes()[0] == before
    p = multiprocessing.get_context(worker_start or "fork").Process(target=_child)
    p.start()
    p.join(timeout=_WORKER_TIMEOUT)
    assert p.exitcode == 0, f"the forked child did not exit cleanly: exit code {p.exitcode}"
    after = cpu._processes()[0]
    assert cpu._started(before, after) == 1 and cpu._started(after, after) == 0
    assert cpu._started("count(3)", 5) == 2 and cpu._started(3, "count(5)") == 2
    assert cpu._started("something else", 4) == 0 and cpu._started(5, 3) == 0


@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_workers_make_the_scope_not_exact(exact_mode, persistent, worker_start):
    """num_workers=2: the batches arrive through shared memory the counters do not see."""
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=4, num_workers=2,
                                         persistent_workers=persistent, timeout=_WORKER_TIMEOUT,
                                         multiprocessing_context=worker_start)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        it = iter(loader) if persistent else None  # persistent: workers started before the block
        with cpu.Scope() as s:
            batches = list(it) if persistent else list(loader)
        del it
    assert len(batches) == 2 and batches[1].shape == (4, 256)
    assert s.exact is False
    (sentence,) = [c for c in s.caveats if "DataLoader" in c]
    assert "shared memory" in sentence and "not exact" in sentence
    del batches


def test_track_report_with_dataloader_workers_is_not_exact(exact_mode, worker_start):
    """The issue's case: num_workers=2 used to report a tiny peak, 'exact'."""
    import memtorch

    loader = torch.utils.data.DataLoader(_Squares(), batch_size=4, num_workers=2, timeout=_WORKER_TIMEOUT,
                                         multiprocessing_context=worker_start)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with memtorch.track(modules=False, leaks=False) as t:
            for batch in loader:
                batch.sum()
    assert t.report.exact is False


def test_dataloader_without_workers_stays_exact(exact_mode):
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=4, num_workers=0)
    with cpu.Scope() as s:
        batches = list(loader)
    assert s.exact and not any("DataLoader" in c for c in s.caveats)
    # 2 batches of 4 x 256 float32 kept: 2 * 4 * 256 * 4 = 8,192 B (the per-item
    # tensors were freed once stacked)
    assert s.delta == 2 * 4 * 256 * 4
    del batches


# ---------------------------------------------------------------------------
# Unseen frees: only what could be tensor storage.


def test_a_tensor_made_before_counting_is_an_unseen_free(exact_mode):
    x = torch.ones(1000)  # 4,000 B, made before any installation
    with cpu.Scope() as s:
        del x
    assert s.unseen_frees == 1 and s.unseen_bytes >= 4000
    assert any(c.startswith("1 free of memory allocated before counting began") for c in s.caveats)


def test_a_printed_report_says_each_caveat_once(exact_mode):
    """The unseen free is a row of the table pointing at its note, and the note (also one of
    at_peak's notes) is printed once."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(1000)  # made before counting began
    with memtorch.track(model, optimizer=opt) as t:
        del x
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    r = t.report
    assert r.unseen_frees == 1
    caveat = next(c for c in r.caveats if "before counting began" in c)
    assert caveat in r.at_peak.notes
    text = str(r)
    assert text.count(caveat) == 1
    assert "(see the note below)" in text


def test_demangled_names_are_not_unseen_frees(exact_mode):
    """AccumulateGrad.name() frees __cxa_demangle's buffer through libc10's &free."""
    a = torch.ones(3, requires_grad=True)
    loss = (a * 2).sum()
    node = loss.grad_fn.next_functions[0][0].next_functions[0][0]
    foreign0 = None
    with cpu.Scope() as s:
        foreign0 = _C.counters_stats()[6]
        names = {node.name() for _ in range(20)}
        foreign = _C.counters_stats()[6] - foreign0
    assert names == {"torch::autograd::AccumulateGrad"}
    assert s.unseen_frees == 0 and _began(s) == []
    assert foreign >= 20  # seen, and recognised as not tensor storage


def test_profiler_frees_are_not_unseen_frees(exact_mode):
    from torch.profiler import ProfilerActivity, profile

    model = torch.nn.Linear(16, 4)
    x = torch.randn(8, 16)
    with cpu.Scope() as s:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)
    assert s.unseen_frees == 0
    assert not any("before counting" in c for c in s.caveats)


def test_injected_frees_follow_the_rule(exact_mode):
    """Rule: a free of an unknown pointer is an unseen tensor free only through libc10's
    direct free and at c10's 64-byte alignment."""
    with cpu.Scope() as s:
        st0 = _C.counters_stats()
        _C._counters_inject(0x7A00_0000_0040, -1)  # direct, 64-aligned: could be a tensor
        _C._counters_inject(0x7A00_0000_0050, -1)  # direct, 16-aligned: cannot
        _C._counters_inject(0x7A00_0000_0080, -2)  # through &free: cannot
        st1 = _C.counters_stats()
    assert (st1[4] - st0[4], st1[6] - st0[6]) == (1, 2)
    assert s.unseen_frees == 1
    with pytest.raises(ValueError, match="size must be"):
        _C._counters_inject(0x7A00_0000_0040, -3)


# ---------------------------------------------------------------------------
# A stand-in for libc10 (a small shared library built here): the mechanism's name
# comes from what is patched; the GLOB_DAT rule on real code.

FAKE_SRC = r"""
#include <stdlib.h>
void *fake_alloc(size_t n) { void *p = 0; return posix_memalign(&p, 64, n) ? 0 : p; }
void fake_free(void *p) { free(p); }
typedef void (*fr)(void *);
fr fake_free_ref(void) { return free; }
"""
NO_PM_SRC = r"""
#include <stdlib.h>
void *fake_alloc(size_t n) { return malloc(n); }   /* like mimalloc: no posix_memalign import */
void fake_free(void *p) { free(p); }
"""


def _build(tmp_path, name, src):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    c = tmp_path / (name + ".c")
    c.write_text(src)
    so = tmp_path / (name + ".so")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(c)], check=True)
    return str(so)


def _run(code):
    env = dict(os.environ, MEMTORCH_CPU_KEEP="0")
    env.pop("MEMTORCH_CPU_MECHANISM", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_libc10_without_posix_memalign_falls_back_and_says_so(tmp_path):
    so = _build(tmp_path, "libmtnopm", NO_PM_SRC)
    r = _run(f"""
    import ctypes, json, torch
    from memtorch import cpu, _C
    ctypes.CDLL({so!r})
    _C._counters_set_target("libmtnopm.so")
    out = {{"mechanism": cpu.mechanism(), "reason": cpu.fallback_reason(), "c": _C.counters_mechanism(),
            "exact": cpu.exact()}}
    with cpu.Scope() as s:
        pass
    out.update(scope=s.mechanism, scope_exact=s.exact, caveats=s.caveats)
    print(json.dumps(out))
    """)
    assert r["mechanism"] == "rss-fallback" and r["c"] is None and r["exact"] is False
    assert "does not import posix_memalign" in r["reason"]
    assert r["scope"] == "rss-fallback" and r["scope_exact"] is False
    assert any("resident set size" in c and "posix_memalign" in c for c in r["caveats"])


def test_a_stand_in_libc10_is_counted_through_its_slots(tmp_path):
    """1000 B through posix_memalign, freed by the direct free: counted; a 48 B
    malloc freed through the library's &free: foreign, not an unseen free."""
    so = _build(tmp_path, "libmtfake", FAKE_SRC)
    r = _run(f"""
    import ctypes, json, torch
    from memtorch import cpu, _C
    lib = ctypes.CDLL({so!r})
    lib.fake_alloc.restype = ctypes.c_void_p
    lib.fake_alloc.argtypes = [ctypes.c_size_t]
    lib.fake_free.argtypes = [ctypes.c_void_p]
    lib.fake_free_ref.restype = ctypes.c_void_p
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    _C._counters_set_target("libmtfake.so")
    out = {{"mechanism": cpu.mechanism()}}
    with cpu.Scope() as s:
        p = lib.fake_alloc(1000)
        out["alive"] = s.delta
        lib.fake_free(p)
        st0 = _C.counters_stats()
        q = libc.malloc(48)
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lib.fake_free_ref())(q)
        st1 = _C.counters_stats()
    out.update(end=s.delta, peak=s.peak_above_start, unseen=s.unseen_frees, foreign=st1[6] - st0[6])
    # torch's own libc10 is not patched meanwhile
    print(json.dumps(out))
    """)
    assert r["mechanism"] == "libc10-got"
    assert r["alive"] == 1000 and r["end"] == 0 and r["peak"] == 1000
    assert r["unseen"] == 0 and r["foreign"] == 1


def test_torch_intra_op_workers_are_the_operators_own(exact_mode):
    """torch's intra-op workers (OpenMP here) allocate inside an operator the tracking thread called:
    counted, filed under that thread's phase and module, never flagged as another thread's. The CPU's
    flash-attention backward allocates in each worker of a parallel region (found by a scope around each
    of a dozen operators: only it had other-thread bytes before this rule)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q = torch.randn(8, 4, 128, 64, requires_grad=True)

        def step():
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

        step()
        for _ in range(3):
            with cpu.Scope() as s:
                step()
            assert (s.other_thread_bytes, s.other_thread_allocations) == (0, 0)
            assert not [c for c in s.caveats if "other threads" in c]
            with memtorch.track() as t:
                step()
            assert t.report.exact and "other threads" not in str(t.report)
    finally:
        torch.set_num_threads(old)
        q.grad = None
