"""The C walker against the pure-Python reference, hand counts, inputs unmodified, bad input."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import memtorch
from memtorch import _reference
from memtorch.inspection import walk as c_walk

import zoo


def assert_same_walk(obj, optimizer=None):
    c = c_walk(obj, optimizer)
    py = _reference.walk(obj, optimizer)
    rows_c, rows_py = c[0], py[0]
    assert rows_c.dtype == rows_py.dtype
    assert len(rows_c) == len(rows_py)
    for field in rows_c.dtype.names:
        np.testing.assert_array_equal(rows_c[field], rows_py[field], err_msg=field)
    assert c[1:4] == py[1:4]
    (cp, ct, cl), (pp, pt, pl) = c[4], py[4]
    assert (cp, ct) == (pp, pt)
    assert cl.dtype == pl.dtype == np.int32 and cl.shape == pl.shape == (len(cp), 2)
    np.testing.assert_array_equal(cl, pl)
    return c


def independent_total(tensors):
    """Bytes of unique storages of `tensors`, keyed as torch itself exposes them."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def train_step(model, opt, x):
    out = model(x)
    if isinstance(out, tuple):
        out = out[0]
    out.float().sum().backward()
    opt.step()


# ---------------------------------------------------------------- C == Python
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_c_walker_matches_reference(name):
    model = zoo.ZOO[name]()
    rows = assert_same_walk(model)[0]
    assert len(rows) > 0


INPUTS = {
    "seed_model": lambda: torch.randn(2, 784),
    "cnn_bn": lambda: torch.randn(2, 3, 8, 8),
    "lstm": lambda: torch.randn(5, 2, 16),
    "tied_transformer": lambda: torch.randint(0, 100, (2, 7)),
    "frozen_backbone": lambda: torch.randn(2, 32),
}


@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("optim", ["adam", "sgd_momentum"])
def test_c_walker_matches_reference_after_a_step(name, optim):
    model = zoo.ZOO[name]()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params) if optim == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    train_step(model, opt, INPUTS[name]())
    rows, paths = assert_same_walk(model, opt)[:2]
    cats = set(rows["category"].tolist())
    assert {0, 2, 3} <= cats  # parameters, gradients, optimizer state


def test_c_walker_matches_reference_on_containers():
    model = zoo.seed_model()
    arr = np.arange(12.0)
    obj = {
        "sd": model.state_dict(),
        "list": [torch.ones(3), (torch.zeros(2), {"x": arr, "y": arr[2:5]})],
        "set": frozenset([1, 2]),
        7: torch.ones(1, dtype=torch.int16),
        "model": model,
    }
    assert_same_walk(obj)


# ---------------------------------------------------------------- hand counts
def test_seed_model_hand_count():
    # fc1: 784*128 weights + 128 biases; fc2: 128*10 + 10; float32 = 4 bytes.
    mm = memtorch.inspect(zoo.seed_model())
    assert mm.total == (784 * 128 + 128 + 128 * 10 + 10) * 4 == 407_080
    assert mm.by_dtype == {"float32": 407_080}
    assert mm.by_category == {"parameter": 407_080}
    assert mm.trainable == 407_080 and mm.frozen == 0


def test_seed_model_after_one_adam_step():
    model = zoo.seed_model()
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt, torch.randn(4, 784))
    mm = memtorch.inspect(model, opt)
    params = 407_080
    # Adam: exp_avg and exp_avg_sq per parameter (2 x params) plus one `step`
    # per parameter tensor (4 tensors); torch keeps step as a float32 scalar.
    step_dtype = opt.state[model.fc1.weight]["step"].dtype
    assert step_dtype == torch.float32
    assert mm.by_category["optimizer_state"] == 2 * params + 4 * 4
    assert mm.by_category["gradient"] == params
    assert mm.by_category["parameter"] == params
    assert mm.total == 4 * params + 16


def test_independent_totals_over_zoo():
    # Dense models: total equals the unique storages torch's own iterators give.
    for name in ("seed_model", "cnn_bn", "lstm", "tied_transformer", "frozen_backbone", "meta_model",
                 "mixed_dtype", "multi_name_submodule", "view_buffer", "two_devices"):
        model = zoo.ZOO[name]()
        expected = independent_total(list(model.parameters()) + list(model.buffers()))
        assert memtorch.inspect(model).total == expected, name


def test_cnn_bn_hand_count():
    # conv1 3*8*9 + 8 = 224; bn1 weight, bias, running mean, running var 4*8 = 32
    # conv2 8*16*9 = 1152 (no bias); bn2 4*16 = 64; linear 16*10 + 10 = 170
    # float32: (224 + 32 + 1152 + 64 + 170) * 4 = 6568; two int64 num_batches_tracked = 16
    mm = memtorch.inspect(zoo.cnn_bn())
    assert mm.by_dtype == {"float32": 6568, "int64": 16}
    assert mm.by_category == {"parameter": (224 + 16 + 1152 + 32 + 170) * 4, "buffer": (16 + 32) * 4 + 16}


def test_lstm_hand_count():
    # per layer: w_ih 4H x I, w_hh 4H x H, two biases 4H; H=32, I=16 then 32
    layer0 = 128 * 16 + 128 * 32 + 2 * 128
    layer1 = 128 * 32 + 128 * 32 + 2 * 128
    assert memtorch.inspect(zoo.lstm()).total == (layer0 + layer1) * 4


def test_tied_weights_counted_once():
    tied = zoo.tied_transformer()
    mm = memtorch.inspect(tied)
    untied = zoo.tied_transformer()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    # The tied weight is 100 x 32 float32 = 12,800 bytes, held once.
    assert memtorch.inspect(untied).total - mm.total == 100 * 32 * 4
    assert ("embed.weight", "head.weight") in mm.shared


def test_meta_model_counts_what_it_would_take():
    before = torch.empty(0)  # noqa: F841 (nothing to compare on meta but the figures)
    mm = memtorch.inspect(zoo.meta_model())
    assert mm.total == (1000 * 1000 + 1000 + 1000 * 10 + 10) * 4 == 4_044_040
    assert mm.by_device == {"meta": 4_044_040}


def test_mixed_dtypes_hand_count():
    mm = memtorch.inspect(zoo.mixed_dtype())
    expect = {"float32": 40, "float16": 20, "bfloat16": 20, "complex64": 80, "int8": 10, "bool": 10}
    if hasattr(torch, "float8_e4m3fn"):
        expect["float8_e4m3fn"] = 10
    assert mm.by_dtype == expect
    assert mm.total == sum(expect.values())


def test_sparse_counts_indices_and_values():
    model = zoo.sparse_case()
    mm = memtorch.inspect(model)
    # logical: weight 16*4; COO: indices 2 x 3 int64 = 48, values 3 float32 = 12;
    # CSR: crow_indices 7 int64 = 56, col_indices 3 int64 = 24, values 12
    assert mm.logical == 64 + 48 + 12 + 56 + 24 + 12
    parts = [model.weight, model.coo._indices(), model.coo._values(), model.csr.crow_indices(),
             model.csr.col_indices(), model.csr.values()]
    assert mm.total == independent_total(parts)
    paths = set(mm.paths)
    assert {"coo._indices", "coo._values", "csr.crow_indices", "csr.col_indices", "csr.values"} <= paths


def test_quantized_hand_count():
    mm = memtorch.inspect(zoo.quantized_case())
    # per-tensor qint8 4x4 = 16; per-channel quint8 4x4 = 16 plus 4 float64
    # scales (32) and 4 int64 zero points (32)
    assert mm.total == 16 + 16 + 32 + 32
    assert mm.by_dtype == {"qint8": 16, "quint8": 16, "float64": 32, "int64": 32}


def test_view_buffer_counted_once_both_figures():
    mm = memtorch.inspect(zoo.view_buffer())
    # weight 4 x 8 float32 = 128 bytes; row0 views 8 of them (32 logical bytes)
    assert mm.total == 128
    assert mm.logical == 128 + 32
    assert mm.shared == [("weight", "row0")]
    rows = mm.to_numpy()
    row0 = rows[rows["path"] == "row0"][0]
    assert row0["nbytes"] == 32 and row0["storage_nbytes"] == 128


def test_submodule_under_two_names():
    mm = memtorch.inspect(zoo.multi_name_submodule())
    assert mm.total == (8 * 8 + 8) * 4
    assert ("first.weight", "second.weight") in mm.shared
    assert ("first.bias", "second.bias") in mm.shared
    second = [m for m in mm.modules if m.name == "second"][0]
    assert second.alias_of == "first"


def test_module_containing_itself_terminates():
    model = zoo.seed_model()
    model._modules["again"] = model  # a cycle through _modules
    mm = memtorch.inspect(model)
    assert mm.total == 407_080
    again = [m for m in mm.modules if m.name == "again"][0]
    assert again.alias_of == ""
    assert ("fc1.weight", "again.fc1.weight") in mm.shared
    assert_same_walk(model)


def test_two_devices():
    mm = memtorch.inspect(zoo.two_devices())
    assert mm.by_device == {"cpu": (256 + 16) * 4, "meta": (256 + 16) * 4}


def test_frozen_backbone_trainable_vs_frozen():
    mm = memtorch.inspect(zoo.frozen_backbone())
    assert mm.trainable == (64 * 5 + 5) * 4
    assert mm.frozen == (32 * 64 + 64 + 64 * 64 + 64) * 4


def test_optimizer_state_in_its_real_dtype():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    mm = memtorch.inspect(model, opt)
    rows = mm.to_numpy()
    state = rows[rows["category"] == "optimizer_state"]
    assert set(state[np.char.endswith(state["path"], "exp_avg")]["dtype"]) == {"bfloat16"}
    # params 20 bf16 = 40 B, grads 40 B, exp_avg + exp_avg_sq 80 B, 2 float32 steps 8 B
    assert mm.total == 40 + 40 + 80 + 8


def test_optimizer_params_outside_the_model():
    extra = nn.Parameter(torch.zeros(5))
    model = zoo.seed_model()
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [extra]}], lr=0.1)
    mm = memtorch.inspect(model, opt)
    assert mm.total == 407_080 + 5 * 4
    assert "optimizer.param_groups[1].params[0]" in mm.paths


def test_optimizer_over_plain_leaf_tensors():
    model = zoo.seed_model()
    w = torch.zeros(3, requires_grad=True)  # a plain leaf tensor, not a Parameter
    opt = torch.optim.Adam([*model.parameters(), w])
    (model(torch.randn(2, 784)).sum() + w.sum()).backward()
    opt.step()
    rows, paths = assert_same_walk(model, opt)[:2]
    assert "optimizer.param_groups[0].params[4]" in paths
    assert "optimizer.state[optimizer.param_groups[0].params[4]].exp_avg" in paths
    assert "optimizer.state[fc1.weight].exp_avg" in paths
    # w 12 B, its grad 12 B, exp_avg + exp_avg_sq 24 B, its step 4 B; the model as before
    assert memtorch.inspect(model, opt).total == 4 * 407_080 + 16 + 12 + 12 + 24 + 4


# ---------------------------------------------------------------- unmodified
def test_inputs_unmodified():
    model = zoo.tied_transformer()
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt, torch.randint(0, 100, (2, 5)))
    before = {k: (v.clone(), v.requires_grad) for k, v in model.state_dict(keep_vars=True).items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    state_keys = {id(k): sorted(v) for k, v in opt.state.items()}
    for _ in range(3):
        memtorch.inspect(model, opt)
    after = model.state_dict(keep_vars=True)
    for k, (v, rg) in before.items():
        assert torch.equal(after[k], v) and after[k].requires_grad == rg
    for n, p in model.named_parameters():
        assert id(p) == ids[n] and torch.equal(p.grad, grads[n])
    assert {id(k): sorted(v) for k, v in opt.state.items()} == state_keys
    assert model.training


def test_no_grad_created_or_warned():
    model = zoo.seed_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memtorch.inspect(model)
        memtorch.sizeof([torch.ones(2, requires_grad=True) * 2])  # a non-leaf: .grad not read
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [42, None, "model", [nn.Linear(2, 2)]])
def test_inspect_rejects_non_modules(bad):
    with pytest.raises(TypeError, match=r"torch\.nn\.Module.*sizeof"):
        memtorch.inspect(bad)


def test_inspect_rejects_bad_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        memtorch.inspect(zoo.seed_model(), optimizer=42)


def test_unparsable_size_is_value_error():
    with pytest.raises(ValueError, match="MiB"):
        memtorch.units.parse("64 MiBs")


def test_non_tensor_in_parameters_names_the_path():
    model = zoo.seed_model()
    model.fc2._parameters["weight"] = 3
    with pytest.raises(TypeError, match=r"'fc2'.*int.*_parameters\['weight'\]"):
        memtorch.inspect(model)
    with pytest.raises(TypeError, match=r"'fc2'"):
        _reference.inspect(model)


def test_none_parameter_is_skipped():
    model = nn.Linear(3, 3, bias=False)
    assert model._parameters["bias"] is None
    assert memtorch.inspect(model).total == 9 * 4


def test_module_without_init():
    class Bad(nn.Module):
        def __init__(self):
            pass  # forgot super().__init__()

    bad = Bad()
    with pytest.raises(TypeError, match=r"_parameters.*nn\.Module\.__init__"):
        memtorch.inspect(bad)


def test_module_overriding_getattr_is_read_through_dict():
    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def __getattr__(self, name):
            raise RuntimeError("user __getattr__ must not run")

        def __getattribute__(self, name):
            armed = object.__getattribute__(self, "__dict__").get("armed")
            if armed and name in ("_parameters", "_buffers", "_modules"):
                raise RuntimeError("user __getattribute__ must not run")
            return object.__getattribute__(self, name)

    sneaky = Sneaky()
    sneaky.__dict__["armed"] = True
    with pytest.raises(RuntimeError):
        sneaky._parameters  # the trap works
    mm = memtorch.inspect(sneaky)
    assert mm.total == (16 + 4) * 4


class PlainSubclass(torch.Tensor):
    pass


class Wrapper(torch.Tensor):
    """A wrapper subclass: its storage holds nothing, its data is in .elem."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("not implemented")


class FlatWrapper(Wrapper):
    def __tensor_flatten__(self):
        return ["elem"], None


def test_plain_tensor_subclass():
    t = torch.ones(10).as_subclass(PlainSubclass)
    assert memtorch.sizeof([t]).total == 40
    assert_same_walk([t])


def test_wrapper_subclass_without_flatten_is_a_clear_error():
    w = Wrapper(torch.ones(10))
    with pytest.raises(TypeError, match=r"Wrapper at '\[0\]'.*__tensor_flatten__"):
        memtorch.sizeof([w])
    with pytest.raises(TypeError, match=r"__tensor_flatten__"):
        _reference.sizeof([w])


def test_wrapper_subclass_with_flatten_counts_inner_tensors():
    inner = torch.ones(10)
    w = FlatWrapper(inner)
    mm = memtorch.sizeof({"w": w})
    assert mm.total == 40
    assert mm.paths == ["w.elem"]
    assert_same_walk({"w": w})


def test_object_whose_len_raises():
    class NoLen:
        def __len__(self):
            raise RuntimeError("no len")

    class ListNoLen(list):
        def __len__(self):
            raise RuntimeError("no len")

    assert memtorch.sizeof([NoLen(), torch.ones(4)]).total == 16
    assert memtorch.sizeof(ListNoLen([torch.ones(4), torch.ones(2)])).total == 24
    assert_same_walk(ListNoLen([torch.ones(4)]))


def test_walker_not_set_up_errors_cleanly():
    from memtorch import _C

    with pytest.raises(TypeError):
        _C._walk(1)
    with pytest.raises(TypeError, match="Optimizer"):
        c_walk(zoo.seed_model(), 5)
    with pytest.raises(TypeError, match="dict"):
        _C._walker_setup(5)


def test_user_code_changing_the_model_during_the_walk_does_not_crash():
    # A wrapper subclass's __tensor_flatten__ is user code the walker must call;
    # here it replaces the dicts being walked. The walk keeps its own references.
    model = nn.Module()
    opt_holder = {}

    class Mutating(FlatWrapper):
        def __tensor_flatten__(self):
            model.__dict__["_parameters"] = {}
            model.__dict__["_buffers"] = {}
            opt = opt_holder.get("opt")
            if opt is not None:
                opt.__dict__["param_groups"] = []
                opt.__dict__["state"] = {}
            return ["elem"], None

    p = nn.Parameter(torch.ones(3))
    model._parameters["w"] = Mutating(torch.ones(2))
    model._parameters["p"] = p
    model.register_buffer("b", torch.ones(4))
    mm = memtorch.inspect(model)
    assert mm.paths[0] == "w.elem"  # what was there when the walk began
    opt = torch.optim.SGD([Mutating(torch.ones(5)), p], lr=0.1)
    opt_holder["opt"] = opt
    memtorch.inspect(nn.Module(), opt)


def test_sizeof_refuses_an_iterator_and_leaves_it_unconsumed():
    import torch

    import memtorch

    tensors = [torch.zeros(4), torch.zeros(8)]
    gen = (t for t in tensors)
    with pytest.raises(TypeError, match="sizeof\\(\\) of a generator \\(an iterator\\): walking it would consume it"):
        memtorch.sizeof(gen)
    assert len(list(gen)) == 2  # not consumed
    with pytest.raises(TypeError, match="list_iterator"):
        memtorch.sizeof(iter(tensors))
    assert memtorch.sizeof(list(tensors)).total == 4 * 4 + 8 * 4  # the list it would hold
