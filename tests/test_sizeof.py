"""sizeof(): any nest of containers holding tensors and NumPy arrays."""

import dataclasses
from collections import OrderedDict, namedtuple

import numpy as np
import torch

import memtorch
from memtorch import _reference

import zoo
from test_walker import assert_same_walk


def test_batch_dict():
    batch = {"x": torch.zeros(8, 3, dtype=torch.float32), "y": torch.zeros(8, dtype=torch.int64)}
    mm = memtorch.sizeof(batch)
    assert mm.total == 8 * 3 * 4 + 8 * 8
    assert mm.paths == ["x", "y"]
    assert mm.by_category == {"tensor": 160}


def test_state_dict_equals_model():
    model = zoo.cnn_bn()
    assert memtorch.sizeof(model.state_dict()).total == memtorch.inspect(model).total == 6584


def test_optimizer_state():
    model = zoo.seed_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 784)).sum().backward()
    opt.step()
    # exp_avg + exp_avg_sq of every parameter plus four float32 steps; the
    # state dict's keys are the parameters, which it keeps alive with their
    # grads: counted too, under their own categories.
    by_cat = memtorch.sizeof(opt.state).by_category
    assert by_cat == {"tensor": 2 * 407_080 + 16, "parameter": 407_080, "gradient": 407_080}
    mm = memtorch.sizeof(opt)
    # an optimizer alone: its parameters (and their grads) plus its state
    assert mm.total == 4 * 407_080 + 16
    assert_same_walk(opt)


def test_tensor_views_counted_once():
    base = torch.zeros(100)
    mm = memtorch.sizeof([base, base[10:20], base.view(10, 10), base])
    assert mm.total == 400
    # logical: base (met twice, one tensor) 400, the slice 40, the 10x10 view 400
    assert mm.logical == 400 + 40 + 400
    assert len(mm.paths) == 4


def test_expanded_tensor_logical_vs_storage():
    t = torch.zeros(1, 4).expand(1000, 4)
    mm = memtorch.sizeof(t)
    assert mm.total == 16 and mm.logical == 1000 * 4 * 4


def test_numpy_views_of_one_base_counted_once():
    a = np.zeros(1000, dtype=np.float64)
    mm = memtorch.sizeof({"a": a, "v": a[10:20], "w": a[::2].reshape(25, 20), "b": np.ones(3, dtype=np.int32)})
    assert mm.total == 8000 + 12
    assert mm.by_dtype == {"float64": 8000, "int32": 12}
    assert mm.by_category == {"array": 8012}
    assert_same_walk({"a": a, "v": a[10:20]})


def test_numpy_over_a_tensor_counts_the_storage_once():
    t = torch.zeros(10)
    mm = memtorch.sizeof([t, t.numpy()])
    assert mm.total == 40


def test_namedtuple_and_dataclass_and_sets():
    Pair = namedtuple("Pair", "left right")

    @dataclasses.dataclass
    class Batch:
        inputs: torch.Tensor
        meta: dict
        note: str = "x"

    obj = OrderedDict(
        pair=Pair(torch.zeros(2), torch.zeros(3)),
        batch=Batch(torch.zeros(4), {"mask": torch.zeros(5, dtype=torch.bool)}),
        ids={1, 2, 3},
    )
    mm = memtorch.sizeof(obj)
    assert mm.total == 2 * 4 + 3 * 4 + 4 * 4 + 5
    assert mm.paths == ["pair.left", "pair.right", "batch.inputs", "batch.meta.mask"]
    assert_same_walk(obj)


def test_slots_dataclass():
    @dataclasses.dataclass
    class S:
        __slots__ = ("t",)
        t: torch.Tensor

    assert memtorch.sizeof([S(torch.zeros(3))]).total == 12


def test_self_containing_container_terminates():
    a = [torch.zeros(4)]
    a.append(a)
    d = {"t": torch.zeros(2)}
    d["me"] = d
    assert memtorch.sizeof(a).total == 16
    assert memtorch.sizeof(d).total == 8
    assert_same_walk(a)


def test_deep_nesting_is_iterative():
    obj = torch.zeros(1)
    for _ in range(100_000):
        obj = [obj]
    assert memtorch.sizeof(obj).total == 4


def test_scalars_and_other_objects_count_zero():
    assert memtorch.sizeof(3).total == 0
    assert memtorch.sizeof(None).total == 0
    assert memtorch.sizeof("text").total == 0
    assert memtorch.sizeof(object()).total == 0


def test_module_inside_a_container():
    mm = memtorch.sizeof({"model": zoo.seed_model(), "x": torch.zeros(1)})
    assert mm.total == 407_080 + 4
    assert "model.fc1.weight" in mm.paths


def test_grad_of_a_leaf_tensor_counted():
    t = torch.zeros(5, requires_grad=True)
    (t * 2).sum().backward()
    mm = memtorch.sizeof([t])
    assert mm.total == 40 and mm.by_category == {"tensor": 20, "gradient": 20}


def test_sparse_tensor_alone():
    i = torch.tensor([[0, 1], [1, 0]])
    v = torch.tensor([1.0, 2.0])
    s = torch.sparse_coo_tensor(i, v, (2, 2), check_invariants=True)
    # 2 x 2 int64 indices = 32 bytes, 2 float32 values = 8 bytes
    assert memtorch.sizeof(s).logical == 32 + 8
    ref = _reference.sizeof(s)
    assert ref.total == memtorch.sizeof(s).total
