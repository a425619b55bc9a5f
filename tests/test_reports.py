"""The result types: dataclasses on memtorch.reports' bases, each field declared once.

to_dict() is derived from the declared fields, so these tests hold the declarations themselves:
every attribute an instance carries is a declared field (an attribute set elsewhere would be
missing from to_dict() and from the stubs), every field is in to_dict() or says it is not,
each has an annotation and a one-line comment, every to_dict() survives json.dumps and
json.loads unchanged, and every key of a report's to_dict() names an attribute of the report
(a reader of the JSON finds each figure under the same name on the object). The instances come
from real runs (track(), estimate(), plan_from()) or, for the rows a small run does not make,
from their constructors.
"""

import ast
import dataclasses
import importlib
import inspect
import json
import pkgutil
import textwrap
from fractions import Fraction

import pytest
import torch

import memtorch
from memtorch import advice, distributed, estimation, leaks, peak, planning, report, tracking
from memtorch import reports
from memtorch.reports import Record, Report, field

REPORTS = [
    tracking.TrackReport, leaks.LeakReport, peak.AtPeak, estimation.Estimate, planning.Plan,
    advice.Advice, distributed.MultiRankReport, report.ModelMemory,
]  # fmt: skip
ROWS = [
    tracking.PhaseStats, tracking.ModuleStats, tracking.TensorInfo, leaks.SurvivorGroup, peak.Owner,
    peak.StorageAtPeak, advice.Suggestion, distributed.RankReport, distributed._Leak, report.ModuleRow,
]  # fmt: skip


@pytest.fixture(scope="module")
def made():
    """{type: [instances]} from a tracked Adam step with a leak, an estimate, a plan and a gather."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    kept = []
    with memtorch.track(model, optimizer=opt, largest=3) as t:
        for _ in range(3):
            loss = model(torch.randn(8, 16)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            kept.append(loss)  # a leak: each step's loss and its graph
            t.step()
    r = t.report
    with memtorch.track(model) as t2:  # no step: no leak figure
        kept.append(torch.zeros(64))
    est = memtorch.estimate(model, torch.randn(8, 16), optimizer="adamw")
    b = planning.Breakdown(
        peak=5000, parameter=1000, gradient=1000, optimizer_state=2000, gradient_at_peak=1000,
        optimizer_state_at_peak=2000, numel=250, largest_block=400, param_numels=(150, 100),
    )  # fmt: skip
    plan = planning.plan_from({("fp32", None, 8): b}, device_memory=4000, world_sizes=[1, 2])
    figs = json.loads(json.dumps(distributed.figures(r)))
    ranks = [distributed.RankReport(dict(figs, rank=k)) for k in range(2)]
    group = leaks.SurvivorGroup("float32", "8x16", True, "a list", None)
    group.count, group.nbytes = 2, 1024
    owner = peak.Owner("other", "other", "forward", 96, 2)
    owner.sites, owner.sites_note = [("train.py", 3, "step", 96, 2)], "no line for 0 B"
    mm = memtorch.inspect(model, opt)
    sizes = memtorch.sizeof([torch.zeros(3), {"a": torch.ones(2)}])
    sugg = advice.Suggestion("bf16", "train in bf16", 1000, advice.EXACT, "model.to(torch.bfloat16)", "1000 B")
    out = {
        tracking.TrackReport: [r, t2.report],
        tracking.PhaseStats: list(r.phases.values()),
        tracking.ModuleStats: r.modules,
        tracking.TensorInfo: [tracking.TensorInfo(torch.zeros(3, 4), step=1, name="x")] + r.leak.survivors,
        leaks.LeakReport: [r.leak, leaks.LeakReport([3, 1, 2], 1, [], False, why="not exact")],
        leaks.SurvivorGroup: [group],
        peak.AtPeak: [r.at_peak],
        peak.Owner: r.at_peak.owners + [owner],
        peak.StorageAtPeak: r.largest,
        estimation.Estimate: [est],
        planning.Plan: [plan],
        advice.Suggestion: [sugg],
        advice.Advice: [advice.Advice("Sequential", [sugg], None, 1234, None, ["nothing else"])],
        distributed.RankReport: ranks,
        distributed._Leak: [ranks[0].leak],
        distributed.MultiRankReport: [distributed.MultiRankReport(ranks)],
        report.ModelMemory: [mm, sizes],
        report.ModuleRow: mm.modules,
    }
    del kept
    return out


def test_every_result_type_is_a_record_and_every_report_a_report():
    for cls in REPORTS + ROWS:
        assert dataclasses.is_dataclass(cls) and issubclass(cls, Record), cls
    for cls in REPORTS:
        assert issubclass(cls, Report), cls
    assert memtorch.TrackReport is tracking.TrackReport and memtorch.Estimate is estimation.Estimate


@pytest.mark.parametrize("cls", REPORTS + ROWS, ids=lambda c: c.__name__)
def test_every_attribute_is_a_declared_field_and_in_to_dict_unless_it_says_not(made, cls):
    instances = made[cls]
    assert instances and all(type(x) is cls for x in instances)
    names = {f.name for f in dataclasses.fields(cls)}
    for x in instances:
        undeclared = set(vars(x)) - names
        assert not undeclared, f"{cls.__name__}: attributes set but not declared as fields: {sorted(undeclared)}"
        d = x.to_dict()
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta.get("dict") is False or (f.name.startswith("_") and not meta.get("key")):
                continue
            key = meta.get("key") or f.name
            if meta.get("omit_none") and getattr(x, key if f.name.startswith("_") else f.name) is None:
                assert key not in d
                continue
            if cls is peak.Owner and f.name == "sites_note" and x.sites is None:
                continue  # the note is about the sites: in the JSON with them (Owner._dict_more)
            assert key in d, f"{cls.__name__}.{f.name} is not in to_dict() (as {key!r})"
        assert json.loads(json.dumps(d)) == d, f"{cls.__name__}.to_dict() does not survive JSON"


# (type name, key) of a report's to_dict() that names no attribute of it, not yet fixed. The set only
# shrinks: a key that names an attribute fails the tests below until it is taken off.
KEYS_NOT_ATTRIBUTES = set()


def _report_types():
    """Every Report subclass of memtorch: those of memtorch.reports' modules (where the result types
    live, each imported here) and any other memtorch module imported already."""
    for info in pkgutil.iter_modules(reports.__path__):
        importlib.import_module(f"{reports.__name__}.{info.name}")
    found, todo = [], [Report]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("memtorch.") and sub not in found:
                found.append(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: c.__name__)


def _check_keys(cls, keys, what):
    """keys (of cls's JSON) that name no attribute of ``what`` (the class, or an instance of it), as
    KEYS_NOT_ATTRIBUTES allows."""
    missing = {(cls.__name__, k) for k in keys if not hasattr(what, k)}
    known = {(name, k) for name, k in KEYS_NOT_ATTRIBUTES if name == cls.__name__ and k in keys}
    new = sorted(k for _, k in missing - known)
    assert not new, (
        f"{cls.__name__}.to_dict() keys that name no attribute of it: {new} "
        "(add a read-only property of that name, or name the key after its attribute)"
    )
    fixed = sorted(k for _, k in known - missing)
    assert not fixed, f"{cls.__name__}: {fixed} name an attribute now: take them off KEYS_NOT_ATTRIBUTES"


@pytest.mark.parametrize("cls", REPORTS, ids=lambda c: c.__name__)
def test_every_key_of_a_reports_to_dict_names_an_attribute(made, cls):
    """report.to_dict()[key] has report.key beside it: a field, a property over a private field or a
    derived figure, or a method (AtPeak.by_kind)."""
    for x in made[cls]:
        _check_keys(cls, list(x.to_dict()), x)


@pytest.mark.parametrize("cls", _report_types(), ids=lambda c: c.__name__)
def test_every_key_a_report_type_declares_names_an_attribute(cls):
    """The same, read from the class alone (a report type with no instance above is held too): a field's
    key (field(key=...)) and a key set in _dict_more (d["key"] = ...) name a field or a class attribute."""
    fields = {f.name for f in dataclasses.fields(cls)}
    keys = [
        f.metadata.get("key") for f in dataclasses.fields(cls)
        if f.metadata.get("key") and f.metadata.get("dict", True)
    ]  # fmt: skip
    for klass in cls.__mro__:
        more = vars(klass).get("_dict_more")
        if more is None or not klass.__module__.startswith("memtorch."):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(more)))):
            if isinstance(node, ast.Assign):
                subs = [t.slice for t in node.targets if isinstance(t, ast.Subscript)]
                keys += [s.value for s in subs if isinstance(s, ast.Constant) and isinstance(s.value, str)]
    _check_keys(cls, [k for k in keys if k not in fields], cls)


def test_report_types_are_all_found():
    """_report_types() finds the reports (so a broken walk cannot pass the test above)."""
    assert set(REPORTS) <= set(_report_types())


@pytest.mark.parametrize("cls", REPORTS + ROWS, ids=lambda c: c.__name__)
def test_each_field_is_annotated_once_with_a_comment(cls):
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body
    # a ClassVar or InitVar is declared the same way (annotated, commented) but is no field
    not_fields = ("ClassVar", "dataclasses.InitVar")
    declared = [
        n.target.id for n in body if isinstance(n, ast.AnnAssign) and not ast.unparse(n.annotation).startswith(not_fields)
    ]
    assert sorted(declared) == sorted(f.name for f in dataclasses.fields(cls) if f.name in declared)
    assert len(declared) == len(set(declared))
    own = {n.target.id: n for n in body if isinstance(n, ast.AnnAssign)}
    text = textwrap.dedent("".join(lines)).splitlines()
    for name, node in own.items():
        here = text[node.end_lineno - 1]
        above = text[node.lineno - 2].strip() if node.lineno > 1 else ""
        assert "#" in here or above.startswith("#"), f"{cls.__name__}.{name} has no comment"


def test_a_field_added_is_in_to_dict_without_another_line():
    @dataclasses.dataclass(eq=False)
    class Two(Record):
        nbytes: int = field(key="bytes")  # renamed
        rate: Fraction = field(json=float)  # converted
        upper: "int | None" = field(None, omit_none=True)  # absent when None
        hidden: int = field(0, to_dict=False)  # never in the JSON
        _lazy: int = field(0, key="lazy")  # read through its property
        shape: tuple = (2, 3)  # tuples as lists

        @property
        def lazy(self):
            return self._lazy + 1

    assert Two(7, Fraction(1, 4)).to_dict() == {"bytes": 7, "rate": 0.25, "lazy": 1, "shape": [2, 3]}
    assert Two(7, Fraction(1, 4), upper=9).to_dict()["upper"] == 9


def test_print_and_the_notebook_show_to_text_and_to_html(made):
    for cls in REPORTS:
        x = made[cls][0]
        assert str(x) == x.to_text() and x.to_text().strip(), cls
        assert x._repr_html_() == x.to_html() and x.to_html().lstrip().startswith("<"), cls


def test_check_is_one_entry_point_on_the_report_base(made):
    """TrackReport, Estimate and MultiRankReport check() through Report.check, with assert_budget's verdict."""
    from memtorch.budget import assert_budget

    for cls in (tracking.TrackReport, estimation.Estimate, distributed.MultiRankReport):
        assert cls.check is Report.check, cls
    r = made[tracking.TrackReport][0]
    r.check(peak=r.peak_above_start, delta=r.delta)  # a limit equal to an exact figure passes
    limit = r.peak_above_start - 1
    with pytest.raises(memtorch.BudgetExceeded) as by_check:
        r.check(peak=limit)
    with pytest.raises(memtorch.BudgetExceeded) as by_assert:
        assert_budget(r, peak=limit)
    assert str(by_check.value) == str(by_assert.value) and by_check.value.failures == [("peak", limit + 1, limit)]
    est = made[estimation.Estimate][0]
    with pytest.raises(memtorch.BudgetExceeded, match="^delta "):
        est.check(None, est.delta - 1)  # positional: (peak, delta), as before
    with pytest.raises(TypeError, match=r"Estimate.check\(\) takes no leak budget; its budgets: peak, delta"):
        est.check(leak=1)
    multi = made[distributed.MultiRankReport][0]
    with pytest.raises(memtorch.BudgetExceeded, match="^peak "):
        multi.check(peak=multi.peak_above_start - 1)


@pytest.mark.parametrize("cls", [report.ModelMemory, leaks.LeakReport, peak.AtPeak, planning.Plan, advice.Advice])
def test_check_on_a_report_without_budgets_says_what_to_do(made, cls):
    with pytest.raises(TypeError, match=f"^{cls.__name__} has no figure a budget applies to: check\\(\\) a track"):
        made[cls][0].check(peak="1 MiB")


def test_module_row_still_unpacks_indexes_and_compares_as_its_namedtuple(made):
    row = next(m for m in made[report.ModuleRow] if m.name == "0")
    fields = ("name", "type", "own", "subtree", "parameters", "buffers", "gradients", "optimizer_state",
              "alias_of", "attributes", "shared")  # fmt: skip
    assert report.ModuleRow._fields == fields == tuple(f.name for f in dataclasses.fields(report.ModuleRow))
    name, kind, own, *rest = row
    # Linear(16, 16) under Adam: weight + bias, their gradients and two Adam moments each (+ steps)
    assert (name, kind) == ("0", "Linear") and own == row.own == row[2] and len(rest) == len(row) - 3 == 8
    assert row.parameters == (16 * 16 + 16) * 4 and row[-1] == row.shared and row[:2] == ("0", "Linear")
    assert row == tuple(row) and hash(row) == hash(tuple(row)) and row._asdict() == dict(zip(fields, row))
    assert row._replace(own=1) == (*row[:2], 1, *row[3:]) and row.own != 1
    assert row.to_dict() == row._asdict()


def test_model_memory_pickles_and_keeps_its_figures(made):
    import pickle

    mm = made[report.ModelMemory][0]
    back = pickle.loads(pickle.dumps(mm))
    assert json.dumps(back.to_dict()) == json.dumps(mm.to_dict()) and str(back) == str(mm)
    # depth cuts the rows and nothing else: depth 0 keeps the model's row
    top = mm.to_dict(depth=0)
    assert [m["name"] for m in top["modules"]] == [""] and {k: v for k, v in top.items() if k != "modules"} == {
        k: v for k, v in mm.to_dict().items() if k != "modules"
    }
