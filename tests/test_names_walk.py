"""_C.names_walk, _C.modules_fingerprint and _C.modules_compiled (track()'s names for at_peak, its
per-model plan kept between blocks, its compiled regions): held against plain Python, their leaks, and
the plan's rebuilds."""

import gc
import weakref

import pytest
import torch

from memtorch import _C, _torch, track
from memtorch import tracking

from test_refleaks_walker import assert_no_leak

NAMES_FUNCTIONS = {"names_walk", "modules_fingerprint", "modules_compiled"}


def _trained():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _python_names(params, state, want):
    """What names_walk computes, in plain Python (first name of an address wins)."""
    names = {}

    def put(t, name, kind):
        a = t.untyped_storage().data_ptr()
        if a and a not in names:
            names[a] = (name, kind, None, t.shape, t.dtype)

    for name, ref in params:
        p = ref()
        if p is None:
            continue
        if want & 1:
            put(p, name, "buffer" if want & 8 else "parameter")
        if want & 2 and p.grad is not None:
            put(p.grad, name + ".grad", "gradient")
        if want & 4 and state is not None:
            for key, v in state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    put(v, f"{name}.{key}", "optimizer state")
    return names


@pytest.mark.parametrize("want", [0, 1, 2, 4, 7, 9, 15])
def test_names_walk_matches_python(want):
    _torch.torch()
    model, opt = _trained()
    params = [(n, weakref.ref(p)) for n, p in model.named_parameters()]
    names = {}
    _C.names_walk(names, params, opt.state, want)
    assert names == _python_names(params, opt.state, want)
    if want & 4:  # Adam's state by the names a user knows
        assert {v[0] for v in names.values()} >= {"0.weight.exp_avg", "2.bias.exp_avg_sq"}


def test_names_walk_keeps_a_known_address_and_skips_dead_and_storageless():
    _torch.torch()
    model, opt = _trained()
    w = model[0].weight
    names = {w.untyped_storage().data_ptr(): ("mine", "input", None, None, None)}
    dead = torch.nn.Parameter(torch.zeros(2))
    dead_ref = weakref.ref(dead)
    del dead
    gc.collect()
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    _C.names_walk(names, [("0.weight", weakref.ref(w)), ("gone", dead_ref), ("m", weakref.ref(meta))], None, 1)
    assert names[w.untyped_storage().data_ptr()][0] == "mine"
    assert len(names) == 1  # nothing for the freed parameter, nothing for a storage without data


def test_a_gradient_is_named_as_given_else_after_its_parameter():
    _torch.torch()
    model, opt = _trained()
    w, b = model[0].weight, model[0].bias
    assert w.grad is not None and b.grad is not None
    names = {}
    _C.names_walk(names, [("0.weight", weakref.ref(w), "W's gradient"), ("0.bias", weakref.ref(b))], None, 2 | 16)
    assert names == {
        w.grad.untyped_storage().data_ptr(): ("W's gradient", "gradient", None, None, None),
        b.grad.untyped_storage().data_ptr(): ("0.bias.grad", "gradient", None, None, None),
    }


def test_names_walk_bad_input():
    _torch.torch()
    with pytest.raises(TypeError, match="names_walk"):
        _C.names_walk([], [], None, 1)
    with pytest.raises(TypeError, match="grad name"):
        _C.names_walk({}, [("a",)], None, 1)
    with pytest.raises(TypeError, match="grad name"):
        _C.names_walk({}, [("a", None, 5)], None, 2)  # a gradient's name that is not a str
    with pytest.raises(TypeError, match="weakref"):
        _C.names_walk({}, [], [], 1)
    with pytest.raises(TypeError, match="4 arguments"):
        _C.names_walk({}, [])
    with pytest.raises(TypeError):
        _C.names_walk({}, [("a", 5)], None, 1)  # not callable


def test_fingerprint_changes_with_structure():
    model, _ = _trained()
    mods = list(model.modules())
    fp = _C.modules_fingerprint(mods)
    assert _C.modules_fingerprint(mods) == fp
    fp1 = fp
    model.add_module("extra", torch.nn.ReLU())  # added
    assert _C.modules_fingerprint(mods) != fp1
    fp2 = _C.modules_fingerprint(mods)
    del model.extra  # removed
    assert _C.modules_fingerprint(mods) != fp2
    model[1].register_buffer("more", torch.zeros(1))  # a buffer added
    assert _C.modules_fingerprint(mods) != fp1
    with pytest.raises(TypeError, match="list of modules"):
        _C.modules_fingerprint(5)


def test_fingerprint_of_weak_references_is_that_of_the_modules_or_none_when_one_is_gone():
    model, _ = _trained()
    mods = list(model.modules())
    refs = [weakref.ref(m) for m in mods]
    assert _C.modules_fingerprint(refs) == _C.modules_fingerprint(mods)
    extra = torch.nn.ReLU()
    refs.append(weakref.ref(extra))
    assert _C.modules_fingerprint(refs) == _C.modules_fingerprint(mods + [extra])
    del extra
    assert _C.modules_fingerprint(refs) is None


def test_fingerprint_changes_when_a_parameter_is_replaced():
    model, _ = _trained()
    mods = list(model.modules())
    fp = _C.modules_fingerprint(mods)
    model[2].weight = torch.nn.Parameter(torch.zeros(2, 3))
    assert _C.modules_fingerprint(mods) != fp


def test_plan_rebuilt_between_blocks_when_the_model_changes():
    model, opt = _trained()
    x = torch.randn(5, 4)
    with track(model, optimizer=opt) as t:
        model(x)
    assert [m.name for m in t.report.modules] == ["", "0", "1", "2"]
    model.add_module("3", torch.nn.ReLU())  # a module appended between blocks
    with track(model, optimizer=opt) as t:
        model(x)
    rows = {m.name: m for m in t.report.modules}
    assert list(rows) == ["", "0", "1", "2", "3"] and rows["3"].calls == 1
    # a parameter replaced between blocks is named by the new plan: its 2x3 float32 storage
    new = torch.nn.Parameter(torch.ones(2, 3))
    model[2].weight = new
    with track(model, optimizer=opt) as t:
        keep = torch.empty(1000)  # noqa: F841  the peak is inside the block
    assert t.report.at_peak["2.weight"] == new.untyped_storage().nbytes()


def test_plan_keeps_no_module_alive():
    model, opt = _trained()
    head = model[2]
    with track(model, optimizer=opt):
        model(torch.randn(5, 4))
    ref = weakref.ref(head)
    del model[2], head
    gc.collect()
    assert ref() is None  # memtorch's plan holds only weak references
    assert id(model) in tracking._plans  # the root's plan is still there (until rebuilt or the model dies)
    ref_model, key = weakref.ref(model), id(model)
    del model, opt
    gc.collect()
    assert ref_model() is None and key not in tracking._plans  # the plan went with its model


def test_names_walk_does_not_leak():
    _torch.torch()
    model, opt = _trained()
    params = [(n, weakref.ref(p)) for n, p in model.named_parameters()]
    tracked = list(model.parameters()) + [p.grad for p in model.parameters()]
    tracked += [v for st in opt.state.values() for v in st.values()]

    def call():
        _C.names_walk({}, params, opt.state, 7)
        _C.names_walk({}, params, None, 9)
        try:
            _C.names_walk({}, [("a",)], None, 1)
        except TypeError:
            pass

    assert_no_leak(call, tracked)


def test_modules_fingerprint_does_not_leak():
    model, _ = _trained()
    mods = list(model.modules())

    refs = [weakref.ref(m) for m in mods] + [weakref.ref(torch.nn.ReLU())]  # the last one dead

    def call():
        _C.modules_fingerprint(mods)
        _C.modules_fingerprint(refs[:-1])
        _C.modules_fingerprint(refs)
        try:
            _C.modules_fingerprint(5)
        except TypeError:
            pass

    assert_no_leak(call, list(model.parameters()) + mods)


class _Wrapper(torch.nn.Module):
    """A stand-in for torch.compile's wrapper class (an instance of it is a compiled region)."""


def _python_compiled(mods, wrapper):
    """_C.modules_compiled in plain Python (tracking._compiled_kind of each live module)."""
    for m in mods:
        m = m() if isinstance(m, weakref.ref) else m
        if m is not None and tracking._compiled_kind(m, wrapper) is not None:
            return True
    return False


def test_modules_compiled_is_the_python_test_of_each_module():
    model, _ = _trained()
    mods = list(model.modules())
    refs = [weakref.ref(m) for m in mods]
    wrapped = _Wrapper()
    dead = weakref.ref(_Wrapper())  # gone: skipped
    cases = [(mods, None), (refs, None), (refs + [dead], _Wrapper), (mods + [wrapped], None),
             (mods + [wrapped], _Wrapper), ([weakref.ref(wrapped)], _Wrapper), ([], None)]  # fmt: skip
    for ms, wrapper in cases:
        assert _C.modules_compiled(ms, wrapper) == _python_compiled(ms, wrapper)
    assert _C.modules_compiled(mods + [wrapped], _Wrapper) and not _C.modules_compiled(mods, _Wrapper)
    # module.compile() sets the instance's _compiled_call_impl (set here by hand: the model is not called)
    model[1].__dict__["_compiled_call_impl"] = lambda *a, **k: None
    try:
        assert _C.modules_compiled(refs, None) and _python_compiled(refs, None)
    finally:
        del model[1].__dict__["_compiled_call_impl"]
    assert not _C.modules_compiled(refs, None)
    with pytest.raises(TypeError, match="list of modules"):
        _C.modules_compiled(5, None)
    with pytest.raises(TypeError, match="a class or None"):
        _C.modules_compiled(mods, "OptimizedModule")
    with pytest.raises(TypeError, match="2 arguments"):
        _C.modules_compiled(mods)


def test_modules_compiled_does_not_leak():
    model, _ = _trained()
    mods = list(model.modules())
    refs = [weakref.ref(m) for m in mods] + [weakref.ref(torch.nn.ReLU())]  # the last one dead
    wrapped = _Wrapper()

    def call():
        _C.modules_compiled(mods, None)
        _C.modules_compiled(refs, _Wrapper)
        _C.modules_compiled(mods + [wrapped], _Wrapper)
        for bad in ((5, None), (mods, 5)):
            try:
                _C.modules_compiled(*bad)
            except TypeError:
                pass

    assert_no_leak(call, mods + [wrapped])


def test_block_names_come_from_the_plan_only_while_the_same_allocations_live():
    """The second block reuses the first one's names (same storages, same allocation
    numbers); a parameter whose storage is replaced in place (p.data = ...) or new optimizer
    state is read again: at_peak names them right."""
    from memtorch import cpu

    cpu.start()  # count from here: the model's storages get allocation numbers
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 8)

    def block():
        with track(model, optimizer=opt) as t:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return t.report.at_peak

    block()  # the first block starts before the optimizer has state
    block()
    plan = tracking._plans[id(model)]
    cached = plan.names
    assert cached is not None and "weight.exp_avg" in {v[0] for v in cached[6].values()}
    at = block()
    assert plan.names is cached  # reused: nothing was read again
    assert at["weight"] == at["weight.exp_avg"] == 8 * 8 * 4
    model.weight.data = torch.zeros(8, 8)  # a new storage behind the same Parameter
    at = block()
    assert plan.names is not cached
    assert model.weight.untyped_storage().data_ptr() in plan.names[6]
    assert at["weight"] == 8 * 8 * 4
    before = plan.names
    opt.state.clear()  # the next step makes new state
    at = block()
    assert plan.names is not before
    assert at["weight.exp_avg_sq"] == 8 * 8 * 4
    assert _C.counters_serials([0])[0] == -1
    with pytest.raises(TypeError):
        _C.counters_serials(5)


def test_a_view_is_named_by_its_storage_not_its_data_pointer():
    """A gradient that is a view into the middle of a larger tensor: named by the address
    of its storage (where the counters hold the allocation), not by its data pointer."""
    from memtorch import cpu

    with cpu.Scope():
        p = torch.nn.Parameter(torch.zeros(4))
        big = torch.zeros(16)
        p.grad = big[4:8]  # data pointer 16 bytes into big's storage
        whole = torch.ones(4)
        q = torch.nn.Parameter(torch.zeros(4))
        q.grad = whole  # its own allocation: data pointer == storage address
        names = {}
        _C.names_walk(names, [("p", weakref.ref(p)), ("q", weakref.ref(q))], None, 2 | 16)
    assert p.grad.data_ptr() != big.untyped_storage().data_ptr()
    assert names[big.untyped_storage().data_ptr()][0] == "p.grad"
    assert names[whole.untyped_storage().data_ptr()][0] == "q.grad"
    assert p.grad.data_ptr() not in names
