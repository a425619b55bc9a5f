"""memtorch's CPU counters beside other tools that patch the same libc10 import slots.

A stand-in tool in _C (``_C._counters_tool``) patches libc10's posix_memalign/free
slots as another profiler would: 'chain' forwards to what it found and restores
only its own slots, 'naive' restores unconditionally, 'libc' forwards to libc and
writes libc's functions back (what memray does). Each scenario runs in a
subprocess: a broken chain crashes the process (infinite recursion: SIGSEGV).
Then real memray and real pytest-memray.

Expected figures: torch.empty(1000, 1000) is 1000 * 1000 float32 elements of
4 bytes = 4,000,000 B, allocated with one posix_memalign and released with one
free, both through libc10's slots (so a tool on the path sees exactly 2 calls).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GOT patching is Linux-only")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMPTY = 1000 * 1000 * 4  # torch.empty(1000, 1000), float32

PRELUDE = '''
import json, sys, torch
from memtorch import cpu, _C
out = {}
def probe():
    """(bytes counted while alive, bytes counted after the free, calls the tool saw)."""
    t0 = _C._counters_tool("calls"); c0 = _C.counters_current()
    x = torch.empty(1000, 1000)
    grew = _C.counters_current() - c0
    del x
    return [grew, _C.counters_current() - c0, _C._counters_tool("calls") - t0]
def slot():
    return _C._counters_slot_info("posix_memalign")[0]
'''


def run(body, env=None):
    """Run PRELUDE + body in a fresh interpreter; returns the dict it stored in `out`."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    code = code.replace("MEMRAY_PRELUDE\n", MEMRAY_PRELUDE)
    full_env = dict(os.environ, MEMTORCH_CPU_MECHANISM="libc10-got", MEMTORCH_CPU_KEEP="0")
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# The stand-in tool: install orders and uninstall orders.


def test_tool_first_then_memtorch_uninstall_memtorch_first():
    r = run('''
    original = slot()
    _C._counters_tool("chain")
    tool = slot()
    cpu.install()
    out["both"] = probe()            # memtorch counts, and forwards to the tool
    out["saved"] = _C._counters_slot_info("posix_memalign")[1] == tool
    cpu.uninstall()
    out["tool_back"] = slot() == tool
    _C._counters_tool("uninstall")
    out["original_back"] = slot() == original
    out["after"] = probe()
    ''')
    assert r["both"] == [EMPTY, 0, 2]  # counted once; the tool saw 1 posix_memalign + 1 free
    assert r["saved"] and r["tool_back"] and r["original_back"]
    assert r["after"] == [0, 0, 0]


def test_tool_first_then_memtorch_uninstall_tool_first():
    r = run('''
    _C._counters_tool("chain")
    cpu.install()
    _C._counters_tool("uninstall")   # polite: our hook sits on top of it, so it leaves the slot alone
    out["still"] = probe()
    out["intact"] = _C.counters_check() == 0
    cpu.uninstall()
    out["after"] = probe()
    ''')
    assert r["still"][:2] == [EMPTY, 0] and r["intact"]
    assert r["after"][:2] == [0, 0]


def test_memtorch_first_then_tool_uninstall_in_each_order():
    r = run('''
    original = slot()
    cpu.install()
    _C._counters_tool("chain")       # on top of our hook, forwarding to it
    out["tool_on_top"] = probe()
    # memtorch cannot tell a tool that forwards to it from one that does not:
    # it puts its hook back on top, chained to the tool (no cycle: guarded)
    with cpu.Scope() as s:
        out["scope"] = probe()
    out["exact"] = s.exact
    cpu.uninstall()                   # must not cut the tool out of the chain
    out["after_memtorch"] = probe()
    _C._counters_tool("uninstall")
    out["after_both"] = probe()
    ''')
    assert r["tool_on_top"] == [EMPTY, 0, 2]
    assert r["scope"][:2] == [EMPTY, 0] and r["scope"][2] >= 2 and r["exact"] is True
    assert r["after_memtorch"][0] == 0 and r["after_memtorch"][2] >= 2  # the tool still sees them
    assert r["after_both"][:2] == [0, 0]


def test_reinstall_under_a_tool_that_chains_to_memtorch_does_not_recurse():
    """The issue's SIGSEGV: install, a tool chains to our hook, uninstall (the tool stays
    on top, forwarding to us), install again: we used to forward to the tool, which
    forwards to us, forever."""
    r = run('''
    cpu.install()
    _C._counters_tool("chain")
    cpu.uninstall()
    cpu.install()
    out["probe"] = probe()
    out["many"] = [probe() for _ in range(200)][-1]
    with cpu.Scope() as s:
        xs = [torch.empty(250) for _ in range(1000)]   # 1000 * 250 * 4 B
        out["delta"] = s.delta
        del xs
    out["end"] = s.delta
    cpu.uninstall()
    _C._counters_tool("uninstall")
    out["after"] = probe()[:2]
    ''')
    assert r["probe"] == [EMPTY, 0, 2]  # counted once, not twice; the tool saw each call once
    assert r["many"] == [EMPTY, 0, 2]
    assert r["delta"] == 1000 * 250 * 4 and r["end"] == 0
    assert r["after"] == [0, 0]


def test_double_installation_is_refcounted_and_adopts_its_own_hook():
    r = run('''
    hook = _C._counters_slot_info("posix_memalign")[3]
    cpu.install(); cpu.install()
    out["patched_once"] = slot() == hook and _C.counters_installed() == 2
    cpu.uninstall(); cpu.uninstall()
    # a polite tool that saved our hook puts it back when it leaves: our hook sits
    # in the slot while memtorch is not installed, and only forwards
    cpu.install(); _C._counters_tool("chain"); cpu.uninstall(); _C._counters_tool("uninstall")
    out["ours_left"] = slot() == hook
    out["forwarding"] = probe()[:2]
    cpu.install()                    # adopts it: nothing to patch, no self-forwarding
    out["adopted"] = probe()
    cpu.uninstall()
    ''')
    assert r["patched_once"] and r["ours_left"]
    assert r["forwarding"] == [0, 0]
    assert r["adopted"][:2] == [EMPTY, 0]


def test_a_tool_that_writes_libc_back_is_noticed_and_the_scope_is_not_exact():
    """memray's way: its hooks call libc directly, and stopping writes libc's functions
    into every slot, ours included."""
    r = run('''
    with cpu.Scope() as s:
        a = torch.empty(1000, 1000)           # counted: 4,000,000 B
        _C._counters_tool("libc")
        out["during"] = probe()               # the tool's hooks bypass ours
        _C._counters_tool("uninstall")        # writes libc back
    out["exact"] = s.exact
    out["caveats"] = s.caveats
    out["losses"] = _C.counters_loss_info()[0]
    with cpu.Scope() as s2:                    # hooks put back: exact again
        out["next"] = probe()
    out["next_exact"] = s2.exact
    out["next_caveats"] = s2.caveats
    ''')
    assert r["during"][0] == 0 and r["during"][2] == 2
    assert r["exact"] is False
    assert any("Another tool replaced memtorch's allocation hooks" in c for c in r["caveats"])
    assert any("libc" in c for c in r["caveats"])  # names what sat in the slot
    assert r["losses"] >= 1
    assert r["next"][:2] == [EMPTY, 0] and r["next_exact"] is True
    # counting is not kept here (MEMTORCH_CPU_KEEP=0), so the next block begins it and says only that
    assert [c[:37] for c in r["next_caveats"]] == ["Counting began when this block opened"]


def test_a_tool_that_writes_libc_back_inside_a_block_per_step_is_noticed_as_by_the_general_path():
    """The same tool inside a track(model, optimizer) block with counting held (a block per training
    step: Tracker._enter_lean and _finish_lean, the block's scope by its own C calls): its end finds the
    hooks gone, reads where they went, and says what the general path says (the block opened as it is),
    each in a process of its own."""
    body = '''
    import memtorch
    cpu.start()
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    t = memtorch.track(model, opt)
    t._lean = LEAN
    with t:
        model(torch.ones(8, 64)).sum().backward()
        _C._counters_tool("libc")
        opt.step()
        _C._counters_tool("uninstall")    # writes libc back, over memtorch's hooks
        opt.zero_grad()
    r = t.report
    out["said"] = [r.exact, r.caveats, r.mechanism, t._scope is None, sorted(r.phases)]
    '''
    lean, general = (run(body.replace("LEAN", str(lean)))["said"] for lean in (True, False))
    assert lean[0] is False and any("Another tool replaced memtorch's allocation hooks" in c for c in lean[1])
    assert lean[3] is True  # its scope by its own C calls until then
    assert lean == general
    assert lean[4] == ["backward", "forward", "optimizer"]


def test_a_tool_that_writes_libc_back_inside_a_counters_only_block_is_noticed_either_way():
    """The same tool inside `with memtorch.track():`, with counting held (the block's scope by its own C
    calls, ended by its own short way: Tracker.__exit__) and without (a cpu.Scope): each end finds the
    hooks gone and says so alike, each in a process of its own."""
    body = '''
    import memtorch
    if HOLD:
        cpu.start()
    with memtorch.track() as t:
        a = torch.empty(1000, 1000)
        _C._counters_tool("libc")
        b = torch.empty(10, 10)
        _C._counters_tool("uninstall")    # writes libc back, over memtorch's hooks
    r = t.report
    out["said"] = [r.exact, [c[:60] for c in r.caveats if "Another tool" in c], r.mechanism, r.delta]
    out["left"] = [t._scope, t._raw, t._open, memtorch.tracking._debug_leftovers()]
    '''
    held, plain = (run(body.replace("HOLD", str(hold))) for hold in (True, False))
    assert held["said"] == plain["said"]
    assert held["said"][0] is False and len(held["said"][1]) == 1
    assert held["said"][3] >= 4_000_000  # a counted; b went to libc unseen
    assert held["left"] == plain["left"] == [None, None, False, []]


def test_a_naive_tool_restoring_under_memtorch_is_noticed():
    r = run('''
    original = slot()
    _C._counters_tool("naive")
    with cpu.Scope() as s:
        _C._counters_tool("uninstall")    # writes what it saved over our hook
        out["during"] = probe()[0]
    out["exact"] = s.exact
    cpu.uninstall() if cpu.installed() else None
    out["restored"] = slot() == original
    ''')
    assert r["during"] == 0 and r["exact"] is False
    assert r["restored"]


# ---------------------------------------------------------------------------
# Real memray.

def _need(module):
    pytest.importorskip(module)


MEMRAY_PRELUDE = '''
import memray, os, tempfile
d = tempfile.mkdtemp()
def tracker(name):
    return memray.Tracker(os.path.join(d, name + ".bin"))
'''


@pytest.mark.parametrize("keep", ["0", "1"])
def test_memray_tracker_before_around_and_inside_a_scope(keep):
    """Each figure is exact to the byte or marked not exact: never 0 B with exact=True."""
    _need("memray")
    r = run('''
    MEMRAY_PRELUDE
    def figures(s):
        return [s.peak_above_start, s.exact, s.caveats]
    cpu.start() if cpu._keep else None
    with tracker("before"):
        torch.empty(10)
    with cpu.Scope() as s:                 # after a Tracker ran and restored libc's functions
        x = torch.empty(1000, 1000); del x
    out["before"] = figures(s)
    with tracker("around"):
        with cpu.Scope() as s:
            x = torch.empty(1000, 1000); del x
    out["around"] = figures(s)
    with cpu.Scope() as s:
        with tracker("inside"):
            x = torch.empty(1000, 1000); del x
    out["inside"] = figures(s)
    with cpu.Scope() as s:
        x = torch.empty(1000, 1000); del x
    out["after"] = figures(s)
    cpu.stop()
    ''', env={"MEMTORCH_CPU_KEEP": keep})
    for case in ("before", "around", "after"):
        peak, exact, caveats = r[case]
        assert (peak, exact) == (EMPTY, True), (case, r[case])
    peak, exact, caveats = r["inside"]
    assert exact is False and any("memray" in c for c in caveats)
    # whatever the figure, never a silent 0 B called exact
    for case, (peak, exact, _) in r.items():
        assert not (exact and peak == 0), case


def test_memray_still_sees_tensor_memory_while_memtorch_counts():
    """Chaining keeps memray working: its capture holds the 4,000,000-byte block."""
    _need("memray")
    r = run('''
    MEMRAY_PRELUDE
    path = os.path.join(d, "cap.bin")
    with memray.Tracker(path):
        with cpu.Scope() as s:
            x = torch.empty(1000, 1000)
            del x
    reader = memray.FileReader(path)
    sizes = [a.size for a in reader.get_allocation_records()]
    out["memray_saw"] = EMPTY_SIZE in sizes
    out["scope"] = [s.peak_above_start, s.exact]
    '''.replace("EMPTY_SIZE", str(EMPTY)))
    assert r["memray_saw"] is True
    assert r["scope"] == [EMPTY, True]


def test_pytest_memray_beside_memory_budgets(pytester):
    """pytest --memray beside @pytest.mark.memory_budget: budgets still measure."""
    _need("pytest_memray")
    _need("memray")
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.memory_budget(peak="1 MiB")
        def test_over_budget():
            x = torch.empty(1000, 1000)   # 4,000,000 B > 1 MiB
            del x

        @pytest.mark.memory_budget(peak="8 MiB")
        def test_under_budget():
            x = torch.empty(1000, 1000)
            del x

        def test_plain_first():
            torch.empty(10)

        @pytest.mark.memory_budget(peak="1 MiB")
        def test_over_budget_again():
            x = torch.empty(1000, 1000)
            del x
        """
    )
    env = {"MEMTORCH_CPU_MECHANISM": "libc10-got"}
    for k, v in env.items():
        pytester._monkeypatch.setenv(k, v)
    result = pytester.runpytest_subprocess("--memray", "-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=2)
    text = result.stdout.str()
    assert "test_over_budget " in text or "test_over_budget" in text
    # the failure names the measured peak: 4,000,000 B = 3.8 MiB, over 1 MiB
    assert "3.8 MiB" in text
