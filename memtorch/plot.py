"""Plots of memtorch reports (matplotlib, the optional extra: pip install memtorch-probe[plot]).

Every function returns a matplotlib Figure (no pyplot, so no global figure
state and nothing shown twice in a notebook); save it with fig.savefig(...).

    report.plot()                     # TrackReport: timeline (needs track(timeline=True))
    report.plot("phases")             # per phase: held at the start + needed above it
    report.plot("modules")            # per module: bytes its forward left alive
    mm.plot()                         # ModelMemory: per-module bars, stacked by category
    mm.plot("categories")             # one stacked bar: parameters, gradients, optimizer state...
    memtorch.plot.categories({"fp32": mm, "bf16": mm16})   # bars side by side
    leak.plot()                       # growth per step, warm-up steps marked

Axes carry binary units (KiB = 1024 B); the unit is chosen from the largest figure.
"""

from . import reports as _reports, units, words
from .units import format_rate
from .errors import MemtorchError

__all__ = [
    "timeline", "phases", "modules", "categories", "leak", "model_memory", "track_report", "leak_report", "estimate",
]  # fmt: skip

PHASE_COLORS = {"forward": "#4C9BE8", "backward": "#F28E2B", "optimizer": "#59A14F"}
CATEGORY_COLORS = {
    "parameter": "#4E79A7",
    "buffer": "#9C755F",
    "gradient": "#F28E2B",
    "optimizer_state": "#59A14F",
    "tensor": "#B07AA1",
    "array": "#BAB0AC",
    "activation": "#E15759",
    "temporary": "#EDC948",
    "input": "#76B7B2",
}


def _figure(**kw):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "memtorch's plots need matplotlib: pip install 'memtorch-probe[plot]' (or pip install matplotlib)"
        ) from None

    class MemtorchFigure(Figure):
        """A Figure that notebooks show as a PNG without pyplot."""

        def _repr_png_(self):
            import io

            buf = io.BytesIO()
            self.savefig(buf, format="png", bbox_inches="tight")
            return buf.getvalue()

    return MemtorchFigure(**kw)


def _unit(largest):
    """(name, factor) of the binary unit for an axis whose largest figure is ``largest`` bytes."""
    for name in ("GiB", "MiB", "KiB"):
        if abs(largest) >= units.UNITS[name]:
            return name, units.UNITS[name]
    return "B", 1


def _require(kind, **checks):
    for what, ok in checks.items():
        if not ok:
            raise MemtorchError(f"cannot plot {kind}: {what}")


# ---------------------------------------------------------------------------
# TrackReport


def timeline(report, ax=None, title=None):
    """Allocated bytes over the block's time, phases shaded, step boundaries marked, the peak annotated."""
    tl = getattr(report, "timeline", None)
    _require(
        "a timeline",
        **{
            "the block was tracked without timeline=True: use memtorch.track(..., timeline=True)": tl
            is not None
        },
    )
    import numpy as np

    t, b = (np.asarray(a) for a in tl)
    _require("a timeline", **{"the timeline is empty": len(t) > 0})
    fig, ax = _fig_ax(ax, figsize=(9, 4))
    name, factor = _unit(max(int(b.max()), report.peak))
    # milliseconds, or seconds for blocks longer than 10 s
    tdiv, tunit = (1e9, "s") if len(t) and t[-1] > 10e9 else (1e6, "ms")
    ms = t / tdiv
    ax.plot(ms, b / factor, drawstyle="steps-post", color="#333333", linewidth=1.2, label="allocated")
    ax.set_xlabel(f"time since the block opened ({tunit})")
    ax.set_ylabel(f"allocated ({name})")
    ax.set_xlim(0, max(float(ms[-1]), 1e-3))
    ax.set_ylim(0, max(report.peak, int(b.max())) / factor * 1.18 or 1)
    # phases: spans between their start and end marks
    marks = list(getattr(report, "marks", None) or [])
    seen = set()
    open_ = {}
    for ns, kind, label in marks:
        if kind == "phase":
            open_[label] = ns
        elif kind == "end" and label in open_:
            start = open_.pop(label)
            ax.axvspan(
                start / tdiv, ns / tdiv, color=PHASE_COLORS.get(label, "#cccccc"), alpha=0.22, linewidth=0,
                label=label if label not in seen else None,
            )  # fmt: skip
            seen.add(label)
    steps = [(ns, label) for ns, kind, label in marks if kind == "step"]
    for i, (ns, k) in enumerate(steps):
        ax.axvline(
            ns / tdiv,
            color="#555555",
            linestyle="--",
            linewidth=0.9,
            label="end of a step" if i == 0 else None,
        )
        ax.annotate(
            f"step {k}", xy=(ns / tdiv, 1), xycoords=("data", "axes fraction"), xytext=(-3, -3),
            textcoords="offset points", ha="right", va="top", fontsize=8, color="#555555",
        )  # fmt: skip
    # the peak: the first time the log reaches it
    i = int(np.argmax(b))
    at = float(ms[i])
    peak = report.peak
    text = f"peak {units.format(peak)} ({peak:,} B)"
    if not report.exact:
        text += ", not exact"
    ax.plot([at], [peak / factor], marker="o", color="#C03030", zorder=5)
    right = at > 0.6 * float(ms[-1] or 1)
    ax.annotate(
        text, xy=(at, peak / factor), xytext=(-8 if right else 8, 6), textcoords="offset points",
        ha="right" if right else "left", va="bottom", color="#C03030", fontsize=9, gid="memtorch-peak",
    )  # fmt: skip
    ax.axhline(report.start / factor, color="#999999", linestyle=":", linewidth=0.9, label="at the start")
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax.set_title(title or f"memtorch.track on {report.device}: allocated over time", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return fig


def phases(report, ax=None, title=None):
    """Per phase: its peak (the bar's height, absolute bytes) and, on top, the largest rise above
    the bytes allocated at its start in one occurrence (what the phase itself needed)."""
    ph = [p for p in report.phases.values() if p.calls]
    _require("phases", **{"the block recorded no phase: give track() a model and/or an optimizer": bool(ph)})
    fig, ax = _fig_ax(ax, figsize=(7, 3.5))
    rise = [p.peak_above_start for p in ph]
    base = [p.peak - p.peak_above_start for p in ph]
    name, factor = _unit(max(p.peak for p in ph))
    x = range(len(ph))
    ax.bar(
        x, [b / factor for b in base], color="#BBBBBB", label="rest of the peak (allocated before the phase)"
    )
    ax.bar(
        x, [r / factor for r in rise], bottom=[b / factor for b in base],
        color=[PHASE_COLORS.get(p.name, "#888888") for p in ph], label="largest rise within the phase",
    )  # fmt: skip
    for i, p in enumerate(ph):
        ax.annotate(
            f"peak {units.format(p.peak)}\nrise {units.format(p.peak_above_start)}", xy=(i, p.peak / factor),
            ha="center", va="bottom", fontsize=8,
        )  # fmt: skip
    ax.set_xticks(list(x), [f"{p.name} ({p.calls}x)" for p in ph])
    ax.set_ylabel(f"allocated ({name})")
    ax.set_ylim(0, max(p.peak for p in ph) / factor * 1.3 or 1)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title or "peak of each phase over its occurrences", fontsize=10)
    return fig


def _leaf_modules(names):
    """Names with no other name below them (a parent's figures include its children's)."""
    names = list(names)
    prefixes = set()
    for n in names:
        parts = n.split(".") if n else []
        for k in range(len(parts)):
            prefixes.add(".".join(parts[:k]))
    return [n for n in names if n not in prefixes]


def modules(report, top=15, ax=None, title=None):
    """Horizontal bars, largest first. TrackReport: what each innermost module's forward left
    alive (activations). ModelMemory: each module's own bytes, stacked by category."""
    if hasattr(report, "module_table"):
        return _mm_modules(report, top, ax, title)
    mods = [m for m in report.modules if m.calls]
    _require("modules", **{"no module ran a forward: give track() the model": bool(mods)})
    leaves = set(_leaf_modules(m.name for m in mods))
    rows = sorted((m for m in mods if m.name in leaves), key=lambda m: -m.activation_bytes)
    shown, rest = rows[:top], rows[top:]
    labels = [words.module_label(m.name, m.type) for m in shown]
    vals = [m.activation_bytes for m in shown]
    if rest:
        labels.append(f"{len(rest)} other module(s)")
        vals.append(sum(m.activation_bytes for m in rest))
    fig, ax = _fig_ax(ax, figsize=(8, 0.9 + 0.32 * len(vals)))
    name, factor = _unit(max(vals) if vals else 0)
    y = list(range(len(vals)))[::-1]
    ax.barh(y, [v / factor for v in vals], color="#4C9BE8")
    for yi, v in zip(y, vals):
        ax.annotate(" " + units.format(v), xy=(v / factor, yi), va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel(f"left alive after its forward, per forward of the model ({name})")
    ax.set_xlim(0, (max(vals) if vals else 1) / factor * 1.25 or 1)
    ax.set_title(title or "activations by module (innermost modules)", fontsize=10)
    return fig


def _mm_modules(mm, top, ax, title):
    cats = words.MODULE_CATEGORIES
    fields = ("parameters", "buffers", "gradients", "optimizer_state")  # ModuleRow's figures of cats
    rows = [m for m in mm.modules if m.alias_of is None and m.own > 0]
    _require("modules", **{"no module holds any tensor": bool(rows)})
    rows.sort(key=lambda m: -m.own)
    shown, rest = rows[:top], rows[top:]
    labels = [words.module_label(m.name, m.type) for m in shown]
    data = [[getattr(m, f) for f in fields] for m in shown]
    if rest:
        labels.append(f"{len(rest)} other module(s)")
        data.append([sum(getattr(m, f) for m in rest) for f in fields])
    totals = [sum(d) for d in data]
    fig, ax = _fig_ax(ax, figsize=(8, 1.2 + 0.32 * len(data)))
    name, factor = _unit(max(totals))
    y = list(range(len(data)))[::-1]
    left = [0.0] * len(data)
    for j, c in enumerate(cats):
        vals = [d[j] / factor for d in data]
        if any(vals):
            ax.barh(y, vals, left=left, color=CATEGORY_COLORS[c], label=words.label(c))
            left = [a + b for a, b in zip(left, vals)]
    for yi, v in zip(y, totals):
        ax.annotate(" " + units.format(v), xy=(v / factor, yi), va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel(f"bytes held by the module itself ({name}), each storage once")
    ax.set_xlim(0, max(totals) / factor * 1.25)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or f"{mm.root_type}: memory by module", fontsize=10)
    return fig


def _by_category(r):
    """{category: bytes} of a report: ModelMemory.by_category, or an Estimate's breakdown at its peak."""
    for attr in ("by_category", "breakdown"):
        value = getattr(r, attr, None)
        if isinstance(value, dict):
            return value
    at_peak = getattr(r, "at_peak", None)  # a TrackReport: who held the bytes at its peak
    if at_peak is not None:
        return at_peak.by_kind()
    raise TypeError(
        "categories() needs reports with by_category (a ModelMemory), breakdown (an Estimate) or at_peak "
        f"(a TrackReport of a block whose event log ran), got {type(r).__name__}"
    )


def categories(reports, ax=None, title=None):
    """Stacked bars by category (parameter, buffer, gradient, optimizer state, activation, ...).

    ``reports``: a ModelMemory or an Estimate (its breakdown at the peak), or a
    dict {label: report} for bars side by side (before and after a change, an
    estimate beside what inspect() counts).
    """

    if not isinstance(reports, dict):
        reports = {getattr(reports, "root_type", "") or type(reports).__name__: reports}
    figures = {label: _by_category(r) for label, r in reports.items()}
    fig, ax = _fig_ax(ax, figsize=(2.2 + 1.3 * len(figures), 4))
    order = list(words.INSPECT_CATEGORIES + words.ESTIMATE_CATEGORIES) + [c for d in figures.values() for c in d]
    cats = [c for c in dict.fromkeys(order) if any(d.get(c, 0) for d in figures.values())]
    totals = [sum(d.values()) for d in figures.values()]
    name, factor = _unit(max(totals) if totals else 0)
    x = list(range(len(figures)))
    bottom = [0.0] * len(figures)
    for c in cats:
        vals = [d.get(c, 0) / factor for d in figures.values()]
        ax.bar(
            x,
            vals,
            bottom=bottom,
            color=CATEGORY_COLORS.get(c, "#888888"),
            label=words.label(c),
            width=0.6,
        )
        for i, v in enumerate(vals):
            if v and v > 0.06 * (max(totals) / factor):
                ax.annotate(
                    units.format(round(v * factor)), xy=(i, bottom[i] + v / 2), ha="center", va="center",
                    fontsize=7, color="white",
                )  # fmt: skip
        bottom = [a + b for a, b in zip(bottom, vals)]
    for i, tot in enumerate(totals):
        ax.annotate(
            units.format(tot), xy=(i, tot / factor), ha="center", va="bottom", fontsize=8, fontweight="bold"
        )
    ax.set_xticks(x, list(figures), fontsize=8)
    ax.set_ylabel(f"bytes ({name})")
    ax.set_ylim(0, (max(totals) if totals else 1) / factor * 1.15 or 1)
    handles, labels = ax.get_legend_handles_labels()  # listed top to bottom, as stacked
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title is None:
        kinds = {"breakdown" if isinstance(getattr(r, "breakdown", None), dict) else "held" for r in reports.values()}
        title = "at the estimated peak, by category" if kinds == {"breakdown"} else "memory by category"
    ax.set_title(title, fontsize=10)
    return fig


def estimate(est, kind="categories", **kw):
    kinds = {"categories": categories, "phases": phases, "modules": modules}
    if kind not in kinds:
        raise ValueError(f"unknown plot kind {kind!r} for an Estimate: expected one of {', '.join(kinds)}")
    return kinds[kind](est, **kw)


# ---------------------------------------------------------------------------
# LeakReport


def leak(report, ax=None, title=None):
    """Growth of allocated bytes per step; warm-up steps (not judged) in grey."""
    lk = getattr(report, "leak", report)
    _require(
        "leaks",
        **{"no steps were marked: call t.step() at the end of each step": lk is not None and bool(lk.steps)},
    )
    fig, ax = _fig_ax(ax, figsize=(7, 3.5))
    name, factor = _unit(max(abs(g) for g in lk.steps) or 1)
    x = list(range(1, len(lk.steps) + 1))
    colors = [
        "#BBBBBB" if i < lk.warmup else ("#C03030" if g > 0 else "#59A14F") for i, g in enumerate(lk.steps)
    ]
    ax.bar(x, [g / factor for g in lk.steps], color=colors)
    for xi, g in zip(x, lk.steps):
        ax.annotate(units.format_delta(g), xy=(xi, max(g, 0) / factor), ha="center", va="bottom", fontsize=8)
    ax.axhline(0, color="#333333", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"growth during the step ({name})")
    ax.set_xticks(x)

    verdict = (
        "not judged" if lk.per_step is None else f"{format_rate(lk.per_step)} per step after warm-up"
        + ("" if getattr(lk, "exact", True) else " (not exact)")
    )
    ax.set_title(title or f"leak: {verdict} (grey: warm-up steps)", fontsize=10)
    return fig


# ---------------------------------------------------------------------------
# dispatch used by the reports' plot() methods


def _fig_ax(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    fig = _figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def track_report(report, kind="timeline", **kw):
    kinds = {
        "timeline": timeline,
        "phases": phases,
        "modules": modules,
        "leak": leak,
        "categories": categories,
    }
    if kind not in kinds:
        raise ValueError(f"unknown plot kind {kind!r} for a TrackReport: expected one of {', '.join(kinds)}")
    return kinds[kind](report, **kw)


def model_memory(mm, kind="modules", **kw):
    kinds = {"modules": modules, "categories": categories}
    if kind not in kinds:
        raise ValueError(f"unknown plot kind {kind!r} for a ModelMemory: expected one of {', '.join(kinds)}")
    return kinds[kind](mm, **kw)


def leak_report(lk, **kw):
    return leak(lk, **kw)


# What each result type's plot() calls: memtorch.reports.render looks them up here by class name.
for _name, _fn in [
    ("ModelMemory", model_memory), ("TrackReport", track_report), ("Estimate", estimate), ("LeakReport", leak_report),
]:
    _reports.renders("plot", _name)(_fn)
del _name, _fn
