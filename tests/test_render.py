"""print(report) and report.to_text() show the same content, rendered by memtorch.display alone
(issue 25, item 2); at_peak answers per kind, then per module, then per tensor (item 4)."""

import html

import pytest
import torch
from torch import nn

import memtorch
from memtorch import display, units, words
from memtorch import distributed as mdist
from memtorch.leaks import LeakReport
from memtorch.estimator.plan import Breakdown, plan_from


class _Deep(nn.Module):
    """32 layers, each a different width (so no two fold into one 'x N' row), 34 modules in all."""

    def __init__(self, n=32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8 + i, 9 + i) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.pad(layer(x), (0, 0))
        return x


def _rows_named(text):
    """The first cell of each line of the module tree (indent stripped)."""
    return {line.split()[0] for line in text.splitlines() if line.startswith(" ") and line.split()}


def test_print_of_a_track_report_is_its_text_and_keeps_every_layer():
    model = _Deep()
    x = torch.ones(2, 8)
    with memtorch.track(model) as t:
        model(x).sum().backward()
    r = t.report
    assert str(r) == r.to_text()
    # 34 modules fit the default 40 rows: each has its row, the last layers included (a flat
    # table cut at 30 rows lost 4 of them)
    names = _rows_named(str(r))
    assert {f"layers.{i}" for i in range(32)} <= names
    assert "folded" not in str(r)


def test_a_model_too_long_for_the_table_folds_and_says_how_to_see_every_module():
    model = _Deep(60)  # 62 modules > 40 rows: the layers fold into their ModuleList
    with memtorch.track(model) as t:
        model(torch.ones(2, 8)).sum().backward()
    text = str(t.report)
    assert text == t.report.to_text()
    note = next(line for line in text.splitlines() if "folded" in line)
    assert note.startswith("62 modules in ") and "[+N]" in note and ".to_text(max_rows=None)" in note
    assert "layers [+60]" in text  # the 60 layers, inside their ModuleList's row
    full = t.report.to_text(max_rows=None)
    assert {f"layers.{i}" for i in range(60)} <= _rows_named(full)


@pytest.mark.slow
def test_print_of_an_estimate_is_its_text_and_keeps_every_layer():
    est = memtorch.estimate(_Deep(), torch.ones(2, 8), optimizer="sgd")
    assert str(est) == est.to_text()
    assert {f"layers.{i}" for i in range(32)} <= _rows_named(str(est))
    # its phase table's peak is above each phase's start, and its title says so
    assert words.PEAK_ABOVE_PHASE_START in str(est)


def test_leak_multi_rank_plan_and_at_peak_render_through_display():
    leak = LeakReport([100, 8, 8, 8], warmup=1, survivors=[], exact=True)
    assert str(leak) == leak.to_text() == display.leak_report_text(leak)
    assert leak.to_text().startswith("leak: +8 B per step after 1 warm-up step(s) (LEAKING)")

    ph = {"forward": {"calls": 1, "delta": 0, "peak": 0, "peak_above_start": 30, "seconds": 0.0, "exact": True}}
    ranks = [
        mdist.RankReport({"rank": k, "world_size": 2, "device": "cpu", "exact": True, "mechanism": "test",
                          "start": 100, "end": 100, "peak": 100 + 200 * (k + 1), "phases": ph, "modules": []})
        for k in range(2)
    ]  # fmt: skip
    m = mdist.MultiRankReport(ranks)
    assert str(m) == m.to_text() == display.multi_rank_text(m)
    head = m.to_text().splitlines()[1]
    # every peak column says what it is above: the block's start, or the phase's
    assert "peak above block start" in head and "forward peak above phase start" in head
    rank1 = m.to_text().splitlines()[4].split()
    assert rank1[:4] == ["1", "cpu"] + units.format(400).split()  # 500 - 100 above its block's start

    b = Breakdown(peak=5000, parameter=1000, gradient=1000, optimizer_state=2000, gradient_at_peak=1000,
                  optimizer_state_at_peak=2000, numel=250, largest_block=400, param_numels=(150, 100))  # fmt: skip
    p = plan_from({("fp32", None, 8): b}, device_memory=4000, world_sizes=[1, 2])
    assert str(p) == p.to_text() == display.plan_text(p)
    # the notebook shows the same rows
    for report in (m, p):
        page = report._repr_html_()
        for line in report.to_text().splitlines():
            if line and not line.startswith("-"):
                assert all(html.escape(cell.strip()) in page for cell in line.split("  ") if cell.strip()), line

    model = nn.Linear(4, 4)
    with memtorch.track(model) as t:
        model(torch.ones(2, 4)).sum().backward()
    ap = t.report.at_peak
    assert str(ap) == ap.to_text() == "\n".join(display.at_peak_lines(ap, 30))


def _mlp_step():
    memtorch.cpu.start()  # count from here: the parameters, made before the block, are counted live at its peak
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    x = torch.ones(8, 16)
    with memtorch.track(model, opt) as t:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t.step()
    return model, opt, t.report


def test_at_peak_by_module_is_each_modules_gradients_and_state_at_the_peak():
    model, opt, r = _mlp_step()
    ap = r.at_peak
    by_module = ap.by_module()
    # the peak is in the optimizer's step (parameters, gradients and Adam's state all live); each
    # Linear's figure is its parameters, their .grad and their state, measured by their nbytes here
    for name in ("0", "2"):
        params = list(model.get_submodule(name).parameters())
        weights = sum(p.nbytes for p in params)
        grads = weights  # a .grad has its parameter's size (zero_grad has set it to None since)
        state = sum(v.nbytes for p in params for v in opt.state[p].values() if torch.is_tensor(v))
        assert by_module[name] == weights + grads + state
    assert "1" not in by_module  # the ReLU holds nothing at the peak
    # the groups add up to the peak: the modules' and the rest
    outside = sum(o.nbytes for o in ap.owners if o.module is None)
    assert sum(by_module.values()) + outside == ap.peak
    assert {o.module for o in ap.owners if o.kind == "temporary"} == {None}


def test_at_peak_text_answers_per_kind_then_module_then_tensor():
    model, _, r = _mlp_step()
    ap = r.at_peak
    lines = ap.lines(limit=4)
    heads = [i for i, line in enumerate(lines) if not line.startswith(" ")]
    assert [lines[i].split(" (")[0].split(",")[0] for i in heads] == ["at the peak", "by module", "by tensor"]
    kinds = lines[heads[0] + 1 : heads[1]]
    assert [line.split(None, 2)[2] for line in kinds] == [words.label(k) for k, b in ap.by_kind().items() if b]
    mods = lines[heads[1] + 1 : heads[2]]
    # each module named with its type, as the other tables name it ("0 (Linear)")
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    expected = [f"{words.root_or(m)} ({types[m]})" for m in ap.by_module()]
    expected += ["outside any module (inputs, temporaries, other)"]
    assert sorted(line.split(None, 2)[2] for line in mods) == sorted(expected)
    # the tensors: the first 4, then one line with how many more and their bytes
    tensors = [line for line in lines[heads[2] + 1 :] if not line.startswith("  note")]
    owners = [o for o in ap.owners if o.nbytes]
    assert len(owners) > 4 and len(tensors) == 5
    rest = sum(o.nbytes for o in owners[4:])
    assert tensors[-1].split() == units.format(rest).split() + ["...", "and", str(len(owners) - 4), "more", "owner(s)"]
    # the report's text shows the same sections, and its summary's peak says it is above the block's start
    text = str(r)
    assert text.index("by kind:") < text.index("by module") < text.index("by tensor")
    assert "above block start" in text


def test_at_peak_html_has_the_same_three_lists():
    _, _, r = _mlp_step()
    page = r.at_peak._repr_html_()
    assert page.index("by kind") < page.index("by module") < page.index("by tensor")
    assert page == display.at_peak_html(r.at_peak, 30)


def test_module_of_names_no_module_for_what_the_model_does_not_hold():
    from memtorch.peak import module_of

    mods = {"", "a", "a.b"}
    assert module_of("a.b.weight.exp_avg", "optimizer state", mods) == "a.b"
    assert module_of("a.weight", "parameter", mods) == "a"
    assert module_of("weight.grad", "gradient", mods) == ""  # the root's own
    assert module_of("input 0", "input", mods) is None
    assert module_of("param_groups[0][1].exp_avg", "optimizer state", mods) is None  # not the model's
