"""Example inputs as users pass them: one reading for estimate(), plan(), advise() and the CLI.

A model is called as ``model(*args, **kwargs)``. The inputs given to those
functions are read here, once:

- a tensor (real, meta or fake: its values are never read by estimate/plan);
- a shape: ``(64, 784)`` or ``torch.Size``, float32;
- a ``(shape, dtype)`` pair: ``((8, 128), torch.long)``;
- a text spec, the CLI's spelling: ``"8x128:int64"`` (``x`` between sizes,
  an optional ``:dtype``: float32, bf16, int64, long, ...);
- a mapping (a Hugging Face batch: ``{"input_ids": ids, "labels": ids}``),
  given alone or after the positional inputs: its items are keyword inputs,
  the model is called as ``model(**batch)``; each value is read as above,
  a value that is none of those (``use_cache=False``) is passed as it is.

The CLI's ``--input input_ids=1x2048:int64`` is a keyword input, ``--input
8x3x224x224`` a positional one (``parse_text``).

The default loss (``default_loss``) is the output's ``.loss`` when the model
computes one (a Hugging Face model given ``labels``), else the sum of every
floating-point tensor in the output.
"""

from collections.abc import Mapping

from .errors import MemtorchError
from ._torch import torch as _load_torch  # the loader only: torch itself loads on first call

__all__ = ["Inputs", "read", "from_texts", "parse_text", "default_loss", "sum_loss", "loss_of"]

_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
    "fp64": "float64", "double": "float64", "long": "int64", "int": "int32", "bool": "bool",
}  # fmt: skip

_FORMS = (
    "pass example tensors (real, meta or fake), shapes such as (64, 784), (shape, dtype) pairs such as "
    "((8, 128), torch.long), specs such as '8x128:int64', or a mapping of keyword inputs "
    "({'input_ids': ..., 'labels': ...}, passed as model(**batch))"
)


def _torch():
    return _load_torch()


def dtype_of(name, what="dtype"):
    """A torch.dtype from a name: 'int64', 'long', 'bf16', 'torch.float16'."""
    torch = _torch()
    key = str(name).strip().lower().removeprefix("torch.")
    dt = getattr(torch, _DTYPE_ALIASES.get(key, key), None)
    if not isinstance(dt, torch.dtype):
        raise MemtorchError(f"{what} {name!r} is not a torch dtype (e.g. float32, bfloat16, int64)")
    return dt


def parse_text(text):
    """'8x128:int64' -> (None, (8, 128), torch.int64); 'input_ids=1x2048:int64' -> ('input_ids', ...).

    The dtype defaults to float32. Raises MemtorchError with the expected form.
    """
    name = None
    body = str(text).strip()
    if "=" in body:
        name, _, body = body.partition("=")
        name = name.strip()
        if not name.isidentifier():
            raise MemtorchError(f"input {text!r}: {name!r} is not a keyword argument name")
    shape_text, sep, dtype = body.partition(":")
    parts = shape_text.strip().lower().replace("×", "x").split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = None
    if not shape or any(d < 0 for d in shape):
        raise MemtorchError(
            f"input {text!r} is not a shape: write the sizes joined by x, e.g. 8x3x224x224, optionally with a "
            "dtype, e.g. 8x128:int64, and for a keyword input its name, e.g. input_ids=1x2048:int64"
        )
    torch = _torch()
    dt = dtype_of(dtype, f"input {text!r}: dtype") if sep and dtype.strip() else torch.float32
    return name, shape, dt


def _spec(x, where):
    """A tensor standing for one example input: the tensor itself, or an empty meta tensor of the
    shape and dtype given. Non-tensor values are returned as they are when ``where`` is a keyword."""
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, torch.Size) or (
        isinstance(x, (tuple, list)) and x and all(isinstance(d, int) and not isinstance(d, bool) for d in x)
    ):
        return torch.empty(tuple(x), device="meta")
    if (
        isinstance(x, (tuple, list))
        and len(x) == 2
        and isinstance(x[1], torch.dtype)
        and isinstance(x[0], (tuple, list, torch.Size))
        and all(isinstance(d, int) for d in x[0])
    ):
        return torch.empty(tuple(x[0]), dtype=x[1], device="meta")
    if isinstance(x, str):
        try:
            name, shape, dt = parse_text(x)
        except MemtorchError:
            name, shape = None, None
        if shape is not None and name is None:
            return torch.empty(shape, dtype=dt, device="meta")
    if isinstance(where, str):
        return x  # a keyword argument that is not a tensor (use_cache=False): passed as it is
    raise MemtorchError(f"input {where} is a {type(x).__name__}: {_FORMS}")


class Inputs:
    """The example inputs read: ``args`` (tuple) and ``kwargs`` (dict), tensors standing for the
    tensors (meta tensors for shapes), other keyword values as given."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args, kwargs):
        self.args = tuple(args)
        self.kwargs = dict(kwargs)

    def tensors(self):
        torch = _torch()
        return [t for t in list(self.args) + list(self.kwargs.values()) if isinstance(t, torch.Tensor)]

    def __bool__(self):
        return bool(self.args or self.kwargs)

    def map(self, fn):
        """A new Inputs with fn(tensor) in place of each tensor; a tensor given twice ({"input_ids": ids,
        "labels": ids}) is mapped once, so that it stays one tensor."""
        torch = _torch()
        done = {}

        def f(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) not in done:
                done[id(t)] = (t, fn(t))  # the tensor kept too, so that its id is not reused
            return done[id(t)][1]

        return Inputs([f(t) for t in self.args], {k: f(v) for k, v in self.kwargs.items()})

    def call(self, model):
        return model(*self.args, **self.kwargs)

    def batch_size(self):
        """Dimension 0 of the first tensor with a dimension, positional inputs first; None without one."""
        for t in self.tensors():
            if t.dim() > 0:
                return int(t.shape[0])
        return None

    def with_batch(self, n):
        """The inputs with dimension 0 of every tensor set to ``n``, as meta tensors (plan's micro-batches)."""
        torch = _torch()
        return self.map(
            lambda t: torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype, device="meta") if t.dim() > 0 else t
        )

    def seq_len(self):
        """Dimension 1 of the first tensor with two dimensions (the sequence of token ids, say); None without one."""
        for t in self.tensors():
            if t.dim() > 1:
                return int(t.shape[1])
        return None

    def with_seq(self, n):
        """The inputs with dimension 1 set to ``n`` in every tensor whose dimension 1 is the sequence length
        (seq_len(): input_ids, labels, an attention mask alike), as meta tensors."""
        torch = _torch()
        old = self.seq_len()
        return self.map(
            lambda t: torch.empty((t.shape[0], n) + tuple(t.shape[2:]), dtype=t.dtype, device="meta")
            if t.dim() > 1 and t.shape[1] == old else t
        )

    def signature(self):
        """What a dry run reads of the inputs: each tensor's shape and dtype, other values' repr."""
        torch = _torch()
        first = {}  # a tensor given twice ({"input_ids": ids, "labels": ids}) is one allocation

        def one(t):
            if not isinstance(t, torch.Tensor):
                return repr(t)
            return (tuple(t.shape), str(t.dtype), first.setdefault(id(t), len(first)))

        return tuple(one(t) for t in self.args) + tuple((k, one(v)) for k, v in sorted(self.kwargs.items()))

    def real(self, device=None):
        """Real tensors for a measured run: tensors given stay as they are (meta ones and shapes become
        random floats / zero integers, token ids 0 being valid ones)."""
        torch = _torch()

        def make(t):
            if t.device.type != "meta":
                return t
            dev = device or "cpu"
            if t.dtype.is_floating_point or t.dtype.is_complex:
                return torch.randn(tuple(t.shape), dtype=t.dtype, device=dev)
            return torch.zeros(tuple(t.shape), dtype=t.dtype, device=dev)

        return self.map(make)

    def as_tuple(self):
        """The positional form used where a tuple of inputs is passed on: args, then the kwargs mapping."""
        return self.args + ((dict(self.kwargs),) if self.kwargs else ())

    def describe(self):
        def one(t):
            torch = _torch()
            if isinstance(t, torch.Tensor):
                return "x".join(map(str, t.shape)) + ":" + str(t.dtype).replace("torch.", "")
            return repr(t)

        return ", ".join([one(t) for t in self.args] + [f"{k}={one(v)}" for k, v in self.kwargs.items()])


def read(inputs, who="estimate()"):
    """Inputs from what a user passed as ``*inputs``: positional specs, then at most one mapping of
    keyword inputs (last). Raises MemtorchError naming the input that is none of the forms."""
    args, kwargs = [], {}
    items = list(inputs)
    if items and isinstance(items[-1], Mapping):
        mapping = items.pop()
        for k, v in mapping.items():
            if not isinstance(k, str) or not k.isidentifier():
                raise MemtorchError(f"{who}: keyword input {k!r} is not an argument name (a str)")
            kwargs[k] = _spec(v, k)
    for i, x in enumerate(items):
        if isinstance(x, Mapping):
            raise MemtorchError(
                f"{who}: input {i} is a mapping but is not the last input: pass keyword inputs as one mapping, "
                "after the positional ones"
            )
        args.append(_spec(x, i))
    return Inputs(args, kwargs)


def from_texts(texts):
    """Inputs from the CLI's --input values ('8x128:int64', 'input_ids=1x2048:int64'), as meta tensors."""
    torch = _torch()
    args, kwargs = [], {}
    for text in texts:
        name, shape, dt = parse_text(text)
        t = torch.empty(shape, dtype=dt, device="meta")
        if name is None:
            if kwargs:
                raise MemtorchError(f"input {text!r}: positional inputs come before the keyword ones (name=shape)")
            args.append(t)
        elif name in kwargs:
            raise MemtorchError(f"input {text!r}: keyword input {name!r} given twice")
        else:
            kwargs[name] = t
    return Inputs(args, kwargs)


def loss_of(output):
    """The output's own loss (``output.loss``, or ``output['loss']`` of a mapping) when it is a
    one-element tensor, else None."""
    torch = _torch()
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    return None


def default_loss(output, *inputs, **kw_inputs):
    """The loss estimate(), plan() and advise() use without loss_fn: the output's ``.loss`` when the
    model computes one (a Hugging Face model given labels), else the sum of every floating-point
    tensor in the output."""
    own = loss_of(output)
    if own is not None:
        return own
    return sum_loss(output)


def sum_loss(output, *inputs, **kw_inputs):
    """The sum of every floating-point tensor in the output (a loss that reaches every output)."""
    from torch.utils._pytree import tree_leaves

    torch = _torch()
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise MemtorchError(
            "the model's output holds no floating-point tensor to sum into a loss (and no .loss): pass "
            "loss_fn=(output, *inputs) -> loss"
        )
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss
