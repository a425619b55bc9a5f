"""Textual checks on src/ (in the manner of msgspec's test_cpylint.py)."""

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
C_FILES = sorted(SRC.glob("*.c"))
ALL_FILES = C_FILES + sorted(SRC.glob("*.h"))


def _code(path):
    """The file's text with comments and string literals blanked (line numbers kept)."""
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def test_there_is_c_to_lint():
    assert C_FILES, "no C sources found"


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_purpose_comment_first(path):
    first = path.read_text().lstrip().splitlines()[0]
    assert first.startswith("/*") and path.name in first, f"{path.name} must start with '/* {path.name}: <purpose> */'"


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_no_private_python_api(path):
    hits = [
        (i + 1, line.strip())
        for i, line in enumerate(_code(path).splitlines())
        if re.search(r"\b_Py[A-Za-z]", line)
    ]
    assert not hits, f"private CPython API (_Py*) used in {path.name}: {hits}"


@pytest.mark.parametrize("path", C_FILES, ids=lambda p: p.name)
def test_recursion_guards_paired(path):
    code = _code(path)
    enter = len(re.findall(r"\bPy_EnterRecursiveCall\s*\(", code))
    leave = len(re.findall(r"\bPy_LeaveRecursiveCall\s*\(", code))
    assert enter == leave, f"{path.name}: {enter} Py_EnterRecursiveCall vs {leave} Py_LeaveRecursiveCall"


@pytest.mark.parametrize("path", C_FILES, ids=lambda p: p.name)
def test_pyerr_clear_is_explained(path):
    """Every PyErr_Clear() must have a comment on its line or the line above saying why."""
    lines = path.read_text().splitlines()
    bad = []
    for i, line in enumerate(lines):
        if "PyErr_Clear()" in line and not line.strip().startswith(("/*", "*")):
            context = line + (lines[i - 1] if i else "")
            if "/*" not in context and "*/" not in context and "//" not in context:
                bad.append(i + 1)
    assert not bad, f"{path.name}: PyErr_Clear() without a comment saying why, lines {bad}"


@pytest.mark.parametrize("path", C_FILES, ids=lambda p: p.name)
def test_no_user_facing_size_formatting(path):
    """Mechanism in C, policy in Python: no unit strings in C."""
    text = path.read_text()
    hits = re.findall(r'"[^"\n]*\b(?:KiB|MiB|GiB|kB|MB|GB)\b[^"\n]*"', text)
    assert not hits, f"{path.name} formats sizes: {hits}"


@pytest.mark.parametrize("path", C_FILES, ids=lambda p: p.name)
def test_method_docstrings_have_signature(path):
    """Every PyDoc_STRVAR of a function starts with a 'name($module, ...)\\n--\\n\\n' header."""
    text = path.read_text()
    for m in re.finditer(r"PyDoc_STRVAR\(\s*(\w+)\s*,\s*((?:\"(?:\\.|[^\"\\])*\"\s*)+)\)", text):
        body = "".join(re.findall(r'"((?:\\.|[^"\\])*)"', m.group(2)))
        if body.startswith("memtorch") or "$" not in body and "--" not in body and "(" not in body.split("\\n")[0]:
            continue  # module or type docstrings
        assert re.match(r"^\w+\(\$module.*\)\\n--\\n\\n", body), f"{path.name}: {m.group(1)} lacks a signature header"


@pytest.mark.parametrize("path", C_FILES, ids=lambda p: p.name)
def test_single_error_label_per_function(path):
    """One error exit per function: no function has two distinct error-ish labels."""
    code = _code(path)
    # split at top-level function bodies: a line starting with '{' after a signature
    bodies = re.split(r"\n}\n", code)
    for body in bodies:
        labels = re.findall(r"^\s*(error\w*|fail\w*|cleanup\w*)\s*:", body, flags=re.M)
        assert len(labels) <= 1 or set(labels) == {"done", "error"}, f"{path.name}: several error labels {labels}"


# ---------------------------------------------------------------- issue 10 bug classes
def test_sizes_are_multiplied_with_an_overflow_check():
    """numel * itemsize wraps silently (CPython builds with -fwrapv, so UBSan
    is blind to it): every product of an element count goes through
    __builtin_mul_overflow."""
    code = _code(SRC / "walker.c")
    bad = [line.strip() for line in code.splitlines() if re.search(r"numel\s*\*|\*\s*w->itemsize", line)]
    assert not bad, bad
    assert "__builtin_mul_overflow" in code


def test_no_fixed_size_tables_indexed_by_walk_slots():
    """A side table of fixed size (MT_MAX_DTYPES entries) turned the 1,025th
    NumPy dtype into an OverflowError: per-slot arrays grow."""
    code = _code(SRC / "walker.c")
    assert not re.search(r"\w+\s+\w+\[MT_MAX_\w+\]\s*;", code)


def test_names_are_not_read_borrowed_across_getattr():
    """A key borrowed from PyDict_Next handed to PyObject_GetAttr, which runs
    properties (user code that may empty the dict and free the key), then
    read again: the use-after-free of issue 10 (dataclass field names). Names
    for getattr come from a container the function owns (a tuple or a copy)."""
    code = _code(SRC / "walker.c")
    loops = list(re.finditer(r"while \(PyDict_Next\([^,]+, &\w+, &(\w+), &\w+\)\) \{", code))
    assert loops
    for m in loops:
        key, body, depth = m.group(1), code[m.end() :], 1
        for i, ch in enumerate(body):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                body = body[:i]
                break
        assert not re.search(rf"PyObject_GetAttr\(\w+, {key}\)", body), (
            f"PyObject_GetAttr with the borrowed PyDict_Next key {key!r}: hold a reference first"
        )
