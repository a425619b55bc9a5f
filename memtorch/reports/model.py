"""ModelMemory: the figures of inspect()/sizeof(), built with NumPy from the walker's rows.

Every figure counts each storage once: the bytes memory really holds. A
storage is filed under the dtype, device and category of its first
occurrence in walk order (parameters before their gradients, a module's
parameters before its buffers and plain tensor attributes, the model before
the optimizer). Storages that share memory (torch.from_numpy, np.frombuffer
windows over one buffer) are one storage: the union of their bytes.

Sums are taken in Python ints: two meta storages of 2**62 bytes add up to
2**63, past int64.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterator

import numpy as np

from .. import units, words
from . import Record, Report, field, plain, render

__all__ = ["ModelMemory", "ModuleRow", "CATEGORIES", "MODULE_RULE"]

# Index = the category code in a row (src/rows.h MT_CAT_*); the words are memtorch.words'.
CATEGORIES = words.INSPECT_CATEGORIES

# nbytes of a row whose numel * element size does not fit in int64 (src/rows.h).
_NBYTES_OVERFLOW = -1

MODULE_RULE = words.MODULE_RULE

@dataclasses.dataclass(eq=False)
class ModuleRow(Record):
    """One module of the walk, in walk (pre-)order; bytes, each storage once.

    The rule (MODULE_RULE): a storage's bytes are charged to the first module
    that holds it, in registration (walk) order; its optimizer state goes with
    it. So the `own` column adds up, over all modules, to the bytes held by
    modules, and `subtree` is the sum of `own` over the module and its
    descendants. own = parameters + buffers + gradients + optimizer_state +
    attributes.

    A ModuleRow was a namedtuple: it still unpacks, indexes, compares and hashes as the tuple of its
    fields in order (``name, type, own, *rest = row``; ``row._asdict()``).
    """

    name: str  # the module's path in the model ("" for the model itself)
    type: str  # its class name
    own: int  # bytes charged to it (MODULE_RULE): parameters + buffers + gradients + optimizer_state + attributes
    subtree: int  # the sum of own over the module and its descendants
    parameters: int  # its parameters' bytes charged to it
    buffers: int  # its buffers' bytes charged to it
    gradients: int  # its parameters' gradients' bytes charged to it
    optimizer_state: int  # the optimizer state of its parameters charged to it, bytes
    alias_of: "str | None"  # the name it was first met under if met again (then its row holds 0 B), else None
    attributes: int  # plain tensor attributes, arrays and other tensors it holds, bytes charged to it
    shared: int  # bytes it holds that are charged to an earlier module (a tied weight)

    # the field names in order, as a namedtuple's _fields (set below the class)
    _fields: ClassVar[tuple[str, ...]] = ()

    def __iter__(self) -> Iterator[Any]:
        return iter([getattr(self, name) for name in self._fields])

    def __len__(self) -> int:
        return len(self._fields)

    def __getitem__(self, index: Any) -> Any:
        return tuple(self)[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ModuleRow, tuple)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def _asdict(self) -> dict[str, Any]:
        """{field: value} in field order (a namedtuple's _asdict)."""
        return dict(zip(self._fields, self))

    def _replace(self, **changes: Any) -> "ModuleRow":
        """A copy with the fields named changed (a namedtuple's _replace)."""
        return dataclasses.replace(self, **changes)


ModuleRow._fields = tuple(f.name for f in dataclasses.fields(ModuleRow))


def _unique_storage_bytes(keys: np.ndarray, nbytes: np.ndarray) -> int:
    """Sum of nbytes over unique keys, taking the largest figure per key (Python int)."""
    if len(keys) == 0:
        return 0
    order = np.lexsort((-nbytes, keys))
    k = keys[order]
    first = np.ones(len(k), dtype=bool)
    first[1:] = k[1:] != k[:-1]
    return sum(nbytes[order][first].tolist())


def _merge_shared_memory(rows: np.ndarray, devices: list[str]) -> np.ndarray:
    """Rows whose storages overlap in memory (same device, data != 0) get one
    key (the first row's) and the size of the merged range.

    Two storages with their own StorageImpl can hold one buffer
    (torch.from_numpy(a) and a; two np.frombuffer windows over one bytes
    object): keyed apart, they would be counted twice. Returns rows, a copy
    where anything changed.
    """
    if len(rows) == 0:
        return rows
    data = rows["data"]
    snb = rows["storage_nbytes"]
    sel = np.flatnonzero((data != 0) & (snb > 0))
    if len(sel) < 2:
        return rows
    start = data[sel]
    end = start + snb[sel].astype(np.uint64)
    # Device codes by name: an ndarray's "cpu" and torch.device("cpu") are
    # two entries of the devices table with one name.
    canon = np.array([devices.index(name) for name in devices], dtype=np.int64)
    dev = canon[rows["device"][sel]]
    order = np.lexsort((start, dev))
    s_o, e_o, d_o = start[order], end[order], dev[order]
    # A row opens a new range on a new device, or where it starts at or past
    # the running end of the ranges before it on its device.
    new = np.ones(len(order), dtype=bool)
    bounds = np.flatnonzero(np.r_[True, d_o[1:] != d_o[:-1], True])
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        run_end = np.maximum.accumulate(e_o[lo:hi])
        new[lo + 1 : hi] = s_o[lo + 1 : hi] >= run_end[:-1]
    if new.all():
        return rows
    group = np.cumsum(new) - 1
    ngroups = int(group[-1]) + 1
    gstart = s_o[new]
    gend = np.zeros(ngroups, dtype=np.uint64)
    np.maximum.at(gend, group, e_o)
    rows_sel = sel[order]
    gkey_row = np.full(ngroups, len(rows), dtype=np.int64)
    np.minimum.at(gkey_row, group, rows_sel)
    keys = rows["storage"][rows_sel]
    # Only ranges holding more than one storage key change anything.
    multi = np.zeros(ngroups, dtype=bool)
    first_key = rows["storage"][gkey_row]
    np.logical_or.at(multi, group, keys != first_key[group])
    if not multi.any():
        return rows
    out = rows.copy()
    m = multi[group]
    out["storage"][rows_sel[m]] = first_key[group[m]]
    out["storage_nbytes"][rows_sel[m]] = (gend - gstart)[group[m]].astype(np.int64)
    return out


@dataclasses.dataclass(eq=False)
class ModelMemory(Report):
    """What a model (and optimizer), or any nest of tensors, holds.

    Attributes (bytes, ints): total, logical, by_dtype, by_device,
    by_category, trainable, frozen; shared (groups of names sharing one
    storage); modules (list of ModuleRow); to_numpy() for the rows.

    Built by memtorch.inspection from the walker's tables: ``ModelMemory(rows, paths, dtypes,
    devices, walk, root_type)``. Its figures are properties derived from the rows, not fields: in
    to_dict() they follow the one field in the JSON (``root_type``; see _dict_more).
    """

    rows: np.ndarray = field(to_dict=False, repr=False)  # one per tensor met (src/rows.h), shared memory merged
    paths: list[str] = field(to_dict=False, repr=False)  # the names a row's path code indexes
    dtypes: list[str] = field(to_dict=False, repr=False)  # the dtype names a row's dtype code indexes
    devices: list[str] = field(to_dict=False, repr=False)  # the device names a row's device code indexes
    # the walk's modules: (paths, type names, links: [[parent index, alias-of index]] with -1 for none)
    walk: dataclasses.InitVar[Any]
    root_type: str = field("")  # the class name of what was walked
    _mod_paths: list[str] = field(init=False, repr=False)  # each module's path, in walk order
    _mod_types: list[str] = field(init=False, repr=False)  # each module's class name
    _links: np.ndarray = field(init=False, repr=False)  # each module's [parent index, alias-of index], -1 for none
    _first: np.ndarray = field(init=False, repr=False)  # the row of each storage's first occurrence, in walk order
    _first_size: np.ndarray = field(init=False, repr=False)  # each such storage's bytes (its largest figure)
    _module_table: "list[tuple[str, str, int, int]] | None" = field(None, init=False, repr=False)  # cache
    _modules: "list[ModuleRow] | None" = field(None, init=False, repr=False)  # cache of .modules
    _shared: "list[tuple[str, ...]] | None" = field(None, init=False, repr=False)  # cache of .shared

    # {dtype name: bytes per element}() for the rows whose bytes overflowed int64: set by
    # memtorch.inspection, the engine that builds every ModelMemory (this floor imports no engine)
    _dtype_sizes: ClassVar[Callable[[], dict[str, int]] | None] = None

    def __post_init__(self, walk: Any) -> None:
        self.paths = list(self.paths)
        self.dtypes = list(self.dtypes)
        self.devices = list(self.devices)
        self._mod_paths, self._mod_types, self._links = walk
        rows = self.rows = _merge_shared_memory(self.rows, self.devices)
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
    def module_table(self) -> list[tuple[str, str, int, int]]:
        """[(path, type name, parent index, alias-of index)] of the walk, -1 for none."""
        if self._module_table is None:
            self._module_table = list(
                zip(self._mod_paths, self._mod_types, self._links[:, 0].tolist(), self._links[:, 1].tolist())
            )
        return self._module_table

    # ------------------------------------------------------------ totals
    @property
    def total(self) -> int:
        """Bytes of the unique storages held."""
        return sum(self._first_size.tolist())

    @property
    def logical(self) -> int:
        """Sum of numel * element size over distinct tensors (views and tied
        weights once each); differs from total where views keep larger
        storages alive or expanded tensors share one."""
        r = self.rows
        if len(r) == 0:
            return 0
        pairs = np.stack([r["tensor"], r["storage"]], axis=1)
        _, idx = np.unique(pairs, axis=0, return_index=True)
        nbytes = r["nbytes"][idx].tolist()
        if _NBYTES_OVERFLOW in nbytes:
            # numel * element size past int64 (a huge expanded or meta tensor):
            # recomputed exactly in Python ints.
            sizes = type(self)._dtype_sizes()  # type: ignore[misc]  # set by memtorch.inspection
            numel, dt = r["numel"][idx].tolist(), r["dtype"][idx].tolist()
            for i, b in enumerate(nbytes):
                if b == _NBYTES_OVERFLOW:
                    nbytes[i] = numel[i] * sizes[self.dtypes[dt[i]]]
        return sum(nbytes)

    @property
    def count(self) -> int:
        """Number of tensor occurrences (rows)."""
        return len(self.rows)

    @property
    def unit(self) -> str:
        """The unit of every size figure: ``"bytes"`` (each an int; said in the JSON as ``unit``)."""
        return "bytes"

    @property
    def numel(self) -> int:
        """Elements of the parameters, each parameter once (a tied weight once; three
        parameters that are views of one storage three times), as a summary counts them."""
        r = self.rows[self.rows["category"] == 0]
        _, idx = np.unique(r["tensor"], return_index=True)
        return sum(r["numel"][idx].tolist())

    def _group(self, column: str, names: list[str] | tuple[str, ...]) -> dict[str, int]:
        """{name: bytes} of the unique storages, by the row column given (each storage once)."""
        r = self.rows[self._first]
        out: dict[str, int] = {}
        for code, size in zip(r[column].tolist(), self._first_size.tolist()):
            name = names[code]
            out[name] = out.get(name, 0) + size
        return out

    @property
    def by_dtype(self) -> dict[str, int]:
        """{dtype name: bytes}, e.g. {'float32': 407080}."""
        return self._group("dtype", self.dtypes)

    @property
    def by_device(self) -> dict[str, int]:
        """{device: bytes}, e.g. {'cpu': 407080, 'meta': 0}."""
        return self._group("device", self.devices)

    @property
    def by_category(self) -> dict[str, int]:
        """{category: bytes}: parameter, buffer, gradient, optimizer_state, tensor, array."""
        return self._group("category", CATEGORIES)

    def _param_storages(self, trainable: bool) -> int:
        r = self.rows
        sel = r["category"] == 0
        keys, rg, snb = r["storage"][sel], r["requires_grad"][sel], r["storage_nbytes"][sel]
        train_keys = np.unique(keys[rg])
        in_train = np.isin(keys, train_keys)
        pick = in_train if trainable else ~in_train
        return _unique_storage_bytes(keys[pick], snb[pick])

    @property
    def trainable(self) -> int:
        """Bytes of parameter storages some parameter of which requires grad."""
        return self._param_storages(True)

    @property
    def frozen(self) -> int:
        """Bytes of parameter storages no parameter of which requires grad."""
        return self._param_storages(False)

    # ------------------------------------------------------------ names
    @property
    def shared(self) -> list[tuple[str, ...]]:
        """Groups (tuples) of names whose tensors share one storage, each group
        once, in walk order: tied weights, views, a submodule under two names."""
        if self._shared is None:
            self._shared = self._compute_shared()
        return self._shared

    def _compute_shared(self) -> list[tuple[str, ...]]:
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
    def modules(self) -> list[ModuleRow]:
        """Per-module rows (ModuleRow), in walk order."""
        if self._modules is None:
            self._modules = self._compute_modules()
        return self._modules

    def _compute_modules(self) -> list[ModuleRow]:
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
        size = dict(zip(self.rows["storage"][self._first].tolist(), self._first_size.tolist()))
        r = self.rows
        sel = np.flatnonzero(r["module"] >= 0)
        # Python ints throughout: the sums may pass int64 (meta storages).
        own = [0] * n
        shared = [0] * n
        percat = [[0] * len(CATEGORIES) for _ in range(n)]
        charged = {}  # storage key -> module it is charged to
        held = set()  # (module, key) pairs met
        for m, key, cat in zip(
            r["module"][sel].tolist(), r["storage"][sel].tolist(), r["category"][sel].tolist()
        ):
            if (m, key) in held:
                continue
            held.add((m, key))
            b = size[key]
            if key not in charged:
                charged[key] = m
                own[m] += b
                percat[m][cat] += b
            elif charged[key] != m:
                shared[m] += b
        cum = [0]
        for v in own:
            cum.append(cum[-1] + v)
        out = []
        for i, (path, tname, _parent, alias) in enumerate(table):
            c = percat[i]
            out.append(
                ModuleRow(
                    path,
                    tname,
                    own[i],
                    cum[int(end[i])] - cum[i],
                    c[0],
                    c[1],
                    c[2],
                    c[3],
                    table[alias][0] if alias >= 0 else None,
                    own[i] - c[0] - c[1] - c[2] - c[3],
                    shared[i],
                )
            )
        return out

    @property
    def outside_modules(self) -> int:
        """Bytes of storages no module holds (tensors of an optimizer's param
        groups outside the model, a sizeof() container's tensors): total =
        sum of ModuleRow.own + outside_modules."""
        return self.total - sum(m.own for m in self.modules)

    # ------------------------------------------------------------ output
    def to_numpy(self) -> np.ndarray:
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

    def summary(self) -> dict[str, Any]:
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

    def __repr__(self) -> str:
        return f"<ModelMemory {self.root_type}: {units.format(self.total)} in {len(self._first)} storages>"

    def to_text(self, depth: int | None = ..., max_rows: int | None = ...) -> str:  # type: ignore[assignment]
        """The table print() shows: folded as memtorch.display.options says by default; depth=None,
        max_rows=None: every module (memtorch.display)."""
        return render("text", self, depth, max_rows)

    def to_html(self, depth: int | None = ..., max_rows: int | None = ...) -> str:  # type: ignore[assignment]
        """The notebook HTML, folded as to_text() (memtorch.display)."""
        return render("html", self, depth, max_rows)

    def to_dict(self, depth: int | None = None) -> dict[str, Any]:
        """The totals and every module row (to ``depth`` levels below the model; None: all) as plain
        JSON-ready values, bytes as ints: what ``memtorch inspect --format json`` prints.

        Record.to_dict() with the module rows cut at ``depth``: the one argument the base has not."""
        d = super().to_dict()
        if depth is not None:
            d["modules"] = [m for m in d["modules"] if m["depth"] <= depth]
        return d

    def _dict_more(self, d: dict[str, Any]) -> None:
        """The figures, after the one field in the JSON (root_type): they are derived from the rows."""
        d["unit"] = self.unit
        d.update(plain(self.summary()))
        d["numel"] = int(self.numel)
        d["shared"] = [list(g) for g in self.shared]
        d["modules"] = [
            m.to_dict() | {"depth": 0 if m.name == "" else m.name.count(".") + 1} for m in self.modules
        ]

    def plot(self, kind: str = "modules", **kw: Any) -> Any:
        """A matplotlib Figure: kind='modules' (per-module bars) or 'categories' (memtorch.plot)."""
        return render("plot", self, kind=kind, **kw)
