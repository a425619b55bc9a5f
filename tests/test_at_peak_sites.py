"""at_peak's "other": the Python file:line of the largest allocations a block made outside
its phases (src/sites.c, memtorch/peak.py _attach_sites).

Expected lines come from the code itself (inspect / co_firstlineno), expected bytes from
untyped_storage().nbytes(), the threshold from _C.eventlog_sites_config()."""

import inspect
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

import memtorch  # noqa: E402
from memtorch import _C, budget, peak  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and memtorch.cpu.exact()), reason="needs exact CPU counters (event log)"
)

OTHER = peak.OTHER_IN_BLOCK


def _threshold():
    prev = _C.eventlog_sites_config(0, 0)
    _C.eventlog_sites_config(*prev)
    return prev[0]


MIN = _threshold()
N_BIG = 3 * MIN // 4  # float32 elements: 3 x the threshold in bytes
N_SMALL = MIN // 16  # a quarter of the threshold


def make_batch():
    return torch.randn(N_BIG)  # the line a site names: make_batch.__code__.co_firstlineno + 1


def _model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, opt):
    model(torch.ones(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()


def _sites(report):
    owner = next(o for o in report.at_peak.owners if o.name == OTHER)
    return owner, [(f, ln, fn) for f, ln, fn, _, _ in owner.sites]


def test_defaults_agree_with_the_tag_layout():
    prev = _C.eventlog_sites_config(0, 0)
    _C.eventlog_sites_config(*prev)
    assert prev == (4096, (1 << peak.TAG_BITS) - 1)


def test_other_names_the_line_and_bytes_of_a_tensor_made_in_the_block():
    memtorch.cpu.start()
    model, opt = _model()
    _step(model, opt)
    with memtorch.track(model, opt) as t:
        kept = torch.empty(N_BIG); line = inspect.currentframe().f_lineno  # noqa: E702
        small = torch.empty(N_SMALL); small_line = inspect.currentframe().f_lineno  # noqa: E702
        _step(model, opt)  # the peak comes after: both are live there
    owner, where = _sites(t.report)
    me = inspect.currentframe().f_code
    assert (me.co_filename, line, me.co_name) in where
    site = next(s for s in owner.sites if s[1] == line)
    assert site[3:] == (kept.untyped_storage().nbytes(), 1)
    # below the threshold: never listed, and said so
    assert small.untyped_storage().nbytes() < MIN
    assert all(ln != small_line for _, ln, _ in where)
    assert f"under {memtorch.units.format(MIN)}" in owner.sites_note
    # printed under the "other" row, in to_dict, and in the budget failure text
    text = str(t.report.at_peak)
    assert f"{peak.where(me.co_filename, line, me.co_name)}" in text
    d = next(o for o in t.report.to_dict()["at_peak"]["owners"] if o["name"] == OTHER)
    assert {"file": me.co_filename, "line": line, "function": me.co_name, "bytes": site[3], "count": 1} in d["sites"]
    assert peak.where(me.co_filename, line, me.co_name) in budget.breakdown(t.report)
    del kept, small


def test_after_a_nested_block_the_outer_block_keeps_its_phase():
    """The inner block's end puts back the outer block's tag: a tensor the outer block
    allocates after it, in its backward phase (the forward has returned), is a backward
    temporary of the outer block, not "other"."""
    memtorch.cpu.start()
    model, opt = _model()
    _step(model, opt)
    with memtorch.track(model, opt) as outer:
        out = model(torch.ones(8, 16))  # from here on: the backward phase
        with memtorch.track(torch.nn.Linear(2, 2)):  # a block with its own event-log tags
            torch.empty(N_SMALL)
        kept = torch.empty(N_BIG)
        out.sum().backward()
        opt.step()
    at = outer.report.at_peak
    nbytes = kept.untyped_storage().nbytes()
    assert at["backward temporaries, not gradients"] >= nbytes
    assert OTHER not in at or at[OTHER] < nbytes
    del kept


def test_a_helper_function_is_named_with_its_own_line():
    memtorch.cpu.start()
    model, opt = _model()
    _step(model, opt)
    with memtorch.track(model, opt) as t:
        batches = [make_batch() for _ in range(3)]
        _step(model, opt)
    owner, _ = _sites(t.report)
    code = make_batch.__code__
    site = next(s for s in owner.sites if s[2] == "make_batch")
    assert site == (code.co_filename, code.co_firstlineno + 1, "make_batch",
                    sum(b.untyped_storage().nbytes() for b in batches), 3)  # fmt: skip
    del batches


def test_an_allocation_made_with_the_gil_held_is_named_too():
    # torch.tensor(list) copies from Python objects with the GIL held: read in the hook itself
    memtorch.cpu.start()
    model, opt = _model()
    with memtorch.track(model, opt) as t:
        kept = torch.tensor([0.5] * N_BIG); line = inspect.currentframe().f_lineno  # noqa: E702
        _step(model, opt)
    _, where = _sites(t.report)
    assert any(ln == line for _, ln, _ in where)
    del kept


def _loader_block(keep):
    from torch.utils.data import DataLoader, TensorDataset

    memtorch.cpu.start()
    model, opt = _model()
    loader = DataLoader(TensorDataset(torch.ones(32, 16), torch.ones(32, N_BIG // 8)), batch_size=8)
    with memtorch.track(model, opt) as t:
        for x, y in loader:
            line = inspect.currentframe().f_lineno - 1  # the `for` line above
            keep.append(y)  # made by torch's default_collate, kept: "other"
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return t, line


def test_a_batch_made_by_torch_code_is_named_at_the_users_line():
    # the collate function that stacks the batch is torch's own Python code: the line
    # named is the caller's, the `for` over the DataLoader
    keep = []
    t, line = _loader_block(keep)
    owner, where = _sites(t.report)
    me = inspect.currentframe().f_code
    site = next(s for s in owner.sites if s[1] == line)
    assert site == (_loader_block.__code__.co_filename, line, "_loader_block",
                    sum(y.untyped_storage().nbytes() for y in keep), len(keep))  # fmt: skip
    assert me.co_filename == site[0]
    # without the skip: the innermost frame, in torch's collate
    prev = _C.eventlog_sites_skip(None)
    try:
        t, line = _loader_block([])
    finally:
        assert _C.eventlog_sites_skip(prev) is None
    _, where = _sites(t.report)
    assert where and all(f.startswith(prev) for f, _, _ in where)


def _nothing():
    return None


def test_an_operator_that_is_not_a_call_is_named_at_the_next_call_of_its_function():
    # x * 2 allocates inside no call: CPython checks for pending calls only at calls (and
    # loop jumps), so the line is the next call's, in the same function, never the
    # callee's first line
    memtorch.cpu.start()
    model, opt = _model()
    x = torch.ones(N_BIG)
    with memtorch.track(model, opt) as t:
        doubled = x * 2
        _nothing()
        line = inspect.currentframe().f_lineno - 2  # the x * 2 line
        _step(model, opt)
    _, where = _sites(t.report)
    me = inspect.currentframe().f_code
    assert (me.co_filename, line + 1, me.co_name) in where  # the _nothing() line
    assert all(fn != "_nothing" for _, _, fn in where)
    del doubled


def test_another_threads_allocation_is_said_not_read():
    memtorch.cpu.start()
    model, opt = _model()
    out = []
    th = threading.Thread(target=lambda: out.append(torch.empty(N_BIG)))
    with memtorch.track(model, opt) as t:
        th.start()
        th.join()
        _step(model, opt)
    # the other thread's storage (N_BIG float32, live at the peak) is an owner of its own, never
    # this block's "other" with a source line (issue 23 row 5)
    from memtorch.peak import OTHER_THREADS

    at_peak = t.report.at_peak
    assert at_peak[OTHER_THREADS] == N_BIG * 4
    assert all(not o.sites for o in at_peak.owners if o.name == OTHER)
    del out


def test_sites_older_than_the_table_are_said_lost():
    memtorch.cpu.start()
    model, opt = _model()
    with memtorch.track(model, opt) as t:
        kept = torch.empty(2 * N_BIG)
        for _ in range(5000):  # more sites than the table keeps (4096), each freed at once
            torch.empty(N_BIG)
    owner, _ = _sites(t.report)
    assert owner.sites == []
    assert "older than the latest 4096" in owner.sites_note
    assert t.report.at_peak.total == t.report.peak
    del kept


def test_no_code_object_is_kept_after_the_blocks():
    memtorch.cpu.start()
    model, opt = _model()
    code = make_batch.__code__
    me = sys._getframe().f_code
    refs0 = sys.getrefcount(code), sys.getrefcount(me)
    for _ in range(50):
        with memtorch.track(model, opt) as t:
            b = make_batch()
            _step(model, opt)
        assert any(s[2] == "make_batch" for s in _sites(t.report)[0].sites)
        del b
    assert (sys.getrefcount(code), sys.getrefcount(me)) == refs0


def test_config_rejects_bad_values_and_reading_checks_its_arguments():
    prev = _C.eventlog_sites_config(0, 0)
    try:
        with pytest.raises(ValueError, match="min_bytes must be >= 0"):
            _C.eventlog_sites_config(-1, 0)
        with pytest.raises(ValueError, match="owner_mask < 2"):
            _C.eventlog_sites_config(1, 1 << 32)
        with pytest.raises(TypeError, match="takes 2 arguments"):
            _C.eventlog_sites(0)
        with pytest.raises(OverflowError):
            _C.eventlog_sites(-1, 0)
    finally:
        _C.eventlog_sites_config(*prev)
    assert _C.eventlog_sites_config(*prev) == prev
