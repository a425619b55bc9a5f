"""Static typing: editors and mypy see memtorch's public API with real types.

memtorch/__init__.py exports lazily (a module __getattr__), which hides every
name from type checkers; memtorch/__init__.pyi declares them, and stubs beside
report.py, tracking.py, units.py, cpu.py and cuda.py give their figures real types. These tests
keep the stubs complete (every exported or public name declared) and run mypy
on an example that uses the public API.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import memtorch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "memtorch"
STUBBED = ("report", "tracking", "units", "cpu", "cuda")
# where a stubbed module's code lives (the result types moved to memtorch/reports; the old module re-exports them)
CODE = {"report": ["reports/model"], "tracking": ["tracking", "reports/track"]}


def _declared(tree):
    """Names a stub declares at module level: defs, classes, annotated names, imports `as`."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname for a in node.names if a.asname}
    return names


def _class_members(cls):
    """Public methods, properties and attributes of a class: defs, self.x assignments, __slots__."""
    members = set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef):
            members.add(item.name)
            for sub in ast.walk(item):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    members.add(sub.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            for t in item.targets:
                if isinstance(t, ast.Name) and t.id == "__slots__":
                    members |= set(ast.literal_eval(item.value))
                elif isinstance(t, ast.Name):
                    members.add(t.id)
    return {
        m
        for m in members
        if not m.startswith("_") or m in ("_repr_html_", "__call__", "__enter__", "__exit__")
    }


def _public(tree):
    """{name: members or None} for the public module-level functions, classes and constants."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            out[node.name] = _class_members(node)
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            out[node.name] = None
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and not t.id.startswith("_") and t.id.isupper():
                    out[t.id] = None
    return out


def test_package_stub_declares_every_export():
    tree = ast.parse((PKG / "__init__.pyi").read_text())
    declared = _declared(tree)
    missing = sorted(set(memtorch._EXPORTS) - declared)
    lines = []
    for name in missing:
        mod, attr = memtorch._EXPORTS[name]
        lines.append(
            f"from . import {mod} as {name}" if attr is None else f"from .{mod} import {attr} as {name}"
        )
    assert not missing, "memtorch/__init__.pyi does not declare, add:\n" + "\n".join(lines)
    assert {"__version__", "__all__"} <= declared


@pytest.mark.parametrize("module", STUBBED)
def test_module_stub_declares_every_public_name(module):
    impl = {}
    for code in CODE.get(module, [module]):
        impl.update(_public(ast.parse((PKG / f"{code}.py").read_text())))
    stub_tree = ast.parse((PKG / f"{module}.pyi").read_text())
    declared = _declared(stub_tree)
    stub_classes = {n.name: _class_members(n) for n in stub_tree.body if isinstance(n, ast.ClassDef)}
    missing = [name for name in impl if name not in declared]
    for name, members in impl.items():
        if members is not None and name in stub_classes:
            missing += [f"{name}.{m}" for m in sorted(members - stub_classes[name])]
    assert not missing, f"memtorch/{module}.pyi does not declare: {', '.join(missing)}"


EXAMPLE = """
import torch
import memtorch

model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
mm = memtorch.inspect(model)
reveal_type(mm)
reveal_type(mm.total)
reveal_type(mm.by_dtype)
reveal_type(mm.shared)
reveal_type(mm.modules[0].subtree)
reveal_type(memtorch.sizeof([torch.zeros(3)]).total)
reveal_type(memtorch.diagram(model, kind="er", depth=2))
reveal_type(memtorch.units.parse("64 MiB"))
reveal_type(memtorch.units.format(1536))
with memtorch.track(model) as t:
    model(torch.zeros(1, 4)).sum().backward()
reveal_type(t)
reveal_type(t.report)
reveal_type(t.report.peak_above_start)
reveal_type(memtorch.cpu.allocated())
with memtorch.cpu.Scope() as s:
    torch.zeros(10)
reveal_type(s.peak_above_start)
reveal_type(memtorch.cuda.mem_info())
memtorch.assert_budget(t.report, peak="64 MiB")
try:
    t.report.check(peak=1 << 20)
except memtorch.BudgetExceeded as e:
    reveal_type(e)
"""

EXPECTED = [
    "memtorch.report.ModelMemory",
    "builtins.int",
    "builtins.dict[builtins.str, builtins.int]",
    "builtins.list[builtins.tuple[builtins.str, ...]]",
    "builtins.int",
    "builtins.int",
    "builtins.str",
    "builtins.int",
    "builtins.str",
    "memtorch.tracking.Tracker",
    "memtorch.tracking.TrackReport",
    "builtins.int",
    "builtins.int",
    "builtins.int",
    "tuple[builtins.int, builtins.int]",
    "memtorch.errors.BudgetExceeded",
]

MISTAKES = """
import torch
import memtorch

model = torch.nn.Linear(4, 2)
memtorch.inspect(model).total.upper()
memtorch.diagram(model, depth="2")
memtorch.units.parse(b"64 MiB")
"""


@pytest.mark.slow
def test_mypy_sees_real_types(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    (tmp_path / "uses_memtorch.py").write_text(EXAMPLE)
    (tmp_path / "mistakes.py").write_text(MISTAKES)
    # mypy cannot follow setuptools' editable-install import hook: point it at the source tree.
    # torch is not analysed (slow, and not what is tested here): its names are Any to mypy.
    (tmp_path / "mypy.ini").write_text(
        textwrap.dedent(f"""
        [mypy]
        mypy_path = {ROOT}
        show_traceback = True
        [mypy-torch.*]
        follow_imports = skip
        """)
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONMALLOC", "MYPYPATH")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            os.devnull,
            "--show-error-codes",
            "--no-error-summary",
            "--show-absolute-path",
            "uses_memtorch.py",
            "mistakes.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    revealed = [
        m.group(1) for m in re.finditer(r'uses_memtorch\.py:\d+: note: Revealed type is "([^"]+)"', out)
    ]
    # mypy may print builtins without their module: compare both spellings.
    assert [r.replace("builtins.", "") for r in revealed] == [e.replace("builtins.", "") for e in EXPECTED], (
        out
    )
    assert "uses_memtorch.py" not in "".join(line for line in out.splitlines(True) if ": error:" in line), out
    errors = [line for line in out.splitlines() if "mistakes.py" in line and ": error:" in line]
    assert len(errors) == 3, out
    assert '"int" has no attribute "upper"' in errors[0]
    assert 'Argument "depth" to "diagram" has incompatible type "str"' in errors[1]
    assert 'Argument 1 to "parse" has incompatible type "bytes"' in errors[2]
    assert proc.returncode == 1, out


def test_namedtuple_stubs_declare_every_field():
    """A NamedTuple stub lists the namedtuple's fields in order (report.pyi's ModuleRow once lacked two)."""
    from memtorch import report

    stub = ast.parse((PKG / "report.pyi").read_text())
    cls = next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "ModuleRow")
    declared = tuple(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign))
    assert declared == report.ModuleRow._fields
