"""Golden text files: every report kind rendered by memtorch.display, compared with tests/golden/*.txt.

One file per report kind and representative model (tests/golden/<kind>-<model>.txt; the models are in
tests/golden_models.py). Each test builds the report, renders ``to_text()`` and compares it with the
file; it also holds ``str(report) == report.to_text()``, that the HTML (``to_html()`` and
``_repr_html_()``) shows every figure and module name of the text, and that ``to_dict()`` is JSON with
the same totals as the report. The figures are those of torch's CPU build (a CPU track() is exact
to the byte; estimate, plan and advise are dry runs whose figures depend only on shapes and dtypes).

Regenerate the files after a deliberate change of what a report prints, and review their diff:

    python -m pytest tests/test_golden.py --update-golden

Besides the reports of memtorch's calls on the CPU: a Tracker (what a notebook shows for ``t``) of a
step with torch.utils.checkpoint; a CUDA at_peak replayed from a shipped H200 trace (tests/data/h200,
the hooks' marks made from the trace as tests/test_cuda_at_peak.py makes them; its peak is the
device's own max_memory_allocated()); a checkpointed and a sharded (zero3 on 2 ranks) estimate; the
Mermaid class and ER diagrams (plain text: no HTML of their own; checked against the CLI's output).

What is not golden: wall-clock times. A track() block's ``seconds`` and its phases' ``seconds`` and a
plan's ``seconds`` are the only figures of these reports that vary between runs; the builders below set
them to fixed values (``_fix_times``) before rendering, so the files show how a time is printed without
recording the clock. Nothing else is rewritten.

The reports of a track() block (track, at_peak, leak, multirank, breakdown) are built in a child
interpreter that starts counting (memtorch.cpu.start()) before it builds anything: a block's absolute
figures (start, end, peak, the owners at the peak) count every live tensor allocated since counting
began, so in the test process they would depend on which tests ran before. In the child they are the
block's own model and batch: start = the MLP's parameters (64*128 + 128 + 128*10 + 10 float32 =
38,440 B) + the batch (8*64 float32 = 2,048 B) = 40,488 B, checked below.
"""

import gc
import html
import json
import os
import subprocess
import pathlib
import re
import sys

import pytest
import torch

import memtorch
from memtorch import budget, distributed

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
sys.path.insert(0, str(HERE))
import golden_models as gm  # noqa: E402

BLOCK_SECONDS = 0.25  # what _fix_times writes: the block's wall time
PHASE_SECONDS = 0.0625  # each phase's


def _fix_times(report):
    """The wall-clock fields set to fixed values (see the module docstring); returns the report."""
    if hasattr(report, "seconds"):
        report.seconds = BLOCK_SECONDS
    for p in (getattr(report, "phases", None) or {}).values():
        if hasattr(p, "seconds"):
            p.seconds = PHASE_SECONDS
    return report


def track_mlp(leak=False):
    gc.collect()  # the previous block's model and optimizer gone: each block starts from the same bytes
    return _track_mlp(leak)


def _track_mlp(leak):
    """Three Adam steps of the MLP on a batch of 8 (t.step() after each); leak=True keeps each loss."""
    model = gm.mlp()
    opt = torch.optim.Adam(model.parameters())
    x = torch.ones(8, 64)
    kept = []
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(3):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if leak:
                kept.append(loss)  # the graph's output, kept: a leak of one scalar per step
            t.step()
    report = _fix_times(t.report)
    del kept
    return report


def tracker_checkpointed():
    """The Tracker (what a notebook shows for ``t``) of three Adam steps of golden_models.Checkpointed:
    two blocks under torch.utils.checkpoint, recomputed in backward."""
    gc.collect()
    model = gm.mlp_checkpointed()
    opt = torch.optim.Adam(model.parameters())
    x = torch.ones(8, 64)
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t.step()
    _fix_times(t.report)  # the Tracker shows this report: its times fixed in place
    return t


def multi_rank_mlp():
    """Two ranks' figures as gather() makes them (memtorch.distributed.figures, through JSON): rank 0 the
    MLP's step, rank 1 the same step with the leak."""
    ranks = []
    for rank, report in enumerate((track_mlp(), track_mlp(leak=True))):
        d = json.loads(json.dumps(distributed.figures(report)))
        d["rank"] = rank
        ranks.append(distributed.RankReport(d))
    return distributed.MultiRankReport(ranks)


def plan_gpt2():
    p = memtorch.plan(gm.gpt2_2(), gm.lm_batch(), **PLAN_KW)
    return _fix_times(p)


PLAN_KW = dict(device_memory="69 MiB", world_sizes=[1, 2], shardings=["ddp", "zero3"], precisions=["fp32"],
               checkpointing=[None], reserve="0 B", device="cuda")  # fmt: skip
ADVISE_KW = dict(optimizer="adamw", budget="4 MiB", reserve=0, device="cuda")
ESTIMATE_KW = dict(device="cpu")


# kind -> (model, builder of the report): built in a child interpreter (see the module docstring)
TRACKED = {
    "track": ("mlp_adam", lambda: track_mlp()),
    "at_peak": ("mlp_adam", lambda: track_mlp().at_peak),
    "leak": ("mlp_adam_kept_loss", lambda: track_mlp(leak=True).leak),
    "multirank": ("mlp_adam", multi_rank_mlp),
    "tracker": ("mlp_checkpointed_adam", tracker_checkpointed),
}
MLP_START = (64 * 128 + 128 + 128 * 10 + 10) * 4 + 8 * 64 * 4  # parameters 38,440 + batch 2,048 = 40,488 bytes


def child_main():
    """In the child: every TRACKED report built and checked (check_same_content), its text and the
    breakdown's as JSON on stdout; an assertion that fails is reported as the kind's error."""
    import traceback

    memtorch.cpu.start()
    out = {}
    for kind, (_, build) in TRACKED.items():
        try:
            report = build()
            text = report.to_text()
            assert str(report) == text, "str(report) != report.to_text()"
            if isinstance(report, memtorch.tracking.Tracker):  # the Tracker shows its report, as it is
                assert text == report.report.to_text(), "the Tracker's text is not its report's"
                assert report.to_html() == report._repr_html_() == report.report.to_html()
                report = report.report
            check_same_content(report, text)
            out[kind] = {"text": text, "error": None}
            if kind == "track":
                out["breakdown"] = {"text": budget.breakdown(report), "error": None}
                out["start"] = report.start
        except Exception:
            out[kind] = {"text": None, "error": traceback.format_exc()}
    sys.stdout.write(json.dumps(out))


@pytest.fixture(scope="module")
def tracked():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONMALLOC")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_golden; test_golden.child_main()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TRACKED) + ["breakdown"])
def test_golden_tracked(request, tracked, kind):
    """The reports of a track() block (and memtorch.budget.breakdown's text of it: text only)."""
    got = tracked[kind]
    assert got["error"] is None, got["error"]
    model = TRACKED[kind][0] if kind in TRACKED else "mlp_adam"
    check_golden(request, golden_path(kind, model), got["text"])


@pytest.mark.slow
def test_tracked_start_is_the_model_and_batch(tracked):
    """The child's block starts with its own model and batch only (see the module docstring)."""
    assert tracked["start"] == MLP_START


# kind -> (model, builder of the report, whether it is slow): built here (no counters read)
CASES = {
    "inspect": ("gpt2_32", lambda: memtorch.inspect(gm.gpt2_32()), False),
    "estimate": ("gpt2_32", lambda: memtorch.estimate(gm.gpt2_32(), gm.lm_batch(), **ESTIMATE_KW), True),
    "plan": ("gpt2_2", plan_gpt2, True),
    "advise": ("gpt2_2", lambda: memtorch.advise(gm.gpt2_2(), gm.lm_batch(), **ADVISE_KW), True),
    # the GPT-2 blocks recomputed in backward (torch.utils.checkpoint), on the CPU's rules
    "estimate_checkpointed": ("gpt2_2", lambda: memtorch.estimate(
        gm.gpt2_2(), gm.lm_batch(), device="cpu", checkpointing="blocks"), True),  # fmt: skip
    # per rank on 2 GPUs, FSDP2 (zero3): the per-rank table and the CUDA model's notes
    "estimate_zero3": ("gpt2_2", lambda: memtorch.estimate(
        gm.gpt2_2(), gm.lm_batch(), device="cuda", world_size=2, sharding="zero3"), True),  # fmt: skip
    # a CUDA block's owners at its peak, from the shipped H200 trace of the MLP's two Adam steps
    "at_peak_cuda": ("mlp_fp32_h200", lambda: cuda_at_peak_mlp(), False),
}


def cuda_at_peak_mlp():
    """AtPeak of tests/data/h200/mlp-fp32 (two Adam steps of Linear(1024, 4096), ReLU, Linear(4096, 4096),
    ReLU, Linear(4096, 1000) on an H200), replayed from the allocator's history as a CUDA track() block
    does, the hooks' marks and names made from the trace as tests/test_cuda_at_peak.py makes them (its
    hand counts check the owners; here: the peak is the device's own max_memory_allocated())."""
    import test_cuda_at_peak as tc

    snap, marks, walks, rows = tc._synth("mlp-fp32", tc._mlp_rows)
    start = sum(b for _, b, _, _ in tc.ct.replay(snap).pre_live)
    true_peak = tc._truth("mlp-fp32")["true_peak"]
    at = tc.ct.attribute_cuda(snap, 0, start, true_peak, True, marks, walks, rows, workspaces=tc.WS)
    assert at.exact and at.peak == at.total == true_peak, (at.notes, at.peak, true_peak)
    return at


def _case(kind):
    model, _, slow = CASES[kind]
    return pytest.param(kind, id=f"{kind}-{model}", marks=[pytest.mark.slow] if slow else [])


def golden_path(kind, model):
    return GOLDEN / f"{kind}-{model}.txt"


def check_golden(request, path, text):
    """text == the file's, or (--update-golden) the file rewritten."""
    text = text if text.endswith("\n") else text + "\n"
    if request.config.getoption("--update-golden"):
        path.parent.mkdir(exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"{path.name} is missing: run pytest {__file__} --update-golden and review it"
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"{path.name} differs (pytest --update-golden rewrites it; review the diff)"


# ---------------------------------------------------------------- text, HTML and JSON agree

# a figure as the renderers print it: a size with its unit, a count with separators, a percentage,
# a time; signed or not
_FIGURE = re.compile(
    r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?: ?(?:B|KiB|MiB|GiB|TiB|kB|MB|GB|ms|s|µs)\b|%)?"
)


def figures(text):
    """The set of figures (numbers with their unit) in a text."""
    return {m.group(0).lstrip("+") for m in _FIGURE.finditer(text)}


def html_text(markup):
    """The text a browser shows: tags dropped (each as a space), entities decoded."""
    markup = re.sub(r"<(script|style)\b.*?</\1>", " ", markup, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", markup))


def module_names(report):
    """The module names a report's rows show (their last dotted part, as the folded tree labels them)."""
    rows = getattr(report, "modules", None) or []
    names = set()
    for r in rows:
        name = r.name if hasattr(r, "name") else r.get("name", "")
        if name:
            names.add(name.rsplit(".", 1)[-1])
    return names


def check_same_content(report, text):
    """The HTML shows every figure and module name of the text; to_dict() is JSON with the same totals."""
    markup = report.to_html()
    assert report._repr_html_() == markup
    shown = html_text(markup)
    missing = figures(text) - figures(shown)
    assert not missing, f"figures in the text but not in the HTML: {sorted(missing)}"
    names = {n for n in module_names(report) if n in text}
    absent = {n for n in names if n not in shown}
    assert not absent, f"module names in the text but not in the HTML: {sorted(absent)}"
    to_dict = getattr(report, "to_dict", None)
    assert to_dict is not None, f"{type(report).__name__} has no to_dict()"
    d = json.loads(json.dumps(to_dict()))
    compared = []
    for key in ("peak", "total", "peak_above_start", "delta", "start", "end", "device_memory", "steady"):
        value = getattr(report, key, None)
        if key in d and isinstance(value, int) and not isinstance(value, bool):
            assert d[key] == value, key
            compared.append(key)
    if hasattr(report, "per_step"):  # a LeakReport: its rate, exactly
        assert d["per_step_fraction"] == [report.per_step.numerator, report.per_step.denominator]
        compared.append("per_step")
    if "owners" in d:  # an AtPeak: the owners add up to the peak, in the JSON as in the report
        assert sum(o["bytes"] for o in d["owners"]) == report.peak
    if "options" in d:  # a Plan: each option's peak
        assert [o["peak"] for o in d["options"]] == [o.peak for o in report.options]
        compared.append("options")
    if "suggestions" in d:  # an Advice: each suggestion's saving
        assert [s["saves"] for s in d["suggestions"]] == [s.saves for s in report.suggestions]
        compared.append("suggestions")
    assert compared, f"no total of {type(report).__name__} compared with its to_dict(): {sorted(d)}"
    return d


@pytest.mark.parametrize("kind", [_case(k) for k in CASES])
def test_golden(request, kind):
    model, build, _ = CASES[kind]
    report = build()
    text = report.to_text()
    assert str(report) == text
    check_golden(request, golden_path(kind, model), text)
    check_same_content(report, text)


@pytest.mark.parametrize("kind", ["class", "er"])
def test_golden_diagram(request, kind):
    """memtorch.diagram's Mermaid text of golden_models.Checkpointed (a ModuleList of two identical
    blocks, a head): the file, and what `memtorch diagram --kind` prints."""
    text = memtorch.diagram(gm.mlp_checkpointed(), kind=kind)
    check_golden(request, golden_path(f"diagram_{kind}", "mlp_checkpointed"), text)
    code, out = _cli(["diagram", f"{MODELS_FILE}:mlp_checkpointed", "--kind", kind, "--quiet"])
    assert code == 0 and out == (text if text.endswith("\n") else text + "\n")


def test_figures_reads_units():
    """The figure pattern the content checks use: a size keeps its unit, a count its separators."""
    assert figures("peak 176.6 KiB (+75.1 KiB), 1,620,096 elements, 17.2%, 34.5 ms, x 32") == {
        "176.6 KiB", "75.1 KiB", "1,620,096", "17.2%", "34.5 ms", "32",
    }  # fmt: skip
    assert html_text("<td>1.0&nbsp;KiB</td><td>a &amp; b</td>").split() == ["1.0", "KiB", "a", "&", "b"]


# ---------------------------------------------------------------- the CLI shows the same reports

MODELS_FILE = HERE / "golden_models.py"
# subcommand -> (golden kind, TARGET, arguments): the same model and inputs as the golden file's
CLI_CASES = {
    "inspect": ("inspect", "gpt2_32", []),
    "estimate": ("estimate", "gpt2_32", gm.LM_INPUT_FLAGS + ["--device", "cpu"]),
    "plan": ("plan", "gpt2_2", gm.LM_INPUT_FLAGS + [
        "--device-memory", "69 MiB", "--world-sizes", "1,2", "--shardings", "ddp,zero3", "--precisions", "fp32",
        "--checkpointing", "none", "--reserve", "0 B", "--device", "cuda"]),
    "advise": ("advise", "gpt2_2",
               gm.LM_INPUT_FLAGS + ["--optimizer", "adamw", "--budget", "4 MiB", "--reserve", "0", "--device", "cuda"]),
}  # fmt: skip


def _cli(argv):
    import io

    from memtorch import cli

    out = io.StringIO()
    code = cli.main([str(a) for a in argv], out=out)
    return code, out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("command", list(CLI_CASES))
def test_cli_formats_show_the_report(request, monkeypatch, command):
    """`memtorch <command> --format text|json|html`: the text is the report's to_text() (and the golden
    file: same model, same inputs), the JSON its to_dict(), the HTML page its to_html() with every
    figure of the text. The report the CLI made is caught on its way out of memtorch.<command>()."""
    import functools

    kind, target, args = CLI_CASES[command]
    api = getattr(memtorch, command)
    made = []

    @functools.wraps(api)
    def catch(*a, **kw):
        report = api(*a, **kw)
        made.append(_fix_times(report) if command == "plan" else report)
        return report

    monkeypatch.setattr(memtorch, command, catch)
    argv = [command, f"{MODELS_FILE}:{target}", *args, "--quiet"]
    code, text = _cli(argv + ["--format", "text"])
    assert code == 0, text
    report = made[-1]
    assert text == report.to_text() + "\n"
    check_golden(request, golden_path(kind, target), text)
    code, out = _cli(argv + ["--format", "json"])
    assert code == 0 and json.loads(out) == json.loads(json.dumps(made[-1].to_dict(), default=str))
    code, page = _cli(argv + ["--format", "html"])
    assert code == 0 and page.startswith("<!doctype html>")
    assert made[-1].to_html() in page
    missing = figures(text) - figures(html_text(page))
    assert not missing, f"figures in the text but not in the HTML page: {sorted(missing)}"
