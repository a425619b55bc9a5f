"""Static typing: editors and mypy see memtorch's public API with real types.

memtorch/__init__.py exports lazily (a module __getattr__), which hides every
name from type checkers; memtorch/__init__.pyi declares them (and _C.pyi the C
extension's). Every other module carries its own types inline: report.py,
tracking.py, units.py, cpu.py and cuda.py once had stubs beside them, now gone.
These tests keep the package stub complete (every export declared), keep every
public function, method and property of those modules annotated (each argument
and the return), and run mypy on an example that uses the public API.
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
# the modules whose types are inline (their stubs removed), and where their code lives: the result
# types moved to memtorch/reports and the old modules re-export them
ANNOTATED = {
    "report": ["reports/model"],
    "tracking": ["tracking", "reports/track", "reports/leaks"],
    "units": ["units"],
    "cpu": ["cpu"],
    "cuda": ["cuda"],
}
# the only stubs left: code that cannot carry its own types (the C extension, the lazy package)
STUBS = {"__init__.pyi", "_C.pyi"}
DUNDERS = ("__init__", "__enter__", "__exit__", "__call__", "__str__", "_repr_html_")


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


def _unannotated(path):
    """'where name: [what lacks a type]' for each public function, method and property of a module."""
    tree = ast.parse(path.read_text())
    out = []

    def check(node, owner):
        if node.name.startswith("_") and node.name not in DUNDERS:
            return
        a = node.args
        args = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
        if owner and args and args[0].arg in ("self", "cls"):
            args = args[1:]
        missing = [x.arg for x in args if x.annotation is None] + (["return"] if node.returns is None else [])
        if missing:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}{node.name}: {missing}")

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            check(node, "")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    check(item, node.name + ".")
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


def test_only_the_stubs_code_cannot_replace_remain():
    assert {p.name for p in PKG.rglob("*.pyi")} == STUBS


@pytest.mark.parametrize("module", sorted(ANNOTATED))
def test_public_api_is_annotated_inline(module):
    missing = [line for code in ANNOTATED[module] for line in _unannotated(PKG / f"{code}.py")]
    assert not missing, "annotate (each argument and the return):\n" + "\n".join(missing)


def test_the_annotation_check_sees_a_missing_annotation(tmp_path):
    """The check above fails where it should: an argument, a return, a method; private names are free."""
    (tmp_path / "m.py").write_text(
        "def ok(a: int) -> int: ...\ndef no_arg(a) -> int: ...\ndef no_ret(a: int): ...\n"
        "def _private(a): ...\nclass C:\n    def m(self, b: str): ...\n    def _p(self, x): ...\n"
    )
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = _unannotated(tmp_path / "m.py")
    finally:
        ROOT = root
    assert found == ["m.py:2 no_arg: ['a']", "m.py:3 no_ret: ['return']", "m.py:6 C.m: ['return']"]


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
    "memtorch.reports.model.ModelMemory",
    "builtins.int",
    "builtins.dict[builtins.str, builtins.int]",
    "builtins.list[builtins.tuple[builtins.str, ...]]",
    "builtins.int",
    "builtins.int",
    "builtins.str",
    "builtins.int",
    "builtins.str",
    "memtorch.tracking.Tracker",
    "memtorch.reports.track.TrackReport",
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
