"""HTML and text rendering of reports: the module tree, folding, parameter counts.

The HTML is parsed (html.parser) rather than searched as text. Expected
figures are hand counts: parameter elements from the layer shapes, bytes as
elements x 4 (float32).
"""

import html.parser

import pytest
import torch
import zoo
from torch import nn

import memtorch
from memtorch import display, units


class _Table(html.parser.HTMLParser):
    """Collects every <table>: its header cells and rows of (text, attrs) cells, plus row attrs."""

    def __init__(self):
        super().__init__()
        self.tables = []
        self._cell = None
        self._row = None
        self._in_head = False
        self.details = 0
        self.open_tags = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in ("br", "hr", "img", "meta"):
            self.open_tags.append(tag)
        if tag == "details":
            self.details += 1
        if tag == "table":
            self.tables.append({"class": attrs.get("class", ""), "head": [], "rows": []})
        elif tag == "thead":
            self._in_head = True
        elif tag == "tbody":
            self._in_head = False
        elif tag == "tr":
            self._row = {"attrs": attrs, "cells": []}
        elif tag in ("td", "th"):
            self._cell = {"text": "", "attrs": attrs}

    def handle_endtag(self, tag):
        assert self.open_tags and self.open_tags[-1] == tag, f"</{tag}> closes <{self.open_tags[-1:]}>"
        self.open_tags.pop()
        if tag in ("td", "th"):
            self._row["cells"].append(self._cell)
            self._cell = None
        elif tag == "tr":
            t = self.tables[-1]
            if self._in_head:
                t["head"] = [c["text"] for c in self._row["cells"]]
            else:
                t["rows"].append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data


def parse(page):
    p = _Table()
    p.feed(page)
    p.close()
    assert p.open_tags == [], f"unclosed tags {p.open_tags}"
    return p


def module_table(page):
    tables = [t for t in parse(page).tables if "memtorch-modules" in t["class"]]
    assert len(tables) == 1
    return tables[0]


def nested():
    return nn.Sequential(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 64), nn.ReLU())),
        nn.Sequential(nn.Linear(64, 10)),
    )


# Hand counts for nested(): Linear(i, o) holds i*o + o elements.
L1, L2, L3 = 32 * 64 + 64, 64 * 64 + 64, 64 * 10 + 10


def test_nested_tree_rows_names_depths_and_counts():
    mm = memtorch.inspect(nested())
    t = module_table(mm._repr_html_())
    assert t["head"][:3] == ["module", "type", "param count"]
    rows = t["rows"]
    names = [r["cells"][0]["attrs"]["title"].split(" ")[0] for r in rows]
    assert names == ["(model):", "0", "0.0", "0.1", "0.2", "0.2.0", "0.2.1", "1", "1.0"]
    depths = [int(r["attrs"]["data-depth"]) for r in rows]
    assert depths == [0, 1, 2, 2, 2, 3, 3, 1, 2]
    # two rows named "0" under different parents are told apart by their shown label too
    labels = [r["cells"][0]["text"] for r in rows]
    assert labels[1] == "0" and labels[2] == "0.0" and labels[5] == "0.2.0"
    params = [int(r["cells"][2]["text"].replace(",", "")) for r in rows]
    assert params == [L1 + L2 + L3, L1 + L2, L1, 0, L2, L2, 0, L3, L3]
    total = [r["cells"][-1]["text"] for r in rows]
    assert total[0] == units.format(4 * (L1 + L2 + L3)) and total[4] == units.format(4 * L2)
    # numbers right-aligned, names left-aligned, indentation grows with depth
    for r in rows:
        assert "text-align:right" in r["cells"][2]["attrs"]["style"]
        assert "text-align:right" in r["cells"][-1]["attrs"]["style"]
        assert "text-align:left" in r["cells"][0]["attrs"]["style"]
    pads = [int(r["cells"][0]["attrs"]["style"].rsplit(" ", 1)[-1].rstrip("px")) for r in rows]
    assert pads[5] > pads[4] > pads[1] > pads[0]


def test_parameter_count_in_heading_and_totals():
    model = nested()
    mm = memtorch.inspect(model)
    n = L1 + L2 + L3
    assert n == sum(p.numel() for p in model.parameters())
    page = mm._repr_html_()
    assert f"{n:,} parameters" in page
    assert f"{n:,} elements, {n:,} trainable" in str(mm)
    model[0].requires_grad_(False)
    assert f"{n:,} elements, {L3:,} trainable" in str(memtorch.inspect(model))


def test_tied_weights_counted_once_in_the_subtree():
    mm = memtorch.inspect(zoo.tied_transformer())
    root = module_table(mm.to_html())["rows"][0]
    assert root["cells"][-1]["text"] == units.format(mm.total)
    assert int(root["cells"][2]["text"].replace(",", "")) == mm.numel


def test_alias_row_says_where_it_is_counted():
    mm = memtorch.inspect(zoo.multi_name_submodule())
    rows = module_table(mm.to_html())["rows"]
    assert [r["cells"][0]["attrs"]["title"] for r in rows[1:]] == ["first", "second"]
    assert rows[2]["cells"][-1]["text"] == "the same module as first, counted there"
    assert rows[0]["cells"][-1]["text"] == units.format(4 * (8 * 8 + 8))


def test_depth_folds_levels_into_their_parent():
    mm = memtorch.inspect(nested())
    rows = module_table(mm.to_html(depth=1))["rows"]
    assert [r["cells"][0]["text"] for r in rows] == ["(model)", "0 [+5]", "1 [+1]"]
    assert [r["cells"][-1]["text"] for r in rows] == [
        units.format(4 * (L1 + L2 + L3)), units.format(4 * (L1 + L2)), units.format(4 * L3),
    ]  # fmt: skip
    assert "5 module(s) inside" in rows[1]["cells"][0]["attrs"]["title"]
    assert [r["cells"][0]["text"] for r in module_table(mm.to_html(depth=0))["rows"]] == ["(model) [+8]"]
    text = mm.to_text(depth=1)
    assert "0 [+5]" in text and "0.2.0" not in text and "[+N]: N modules inside the row" in text


def test_identical_blocks_collapse_and_keep_their_insides():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    enc = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
    mm = memtorch.inspect(enc)
    rows = module_table(mm.to_html(max_rows=20))["rows"]
    labels = [r["cells"][0]["text"] for r in rows]
    types = [r["cells"][1]["text"] for r in rows]
    assert labels[:3] == ["(model)", "layers", "layers.0-11"]
    assert types[2] == "TransformerEncoderLayer x 12"
    one_layer = sum(p.numel() for p in layer.parameters())
    assert int(rows[2]["cells"][2]["text"].replace(",", "")) == 12 * one_layer
    # the inside of one layer, summed over the 12
    i = labels.index("linear1")
    assert types[i] == "Linear x 12" and rows[i]["cells"][2]["text"] == f"{12 * (16 * 32 + 32):,}"
    assert "norm1, norm2" in labels and types[labels.index("norm1, norm2")] == "LayerNorm x 24"
    assert len(rows) <= 20
    # every module when asked
    assert len(module_table(mm.to_html(max_rows=None))["rows"]) == len(mm.modules)


def test_too_long_even_at_one_level_sums_the_rest():
    model = nn.Sequential(*[nn.Linear(2, i + 1) for i in range(200)])  # all different
    mm = memtorch.inspect(model)
    rows = module_table(mm.to_html(max_rows=10))["rows"]
    assert len(rows) == 10
    last = rows[-1]
    assert last["cells"][0]["text"] == "... 192 more module(s)"
    hidden = sum(3 * (i + 1) for i in range(8, 200))  # Linear(2, o): 2*o + o elements
    assert int(last["cells"][2]["text"].replace(",", "")) == hidden
    assert last["cells"][-1]["text"] == units.format(4 * hidden)


def test_default_table_of_a_large_model_is_bounded():
    mm = memtorch.inspect(zoo.transformer_12())
    text = str(mm)
    table = text.split("\n\n")[1].splitlines()
    assert len(table) - 3 <= display.options["max_rows"]  # header, rule, note
    assert "(model)" in table[2]


def test_odd_module_names_are_escaped():
    m = nn.Module()
    m.add_module('<b>"x"&', nn.Linear(2, 2))
    page = memtorch.inspect(m)._repr_html_()
    rows = module_table(page)["rows"]
    assert rows[1]["cells"][0]["text"] == '<b>"x"&' and rows[1]["cells"][0]["attrs"]["title"] == '<b>"x"&'
    assert '<b>"x"&' not in page


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"depth": -1}, "depth must be None or an int >= 0"),
        ({"depth": 1.5}, "depth must be None or an int >= 0"),
        ({"depth": True}, "depth must be None or an int >= 0"),
        ({"max_rows": 1}, "max_rows must be None or an int >= 2"),
        ({"max_rows": "10"}, "max_rows must be None or an int >= 2"),
    ],
)
def test_bad_limits(kw, msg):
    mm = memtorch.inspect(nested())
    with pytest.raises(ValueError, match=msg):
        mm.to_html(**kw)
    with pytest.raises(ValueError, match=msg):
        mm.to_text(**kw)


def test_sizeof_has_no_module_table():
    mm = memtorch.sizeof({"a": torch.zeros(10)})
    page = mm._repr_html_()
    assert not [t for t in parse(page).tables if "memtorch-modules" in t["class"]]
    assert "40 B" in page


def _tracked():
    model = nested()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 32)
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t.step()
    return t


def test_track_report_html_tree():
    t = _tracked()
    r = t.report
    page = r._repr_html_()
    p = parse(page)
    assert p.details >= 1
    mt = module_table(page)
    assert mt["head"] == ["module", "type", "calls", "left alive (activations)", "peak inside"]
    rows = mt["rows"]
    assert [row["cells"][0]["attrs"]["title"] for row in rows][:3] == ["(model): the whole model", "0", "0.0"]
    assert [row["cells"][2]["text"] for row in rows] == ["3"] * 9
    by_name = {m.name: m for m in r.modules}
    for row in rows:
        name = row["cells"][0]["attrs"]["title"].split(":")[0]
        m = by_name["" if name == "(model)" else name]
        assert row["cells"][3]["text"] == units.format(m.activation_bytes)
    # the step table of the leak report
    steps = next(tb for tb in p.tables if tb["head"][:2] == ["step", "growth"])
    assert [row["cells"][1]["text"] for row in steps["rows"]] == [units.format_delta(g) for g in r.leak.steps]
    assert "warm-up" in steps["rows"][0]["cells"][2]["text"]
    # text with a depth
    text = r.to_text(depth=1)
    tree = next(part for part in text.split("\n\n") if "[+5]" in part)  # at_peak below names 0.2.0.weight
    assert "0 [+5]" in tree and "0.2.0" not in tree


def test_leak_and_tracker_html():
    t = _tracked()
    page = t.report.leak._repr_html_()
    assert "per step" in page and len(parse(page).tables) == 1
    assert t._repr_html_() == t.report._repr_html_()
    fresh = memtorch.track()
    assert "has not run" in fresh._repr_html_()
    with memtorch.track() as live:
        keep = torch.ones(100)
        assert "so far" in live._repr_html_()
    del keep


class _Owner:
    def __init__(self, name, kind, phase, nbytes):
        self.name, self.kind, self.phase, self.nbytes = name, kind, phase, nbytes


class _AtPeak:
    """The shape of track()'s at_peak (owners largest first, peak = their sum, exact, notes)."""

    def __init__(self, owners):
        self.owners = owners
        self.peak = sum(o.nbytes for o in owners)
        self.exact = True
        self.notes = ["a note"]


def test_at_peak_table():
    owners = [_Owner(f"layer{i}.weight", "parameter", None, 1000 - i) for i in range(20)]
    page = display.at_peak_html(_AtPeak(owners), limit=15)
    _kinds, mods, t = parse(page).tables  # per kind first, then per module, then per owner
    assert mods["head"] == ["module", "bytes", ""]  # these owners name no module: all outside one
    total = sum(1000 - i for i in range(20))
    assert [[c["text"] for c in r["cells"]] for r in mods["rows"]] == [
        ["outside any module (inputs, temporaries, other)", units.format(total), f"{total:,} B"]
    ]
    assert t["head"] == ["owner", "kind", "allocated in", "bytes", ""]
    assert len(t["rows"]) == 16
    assert t["rows"][0]["cells"][4]["text"] == "1,000 B"
    rest = sum(1000 - i for i in range(15, 20))
    assert (
        t["rows"][-1]["cells"][0]["text"] == "... and 5 more owner(s)"
        and t["rows"][-1]["cells"][4]["text"] == f"{rest:,} B"
    )
    assert "note: a note" in page


def test_estimate_html_and_text():
    model = nested()
    est = memtorch.estimate(model, torch.ones(4, 32), optimizer="adamw")
    page = est._repr_html_()
    p = parse(page)
    at_peak = next(t for t in p.tables if t["head"] == ["category", "bytes", "share"])
    assert [r["cells"][0]["text"] for r in at_peak["rows"]] == [c.replace("_", " ") for c, b in est.breakdown.items() if b]
    assert [r["cells"][1]["text"] for r in at_peak["rows"]] == [units.format(b) for b in est.breakdown.values() if b]
    rows = module_table(page)["rows"]
    by_name = {m.name: m for m in est.modules}
    assert [r["cells"][0]["attrs"]["title"].split(":")[0] for r in rows][1:] == [m.name for m in est.modules][1:]
    for r in rows:
        name = r["cells"][0]["attrs"]["title"].split(":")[0]
        m = by_name["" if name == "(model)" else name]
        assert r["cells"][3]["text"] == units.format(m.activation_bytes)
    assert "estimated, not measured" in page
    text = est.to_text(depth=1)
    assert "0 [+5]" in text and "0.2.0" not in text and "at the peak:" in text


def test_tracker_prints_its_report_or_that_its_block_still_runs():
    fresh = memtorch.track()
    assert str(fresh) == "memtorch.track on cpu: no report: this track() block has not run (or ended with an exception)"
    with memtorch.track() as live:
        keep = torch.ones(1000)  # 4,000 B of float32
        inside = str(live)
        snapshot = live.report
    head, rest = inside.split("\n", 1)
    assert head == "memtorch.track on cpu: the block is still running; its figures so far:"
    assert snapshot.live and "so far" in rest and snapshot.peak_above_start >= keep.nbytes == 4000
    assert str(live) == str(live.report) == live.report.to_text() and not live.report.live
    del keep
