"""Pure-Python twin of the C walker (src/walker.c): the oracle the tests hold it against.

walk(obj, optimizer) returns exactly what memtorch._C._walk returns: (rows,
paths, dtypes, devices, modules), rows a NumPy array of memtorch._C.row_dtype.
Same order, same names, same keys; written for clarity, not speed.
"""

import dataclasses

import numpy as np

from . import _torch

__all__ = ["walk", "inspect", "sizeof"]

PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, TENSOR, ARRAY = range(6)
_MAX_FLATTEN_DEPTH = 32


class _Walk:
    def __init__(self, torch):
        from .inspection import setup_info

        self.torch = torch
        info = setup_info(torch)  # cached: the same dict the C walker holds
        self.dtype_info = info["dtypes"]
        self.layouts = info["layouts"]
        self.per_channel = info["per_channel"]
        self.classify = info["classify"]
        self.type_cache = {}
        self.rows = []
        self.paths = []
        self.dtypes, self.dtype_index, self.itemsize, self.quantized = [], {}, [], []
        self.devices, self.device_index = [], {}
        self.modules, self.module_ids = [], {}
        self.seen = set()
        self.params = {}
        self.keepalive = []
        self.stack = []  # items: (kind, obj, path, module, category)

    # -- side tables
    def path_slot(self, path):
        self.paths.append(path)
        return len(self.paths) - 1

    def torch_dtype_slot(self, dtype):
        i = self.dtype_index.get(dtype)
        if i is None:
            if dtype not in self.dtype_info:
                raise TypeError(f"memtorch does not know the dtype {dtype!r}")
            name, itemsize, quantized = self.dtype_info[dtype]
            i = self.dtype_index[dtype] = len(self.dtypes)
            self.dtypes.append(name)
            self.itemsize.append(itemsize)
            self.quantized.append(quantized)
        return i

    def numpy_dtype_slot(self, descr):
        i = self.dtype_index.get(descr)
        if i is None:
            i = self.dtype_index[descr] = len(self.dtypes)
            self.dtypes.append(str(descr))
            self.itemsize.append(0)
            self.quantized.append(False)
        return i

    def device_slot(self, device):
        i = self.device_index.get(device)
        if i is None:
            i = self.device_index[device] = len(self.devices)
            self.devices.append(str(device))
        return i

    @staticmethod
    def join(prefix, name):
        return f"{prefix}.{name}" if prefix else name

    # -- tensors
    def dense(self, t, owner, path, module, category, check_data):
        storage = t.untyped_storage()
        if check_data:
            try:
                storage.data_ptr()
            except RuntimeError:
                raise TypeError(
                    f"memtorch cannot measure the tensor subclass {type(t).__name__} at '{path}': its storage "
                    "holds no data (a wrapper subclass) and it does not implement __tensor_flatten__ to say "
                    "which tensors hold its data"
                ) from None
        key = storage._cdata
        storage_nbytes = storage.nbytes()
        numel = t.numel()
        dt = self.torch_dtype_slot(t.dtype)
        dev = self.device_slot(t.device)
        rg = bool(t.requires_grad)
        p = self.path_slot(path)
        self.rows.append(
            (numel, numel * self.itemsize[dt], key, storage_nbytes, id(owner), p, module, dt, dev, category, rg)
        )
        if self.quantized[dt] and t.qscheme() in self.per_channel:
            for aux in ("q_per_channel_scales", "q_per_channel_zero_points"):
                part = getattr(t, aux)()
                self.keepalive.append(part)
                self.dense(part, owner, self.join(path, aux), module, category, False)

    def tensor(self, t, path, module, category, depth=0, owner=None):
        if owner is None:
            owner = t
        if depth > _MAX_FLATTEN_DEPTH:
            raise RecursionError(f"tensor subclasses nested more than {_MAX_FLATTEN_DEPTH} deep at '{path}'")
        tp = type(t)
        if tp is self.torch.Tensor or tp is self.torch.nn.Parameter:
            cls = 0
        else:
            cls = self.type_cache.get(tp)
            if cls is None:
                cls = self.type_cache[tp] = int(self.classify(tp))
        if cls == 1:
            attrs = t.__tensor_flatten__()[0]
            for name in attrs:
                inner = getattr(t, name)
                if isinstance(inner, self.torch.Tensor):
                    self.tensor(inner, self.join(path, name), module, category, depth + 1, owner)
            return
        layout = t.layout
        L = self.layouts
        if layout is L[0]:
            self.dense(t, owner, path, module, category, cls == 2)
            return
        if layout is L[1]:
            parts = ("_indices", "_values")
        elif layout is L[2] or layout is L[4]:
            parts = ("crow_indices", "col_indices", "values")
        elif layout is L[3] or layout is L[5]:
            parts = ("ccol_indices", "row_indices", "values")
        else:
            raise TypeError(
                f"memtorch cannot measure the tensor at '{path}': layout {layout!r} is not supported "
                "(strided, sparse COO/CSR/CSC/BSR/BSC are)"
            )
        for name in parts:
            part = getattr(t, name)()
            self.keepalive.append(part)
            self.tensor(part, self.join(path, name), module, category, depth + 1, owner)

    def param(self, p, path, module, category):
        first_row = len(self.rows)
        self.tensor(p, path, module, category)
        if len(self.rows) > first_row:
            row = self.rows[first_row]
            self.params.setdefault(id(p), (self.paths[row[5]], row[6]))
        if type(p) is not self.torch.nn.Parameter:
            if not (p.requires_grad and p.is_leaf):
                return
        grad = p.grad
        if isinstance(grad, self.torch.Tensor):
            self.tensor(grad, self.join(path, "grad"), module, GRADIENT)

    def array(self, arr, path, module):
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        base = root.base
        storage_nbytes = root.nbytes
        if base is None:
            key = id(root)
        elif isinstance(base, self.torch.Tensor):
            st = base.untyped_storage()
            key, storage_nbytes = st._cdata, st.nbytes()
        else:
            key = id(base)
        dt = self.numpy_dtype_slot(arr.dtype)
        dev = self.device_slot("cpu")
        p = self.path_slot(path)
        self.rows.append((arr.size, arr.nbytes, key, storage_nbytes, id(arr), p, module, dt, dev, ARRAY, False))

    # -- modules
    def module(self, mod, path, parent):
        idx = len(self.modules)
        alias = self.module_ids.get(id(mod), -1)
        self.modules.append((path, type(mod).__name__, parent, alias))
        if alias >= 0:
            return
        self.module_ids[id(mod)] = idx
        d = object.__getattribute__(mod, "__dict__")
        tabs = {}
        for name in ("_parameters", "_buffers", "_modules"):
            tab = d.get(name)
            if not isinstance(tab, dict):
                raise TypeError(
                    f"module {type(mod).__name__} at '{path}' has no dict {name} in its __dict__ "
                    "(was nn.Module.__init__ called?)"
                )
            tabs[name] = tab
        for name, kind, category in (("_parameters", "tensors", PARAMETER), ("_buffers", "tensors", BUFFER)):
            for key, value in tabs[name].items():
                if value is None:
                    continue
                if not isinstance(key, str) or not isinstance(value, self.torch.Tensor):
                    raise TypeError(
                        f"module {type(mod).__name__} at '{path}' holds a {type(value).__name__} in "
                        f"{name}[{key!r}]: only {kind} and None are allowed there"
                    )
                if category == PARAMETER:
                    self.param(value, self.join(path, key), idx, PARAMETER)
                else:
                    self.tensor(value, self.join(path, key), idx, BUFFER)
        children = []
        for key, value in tabs["_modules"].items():
            if value is None:
                continue
            if not isinstance(key, str) or not isinstance(value, self.torch.nn.Module):
                raise TypeError(
                    f"module {type(mod).__name__} at '{path}' holds a {type(value).__name__} in "
                    f"_modules[{key!r}]: only modules and None are allowed there"
                )
            children.append(("module", value, self.join(path, key), idx, PARAMETER))
        self.stack.extend(reversed(children))

    # -- optimizers
    def optimizer(self, opt, prefix):
        if id(opt) in self.seen:
            return
        self.seen.add(id(opt))
        d = object.__getattribute__(opt, "__dict__")
        groups, state = d.get("param_groups"), d.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise TypeError(
                f"optimizer {type(opt).__name__} has no list param_groups and dict state in its __dict__ "
                "(was Optimizer.__init__ called?)"
            )
        for g, group in enumerate(groups):
            if not isinstance(group, dict):
                raise TypeError(f"optimizer {type(opt).__name__}: param_groups[{g}] is a {type(group).__name__}")
            params = group.get("params")
            if params is not None and not isinstance(params, (list, tuple)):
                raise TypeError(f"optimizer {type(opt).__name__}: param_groups[{g}]['params'] is not a list")
            for j, p in enumerate(params or ()):
                if not isinstance(p, self.torch.Tensor):
                    raise TypeError(
                        f"optimizer {type(opt).__name__}: param_groups[{g}]['params'][{j}] is a "
                        f"{type(p).__name__}, not a tensor"
                    )
                if id(p) not in self.params:
                    self.param(p, f"{prefix}.param_groups[{g}].params[{j}]", -1, PARAMETER)
        items = []
        for i, (key, value) in enumerate(state.items()):
            rec = self.params.get(id(key))
            if rec is not None:
                path, module = f"{prefix}.state[{rec[0]}]", rec[1]
            else:
                path, module = f"{prefix}.state[{i}]", -1
            items.append(("any", value, path, module, OPTIMIZER_STATE))
        self.stack.extend(reversed(items))
        items = []
        for g, group in enumerate(groups):
            for key, value in group.items():
                if isinstance(key, str) and key != "params":
                    items.append(("any", value, f"{prefix}.param_groups[{g}].{key}", -1, OPTIMIZER_STATE))
        self.stack.extend(reversed(items))

    # -- containers
    def any(self, obj, path, module, category):
        torch = self.torch
        if obj is None or type(obj) in (int, float, str, bytes, bool, complex) or isinstance(obj, type):
            return
        if isinstance(obj, torch.Tensor):
            if category in (TENSOR, PARAMETER):
                cat = PARAMETER if isinstance(obj, torch.nn.Parameter) else TENSOR
                self.param(obj, path, module, cat)
            else:
                self.tensor(obj, path, module, category)
            return
        if isinstance(obj, np.ndarray):
            self.array(obj, path, module)
            return
        if isinstance(obj, torch.nn.Module):
            self.stack.append(("module", obj, path, module, PARAMETER))
            return
        if isinstance(obj, torch.optim.Optimizer):
            self.optimizer(obj, path or "optimizer")
            return
        fields = None
        if not isinstance(obj, (dict, list, tuple, set, frozenset)):
            fields = getattr(type(obj), "__dataclass_fields__", None)
            if not isinstance(fields, dict):
                return
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        pairs = []
        if fields is not None:
            for name in fields:
                if isinstance(name, str):
                    pairs.append((getattr(obj, name), self.join(path, name)))
        elif isinstance(obj, dict):
            for i, (key, value) in enumerate(dict.items(obj)):
                if isinstance(key, str):
                    p = self.join(path, key)
                elif type(key) is int:
                    p = f"{path}[{key}]"
                else:
                    p = f"{path}[{i}]"
                pairs.append((value, p))
        elif isinstance(obj, (list, tuple)):
            names = None
            if isinstance(obj, tuple) and type(obj) is not tuple:
                names = getattr(type(obj), "_fields", None)
                if not isinstance(names, tuple):
                    names = None
            items = list.__iter__(obj) if isinstance(obj, list) else tuple.__iter__(obj)
            for i, value in enumerate(items):
                if names is not None and i < len(names) and isinstance(names[i], str):
                    p = self.join(path, names[i])
                else:
                    p = f"{path}[{i}]"
                pairs.append((value, p))
        else:
            for i, value in enumerate(iter(obj)):
                pairs.append((value, f"{path}{{{i}}}"))
        for value, p in reversed(pairs):
            self.stack.append(("any", value, p, module, category))

    def drain(self):
        while self.stack:
            kind, obj, path, module, category = self.stack.pop()
            if kind == "module":
                self.module(obj, path, module)
            else:
                self.any(obj, path, module, category)

    def result(self):
        from . import _C

        rows = np.array(self.rows, dtype=_C.row_dtype) if self.rows else np.zeros(0, dtype=_C.row_dtype)
        links = np.array([(m[2], m[3]) for m in self.modules], dtype=np.int32).reshape(-1, 2)
        modules = ([m[0] for m in self.modules], [m[1] for m in self.modules], links)
        return rows, self.paths, self.dtypes, self.devices, modules


def walk(obj, optimizer=None):
    """Same contract as memtorch._C._walk (see memtorch/_C.pyi)."""
    torch = _torch.torch()
    from .inspection import _ensure_setup

    _ensure_setup()
    w = _Walk(torch)
    with torch._C.DisableTorchFunctionSubclass():
        w.stack.append(("any", obj, "", -1, TENSOR))
        w.drain()
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, not {type(optimizer).__name__}")
            w.optimizer(optimizer, "optimizer")
            w.drain()
    return w.result()


def inspect(model, optimizer=None):
    """memtorch.inspect() over the pure-Python walker."""
    from .report import ModelMemory

    torch = _torch.torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"inspect() takes a torch.nn.Module, not {type(model).__name__}")
    return ModelMemory(*walk(model, optimizer), root_type=type(model).__name__)


def sizeof(obj):
    """memtorch.sizeof() over the pure-Python walker."""
    from .report import ModelMemory

    return ModelMemory(*walk(obj, None), root_type=type(obj).__name__)
