"""Every rank's figures gathered on one rank (memtorch.distributed.gather): a row per rank and the
report over them. Data only: the gathering over torch.distributed stays in memtorch.distributed."""

import dataclasses

from .. import units, words
from ..errors import MemtorchError
from . import Record, Report, field, render

__all__ = ["MultiRankReport", "RankReport"]


@dataclasses.dataclass(eq=False)
class _Leak(Record):
    """A leak figure: ``per_step`` bytes (the most of any rank in a MultiRankReport)."""

    per_step: "int | float | None"  # bytes per step (an int when whole, else a float), or None
    steps: list = ()  # growth of each step, bytes
    warmup: int = 0  # warm-up steps, not judged
    leaking: bool = False  # the rank's LeakReport.leaking (any rank's, in a MultiRankReport)
    survivors: list = ()  # a few of the tensors kept, as text

    def __post_init__(self):
        self.steps = list(self.steps)
        self.survivors = list(self.survivors)

    def __repr__(self):
        return f"leak(per_step={self.per_step}, leaking={self.leaking})"


@dataclasses.dataclass(eq=False, init=False)
class RankReport(Record):
    """One rank's figures as gathered (memtorch.distributed.figures): the TrackReport fields, in bytes."""

    rank: int  # the rank
    world_size: "int | None"  # the world size it saw
    device: str  # "cpu" or "cuda:N"
    exact: bool  # its figures exact
    mechanism: str  # what counted its block
    start: int  # allocated bytes at its block's start
    end: int  # at its end
    peak: int  # the highest during the block (absolute)
    peak_upper: "int | None"  # CUDA, when peak is a lower bound: an upper bound
    reserved_peak: "int | None"  # CUDA: the caching allocator's reserved peak
    unseen_bytes: int  # CPU: bytes of frees of storages allocated before counting began
    seconds: float  # its block's wall time
    steps: int  # its t.step() calls
    phases: dict  # {name: {calls, delta, peak, peak_above_start, seconds, exact}}
    modules: list  # the ten modules leaving the most alive: {name, type, calls, activation_bytes, peak_above_start}
    leak: "_Leak | None"  # per_step, steps, warmup, leaking, survivors (as text), or None
    delta: int = field(to_dict=False)  # end - start (not in the JSON: start and end are)
    peak_above_start: int = field(to_dict=False)  # peak - start (likewise)

    def __init__(self, d):
        """From the dict figures() makes (a key it lacks reads as unknown: None, 0 or empty)."""
        self.rank = d["rank"]
        self.world_size = d.get("world_size")
        self.device = d["device"]
        self.exact = d["exact"]
        self.mechanism = d["mechanism"]
        self.start = d["start"]
        self.end = d["end"]
        self.peak = d["peak"]
        self.peak_upper = d.get("peak_upper")
        self.reserved_peak = d.get("reserved_peak")
        self.unseen_bytes = d.get("unseen_bytes", 0)
        self.seconds = d.get("seconds", 0.0)
        self.steps = d.get("steps", 0)
        self.phases = d.get("phases", {})
        self.modules = d.get("modules", [])
        leak = d.get("leak")
        self.leak = None if leak is None else _Leak(**leak)
        self.delta = self.end - self.start
        self.peak_above_start = self.peak - self.start

    def __repr__(self):
        return (
            f"RankReport(rank={self.rank}, device={self.device!r}, peak_above_start={self.peak_above_start}, "
            f"delta={self.delta})"
        )


def _stat(values):
    return max(values), min(values), sum(values) / len(values)


def _per_step_json(leak):
    return None if leak is None else leak.per_step


@dataclasses.dataclass(eq=False)
class MultiRankReport(Report):
    """Every rank's track() figures, gathered on one rank. Sizes are ints of bytes.

    The figures a budget reads are the maxima over ranks: peak_above_start, delta, peak (absolute),
    leak.per_step.
    """

    _budgets = ("peak", "delta", "leak")  # the figures check() (Report.check) takes a budget on

    ranks: list  # [RankReport] in rank order
    world_size: int = field(init=False)  # how many were gathered
    max_rank: int = field(init=False)  # the rank with the highest peak above start
    min_rank: int = field(init=False)  # the rank with the lowest
    peak_above_start: int = field(init=False)  # the highest peak above start over ranks
    min_peak_above_start: int = field(init=False)  # the lowest
    mean_peak: float = field(init=False)  # the mean of the peaks above start
    imbalance: float = field(init=False)  # max / mean of the peaks above start (1.0 when balanced)
    spread: int = field(init=False)  # max - min of them
    peak: int = field(init=False)  # the highest absolute peak over ranks
    delta: int = field(init=False)  # the largest delta over ranks
    leak: "_Leak | None" = field(init=False, key="leak_per_step", json=_per_step_json)  # the largest leak, or None
    exact: bool = field(init=False)  # every rank's figures exact
    delta_rank: int = field(init=False, to_dict=False)  # the rank with the largest delta (not in the JSON)
    leak_rank: "int | None" = field(init=False, to_dict=False)  # the rank with the largest leak (not in the JSON)
    device: str = field(init=False, to_dict=False)  # the ranks' devices, ", "-joined (not in the JSON)
    phases: dict = field(init=False, to_dict=False)  # {name: {peak_above_start, delta}}, maxima (not in the JSON)

    @property
    def leak_per_step(self) -> "int | float | None":
        """The highest rank's leak per step in bytes (``leak.per_step``: the rank is ``leak_rank``), or
        None when no rank measured one: the JSON's leak_per_step."""
        return None if self.leak is None else self.leak.per_step

    def __post_init__(self):
        ranks = self.ranks
        if not ranks:
            raise MemtorchError("a MultiRankReport needs at least one rank's figures")
        self.ranks = sorted(ranks, key=lambda r: r.rank)
        self.world_size = len(self.ranks)
        peaks = [r.peak_above_start for r in self.ranks]
        hi, lo, mean = _stat(peaks)
        self.max_rank = next(r.rank for r in self.ranks if r.peak_above_start == hi)
        self.min_rank = next(r.rank for r in self.ranks if r.peak_above_start == lo)
        self.peak_above_start = hi
        self.min_peak_above_start = lo
        self.mean_peak = mean
        self.spread = hi - lo
        self.imbalance = hi / mean if mean > 0 else 1.0
        self.peak = max(r.peak for r in self.ranks)
        self.delta = max(r.delta for r in self.ranks)
        self.delta_rank = next(r.rank for r in self.ranks if r.delta == self.delta)
        self.exact = all(r.exact for r in self.ranks)
        devices = sorted({r.device for r in self.ranks})
        self.device = devices[0] if len(devices) == 1 else ", ".join(devices)
        per_step = [r.leak.per_step for r in self.ranks if r.leak is not None and r.leak.per_step is not None]
        self.leak = None
        if per_step:
            worst = max(per_step)
            self.leak_rank = next(
                r.rank for r in self.ranks if r.leak is not None and r.leak.per_step == worst
            )
            self.leak = _Leak(worst, leaking=any(r.leak.leaking for r in self.ranks if r.leak is not None))
        else:
            self.leak_rank = None
        names = []
        for r in self.ranks:
            names += [n for n in r.phases if n not in names]
        self.phases = {
            n: {
                "peak_above_start": max(r.phases[n]["peak_above_start"] for r in self.ranks if n in r.phases),
                "delta": max(r.phases[n]["delta"] for r in self.ranks if n in r.phases),
            }
            for n in names
        }

    # -- budgets ---------------------------------------------------------------
    def budget_breakdown(self):
        """The text memtorch.assert_budget prints under its verdict."""
        return str(self)

    # -- output ----------------------------------------------------------------
    def _rows(self):
        f = units.format
        names = list(self.phases)
        rows = []
        for r in self.ranks:
            leak = "" if r.leak is None or r.leak.per_step is None else units.format_delta(r.leak.per_step)
            row = [str(r.rank), r.device, f(r.peak_above_start), f(r.peak), units.format_delta(r.delta), leak]
            row += [f(r.phases[n]["peak_above_start"]) if n in r.phases else "" for n in names]
            if not r.exact:
                row[2] += " (not exact)"
            rows.append(row)
        # every peak column says what it is above: the block's start, each phase's start (words.py)
        header = ["rank", "device", words.PEAK_ABOVE_BLOCK_START, "peak", "delta", "leak/step"]
        header += [f"{n} {words.PEAK_ABOVE_PHASE_START}" for n in names]
        return header, rows

    def summary_lines(self):
        f = units.format
        n = self.world_size
        lines = [
            f"highest: rank {self.max_rank} holds the most, peak {f(self.peak_above_start)} above its block start",
            f"lowest:  rank {self.min_rank}, {f(self.min_peak_above_start)}; "
            f"mean {f(int(round(self.mean_peak)))} over {n} rank(s)",
            f"imbalance: highest / mean = {self.imbalance:.3f}; highest - lowest = {f(self.spread)}",
        ]
        if self.delta_rank is not None and self.delta:
            lines.append(f"largest delta: rank {self.delta_rank}, {units.format_delta(self.delta)}")
        if self.leak is not None and self.leak.per_step > 0:
            lines.append(
                f"largest leak: rank {self.leak_rank}, {units.format_delta(self.leak.per_step)} per step"
            )
        elif self.leak is not None:
            lines.append("leak: no rank grew per step after warm-up")
        if not self.exact:
            lines.append("some ranks' figures are not exact (see their rows)")
        return lines

    def to_text(self):
        """One row per rank, then the summary (memtorch.display.multi_rank_text)."""
        return render("text", self)

    def to_html(self):
        return render("html", self)

    def __repr__(self):
        return (
            f"MultiRankReport(world_size={self.world_size}, max_rank={self.max_rank}, "
            f"peak_above_start={self.peak_above_start}, imbalance={self.imbalance:.3f})"
        )
