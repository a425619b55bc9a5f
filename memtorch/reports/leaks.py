"""The result of a leak check (memtorch.leaks): growth per step judged over the run, and the groups of
tensors kept. Data only: the scans that find the tensors stay in memtorch.leaks."""

from __future__ import annotations

import dataclasses
import weakref
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from .. import units
from . import Record, Report, field, plain, render

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch

__all__ = ["LeakReport", "SurvivorGroup", "TensorInfo", "judge", "storage_nbytes"]


def storage_nbytes(t: Any) -> int:
    """Bytes of the storage a tensor keeps alive; its logical bytes (numel * element size) when it
    has no single storage (sparse); 0 when even those cannot be read. The one definition (memtorch.leaks
    re-exports it)."""
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        try:
            return int(t.numel() * t.element_size())
        except Exception:
            return 0


@dataclasses.dataclass(eq=False, init=False)
class TensorInfo(Record):
    """A live tensor described without keeping it alive (``ref`` is a weakref): ``TensorInfo(tensor,
    step=None, name=None, graph_bytes=None)`` reads its figures from the tensor (so __init__ is written
    here, not generated: the tensor is no field). A leak's survivors and TrackReport.largest."""

    name: "str | None"  # who holds it (an attribute path), or None
    shape: tuple  # its sizes (("nested",) for a nested tensor)
    dtype: str  # "float32", ...
    device: str  # "cpu", "cuda:0", ...
    nbytes: int = field(key="bytes")  # its storage's bytes
    has_graph: bool = field(json=bool)  # it holds an autograd graph (grad_fn is set)
    graph_bytes: "int | None" = None  # bytes of the saved tensors its graph keeps, or None (not measured)
    step: "int | None" = None  # the step that created it, or None
    ref: "weakref.ref[Any] | None" = field(None, to_dict=False, repr=False)  # a weakref to it (None: not possible)

    def __init__(
        self, tensor: "torch.Tensor", step: "int | None" = None, name: "str | None" = None,
        graph_bytes: "int | None" = None,
    ) -> None:  # fmt: skip
        try:
            self.shape = tuple(tensor.shape)
        except RuntimeError:  # a nested tensor has no single shape
            self.shape = ("nested",)
        self.dtype = str(tensor.dtype).replace("torch.", "")
        self.device = str(tensor.device)
        self.nbytes = storage_nbytes(tensor)
        self.has_graph = tensor.grad_fn is not None
        self.graph_bytes = graph_bytes
        self.step = step
        self.name = name
        try:
            self.ref = weakref.ref(tensor)
        except TypeError:
            self.ref = None

    def describe(self) -> str:
        """One line: its name, dtype[shape], bytes, and the graph it holds."""
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        text = f"{self.name or 'tensor'}: {self.dtype}[{shape}] {units.format(self.nbytes)}"
        if self.has_graph:
            text += " holds an autograd graph"
            if self.graph_bytes:
                text += f" keeping {units.format(self.graph_bytes)} of saved tensors"
        if self.step is not None:
            text += f" (created in step {self.step})"
        return text

    def __repr__(self) -> str:
        return f"TensorInfo({self.describe()})"


def judge(growth: list[int], warmup: int) -> tuple[bool, Fraction | None, dict[str, Any]]:
    """(leaking, per_step, evidence dict) from per-step growth (bytes), warm-up steps skipped."""
    judged = list(growth[warmup:])
    if not judged:
        return False, None, {}
    net = sum(judged)
    grew = [warmup + i + 1 for i, g in enumerate(judged) if g > 0]
    n = len(judged)
    leaking = net > 0 and (len(grew) >= 2 or len(grew) == n)
    # one rate: the net growth over the judged steps (the slope from the first judged boundary to the last)
    evidence = {
        "judged_steps": n, "steps_that_grew": grew, "net_growth": int(net), "largest_step_growth": int(max(judged)),
    }  # fmt: skip
    # exact: 7,996 B over 2,000 steps is 3.998 B a step, never floored to 3 (a budget of 3 B must fail)
    return leaking, Fraction(int(net), n), evidence


@dataclasses.dataclass(eq=False)
class SurvivorGroup(Record):
    """Tensors of one kind kept alive across steps: count, bytes, description, holder."""

    dtype: str  # their dtype ("float32")
    shape: "str | None"  # their sizes as text, or None (unknown)
    has_graph: bool  # they hold autograd graphs
    holder: "str | None"  # the container that holds them (found through gc's referrers), or None
    expected: "str | None"  # why they are expected to live (an optimizer's state, ...), or None
    count: int = field(0, init=False)  # tensors in the group
    nbytes: int = field(0, init=False, key="bytes")  # their bytes
    graph_bytes: int = field(0, init=False)  # bytes of the saved tensors their graphs keep
    examples: list = field(init=False, default_factory=list, to_dict=False, repr=False)  # weakrefs to a few members

    def describe(self, steps_after: int | None = None) -> str:
        shape = self.shape if self.shape is not None else "?"
        what = f"{self.count} tensor{'s' if self.count != 1 else ''} {self.dtype}[{shape}]"
        text = f"{what}, {units.format(self.nbytes)}"
        if self.has_graph:
            text += " holding autograd graphs"
            if self.graph_bytes:
                text += f" (keeping {units.format(self.graph_bytes)} of saved tensors)"
        if steps_after and self.count > 1 and abs(self.count - steps_after) <= 1:
            text += ", one per step"
        if self.holder:
            text += f", {self.holder}"
        if self.expected:
            text += f" (expected to live: {self.expected})"
        return text


def _rate_json(rate):
    """per_step for JSON: an int when whole bytes, else a float (per_step_fraction holds it exactly)."""
    if rate is None:
        return None
    return int(rate) if rate.denominator == 1 else float(rate)


@dataclasses.dataclass(eq=False)
class LeakReport(Report):
    """Growth of allocated bytes per step, judged over the whole run.

    A leak budget on a report that is not exact is inconclusive (it fails, never passes).
    """

    steps: list  # growth of each step, bytes (warm-up steps included)
    warmup: int  # warm-up steps, not judged
    survivors: list  # [TensorInfo] of a few of the tensors kept
    # False when the counters could not see every allocation of the block (DataLoader workers'
    # shared memory, another tool's hooks, ...); ``why`` then says why and the text says "not exact"
    exact: bool = field(json=bool)
    groups: list = ()  # [SurvivorGroup] of tensors kept, the unexpected first
    notes: list = ()  # what the scan could not do (stopped early, ...)
    steps_after: "int | None" = field(None, to_dict=False)  # steps after the first scan (not in the JSON)
    # why the figure is not exact (a sentence), None when it is; track() fills it from the block's counters
    # when the report is made
    why: "str | None" = None
    # net growth of the judged steps divided by their number, exactly (a fractions.Fraction of bytes:
    # 7,996 B over 2,000 steps is 3.998 B, never floored); in the JSON an int when whole, else a float,
    # and per_step_fraction [numerator, denominator]
    per_step: "Fraction | None" = field(init=False, json=_rate_json)
    # the run grew in two or more judged steps (or every one) and its net growth is positive
    leaking: bool = field(init=False, json=bool)
    # {judged_steps, steps_that_grew, net_growth, largest_step_growth}
    evidence: dict = field(init=False)

    def __post_init__(self):
        self.steps = list(self.steps)
        self.leaking, self.per_step, self.evidence = judge(self.steps, self.warmup)
        self.survivors = list(self.survivors)
        self.exact = bool(self.exact)
        self.groups = list(self.groups)
        self.notes = list(self.notes)

    @property
    def per_step_fraction(self) -> tuple[int, int] | None:
        """per_step exactly, as (numerator, denominator) of bytes, or None: the JSON's per_step is an
        int or a float, its per_step_fraction this pair."""
        return None if self.per_step is None else (self.per_step.numerator, self.per_step.denominator)

    def _dict_more(self, d):
        d["per_step_fraction"] = plain(self.per_step_fraction)

    def budget_bounds(self) -> tuple[Fraction | None, Fraction | None, str | None, str | None]:
        """(low, high, why, fix) of per_step for a leak budget (memtorch.budget): (per_step,
        per_step, None, None) when exact; when not, nothing bounds it (an allocation the
        counters cannot see may be kept, or freed, in any step): (per_step, None, why, fix),
        and a budget on it is inconclusive whatever its limit."""
        if self.per_step is None or self.exact:
            return self.per_step, self.per_step, None, None
        return self.per_step, None, self.why or "the block's counters are not exact", (
            "measure the leak where the counters see every allocation: DataLoader(num_workers=0), "
            "no other tool patching the allocator during the block"
        )

    def to_text(self) -> str:
        """The verdict, its evidence, the tensors kept (memtorch.display.leak_report_text)."""
        return render("text", self)

    def to_html(self) -> str:
        return render("html", self)

    def __repr__(self):
        return f"LeakReport(per_step={self.per_step}, leaking={self.leaking}, groups={len(self.groups)})"
