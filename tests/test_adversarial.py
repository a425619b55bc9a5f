"""An adversarial corpus for inspect()/sizeof(): odd inputs, each with a hand-derived answer.

Every case builds an object and states the bytes it holds, derived by hand in
the comment or the expression beside it (element sizes, shapes, which storages
are shared), never pasted from a run. Each case is also walked by the
pure-Python reference walker, which must agree row for row with the C walker.
Cases that once crashed the process (use-after-free, malformed private input)
run in a child process, so that a crash fails those cases, not the session.
"""

import collections
import dataclasses
import json
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.utils.prune
from torch import nn

import memtorch
from memtorch import _reference
from memtorch.inspection import walk as c_walk

# Bytes per element, by hand from the dtypes' definitions.
ITEMSIZE = {
    torch.float32: 4,
    torch.float64: 8,
    torch.float16: 2,
    torch.bfloat16: 2,
    torch.int8: 1,
    torch.uint8: 1,
    torch.int16: 2,
    torch.int32: 4,
    torch.int64: 8,
    torch.bool: 1,
    torch.complex64: 8,
    torch.complex128: 16,
}
SHAPES = [(0,), (7,), (3, 5)]


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def assert_same_walk(obj, optimizer=None):
    c = c_walk(obj, optimizer)
    py = _reference.walk(obj, optimizer)
    assert len(c[0]) == len(py[0])
    for field in c[0].dtype.names:
        a, b = c[0][field], py[0][field]
        if field in ("storage", "tensor", "data"):
            # Addresses: equal up to relabelling (an object read through a
            # property is a fresh one in each walk), zero kept as zero.
            a, b = _relabel(a), _relabel(b)
        np.testing.assert_array_equal(a, b, err_msg=field)
    assert c[1:4] == py[1:4]
    assert c[4][:2] == py[4][:2]
    np.testing.assert_array_equal(c[4][2], py[4][2])


def _relabel(keys):
    order = {0: 0}
    return np.array([order.setdefault(k, len(order)) for k in keys.tolist()])


CASES = {}


def case(name, total, **expect):
    """Register builder() -> obj; total (and any other attribute) by hand."""

    def deco(builder):
        CASES[name] = (builder, total, expect)
        return builder

    return deco


# ------------------------------------------------ 36 cases: dtype x shape
for _dt, _size in ITEMSIZE.items():
    for _shape in SHAPES:
        case(f"dtype-{str(_dt)[6:]}-{'x'.join(map(str, _shape))}", _numel(_shape) * _size)(
            lambda dt=_dt, shape=_shape: [torch.zeros(shape, dtype=dt)]
        )


# ------------------------------------------------ views, sharing, sizes
@case("slice-keeps-whole-storage", 400, logical=40)
def _():
    return [torch.zeros(100)[10:20]]  # 100 float32 kept alive, 10 seen


@case("expand-past-int64", 4, logical=2**63)
def _():
    return [torch.zeros(1).expand(2**61)]  # 2**61 * 4 B logical, one float stored


@case("two-meta-2**62", 2**63, logical=2**63)
def _():
    return [torch.empty(2**62, dtype=torch.uint8, device="meta") for _ in range(2)]


@case("meta-float32-10", 40)
def _():
    return [torch.empty(10, device="meta")]


@case("same-tensor-twice", 400)
def _():
    t = torch.zeros(100)
    return [t, t]


@case("tensor-and-its-view", 400)
def _():
    t = torch.zeros(100)
    return [t, t.view(10, 10)]


@case("from-numpy-shared-once", 400)
def _():
    a = np.zeros(100, dtype=np.float32)
    return [a, torch.from_numpy(a)]


@case("from-numpy-twice", 400)
def _():
    a = np.zeros(100, dtype=np.float32)
    return [torch.from_numpy(a), torch.from_numpy(a)]


@case("from-numpy-of-slice-and-base", 400)
def _():
    a = np.zeros(100, dtype=np.float32)
    return [torch.from_numpy(a[50:]), a]  # the window lies inside a's 400 B


@case("frombuffer-two-windows", 1000)
def _():
    b = bytes(1000)  # both windows keep the whole bytes object alive
    return [np.frombuffer(b, np.uint8, count=10), np.frombuffer(b, np.uint8, count=20, offset=500)]


@case("torch-and-numpy-frombuffer-one-bytearray", 64)
def _():
    b = bytearray(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.frombuffer(b, dtype=torch.uint8)
    return [t, np.frombuffer(b, np.uint8)]


@case("tensor-numpy-view", 40)
def _():
    t = torch.zeros(10)
    return [t, t.numpy()]


@case("ndarray-view-keeps-base", 80)
def _():
    return [np.zeros(10)[2:5]]  # 10 float64


@case("empty-tensor", 0)
def _():
    return [torch.zeros(0)]


@case("ndarray-f8-10", 80)
def _():
    return np.zeros(10)


# ------------------------------------------------ places the walker must look
@case("tensor-as-dict-key", 400)
def _():
    return {torch.zeros(100): "x"}


@case("tuple-of-tensors-as-dict-key", 80)
def _():
    return {(torch.zeros(10), torch.zeros(10)): 0}


@case("deque", 80)
def _():
    return collections.deque([torch.zeros(10), torch.zeros(10)])


class MyDeque(collections.deque):
    def __iter__(self):  # never called: the walker uses deque's own iterator
        raise AssertionError("user __iter__ ran")


@case("deque-subclass-iter-not-run", 40)
def _():
    return MyDeque([torch.zeros(10)])


@case("deque-in-optimizer-like-state", 120)
def _():
    return {"state": {0: {"history": collections.deque([torch.zeros(10)] * 2 + [torch.zeros(20)])}}}


@case("object-array-of-tensors", 2 * 8 + 40 + 80)
def _():
    arr = np.empty(2, dtype=object)  # 2 pointers of 8 B
    arr[0], arr[1] = torch.zeros(10), torch.zeros(20)
    return arr


@case("object-array-2d-of-arrays", 4 * 8 + 4 * 8)
def _():
    arr = np.empty((2, 2), dtype=object)
    for i in range(2):
        for j in range(2):
            arr[i, j] = np.zeros(1)  # 8 B each
    return arr


@case("masked-array-mask", 80 + 10)
def _():
    return np.ma.array(np.zeros(10), mask=np.zeros(10, dtype=bool))


@case("masked-array-nomask", 80)
def _():
    return np.ma.array(np.zeros(10))


@case("simple-namespace", 40)
def _():
    return types.SimpleNamespace(a=torch.zeros(10), b=3)


@case("user-dict", 40)
def _():
    return collections.UserDict({"a": torch.zeros(10)})


@case("user-list", 80)
def _():
    return collections.UserList([torch.zeros(10), torch.zeros(10)])


@case("frozenset-of-tensors", 80)
def _():
    return frozenset([torch.zeros(10), torch.zeros(10)])


@case("namedtuple", 48)
def _():
    P = collections.namedtuple("P", "x y")
    return P(torch.zeros(10), torch.zeros(2))


@case("ordered-and-default-dict", 80)
def _():
    d = collections.defaultdict(list)
    d["a"].append(torch.zeros(10))
    return collections.OrderedDict(x=d, y=torch.zeros(10))


@case("cycle", 40)
def _():
    a = [torch.zeros(10)]
    a.append(a)
    return a


@case("retain-grad-non-leaf", 40 + 40 + 40)
def _():
    x = torch.zeros(10, requires_grad=True)  # leaf without grad: 40
    y = x * 2  # non-leaf: 40, its retained grad: 40
    y.retain_grad()
    y.sum().backward()  # x.grad: 40, listed beside y
    return [y, x.grad]


@case("non-leaf-without-retain", 40)
def _():
    x = torch.zeros(10, requires_grad=True)
    return [x * 2]


@case("leaf-with-grad", 80, by_category={"tensor": 40, "gradient": 40})
def _():
    x = torch.zeros(10, requires_grad=True)
    x.sum().backward()
    return [x]


# ------------------------------------------------ dataclasses
@dataclasses.dataclass
class WithPseudo:
    x: torch.Tensor
    y: dataclasses.InitVar[int] = 0
    z: "typing.ClassVar[int]" = 5  # noqa: F821  (a ClassVar by string annotation)

    def __post_init__(self, y):
        pass


@case("dataclass-initvar-classvar", 40)
def _():
    return WithPseudo(torch.zeros(10))


@dataclasses.dataclass
class FreshList:
    x: list = dataclasses.field(default=None)


# A new list and tensor on every read (the setter lets __init__ run).
FreshList.x = property(lambda self: [torch.zeros(10)], lambda self, v: None)


@case("five-dataclasses-fresh-lists", 5 * 40)
def _():
    return [FreshList() for _ in range(5)]


@dataclasses.dataclass
class FreshTensor:
    t: torch.Tensor = None


FreshTensor.t = property(lambda self: torch.zeros(10), lambda self, v: None)


@case("three-fresh-tensors-through-getattr", 3 * 40)
def _():
    return [FreshTensor() for _ in range(3)]


# ------------------------------------------------ quantized
def _q(shape, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.rand(*shape), 0.1, 0, dtype)


@case("quint4x2-3x3", 6, logical=6)  # 3 rows of ceil(3/2) = 2 bytes
def _():
    return [_q((3, 3), torch.quint4x2)]


@case("quint4x2-9", 5, logical=5)  # ceil(9/2)
def _():
    return [_q((9,), torch.quint4x2)]


@case("quint2x4-5x2", 5, logical=5)  # 5 rows of ceil(2/4) = 1 byte
def _():
    return [_q((5, 2), torch.quint2x4)]


@case("quint2x4-2x3x5", 12, logical=12)  # 6 rows of ceil(5/4) = 2 bytes
def _():
    return [_q((2, 3, 5), torch.quint2x4)]


@case("qint8-per-tensor", 10)
def _():
    return [_q((10,), torch.qint8)]


@case("quantized-unknown-quantizer", 4)
def _():
    return [torch.empty(4, dtype=torch.quint8)]  # qscheme() raises on it


@case("qint8-per-channel", 12 + 3 * 8 + 3 * 8)  # data, float64 scales, int64 zero points
def _():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            torch.quantize_per_channel(
                torch.rand(3, 4), torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.int64), 0, torch.qint8
            )
        ]


# ------------------------------------------------ sparse
@case("sparse-coo", 2 * 3 * 8 + 3 * 4)  # int64 indices (2, nnz=3), float32 values
def _():
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [torch.sparse_coo_tensor(i, torch.ones(3), (3, 3)).coalesce()]


def _independent(tensors):
    """Bytes of the unique storages of tensors, as torch itself reports them."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


# crow (n+1=4 int64), col (3 int64), values (3 float32); torch's conversion
# leaves col_indices a view of a larger storage: the independent count says how large.
@case("sparse-csr", lambda obj: _independent([obj[0].crow_indices(), obj[0].col_indices(), obj[0].values()]))
def _():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [torch.eye(3).to_sparse_csr()]


# ------------------------------------------------ many numpy dtypes
@case("1100-distinct-numpy-dtypes", sum(range(1, 1101)))
def _():
    # structured dtypes of 1..1100 bytes: one array of one element each
    return [np.zeros(1, dtype=[("f", "u1", (n,))]) for n in range(1, 1101)]


# ------------------------------------------------ modules
class WithAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)  # 4*4 + 2*4 = 24
        self.cache = torch.zeros(10)  # a plain attribute: 40
        self.history = [torch.zeros(5)]  # 20


@case("module-plain-tensor-attributes", 24 + 40 + 20, by_category={"parameter": 24, "attribute": 60})
def _():
    return WithAttr()


@case("pruned-linear-100", 40000 + 400 + 40000 + 40000, by_category={"parameter": 40400, "buffer": 40000, "attribute": 40000})
def _():
    m = nn.Linear(100, 100)  # weight_orig 40,000, bias 400, weight_mask 40,000, weight 40,000
    torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.5)
    return m


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)  # 400
        self.b = nn.Linear(10, 10, bias=False)
        self.b.weight = self.a.weight


@case("tied-weight", 400)
def _():
    return Tied()


@case("submodule-under-two-names", 440)
def _():
    m = nn.Module()
    m.x = nn.Linear(10, 10)  # 400 + 40
    m.y = m.x
    return m


@case("scripted-linear", 440)
def _():
    return torch.jit.script(nn.Linear(10, 10))


@case("traced-sequential", 440 + 160)  # Linear(10, 10): 400 + 40; Linear(10, 4, bias=False): 160
def _():
    return torch.jit.trace(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 4, bias=False)), torch.randn(1, 10))


@case("scripted-batchnorm", 4 * 16 + 8)  # weight, bias, running mean/var (4 float32) + int64 counter
def _():
    return torch.jit.script(nn.BatchNorm1d(4))


class HoldsScripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(3, 3)  # 36 + 12
        self.scripted = torch.jit.script(nn.Linear(3, 2))  # 24 + 8


@case("plain-module-with-scripted-child", 48 + 32)
def _():
    return HoldsScripted()


# ------------------------------------------------ optimizers
class HistoryOpt(torch.optim.Optimizer):
    """LBFGS-like: keeps a deque of past directions in its state."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("dirs", collections.deque(maxlen=3)).append(p.detach().clone())


@case("optimizer-with-deque-state", 40 + 3 * 40)
def _():
    p = nn.Parameter(torch.zeros(10))
    opt = HistoryOpt([p])
    for _ in range(4):
        opt.step()  # the deque keeps the last 3 clones
    return opt


# ------------------------------------------------ wrapper subclass
class Wrapper(torch.Tensor):
    """A traceable wrapper subclass whose data lives in an inner tensor."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError

    def __tensor_flatten__(self):
        return ["inner"], None


@case("wrapper-subclass", 40)
def _():
    return [Wrapper(torch.zeros(10))]


def test_corpus_size():
    assert len(CASES) + len(CHILD_CASES) >= 100


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    builder, total, expect = CASES[name]
    obj = builder()
    mm = memtorch.sizeof(obj)
    if callable(total):
        total = total(obj)
    assert mm.total == total
    for attr, value in expect.items():
        assert getattr(mm, attr) == value, attr
    assert_same_walk(obj)


# ------------------------------------------------ in a child process
# Each is a snippet that prints one JSON value; the expected value is by hand.
CHILD_CASES = {
    # __tensor_flatten__'s names freed by a property during getattr (the
    # walker of main before this fix: ASan heap-use-after-free in join_name).
    "flatten-names-freed-by-property": (
        """
class W(torch.Tensor):
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
    def __init__(self, inner):
        self._inner = inner
        # A fresh name of > 100 characters: CPython's type attribute cache
        # does not keep a reference to it, so clearing the list frees it.
        self._names = ["".join(["inner"] + ["_x"] * 60)]
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError
    def __tensor_flatten__(self):
        return self._names, None
def _get(self):
    self._names.clear()
    return self._inner
setattr(W, "inner" + "_x" * 60, property(_get))
out = [memtorch.sizeof([W(torch.zeros(10))]).total, memtorch._reference.sizeof([W(torch.zeros(10))]).total]
""",
        [40, 40],
    ),
    # A dataclass field whose property empties the class's field table.
    "dataclass-fields-cleared-by-property": (
        """
import dataclasses
@dataclasses.dataclass
class D:
    a: object = None
    b: object = None
D.a = property(lambda self: (type(self).__dataclass_fields__.clear(), torch.zeros(10))[1], lambda s, v: None)
D.b = property(lambda self: torch.zeros(5), lambda s, v: None)
out = memtorch.sizeof(D()).total
""",
        60,
    ),
    # A property that frees the list it is a field of while the walk holds it.
    "module-dict-mutated-during-walk": (
        """
class W(torch.Tensor):
    @staticmethod
    def __new__(cls, inner, owner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
    def __init__(self, inner, owner):
        self._inner, self._owner = inner, owner
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError
    def __tensor_flatten__(self):
        return ["inner"], None
    @property
    def inner(self):
        self._owner.__dict__.clear()
        return self._inner
m = torch.nn.Module()
m.register_buffer("w", W(torch.zeros(10), m))
m.extra = torch.zeros(5)
try:
    out = memtorch.inspect(m).total
except TypeError as e:
    out = "TypeError"  # its tables are gone mid-walk: a clear error, no crash
""",
        "TypeError",
    ),
    "walker-setup-malformed-dtype-table": (
        """
from memtorch import _C
try:
    _C._walker_setup({"dtypes": {torch.float32: ("float32",)}, "layouts": ()})
    out = "no error"
except TypeError as e:
    out = "TypeError" if "dtype table" in str(e) else str(e)
""",
        "TypeError",
    ),
    "walker-setup-bad-layouts": (
        """
from memtorch import _C
try:
    _C._walker_setup({"dtypes": {}, "layouts": (1, 2)})
    out = "no error"
except TypeError as e:
    out = "TypeError"
""",
        "TypeError",
    ),
    "walker-setup-itemsize-not-int": (
        """
from memtorch import _C
try:
    _C._walker_setup({"dtypes": {torch.float32: ("float32", "4", False, 0)}, "layouts": (0,) * 6})
    out = "no error"
except TypeError as e:
    out = "TypeError"
""",
        "TypeError",
    ),
    "classify-returns-minus-one": (
        """
from memtorch import _C, inspection
class S(torch.Tensor):
    pass
memtorch.sizeof([torch.zeros(1)])  # set up
info = dict(inspection.setup_info(torch))
info["classify"] = lambda tp: -1
_C._walker_setup(info)
try:
    _C._walk([torch.zeros(3).as_subclass(S)], None)
    out = "no error"
except TypeError as e:
    out = "TypeError" if "classify" in str(e) else str(e)
""",
        "TypeError",
    ),
    "classify-returns-a-string": (
        """
from memtorch import _C, inspection
class S(torch.Tensor):
    pass
memtorch.sizeof([torch.zeros(1)])
info = dict(inspection.setup_info(torch))
info["classify"] = lambda tp: "plain"
_C._walker_setup(info)
try:
    _C._walk([torch.zeros(3).as_subclass(S)], None)
    out = "no error"
except TypeError as e:
    out = "TypeError"
""",
        "TypeError",
    ),
    "dtype-table-changed-after-setup": (
        """
from memtorch import _C, inspection
memtorch.sizeof([torch.zeros(1)])
info = dict(inspection.setup_info(torch))
info["dtypes"] = dict(info["dtypes"])
_C._walker_setup(info)
info["dtypes"][torch.float64] = "broken"   # the walker's copy of info shares this dict
try:
    _C._walk([torch.zeros(3, dtype=torch.float64)], None)
    out = "no error"
except TypeError as e:
    out = "TypeError"
""",
        "TypeError",
    ),
}


@pytest.fixture(scope="module")
def child_results():
    """Runs every CHILD_CASES snippet in one child process; {name: result or crash}."""
    prog = ["import json, sys, warnings, torch, memtorch, memtorch._reference", "warnings.simplefilter('ignore')"]
    for name, (code, _expected) in CHILD_CASES.items():
        prog.append(f"try:\n    exec({code!r})\nexcept Exception as e:\n    out = 'error: ' + repr(e)")
        prog.append(f"print(json.dumps([{name!r}, out]), flush=True)")
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(prog)], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("["):
            name, out = json.loads(line)
            results[name] = out
    return results, proc


@pytest.mark.parametrize("name", sorted(CHILD_CASES))
def test_child_case(name, child_results):
    results, proc = child_results
    assert name in results, f"the child process died before this case (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert results[name] == CHILD_CASES[name][1]
