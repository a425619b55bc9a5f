"""memtorch's import graph has floors: a module imports only modules on its own floor or below.

    floor 0  vocabulary and plumbing: errors, units, words, _torch (the lazy torch loader), _C
    floor 1  the result types: memtorch.reports (the Record/Report bases and the result dataclasses),
             report.py (ModelMemory), and budget (the verdict a report's check() gives)
    floor 2  the engines that measure and build results: inspection, cpu, cuda, tracking, peak,
             leaks, estimator (estimate() and the decisions: plan, advise, fit, capacity; estimation,
             planning, advice and fitting are its first names), _inputs, _reference, _cuda_trace,
             distributed, integrations, models (a model from its name or config)
    floor 3  renderers and front ends: display, plot, mermaid, cli, pytest_plugin, __main__, and the
             package itself (memtorch/__init__.py, whose lazy loader reaches every floor)

Why this split: a result type is data a renderer reads and an engine fills, so it sits under both;
the renderers read every result type and are never needed to build one, so they sit on top; the
words and units every floor prints sit at the bottom. budget judges a report's figures against
limits and reads nothing but them, so it sits with the result types: their check() calls it
without reaching up (a Tracker passed to it is told by its ``report`` property, not by an import).

The rules, checked with ``ast`` over memtorch/**/*.py (every import, at module level or inside a
function, of a memtorch module):
- no import reaches UP a floor;
- the module-level imports have no cycle;
- an import inside a function carries a comment on its line or in the comment block right above
  it that starts with ``# lazy:`` and says why (keeping ``import memtorch`` or the pytest plugin
  torch-free and cheap, an engine loaded only on the path that needs it);
- a function-level import never hides a cycle: its target does not import its importer back at
  module level (then the lazy import would be the only thing holding the circle apart);
- nor does any import close one: counting the lazy imports too, no module reaches itself (two lazy
  imports facing each other, as memtorch.peak and memtorch._cuda_trace once had, are a cycle still:
  which of the two is below is decided, and the shared piece lives there).

The one way up: a Report's to_text()/to_html()/plot() turn to the renderer floor through the
registries in memtorch.reports (filled by display.py and plot.py when they are imported); reports
loads those two modules by name (importlib, in memtorch.reports.render) the first time a report is
rendered. That is a lookup by name, not an import statement, and it is the only one. (Chosen over
having memtorch/__init__'s lazy loader import display when a result type is first built: a report
made through ``import memtorch.tracking``, not the package's names, would then find no renderer.)
TrackReport.gather() (an engine's action kept on the report) reaches memtorch.distributed the same way:
distributed registers gather() under "gather", and is loaded by name on the first call.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "memtorch"

FLOORS = {
    0: ["errors", "units", "words", "_torch", "_C"],
    1: ["reports", "report", "budget"],
    2: [
        "inspection", "cpu", "cuda", "tracking", "peak", "leaks", "estimator", "estimation", "planning",
        "advice", "fitting", "_inputs", "_reference", "_cuda_trace", "distributed", "integrations",
        "_optimizers", "models", "_quantize", "oom",
    ],
    3: ["display", "plot", "mermaid", "cli", "pytest_plugin", "__main__", ""],
}  # fmt: skip
FLOOR = {name: floor for floor, names in FLOORS.items() for name in names}

# Violations not yet removed: (importer, imported, rule). The list only shrinks: a pair that no
# longer breaks its rule fails the test until it is taken off.
KNOWN = set()


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted):
    """Whether memtorch.x.y names a module or package (a .py file, a folder, or the _C extension)."""
    rel = pathlib.Path(*dotted.split("."))
    return (
        (ROOT / rel).with_suffix(".py").exists()
        or (ROOT / rel / "__init__.py").exists()
        or any((ROOT / rel.parent).glob(rel.name + ".*.so"))
        or (ROOT / rel).with_suffix(".pyi").exists()
    )


def _targets(module, node, is_package):
    """The memtorch modules an Import/ImportFrom node loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "memtorch"]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "memtorch":
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if _is_module(sub) else target)
    return out


def _floor_of(dotted):
    """The floor of memtorch.x (and of any module inside the package x)."""
    parts = dotted.split(".")
    key = parts[1] if len(parts) > 1 else ""
    assert key in FLOOR, f"{dotted} is on no floor: add it to FLOORS in tests/test_imports.py"
    return FLOOR[key]


def _imports():
    """[(importer, imported, line, in_function, reason comment or None)] over memtorch/**/*.py."""
    rows = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(module, node, path.name == "__init__.py")
            up, in_function = node, False
            while up in parents:
                up = parents[up]
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    in_function = True
                    break
            near = [lines[node.lineno - 1]]  # its line, then the comment block right above it
            k = node.lineno - 2
            while k >= 0 and lines[k].lstrip().startswith("#"):
                near.append(lines[k])
                k -= 1
            reason = next((line.split("# lazy:", 1)[1].strip() for line in near if "# lazy:" in line), None)
            rows += [(module, t, node.lineno, in_function, reason) for t in targets if t != module]
    return rows


IMPORTS = _imports()


def _module_level_graph():
    graph = {}
    for a, b, _, in_function, _ in IMPORTS:
        if not in_function:
            graph.setdefault(a, set()).add(b)
    return graph


def _reaches(graph, start, goal):
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo += graph.get(node, ())
    return False


def _violations():
    graph = _module_level_graph()
    found = {}
    for a, b, line, in_function, reason in IMPORTS:
        where = f"{a}:{line} imports {b}"
        if _floor_of(b) > _floor_of(a):
            found.setdefault((a, b, "up"), where + f" (floor {_floor_of(a)} -> floor {_floor_of(b)})")
        if in_function and not reason:
            found.setdefault((a, b, "no reason"), where + " inside a function with no '# lazy: why' comment")
        if in_function and _reaches(graph, b, a):
            found.setdefault((a, b, "hides a cycle"), where + f" inside a function: {b} imports {a} back")
    return found


def test_every_module_is_on_a_floor():
    for a, b, *_ in IMPORTS:
        _floor_of(a)
        _floor_of(b)
    for path in PKG.rglob("*.py"):
        _floor_of(_module_name(path))


def test_no_import_breaks_a_floor_rule():
    found = _violations()
    new = sorted(msg for key, msg in found.items() if key not in KNOWN)
    assert not new, "imports break the floors (see this file's docstring):\n" + "\n".join(new)
    gone = sorted(KNOWN - set(found))
    assert not gone, f"fixed, take them off KNOWN: {gone}"


def test_module_level_imports_have_no_cycle():
    graph = _module_level_graph()
    cycles = sorted({a for a in graph if any(_reaches(graph, b, a) for b in graph[a])})
    assert not cycles, f"module-level import cycle through: {cycles}"


def test_no_cycle_through_lazy_imports_either():
    graph = {}
    for a, b, *_ in IMPORTS:
        graph.setdefault(a, set()).add(b)
    cycles = sorted({a for a in graph if any(_reaches(graph, b, a) for b in graph[a])})
    assert not cycles, f"import cycle (lazy imports counted) through: {cycles}"


def test_the_checker_sees_what_it_checks():
    """The graph is not empty and holds imports known to be there (so a broken parser cannot pass)."""
    pairs = {(a, b, f) for a, b, _, f, _ in IMPORTS}
    assert ("memtorch.units", "memtorch.errors", False) in pairs
    assert ("memtorch.tracking", "memtorch._C", False) in pairs
    assert any(f for _, _, _, f, _ in IMPORTS)


@pytest.mark.parametrize("source, expected", [
    ("import memtorch.units\n", ["memtorch.units"]),
    ("from . import _C, units\n", ["memtorch._C", "memtorch.units"]),
    ("from .reports import Report\n", ["memtorch.reports"]),
    ("from .. import units\n", ["memtorch.units"]),
])  # fmt: skip
def test_targets_resolves_relative_imports(source, expected):
    node = ast.parse(source).body[0]
    module = "memtorch.integrations.lightning" if source.startswith("from ..") else "memtorch.tracking"
    assert _targets(module, node, False) == expected


def test_every_report_has_its_renderers():
    """Each result type's text and HTML (and plot, where it has one) are registered by the renderer
    floor, so to_text()/to_html()/plot() never import a renderer themselves."""
    from memtorch import advice, distributed, estimation, leaks, peak, planning, report, reports, tracking
    from memtorch import display, plot  # noqa: F401 - they register their renderers at import

    types = [report.ModelMemory, tracking.TrackReport, estimation.Estimate, leaks.LeakReport, peak.AtPeak,
             planning.Plan, advice.Advice, distributed.MultiRankReport]  # fmt: skip
    for cls in types:
        name = cls.__name__
        assert ("html", name) in reports._RENDERERS, name
        assert ("text", name) in reports._RENDERERS or ("lines", name) in reports._RENDERERS, name
    for name in ["ModelMemory", "TrackReport", "Estimate", "LeakReport"]:
        assert ("plot", name) in reports._RENDERERS, name


def test_render_names_a_type_with_no_renderer():
    from memtorch import reports

    class Unrendered(reports.Report):
        pass

    with pytest.raises(NotImplementedError, match="memtorch.display renders no text for Unrendered"):
        Unrendered().to_text()


# Each family of _C functions has one Python owner: only it names them on _C (others go through it).
C_OWNERS = {
    ("counters_", "scope_", "eventlog_"): "memtorch.cpu",
    ("names_walk", "modules_fingerprint", "modules_compiled", "ModuleMarks"): "memtorch.tracking",
    ("_walk", "_walker_setup"): "memtorch.inspection",
    ("alloc_replay",): "memtorch.estimator.ranks",
}
C_EXCEPTIONS = {
    # _torch hands _C torch's source folder when torch first loads (the loader is below cpu's floor)
    ("memtorch._torch", "eventlog_sites_skip"),
    # the pure-Python twin calls the C walker to compare itself with it
    ("memtorch._reference", "_walk"),
}


def test_each_family_of_C_functions_has_one_owner():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_C"):
                continue
            for prefixes, owner in C_OWNERS.items():
                if node.attr.startswith(prefixes) and module != owner and (module, node.attr) not in C_EXCEPTIONS:
                    wrong.append(f"{module}:{node.lineno} calls _C.{node.attr} (its owner is {owner})")
    assert not wrong, "\n".join(wrong)


def test_storage_helpers_and_vocabulary_are_defined_once():
    """storage_key/storage_nbytes once (two copies had drifted: one raised on a tensor whose bytes
    cannot be read), and the categories and phases only in memtorch.words (others alias it)."""
    defs, constants = {}, []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in ("storage_key", "storage_nbytes"):
                defs.setdefault(node.name.lstrip("_"), []).append(module)
            if isinstance(node, ast.Assign) and module != "memtorch.words":
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if any(n.endswith(("CATEGORIES", "PHASES")) for n in names) and not (
                    isinstance(node.value, ast.Attribute) and getattr(node.value.value, "id", None) == "words"
                ):
                    constants.append(f"{module}:{node.lineno} {names}")
    assert defs == {"storage_key": ["memtorch.leaks"], "storage_nbytes": ["memtorch.reports.leaks"]}
    assert not constants, f"define these in memtorch.words and alias them: {constants}"


_SHADOW_CHECK = """
import importlib, pkgutil, sys
import memtorch
names = [m.name for m in pkgutil.walk_packages(memtorch.__path__, "memtorch.")]
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as e:  # an optional dependency (lightning): its module is not the question
        print("skipped", name, e, file=sys.stderr)
wrong = []
for public, (modname, attr) in memtorch._EXPORTS.items():
    want = importlib.import_module("memtorch." + modname)
    if attr is not None:
        want = getattr(want, attr)
    if getattr(memtorch, public) is not want:
        wrong.append((public, repr(getattr(memtorch, public))[:80]))
print(len(names), wrong)
"""


def test_importing_a_submodule_never_shadows_a_public_name():
    """`import memtorch.x` sets the attribute x of the package to the submodule: a public function of the
    same name (memtorch.capacity was one: capacity.py) became the module after `from memtorch.capacity
    import ...`. Every submodule imported, every public name is still what memtorch exports."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHADOW_CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    count, wrong = out.stdout.strip().split(" ", 1)
    assert int(count) > 30 and wrong == "[]", out.stdout
