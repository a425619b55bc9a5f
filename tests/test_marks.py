"""_C.ModuleMarks: track()'s module and optimizer hooks in C (event-log mode): the marks and
owner tags of the modules and phases, the names of the batch, gradients and new optimizer
state, checked against hand-written expectations and the tensors themselves; with bad input,
deep nesting, cycles and a leak loop."""

import gc
import sys
import weakref

import pytest
import torch

from memtorch import _C, cpu
from memtorch import peak as attribution
from test_refleaks_counters import _leaks

MARKS_FUNCTIONS = {"ModuleMarks"}  # for the leak suites' meta-test (test_refleaks_meta.py)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact counters are Linux-only")

FORWARD, BACKWARD, OPTIMIZER = (attribution.PHASE_CODES[k] for k in ("forward", "backward", "optimizer"))


class _Mod:  # stands for a module: the marks only compare its address
    pass


def _log(ev0):
    ev, dropped = _C.eventlog_read_all(ev0, _C.eventlog_head())
    assert dropped == 0
    return [(int(k), int(p), int(t)) for k, p, t in zip(ev["kind"], ev["ptr"], ev["tag"]) if k != 0]


def _marks(ids=None, root=0, token=7, snaps=None, grad=lambda: True, timeline=None, shapes=False):
    return _C.ModuleMarks(
        {} if ids is None else ids, root, token << attribution.TAG_BITS, [] if snaps is None else snaps, grad,
        timeline, shapes,
    )  # fmt: skip


@linux_only
def test_module_and_phase_marks_and_tags():
    """A root with one child, with autograd on: the root's pre-hook begins the forward phase
    before its enter mark; its post-hook, after its exit mark, ends it and begins the
    backward phase. Tags are tagbase | (row + 1) << 2 | phase; on exit the enclosing
    module's (or the block's with its phase); a phase's end mark carries the bare tagbase."""
    root, child, other = _Mod(), _Mod(), _Mod()
    base = 7 << attribution.TAG_BITS
    timeline = []
    marks = _marks({id(root): 0, id(child): 1}, id(root), timeline=timeline)
    with cpu.Scope(timeline=True) as s:
        marks.pre(root, ("x",))
        marks.pre(other, ())  # not the model's: nothing
        marks.pre(child, ())
        assert marks.depth == 2 and marks.top() == attribution.make_tag(7, 1, FORWARD)
        marks.post(child, (), "out")
        marks.post(other, (), None)
        marks.post(root, ("x",), "y")
        assert marks.phase_code == BACKWARD and marks.top() == base | BACKWARD
        marks.end_phase()
        log = _log(s._ev0)
    assert log == [
        (3, 0x100 | FORWARD, base | FORWARD),
        (1, 0, attribution.make_tag(7, 0, FORWARD)),
        (1, 1, attribution.make_tag(7, 1, FORWARD)),
        (2, 1, attribution.make_tag(7, 0, FORWARD)),
        (2, 0, base | FORWARD),  # the phase ends after the root's exit mark
        (3, 0x200 | FORWARD, base),
        (3, 0x100 | BACKWARD, base | BACKWARD),
        (3, 0x200 | BACKWARD, base),
    ]
    assert marks.depth == 0 and marks.top() == base and marks.phase_code == 0
    assert marks.forwards == 1
    (fc, fs), (bc, bs), (oc, os_) = marks.phases
    assert (fc, bc, oc) == (1, 1, 0) and fs > 0 and bs > 0 and os_ == 0
    assert [(kind, name) for _, kind, name in timeline] == [
        ("phase", "forward"), ("end", "forward"), ("phase", "backward"), ("end", "backward"),
    ]  # fmt: skip
    times = [ns for ns, _, _ in timeline]
    assert times == sorted(times) and times[0] > 0


def test_no_backward_phase_without_autograd_and_recursion_is_one_forward():
    root = _Mod()
    marks = _marks({id(root): 0}, id(root), grad=lambda: False)
    marks.pre(root, ())
    marks.pre(root, ())  # a root calling itself: one forward
    marks.post(root, (), None)
    assert marks.phase_code == FORWARD
    marks.post(root, (), None)
    assert marks.phase_code == 0 and marks.forwards == 1
    assert [c for c, _ in marks.phases] == [1, 0, 0]
    marks.post(root, (), None)  # an end without its beginning (hooks added mid-forward): nothing
    assert marks.phase_code == 0 and [c for c, _ in marks.phases] == [1, 0, 0]


@linux_only
def test_the_batch_is_named_by_address_and_listed_as_the_last_inputs():
    """The tensors among the root's arguments are named "input j" (or "input" for a single
    argument) at the point of the log where the forward began; others are skipped."""
    root = _Mod()
    snaps = []
    marks = _marks({id(root): 0}, id(root), snaps=snaps, shapes=True)
    with cpu.Scope():
        x = torch.randn(4, 3)
        y = torch.zeros(5, dtype=torch.int64)[1:]  # a view: its storage's address
        head = _C.eventlog_head()
        marks.pre(root, (x, "not a tensor", y))
        assert marks.last_inputs == [x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()]
        assert snaps == [(head, {
            x.untyped_storage().data_ptr(): ("input 0", "input", None, x.shape, x.dtype),
            y.untyped_storage().data_ptr(): ("input 2", "input", None, y.shape, y.dtype),
        })]  # fmt: skip
        marks.post(root, (), None)
        marks.pre(root, (x,))
        assert snaps[-1][1] == {x.untyped_storage().data_ptr(): ("input", "input", None, x.shape, x.dtype)}
        marks.post(root, (), None)
        marks.pre(root, ("no tensor",))
        assert marks.last_inputs == [] and len(snaps) == 2  # nothing to name: no snapshot
        marks.post(root, (), None)
        marks.end_phase()


@linux_only
def test_optimizer_hooks_name_gradients_and_new_state():
    """opt_pre: the optimizer phase and the gradients' names; opt_post: the phase ends and,
    when the optimizer's state has new entries, their tensors are named
    ("<param>.exp_avg"); no walk before the params are set."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    b = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([w, b], lr=0.1)
    snaps = []
    base = 3 << attribution.TAG_BITS
    marks = _marks(token=3, snaps=snaps)
    addr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    with cpu.Scope(timeline=True) as s:
        (w.sum() + b.sum()).backward()
        marks.opt_pre(opt, (), {})
        assert snaps == [] and marks.phase_code == OPTIMIZER  # params not set yet: no names
        marks.opt_post(opt, (), {})
        marks.params = [("w", weakref.ref(w)), ("b", weakref.ref(b))]
        marks.state_n = len(opt.state)
        marks.opt_pre(opt, (), {})
        opt.step()
        marks.opt_post(opt, (), {})
        log = _log(s._ev0)
    assert snaps[0][1] == {
        addr(w.grad): ("w.grad", "gradient", None, None, None),
        addr(b.grad): ("b.grad", "gradient", None, None, None),
    }
    assert marks.state_n == 2 == len(opt.state)
    want = {}
    for name, p in (("w", w), ("b", b)):
        for key, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr():
                want[addr(v)] = (f"{name}.{key}", "optimizer state", None, None, None)
    assert snaps[1][1] == want and len(want) >= 4  # exp_avg and exp_avg_sq of each
    assert [k for k, _, _ in log].count(3) == 4  # two optimizer phases, begun and ended
    assert (3, 0x100 | OPTIMIZER, base | OPTIMIZER) in log and (3, 0x200 | OPTIMIZER, base) in log
    n = len(snaps)
    marks.opt_pre(opt, (), {})
    opt.step()
    marks.opt_post(opt, (), {})  # no new state: the gradients only
    assert len(snaps) == n + 1 and all(v[1] == "gradient" for v in snaps[-1][1].values())
    assert [c for c, _ in marks.phases] == [0, 0, 3]


def test_snapshots_keep_the_first_16_and_the_latest():
    w = torch.nn.Parameter(torch.randn(3))
    w.grad = torch.ones(3)
    snaps = [(-i, {}) for i in range(256)]  # stand-ins for the walks already kept
    marks = _marks(snaps=snaps)
    marks.params = [("w", weakref.ref(w))]
    marks.opt_pre(None, (), {})
    assert len(snaps) == 256 and [h for h, _ in snaps[:17]] == [-i for i in range(16)] + [-17]
    assert [v[0] for v in snaps[-1][1].values()] == ["w.grad"]
    given = {1: ("mine", "input", None, None, None)}  # watch()'s walk, added the same way
    head = _C.eventlog_head()
    marks.snapshot(given)
    assert len(snaps) == 256 and snaps[-1] == (head, given) and snaps[16][0] == -18
    with pytest.raises(TypeError, match="dict"):
        marks.snapshot([])


class _Handle:  # stands for torch.utils.hooks.RemovableHandle: the marks take ids from its counter
    next_id = 40


def test_install_puts_the_hooks_in_and_uninstall_takes_them_out():
    """Into each module's own forward hook dicts (torch's OrderedDicts: ours first, as
    global hooks would run, the others kept in order): pre, post (and its always-called
    entry), then opt_pre, opt_post into the optimizer's, under ids from next_id (one per
    kind: each module's dicts are its own); a module by weakref too; None leaves the
    modules or the optimizer out; uninstall twice is harmless."""
    from collections import OrderedDict

    _Handle.next_id = 40
    a, b = torch.nn.Module(), torch.nn.Module()
    a._forward_pre_hooks[7] = "someone else's"
    opre, opost = OrderedDict(), OrderedDict()
    hooks = ("pre", "post", "opt_pre", "opt_post")  # stand-ins for track()'s wrappers
    marks = _marks()
    marks.install([a, weakref.ref(b)], opre, opost, hooks, _Handle)
    assert list(a._forward_pre_hooks) == [40, 7] and a._forward_pre_hooks[40] == "pre"
    assert dict(b._forward_pre_hooks) == {40: "pre"}
    for m in (a, b):
        assert dict(m._forward_hooks) == {41: "post"} and dict(m._forward_hooks_always_called) == {41: True}
    assert opre == {42: "opt_pre"} and opost == {43: "opt_post"} and _Handle.next_id == 44
    with pytest.raises(RuntimeError, match="installed already"):
        marks.install([a], opre, opost, hooks, _Handle)
    del opre[42]  # taken out by someone else: skipped
    marks.uninstall()
    assert dict(a._forward_pre_hooks) == {7: "someone else's"} and not opre and not opost
    for m in (a, b):
        assert not m._forward_hooks and not m._forward_hooks_always_called
    assert not b._forward_pre_hooks
    marks.uninstall()
    marks.install(None, opre, opost, hooks, _Handle)  # an optimizer without a model
    assert opre == {46: "opt_pre"} and opost == {47: "opt_post"}  # ids 44, 45 for modules: none given
    marks.uninstall()
    assert not opre and not opost


def test_install_refuses_bad_input_and_leaves_nothing_behind():
    hooks = ("pre", "post", "opt_pre", "opt_post")
    mod = torch.nn.Module()
    marks = _marks()
    with pytest.raises(TypeError, match="5 arguments"):
        marks.install(None, {}, {}, hooks)
    with pytest.raises(TypeError, match="tuple of 4 hooks"):
        marks.install(None, {}, {}, list(hooks), _Handle)
    with pytest.raises(TypeError, match="or None, None"):
        marks.install(None, {}, None, hooks, _Handle)
    with pytest.raises(TypeError, match="list of modules"):
        marks.install(7, None, None, hooks, _Handle)

    class NotAnInt:
        next_id = 1.5

    with pytest.raises(TypeError, match="not an int"):
        marks.install([mod], None, None, hooks, NotAnInt)
    NotAnInt.next_id = -1
    with pytest.raises(TypeError, match="not an int >= 0"):
        marks.install([mod], None, None, hooks, NotAnInt)
    assert not mod._forward_pre_hooks and not mod._forward_hooks

    class FailsLater(dict):
        def __setitem__(self, key, value):
            raise RuntimeError("no room")

    _Handle.next_id = 0
    with pytest.raises(RuntimeError, match="no room"):
        marks.install([mod], FailsLater(), {}, hooks, _Handle)
    # what went in before the error came out again
    assert not mod._forward_pre_hooks and not mod._forward_hooks and not mod._forward_hooks_always_called

    class FailsToDelete(dict):
        def __delitem__(self, key):
            raise RuntimeError("stuck")

    stuck, post = FailsToDelete(), {}
    marks.install([mod], stuck, post, hooks, _Handle)
    with pytest.raises(RuntimeError, match="stuck"):
        marks.uninstall()
    assert not mod._forward_pre_hooks and not post and len(stuck) == 1  # the others were still taken out
    marks.uninstall()  # nothing left to take out


@linux_only
def test_a_part_of_the_model_run_alone_is_the_forward():
    """A framework's step that calls a part of the model, never the model itself (a LightningModule's
    training_step calling self.model(x)): the first module of the model whose forward runs while none
    of the model's does is the root from then on; a later one of another module while none runs (the
    parts called one by one) is the same forward pass, no new call of the forward or backward phase."""
    root, a, b, a1 = _Mod(), _Mod(), _Mod(), _Mod()
    marks = _marks({id(root): 0, id(a): 1, id(b): 2, id(a1): 3}, id(root))
    with cpu.Scope(timeline=True):
        for step in (1, 2):
            marks.pre(a, ("x",))
            assert marks.root == id(a) and marks.forwards == step and marks.phase_code == FORWARD
            marks.pre(a1, ())  # inside a: no pass of its own
            marks.post(a1, (), None)
            marks.post(a, ("x",), "y")
            assert marks.phase_code == BACKWARD
            marks.pre(b, ())
            assert marks.phase_code == FORWARD and marks.forwards == step
            marks.post(b, (), None)
            assert marks.phase_code == BACKWARD and marks.depth == 0
            marks.end_phase()
    (fwd, _), (bwd, _), _ = marks.phases
    assert (fwd, bwd) == (2, 2)
    # the model's own root ran: nothing changes
    marks = _marks({id(root): 0, id(a): 1}, id(root))
    marks.pre(root, ())
    marks.pre(a, ())
    marks.post(a, (), None)
    marks.post(root, (), None)
    marks.end_phase()
    assert marks.root == id(root) and marks.forwards == 1
    # no root given (a block with no model): no module is made one
    marks = _marks({id(a): 1})
    marks.pre(a, ())
    marks.post(a, (), None)
    assert marks.root == 0 and marks.forwards == 0 and marks.phase_code == 0


def test_nesting_deeper_than_the_stack_keeps_counting():
    """Recursion deeper than the 256 tags kept: the depth still counts, and once back
    within the stack the tags are the modules' again."""
    m = _Mod()
    marks = _marks({id(m): 3}, token=1)
    for _ in range(300):
        marks.pre(m, ())
    assert marks.depth == 300 and marks.top() == attribution.make_tag(1, 3, 0)
    for _ in range(300):
        marks.post(m, (), None)
    assert marks.depth == 0 and marks.top() == 1 << attribution.TAG_BITS
    marks.post(m, (), None)  # an exit without its enter (a hook added mid-forward): no underflow
    assert marks.depth == 0


def test_set_model_replaces_the_modules():
    a, b = _Mod(), _Mod()
    marks = _marks({id(a): 0}, id(a))
    marks.set_model({id(b): 4}, id(b))
    marks.pre(a, ())
    assert marks.depth == 0 and marks.forwards == 0  # a is no longer the model's
    marks.pre(b, ())
    assert marks.depth == 1 and marks.forwards == 1 and marks.top() == attribution.make_tag(7, 4, FORWARD)
    with pytest.raises(ValueError, match="module ids"):
        marks.set_model({0: 1}, 0)
    assert marks.top() == attribution.make_tag(7, 4, FORWARD)  # a refused set_model keeps the old
    with pytest.raises(TypeError, match="set_model"):
        marks.set_model([], 0)


@pytest.mark.parametrize(
    "args, error, match",
    [
        (([], 0, 0, [], print), TypeError, "dict"),
        (({}, 0, 0, (), print), TypeError, "list"),
        (({1: 0}, 0, 0, [], 1), TypeError, "callable"),
        (({0: 0}, 0, 0, [], print), ValueError, "module ids"),
        (({1: -1}, 0, 0, [], print), ValueError, "rows"),
        (({1: 1 << 22}, 0, 0, [], print), ValueError, "rows"),
        (({"a": 0}, 0, 0, [], print), TypeError, "integer"),
        (({1: 0}, 0, 1 << 32, [], print), ValueError, "tagbase"),
        (({1: 0}, 0, 5, [], print), ValueError, "low 24 bits"),
        (({1: 0}, 0, 0, [], print, ()), TypeError, "timeline"),
    ],
)
def test_bad_input_is_refused(args, error, match):
    with pytest.raises(error, match=match):
        _C.ModuleMarks(*args)


def test_bad_calls_are_refused():
    marks = _marks()
    with pytest.raises(TypeError, match="2 arguments"):
        marks.pre(_Mod())
    with pytest.raises(TypeError, match="3 arguments"):
        marks.post(_Mod(), ())
    with pytest.raises(TypeError, match="3 arguments"):
        marks.opt_pre(None)
    with pytest.raises(TypeError, match="3 arguments"):
        marks.opt_post(None, ())
    for code in (0, 4, -1):
        with pytest.raises(ValueError, match="1, 2 or 3"):
            marks.begin_phase(code)
    with pytest.raises(AttributeError):
        marks.phase_code = 1
    with pytest.raises(TypeError, match="params"):
        marks.params = ("w", None)
    with pytest.raises(AttributeError, match="deleted"):
        del marks.state_n
    with pytest.raises(AttributeError):
        marks.opt_post(object(), (), {})  # no .state: an optimizer's hook on something else
    assert marks.phase_code == 0  # the phase ended before the state was read


def test_errors_inside_the_hooks_reach_the_caller():
    root = _Mod()

    def fails():
        raise RuntimeError("from is_grad_enabled")

    marks = _marks({id(root): 0}, id(root), grad=fails)
    marks.pre(root, ())
    with pytest.raises(RuntimeError, match="is_grad_enabled"):
        marks.post(root, (), None)
    assert marks.phase_code == 0 and marks.depth == 0  # the forward ended; no backward began

    class Boom:
        def __call__(self):
            raise RuntimeError("weakref gone wrong")

    marks.params = [("w", Boom())]
    with pytest.raises(RuntimeError, match="weakref gone wrong"):
        marks.opt_pre(None, (), {})


def test_a_cycle_through_the_lists_is_collected():
    """The Tracker holds its marks and the marks hold the Tracker's lists (snapshots,
    timeline); a list that holds the marks makes a cycle the collector must break."""

    class Holder:
        pass

    h = Holder()
    h.snaps = []
    h.marks = _marks(snaps=h.snaps, timeline=[], grad=lambda: h)
    h.snaps.append(h)
    h.mod = torch.nn.Module()
    m = h.marks
    # the module's dicts hold the marks' hooks, the marks hold the dicts
    h.marks.install([h.mod], {}, {}, (m.pre, m.post, m.opt_pre, m.opt_post), _Handle)
    del m
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None


def test_marks_do_not_leak():
    root, child = _Mod(), _Mod()
    ids = {id(root): 0, id(child): 1}
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)

    def once():
        snaps, timeline = [], []
        marks = _marks(ids, id(root), snaps=snaps, timeline=timeline, shapes=True)
        marks.params = [("w", weakref.ref(w))]
        x = torch.ones(2)
        marks.pre(root, (x, 1), {"mask": x, "n": 2})  # the root's hook with the kwargs (a batch as model(**batch))
        marks.pre(child, ())
        marks.post(child, (), None)
        marks.post(root, (), None)
        w.grad = torch.ones(4)
        marks.opt_pre(opt, (), {})
        marks.state_n = -1
        marks.opt_post(opt, (), {})
        marks.closure_hook = lambda args, kwargs: (args, kwargs)  # step(closure): see tracking._closure_args
        marks.opt_pre(opt, (opt, print), {})
        marks.resume_optimizer()
        marks.closure_hook = None
        marks.pre_id, marks.closure_hook
        marks.opt_post(opt, (), {})
        marks.set_model(ids, id(root))
        marks.top(), marks.phases, marks.last_inputs, marks.forwards, marks.params
        marks.snapshot({1: ("x", "input", None, None, None)})
        marks.install([root, weakref.ref(child)], {}, {}, (marks.pre, marks.post, marks.opt_pre, marks.opt_post), _Handle)
        marks.uninstall()
        for bad in (lambda: _C.ModuleMarks({1: -1}, 0, 0, [], print), lambda: marks.pre(root),
                    lambda: marks.begin_phase(9), lambda: marks.opt_post(object(), (), {}),
                    lambda: marks.snapshot(None)):
            try:
                bad()
            except (ValueError, TypeError, AttributeError):
                pass
        w.grad = None

    deltas = _leaks(once)
    assert not all(d > 0 for d in deltas), deltas
