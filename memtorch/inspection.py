"""inspect() and sizeof(): what a model, an optimizer or any nest of tensors holds.

The C walker (memtorch._C._walk) records one row per tensor occurrence; this
module hands it what it needs to know about torch once, calls it, and builds a
ModelMemory (memtorch/report.py) from the rows.
"""

import argparse
import collections
import dataclasses
import threading
import types

import numpy as np

from . import _torch
from .reports.model import ModelMemory

__all__ = ["inspect", "sizeof"]

_setup_lock = threading.Lock()
_setup_done = False

# Type classes the walker understands (src/walker.c MT_TYPE_*).
TYPE_PLAIN, TYPE_FLATTEN, TYPE_CHECK_DATA = 0, 1, 2


# Packed sub-byte quantized dtypes: elements per byte along the last dimension.
_PACKED = {"quint4x2": 2, "quint2x4": 4}


def _dtype_table(torch):
    """{torch.dtype: (name, itemsize, quantized, per_byte)} for every dtype torch has.

    per_byte is the number of elements packed in one byte along the last
    dimension (quint4x2: 2, quint2x4: 4), 0 for byte-sized elements.
    """
    table = {}
    quantized = _quantized_dtypes(torch)
    for name in dir(torch):
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype) and dt not in table:
            short = str(dt).replace("torch.", "", 1)
            table[dt] = (short, int(dt.itemsize), bool(dt in quantized), _PACKED.get(short, 0))
    return table


def _dataclass_fields(tp):
    """Names of the real fields of dataclass type tp (no ClassVar/InitVar), or None.

    Read from the class's field table as dataclasses.fields() reads it, but each
    name is the table's key: user code run by the walk (a property) may have
    deleted a Field's attributes or entries of the table, and what is left is
    still walked by name (a field missing on the instance counts nothing)."""
    if not isinstance(tp, type) or not dataclasses.is_dataclass(tp):
        return None
    table = getattr(tp, "__dataclass_fields__", None)
    if not isinstance(table, dict):
        return None
    pseudo = (dataclasses._FIELD_CLASSVAR, dataclasses._FIELD_INITVAR)
    return tuple(k for k, f in list(table.items()) if isinstance(k, str) and getattr(f, "_field_type", None) not in pseudo)


def _script_tables(mod):
    """(parameters, buffers, modules) as plain dicts for a TorchScript module, else None.

    torch.jit.script / torch.jit.trace modules keep their tables in C++ and
    expose wrappers (or nothing, for a traced module) where nn.Module has dicts.
    """
    torch = _torch.torch()
    if not isinstance(mod, torch.jit.ScriptModule):
        return None
    return (dict(mod._parameters.items()), dict(mod._buffers.items()), dict(mod._modules.items()))


def _quantized_dtypes(torch):
    return {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


def classify_type(tp):
    """How the walker should read a tensor subclass (cached per type by the walker).

    A subclass that keeps torch's own __torch_dispatch__ stores its data in its
    storage like a plain tensor. One that overrides it may be a wrapper whose
    storage holds nothing: if it implements __tensor_flatten__ the walker reads
    the tensors it names; otherwise the walker checks that the storage has data
    and raises a clear TypeError if it has none.
    """
    torch = _torch.torch()
    if getattr(tp, "__torch_dispatch__", None) is torch._C._disabled_torch_dispatch_impl:
        return TYPE_PLAIN
    if callable(getattr(tp, "__tensor_flatten__", None)):
        return TYPE_FLATTEN
    return TYPE_CHECK_DATA


_info = None


def setup_info(torch):
    """The dict handed to _C._walker_setup (also read by memtorch._reference); built once."""
    global _info
    if _info is None:
        _info = _build_setup_info(torch)
    return _info


def _build_setup_info(torch):
    layouts = tuple(
        getattr(torch, n, object())
        for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")
    )
    per_channel = tuple(
        getattr(torch, n)
        for n in ("per_channel_affine", "per_channel_symmetric", "per_channel_affine_float_qparams")
        if hasattr(torch, n)
    )
    return {
        "dtypes": _dtype_table(torch),
        "layouts": layouts,
        "per_channel": per_channel,
        "classify": classify_type,
        "dataclass_fields": _dataclass_fields,
        "script_tables": _script_tables,
        # Iterated by their own C iterator (a subclass's __iter__ is not run).
        "iterables": (collections.deque,),
        # Their state is their instance __dict__.
        "namespaces": (types.SimpleNamespace, argparse.Namespace, collections.UserDict, collections.UserList),
        "masked_type": np.ma.MaskedArray,
        # nn.Module's own bookkeeping in an instance __dict__: not user attributes.
        "module_skip": frozenset(torch.nn.Module().__dict__) | {"training"},
    }


def dtype_sizes():
    """{dtype name: bytes per element} for torch's dtypes (packed ones: 1 per byte of packing)."""
    torch = _torch.torch()
    return {name: itemsize for name, itemsize, _q, _pb in setup_info(torch)["dtypes"].values()}


ModelMemory._dtype_sizes = staticmethod(dtype_sizes)  # what its overflowed rows are recomputed with


def _ensure_setup():
    global _setup_done
    torch = _torch.torch()
    if not _setup_done:
        with _setup_lock:
            if not _setup_done:
                # lazy: the extension _C loads NumPy; only this path needs it (importing inspection stays cheap)
                from . import _C

                _C._walker_setup(setup_info(torch))
                _setup_done = True
    return torch


def walk(obj, optimizer=None):
    """Raw walker output: (rows, paths, dtypes, devices, modules); see memtorch/_C.pyi."""
    torch = _ensure_setup()
    # lazy: the extension _C loads NumPy; only this path needs it (importing inspection stays cheap)
    from . import _C

    # A subclass's __torch_function__ is user code: keep it out of the walk.
    with torch._C.DisableTorchFunctionSubclass():
        return _C._walk(obj, optimizer)


def inspect(model, optimizer=None):
    """What `model` (an nn.Module) and `optimizer` (or None) hold in memory.

    Returns a ModelMemory: each storage counted once (tied weights, views,
    a submodule under two names), with per-dtype, per-device, per-category
    and per-module figures, in bytes.
    """
    torch = _torch.torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"inspect() takes a torch.nn.Module (and optionally optimizer=torch.optim.Optimizer), "
            f"not {type(model).__name__}; for tensors, dicts, lists or a state_dict use memtorch.sizeof()"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, not {type(optimizer).__name__}")
    return ModelMemory(*walk(model, optimizer), root_type=type(model).__name__)


def sizeof(obj):
    """Bytes held by any nest of dicts, lists, tuples, sets, namedtuples and
    dataclasses holding tensors, NumPy arrays, modules or optimizers.

    Returns a ModelMemory (``.total`` is the bytes of the unique storages).
    Objects of other types hold nothing memtorch can see and count 0. A generator or
    other iterator is refused (TypeError): walking it would consume it, and what it
    yields is not held until it is asked for.
    """
    from collections.abc import Iterator

    if isinstance(obj, Iterator):
        raise TypeError(
            f"sizeof() of a {type(obj).__name__} (an iterator): walking it would consume it, and what it yields "
            "is not held yet; pass what it holds, e.g. memtorch.sizeof(list(items))"
        )
    return ModelMemory(*walk(obj, None), root_type=type(obj).__name__)
