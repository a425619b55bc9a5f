"""memtorch's pytest plugin beside pytest-memray, on the same generated test files.

The script writes, in a temporary folder, a pytest.ini (registers both plugins'
markers, reports call-phase durations in the JUnit XML), a file of training-step
tests and a file of boundary tests, then runs pytest on them in subprocesses:

  plain     pytest -p no:memray                              (no plugin figures)
  memtorch  pytest -p no:memray -p memtorch.pytest_plugin --memtorch-save=FILE
  memray    pytest --memray --memray-bin-path DIR            (pytest-memray)

Each test carries both markers with the same budget, spelled in bytes so both
tools read it alike: @pytest.mark.memory_budget(peak=S, device="cpu") and
@pytest.mark.limit_memory(S). The plain and memray runs do not load memtorch's
plugin; the plain and memtorch runs do not load pytest-memray (it registers
itself in every pytest run of the environment).

Figures: memtorch's per-test peak from its --memtorch-save JSON; memray's from
its --memray-bin-path files: the metadata peak and the sum of its high-watermark
allocation records (what its limit_memory marker compares), read with memray's
FileReader. Rounds are interleaved (order rotated each round); a figure is
deterministic when it is the same, to the byte, in every round.

Boundary: a test allocating torch.empty(1000, 1000) (4,000,000 B) under budgets
"4 MB", "4000000 B", "3.8 MiB" and "3.8 MB", checked by each tool; the messages
are quoted from the runs. memray cannot parse "3.8 MiB" (it stops the session),
so that budget runs in a session of its own.

    python benchmarks/bench_plugin.py [--rounds 5] [--no-write] [--keep]

Needs pytest-memray (pip install pytest-memray torch==2.13.0) and the C
extension built in place.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from importlib import metadata as importlib_metadata
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import ROOT, machine, write_section  # noqa: E402
from memtorch import units  # noqa: E402

# ---------------------------------------------------------------- hand counts
# Bytes of tensors a test body holds, derived by hand (float32 = 4 B, int64 = 8 B).

# test_empty: torch.empty(1000, 1000) float32: 1000 * 1000 * 4.
EMPTY_BYTES = 1000 * 1000 * 4  # 4,000,000 B: the whole body

# test_mlp_sgd_step: nn.Sequential(Linear(784, 128), ReLU, Linear(128, 10)), batch 64, SGD.
MLP_BATCH = 64
MLP_PARAMS = 784 * 128 + 128 + 128 * 10 + 10  # 101,770 parameters
MLP_X = MLP_BATCH * 784 * 4  # 200,704 B
MLP_Y = MLP_BATCH * 8  # 512 B (int64 labels)
MLP_LOSS = 4  # the scalar loss
MLP_GRADS = MLP_PARAMS * 4  # 407,080 B: one gradient per parameter
# After loss.backward() the body holds x, y, the loss and every gradient at once
# (the graph's saved activations are gone by then), so its peak is at least:
MLP_LOWER = MLP_X + MLP_Y + MLP_LOSS + MLP_GRADS  # 608,300 B
# On top of it during backward: the gradient flowing into fc1's backward (64*128*4 =
# 32,768 B) and whatever else autograd still holds: the exact peak is the tools' job.

# test_transformer_adam_step: TransformerEncoder, 2 layers, d_model 64, 4 heads,
# feed-forward 128, batch 4 x 32 tokens, Adam (its state made by a warm-up step in
# the fixture, so the body starts with it).
# One layer: in_proj 3*64*64 + 3*64, out_proj 64*64 + 64, linear1 64*128 + 128,
# linear2 128*64 + 64, two LayerNorms 2 * (64 + 64).
TF_LAYER_PARAMS = (3 * 64 * 64 + 3 * 64) + (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64) + 2 * (64 + 64)
TF_PARAMS = 2 * TF_LAYER_PARAMS  # 66,944 parameters
TF_X = 4 * 32 * 64 * 4  # 32,768 B
TF_GRADS = TF_PARAMS * 4  # 267,776 B (zero_grad(set_to_none=True): the body makes them anew)
TF_LOWER = TF_X + 4 + TF_GRADS  # 300,548 B: x, the loss and every gradient after backward

# test_lazy_import: imports stdlib modules nobody imported yet and makes no tensor.
IMPORT_BYTES = 0
LAZY_MODULES = ["pydoc", "xml.dom.minidom", "plistlib", "mailbox"]  # none imported by pytest, torch or the plugins

# Budgets (inputs, not results): in bytes, which both tools parse to the same number.
# memtorch fails a test whose peak is > the budget, pytest-memray one whose figure is >= it.
BUDGETS = {
    "test_mlp_sgd_step": 1024 * 1024,  # 1 MiB
    "test_mlp_sgd_step_again": 1024 * 1024,  # the same test, run second: what the order changes
    "test_transformer_adam_step": 4 * 1024 * 1024,  # 4 MiB
    "test_empty": 4 * 1024 * 1024,  # 4 MiB
    "test_lazy_import": 1024 * 1024,  # 1 MiB
}
HAND = {
    "test_mlp_sgd_step": (MLP_LOWER, ">="),
    "test_mlp_sgd_step_again": (MLP_LOWER, ">="),
    "test_transformer_adam_step": (TF_LOWER, ">="),
    "test_empty": (EMPTY_BYTES, "="),
    "test_lazy_import": (IMPORT_BYTES, "="),
}
HAND_WHY = {
    "test_mlp_sgd_step": "x 200,704 + y 512 + loss 4 + gradients 407,080, live together after backward",
    "test_mlp_sgd_step_again": "the same body",
    "test_transformer_adam_step": "x 32,768 + loss 4 + gradients 267,776, live together after backward",
    "test_empty": "1000 x 1000 float32",
    "test_lazy_import": "no tensor",
}
BOUNDARY = ["4 MB", "4000000 B", "3.8 MiB", "3.8 MB"]  # the budgets tried on torch.empty(1000, 1000)

PYTEST_INI = """\
[pytest]
markers =
    memory_budget: memtorch budget (registered here for the runs without memtorch's plugin)
    limit_memory: pytest-memray budget (registered here for the runs without pytest-memray)
junit_duration_report = call
junit_family = xunit2
"""


def steps_file():
    budgets = {k: f"{v} B" for k, v in BUDGETS.items()}
    return textwrap.dedent(
        f'''\
        """Generated by benchmarks/bench_plugin.py: training-step tests under two memory plugins."""
        import sys

        import pytest
        import torch
        from torch import nn

        torch.set_num_threads(1)


        @pytest.fixture
        def mlp():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
            assert sum(p.numel() for p in model.parameters()) == {MLP_PARAMS}
            return model, torch.optim.SGD(model.parameters(), lr=0.1)


        def mlp_step(model, opt):
            x, y = torch.randn({MLP_BATCH}, 784), torch.randint(0, 10, ({MLP_BATCH},))
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


        @pytest.mark.memory_budget(peak={budgets["test_mlp_sgd_step"]!r}, device="cpu")
        @pytest.mark.limit_memory({budgets["test_mlp_sgd_step"]!r})
        def test_mlp_sgd_step(mlp):
            mlp_step(*mlp)


        @pytest.mark.memory_budget(peak={budgets["test_mlp_sgd_step_again"]!r}, device="cpu")
        @pytest.mark.limit_memory({budgets["test_mlp_sgd_step_again"]!r})
        def test_mlp_sgd_step_again(mlp):  # the same test, second in the session
            mlp_step(*mlp)


        @pytest.fixture
        def transformer():
            torch.manual_seed(0)
            layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
            model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            assert sum(p.numel() for p in model.parameters()) == {TF_PARAMS}
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            model(torch.randn(4, 32, 64)).pow(2).mean().backward()  # warm-up: Adam's state exists
            opt.step()
            opt.zero_grad(set_to_none=True)
            return model, opt


        @pytest.mark.memory_budget(peak={budgets["test_transformer_adam_step"]!r}, device="cpu")
        @pytest.mark.limit_memory({budgets["test_transformer_adam_step"]!r})
        def test_transformer_adam_step(transformer):
            model, opt = transformer
            x = torch.randn(4, 32, 64)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


        @pytest.mark.memory_budget(peak={budgets["test_empty"]!r}, device="cpu")
        @pytest.mark.limit_memory({budgets["test_empty"]!r})
        def test_empty():
            x = torch.empty(1000, 1000)
            assert x.untyped_storage().nbytes() == {EMPTY_BYTES}


        @pytest.mark.memory_budget(peak={budgets["test_lazy_import"]!r}, device="cpu")
        @pytest.mark.limit_memory({budgets["test_lazy_import"]!r})
        def test_lazy_import():
            fresh = [m for m in {LAZY_MODULES!r} if m not in sys.modules]
            assert fresh == {LAZY_MODULES!r}, "already imported: the test would not import anything"
            import mailbox, plistlib, pydoc, xml.dom.minidom  # noqa: F401,E401
        '''
    )


def boundary_name(spelled):
    return "test_empty_budget_" + re.sub(r"[^0-9A-Za-z]+", "_", spelled).strip("_")


def boundary_file():
    parts = [
        '"""Generated by benchmarks/bench_plugin.py: torch.empty(1000, 1000) = 4,000,000 B at the budget\'s edge."""',
        "import pytest",
        "import torch",
        "",
        "",
        "def test_warm_up():  # the same body, first, without a budget",
        "    x = torch.empty(1000, 1000)",
    ]
    for spelled in BOUNDARY:
        parts += [
            "",
            "",
            f'@pytest.mark.memory_budget(peak={spelled!r}, device="cpu")',
            f"@pytest.mark.limit_memory({spelled!r})",
            f"def {boundary_name(spelled)}():",
            "    x = torch.empty(1000, 1000)",
        ]
    parts += ["", "", "def test_after():  # last: did the session get this far?", "    x = torch.empty(1000, 1000)"]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------- running pytest

CONFIGS = {
    "plain": ["-p", "no:memray"],
    "memtorch": ["-p", "no:memray", "-p", "memtorch.pytest_plugin", "--memtorch-save={save}"],
    "memray": ["--memray", "--memray-bin-path={bins}"],
}
# How the command lines read in the report (the temporary paths shortened).
SHOWN = {
    "plain": "pytest -p no:memray test_steps.py",
    "memtorch": "pytest -p no:memray -p memtorch.pytest_plugin --memtorch-save=memtorch.json test_steps.py",
    "memray": "pytest --memray --memray-bin-path=bins test_steps.py",
}


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.pop("MEMRAY_RESULT_PATH", None)
    e.pop("PYTEST_ADDOPTS", None)
    e["COLUMNS"] = "10000"  # pytest's short summary quotes each failure's first line uncut
    return e


def run_pytest(tmp, tag, config, files, extra=()):
    """Run one pytest session; return dict(wall, rc, out, junit: {name: (outcome, seconds, message)})."""
    run_dir = tmp / "runs" / tag
    run_dir.mkdir(parents=True)
    fmt = {"save": run_dir / "memtorch.json", "bins": run_dir / "bins"}
    args = [a.format(**fmt) for a in CONFIGS[config]]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={run_dir / 'junit.xml'}", *args, *extra, *files]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    (run_dir / "output.txt").write_text(out)
    return {"wall": wall, "rc": proc.returncode, "out": out, "junit": read_junit(run_dir / "junit.xml"),
            "dir": run_dir}


def read_junit(path):
    results = {}
    if not path.exists():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = child.get("message") or ""
        results[case.get("name")] = (outcome, float(case.get("time") or 0.0), message)
    return results


def memtorch_figures(run):
    path = run["dir"] / "memtorch.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {nodeid.split("::")[-1]: f for nodeid, f in data.items()}


def memray_figures(run):
    """{test name: {peak, watermark, allocations, records}} from the run's memray files."""
    from memray import FileReader

    figures = {}
    meta_dir = run["dir"] / "bins" / "metadata"
    if not meta_dir.exists():
        return figures
    for meta in sorted(meta_dir.glob("*.metadata")):
        raw = json.loads(meta.read_text())
        reader = FileReader(raw["result_file"])
        records = list(reader.get_high_watermark_allocation_records(merge_threads=True))
        figures[raw["test_id"].split("::")[-1]] = {
            "peak": int(raw["peak_memory"]),
            "watermark": sum(r.size for r in records),
            "allocations": int(reader.metadata.total_allocations),
            "records": sorted(
                ((r.size, r.n_allocations, _where(r), _allocator(r)) for r in records), key=lambda t: -t[0]
            ),
        }
    return figures


def _allocator(record):
    """The allocator's name (malloc, mmap, ...): records carry its AllocatorType number."""
    from memray import AllocatorType

    try:
        return AllocatorType(record.allocator).name.lower()
    except ValueError:
        return str(record.allocator)


def _where(record):
    try:
        trace = record.stack_trace()
    except NotImplementedError:
        return "?"
    if not trace:
        return "?"
    function, file, line = trace[0]
    return f"{function} ({os.path.basename(file)}:{line})"


# ---------------------------------------------------------------- formatting


def b(n):
    return f"{n:,}"


def bu(n):
    return f"{n:,} ({units.format(n)})"


def same(values):
    """'yes' when every round gave the same bytes, else the spread."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(set(values)) == 1:
        return f"yes ({len(values)}/{len(values)} equal)"
    return f"no: {b(min(values))} to {b(max(values))} ({len(set(values))} values in {len(values)} runs)"


def said(run, name):
    """'passed', or the outcome and the test's line of pytest's short summary (-rA), verbatim."""
    outcome, _, message = run["junit"].get(name, ("missing", 0, ""))
    if outcome == "passed":
        return "passed"
    for line in run["out"].splitlines():
        m = re.match(rf"(FAILED|ERROR) \S+::{re.escape(name)} - (.*)", line)
        if m:
            return f"{outcome}: \"{md_escape(m.group(2))}\""
    return f"{outcome}: \"{md_escape(message.splitlines()[0] if message else '')}\""


def outcomes(runs, name):
    seen = [r["junit"].get(name, ("missing", 0, ""))[0] for r in runs]
    return seen[0] if len(set(seen)) == 1 else "/".join(seen)


def md_escape(text):
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the three configurations")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not write BENCHMARKS.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        memray_version = importlib_metadata.version("pytest-memray")
        memray_core = importlib_metadata.version("memray")
    except importlib_metadata.PackageNotFoundError:
        sys.exit("pytest-memray is not installed: pip install pytest-memray torch==2.13.0")
    from pytest_memray.utils import parse_memory_string  # how memray reads a budget, asked of memray itself

    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_plugin_"))
    try:
        (tmp / "pytest.ini").write_text(PYTEST_INI)
        (tmp / "test_steps.py").write_text(steps_file())
        (tmp / "test_boundary.py").write_text(boundary_file())

        names = list(BUDGETS)
        configs = list(CONFIGS)
        runs = {c: [] for c in configs}
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for c in order:
                run = run_pytest(tmp, f"r{r}-{c}", c, ["test_steps.py"])
                runs[c].append(run)
                print(f"round {r + 1}/{args.rounds} {c:9s} rc={run['rc']} {run['wall']:.2f} s", flush=True)
                if run["rc"] not in (0, 1):
                    print(run["out"][-3000:])
                    sys.exit(f"pytest ({c}) stopped with exit status {run['rc']}")

        mt = [memtorch_figures(r) for r in runs["memtorch"]]
        mr = [memray_figures(r) for r in runs["memray"]]

        # Boundary sessions.
        bnd_mt = run_pytest(tmp, "boundary-memtorch", "memtorch", ["test_boundary.py"])
        parsable = [s for s in BOUNDARY if _memray_parses(parse_memory_string, s)]
        unparsable = [s for s in BOUNDARY if s not in parsable]
        keep = ["test_warm_up"] + [boundary_name(s) for s in parsable]
        bnd_mr = run_pytest(tmp, "boundary-memray", "memray", ["test_boundary.py"], ["-k", " or ".join(keep)])
        bnd_bad = {
            s: run_pytest(tmp, f"boundary-memray-{i}", "memray", ["test_boundary.py"],
                          ["-k", f"test_warm_up or {boundary_name(s)} or test_after"])
            for i, s in enumerate(unparsable)
        }
        bnd_mt_fig = memtorch_figures(bnd_mt)
        bnd_mr_fig = memray_figures(bnd_mr)

        # ---- figures table
        lines = [
            "## pytest plugins: memtorch's memory_budget beside pytest-memray",
            "",
            f"Machine: {machine()}",
            "",
            f"Command: `python benchmarks/bench_plugin.py --rounds {args.rounds}` "
            f"(pytest-memray {memray_version}, memray {memray_core}; the whole script took "
            f"{{elapsed:.0f}} s). It writes a test file and runs pytest on it in subprocesses, "
            f"{args.rounds} interleaved rounds of: `{SHOWN['plain']}`, `{SHOWN['memtorch']}`, `{SHOWN['memray']}` "
            "(all with `-p no:cacheprovider`, in a folder with a pytest.ini of its own, torch on 1 thread). "
            "Each test carries both markers with one budget written in bytes, so both tools read the same number. "
            "Only the test body is measured by either tool (not fixtures). memray's figure is its peak for the "
            "test (`peak_memory` in its metadata; the sum of its high-watermark records, which `limit_memory` "
            "compares, is equal where the table shows one number).",
            "",
            "| test | hand-derived tensor bytes | budget | memtorch peak (last run) | same every run | memtorch verdict "
            "| memray peak (last run) | same every run | memray verdict | memray allocations in the test |",
            "|---|---:|---:|---:|---|---|---:|---|---|---:|",
        ]
        for n in names:
            hand, rel = HAND[n]
            mt_vals = [f.get(n, {}).get("peak") for f in mt]
            mr_vals = [f.get(n, {}).get("peak") for f in mr]
            wm_vals = [f.get(n, {}).get("watermark") for f in mr]
            al_vals = [f.get(n, {}).get("allocations") for f in mr]
            mr_text = bu(mr_vals[-1]) if mr_vals[-1] is not None else "n/a"
            if wm_vals != mr_vals:
                mr_text += f" (high-watermark records: {', '.join(b(v) for v in wm_vals if v is not None)})"
            hand_text = f"{'&ge; ' if rel == '>=' else ''}{b(hand)} ({HAND_WHY[n]})"
            lines.append(
                f"| `{n}` | {hand_text} | {bu(BUDGETS[n])} | {bu(mt_vals[-1]) if mt_vals[-1] is not None else 'n/a'} "
                f"| {same(mt_vals)} | {outcomes(runs['memtorch'], n)} | {mr_text} | {same(mr_vals)} "
                f"| {outcomes(runs['memray'], n)} | {', '.join(b(v) for v in al_vals if v is not None)} |"
            )
        checks = []
        for n in names:
            hand, rel = HAND[n]
            got = [f.get(n, {}).get("peak") for f in mt]
            ok = all(g is not None and (g == hand if rel == "=" else g >= hand) for g in got)
            checks.append(f"`{n}` memtorch {'=' if rel == '=' else '>='} hand count: {'yes' if ok else 'NO'}")
        lines += ["", "Against the hand counts, every run: " + "; ".join(checks) + "."]
        failed_msgs = []
        for c in ("memtorch", "memray"):
            for n in names:
                for run in runs[c]:
                    if run["junit"].get(n, ("missing",))[0] != "passed":
                        failed_msgs.append(f"{c} `{n}`: {said(run, n)}")
                        break
        if failed_msgs:
            lines += ["", "Failures (first run that failed, message verbatim): " + "; ".join(failed_msgs) + "."]

        # ---- time
        plain_wall = statistics.median(r["wall"] for r in runs["plain"])
        plain_call = statistics.median(sum(v[1] for v in r["junit"].values()) for r in runs["plain"])
        lines += [
            "",
            f"Time, median of {args.rounds} runs per configuration: the whole pytest process (start, torch import, "
            "collection, tests, report) and the call phase of the tests alone (JUnit `junit_duration_report = call`: "
            "the body with each plugin's work around it, not fixtures; memray's `limit_memory` check runs after "
            "the call phase and is only in the process time).",
            "",
            "| configuration | process wall | ratio to plain | tests' call phase (sum) | ratio to plain | "
            + " | ".join(f"`{n}` call" for n in names) + " |",
            "|---|---:|---:|---:|---:|" + "---:|" * len(names),
        ]
        for c in configs:
            wall = statistics.median(r["wall"] for r in runs[c])
            call = statistics.median(sum(v[1] for v in r["junit"].values()) for r in runs[c])
            per = [statistics.median(r["junit"].get(n, ("", 0.0, ""))[1] for r in runs[c]) for n in names]
            lines.append(
                f"| {c} | {wall:.2f} s | {wall / plain_wall:.2f}x | {call * 1000:.0f} ms | "
                f"{(call / plain_call if plain_call else float('nan')):.2f}x | "
                + " | ".join(f"{p * 1000:.0f} ms" for p in per) + " |"
            )

        # ---- boundary
        lines += [
            "",
            f"Boundary: `torch.empty(1000, 1000)` ({b(EMPTY_BYTES)} B by hand) under each budget, both markers on "
            "one test, after a first test with the same body and no budget (`test_warm_up`). memtorch fails a test "
            "whose peak is greater than the budget; pytest-memray one whose figure is greater than or equal to it. "
            "\"reads as\" is each tool's own parser (`memtorch.units.parse`, `pytest_memray.utils.parse_memory_string`). "
            f"Commands: `pytest -p no:memray -p memtorch.pytest_plugin test_boundary.py`; "
            f"`pytest --memray test_boundary.py -k '...'` once for the budgets memray parses and once per budget it "
            f"does not.",
            "",
            "| budget | memtorch reads as | memtorch peak | memtorch says | memray reads as | memray figure | memray says |",
            "|---|---:|---:|---|---:|---:|---|",
        ]
        for s in BOUNDARY:
            name = boundary_name(s)
            mt_says = said(bnd_mt, name)
            mt_peak = bnd_mt_fig.get(name, {}).get("peak")
            if s in parsable:
                mr_reads = bu(int(parse_memory_string(s)))
                mr_says = said(bnd_mr, name)
                fig = bnd_mr_fig.get(name, {}).get("peak")
            else:
                run = bnd_bad[s]
                mr_reads = "error"
                err = [ln for ln in run["out"].splitlines() if ln.startswith("INTERNALERROR>") and "Error" in ln]
                summary = [ln for ln in run["out"].splitlines() if re.search(r"\b(passed|failed|error)\b.* in ", ln)]
                ran = [n for n in read_junit(run["dir"] / "junit.xml") if n != "internal"]
                mr_says = (
                    f"exit status {run['rc']}; `{md_escape(err[-1]) if err else '?'}`; session summary "
                    f"`{md_escape(summary[-1].strip('= ')) if summary else '?'}`; of the 3 tests selected "
                    f"(`test_warm_up`, this one, `test_after`) the JUnit report has {', '.join(ran) or 'none'}"
                )
                fig = memray_figures(run).get(name, {}).get("peak")
            lines.append(
                f"| \"{s}\" | {bu(units.parse(s))} | {b(mt_peak) if mt_peak is not None else 'n/a'} | {mt_says} "
                f"| {mr_reads} | {b(fig) if fig is not None else 'n/a'} | {mr_says} |"
            )
        warm_mt = bnd_mt_fig.get("test_warm_up")
        warm_mr = bnd_mr_fig.get("test_warm_up", {}).get("peak")
        lines += [
            "",
            f"`test_warm_up` (same body, no budget, first test of its session): memray "
            f"{b(warm_mr) if warm_mr is not None else 'n/a'} B"
            + (f", memtorch {b(warm_mt['peak'])} B" if warm_mt else " (memtorch tracks only budgeted tests)")
            + ".",
        ]

        # ---- what memray counted
        empty = mr[-1].get("test_empty")
        imp = mr[-1].get("test_lazy_import")
        notes = []
        if empty:
            recs = "; ".join(f"{b(size)} B in {n_alloc} allocation(s) at {where}"
                             for size, n_alloc, where, _ in empty["records"][:3])
            notes.append(
                f"- memray at `test_empty`'s high watermark (last run): {recs}. Over the "
                f"{b(EMPTY_BYTES)} B storage: {b(empty['peak'] - EMPTY_BYTES)} B of non-tensor heap."
            )
        if imp:
            recs = "; ".join(f"{b(size)} B at {where}" for size, _, where, _ in imp["records"][:3])
            notes.append(
                f"- `test_lazy_import` makes no tensor: memtorch {b(mt[-1].get('test_lazy_import', {}).get('peak', -1))} B, "
                f"memray {b(imp['peak'])} B ({imp['allocations']} allocations; largest: {recs}). memray measures the "
                "process heap, so a first import, a cache filled or a module loaded lazily inside a test counts "
                "against its budget."
            )
        first, again = mr[-1].get("test_mlp_sgd_step"), mr[-1].get("test_mlp_sgd_step_again")
        mt_first = mt[-1].get("test_mlp_sgd_step", {}).get("peak")
        mt_again = mt[-1].get("test_mlp_sgd_step_again", {}).get("peak")
        if first and again:
            recs = "; ".join(f"{b(size)} B in {n_alloc} allocation(s) at {where}"
                             for size, n_alloc, where, _ in first["records"][:4])
            notes.append(
                f"- The same MLP step, first and second test of the session (last run): memtorch "
                f"{b(mt_first) if mt_first is not None else 'n/a'} and {b(mt_again) if mt_again is not None else 'n/a'} B; "
                f"memray {b(first['peak'])} and {b(again['peak'])} B. memray's largest high-watermark records "
                f"for the first: {recs}."
            )
        for n in names:
            note = varying_note(n, mr)
            if note:
                notes.append(note)
        bud = [bnd_mr_fig.get(boundary_name(s), {}).get("peak") for s in parsable]
        bud = [v for v in bud if v is not None]
        if warm_mr is not None and bud:
            notes.append(
                f"- Boundary session: `test_warm_up` (first test, same body) {b(warm_mr)} B in memray, the budgeted "
                f"tests after it {', '.join(b(v) for v in bud)} B; memtorch gives "
                f"{', '.join(b(bnd_mt_fig[boundary_name(s)]['peak']) for s in BOUNDARY if boundary_name(s) in bnd_mt_fig)} B "
                "for the budgeted tests."
            )
        lines += ["", "What memray counted (from its files):", ""] + notes
        elapsed = time.perf_counter() - t_start
        markdown = "\n".join(lines).replace("{elapsed:.0f}", f"{elapsed:.0f}")
        print(markdown)
        if not args.no_write:
            write_section("plugin", markdown)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def varying_note(name, runs):
    """For a test whose memray figure differs between runs: which records make the difference, or None."""
    per_run = [(f[name]["peak"], i) for i, f in enumerate(runs) if name in f]
    if len({p for p, _ in per_run}) < 2:
        return None
    (lo, i_lo), (hi, i_hi) = min(per_run), max(per_run)
    extra = {}
    for sign, i in ((1, i_hi), (-1, i_lo)):
        for size, _, where, alloc in runs[i][name]["records"]:
            extra[(where, alloc)] = extra.get((where, alloc), 0) + sign * size
    top = sorted(((v, k) for k, v in extra.items() if v > 0), reverse=True)[:3]
    return (
        f"- `{name}` varies in memray: {b(lo)} B (run {i_lo + 1}) against {b(hi)} B (run {i_hi + 1}), "
        f"{b(hi - lo)} B more; what the larger run holds at its high watermark beyond the smaller one: "
        + ("; ".join(f"{b(v)} B at {where} ({alloc})" for v, (where, alloc) in top) or "nothing by location")
        + "."
    )


def _memray_parses(parse, spelled):
    try:
        parse(spelled)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
