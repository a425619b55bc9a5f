"""ModelMemory: the figures of inspect()/sizeof(), built with NumPy from the walker's rows.

Every figure counts each storage once: the bytes memory really holds. A
storage is filed under the dtype, device and category of its first
occurrence in walk order (parameters before their gradients, a module's
parameters before its buffers, the model before the optimizer).
"""

from collections import namedtuple

import numpy as np

from . import units

__all__ = ["ModelMemory", "ModuleRow", "CATEGORIES"]

# Index = the category code in a row (src/rows.h MT_CAT_*).
CATEGORIES = ("parameter", "buffer", "gradient", "optimizer_state", "tensor", "array")

ModuleRow = namedtuple(
    "ModuleRow",
    "name type own subtree parameters buffers gradients optimizer_state alias_of",
)
ModuleRow.__doc__ = """One module of the walk, in walk (pre-)order; bytes, each storage once.

own: storages this module's own rows hold (its parameters, buffers, their
gradients and optimizer state); subtree: storages held by it and its
descendants; the four category columns split `own` by first occurrence.
alias_of: the name this module was first met under, if it is met again
(one submodule registered under two names), else None.
"""


def _unique_storage_bytes(keys, nbytes):
    """Sum of nbytes over unique keys, taking the largest figure per key."""
    if len(keys) == 0:
        return 0
    order = np.lexsort((-nbytes, keys))
    k = keys[order]
    first = np.ones(len(k), dtype=bool)
    first[1:] = k[1:] != k[:-1]
    return int(nbytes[order][first].sum())


class ModelMemory:
    """What a model (and optimizer), or any nest of tensors, holds.

    Attributes (bytes, ints): total, logical, by_dtype, by_device,
    by_category, trainable, frozen; shared (groups of names sharing one
    storage); modules (list of ModuleRow); to_numpy() for the rows.
    """

    def __init__(self, rows, paths, dtypes, devices, modules, root_type=""):
        self.rows = rows
        self.paths = list(paths)
        self.dtypes = list(dtypes)
        self.devices = list(devices)
        self._mod_paths, self._mod_types, self._links = modules
        self._module_table = None
        self.root_type = root_type
        self._modules = None
        self._shared = None
        keys = rows["storage"]
        snb = rows["storage_nbytes"]
        if len(rows):
            # First occurrence of each storage (walk order) -> its attribution;
            # its size: the largest figure among its rows (an ndarray over a
            # foreign buffer only knows the extent it sees).
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            size = np.zeros(len(first), dtype=np.int64)
            np.maximum.at(size, inverse.ravel(), snb)
            order = np.argsort(first, kind="stable")
            self._first = first[order]
            self._first_size = size[order]
        else:
            self._first = np.zeros(0, dtype=np.intp)
            self._first_size = np.zeros(0, dtype=np.int64)

    @property
    def module_table(self):
        """[(path, type name, parent index, alias-of index)] of the walk, -1 for none."""
        if self._module_table is None:
            self._module_table = list(
                zip(self._mod_paths, self._mod_types, self._links[:, 0].tolist(), self._links[:, 1].tolist())
            )
        return self._module_table

    # ------------------------------------------------------------ totals
    @property
    def total(self):
        """Bytes of the unique storages held."""
        return int(self._first_size.sum())

    @property
    def logical(self):
        """Sum of numel * element size over distinct tensors (views and tied
        weights once each); differs from total where views keep larger
        storages alive or expanded tensors share one."""
        r = self.rows
        if len(r) == 0:
            return 0
        pairs = np.stack([r["tensor"], r["storage"]], axis=1)
        _, idx = np.unique(pairs, axis=0, return_index=True)
        return int(r["nbytes"][idx].sum())

    @property
    def count(self):
        """Number of tensor occurrences (rows)."""
        return len(self.rows)

    @property
    def numel(self):
        """Elements of parameter storages, each storage once (as 'parameters' in a summary)."""
        r = self.rows[self._first]
        return int(r["numel"][r["category"] == 0].sum())

    def _group(self, field, names):
        r = self.rows[self._first]
        out = {}
        for code, size in zip(r[field].tolist(), self._first_size.tolist()):
            name = names[code]
            out[name] = out.get(name, 0) + size
        return out

    @property
    def by_dtype(self):
        """{dtype name: bytes}, e.g. {'float32': 407080}."""
        return self._group("dtype", self.dtypes)

    @property
    def by_device(self):
        """{device: bytes}, e.g. {'cpu': 407080, 'meta': 0}."""
        return self._group("device", self.devices)

    @property
    def by_category(self):
        """{category: bytes}: parameter, buffer, gradient, optimizer_state, tensor, array."""
        return self._group("category", CATEGORIES)

    def _param_storages(self, trainable):
        r = self.rows
        sel = r["category"] == 0
        keys, rg, snb = r["storage"][sel], r["requires_grad"][sel], r["storage_nbytes"][sel]
        train_keys = np.unique(keys[rg])
        in_train = np.isin(keys, train_keys)
        pick = in_train if trainable else ~in_train
        return _unique_storage_bytes(keys[pick], snb[pick])

    @property
    def trainable(self):
        """Bytes of parameter storages some parameter of which requires grad."""
        return self._param_storages(True)

    @property
    def frozen(self):
        """Bytes of parameter storages no parameter of which requires grad."""
        return self._param_storages(False)

    # ------------------------------------------------------------ names
    @property
    def shared(self):
        """Groups (tuples) of names whose tensors share one storage, each group
        once, in walk order: tied weights, views, a submodule under two names."""
        if self._shared is None:
            self._shared = self._compute_shared()
        return self._shared

    def _compute_shared(self):
        names_by_key = {}
        for key, p in zip(self.rows["storage"].tolist(), self.rows["path"].tolist()):
            names = names_by_key.setdefault(key, [])
            name = self.paths[p]
            if name not in names:
                names.append(name)
        # A module met under a second name shares all its tensors.
        for path, _type, _parent, alias in self.module_table:
            if alias < 0:
                continue
            orig = self.module_table[alias][0]
            for names in names_by_key.values():
                for name in list(names):
                    if orig == "":
                        extra = f"{path}.{name}" if path else name
                    elif name.startswith(orig + "."):
                        extra = path + name[len(orig):]
                    else:
                        continue
                    if extra not in names:
                        names.append(extra)
        return [tuple(v) for v in names_by_key.values() if len(v) > 1]

    # ------------------------------------------------------------ modules
    @property
    def modules(self):
        """Per-module rows (ModuleRow), in walk order."""
        if self._modules is None:
            self._modules = self._compute_modules()
        return self._modules

    def _compute_modules(self):
        table = self.module_table
        n = len(table)
        if n == 0:
            return []
        parent = self._links[:, 0].astype(np.int64)
        end = np.arange(1, n + 1)
        for i in range(n - 1, -1, -1):
            p = parent[i]
            if p >= 0 and end[i] > end[p]:
                end[p] = end[i]
        r = self.rows
        sel = r["module"] >= 0
        mod, key, cat, snb = r["module"][sel], r["storage"][sel], r["category"][sel], r["storage_nbytes"][sel]
        own = np.zeros(n, dtype=np.int64)
        percat = np.zeros((n, len(CATEGORIES)), dtype=np.int64)
        subtree = np.zeros(n, dtype=np.int64)
        if len(mod):
            # Unique (module, storage) pairs, first occurrence -> category.
            pairs = np.stack([mod.astype(np.int64), key.view(np.int64)], axis=1)
            _, idx = np.unique(pairs, axis=0, return_index=True)
            idx.sort()
            size = dict(zip(self.rows["storage"][self._first].tolist(), self._first_size.tolist()))
            umod, ukey, ucat = mod[idx], key[idx], cat[idx]
            usize = np.array([size[k] for k in ukey.tolist()], dtype=np.int64)
            np.add.at(own, umod, usize)
            np.add.at(percat, (umod, ucat), usize)
            # Storages held by one module only: subtree sums over the
            # contiguous pre-order range [i, end[i]).
            keys_u, counts = np.unique(ukey, return_counts=True)
            multi = set(keys_u[counts > 1].tolist())
            single = ~np.isin(ukey, np.array(sorted(multi), dtype=ukey.dtype)) if multi else np.ones(len(ukey), bool)
            excl = np.zeros(n + 1, dtype=np.int64)
            np.add.at(excl, umod[single] + 1, usize[single])
            cum = np.cumsum(excl)
            subtree = cum[end] - cum[np.arange(n)]
            # Storages held by several modules: once in each ancestor of any.
            if multi:
                holders = {}
                for m, k in zip(umod[~single].tolist(), ukey[~single].tolist()):
                    holders.setdefault(k, []).append(m)
                for k, ms in holders.items():
                    anc = set()
                    for m in ms:
                        while m >= 0 and m not in anc:
                            anc.add(m)
                            m = int(parent[m])
                    for a in anc:
                        subtree[a] += size[k]
        out = []
        for i, (path, tname, _parent, alias) in enumerate(table):
            out.append(
                ModuleRow(
                    path,
                    tname,
                    int(own[i]),
                    int(subtree[i]),
                    int(percat[i, 0]),
                    int(percat[i, 1]),
                    int(percat[i, 2]),
                    int(percat[i, 3]),
                    table[alias][0] if alias >= 0 else None,
                )
            )
        return out

    # ------------------------------------------------------------ output
    def to_numpy(self):
        """The rows as a structured array with names spelled out: path,
        category, dtype, device (str), numel, nbytes (logical), storage (key),
        storage_nbytes, requires_grad, module (index into .modules, -1 none)."""
        r = self.rows
        n = len(r)

        def strings(table, idx):
            arr = np.array(table if table else [""], dtype=str)
            return arr[idx] if n else np.zeros(0, dtype=arr.dtype)

        paths = strings(self.paths, r["path"])
        cats = strings(list(CATEGORIES), r["category"])
        dts = strings(self.dtypes, r["dtype"])
        devs = strings(self.devices, r["device"])
        out = np.zeros(
            n,
            dtype=[
                ("path", paths.dtype),
                ("category", cats.dtype),
                ("dtype", dts.dtype),
                ("device", devs.dtype),
                ("numel", "i8"),
                ("nbytes", "i8"),
                ("storage", "u8"),
                ("storage_nbytes", "i8"),
                ("requires_grad", "?"),
                ("module", "i4"),
            ],
        )
        out["path"], out["category"], out["dtype"], out["device"] = paths, cats, dts, devs
        for f in ("numel", "nbytes", "storage", "storage_nbytes", "requires_grad", "module"):
            out[f] = r[f]
        return out

    def summary(self):
        """Totals as a dict of plain ints and dicts (bytes)."""
        return {
            "total": self.total,
            "logical": self.logical,
            "by_category": self.by_category,
            "by_dtype": self.by_dtype,
            "by_device": self.by_device,
            "trainable": self.trainable,
            "frozen": self.frozen,
        }

    def __repr__(self):
        return f"<ModelMemory {self.root_type}: {units.format(self.total)} in {len(self._first)} storages>"

    def __str__(self):
        from .display import model_memory_text

        return model_memory_text(self)

    def _repr_html_(self):
        from .display import model_memory_html

        return model_memory_html(self)

    def to_text(self, depth=None, max_rows=None):
        """The table of str(), every module by default; depth / max_rows fold it (memtorch.display)."""
        from . import display

        return display.model_memory_text(self, depth, max_rows)

    def to_html(self, depth=None, max_rows=None):
        """The notebook HTML, every module by default; depth / max_rows fold it (memtorch.display)."""
        from . import display

        return display.model_memory_html(self, depth, max_rows)

    def plot(self, kind="modules", **kw):
        """A matplotlib Figure: kind='modules' (per-module bars) or 'categories' (memtorch.plot)."""
        from . import plot

        return plot.model_memory(self, kind=kind, **kw)
