"""Reference-leak loops over the counters' _C functions (in the manner of CPython's refleak.py).

Each call is warmed up, then run in rounds; a leak is a growth of
sys.getallocatedblocks() that stays positive in every round after warm-up.
"""

import sys

import pytest
import numpy as np
import torch

from memtorch import _C, cpu

pytestmark = pytest.mark.usefixtures("raw_counters")

WARMUP, ROUNDS, CALLS = 3, 4, 200

def _calls(handle):
    """Every counters / event-log function of _C -> a call exercising its success and error paths."""
    sid, gen = handle

    def raises(fn, *args):
        def call():
            try:
                fn(*args)
            except (RuntimeError, ValueError, TypeError, OverflowError):
                pass
            else:
                raise AssertionError(f"{fn.__name__}{args} did not raise")

        return call

    return {
        "counters_install": lambda: (_C.counters_install(), _C.counters_uninstall()),
        # refcount 1 with a scope open: refused (the success path is in counters_install's call)
        "counters_uninstall": raises(_C.counters_uninstall),
        "counters_installed": _C.counters_installed,
        "counters_probe": _C.counters_probe,
        "counters_mechanism": _C.counters_mechanism,
        "counters_current": _C.counters_current,
        "counters_peak": _C.counters_peak,
        "counters_reset_peak": _C.counters_reset_peak,
        "counters_stats": _C.counters_stats,
        "counters_open_scopes": _C.counters_open_scopes,
        "counters_rss": _C.counters_rss,
        "scope_open": lambda: _C.scope_close(*_C.scope_open(True)[:2]),
        "scope_read": lambda: (_C.scope_read(sid, gen), raises(_C.scope_read, sid, gen + 99)(),
                               raises(_C.scope_read, -1, gen)(), raises(_C.scope_read, sid)()),
        "scope_close": raises(_C.scope_close, sid, gen + 99),
        # with a timeline (the event log's user count given back at the end), then the errors
        "scope_begin": lambda: (_C.scope_end(*_C.scope_begin(True)[:2]), raises(_C.scope_begin, _BadBool())()),
        "scope_end": lambda: (raises(_C.scope_end, sid, gen + 99)(), raises(_C.scope_end, sid)()),
        "_counters_slot_info": lambda: (_C._counters_slot_info("free"),
                                        raises(_C._counters_slot_info, "malloc")()),
        "_counters_inject": lambda: (_C._counters_inject(0x7A00_0000_0040, 100),
                                     _C._counters_inject(0x7A00_0000_0040, -1),
                                     _C._counters_inject(0x7A00_0000_0048, -2),
                                     raises(_C._counters_inject, 0x7A00_0000_0040, -3)(),
                                     raises(_C._counters_inject, 0, 1)()),
        "_counters_bench": lambda: (_C._counters_bench(10, 64), raises(_C._counters_bench, 0, 64)(),
                                    raises(_C._counters_bench, 1)()),
        "counters_check": _C.counters_check,
        "counters_loss_info": _C.counters_loss_info,
        "counters_restarted": _C.counters_restarted,
        "counters_last_failure": _C.counters_last_failure,
        # refused while installed (a scope is open): the error path; the success path runs in test_coexist
        "_counters_set_target": lambda: (raises(_C._counters_set_target, "libc10.so")(),
                                         raises(_C._counters_set_target, 5)()),
        "_counters_tool": lambda: (_C._counters_tool("chain"), _C._counters_tool("uninstall"),
                                   raises(_C._counters_tool, "uninstall")(),
                                   raises(_C._counters_tool, "bogus")()),
        "eventlog_read": lambda: (_C.eventlog_read(0, _C.eventlog_head()), raises(_C.eventlog_read, -1, 0)()),
        "eventlog_head": _C.eventlog_head,
        "eventlog_read_all": lambda: (_C.eventlog_read_all(0, _C.eventlog_head()),
                                      _C.eventlog_read_all(0, _C.eventlog_head(), True),
                                      raises(_C.eventlog_read_all, -1, 0)(),
                                      raises(_C.eventlog_read_all, 0, 0, 0, 0)()),
        "eventlog_replay": lambda: (
            _C.eventlog_replay(_C.eventlog_read_all(0, _C.eventlog_head())[0], 0, 0, 0, 1, 3, [0, 64]),
            raises(_C.eventlog_replay, [1], 0, 0, 0, 1, 0, [])(),
            raises(_C.eventlog_replay, _C.eventlog_read_all(0, 0)[0], 0, 0, 0, 1, 0, [-1])(),
        ),
        "eventlog_names": lambda: (
            _C.eventlog_names(np.array([[64, 8, 0, 1, 5]], dtype=np.int64), [(3, {64: ("a",), 128: ("b",)})],
                              [64, 128], np.array([[0, 8, 1], [-1, 0, 0]], dtype=np.int64), 0, {128: 16}),
            raises(_C.eventlog_names, [], [], [], [], 0, {})(),
        ),
        "eventlog_mark": lambda: (_C.eventlog_mark(3, 0, 0), raises(_C.eventlog_mark, 9, 0, 0)(),
                                  raises(_C.eventlog_mark, 1, 0)()),
        # refused while a scope is open (this suite's): the parsing and the error paths
        "counters_adopt": lambda: (_C.counters_adopt([0x7A00_0000_0040], [64]), raises(_C.counters_adopt, [1], [])(),
                                   raises(_C.counters_adopt, [0], [8])(), raises(_C.counters_adopt, 5, 5)()),
        "counters_sizes": lambda: (_C.counters_sizes([0, 0x7A00_0000_0040]), raises(_C.counters_sizes, [-1])(),
                                   raises(_C.counters_sizes, 5)()),
        "counters_serials": lambda: (_C.counters_serials([0, 0x7A00_0000_0040]), raises(_C.counters_serials, [-1])(),
                                     raises(_C.counters_serials, 5)()),
        "eventlog_sites": lambda: (_C.eventlog_sites(0, _C.eventlog_head()), raises(_C.eventlog_sites, -1, 0)(),
                                   raises(_C.eventlog_sites, 0)()),
        "eventlog_sites_config": lambda: (_C.eventlog_sites_config(*_C.eventlog_sites_config(0, 0)),
                                          raises(_C.eventlog_sites_config, -1, 0)()),
        "eventlog_sites_skip": lambda: (_C.eventlog_sites_skip(_C.eventlog_sites_skip(None)),
                                        raises(_C.eventlog_sites_skip, 5)()),
        "monotonic_ns": _C.monotonic_ns,
        "torch_alloc": lambda: torch.empty(100),  # the hook path itself
    }


def _counters_functions():
    prefixes = ("counters_", "scope_", "eventlog_", "_counters_", "monotonic_ns")
    return sorted(n for n in dir(_C) if n.startswith(prefixes) and callable(getattr(_C, n)))


class _BadBool:
    """A timeline flag whose truth raises: scope_begin's error path before any lock."""

    def __bool__(self):
        raise ValueError("no truth")


def _leaks(fn):
    deltas = []
    for i in range(WARMUP + ROUNDS):
        before = sys.getallocatedblocks()
        for _ in range(CALLS):
            fn()
        after = sys.getallocatedblocks()
        if i >= WARMUP:
            deltas.append(after - before)
    return deltas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact mechanism is Linux-only")
def test_counters_functions_do_not_leak(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "libc10-got")
    with cpu.Scope() as s:
        calls = _calls(s._handle)
        # the meta-test: every counters function of _C is in this suite
        missing = [n for n in _counters_functions() if n not in calls]
        assert missing == [], f"not covered by the refleak loop: {missing}"
        leaking = {}
        for name, fn in calls.items():
            deltas = _leaks(fn)
            if all(d > 0 for d in deltas):
                leaking[name] = deltas
        assert leaking == {}
    # counters_uninstall's error path, outside any installation
    def uninstall_error():
        try:
            _C.counters_uninstall()
        except RuntimeError:
            pass

    assert not all(d > 0 for d in _leaks(uninstall_error))


def test_fallback_scope_does_not_leak(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "rss")

    def one():
        with cpu.Scope() as s:
            s.current
        s.peak

    assert not all(d > 0 for d in _leaks(one))
