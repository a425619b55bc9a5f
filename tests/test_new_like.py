"""New tensors like their fake inputs, made without FakeTensorMode (memtorch/estimator/dispatch.py, _new_like).

The dry run makes the outputs of zeros_like / empty_like, empty_strided on the CPU, detach, torch.tensor
of one number (lift_fresh) and of out-of-place foreach operators (AdamW's torch._foreach_sqrt) directly where
they are certain. Each such output must be what
FakeTensorMode gives (shape, strides, dtype, device, storage bytes), every other case must fall
through to FakeTensorMode (None), and a dry run must record the same events either way.
"""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memtorch import _inputs
from memtorch.estimator import dispatch as D
from memtorch.estimator import estimate as E

aten = torch.ops.aten
SHAPES = [(3, 4), (), (1, 5), (2, 1, 3), (7,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


def _same(got, want):
    assert type(got) is FakeTensor
    assert (got.shape, got.stride(), got.dtype, got.device) == (
        want.shape,
        want.stride(),
        want.dtype,
        want.device,
    )
    assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
    assert got.fake_mode is want.fake_mode


def _lists(mode):
    with mode:
        a = [torch.empty(s, dtype=d) for s, d in zip(SHAPES, DTYPES + DTYPES)]
        b = [torch.empty(s, dtype=d) for s, d in zip(SHAPES, DTYPES + DTYPES)]
    return a, b


def _ops():
    """(operator, its arguments' kind) of every foreach operator _new_like makes outputs for."""
    out = []
    for op in sorted(D._FOREACH_UNARY | D._FOREACH_BINARY):
        packet = getattr(aten, f"_foreach_{op}", None)
        if packet is None:
            continue
        for overload in ("default", "List", "Scalar", "ScalarList"):
            func = getattr(packet, overload, None)
            if func is not None and D._kind(func):
                out.append(pytest.param(func, D._kind(func), id=f"{op}.{overload}"))
    return out


@pytest.mark.parametrize("func,kind", _ops())
def test_foreach_outputs_are_fake_tensor_modes(func, kind):
    mode = FakeTensorMode()
    a, b = _lists(mode)
    args = {"unary": (a,), "List": (a, b), "Scalar": (a, 2), "ScalarList": (a, [0.5] * len(a))}[kind]
    got = D._new_like(func, args, {}, FakeTensor)
    assert got is not None
    with mode:
        want = func(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.parametrize(
    "func", [aten.zeros_like.default, aten.empty_like.default], ids=["zeros_like", "empty_like"]
)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dtype": torch.float16},
        {"dtype": torch.int64},
        {"memory_format": torch.preserve_format},
        {"memory_format": torch.contiguous_format},
        {"layout": torch.strided, "pin_memory": False},
    ],  # fmt: skip
)
def test_factories_like_are_fake_tensor_modes(func, kwargs):
    mode = FakeTensorMode()
    a, _ = _lists(mode)
    for t in a:
        got = D._new_like(func, (t,), kwargs, FakeTensor)
        assert got is not None
        with mode:
            want = func(t, **kwargs)
        _same(got, want)


@pytest.mark.parametrize(
    "size,stride", [((3, 4), (4, 1)), ((3, 4), (1, 3)), ((2, 3), (10, 2)), ((), ()), ((0, 5), (5, 1))]
)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.int64])
def test_empty_strided_is_fake_tensor_modes(size, stride, dtype):
    mode = FakeTensorMode()
    kwargs = {"device": "cpu"} if dtype is None else {"dtype": dtype, "device": torch.device("cpu")}
    with mode:
        got = D._new_like(aten.empty_strided.default, (list(size), list(stride)), kwargs, FakeTensor)
        want = aten.empty_strided.default(size, stride, **kwargs)
    assert got is not None
    _same(got, want)


def test_detach_is_fake_tensor_modes():
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(3, 4, dtype=torch.bfloat16)
        for t in (x, x.t(), x[1:, ::2]):
            got = D._new_like(aten.detach.default, (t,), {}, FakeTensor)
            want = aten.detach.default(t)
            _same(got, want)
            assert got.storage_offset() == want.storage_offset()
            # a view: the input's own storage, no new allocation
            assert got.untyped_storage()._cdata == t.untyped_storage()._cdata == want.untyped_storage()._cdata


@pytest.mark.parametrize("value", [0.0, 3, 2.5, True, [1.5], [[7]]], ids=repr)
@pytest.mark.parametrize("dtype", [None, torch.float64, torch.bfloat16, torch.int32])
def test_torch_tensor_of_one_number_is_fake_tensor_modes(value, dtype):
    """torch.tensor(x) under the fake mode: FakeTensorMode's fake with its constant, made directly."""
    mode = FakeTensorMode()
    made = []
    lift = D._lift_fresh

    def counted(*a):
        out = lift(*a)
        made.append(out)
        return out

    with mode:
        want = torch.tensor(value, dtype=dtype)
    D._lift_fresh = counted
    try:
        with _Accounting(mode):
            got = torch.tensor(value, dtype=dtype)
    finally:
        D._lift_fresh = lift
    assert made and made[0] is got  # made here, not by FakeTensorMode
    _same(got, want)
    assert got.constant is not None and got.constant is not want.constant
    assert (got.constant.dtype, got.constant.shape, got.constant.tolist()) == (
        want.constant.dtype,
        want.constant.shape,
        want.constant.tolist(),
    )
    with mode:
        assert got.item() == want.item()  # answered from the constant, as FakeTensorMode's
        got.add_(torch.empty((), dtype=got.dtype))  # written with a value no one knows: the constant goes
        want.add_(torch.empty((), dtype=want.dtype))
    assert got.constant is None and want.constant is None


def test_anything_but_one_plain_number_is_lifted_by_fake_tensor_mode():
    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(())
    one = torch.tensor(1.0)
    cases = [
        ((torch.tensor([1.0, 2.0]),), {}),  # two numbers: FakeTensorMode keeps no constant
        ((one.to_sparse(),), {}),
        ((torch.tensor(1.0, requires_grad=True),), {}),
        ((torch.nn.Parameter(torch.ones(())),), {}),  # a subclass
        ((fake,), {}),
        ((one,), {"x": 1}),
        ((one, one), {}),
    ]
    with mode:
        for args, kwargs in cases:
            assert D._lift_fresh(args, kwargs, FakeTensor) is None, args
    assert D._lift_fresh((torch.tensor(1.0),), {}, FakeTensor) is None  # no fake mode


class _Accounting(torch.utils._python_dispatch.TorchDispatchMode):
    """The accounting mode's way to _new_like, alone: a fake mode below it."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def __enter__(self):
        self.mode.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.mode.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = D._new_like(func, args, kwargs or {}, FakeTensor) if D._kind(func) else None
        return func(*args, **(kwargs or {})) if out is None else out


def test_each_operator_is_classified_once_by_its_schema():
    assert D._kind(aten._foreach_mul_.Scalar) == "inplace"  # writes its list, returns nothing
    assert D._kind(aten._foreach_sqrt.default) == "unary"
    assert D._kind(aten._foreach_add.List) == "List"
    assert D._kind(aten.zeros_like.default) == D._kind(aten.empty_like.default) == "factory"
    assert (D._kind(aten.empty_strided.default), D._kind(aten.detach.default)) == ("strided", "detach")
    assert D._kind(aten.lift_fresh.default) == "lift" and D._kind(aten.lift_fresh_copy.default) is None
    for func in (
        aten._foreach_mul.Tensor,
        aten._foreach_lerp.Scalar,
        aten.mm.default,
        aten.empty.memory_format,
    ):
        assert D._kind(func) is None


def test_anything_uncertain_is_left_to_fake_tensor_mode():
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(3, 4)
        odd = torch.empty_strided((4, 1), (1, 7))  # contiguous, but a size-1 dim with a stride of its own
        cases = [
            (aten._foreach_sqrt.default, ([x.t()],), {}),  # not contiguous
            (
                aten._foreach_sqrt.default,
                ([torch.empty(3, dtype=torch.int64)],),
                {},
            ),  # sqrt of an integer is a float
            (aten._foreach_sqrt.default, ([odd],), {}),
            (aten._foreach_sqrt.default, ([torch.empty(0, 4)],), {}),  # no element
            (aten._foreach_add.List, ([x], [torch.empty(3, 4, dtype=torch.float64)]), {}),  # promotes
            (aten._foreach_add.List, ([x], [torch.empty(1, 4)]), {}),  # broadcasts
            (aten._foreach_mul.Scalar, ([x], True), {}),  # a bool
            (aten._foreach_mul.Scalar, ([x], 1j), {}),  # a complex number promotes
            (aten._foreach_add.List, ([x], [x]), {"alpha": torch.tensor(2.0)}),
            (aten._foreach_mul.Tensor, ([x], torch.tensor(2.0)), {}),  # an overload not covered
            (aten._foreach_lerp.Scalar, ([x], [x], 0.5), {}),  # an operator not covered
            (aten.zeros_like.default, (x.t(),), {}),
            (aten.zeros_like.default, (x,), {"device": "cpu"}),
            (aten.zeros_like.default, (x,), {"memory_format": torch.channels_last}),
        ]
        const = torch.tensor(2.0)  # a fake holding its constant
        assert const.constant is not None
        cases += [
            (aten.detach.default, (const,), {}),
            (aten.empty_strided.default, ([2, 3], [3, 1]), {"device": "meta"}),
            (aten.empty_strided.default, ([2, 3], [3, 1]), {"device": "cpu", "pin_memory": True}),
            (aten.empty_strided.default, ([2, True], [3, 1]), {"device": "cpu"}),
        ]
        for func, args, kwargs in cases:
            assert D._new_like(func, args, kwargs, FakeTensor) is None, (func, args, kwargs)
    # no fake mode: a factory is not the dry run's
    assert D._new_like(aten.empty_strided.default, ([2, 3], [3, 1]), {"device": "cpu"}, FakeTensor) is None
    real = [torch.empty(3)]
    assert D._new_like(aten._foreach_sqrt.default, (real,), {}, FakeTensor) is None  # a real tensor
    assert D._new_like(aten.zeros_like.default, (real[0],), {}, FakeTensor) is None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 3, bias=False)

    def forward(self, x):
        return self.head(self.body(x)).pow(2).mean()


def _canon(ledger):
    """The ledger's events as (bytes, category, +1 / -1), each run of consecutive frees sorted: the order of
    frees with no allocation between them changes no figure, and varies from run to run with no change at
    all (autocast's cache is freed in an order that follows the tensors' addresses)."""
    out, frees = [], []
    for k, sign in ledger.events:
        e = (ledger.info[k][0], ledger.info[k][3], sign)
        if sign < 0:
            frees.append(e)
            continue
        out += sorted(frees)
        frees = []
        out.append(e)
    return out + sorted(frees)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("device,precision", [("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16-mixed")])
def test_a_dry_run_records_the_same_events_either_way(monkeypatch, optimizer, device, precision):
    """On cuda AdamW runs its foreach step (torch._foreach_sqrt), on the CPU one tensor at a time: both make
    their state with zeros_like. The ledger, event for event with each storage's bytes and category, is the
    same with the outputs made directly and with FakeTensorMode making them."""
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 16)
    gpu = E.resolve_gpu("h100") if device == "cuda" else None
    made = []
    new_like = D._new_like

    def counted(*a):
        out = new_like(*a)
        made.append(out is not None)
        return out

    runs = []
    for fn in (counted, lambda *a: None):
        monkeypatch.setattr(D, "_new_like", fn)
        ledger, hooks, _facts = E._dry_run(model, _inputs.read((x,)), optimizer, lambda out, *a: out, precision,
                                           device, None, gpu=gpu)  # fmt: skip
        E._classify(ledger, hooks)
        runs.append((_canon(ledger), hooks.spans))
    assert runs[0] == runs[1]
    if optimizer != "sgd":
        assert sum(made) >= 2 * len(list(model.parameters())), "the state was not made by _new_like"
