"""Plots: each is saved as PNG and its content checked (labels with units, bars against figures).

Expected figures come from the report itself (the plot must show what the report
says) and, for the peak, from the timeline's own maximum and a hand count.
"""

import pytest
import torch
from torch import nn

import memtorch
from memtorch import plot, units

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

PNG = b"\x89PNG\r\n\x1a\n"


def save(fig, tmp_path, name):
    path = tmp_path / f"{name}.png"
    fig.savefig(path)
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 5000
    return path


def model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 128), nn.ReLU()), nn.Linear(128, 10))
    return model, torch.optim.Adam(model.parameters())


@pytest.fixture
def tracked():
    model, opt = model_and_opt()
    x = torch.ones(32, 64)
    with memtorch.track(model, optimizer=opt, timeline=True) as t:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t.step()
    return t.report


def _peak_annotation(ax):
    found = [c for c in ax.texts if c.get_gid() == "memtorch-peak"]
    assert len(found) == 1
    return found[0]


def test_timeline(tracked, tmp_path):
    r = tracked
    fig = r.plot()
    save(fig, tmp_path, "timeline")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time since the block opened (ms)"
    unit = ax.get_ylabel().split("(")[1].rstrip(")")
    assert unit in ("B", "KiB", "MiB", "GiB")
    factor = units.UNITS[unit]
    # the peak annotated is report.peak, at the height of the timeline's own maximum
    ann = _peak_annotation(ax)
    assert ann.get_text() == f"peak {units.format(r.peak)} ({r.peak:,} B)"
    assert ann.xy[1] * factor == pytest.approx(r.peak)
    assert int(r.timeline[1].max()) == r.peak
    # phases shaded (one span per occurrence), one dashed line per step, all in the legend
    spans = [p for p in ax.patches]
    assert len(spans) == 3 * 3
    dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(dashed) == 3 == r.steps
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:1] == ["allocated"] and {"forward", "backward", "optimizer", "end of a step"} <= set(
        legend
    )
    assert [t.get_text() for t in ax.texts if t.get_text().startswith("step")] == [
        "step 1",
        "step 2",
        "step 3",
    ]
    # phase spans lie inside the timeline, in order
    ends = [p.get_x() + p.get_width() for p in spans]
    assert all(0 <= p.get_x() <= e <= r.timeline[0][-1] / 1e6 + 1e-9 for p, e in zip(spans, ends))


def test_timeline_peak_hand_counted(tmp_path):
    with memtorch.track(timeline=True) as t:
        a = torch.ones(1000, 1000)  # 4,000,000 B
        b = torch.ones(500, 1000)  # 2,000,000 B
        del a
        c = torch.ones(250, 1000)  # 1,000,000 B
        del b, c
    r = t.report
    assert r.peak - r.start == 6_000_000
    fig = r.plot()
    save(fig, tmp_path, "timeline_hand")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "allocated (MiB)"
    ann = _peak_annotation(ax)
    assert f"({r.peak:,} B)" in ann.get_text()
    assert ann.xy[1] * 2**20 == pytest.approx(r.peak)


def test_timeline_needs_timeline_true():
    with memtorch.track() as t:
        torch.ones(10)
    with pytest.raises(memtorch.MemtorchError, match=r"timeline=True"):
        t.report.plot()


def test_bad_kind(tracked):
    with pytest.raises(
        ValueError, match="unknown plot kind 'pie' for a TrackReport: expected one of timeline"
    ):
        tracked.plot("pie")
    mm = memtorch.inspect(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown plot kind 'timeline' for a ModelMemory"):
        mm.plot("timeline")


def test_phases(tracked, tmp_path):
    fig = tracked.plot("phases")
    save(fig, tmp_path, "phases")
    ax = fig.axes[0]
    unit = ax.get_ylabel().split("(")[1].rstrip(")")
    factor = units.UNITS[unit]
    bars = ax.patches
    n = len(tracked.phases)
    assert n == 3 and len(bars) == 2 * n
    # each phase's stacked bar reaches its peak; the top part is its largest rise
    for i, p in enumerate(tracked.phases.values()):
        top = bars[n + i]
        assert (top.get_y() + top.get_height()) * factor == pytest.approx(p.peak)
        assert top.get_height() * factor == pytest.approx(p.peak_above_start)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["forward (3x)", "backward (3x)", "optimizer (3x)"]


def test_track_modules(tracked, tmp_path):
    fig = tracked.plot("modules")
    save(fig, tmp_path, "track_modules")
    ax = fig.axes[0]
    unit = ax.get_xlabel().rsplit("(", 1)[1].rstrip(")")
    factor = units.UNITS[unit]
    labels = [t.get_text() for t in ax.get_yticklabels()]  # top to bottom
    widths = [b.get_width() * factor for b in ax.patches]
    # innermost modules only (a parent's figure includes its children's), largest first
    leaves = {m.name: m for m in tracked.modules if m.name in ("0.0", "0.1", "1")}
    assert sorted(labels) == sorted(f"{n} ({m.type})" for n, m in leaves.items())
    for label, w in zip(labels, widths):
        assert w == pytest.approx(leaves[label.split(" ")[0]].activation_bytes)
    assert widths == sorted(widths, reverse=True)


def test_model_memory_modules_and_categories(tmp_path):
    model, opt = model_and_opt()
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    mm = memtorch.inspect(model, optimizer=opt)
    fig = mm.plot()
    save(fig, tmp_path, "mm_modules")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("bytes held by the module itself (KiB)")
    # Linear(64,128): (64*128+128)*4 B of parameters, the same again of gradients, twice as optimizer state
    p0 = (64 * 128 + 128) * 4
    labels = [t.get_text() for t in ax.get_yticklabels()]  # top to bottom, largest first
    assert labels == ["0.0 (Linear)", "1 (Linear)"]
    top = ax.get_yticks()[0]
    row0 = [b.get_width() * 1024 for b in ax.patches if abs(b.get_y() + b.get_height() / 2 - top) < 1e-9]
    assert row0 == pytest.approx([p0, p0, 2 * p0 + 2 * 4])  # + one float32 step per weight and bias
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["parameter", "gradient", "optimizer state"]

    fig = mm.plot("categories")
    save(fig, tmp_path, "mm_categories")
    ax = fig.axes[0]
    unit = ax.get_ylabel().split("(")[1].rstrip(")")
    heights = [b.get_height() * units.UNITS[unit] for b in ax.patches]
    p = p0 + (128 * 10 + 10) * 4
    assert heights[0] == pytest.approx(p) and heights[1] == pytest.approx(p)  # parameters, gradients
    # exp_avg + exp_avg_sq, and Adam's 'step': one float32 scalar per parameter tensor (4 tensors)
    assert heights[2] == pytest.approx(2 * p + 4 * 4)
    # side by side
    fig = plot.categories({"float32": mm, "bfloat16": memtorch.inspect(model.to(torch.bfloat16))})
    save(fig, tmp_path, "categories_two")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["float32", "bfloat16"]


def test_leak_plot(tracked, tmp_path):
    fig = tracked.leak.plot()
    save(fig, tmp_path, "leak")
    ax = fig.axes[0]
    unit = ax.get_ylabel().split("(")[1].rstrip(")")
    assert [b.get_height() * units.UNITS[unit] for b in ax.patches] == pytest.approx(tracked.leak.steps)
    assert ax.get_xlabel() == "step"


def test_categories_rejects_other_objects():
    with pytest.raises(
        TypeError, match=r"categories\(\) needs reports with by_category \(a ModelMemory\), breakdown"
    ):
        plot.categories({"x": object()})


def test_notebook_repr_png(tracked):
    png = tracked.plot()._repr_png_()
    assert png.startswith(PNG)


def test_estimate_categories(tmp_path):
    model, _ = model_and_opt()
    est = memtorch.estimate(model, torch.ones(8, 64), optimizer="adam")
    fig = est.plot()
    save(fig, tmp_path, "estimate_categories")
    ax = fig.axes[0]
    unit = ax.get_ylabel().split("(")[1].rstrip(")")
    shown = {c: b for c, b in est.breakdown.items() if b}
    heights = [b.get_height() * units.UNITS[unit] for b in ax.patches]
    assert heights == pytest.approx(list(shown.values()))
    # the legend lists the categories top to bottom, as they are stacked
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [c.replace("_", " ") for c in shown][::-1]
    assert ax.get_title() == "at the estimated peak, by category"
    # beside what inspect() counts
    fig = plot.categories({"estimate": est, "inspect": memtorch.inspect(model)})
    save(fig, tmp_path, "estimate_beside_inspect")
