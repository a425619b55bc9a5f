"""The base of memtorch's result types: each field declared once, to_dict() derived from the fields.

Every result is a dataclass subclass of ``Record`` (a row: a phase, a module, a tensor, an owner at
the peak) or of ``Report`` (a result a user prints: what track(), estimate(), plan(), advise() return).
``to_dict()`` walks the declared fields in order, so a field added to a type is in its JSON without
another line; a field's metadata (made by ``field()`` below) renames its key, converts its value,
leaves it out when None, or leaves it out of the JSON. A leading underscore keeps a field out unless
it names a key (then the public attribute of that name is read: a property over the private field).
Every key of a report's JSON names an attribute of the report (a field, or a property of that name:
a reader finds each figure under the same name on the object; tests/test_reports.py holds it).
``Report`` adds ``__str__`` = ``to_text()`` and ``_repr_html_`` = ``to_html()``: the text and HTML
are made by memtorch.display and the figures by memtorch.plot, never here. Those renderers sit a
floor above the result types (tests/test_imports.py), so a report reaches them through ``render()``:
a registry they fill when imported (``renders``), keyed by the result type's class name.

This module imports neither torch nor NumPy (``import memtorch`` stays torch-free).
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
from typing import Any, Callable, ClassVar

from ..budget import assert_budget

__all__ = ["Record", "Report", "field", "plain", "render", "renders"]

# (what, class name) -> function(obj, *args, **kw); what is "text", "html", "plot" or a renderer's
# own part ("lines"), or "gather" (an engine's action kept on a report: TrackReport.gather()). Filled
# by memtorch.display ("plot": memtorch.plot; "gather": memtorch.distributed) at their import.
_RENDERERS = {}
# the module that registers each `what`; memtorch.display for the rest
_HOMES = {"plot": "memtorch.plot", "gather": "memtorch.distributed"}


def renders(what, *class_names):
    """Register the decorated function as the renderer of `what` for the classes named (a renderer
    module's registration: ``@renders("text", "TrackReport")``)."""

    def register(fn):
        for name in class_names:
            _RENDERERS[(what, name)] = fn
        return fn

    return register


def render(what, obj, *args, **kw):
    """obj rendered as `what` by the function registered for its class (or the nearest base)."""
    home = _HOMES.get(what, "memtorch.display")
    # The one reach up the import floors: the renderer (or engine) module is loaded by name, the first
    # time a report is rendered, and registers its functions here (tests/test_imports.py says why).
    importlib.import_module(home)
    for cls in type(obj).__mro__:
        fn = _RENDERERS.get((what, cls.__name__))
        if fn is not None:
            return fn(obj, *args, **kw)
    raise NotImplementedError(f"{home} renders no {what} for {type(obj).__name__}")


def field(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, key=None, json=None,
          omit_none=False, to_dict=True, init=True, repr=True):  # fmt: skip
    """A dataclasses.field with the metadata to_dict() reads: ``key`` (the JSON key, default the
    field's name), ``json`` (a function of the value giving its JSON, default ``plain``),
    ``omit_none`` (no key when the value is None), ``to_dict=False`` (never in the JSON)."""
    meta = {"key": key, "json": json, "omit_none": omit_none, "dict": to_dict}
    return dataclasses.field(default=default, default_factory=default_factory, init=init, repr=repr, metadata=meta)


def plain(value):
    """value as JSON-ready Python: records as their to_dict(), namedtuples as dicts, other tuples as
    lists, NumPy scalars and arrays as ints, floats and lists (no NumPy import: numbers and tolist())."""
    if isinstance(value, Record):
        return value.to_dict()
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a namedtuple: by its field names
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) or type(value).__module__ == "numpy" and isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":  # an ndarray, or a NumPy bool
        return value.tolist()
    return value


@dataclasses.dataclass(eq=False)
class Record:
    """A dataclass whose to_dict() is derived from its declared fields (see the module docstring).
    eq=False: records compare and hash by identity, as they did before they were dataclasses."""

    def to_dict(self):
        """Every declared figure as plain JSON-serialisable values (bytes as ints)."""
        d = {}
        for f in dataclasses.fields(self):
            meta = f.metadata
            if not meta.get("dict", True) or (f.name.startswith("_") and not meta.get("key")):
                continue
            key = meta.get("key") or f.name
            value = getattr(self, key if f.name.startswith("_") else f.name)
            if value is None and meta.get("omit_none"):
                continue
            convert = meta.get("json")
            d[key] = plain(value) if convert is None else convert(value)
        self._dict_more(d)
        return d

    def _dict_more(self, d):
        """Keys that are no field of their own (a derived figure, a key's older spelling): none here."""


@dataclasses.dataclass(eq=False)
class Report(Record):
    """A result a user prints: print() shows to_text(), a notebook to_html() (both memtorch.display).

    check() judges the figures a budget applies to (``_budgets``: TrackReport, MultiRankReport and
    Estimate have them) through memtorch.budget.assert_budget, the one verdict.
    """

    # the figures check() takes a budget on ("peak", "delta", "leak"); () for a report with none
    _budgets: ClassVar[tuple[str, ...]] = ()

    def check(
        self, peak: int | str | None = None, delta: int | str | None = None, leak: int | str | None = None
    ) -> None:
        """Raise memtorch.BudgetExceeded if a figure exceeds its budget (bytes, or sizes as in
        memtorch.units.parse), memtorch.BudgetInconclusive (a BudgetExceeded) if a figure is only
        bounded and its limit lies between the bounds: ``peak`` is compared with peak_above_start,
        ``delta`` with delta, ``leak`` with leak.per_step (a multi-rank report: the highest rank's).
        TypeError for a report without that figure."""
        name = type(self).__name__
        if not self._budgets:
            raise TypeError(
                f"{name} has no figure a budget applies to: check() a track() block's report (t.report), "
                f"an Estimate or a MultiRankReport, e.g. memtorch.estimate(model, batch).check(peak='8 GiB')"
            )
        given = {"peak": peak, "delta": delta, "leak": leak}
        for figure, limit in given.items():
            if limit is not None and figure not in self._budgets:
                raise TypeError(
                    f"{name}.check() takes no {figure} budget; its budgets: {', '.join(self._budgets)}"
                )
        assert_budget(self, peak=peak, delta=delta, leak=leak)

    def to_text(self):
        """The report as print() shows it (memtorch.display)."""
        return render("text", self)

    def to_html(self):
        """The same content as HTML: the notebook's view (memtorch.display)."""
        return render("html", self)

    def plot(self, *args, **kw):
        """A matplotlib Figure of the report (memtorch.plot; the ``plot`` extra): NotImplementedError
        for a kind that has none."""
        return render("plot", self, *args, **kw)

    def __str__(self):
        return self.to_text()

    def _repr_html_(self):
        return self.to_html()
