"""_C.ModuleMarks: track()'s module hooks in C (event-log mode), checked against the marks and
owner tags the Python hooks wrote, with bad input, deep nesting, cycles and a leak loop."""

import gc
import sys
import weakref

import pytest

from memtorch import _C, cpu
from memtorch import peak as attribution
from test_refleaks_counters import _leaks

MARKS_FUNCTIONS = {"ModuleMarks"}  # for the leak suites' meta-test (test_refleaks_meta.py)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact counters are Linux-only")


class _Mod:  # stands for a module: the marks only compare its address
    pass


def _log(ev0):
    ev, dropped = _C.eventlog_read_all(ev0, _C.eventlog_head())
    assert dropped == 0
    return [(int(k), int(p), int(t)) for k, p, t in zip(ev["kind"], ev["ptr"], ev["tag"]) if k != 0]


@linux_only
def test_marks_and_tags_are_those_of_the_python_hooks():
    """A root with one child: enter root, enter child, exit child, exit root. The root's
    callbacks run before its enter mark and after its exit mark; the tags are
    tagbase | (row + 1) << 2 | phase, and on exit the enclosing module's (or the block's)."""
    root, child, other = _Mod(), _Mod(), _Mod()
    base = 7 << attribution.TAG_BITS
    calls = []

    def on_pre(module, args):
        calls.append(("pre", module is root, args))
        marks.phase_code = 1  # what the Python root hook's forward phase does
        _C.eventlog_mark(3, 0x101, marks.top())

    def on_post(module, args, output):
        calls.append(("post", module is root, output))
        marks.phase_code = 0

    marks = _C.ModuleMarks({id(root): 0, id(child): 1}, id(root), base, on_pre, on_post)
    with cpu.Scope(timeline=True) as s:
        marks.pre(root, ("x",))
        marks.pre(other, ())  # not the model's: nothing
        marks.pre(child, ())
        assert marks.depth == 2 and marks.top() == attribution.make_tag(7, 1, 1)
        marks.post(child, (), "out")
        marks.post(other, (), None)
        marks.post(root, ("x",), "y")
        log = _log(s._ev0)
    assert calls == [("pre", True, ("x",)), ("post", True, "y")]
    assert log == [
        (3, 0x101, base | 1),
        (1, 0, attribution.make_tag(7, 0, 1)),
        (1, 1, attribution.make_tag(7, 1, 1)),
        (2, 1, attribution.make_tag(7, 0, 1)),
        (2, 0, base | 1),  # the phase ends in the root's post callback, after this mark
    ]
    assert marks.depth == 0 and marks.top() == base  # phase_code back to 0


@linux_only
def test_nesting_deeper_than_the_stack_keeps_counting():
    """Recursion deeper than the 256 tags kept: the depth still counts, and once back
    within the stack the tags are the modules' again."""
    m = _Mod()
    marks = _C.ModuleMarks({id(m): 3}, 0, 1 << attribution.TAG_BITS, lambda *a: None, lambda *a: None)
    for _ in range(300):
        marks.pre(m, ())
    assert marks.depth == 300 and marks.top() == attribution.make_tag(1, 3, 0)
    for _ in range(300):
        marks.post(m, (), None)
    assert marks.depth == 0 and marks.top() == 1 << attribution.TAG_BITS
    marks.post(m, (), None)  # an exit without its enter (a hook added mid-forward): no underflow
    assert marks.depth == 0


@pytest.mark.parametrize(
    "args, error, match",
    [
        (([], 0, 0, print, print), TypeError, "dict"),
        (({1: 0}, 0, 0, 1, print), TypeError, "callable"),
        (({0: 0}, 0, 0, print, print), ValueError, "module ids"),
        (({1: -1}, 0, 0, print, print), ValueError, "rows"),
        (({1: 1 << 22}, 0, 0, print, print), ValueError, "rows"),
        (({"a": 0}, 0, 0, print, print), TypeError, "integer"),
        (({1: 0}, 0, 1 << 32, print, print), ValueError, "tagbase"),
    ],
)
def test_bad_input_is_refused(args, error, match):
    with pytest.raises(error, match=match):
        _C.ModuleMarks(*args)


def test_bad_calls_and_phase_codes_are_refused():
    marks = _C.ModuleMarks({}, 0, 0, print, print)
    with pytest.raises(TypeError, match="2 arguments"):
        marks.pre(_Mod())
    with pytest.raises(TypeError, match="3 arguments"):
        marks.post(_Mod(), ())
    with pytest.raises(ValueError, match="0..3"):
        marks.phase_code = 4
    with pytest.raises(AttributeError):
        del marks.phase_code
    root = _Mod()

    def fails(module, args):
        raise RuntimeError("from the root's hook")

    marks = _C.ModuleMarks({id(root): 0}, id(root), 0, fails, print)
    with pytest.raises(RuntimeError, match="root's hook"):
        marks.pre(root, ())
    assert marks.depth == 0  # nothing pushed for a failed root


def test_a_cycle_through_the_callbacks_is_collected():
    """The Tracker holds its marks and the marks hold the Tracker's bound methods."""

    class Holder:
        def pre(self, module, args):
            pass

        def post(self, module, args, output):
            pass

    h = Holder()
    h.marks = _C.ModuleMarks({}, 0, 0, h.pre, h.post)
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None


def test_marks_do_not_leak():
    root, child = _Mod(), _Mod()
    ids = {id(root): 0, id(child): 1}

    def once():
        marks = _C.ModuleMarks(ids, id(root), 5 << attribution.TAG_BITS, lambda m, a: None, lambda m, a, o: None)
        marks.pre(root, ())
        marks.pre(child, ())
        marks.post(child, (), None)
        marks.post(root, (), None)
        marks.phase_code = 2
        marks.top()
        try:
            _C.ModuleMarks({1: -1}, 0, 0, print, print)
        except ValueError:
            pass
        try:
            marks.pre(root)
        except TypeError:
            pass

    deltas = _leaks(once)
    assert not all(d > 0 for d in deltas), deltas
