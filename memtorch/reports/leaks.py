"""The result of a leak check (memtorch.leaks): growth per step judged over the run, and the groups of
tensors kept. Data only: the scans that find the tensors stay in memtorch.leaks."""

import dataclasses
from fractions import Fraction

from .. import units
from . import Record, Report, field, render

__all__ = ["LeakReport", "SurvivorGroup", "judge"]


def judge(growth, warmup):
    """(leaking, per_step, evidence dict) from per-step growth (bytes), warm-up steps skipped."""
    judged = list(growth[warmup:])
    if not judged:
        return False, None, {}
    net = sum(judged)
    grew = [warmup + i + 1 for i, g in enumerate(judged) if g > 0]
    n = len(judged)
    # least-squares slope of the boundaries after warm-up (bytes per step)
    ys = [0]
    for g in judged:
        ys.append(ys[-1] + g)
    xs = range(len(ys))
    mx = sum(xs) / len(ys)
    my = sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    leaking = net > 0 and (len(grew) >= 2 or len(grew) == n)
    evidence = {
        "judged_steps": n, "steps_that_grew": grew, "net_growth": int(net), "slope_per_step": float(slope),
        "largest_step_growth": int(max(judged)),
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

    def describe(self, steps_after=None):
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


def _fraction_json(rate):
    return None if rate is None else [rate.numerator, rate.denominator]


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
    # {judged_steps, steps_that_grew, net_growth, slope_per_step, largest_step_growth}
    evidence: dict = field(init=False)

    def __post_init__(self):
        self.steps = list(self.steps)
        self.leaking, self.per_step, self.evidence = judge(self.steps, self.warmup)
        self.survivors = list(self.survivors)
        self.exact = bool(self.exact)
        self.groups = list(self.groups)
        self.notes = list(self.notes)

    def _dict_more(self, d):
        d["per_step_fraction"] = _fraction_json(self.per_step)

    def budget_bounds(self):
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

    def to_text(self):
        """The verdict, its evidence, the tensors kept (memtorch.display.leak_report_text)."""
        return render("text", self)

    def to_html(self):
        return render("html", self)

    def __repr__(self):
        return f"LeakReport(per_step={self.per_step}, leaking={self.leaking}, groups={len(self.groups)})"
