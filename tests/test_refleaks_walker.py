"""Refcount and memory-block leak checks of the C walker, in the manner of CPython's regrtest -R.

Warm up, then run the walker many times per round; a leak is a delta (allocated
blocks, or references held on the model's tensors) that stays positive in
every round after warm-up.
"""

import gc
import sys
import warnings

import numpy as np
import pytest
import torch

from memtorch import _C
from memtorch.inspection import walk

import zoo
from test_walker import FlatWrapper, Wrapper

# The walker's entry points in _C, each exercised below.
WALKER_FUNCTIONS = {"_walk", "_walker_setup"}


def leak_deltas(fn, tracked, warmup=3, rounds=5, inner=20):
    """Per round: (allocated-blocks delta, sum of refcount deltas of `tracked`)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(rounds):
        refs0 = sum(sys.getrefcount(t) for t in tracked)
        gc.collect()
        blocks0 = sys.getallocatedblocks()
        for _ in range(inner):
            fn()
        gc.collect()
        blocks1 = sys.getallocatedblocks()
        refs1 = sum(sys.getrefcount(t) for t in tracked)
        out.append((blocks1 - blocks0, refs1 - refs0))
    return out


INNER = 20


def assert_no_leak(fn, tracked, inner=INNER):
    deltas = leak_deltas(fn, tracked, inner=inner)
    blocks = [d[0] for d in deltas[1:]]
    refs = [d[1] for d in deltas]
    # A leak in a deterministic call leaks on every call: at least INNER blocks
    # per round, in every round. Smaller positive deltas are allocator and
    # cache noise (under -X dev even np.zeros(3) gains a block per round).
    assert not all(b >= inner for b in blocks), f"allocated blocks grow every round: {deltas}"
    assert all(r == 0 for r in refs), f"references to the model's tensors leak: {deltas}"


def _trained():
    model = zoo.tied_transformer()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randint(0, 100, (2, 5))).sum().backward()
    opt.step()
    return model, opt


def test_walk_module_and_optimizer():
    model, opt = _trained()
    tracked = list(model.parameters()) + [p.grad for p in model.parameters()]
    tracked += [v for st in opt.state.values() for v in st.values()]
    assert_no_leak(lambda: walk(model, opt), tracked)


@pytest.mark.parametrize("name", ["cnn_bn", "sparse_case", "quantized_case", "multi_name_submodule", "meta_model"])
def test_walk_zoo(name):
    model = zoo.ZOO[name]()
    tracked = list(model.parameters()) + list(model.buffers())
    assert_no_leak(lambda: walk(model), tracked)


def test_walk_containers():
    a = np.zeros(100)
    t = torch.zeros(10)
    cyc = [t]
    cyc.append(cyc)
    obj = {"a": a, "v": a[3:], "t": t, "n": t.numpy(), "cyc": cyc, 1: (t, {t}), "w": FlatWrapper(torch.ones(3))}
    # A cheap call: more calls per round lift a real leak (>= 1 block per call)
    # well above the few dozen blocks of noise seen under xdist.
    assert_no_leak(lambda: walk(obj), [a, t], inner=200)


def test_error_paths():
    model = zoo.seed_model()
    model.fc2._parameters["weight"] = "oops"
    wrapped = [torch.zeros(3), Wrapper(torch.ones(3))]

    def fail():
        for bad in (model, wrapped):
            try:
                walk(bad)
            except TypeError:
                pass
            else:
                raise AssertionError("no error")
        try:
            walk(zoo.seed_model(), 5)
        except TypeError:
            pass

    assert_no_leak(fail, [model.fc1.weight, wrapped[0]])


def test_walker_setup():
    from memtorch.inspection import setup_info

    info = setup_info(torch)
    assert_no_leak(lambda: _C._walker_setup(info), [])
    walk(torch.zeros(1))  # still works after re-setup


def test_every_walker_function_is_covered():
    names = {n for n in dir(_C) if n.startswith("_walk")}
    assert names == WALKER_FUNCTIONS


def test_leak_check_catches_a_leak():
    # The harness must fail on a real leak: keep a reference per call.
    t = torch.zeros(1)
    kept = []
    with warnings.catch_warnings():
        deltas = leak_deltas(lambda: kept.append(t), [t], rounds=3, inner=5)
    assert all(d[1] == 5 for d in deltas)
    # and a leak of memory blocks: one object kept per call (blocks are only
    # counted by pymalloc: not under PYTHONMALLOC=malloc, as in the ASan run)
    if sys.getallocatedblocks() == 0:
        return
    objs = []
    deltas = leak_deltas(lambda: objs.append(object()), [], rounds=3, inner=INNER)
    assert all(d[0] >= INNER for d in deltas[1:])


# ---------------------------------------------------------------- paths added for issue 10
@pytest.mark.parametrize("name", ["scripted_seed", "traced_cnn", "partly_scripted"])
def test_walk_torchscript(name):
    model = zoo.ZOO[name]()
    tracked = list(model.parameters()) + list(model.buffers())
    deltas = leak_deltas(lambda: walk(model), tracked, inner=INNER)
    # A traced module's wrappers let go of references once after warm-up (a
    # negative delta in the first round): a leak is a positive one.
    assert not all(b >= INNER for b, _ in deltas[1:]), deltas
    assert all(r <= 0 for _, r in deltas) and all(r == 0 for _, r in deltas[1:]), deltas


def test_walk_new_containers_and_error_paths():
    import collections
    import types

    t = torch.zeros(10)
    objarr = np.empty(2, dtype=object)
    objarr[0], objarr[1] = t, np.zeros(3)
    buf = bytes(64)
    obj = {
        t: "key",
        "dq": collections.deque([t]),
        "ns": types.SimpleNamespace(x=t),
        "ud": collections.UserDict({"y": t}),
        "obj": objarr,
        "ma": np.ma.array(np.zeros(4), mask=np.zeros(4, dtype=bool)),
        "fb": [np.frombuffer(buf, np.uint8, count=8), np.frombuffer(buf, np.uint8, offset=8)],
        "np": [torch.from_numpy(objarr[1])],
    }
    assert_no_leak(lambda: walk(obj), [t, buf], inner=200)

    class Attr(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.cache = torch.zeros(5)
            self.hist = [torch.zeros(2)]

    m = Attr()
    assert_no_leak(lambda: walk(m), [m.cache, m.lin.weight], inner=100)

    class S(torch.Tensor):
        pass

    bad = [torch.zeros(2).as_subclass(S)]
    from memtorch import inspection

    info = dict(inspection.setup_info(torch))

    def classify_error():
        # A classify result outside 0..2: a TypeError, every time, nothing kept.
        _C._walker_setup(dict(info, classify=lambda tp: 7))
        try:
            with pytest.raises(TypeError, match="classify"):
                walk(bad)
        finally:
            _C._walker_setup(info)

    assert_no_leak(classify_error, [bad[0]], inner=50)
