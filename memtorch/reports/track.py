"""What a track() block measured: the report, its phases and its modules. Data only: the hooks and
counters that fill it stay in memtorch.tracking (TensorInfo, the largest tensors' record, is in reports/leaks.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import units, words
from . import Record, Report, field, render

__all__ = ["TrackReport", "PhaseStats", "ModuleStats"]


@dataclasses.dataclass(eq=False)
class PhaseStats(Record):
    """One phase (forward, backward, optimizer) aggregated over its occurrences; in to_dict() under its name."""

    name: str = field(to_dict=False)  # forward, backward or optimizer (the key of TrackReport.phases)
    calls: int = 0  # occurrences
    delta: int = 0  # sum over the occurrences of (end - start), bytes
    peak: int = 0  # the highest absolute bytes during any occurrence
    peak_above_start: int = 0  # the largest (peak - start) of one occurrence: above the phase's own start
    seconds: float = field(0.0, json=float)  # total time
    exact: bool = field(True, json=bool)  # every peak exact
    why: "str | None" = None  # why not exact (a sentence), None when exact or not known
    _seen: int = field(0, repr=False)  # event-log mode: occurrences the replay saw whole

    def _add_bytes(self, start, end, peak, exact):
        self.delta += end - start
        self.peak = max(self.peak, peak)
        self.peak_above_start = max(self.peak_above_start, peak - start)
        self.exact = self.exact and bool(exact)

    def _add(self, start, end, peak, exact, seconds):
        self.calls += 1
        self.delta += end - start
        self.peak = max(self.peak, peak)
        self.peak_above_start = max(self.peak_above_start, peak - start)
        self.seconds += seconds
        self.exact = self.exact and bool(exact)

    def __repr__(self):
        return (
            f"PhaseStats({self.name!r}, calls={self.calls}, delta={self.delta}, "
            f"peak_above_start={self.peak_above_start}, exact={self.exact})"
        )


@dataclasses.dataclass(eq=False)
class ModuleStats(Record):
    """One module's forward: see the module docstring for the definitions."""

    name: str  # the module's dotted name ("" the root)
    type: str  # its class name
    note: "str | None" = None  # what the row cannot show (a compiled region: its insides), or None
    calls: int = 0  # forwards of the module (recomputations not counted)
    activation_bytes: int = 0  # bytes its forward left allocated, per forward of the model
    peak_above_start: int = 0  # the highest (peak - start) of one of its forwards
    exact: bool = field(True, json=bool)  # every figure exact
    why: "str | None" = None  # why not exact (a sentence), None when exact or not known
    # recomputations: its forwards run again by autograd during backward (torch.utils.checkpoint),
    # not counted in calls; the bytes they left allocated (what backward then uses), summed and
    # per forward of the model as activation_bytes is
    recomputed: int = 0  # recomputed forwards
    recomputed_bytes: int = 0  # bytes they left allocated, per forward of the model
    activation_total: int = field(0, to_dict=False)  # activation_bytes summed over every forward (not in the JSON)
    recomputed_total: int = field(0, to_dict=False)  # recomputed_bytes summed likewise (not in the JSON)
    _measured: int = field(0, repr=False)  # calls whose figures are known (event-log mode can drop old events)

    def __repr__(self):
        again = f", recomputed={self.recomputed}" if self.recomputed else ""
        return (
            f"ModuleStats({words.root_or(self.name)!r}, {self.type}, calls={self.calls}, "
            f"activation_bytes={self.activation_bytes}, peak_above_start={self.peak_above_start}{again})"
        )


def _series_json(series):
    return [{"step": i + 1, "peak": int(p), "end": int(e)} for i, (p, e) in enumerate(series)]


def _timeline_json(timeline):
    return {"times_ns": timeline[0].tolist(), "bytes": timeline[1].tolist()}


@dataclasses.dataclass(eq=False)
class TrackReport(Report):
    """What a track() block measured. All sizes are ints of bytes."""

    _budgets = ("peak", "delta", "leak")  # the figures check() (Report.check) takes a budget on

    device: str  # "cpu" or "cuda:N"
    exact: bool = field(json=bool)  # every figure exact (see caveats when not)
    mechanism: str  # what counted the block (the allocator hook, the caching allocator's statistics, ...)
    start: int  # allocated bytes when the block began
    end: int  # allocated bytes when it ended
    peak: int  # the highest allocated bytes during the block (absolute)
    delta: int = field(init=False)  # end - start
    peak_above_start: int = field(init=False)  # peak - start: what the block itself needed at its peak
    peak_upper: "int | None" = field(None, omit_none=True)  # CUDA, when peak is a lower bound: an upper bound
    reserved_peak: "int | None" = field(None, omit_none=True)  # CUDA: the caching allocator's reserved peak
    seconds: float = field(0.0, json=float)  # the block's wall time
    steps: int = 0  # t.step() calls
    live: bool = field(False, json=bool)  # a snapshot read inside the block (figures so far)
    # sentences saying what the counters could not see during the block
    caveats: list = field(default_factory=list)
    # None, or why start, end, peak and at_peak have an unknown baseline (memtorch re-took its
    # hooks from another tool before the block: cpu.Scope.baseline); delta and peak_above_start stay exact
    baseline: "str | None" = None
    absolute_exact: bool = field(init=False)  # exact and the baseline known
    # CPU: frees the counters saw of storages allocated before counting began, and their (malloc-usable)
    # bytes: delta and peak are then upper bounds. Zero when counting was already running (the default
    # after the first block: memtorch.cpu.keep_counting()).
    unseen_frees: int = 0  # those frees
    unseen_bytes: int = 0  # their bytes
    # under an initialised torch.distributed process group (read at the first read of t.report), else None
    rank: "int | None" = None  # this process's rank
    world_size: "int | None" = None  # the world size
    _phases: dict = field(default_factory=dict, key="phases")  # {name: PhaseStats} (read: .phases)
    _modules: list = field(default_factory=list, key="modules")  # [ModuleStats] (read: .modules)
    step_series: list = field(default_factory=list, json=_series_json)  # per step (t.step()): [(peak, end)]
    leak: "LeakReport | None" = None  # growth per step and what was kept (with steps), else None
    _at_peak: "attribution.AtPeak | None" = field(None, key="at_peak")  # who held the peak (read: .at_peak)
    _largest: list = field(default_factory=list, key="largest")  # [TensorInfo] (read: .largest)
    # (times_ns since the first event, bytes) NumPy arrays with timeline=True, else None
    timeline: "tuple | None" = field(None, omit_none=True, json=_timeline_json)
    # with timeline=True: [(ns on the timeline's clock, "phase" | "end" | "step", phase name or step number)]
    marks: list = field(default_factory=list, to_dict=False)  # (not in the JSON: its times are the timeline's)
    # the event log's replay (at_peak, the per-module figures), run when a figure it fills is first read
    _pending: object = field(None, repr=False)
    _row_notes: list = field(default_factory=list, repr=False)  # [(row name, note)]: rows inside a compiled region
    _largest_n: int = field(0, repr=False)  # largest= of track(): how many of the storages at the peak to keep

    def __post_init__(self):
        self.delta = self.end - self.start
        self.peak_above_start = self.peak - self.start
        self.caveats = list(self.caveats or [])
        self.step_series = list(self.step_series or [])
        self._row_notes = self._row_notes or []
        if self._pending is None:
            _apply_notes(self._modules, self._row_notes)
            self._largest_n = len(self._largest)
        self.absolute_exact = bool(self.exact) and self.baseline is None

    def _dict_more(self, d):
        d["steps_series"] = d["step_series"]  # the first spelling (.steps_series), kept for its readers

    def _settle(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            self._at_peak = pending()
            _apply_notes(self._modules, self._row_notes)
            if self.baseline is not None:  # the storages before the restart are not in the replay
                self._at_peak.exact = False
            if self._largest_n:
                self._largest = self._at_peak.storages[: self._largest_n]

    @property
    def steps_series(self) -> list[tuple[int, int]]:
        """step_series under its first spelling (the same list), kept for readers of that key."""
        return self.step_series

    @property
    def at_peak(self) -> Any:
        """Who held the bytes at the peak (memtorch.peak.AtPeak), or None without the event log."""
        self._settle()
        return self._at_peak

    @property
    def phases(self) -> dict[str, PhaseStats]:
        """{name: PhaseStats} of the phases that ran."""
        self._settle()
        return {k: v for k, v in self._phases.items() if v.calls}

    @property
    def modules(self) -> list[ModuleStats]:
        """[ModuleStats] of the model's modules (per-module figures)."""
        self._settle()
        return self._modules

    @property
    def largest(self) -> list[Any]:
        """The largest live tensors: at the peak with names (event log), else at the end."""
        self._settle()
        return self._largest

    def gather(self, group: Any = None, dst: int = 0, timeout: float = 60.0) -> Any:
        """Every rank's figures on ``dst`` (a MultiRankReport; None elsewhere): see memtorch.distributed.gather."""
        # an engine's action kept on the report for its users: memtorch.distributed registers it, and
        # is loaded by name as the renderers are (no import reaches up a floor)
        return render("gather", self, group=group, dst=dst, timeout=timeout)

    def budget_bounds(self, name: str) -> tuple[Any, Any, str | None, str | None] | None:
        """(low, high, why, fix) of the leak figure for memtorch.budget (LeakReport.budget_bounds);
        None for the other figures (budget's own rules)."""
        if name == "leak" and self.leak is not None and self.leak.per_step is not None:
            return self.leak.budget_bounds()
        return None

    # -- presentation ------------------------------------------------------
    def _summary_rows(self):
        f = units.format
        unknown = " (baseline unknown: see the note)" if self.baseline else ""
        rows = [
            ("start", f(self.start), unknown.strip()),
            ("end", f(self.end), units.format_delta(self.delta) + unknown),
            ("peak", f(self.peak), f"{units.format_delta(self.peak_above_start)} above block start{unknown}"),
        ]
        if not self.exact and self.peak_upper is not None:
            rows.append(("peak at most", f(self.peak_upper), "counters cannot be more precise (sampled)"))
        if self.reserved_peak is not None:
            rows.append(("reserved peak", f(self.reserved_peak), "held by the caching allocator"))
        if self.unseen_frees:
            said = any("before counting began" in c for c in self.caveats)  # the note says the rest
            rows.append((
                "unseen frees", f(self.unseen_bytes),
                f"{self.unseen_frees} free(s) of memory allocated before counting began"
                + (" (see the note below)" if said else ": delta and peak may be that much too high "
                   "(memtorch.cpu.start() at start-up counts from the start)"),
            ))  # fmt: skip
        return rows

    def _phase_rows(self):
        return [
            (
                p.name,
                str(p.calls),
                units.format_delta(p.delta),
                units.format(p.peak_above_start) + ("" if p.exact else " (at least)"),
                f"{p.seconds * 1e3:.1f} ms",
            )
            for p in self.phases.values()
            if p.calls
        ]

    def _title(self):
        how = "exact" if self.exact else "not exact"
        return (
            f"memtorch.track on {self.device} ({how}, {self.mechanism}){' so far' if self.live else ''}; "
            f"{self.seconds * 1e3:.1f} ms"
            + (f", {self.steps} step(s)" if self.steps else "")
        )

    def to_text(self, depth: Any = ..., max_rows: Any = ...) -> str:
        """The report as print() shows it (memtorch.display.track_report_text): its module tree folded to
        display.options (``...``, the default), or to depth / max_rows (None: no limit, every module)."""
        return render("text", self, depth, max_rows)

    def to_html(self, depth: Any = ..., max_rows: Any = ...) -> str:
        """The same content as HTML (the notebook's view); depth / max_rows as in to_text()."""
        return render("html", self, depth, max_rows)

    def plot(self, kind: str = "timeline", **kw: Any) -> Any:
        """A matplotlib Figure: kind='timeline', 'phases', 'modules', 'leak' or 'categories' (at the peak) (memtorch.plot)."""
        return render("plot", self, kind=kind, **kw)

    def __repr__(self):
        return (
            f"TrackReport(device={self.device!r}, exact={self.exact}, start={self.start}, end={self.end}, "
            f"peak={self.peak}, peak_above_start={self.peak_above_start})"
        )


def _apply_notes(rows, notes):
    """Each row named in ``notes`` ([(name, note)]) gets its note (ModuleStats.note)."""
    if notes:
        by_name = dict(notes)
        for row in rows:
            row.note = by_name.get(row.name, row.note)
