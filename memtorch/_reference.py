"""Pure-Python twin of the C walker (src/walker.c): the oracle the tests hold it against.

walk(obj, optimizer) returns exactly what memtorch._C._walk returns: (rows,
paths, dtypes, devices, modules), rows a NumPy array of memtorch._C.row_dtype.
Same order, same names, same keys; written for clarity, not speed.
"""

import dataclasses

import numpy as np

from . import _torch

__all__ = ["walk", "inspect", "sizeof"]

PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, TENSOR, ARRAY, ATTRIBUTE = range(7)
_INT64_MAX = 2**63 - 1
_NBYTES_OVERFLOW = -1
_MAX_FLATTEN_DEPTH = 32


def _empty_container(obj):
    """An empty dict, set, list or tuple of any subclass (no user __len__ runs)."""
    for base in (dict, set, frozenset, list, tuple):
        if isinstance(obj, base):
            return base.__len__(obj) == 0
    return False


class _Walk:
    def __init__(self, torch):
        # lazy: the pure-Python twin imports without _C (inspection loads it): it reaches it only to compare
        from .inspection import setup_info

        self.torch = torch
        info = setup_info(torch)  # cached: the same dict the C walker holds
        self.dtype_info = info["dtypes"]
        self.layouts = info["layouts"]
        self.per_channel = info["per_channel"]
        self.classify = info["classify"]
        self.dataclass_fields = info["dataclass_fields"]
        self.script_tables = info["script_tables"]
        self.iterables = info["iterables"]
        self.namespaces = info["namespaces"]
        self.masked_type = info["masked_type"]
        self.module_skip = info["module_skip"]
        self.dc_cache = {}
        self.type_cache = {}
        self.rows = []
        self.paths = []
        self.dtypes, self.dtype_index, self.itemsize, self.quantized, self.perbyte = [], {}, [], [], []
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
            name, itemsize, quantized, perbyte = self.dtype_info[dtype]
            i = self.dtype_index[dtype] = len(self.dtypes)
            self.dtypes.append(name)
            self.itemsize.append(itemsize)
            self.quantized.append(quantized)
            self.perbyte.append(perbyte)
        return i

    def numpy_dtype_slot(self, descr):
        i = self.dtype_index.get(descr)
        if i is None:
            i = self.dtype_index[descr] = len(self.dtypes)
            self.dtypes.append(str(descr))
            self.itemsize.append(0)
            self.quantized.append(False)
            self.perbyte.append(0)
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
        key = storage._cdata
        storage_nbytes = storage.nbytes()
        numel = t.numel()
        dt = self.torch_dtype_slot(t.dtype)
        dev = self.device_slot(t.device)
        data = 0
        if check_data or (storage_nbytes > 0 and self.devices[dev] != "meta"):
            try:
                data = storage.data_ptr()
            except RuntimeError:
                if check_data:
                    raise TypeError(
                        f"memtorch cannot measure the tensor subclass {type(t).__name__} at '{path}': its storage "
                        "holds no data (a wrapper subclass) and it does not implement __tensor_flatten__ to say "
                        "which tensors hold its data"
                    ) from None
        rg = bool(t.requires_grad)
        p = self.path_slot(path)
        if self.perbyte[dt]:
            shape = tuple(t.shape)
            last = shape[-1] if shape else numel
            k = self.perbyte[dt]
            nbytes = 0 if last <= 0 else (numel // last) * ((last + k - 1) // k)
        else:
            nbytes = numel * self.itemsize[dt]
            if nbytes > _INT64_MAX:
                nbytes = _NBYTES_OVERFLOW
        self.rows.append(
            (numel, nbytes, key, storage_nbytes, id(owner), data, p, module, dt, dev, category, rg)
        )
        if self.quantized[dt]:
            try:
                per_channel = t.qscheme() in self.per_channel
            except (RuntimeError, NotImplementedError):
                per_channel = False  # no quantizer torch can name: no scales
            if per_channel:
                for aux in ("q_per_channel_scales", "q_per_channel_zero_points"):
                    part = getattr(t, aux)()
                    self.keepalive.append(part)
                    self.dense(part, owner, self.join(path, aux), module, category, False)

    def tensor(self, t, path, module, category, depth=0, owner=None):
        if owner is None:
            owner = t
            self.keepalive.append(t)
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
            attrs = list(t.__tensor_flatten__()[0])
            for name in attrs:
                inner = getattr(t, name)
                if isinstance(inner, self.torch.Tensor):
                    self.keepalive.append(inner)
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
            self.params.setdefault(id(p), (self.paths[row[6]], row[7]))
        if type(p) is not self.torch.nn.Parameter:
            if not (p.requires_grad and p.is_leaf) and not p.retains_grad:
                return
        grad = p.grad
        if isinstance(grad, self.torch.Tensor):
            self.tensor(grad, self.join(path, "grad"), module, GRADIENT)

    def array(self, arr, path, module, category):
        self.keepalive.append(arr)
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        base = root.base
        storage_nbytes = root.nbytes
        if base is None:
            key, data = id(root), root.ctypes.data
        elif isinstance(base, self.torch.Tensor):
            st = base.untyped_storage()
            key, storage_nbytes, data = st._cdata, st.nbytes(), st.data_ptr()
        else:
            key, data = id(base), 0
            try:
                view = memoryview(base)
            except TypeError:
                pass
            else:
                if view.contiguous:
                    storage_nbytes = view.nbytes
                    data = np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0
                view.release()
        dt = self.numpy_dtype_slot(arr.dtype)
        dev = self.device_slot("cpu")
        p = self.path_slot(path)
        self.rows.append(
            (arr.size, arr.nbytes, key, storage_nbytes, id(arr), data, p, module, dt, dev, ARRAY, False)
        )
        if self.masked_type is not None and isinstance(arr, self.masked_type):
            mask = object.__getattribute__(arr, "__dict__").get("_mask")
            if isinstance(mask, np.ndarray):
                self.stack.append(("any", mask, self.join(path, "mask"), module, category))
        if arr.dtype == object:
            items = []
            for i, value in enumerate(arr.ravel(order="C").tolist()):
                if not self.atom(value):
                    items.append(("any", value, f"{path}[{i}]", module, category))
            self.stack.extend(reversed(items))

    @staticmethod
    def atom(obj):
        return obj is None or type(obj) in (int, float, str, bytes, bool, complex) or isinstance(obj, type)

    # -- modules
    def module(self, mod, path, parent):
        idx = len(self.modules)
        alias = self.module_ids.get(id(mod), -1)
        self.modules.append((path, type(mod).__name__, parent, alias))
        if alias >= 0:
            return
        self.module_ids[id(mod)] = idx
        self.keepalive.append(mod)
        d = object.__getattribute__(mod, "__dict__")
        tabs = None
        if not isinstance(d.get("_parameters"), dict):
            tabs = self.script_tables(mod)
            if tabs is not None:
                tabs = dict(zip(("_parameters", "_buffers", "_modules"), tabs))
        if tabs is None:
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
        # Plain attributes: containers pushed (walked after the children),
        # tensors walked now.
        pushed, tensors = [], []
        for key, value in d.items():
            if self.atom(value) or not isinstance(key, str) or _empty_container(value):
                continue
            if key in self.module_skip:
                continue
            if isinstance(value, (self.torch.nn.Module, self.torch.optim.Optimizer)):
                continue
            if isinstance(value, self.torch.Tensor):
                tensors.append((key, value))
            else:
                pushed.append(("any", value, self.join(path, key), idx, ATTRIBUTE))
        self.stack.extend(reversed(pushed))
        for key, value in tensors:
            self.tensor(value, self.join(path, key), idx, ATTRIBUTE)
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
        self.keepalive.append(opt)
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
    def dict_items(self, d, path):
        pairs = []
        for i, (key, value) in enumerate(dict.items(d)):
            if isinstance(key, str):
                p = self.join(path, key)
            elif type(key) is int:
                p = f"{path}[{key}]"
            else:
                p = f"{path}[{i}]"
                if not self.atom(key):
                    pairs.append((key, f"{p}.key"))
            pairs.append((value, p))
        return pairs

    def any(self, obj, path, module, category):
        torch = self.torch
        if self.atom(obj):
            return
        if isinstance(obj, torch.Tensor):
            if category in (TENSOR, PARAMETER):
                cat = PARAMETER if isinstance(obj, torch.nn.Parameter) else TENSOR
                self.param(obj, path, module, cat)
            else:
                self.tensor(obj, path, module, category)
            return
        if isinstance(obj, np.ndarray):
            self.array(obj, path, module, category)
            return
        if isinstance(obj, torch.nn.Module):
            if category != ATTRIBUTE:
                self.stack.append(("module", obj, path, module, PARAMETER))
            return
        if isinstance(obj, torch.optim.Optimizer):
            if category != ATTRIBUTE:
                self.optimizer(obj, path or "optimizer")
            return
        fields = iterable = namespace = None
        if not isinstance(obj, (dict, list, tuple, set, frozenset)):
            iterable = next((tp for tp in self.iterables if isinstance(obj, tp)), None)
            if iterable is None:
                namespace = next((tp for tp in self.namespaces if isinstance(obj, tp)), None)
            if iterable is None and namespace is None:
                tp = type(obj)
                if tp not in self.dc_cache:
                    self.dc_cache[tp] = self.dataclass_fields(tp)
                fields = self.dc_cache[tp]
                if fields is None:
                    return
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        self.keepalive.append(obj)
        pairs = []
        if fields is not None:
            for name in fields:
                if isinstance(name, str):
                    try:
                        value = getattr(obj, name)
                    except AttributeError:
                        continue
                    pairs.append((value, self.join(path, name)))
        elif isinstance(obj, dict):
            pairs = self.dict_items(obj, path)
        elif namespace is not None:
            pairs = self.dict_items(object.__getattribute__(obj, "__dict__"), path)
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
            if iterable is not None:
                it = iterable.__iter__(obj)
            else:
                it = (frozenset if isinstance(obj, frozenset) else set).__iter__(obj)
            for i, value in enumerate(it):
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
        # lazy: the pure-Python twin imports without _C (inspection loads it): it reaches it only to compare
        from . import _C

        rows = np.array(self.rows, dtype=_C.row_dtype) if self.rows else np.zeros(0, dtype=_C.row_dtype)
        links = np.array([(m[2], m[3]) for m in self.modules], dtype=np.int32).reshape(-1, 2)
        modules = ([m[0] for m in self.modules], [m[1] for m in self.modules], links)
        return rows, self.paths, self.dtypes, self.devices, modules


def walk(obj, optimizer=None):
    """Same contract as memtorch._C._walk (see memtorch/_C.pyi)."""
    torch = _torch.torch()
    # lazy: the pure-Python twin imports without _C (inspection loads it): it reaches it only to compare
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
    # lazy: the pure-Python twin imports without _C (inspection loads it): it reaches it only to compare
    from .report import ModelMemory

    torch = _torch.torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"inspect() takes a torch.nn.Module, not {type(model).__name__}")
    return ModelMemory(*walk(model, optimizer), root_type=type(model).__name__)


def sizeof(obj):
    """memtorch.sizeof() over the pure-Python walker."""
    # lazy: the pure-Python twin imports without _C (inspection loads it): it reaches it only to compare
    from .report import ModelMemory

    return ModelMemory(*walk(obj, None), root_type=type(obj).__name__)
