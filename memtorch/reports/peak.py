"""Who held the bytes at a block's peak (memtorch.peak): the owners, the storages, grouped by kind and
by module. Data only: the replay of the event log that finds them stays in memtorch.peak."""

import dataclasses
import os

from .. import units, words
from . import Record, Report, field, render

__all__ = ["AtPeak", "Owner", "StorageAtPeak", "where"]


def _sites_json(sites):
    return [{"file": f, "line": ln, "function": fn, "bytes": b, "count": c} for f, ln, fn, b, c in sites]


@dataclasses.dataclass(eq=False)
class Owner(Record):
    """One owner at the peak: a tensor, or a group of storages of one kind (largest first in AtPeak)."""

    name: str  # the tensor's name ("0.weight.grad") or the group's ("optimizer temporaries, not its state")
    kind: str  # parameter, gradient, optimizer state, buffer, input, activation, temporary, other
    phase: "str | None" = None  # when it was allocated: forward, backward, optimizer, or None
    nbytes: int = field(0, key="bytes")  # bytes of its storages
    count: int = 0  # storages
    # the dotted name of the module whose parameter, buffer, gradient, optimizer state or
    # activations these are ("" the root); None: no module's (inputs, temporaries, other)
    module: "str | None" = None
    # the "other" owner of a block's own allocations only, else None: the Python source lines that
    # allocated its storages, largest first, as (file, line, function, bytes, count) (an operator that
    # is not a call, ``x * 2``, is named at the next call of its function)
    sites: "list | None" = field(None, omit_none=True, json=_sites_json)
    sites_note: "str | None" = None  # what has no line and why, or None (in the JSON with sites only)

    def _dict_more(self, d):
        if self.sites is None:
            del d["sites_note"]

    def describe(self):
        n = f", {self.count} storages" if self.count > 1 else ""
        return f"{units.format(self.nbytes)}  {self.name} ({self.kind}{n})"

    def site_lines(self, limit=3):
        """The largest ``limit`` sites as text (``1.5 MiB  train.py:42 in make_batch``), then the note."""
        out = [f"{units.format(b)}  {where(f, ln, fn)}" + (f" ({c} storages)" if c > 1 else "")
               for f, ln, fn, b, c in (self.sites or ())[:limit]]  # fmt: skip
        rest = (self.sites or ())[limit:]
        if rest:
            out.append(f"... and {len(rest)} more line(s), {units.format(sum(s[3] for s in rest))}")
        if self.sites_note:
            out.append(self.sites_note)
        return out

    def __repr__(self):
        return f"Owner({self.name!r}, {self.kind}, {self.nbytes} B)"


@dataclasses.dataclass(eq=False)
class StorageAtPeak(Record):
    """One storage live at the peak (for ``largest=``)."""

    name: str  # the name of the tensor that names it, or its owner's
    kind: str  # as Owner.kind
    phase: "str | None"  # as Owner.phase
    nbytes: int = field(key="bytes")  # its bytes
    shape: "tuple | None" = None  # the sizes of the tensor that names it, when a tensor does
    dtype: "str | None" = None  # that tensor's dtype ("float32"), when a tensor does
    has_graph: bool = field(False, init=False, to_dict=False)  # (not in the JSON: always False here)

    def __post_init__(self):
        self.shape = None if self.shape is None else tuple(self.shape)
        self.dtype = None if self.dtype is None else str(self.dtype).replace("torch.", "")

    def describe(self):
        what = ""
        if self.shape is not None:
            shape = "x".join(str(s) for s in self.shape) or "scalar"
            what = f" {self.dtype}[{shape}]"
        return f"{self.name}:{what} {units.format(self.nbytes)} ({self.kind})"

    def __repr__(self):
        return f"StorageAtPeak({self.describe()})"


class _Kinds(dict):
    """by_kind()'s dict: keys spelled as by_category's (``optimizer_state``); a lookup with the
    printed spelling (``optimizer state``), the keys' first spelling, is answered too."""

    def __missing__(self, name):
        k = words.key(name) if isinstance(name, str) else name
        if k != name and k in self:
            return self[k]
        raise KeyError(name)

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name):
        return dict.__contains__(self, name) or (isinstance(name, str) and dict.__contains__(self, words.key(name)))


@dataclasses.dataclass(eq=False)
class AtPeak(Report):
    """The live bytes at a block's peak, grouped by owner (largest first)."""

    peak: int  # absolute bytes at the peak (= the sum of the owners' bytes)
    owners: list  # [Owner], largest first
    _storages: list = field(repr=False)  # (name, kind, phase, nbytes, shape, dtype) tuples until first read (.storages)
    exact: bool  # False when the event log lost events or the replay disagrees with the counters
    notes: list  # sentences saying what is not exact and why
    # {module's dotted name: its type's name} of the block's modules (the tables print "0 (Linear)")
    module_types: dict = field(default_factory=dict, repr=False, to_dict=False)

    def __post_init__(self):
        self.owners = sorted(self.owners, key=lambda o: (-o.nbytes, o.name))
        self.notes = list(self.notes)

    def _dict_more(self, d):
        d["by_kind"] = self.by_kind()

    @property
    def storages(self):
        """[StorageAtPeak] of every storage live at the peak, largest first."""
        if self._storages and not isinstance(self._storages[0], StorageAtPeak):
            made = [StorageAtPeak(*s) for s in self._storages]
            self._storages = sorted(made, key=lambda s: (-s.nbytes, s.name))
        return self._storages

    @property
    def total(self):
        return sum(o.nbytes for o in self.owners)

    def by_kind(self):
        """{kind: bytes} at the peak, largest first, keyed as by_category is (``optimizer_state``);
        the printed spelling (``optimizer state``) is read too."""
        out = {}
        for o in self.owners:
            k = words.key(o.kind)
            out[k] = out.get(k, 0) + o.nbytes
        return _Kinds(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def __getitem__(self, name):
        for o in self.owners:
            if o.name == name:
                return o.nbytes
        raise KeyError(name)

    def __contains__(self, name):
        return any(o.name == name for o in self.owners)

    def top(self, n=5):
        return self.owners[:n]

    def by_module(self):
        """{module's dotted name: bytes} at the peak, largest first: each module's own parameters,
        buffers, their gradients and optimizer state, and its activations ("" is the root's own);
        bytes of no module (inputs, temporaries, other) are not in it."""
        out = {}
        for o in self.owners:
            if o.module is not None:
                out[o.module] = out.get(o.module, 0) + o.nbytes
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def kind_lines(self):
        """The summary that answers first: bytes per kind (parameter, gradient, ...), largest first."""
        return render("kind_lines", self)

    def lines(self, limit=None):
        """Text (memtorch.display.at_peak_lines): per kind, then per module, then per tensor (the first
        ``limit`` of each, the rest summed in one line), then the notes."""
        return render("lines", self, limit)

    def to_text(self, limit=30):
        return "\n".join(self.lines(limit))

    def to_html(self, limit=30):
        return render("html", self, limit)

    def __repr__(self):
        return f"AtPeak(peak={self.peak}, owners={len(self.owners)}, exact={self.exact})"


def where(file, line, function):
    """``train.py:42 in make_batch``: the file relative to the current directory when
    under it; "(no Python line)" when none was running or the table of functions was full."""
    if file is None:
        return "(no Python line)"
    try:
        rel = os.path.relpath(file)
        if not rel.startswith(".."):
            file = rel
    except ValueError:  # another drive (Windows)
        pass
    return f"{file}:{line} in {function}"
