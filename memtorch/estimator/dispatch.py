"""The dry run behind estimate(): one training step, twice, on fake tensors, with allocation accounting.

The user's own model runs on FakeTensorMode tensors that say they live on the
CPU (so that every device-dependent choice, such as the attention backend or
the recurrent layers' implementation, is the one the real CPU step makes) but
own no memory. A TorchDispatchMode above FakeTensorMode sees every operator's
outputs; each new storage is an allocation of its nbytes, and its free is the
moment the storage dies (storages keep their Python object alive while the
C++ StorageImpl lives, so a weakref finalizer on the storage fires exactly at
the StorageImpl's death, as the real allocator's free would).

Where a CPU kernel allocates something its fake kernel does not show (internal
temporaries, a different saved tensor), ``kernels`` adds it.

Nothing real is allocated for the model: parameters, buffers and inputs are
replaced by fake tensors of the same shape, dtype and strides through
torch.func.functional_call, which restores the module's own tensors on exit.
"""

import contextlib
import weakref

from .kernels import (  # Around, Composite: the kernel tables' entries
    Around, Composite, check_real, probe_extra, saved_number_names, scalar_extra,
)
from ..errors import MemtorchError
from .._torch import torch as _load_torch  # the loader only: torch itself loads on first call

_torch_mod = None


def _torch():
    global _torch_mod
    if _torch_mod is None:
        _torch_mod = _load_torch()
    return _torch_mod


class Ledger:
    """Allocation events of the dry run: (+/- bytes, storage key, tag) in order.

    ``current``/``peak`` follow the events. Keys are small ints given out per
    storage; ``info[key]`` is [nbytes, phase, module, category or None].
    """

    def __init__(self, rounding=None):
        self.current = 0
        self.peak = 0
        self.events = []  # (key, +1 alloc / -1 free)
        self.info = {}
        self.live = {}  # id(storage object) -> key
        self._next = 0
        self.phase = None
        self.module = None
        self.closed = False
        self.trace = None  # [(op, modelled transient bytes)] when set to a list (tests, calibration)
        # owner[key] = index of the trainable parameter a storage belongs to (its parameter,
        # gradient, optimizer state, or a temporary the optimizer made from them), -1 for several;
        # followed from the operators' inputs to their outputs while ``attribute`` is set
        self.owner = {}
        self.elements = {}  # key -> elements of an owned storage (its parameter's numel: elementwise)
        # key -> [(storage offset, elements, parameter index)] of a storage several parameters view (cuDNN's
        # flat RNN weights and their flat gradient): its owner is -1, a view of one parameter's part is that one's
        self.views = {}
        self.attribute = False
        self._round = rounding or (lambda n: n)
        self.host = set()  # id(storage) of host memory a device step keeps (Adam's step counts on CUDA)
        self.to_host = False  # set while a factory makes a tensor in host memory (host_factories)
        self.gone = set()  # keys freed before their storage dies (replay.py): its death is not counted again
        self.on_free = None  # fn(key) told of each storage's death (replay.py)
        # [(weakref to an output, names, phase, module)]: an operator given a Python number where it takes a
        # Tensor, whose autograd node may keep that number's 8-byte tensor (settle_saved_numbers)
        self.saved_numbers = []

    def add_host(self, storage):
        """``storage`` lives in host memory: never counted, whatever operator returns it later."""
        sid = id(storage)
        if sid not in self.live:
            self.host.add(sid)
            weakref.finalize(storage, self.host.discard, sid)

    def add_storage(self, storage, category=None):
        """Count ``storage`` as allocated now unless it is already counted; returns its key."""
        sid = id(storage)
        key = self.live.get(sid)
        if key is not None or sid in self.host:
            return key
        if self.to_host:
            self.add_host(storage)
            return None
        nbytes = self._round(int(storage.nbytes()))
        key = self._next
        self._next += 1
        self.live[sid] = key
        self.info[key] = [nbytes, self.phase, self.module, category]
        self.events.append((key, 1))
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        weakref.finalize(storage, self._free, sid, key)
        return key

    def add_extra(self, nbytes, category="temporary", transient=True):
        """An allocation no fake storage shows (a CPU kernel's internal buffer).

        transient: allocated and freed inside the kernel (raises the peak only);
        otherwise returns the key, to be freed with free_key().
        """
        key = self._next
        self._next += 1
        self.info[key] = [int(nbytes), self.phase, self.module, category]
        self.events.append((key, 1))
        self.current += int(nbytes)
        if self.current > self.peak:
            self.peak = self.current
        if transient:
            self.events.append((key, -1))
            self.current -= int(nbytes)
            return None
        return key

    def settle_saved_numbers(self):
        """Counts the wrapped Python numbers the last operators' autograd nodes saved, as held from then on.

        The real step wraps ``x * 2.0``'s 2.0 into an 8-byte CPU tensor before the operator runs, and
        MulBackward0 keeps it until backward runs that node; the operator's outputs do not show it (this
        mode sees the number, not the tensor). The node is known only once autograd has made it, after the
        operator returns, so it is read here: at the next operator, a module's end or a phase's end. Its
        phase and module are the operator's."""
        pending, self.saved_numbers = self.saved_numbers, []
        for ref, names, phase, module in pending:
            out = ref()
            node = getattr(out, "grad_fn", None)
            if node is None:
                continue
            for name in names:
                try:
                    kept = getattr(node, "_saved_" + name)
                except (AttributeError, RuntimeError):  # not saved, or already released
                    continue
                # a wrapped number: a plain 0-dim CPU tensor (not a fake, not anything else the node keeps)
                if type(kept).__name__ != "Tensor" or kept.dim() != 0 or kept.device.type != "cpu":
                    continue
                key = self.add_storage(kept.untyped_storage())
                if key is not None:
                    self.info[key][1:3] = [phase, module]

    def free_key(self, key):
        self.events.append((key, -1))
        self.current -= self.info[key][0]

    def _free(self, sid, key):
        if self.closed:
            return
        if self.live.get(sid) == key:
            del self.live[sid]
        if key in self.gone:
            self.gone.discard(key)
            return
        self.events.append((key, -1))
        self.current -= self.info[key][0]
        if self.on_free is not None:
            self.on_free(key)

    def key_of(self, tensor):
        return self.live.get(id(tensor.untyped_storage()))

    def mark(self, keys, category):
        for k in keys:
            if k is not None and self.info[k][3] is None:
                self.info[k][3] = category

    def replay(self):
        """(peak, index of the event reaching it, keys live at that moment)."""
        cur = best = 0
        at = -1
        for i, (key, sign) in enumerate(self.events):
            cur += sign * self.info[key][0]
            if cur > best:
                best, at = cur, i
        live = set()
        for key, sign in self.events[: at + 1]:
            if sign > 0:
                live.add(key)
            else:
                live.discard(key)
        return best, at, live


def host_factories(ledger):
    """While entered, a tensor factory (torch.tensor, torch.zeros...) called without ``device=`` or with
    ``device="cpu"`` makes host memory: on a GPU run the default device is the CPU's. Entered for the
    optimizer's step on CUDA: the step counts torch's optimizers keep unless capturable or fused (Adam:
    torch.tensor(0.0, device="cpu") since torch 2.12, torch.tensor(0.0) before; RMSprop, Adadelta:
    torch.zeros(())) and the one-element tensors their step adds are the host's. The capturable and
    fused ones, made with ``device=p.device`` (a torch.device: the fake parameters' is the CPU's too,
    so only a device named by a string counts as the host), stay counted. A host tensor sent to the
    device with ``.to(tensor)`` or ``.to(torch.device)`` is a copy there, counted."""
    from torch.overrides import TorchFunctionMode

    torch = _torch()
    factories = {torch.tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
                 torch.arange, torch.empty_strided}  # fmt: skip

    def to_device(args, kwargs):
        # Tensor.to's target: another tensor in device memory, or a torch.device (the fake parameters' own)
        for c in (*args[1:], kwargs.get("device"), kwargs.get("other")):
            if isinstance(c, torch.Tensor):
                return id(c.untyped_storage()) not in ledger.host and ledger.key_of(c) is not None
            if isinstance(c, torch.device):
                return True
        return False

    class HostFactories(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor)
                    and id(args[0].untyped_storage()) in ledger.host and to_device(args, kwargs)):
                # a host tensor sent to the device (transformers' Adafactor: torch.zeros(shape).to(grad); a
                # tensor lr: lr.to(device)) is a copy in device memory on the GPU; the fake parameters are
                # the CPU's, so .to would hand back the host tensor itself
                out = func(*args, **kwargs)
                return out.clone() if out.untyped_storage() is args[0].untyped_storage() or \
                    id(out.untyped_storage()) in ledger.host else out
            device = kwargs.get("device")
            if func not in factories or not (device is None or (isinstance(device, str) and device == "cpu")):
                return func(*args, **kwargs)
            ledger.to_host = True
            try:
                return func(*args, **kwargs)
            finally:
                ledger.to_host = False

    return HostFactories()


def _accounting_mode(ledger, kernels, allow_item, check=True):
    """check: where no probe runs, the real CPU kernel checks the arguments (check_real); off where the CPU
    kernels' rules are not the target's (CUDA's step under autocast: dtype mixes the GPU's kernels take)."""
    probe = kernels.get("probe", True)
    after = kernels.get("after", {})
    before = kernels.get("before", {})  # operator -> fn(args, kwargs): its output made another way, or None
    scalars = kernels.get("scalars", True)  # Python numbers wrapped into CPU tensors (the CPU's memory)
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    torch = _torch()
    local_scalar = torch.ops.aten._local_scalar_dense.default
    is_nonzero = torch.ops.aten.is_nonzero.default
    # Tensor.item() reaches this mode whole where autograd is off (inference_mode): answered as the
    # _local_scalar_dense it decomposes into, not passed below, where the fake mode refuses it
    item = torch.ops.aten.item.default
    prim_device = torch.ops.prim.device.default
    from torch._subclasses.fake_tensor import FakeTensor

    known = _Known()

    class Accounting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is prim_device and len(args) == 1 and isinstance(args[0], FakeTensor):
                # a tensor's device (asked per tensor by the optimizers' grouping, about 11,000 times a 7B
                # step): FakeTensorMode's own answer, without the way down to it; it allocates nothing
                fake = args[0]
                return torch.device("meta") if fake.fake_mode.in_kernel_invocation else fake.fake_device
            # not at prim.device above: autograd asks it before it gives the operator's output its node
            if ledger.saved_numbers:
                ledger.settle_saved_numbers()
            kwargs = kwargs or {}
            if func is item:
                func = local_scalar
            if func in (local_scalar, is_nonzero) and known.get(args[0]) is not None:
                # a value computed from constants alone (a position index) is the real one: the question the
                # real step asks of it (transformers' packed-sequence check) gets the real step's answer
                return known.answer(func, args[0])
            if allow_item[0] == "generate" and func in (local_scalar, is_nonzero):
                # generate()'s questions on tensor values (estimation._generate): a value computed from
                # constants alone is the real one; any other is answered for the longest run
                return known.answer(func, args[0])
            if func is local_scalar:
                if allow_item[0]:
                    # The optimizers read their step count with .item(); any plausible value
                    # gives the same memory.
                    return 1.0 if args[0].dtype.is_floating_point else 1
                raise _DataDependent("calls .item() (or converts a tensor to a Python number or bool)")
            pre = before.get(func)
            if pre is not None:
                out = pre(args, kwargs)
                if out is not None:  # made another way (autograd's in-place sum): counted as any output below
                    known.follow(func, args, kwargs, out)
                    return self._count(func, args, kwargs, out, 0)
            fix = kernels.get(func)
            if (not probe and fix is None and func.namespace == "aten" and func not in after
                    and func._can_decompose()):
                # Under inference_mode autograd is off, so a composite operator (aten.linear, matmul)
                # reaches this mode whole. Without the CPU's probe to measure it, it runs as its
                # decomposition, so that the kernels the target device runs (addmm and its cuBLAS
                # workspaces, the copies a matmul makes) are each accounted, as fake tensors do.
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    known.decomposed(func, args, kwargs, out)
                    return out
            if isinstance(fix, Composite):
                # a kernel that runs as Python-level operators: each is counted here as it runs
                with self:
                    return fix(*args, **kwargs)
            if isinstance(fix, Around):
                # a kernel modelled whole (the target device's own, no fake kernel): it counts its
                # scratch in order and returns fake outputs, counted below
                out = fix(ledger, func, args, kwargs)
                known.follow(func, args, kwargs, out)
                extra = (fix.extra(func, args, kwargs, out) or 0) if fix.extra is not None else 0
            else:
                kind = _kind(func)
                if kind == "inplace" and all(isinstance(t, FakeTensor) for t in tree_leaves(args)
                                             if isinstance(t, torch.Tensor)):  # fmt: skip
                    # an optimizer's in-place foreach kernel (exp_avg.mul_(...) over every parameter) on fake
                    # tensors: nothing to allocate and nothing to return; FakeTensorMode would check each
                    # tensor's metadata, a millisecond a tensor on a 7B model's 291
                    out = None
                else:
                    out = _new_like(func, args, kwargs, FakeTensor) if kind else None
                    if out is None:
                        out = func(*args, **kwargs)
                known.follow(func, args, kwargs, out)
                if fix is not None:
                    extra = fix(args, kwargs, out)
                    if check:  # the real kernel's argument checks, which fake kernels may skip (dtypes, indices)
                        check_real(func, args, kwargs, out, known.get)
                else:
                    extra = probe_extra(func, args, kwargs, out, known.get) if probe else None
                    if not probe and check:
                        check_real(func, args, kwargs, out, known.get)
                    if extra is None and scalars:
                        extra = scalar_extra(func, args, out)
            return self._count(func, args, kwargs, out, extra)

        def _count(self, func, args, kwargs, out, extra):
            """Counts the operator's new output storages and its extra bytes; returns ``out``."""
            owners = _owners(ledger, args, kwargs, out) if ledger.attribute else None
            for i, t in enumerate(tree_leaves(out)):
                # meta outputs (SDPA's RNG seed and offset) own memory nowhere
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    key = ledger.add_storage(t.untyped_storage())
                    if owners is not None and key not in ledger.owner:
                        o = owners(i)
                        if o is not None:
                            ledger.owner[key] = o
                            ledger.elements[key] = t.untyped_storage().nbytes() // max(1, t.element_size())
            if extra:
                ledger.add_extra(extra)
                if owners is not None and owners(None) is not None:
                    ledger.owner[ledger._next - 1] = owners(None)
            if scalars and isinstance(out, torch.Tensor):
                names = saved_number_names(func, args)  # usually none: then no look for an input needing grad
                if names and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                    ledger.saved_numbers.append((weakref.ref(out), names, ledger.phase, ledger.module))
            post = after.get(func)
            if post is not None:
                post(ledger, args, kwargs, out)  # allocations the kernel keeps after its outputs (workspaces)
            if ledger.trace is not None:
                ledger.trace.append((str(func), extra, ledger.current))
            return out

    mode = Accounting()
    mode.known = known
    return mode


# out-of-place foreach operators whose i-th output is a new tensor like the i-th of their first list when every
# tensor is floating point (sqrt, neg, ... of a float keeps its dtype; so does a float op a float of its own dtype
# or a Python number): AdamW's torch._foreach_sqrt over every parameter's exp_avg_sq
_FOREACH_UNARY = frozenset((
    "sqrt", "neg", "abs", "exp", "log", "reciprocal", "sign", "sigmoid", "tanh", "log1p", "expm1", "erf",
    "sin", "cos", "ceil", "floor", "round", "trunc", "frac",
))  # fmt: skip
_FOREACH_BINARY = frozenset(("add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow"))
# operators whose outputs _new_like makes, by name
_DIRECT = {"aten::zeros_like": "factory", "aten::empty_like": "factory", "aten::empty_strided": "strided",
           "aten::detach": "detach", "aten::lift_fresh": "lift"}  # fmt: skip
_KINDS = {}


def _kind(func):
    """What the accounting mode may do for ``func`` without FakeTensorMode, read from its schema once per
    operator: "inplace" (an in-place foreach operator, aten::_foreach_mul_ ...: writes its lists, returns
    nothing), the kinds whose outputs _new_like makes ("factory": zeros_like and empty_like, "strided",
    "detach", "lift": torch.tensor's; how an out-of-place foreach operator's outputs follow its first list:
    "unary", "List", "Scalar", "ScalarList"), else None."""
    hit = _KINDS.get(func, False)
    if hit is False:
        schema = func._schema
        name, overload = schema.name, schema.overload_name
        op = name[len("aten::_foreach_"):] if name.startswith("aten::_foreach_") else ""
        hit = _DIRECT.get(name)
        if op.endswith("_") and not schema.returns:
            hit = "inplace"
        elif op in _FOREACH_UNARY and overload in ("", "default"):
            hit = "unary"
        elif op in _FOREACH_BINARY and overload in ("List", "Scalar", "ScalarList"):
            hit = overload
        _KINDS[func] = hit
    return hit


def _number(x):
    return type(x) in (int, float)


def _new_like(func, args, kwargs, fake_type):
    """The outputs of an operator that makes new tensors like its fake inputs, made directly: FakeTensorMode
    runs the operator's meta kernel and checks it (80 us a tensor for zeros_like, 300 us for each tensor of an
    out-of-place foreach operator: a 7B model's AdamW makes 582 states with zeros_like and runs
    torch._foreach_sqrt over 291). Only where the outputs are certain: None otherwise, and the operator runs
    as usual."""
    kind = _kind(func)
    if kind == "factory":
        return _factory_like(args, kwargs, fake_type)
    if kind == "strided":
        return _empty_strided(args, kwargs, fake_type)
    if kind == "detach":
        return _detach(args, kwargs, fake_type)
    if kind == "lift":
        return _lift_fresh(args, kwargs, fake_type)
    if kind in ("unary", "List", "Scalar", "ScalarList"):
        return _foreach_like_out(kind, args, kwargs, fake_type)
    return None


def _empty_strided(args, kwargs, fake_type):
    """torch.empty_strided(size, stride, device="cpu") under the fake mode (the dry run's parameters, inputs
    and replayed gradients, made by fake_like): a fake of that size and those strides on the CPU, its storage
    as large as they reach (the meta kernel's)."""
    torch = _torch()
    if len(args) != 2 or not all(isinstance(x, (list, tuple)) for x in args) or len(args[0]) != len(args[1]):
        return None
    if not all(type(x) is int for x in (*args[0], *args[1])):  # noqa: E721  (no SymInt, no bool)
        return None
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if (set(kwargs) - {"dtype", "layout", "device", "pin_memory"}
            or kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory")
            or not (isinstance(dtype, torch.dtype) or dtype is None)
            or not (device == "cpu" or (isinstance(device, torch.device) and device == torch.device("cpu")))):  # fmt: skip
        return None
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None or mode.in_kernel_invocation:
        return None
    spec = (args[0], args[1], torch.get_default_dtype() if dtype is None else dtype, torch.device("cpu"))
    return _fakes([spec], mode, fake_type)[0]


def _detach(args, kwargs, fake_type):
    """t.detach() of a fake tensor holding no constant (AccumulateGrad's, for every gradient): a fake viewing
    the same storage, the meta kernel's alias, as FakeTensorMode makes it."""
    if len(args) != 1 or kwargs or not isinstance(args[0], fake_type):
        return None
    t = args[0]
    mode = t.fake_mode
    if mode.in_kernel_invocation or t.constant is not None:
        return None
    torch = _torch()
    # lazy: torch's own helper, loaded with torch already
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    with in_kernel_invocation_manager(mode), torch._C.DisableTorchFunction():
        out = torch.ops.aten.detach.default(t)
    return fake_type(mode, out, t.fake_device)


def _lift_fresh(args, kwargs, fake_type):
    """torch.tensor(x) of one number under the fake mode (each parameter's step count in Adam and AdamW: 291
    on a 7B model, 170-240 us each through FakeTensorMode, which describes the real tensor to its meta
    converter): what FakeTensorMode makes of it, a fake of its shape and strides holding a copy of the real
    tensor as its constant (so that .item() and the constant's invalidation on a write work as they do),
    registered with the mode's converter as its own are. Only a plain one-element CPU tensor, as torch.tensor
    makes; anything else runs as usual."""
    torch = _torch()
    if len(args) != 1 or kwargs or type(args[0]) is not torch.Tensor:  # noqa: E721  (no subclass)
        return None
    t = args[0]
    if t.device.type != "cpu" or t.layout != torch.strided or t.numel() != 1 or t.requires_grad:
        return None
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None or mode.in_kernel_invocation or not mode.may_turn_const(t):
        return None
    # lazy: torch's own helper, loaded with torch already
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch(), torch._C.DisableTorchFunction():
        constant = t.clone()  # FakeTensorMode keeps a copy, never the tensor torch.tensor made
        meta = torch.ops.aten.empty_strided.default(
            constant.shape, constant.stride(), dtype=constant.dtype, device="meta"
        )
        out = fake_type(mode, meta, constant.device, constant=constant)
    converter = mode.fake_tensor_converter
    converter.set_tensor_memo(constant, out)
    converter.add_constant_storage_mapping(out)
    return out


def _plain(t):
    """Whether ``t`` has elements and the strides of a contiguous tensor of its shape (each dim's stride the
    product of the sizes after it, size-1 dims included): the layout every rule of a new tensor like it
    (empty_like's preserve_format, TensorIterator's outputs) gives it again."""
    stride, expect = t.stride(), 1
    shape = t.shape
    for i in range(len(shape) - 1, -1, -1):
        if stride[i] != expect:
            return False
        expect *= shape[i]
    return expect > 0


def _fakes(specs, mode, fake_type):
    """New fake tensors of ``mode``, one per (shape, strides or None: contiguous, dtype, fake device) of
    ``specs``: meta tensors made with every mode and torch function override off, then wrapped (what
    FakeTensorMode does last)."""
    torch = _torch()
    # lazy: torch's own helper, loaded with torch already
    from torch.utils._mode_utils import no_dispatch

    aten = torch.ops.aten
    with no_dispatch(), torch._C.DisableTorchFunction():
        metas = [aten.empty.memory_format(shape, dtype=dtype, device="meta") if stride is None else
                 aten.empty_strided.default(shape, stride, dtype=dtype, device="meta")
                 for shape, stride, dtype, _ in specs]  # fmt: skip
    return [fake_type(mode, m, spec[3]) for m, spec in zip(metas, specs)]


def _factory_like(args, kwargs, fake_type):
    """torch.zeros_like / empty_like of a contiguous fake tensor (_plain), in its dtype or the one given: a new
    contiguous fake of its shape on its device (preserve_format keeps that layout)."""
    torch = _torch()
    if len(args) != 1 or not isinstance(args[0], fake_type):
        return None
    t = args[0]
    dtype = kwargs.get("dtype")
    if (set(kwargs) - {"dtype", "layout", "device", "pin_memory", "memory_format"}
            or kwargs.get("layout") not in (None, torch.strided) or kwargs.get("device") is not None
            or kwargs.get("pin_memory") or kwargs.get("memory_format") not in (None, torch.preserve_format,
                                                                               torch.contiguous_format)
            or (dtype is not None and not isinstance(dtype, torch.dtype))):  # fmt: skip
        return None
    mode = t.fake_mode
    if mode.in_kernel_invocation or not _plain(t):
        return None
    return _fakes([(t.shape, None, t.dtype if dtype is None else dtype, t.fake_device)], mode, fake_type)[0]


def _foreach_like_out(kind, args, kwargs, fake_type):
    """The outputs of an out-of-place foreach operator of ``kind`` (_kind) on fake tensors: one new fake tensor
    each, of its input's shape, dtype and device, contiguous as its input is (what the operator's meta
    kernel gives, empty_like of each)."""
    if not args or (kwargs and (set(kwargs) != {"alpha"} or not _number(kwargs["alpha"]))):
        return None
    first = args[0]
    if not isinstance(first, (list, tuple)) or not first or not isinstance(first[0], fake_type):
        return None
    rest = args[1:]
    if kind == "unary":
        if rest:
            return None
    elif kind == "List":
        if not 1 <= len(rest) <= 2 or not isinstance(rest[0], (list, tuple)) or len(rest[0]) != len(first):
            return None
        if len(rest) == 2 and not _number(rest[1]):  # alpha given by position
            return None
    elif kind == "Scalar":
        if len(rest) != 1 or not _number(rest[0]):
            return None
    elif len(rest) != 1 or not isinstance(rest[0], (list, tuple)) or len(rest[0]) != len(first) or \
            not all(_number(x) for x in rest[0]):
        return None
    mode = first[0].fake_mode
    if mode.in_kernel_invocation:
        return None
    other = rest[0] if kind == "List" else None
    for i, t in enumerate(first):
        if not (isinstance(t, fake_type) and t.fake_mode is mode and t.dtype.is_floating_point and _plain(t)):
            return None
        if other is not None:
            u = other[i]
            if not (isinstance(u, fake_type) and u.fake_mode is mode and u.dtype == t.dtype and u.shape == t.shape
                    and u.fake_device == t.fake_device):  # fmt: skip
                return None
    return _fakes([(t.shape, None, t.dtype, t.fake_device) for t in first], mode, fake_type)


@contextlib.contextmanager
def eager_where_known(known):
    """transformers takes its tracing path for a FakeTensor (utils.import_utils.is_tracing: no question on
    values; masks made whole, packed sequences assumed): the real step is eager and asks, and its memory
    differs (a Llama step with use_cache=False made its causal mask: +2.3%). While entered, a fake whose
    value is known (_Known: computed from constants alone) is not a fake to transformers, so it asks and
    gets the real answer; the others keep the tracing path. Nothing when transformers is not loaded; the
    function is put back on exit."""
    import sys

    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None)
    if original is None:
        yield
        return

    def is_fake_tensor(x):
        return original(x) and known.get(x) is None

    utils.is_fake_tensor = is_fake_tensor
    try:
        yield
    finally:
        utils.is_fake_tensor = original


class _Known:
    """The real values of the small tensors a run computes from constants alone, beside their fakes.

    The CPU kernels run for real (kernels.probe_extra, check_real) read them: a position index
    made by torch.arange is the real one, so an embedding of more positions than the model has raises its
    real IndexError. generate() steers its loops by tensor values: a sequence's end-of-sequence test, and
    loops of its own (Whisper's ``while (seek < max_frames).any()`` over the audio's segments, seek and
    max_frames made by torch.zeros and torch.ones times the input's length). An operator whose tensor inputs all have a
    known value (none for a factory) runs again for real on those values, when its tensors are small; its
    outputs' values are known. Parameters, inputs and whatever the model computes have none: a question on
    them is answered for the longest run (False, 0: no sequence has finished, no special token is
    negative, no prompt is right-padded). A tensor written by an operator with an unknown input (in place,
    or through a view) has no known value from then on.
    """

    LIMIT = 1 << 16  # elements of a tensor run for real

    def __init__(self):
        from torch.utils.weak import WeakTensorKeyDictionary

        self.values = WeakTensorKeyDictionary()  # fake tensor -> real tensor
        self.dirty = set()  # id(storage) written with an unknown value
        self.storages = set()  # id(storage) of the fakes given a value (an id may outlive its storage: harmless)
        self._writes = {}  # operator -> positions of the arguments it writes

    def get(self, t):
        if id(t.untyped_storage()) in self.dirty:
            return None
        return self.values.get(t)

    def answer(self, func, t):
        torch = _torch()
        real = self.get(t)
        if real is not None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return bool(real) if func is torch.ops.aten.is_nonzero.default else real.item()
        if func is torch.ops.aten.is_nonzero.default or t.dtype == torch.bool:
            return False
        return 0.0 if t.dtype.is_floating_point else 0

    def follow(self, func, args, kwargs, out):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_leaves, tree_map

        torch = _torch()
        # tensors and lists of tensors, as operators take them (run for every operator: no pytree walk)
        ins = _tensors(args, torch.Tensor) + _tensors(kwargs.values(), torch.Tensor)
        outs = _tensors(out if isinstance(out, (list, tuple)) else (out,), torch.Tensor)
        reals = None
        if (all(self.get(t) is not None for t in ins) and func not in self._undefined()
                and torch.Tag.nondeterministic_seeded not in func.tags
                and all(t.numel() <= self.LIMIT for t in ins + outs)):  # fmt: skip
            real = tree_map(lambda a: self.get(a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
            try:
                with unset_fake_temporarily():
                    reals = [o for o in tree_leaves(func(*real[0], **real[1])) if isinstance(o, torch.Tensor)]
            except Exception:  # noqa: BLE001 - a value not known: the run goes on without it
                reals = None
        if reals is not None and len(reals) == len(outs):
            for o, r in zip(outs, reals):
                self.values[o] = r
                self.storages.add(id(o.untyped_storage()))
            return
        if not self.storages:
            return  # no value known anywhere: none to forget
        # the storages it wrote (its outputs, and the arguments it writes in place) hold unknown values, for
        # every tensor that views them
        writes = self._writes.get(func)
        if writes is None:
            writes = self._writes[func] = [i for i, a in enumerate(func._schema.arguments)
                                           if a.alias_info is not None and a.alias_info.is_write]  # fmt: skip
        written = outs + _tensors([args[i] for i in writes if i < len(args)], torch.Tensor)
        for t in written:
            if id(t.untyped_storage()) in self.storages:
                self.values.pop(t, None)
                self._dirty(t.untyped_storage())

    def decomposed(self, func, args, kwargs, out):
        """After an operator ran as its decomposition, whose operators may not all have come back through
        this mode: a functional one's outputs take their values from the operator run for real; an
        in-place one leaves what it wrote unknown (its operators may not have updated the values)."""
        from torch.utils._pytree import tree_leaves

        torch = _torch()
        if func._schema.is_mutable:
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    self.values.pop(t, None)
                    self._dirty(t.untyped_storage())
        elif any(isinstance(o, torch.Tensor) and self.get(o) is None for o in tree_leaves(out)):
            self.follow(func, args, kwargs, out)

    _undefined_ops = None

    @classmethod
    def _undefined(cls):
        # factories whose values are whatever the memory held (the fakes of the parameters are made by one)
        if cls._undefined_ops is None:
            aten = _torch().ops.aten
            cls._undefined_ops = frozenset({aten.empty.memory_format, aten.empty_strided.default,
                                            aten.empty_like.default, aten.new_empty.default,
                                            aten.new_empty_strided.default})  # fmt: skip
        return cls._undefined_ops

    def _dirty(self, storage):
        sid = id(storage)
        if sid not in self.dirty:
            self.dirty.add(sid)
            weakref.finalize(storage, self.dirty.discard, sid)


def _tensors(seq, tensor):
    """The tensors in ``seq`` and in its lists and tuples (one level: operators' arguments)."""
    out = []
    for a in seq:
        if isinstance(a, tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, tensor))
    return out


def _owners(ledger, args, kwargs, out):
    """owner(i): the parameter index the i-th output tensor of an operator belongs to, from its inputs.

    A foreach operator (lists of tensors in, a list out) pairs its i-th output with the i-th
    tensor of each input list; any other operator gives every output the one owner of all its
    inputs (-1 when they belong to several parameters, None when to none). owner(None): the
    owner of the operator as a whole (for a kernel's scratch space).
    """
    from torch.utils._pytree import tree_leaves

    torch = _torch()
    own = ledger.owner
    live = ledger.live

    def of(t):
        k = live.get(id(t.untyped_storage()))
        if k is None:
            return None
        o = own.get(k)
        parts = ledger.views.get(k) if o == -1 else None
        if parts:  # a storage several parameters view: the one whose part this view lies in
            at, n = t.storage_offset(), t.numel()
            for start, size, i in parts:
                if start <= at and at + n <= start + size:
                    return i
        return o

    def merge(os_):
        os_ = {o for o in os_ if o is not None}
        if not os_:
            return None
        return os_.pop() if len(os_) == 1 else -1

    lists = [a for a in list(args) + list(kwargs.values())
             if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)]  # fmt: skip
    whole = merge(of(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    if lists and isinstance(out, (list, tuple)) and all(len(a) == len(out) for a in lists):
        per = [merge(of(a[i]) for a in lists) for i in range(len(out))]
        return lambda i: whole if i is None or i >= len(per) else per[i]
    return lambda i: whole


class _DataDependent(MemtorchError):
    pass


def fake_like(t, device, dtype=None, requires_grad=None):
    """A fake tensor shaped like ``t`` (real, meta or fake) on ``device``, no data copied."""
    torch = _torch()
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype or t.dtype, device=device)
    if requires_grad is None:
        requires_grad = t.requires_grad
    if requires_grad:
        out.requires_grad_(True)
    return out


@contextlib.contextmanager
def fake_mode():
    """FakeTensorMode entered with the default device left as it was."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import logging

    # FakeTensorMode logs the traceback of a kernel that rejects its inputs before raising;
    # estimate() turns that error into its own message, so the log line is noise.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = log.disabled
    log.disabled = True
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            yield mode
    finally:
        log.disabled = disabled
