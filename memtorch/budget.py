"""Memory budgets: compare a tracked report with limits, say what went over and why.

``assert_budget(report, peak="64 MiB")`` works anywhere (the pytest plugin, a
script, a notebook); ``TrackReport.check`` delegates here. The figures compared:

- ``peak``  with ``report.peak_above_start``: the most the block itself had
  allocated at once, above what was live when it started;
- ``delta`` with ``report.delta``: what the block left allocated (end - start);
- ``leak``  with ``report.leak.per_step``: what each step kept, from the
  tracker's step boundaries (``t.step()``).

Sizes go through ``memtorch.units.parse``: KiB/MiB/GiB are 1024-based,
kB/MB/GB 1000-based. A figure is over budget when it is strictly greater than
its limit.

A figure that is only bounded (a CUDA block that stayed below a peak the device
reached before it: torch's counters give a range; a CPU block that freed memory
allocated before counting began: the figure is an upper bound) is judged by its
bounds: over budget when its lower bound is above the limit, within when its
upper bound is at or below it, and otherwise *inconclusive*: it fails with
memtorch.BudgetInconclusive (a BudgetExceeded), saying why and how to get an
exact figure. A budget never passes on a lower bound. A report can give its own
bounds with ``budget_bounds(name) -> (low, high, why, fix)`` (high None: no
upper bound).
"""

import re
from fractions import Fraction

from . import units, words
from .units import format_rate
from .errors import BudgetExceeded, BudgetInconclusive, MemtorchError

__all__ = ["assert_budget", "breakdown", "check_budget", "failure_line", "figure_bounds", "format_pair",
           "verdict_line", "Failure"]  # fmt: skip

_FIGURES = ("peak", "delta", "leak")


class Failure(tuple):
    """One figure that did not pass: unpacks and compares as (name, measured, limit), bytes.

    ``measured`` is the figure, or its lower bound when it is only bounded;
    ``upper`` its upper bound (== measured when exact, None when nothing bounds
    it from above); ``inconclusive`` True when the limit lies between the bounds;
    ``why`` and ``fix`` say why the figure is only bounded and how to get an
    exact one (None when exact).
    """

    def __new__(cls, name, measured, limit, upper=None, inconclusive=False, why=None, fix=None):
        if getattr(measured, "denominator", 1) == 1:
            measured = int(measured)  # a leak rate may be a Fraction of bytes: kept exact, never floored
        self = super().__new__(cls, (name, measured, int(limit)))
        self.upper = None if upper is None else int(upper)
        self.inconclusive = bool(inconclusive)
        self.why = why
        self.fix = fix
        return self

    @property
    def exact(self):
        return self.upper == self[1] and self.why is None

    def __repr__(self):
        extra = ", inconclusive" if self.inconclusive else "" if self.exact else f", upper={self.upper}"
        return f"Failure({self[0]!r}, {self[1]}, {self[2]}{extra})"


def format_pair(measured, limit):
    """Format two byte counts so that they read differently whenever they differ.

    One decimal is the default; when that rounds two different counts to the
    same text (3,999,999 B and 4,000,000 B are both "3.8 MiB") more decimals are
    used, and as a last resort the exact bytes.
    """
    for precision in (1, 2, 3):
        a, b = units.format(measured, precision=precision), units.format(limit, precision=precision)
        if a != b or measured == limit:
            return a, b
    a, b = units.format(measured, unit="B"), units.format(limit, unit="B")  # never floors a fraction
    if a == b:  # two fractions of a byte that 3 decimals do not tell apart
        a, b = f"{Fraction(measured)} B", f"{Fraction(limit)} B"
    return a, b


_DECIMAL_UNIT = re.compile(r"(?i)[0-9.\s][kmgt]b\s*$")


def _spelled_limit(text, spelled):
    if isinstance(spelled, str) and _DECIMAL_UNIT.search(spelled):
        text += f" ({spelled.strip()})"
    return text


def verdict_line(name, measured, limit, spelled=None):
    """The one-line verdict, e.g. 'peak 71.2 MiB exceeds budget 64.0 MiB by 7.2 MiB'.

    Figures print in binary units; a limit the user wrote in decimal units is also
    shown as written, so that "3 MB" reads 'budget 2.9 MiB (3 MB)'.
    """
    if getattr(measured, "denominator", 1) != 1:  # a leak rate in fractions of a byte: never floored

        m, lim = format_rate(measured, signed=False), units.format(int(limit))
        return f"{name} {m} exceeds budget {_spelled_limit(lim, spelled)} by {format_rate(measured - int(limit), signed=False)}"
    m, lim = format_pair(measured, limit)
    excess = units.format(int(measured) - int(limit))
    return f"{name} {m} exceeds budget {_spelled_limit(lim, spelled)} by {excess}"


def failure_line(failure, spelled=None):
    """The one-line verdict of a Failure: exceeded (exact, or its lower bound over) or inconclusive."""
    name, low, limit = failure
    if getattr(low, "denominator", 1) != 1:  # a leak rate in fractions of a byte: never floored

        if not failure.inconclusive:
            return verdict_line(name, low, limit, spelled)
        return (
            f"{name} budget {_spelled_limit(units.format(limit), spelled)} inconclusive: the {name} is "
            f"{format_rate(low, signed=False)}, not an exact figure, because {failure.why}; it does not "
            f"pass. For an exact figure: {failure.fix}"
        )
    if not failure.inconclusive:
        if failure.exact:
            return verdict_line(name, low, limit, spelled)
        m, lim = format_pair(low, limit)
        return (
            f"{name} at least {m} exceeds budget {_spelled_limit(lim, spelled)} by at least "
            f"{units.format(low - limit)} ({failure.why})"
        )
    m, lim = format_pair(low, limit)
    if failure.upper is None:
        measured = f"at least {m}, with no upper bound"
    else:
        hi, _ = format_pair(failure.upper, limit)
        measured = f"between {m} and {hi}"
    return (
        f"{name} budget {_spelled_limit(lim, spelled)} inconclusive: the {name} is {measured}, "
        f"not an exact figure, because {failure.why}; it does not pass. For an exact figure: {failure.fix}"
    )


def _leak_figure(report):
    leak = getattr(report, "leak", None)
    per_step = None if leak is None else getattr(leak, "per_step", None)
    if per_step is None:
        raise MemtorchError(
            "a leak budget needs a per-step leak figure, and this report has none: "
            "mark the step boundaries with t.step() (in pytest, request the memtorch_tracker "
            "fixture and call memtorch_tracker.step() after each step)"
        )
    if isinstance(per_step, (list, tuple)):
        # One figure per step: the budget holds for every step.
        return max(per_step, default=0)
    return per_step  # exact (a Fraction of bytes): compared as it is, never floored


def _measured(report, name):
    """The figure of ``report`` that the budget ``name`` is compared with (bytes; a lower bound
    when the figure is only bounded: see figure_bounds)."""
    if name == "peak":
        return int(report.peak_above_start)
    if name == "delta":
        return int(report.delta)
    return _leak_figure(report)


def _one_report_bounds(report, name):
    """(low, high, why, fix) of one report's figure; high None: unbounded; why None: exact."""
    own = getattr(report, "budget_bounds", None)
    if callable(own):
        got = own(name)
        if got is not None:
            return got
    value = _measured(report, name)
    exact = bool(getattr(report, "exact", True))
    mechanism = str(getattr(report, "mechanism", "") or "")
    if name == "peak" and not exact and mechanism.startswith(words.CUDA_MECHANISM):
        start = int(report.start)
        upper = getattr(report, "peak_upper", None)
        if upper is None:
            return (
                value, None,
                "torch's peak counter was reset inside the block (torch.cuda.reset_peak_memory_stats(), "
                "by the code measured or another tool), so nothing bounds the block's peak from above",
                "do not reset torch's peak inside the block, or reset it with memtorch.cuda.reset_peak(), "
                "which keeps open blocks exact",
            )  # fmt: skip
        return (
            value, int(upper) - start,
            "the block stayed below a peak the device reached before it: torch keeps one peak per "
            "device, so its counters only bound the block's own peak",
            "call memtorch.cuda.reset_peak() (torch.cuda.reset_peak_memory_stats()) just before the "
            "block, or measure it under the pytest marker memory_budget(device='cuda'), which does so "
            "for each test",
        )  # fmt: skip
    unseen = int(getattr(report, "unseen_bytes", 0) or 0)
    if name in ("peak", "delta") and unseen > 0:
        return (
            value - unseen, value,
            f"the CPU counters saw frees of {units.format(unseen)} allocated before counting began, so the "
            f"{name} may be up to that much too high",
            "call memtorch.cpu.start() at start-up, before the memory the block frees is allocated "
            "(the pytest plugin does so for every budgeted test)",
        )  # fmt: skip
    return value, value, None, None


def figure_bounds(report, name):
    """(low, high, why, fix) of the figure ``name`` ("peak", "delta", "leak") of ``report``, bytes.

    low == high and why None for an exact figure (or an approximate one that is not a
    bound); high None when nothing bounds it from above. A multi-rank report's figure is
    the maximum over its ranks, bounded by the maxima of their bounds.
    """
    report = _as_report(report, "figure_bounds")
    ranks = getattr(report, "ranks", None)
    if not ranks or name == "leak":
        return _one_report_bounds(report, name)
    low, high, why, fix = None, 0, None, None
    for r in ranks:
        lo, hi, w, f = _one_report_bounds(r, name)
        low = lo if low is None else max(low, lo)
        high = None if high is None or hi is None else max(high, hi)
        if w is not None and why is None:
            why, fix = f"on rank {getattr(r, 'rank', '?')}, {w}", f
    if why is None:
        return low, low, None, None
    return low, high, why, fix


def _as_report(obj, fname):
    """The report to judge: a TrackReport (or anything with its figures), or a Tracker's report."""
    if hasattr(obj, "peak_above_start"):
        return obj
    # a Tracker (told by its class's ``report`` property, so that budget, on the result types' floor,
    # needs no import of memtorch.tracking): the finished block's report (a clear error if it has not run)
    if isinstance(getattr(type(obj), "report", None), property):
        return obj.report
    raise TypeError(
        f"{fname}() expects the report of a track() block (t.report) or the tracker itself (t), "
        f"got {type(obj).__name__}"
    )


def check_budget(report, peak=None, delta=None, leak=None):
    """Return the list of Failures (they unpack as (name, measured_bytes, limit_bytes)): the figures
    over budget and those only bounded whose limit lies between their bounds (``inconclusive``);
    empty when every figure is within its budget.

    Raises UnitError for an unparsable size and MemtorchError for a leak budget
    on a report without steps.
    """
    report = _as_report(report, "check_budget")
    limits = {"peak": peak, "delta": delta, "leak": leak}
    failures = []
    for name in _FIGURES:
        if limits[name] is None:
            continue
        limit = units.parse(limits[name])
        low, high, why, fix = figure_bounds(report, name)
        if low > limit:  # over, even at its lowest
            failures.append(Failure(name, low, limit, high, False, why, fix))
        elif high is None or high > limit:  # only bounded, and the limit lies between the bounds
            failures.append(Failure(name, low, limit, high, True, why, fix))
    return failures


def _get(obj, name, default=None):
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _fmt(value, signed=False):
    if value is None:
        return "n/a"
    return units.format_delta(value) if signed else units.format(value)


def breakdown(report, modules=5, tensors=5, owners=5):
    """Text breakdown of a report: totals, phases, top modules, the largest owners at the peak,
    largest live tensors, leak, and what the counters could not see."""
    owners_n = owners
    own = getattr(report, "budget_breakdown", None)
    if callable(own):  # a report that knows its own layout (memtorch.distributed.MultiRankReport)
        return own()
    lines = []
    device = _get(report, "device", "?")
    exact = _get(report, "exact", None)
    how = "exact counters" if exact else "counters that are not exact" if exact is not None else "counters"
    mechanism = str(_get(report, "mechanism", "") or "")
    if mechanism.startswith("estimate"):  # an Estimate: a dry run, no counter was read
        how = mechanism
    if exact is False and str(_get(report, "mechanism", "") or "").startswith(words.CUDA_MECHANISM):
        upper = _get(report, "peak_upper")
        how = "counters that bound the peak" + ("" if upper is None else f": at most {_fmt(upper)}")
    lines.append(f"memtorch breakdown (device {device}, {how})")
    lines.append(
        "  start {}, end {} (delta {}), peak {} ({} above block start)".format(
            _fmt(_get(report, "start")),
            _fmt(_get(report, "end")),
            _fmt(_get(report, "delta"), signed=True),
            _fmt(_get(report, "peak")),
            _fmt(_get(report, "peak_above_start"), signed=True),
        )
    )
    reserved = _get(report, "reserved_peak")
    if reserved is not None:
        lines.append(f"  reserved peak {_fmt(reserved)} (CUDA caching allocator segments)")
    phases = _get(report, "phases") or {}
    if phases:
        lines.append("  phases:")
        width = max(len(str(n)) for n in phases)
        for name, ph in phases.items():
            lines.append(
                f"    {name!s:<{width}}  peak {_fmt(_get(ph, 'peak_above_start'), signed=True)} above phase "
                f"start, delta {_fmt(_get(ph, 'delta'), signed=True)}"
            )
    rows = list(_get(report, "modules") or [])
    if rows:

        def held(row):
            return max(int(_get(row, "activation_bytes") or 0), int(_get(row, "peak_above_start") or 0))

        rows.sort(key=held, reverse=True)
        lines.append(f"  modules that hold the most (top {min(modules, len(rows))} of {len(rows)}):")
        for row in rows[:modules]:
            label = words.module_label(_get(row, "name", "?"), _get(row, "type", "?"))
            lines.append(
                f"    {label}: activations {_fmt(_get(row, 'activation_bytes'))}, "
                f"peak {_fmt(_get(row, 'peak_above_start'), signed=True)} above its entry"
            )
    at_peak = _get(report, "at_peak")
    if at_peak is not None:
        owners = [o for o in at_peak.owners if o.nbytes]
        how = "" if at_peak.exact else ", not exact"
        lines.append(
            f"  who held the bytes at the peak ({_fmt(at_peak.peak)}{how}; the {min(owners_n, len(owners))} "
            f"largest of {len(owners)} owners):"
        )
        shown = owners[:owners_n]
        width = max((len(_fmt(o.nbytes)) for o in shown), default=0)  # the sizes right-aligned, as at_peak's
        for o in shown:
            lines.append(f"    {_fmt(o.nbytes):>{width}}  {o.name} ({o.kind})")
            # "other": where the largest came from (two lines), or why no line is known
            for text in (o.site_lines(limit=2)[:2] if getattr(o, "site_lines", None) else []):
                lines.append(f"      {text}")
        for note in at_peak.notes:
            lines.append(f"    note: {note}")
    largest = list(_get(report, "largest") or [])
    if largest:
        when = "at the peak" if at_peak is not None else "at the end"
        lines.append(f"  largest live tensors {when} (top {min(tensors, len(largest))}):")
        for t in largest[:tensors]:
            if hasattr(t, "describe"):
                lines.append(f"    {t.describe()}")
                continue
            shape = tuple(_get(t, "shape", ()) or ())
            graph = ", holds autograd graph" if _get(t, "has_graph") else ""
            lines.append(f"    {_fmt(_get(t, 'nbytes'))}  {shape} {_get(t, 'dtype', '?')}{graph}")
    leak = _get(report, "leak")
    if leak is not None:
        per_step = _get(leak, "per_step")
        survivors = list(_get(leak, "survivors") or [])
        if isinstance(per_step, (list, tuple)):
            per_step = max(per_step, default=0)

        rate = "n/a" if per_step is None else format_rate(per_step)
        how = "" if _get(leak, "exact", True) else f" (not exact: {_get(leak, 'why') or 'see the notes'})"
        groups = list(_get(leak, "groups") or [])
        kept = sum(_get(g, "count", 0) for g in groups if _get(g, "expected") is None) if groups else len(survivors)
        lines.append(f"  leak: {rate} per step{how}, {kept} tensor(s) kept unexpectedly")
        for g in list(_get(leak, "groups") or [])[:5]:
            if hasattr(g, "describe"):
                lines.append(f"    kept: {g.describe(_get(leak, 'steps_after'))}")
    said = set(at_peak.notes) if at_peak is not None else set()
    for c in list(_get(report, "caveats") or []):
        if c not in said:  # one note for one fact: at_peak's notes are printed above
            lines.append(f"  note: {c}")
    return "\n".join(lines)


def assert_budget(report, peak=None, delta=None, leak=None):
    """Raise memtorch.BudgetExceeded if ``report`` goes over any given limit, or
    memtorch.BudgetInconclusive (a BudgetExceeded) if a figure is only bounded and a
    limit lies between its bounds: a budget never passes on a lower bound.

    ``peak`` is compared with ``report.peak_above_start``, ``delta`` with
    ``report.delta``, ``leak`` with ``report.leak.per_step``; each is an int of
    bytes or a size string ("64 MiB", "1.5 GB"). The error's ``str()`` starts
    with one line per figure over budget, e.g.
    ``peak 71.2 MiB exceeds budget 64.0 MiB by 7.2 MiB``, then the breakdown;
    its ``failures`` are the (name, measured, limit) byte triples.
    """
    report = _as_report(report, "assert_budget")
    spelled = {"peak": peak, "delta": delta, "leak": leak}
    failures = check_budget(report, peak=peak, delta=delta, leak=leak)
    if failures:
        head = "\n".join(failure_line(f, spelled=spelled[f[0]]) for f in failures)
        # over for sure wins: inconclusive only when no figure is known to be over
        error = BudgetInconclusive if all(f.inconclusive for f in failures) else BudgetExceeded
        raise error(f"{head}\n\n{breakdown(report)}", failures=failures, report=report)
