"""The command line (memtorch/cli.py): python -m memtorch and the `memtorch` console script.

Most tests call memtorch.cli.main(argv) in this process (torch is already
imported); a few run the real entry points in a subprocess. Expected figures
are derived by hand: a Linear(i, o) holds (i*o + o) float32 elements, 4 bytes each.
"""

import io
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import memtorch
from memtorch import cli, units

ROOT = pathlib.Path(__file__).resolve().parent.parent
MLP_BYTES = (784 * 128 + 128 + 128 * 10 + 10) * 4  # 407,080 B

MODELS = """
import torch
from torch import nn

def mlp():
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))

def with_input():
    return mlp(), torch.zeros(4, 784)

instance = nn.Linear(3, 2)
number = 42

def returns_int():
    return 42

def returns_pair_of_ints():
    return 1, 2

def raises():
    raise RuntimeError("no weights here")
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A module of model factories, importable as <name>:callable and as a file path."""
    name = f"cli_models_{os.getpid()}_{abs(hash(str(tmp_path)))}"
    path = tmp_path / f"{name}.py"
    path.write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, path
    sys.modules.pop(name, None)


def run(*argv):
    """(exit code, stdout text) of the command line in this process."""
    out = io.StringIO()
    code = cli.main([str(a) for a in argv], out=out)
    return code, out.getvalue()


# ---------------------------------------------------------------- inspect


def test_inspect_text_json_html(models, capsys):
    name, path = models
    code, text = run("inspect", f"{name}:mlp")
    assert code == 0
    assert f"({MLP_BYTES:,} B, each storage once)" in text
    code, text = run("inspect", f"{path}:mlp", "--format", "json")
    assert code == 0
    data = json.loads(text)
    assert data["total"] == MLP_BYTES and data["unit"] == "bytes"
    assert data["numel"] == MLP_BYTES // 4  # elements (float32: 4 bytes each)
    assert [m["name"] for m in data["modules"]] == ["", "0", "1", "2"]
    code, text = run("inspect", f"{name}:mlp", "--format", "json", "--depth", "0")
    assert [m["name"] for m in json.loads(text)["modules"]] == [""]
    code, text = run("inspect", f"{name}:mlp", "--format", "html")
    assert code == 0 and text.startswith("<!doctype html>") and "Sequential" in text
    assert capsys.readouterr().err == ""  # no progress off a terminal unless asked


def test_inspect_dtype_halves_the_bytes(models):
    name, _ = models
    code, text = run("inspect", f"{name}:mlp", "--format", "json", "--dtype", "bfloat16")
    assert code == 0
    data = json.loads(text)
    assert data["total"] == MLP_BYTES // 2 and data["by_dtype"] == {"bfloat16": MLP_BYTES // 2}


def test_target_forms(models):
    name, path = models
    # A module object itself, and a (model, input) pair.
    code, text = run("inspect", f"{name}:instance", "--format", "json")
    assert code == 0 and json.loads(text)["total"] == (3 * 2 + 2) * 4
    code, text = run("inspect", f"{path}:with_input", "--format", "json")
    assert code == 0 and json.loads(text)["total"] == MLP_BYTES


def test_progress_lines_on_stderr(models, capsys):
    name, _ = models
    code, _ = run("inspect", f"{name}:mlp", "--progress")
    err = capsys.readouterr().err
    assert code == 0
    assert f"memtorch: building the model from {name}:mlp ..." in err
    assert "memtorch: inspecting: done in " in err


def test_live_progress_draws_and_stops():
    stream = io.StringIO()
    progress = cli.Progress("live", stream)
    with progress.step("estimating"):
        import time

        time.sleep(0.5)
    text = stream.getvalue()
    assert "memtorch: estimating (" in text and text.endswith("\r\033[K")  # the line is wiped at the end


# ---------------------------------------------------------------- bad targets and options


@pytest.mark.parametrize(
    "target, message",
    [
        ("{name}", "TARGET must be package.module:callable or path/to/file.py:callable, not '{name}'"),
        (
            "no_such_module_xyz:mlp",
            "cannot import 'no_such_module_xyz': no module named 'no_such_module_xyz'",
        ),
        ("{name}:nothing", "'{name}' has no attribute 'nothing'"),
        ("{name}:number", "{name}:number is a int: expected a callable that returns a torch.nn.Module"),
        ("{name}:returns_int", "{name}:returns_int() returned int: expected a torch.nn.Module"),
        ("{name}:returns_pair_of_ints", "returned (int, int): expected a torch.nn.Module"),
        ("{name}:raises", "calling {name}:raises() raised RuntimeError: no weights here"),
        ("{dir}/missing.py:mlp", "cannot import '{dir}/missing.py': no such file"),
    ],
)
def test_bad_target_exit_2(models, capsys, target, message):
    name, path = models
    target = target.format(name=name, dir=path.parent)
    code, out = run("inspect", target)
    err = capsys.readouterr().err
    assert code == 2 and out == ""
    assert message.format(name=name, dir=path.parent) in err
    assert err.startswith("memtorch: error: ")


def test_target_that_fails_to_import(tmp_path, capsys):
    bad = tmp_path / "broken_model_file.py"
    bad.write_text("import torch\nraise ImportError('needs a GPU library')\n")
    code, _ = run("diagram", f"{bad}:make")
    assert code == 2
    assert f"importing '{bad}' raised ImportError: needs a GPU library" in capsys.readouterr().err
    assert str(tmp_path) not in sys.path  # the file's folder is taken off sys.path again


@pytest.mark.parametrize(
    "argv, message",
    [
        (["estimate", "{t}", "--input", "8xax3"], "'8xax3' is not a shape: write the sizes joined by x"),
        (["inspect", "{t}", "--dtype", "floaty"], "--dtype 'floaty' is not a torch dtype"),
        (["inspect", "{t}", "--dtype", "int64"], "the model's parameters take a floating-point dtype"),
        (["diagram", "{t}", "--depth", "-1"], "'-1' is not a depth: an int >= 0"),
        (["diagram", "{t}", "--kind", "flow"], "invalid choice: 'flow'"),
        (["inspect", "{t}", "--format", "mermaid"], "invalid choice: 'mermaid'"),
        (["frobnicate", "{t}"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_options_exit_2(models, capsys, argv, message):
    name, _ = models
    code, _ = run(*[a.format(t=f"{name}:mlp") for a in argv])
    assert code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- diagram


def test_diagram_formats(models):
    name, _ = models
    expected = memtorch.diagram(
        torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)),
        kind="er",
        depth=1,
    )
    code, text = run("diagram", f"{name}:mlp", "--kind", "er", "--depth", "1")
    assert code == 0 and text == expected
    code, text = run("diagram", f"{name}:mlp", "--format", "json", "--no-memory")
    data = json.loads(text)
    assert (
        data["kind"] == "class" and data["mermaid"].startswith("classDiagram") and " B" not in data["mermaid"]
    )
    code, text = run("diagram", f"{name}:mlp", "--format", "html")
    assert code == 0 and '<pre class="mermaid">\nclassDiagram' in text


# ---------------------------------------------------------------- estimate and advise


def test_estimate_subcommand(models, capsys):
    name, _ = models
    code, text = run(
        "estimate", f"{name}:mlp", "--input", "8x784", "--optimizer", "adamw", "--device", "cpu", "--format", "json"
    )
    if not hasattr(memtorch, "estimate"):
        assert code == 3
        assert "estimate is not available in this install of memtorch" in capsys.readouterr().err
        return
    assert code == 0
    data = json.loads(text)
    assert data["kind"] == "estimate" and data["optimizer"] == "adamw"
    states = data["model_states"]
    assert states["parameter"] == MLP_BYTES and states["gradient"] == MLP_BYTES
    # AdamW: exp_avg and exp_avg_sq per parameter, and a float32 step per parameter tensor (4 tensors).
    assert states["optimizer_state"] == 2 * MLP_BYTES + 4 * 4
    code, text = run("estimate", f"{name}:mlp", "--input", "8x784", "--precision", "bf16-mixed")
    assert code == 0 and "bf16-mixed" in text and "estimated, not measured" in text
    code, _ = run("estimate", f"{name}:mlp", "--input", "8x784", "--optimizer", "adamz")
    assert code == 2 and "adamz" in capsys.readouterr().err
    # one default device for estimate, plan and advise: cuda, said in the output
    code, text = run("estimate", f"{name}:mlp", "--input", "8x784")
    assert code == 0 and "memtorch.estimate on cuda" in text and "by default" in text
    code, text = run("estimate", f"{name}:mlp", "--input", "8x784", "--inference", "--device", "cpu")
    assert code == 0 and "inference_mode" in text


def test_plan_subcommand(models, capsys):
    """The command line's plan is memtorch.plan() with the same settings (inputs on the meta device)."""
    name, _ = models
    args = ["plan", f"{name}:mlp", "--input", "8x784", "--device-memory", "1 MiB", "--world-sizes", "1,2,4",
            "--shardings", "ddp,zero2", "--precisions", "fp32", "--checkpointing", "none",
            "--micro-batches", "4,8", "--device", "cpu", "--reserve", "0"]  # fmt: skip
    code, text = run(*args, "--format", "json")
    assert code == 0
    data = json.loads(text)
    model = importlib.import_module(name).mlp()
    direct = memtorch.plan(
        model, torch.empty(8, 784, device="meta"), device_memory="1 MiB", world_sizes=[1, 2, 4],
        shardings=["ddp", "zero2"], precisions=["fp32"], checkpointing=[None], micro_batches=[4, 8],
        device="cpu", reserve=0,
    ).to_dict()  # fmt: skip
    assert data["options"] == json.loads(json.dumps(direct["options"]))
    # one rank is not sharded: 2 micro-batches there, 2 shardings x 2 micro-batches at 2 and 4 ranks
    assert len(data["options"]) == 2 + 2 * 2 * 2 and data["device_memory"] == 1024**2
    code, text = run(*args)
    assert code == 0 and "combination(s) fit in 1.0 MiB per device" in text
    # no --device-memory: --gpu's nominal memory (as fit's), else 80 GiB
    small = ["plan", f"{name}:mlp", "--input", "8x784", "--world-sizes", "1", "--precisions", "fp32",
             "--checkpointing", "none"]  # fmt: skip
    code, text = run(*small, "--gpu", "l4")
    assert code == 0 and "fit in 24.0 GiB per device" in text and "device memory: the L4 24GB's" in text
    code, text = run(*small)
    assert code == 0 and "fit in 80.0 GiB per device" in text
    code, _ = run("plan", f"{name}:mlp", "--input", "8x784", "--world-sizes", "two")
    assert code == 2 and "--world-sizes: 'two' is not a comma-separated list of ints" in capsys.readouterr().err
    code, _ = run("plan", f"{name}:mlp", "--input", "8x784", "--shardings", "zero9")
    assert code == 2 and "zero9" in capsys.readouterr().err
    code, _ = run("plan", f"{name}:mlp")
    assert code == 2 and "plan needs an example input" in capsys.readouterr().err


def test_step_options_reach_plan_and_advise(models, capsys):
    """--gpu, --loss and --fsdp-units, shared by estimate, plan and advise, reach plan() and advise()."""
    name, _ = models
    model = importlib.import_module(name).mlp()
    x = torch.empty(8, 784, device="meta")
    one = ["--world-sizes", "1", "--shardings", "ddp", "--precisions", "fp32", "--checkpointing", "none", "--reserve",
           "0", "--format", "json"]  # fmt: skip
    for gpu in ("a100", "h100"):
        code, text = run("plan", f"{name}:mlp", "--input", "8x784", "--device", "cuda", "--gpu", gpu,
                         "--device-memory", "80 GiB", *one)  # fmt: skip
        assert code == 0, text
        est = memtorch.estimate(model, x, device="cuda", gpu=gpu)
        assert json.loads(text)["options"][0]["peak"] == est.peak
    # a100 names boards of 40 and 80 GB: without --device-memory, plan asks for it (as fit does)
    code, _ = run("plan", f"{name}:mlp", "--input", "8x784", "--device", "cuda", "--gpu", "a100", *one)
    assert code == 2 and "no memory size known for gpu='a100'" in capsys.readouterr().err
    code, text = run("plan", f"{name}:mlp", "--input", "8x784", "--device", "cpu", "--loss", "output", *one)
    # --loss reached plan's estimates: the output is a plain 8 x 10 tensor, with no .loss
    assert code == 2 and "--loss output: the model's output has no .loss" in capsys.readouterr().err
    kw = ["--device", "cpu", "--world-size", "2", "--sharding", "zero3", "--optimizer", "adam"]
    code, text = run("advise", f"{name}:mlp", "--input", "8x784", *kw, "--fsdp-units", "0", "--format", "json")
    assert code == 0, text
    est = memtorch.estimate(model, x, optimizer="adam", device="cpu", world_size=2, sharding="zero3",
                            fsdp_units=["0"])  # fmt: skip
    assert json.loads(text)["peak"] == est.peak  # estimate()'s figure for the same configuration


def test_cli_defaults_are_the_api_defaults(models):
    """No --optimizer is --optimizer adamw, as advise(), plan(), fit() and estimate() default to it."""
    name, _ = models
    flags = ["--input", "8x784", "--device", "cpu", "--budget", "1 MiB", "--reserve", "0", "--format", "json"]
    code, default = run("advise", f"{name}:mlp", *flags)
    assert code == 0, default
    code, adamw = run("advise", f"{name}:mlp", *flags, "--optimizer", "adamw")
    assert code == 0 and json.loads(default)["peak"] == json.loads(adamw)["peak"]
    model = importlib.import_module(name).mlp()
    est = memtorch.estimate(model, torch.empty(8, 784, device="meta"), device="cpu")
    assert json.loads(default)["peak"] == est.peak


def test_estimate_needs_an_input(models, capsys):
    name, _ = models
    code, _ = run("estimate", f"{name}:mlp")
    err = capsys.readouterr().err
    if not hasattr(memtorch, "estimate"):
        assert code == 3 and "not available" in err
        return
    assert code == 2 and "estimate needs an example input: --input 8x3x224x224" in err


def test_advise_subcommand(models, capsys):
    name, _ = models
    code, text = run("advise", f"{name}:mlp", "--input", "8x784", "--optimizer", "adam")
    if not hasattr(memtorch, "advise"):
        assert code == 3
        assert "advise is not available in this install of memtorch" in capsys.readouterr().err
        return
    assert code == 0 and text.strip()


def test_unknown_optimizer_name(models, capsys):
    if not hasattr(memtorch, "advise"):
        pytest.skip("memtorch.advise is not in this install: the optimizer is built for it")
    name, _ = models
    code, _ = run("advise", f"{name}:mlp", "--optimizer", "adamz")
    assert code == 2 and "unknown optimizer 'adamz'" in capsys.readouterr().err


# ---------------------------------------------------------------- diff

OLD = {
    "tests/test_a.py::test_step": {"peak": 1_048_576, "delta": 0, "device": "cpu", "exact": True},
    "tests/test_a.py::test_same": {"peak": 4096, "delta": 512, "device": "cpu", "exact": True},
    "tests/test_a.py::test_gone": {"peak": 10, "delta": 0, "device": "cpu", "exact": True},
    "tests/test_a.py::test_gpu": {"peak": 512, "delta": 0, "device": "cpu", "exact": True},
}
NEW = {
    "tests/test_a.py::test_step": {"peak": 1_310_720, "delta": 0, "device": "cpu", "exact": True},
    "tests/test_a.py::test_same": {"peak": 4096, "delta": 512, "device": "cpu", "exact": True},
    "tests/test_a.py::test_new": {"peak": 7, "delta": 0, "device": "cpu", "exact": True},
    "tests/test_a.py::test_gpu": {"peak": 1024, "delta": 0, "device": "cuda", "exact": True},
}


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_diff_text(tmp_path):
    old, new = write(tmp_path, "old.json", OLD), write(tmp_path, "new.json", NEW)
    code, text = run("diff", old, new)
    assert code == 0
    # 1 MiB -> 1.25 MiB: +256 KiB, +25.0% (by hand: 262,144 / 1,048,576).
    line = next(x for x in text.splitlines() if "test_step" in x)
    assert line.split() == [
        "tests/test_a.py::test_step",
        "peak",
        "1.0",
        "MiB",
        "(1048576",
        "B)",
        "1.2",
        "MiB",
        "(1310720",
        "B)",
        "+256.0",
        "KiB",
        "(+25.0%)",
    ]
    assert "test_same" not in text.split("test(s) compared")[0]  # unchanged figures are not listed
    assert "2 test(s) compared: 1 figure(s) changed, 3 unchanged" in text
    assert "not compared: tests/test_a.py::test_gpu: measured on cpu, then on cuda" in text
    assert f"1 test(s) only in {old}: tests/test_a.py::test_gone" in text
    assert f"1 test(s) only in {new}: tests/test_a.py::test_new" in text


def test_diff_json_and_fail_on_increase(tmp_path):
    old, new = write(tmp_path, "old.json", OLD), write(tmp_path, "new.json", NEW)
    code, text = run("diff", old, new, "--format", "json")
    data = json.loads(text)
    assert code == 0
    assert data["changes"] == [
        {
            "test": "tests/test_a.py::test_step",
            "figure": "peak",
            "old": 1_048_576,
            "new": 1_310_720,
            "change": 262_144,
            "bytes": True,
        }
    ]
    code, _ = run("diff", old, new, "--fail-on-increase", "30%")
    assert code == 0  # +25% is within 30%
    code, text = run("diff", old, new, "--fail-on-increase", "10%")
    assert (
        code == 1
        and "FAILED: tests/test_a.py::test_step: peak grew by +256.0 KiB (+25.0%), more than 10%" in text
    )
    code, _ = run("diff", old, new, "--fail-on-increase", "256 KiB")
    assert code == 0  # exactly 262,144 B is allowed
    code, _ = run("diff", old, new, "--fail-on-increase", "255 KiB")
    assert code == 1


def test_diff_extended_form_compares_every_figure_in_both(tmp_path):
    # An extended save file (nested figures) against an old one: the figures present in both are compared.
    extended = {
        "t::a": {
            "peak": 2048,
            "delta": 0,
            "device": "cpu",
            "exact": True,
            "end": 4096,
            "phases": {"forward": {"peak": 1024}, "backward": {"peak": 2048}},
            "steps": 3,
            "at_peak": {"by_category": {"parameter": 1000, "activation": 24}},
        },
    }
    old = {
        "t::a": {
            "peak": 1024,
            "delta": 0,
            "device": "cpu",
            "exact": True,
            "phases": {"forward": {"peak": 1024}, "backward": {"peak": 1024}},
            "steps": 2,
        }
    }
    code, text = run(
        "diff", write(tmp_path, "o.json", old), write(tmp_path, "n.json", extended), "--format", "json"
    )
    assert code == 0
    changed = {c["figure"]: (c["old"], c["new"], c["bytes"]) for c in json.loads(text)["changes"]}
    assert changed == {
        "peak": (1024, 2048, True),
        "phases.backward.peak": (1024, 2048, True),
        "steps": (2, 3, False),
    }
    code, text = run("diff", write(tmp_path, "o.json", old), write(tmp_path, "n.json", extended))
    # A count is not a size: printed as a plain number.
    assert ["t::a", "steps", "2", "3", "+1", "(+50.0%)"] in [line.split() for line in text.splitlines()]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "is not a file written by pytest --memtorch-save"),
        ('{"t": 5}', "is not a file written by pytest --memtorch-save"),
    ],
)
def test_diff_bad_files_exit_2(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    good = write(tmp_path, "good.json", OLD)
    code, _ = run("diff", good, bad)
    assert code == 2 and message in capsys.readouterr().err


def test_diff_bad_margin(tmp_path, capsys):
    good = write(tmp_path, "good.json", OLD)
    code, _ = run("diff", good, good, "--fail-on-increase", "lots")
    assert (
        code == 2 and "--fail-on-increase 'lots': expected a percentage such as 5%" in capsys.readouterr().err
    )


def _subprocess_env():
    # The sanitizer pass's preloads and allocator are not for child interpreters started here.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONMALLOC")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_diff_of_real_save_files(tmp_path):
    """Two real runs of the plugin's --memtorch-save: the diff reads what the plugin writes."""
    test_file = tmp_path / "test_budget_size.py"
    saved = []
    for n in (1000, 3000):
        test_file.write_text(
            textwrap.dedent(f"""
            import pytest, torch

            @pytest.mark.memory_budget(peak="1 MiB", device="cpu")
            def test_alloc():
                x = torch.empty({n})
            """)
        )
        out = tmp_path / f"run{n}.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "no:xdist",
                f"--memtorch-save={out}",
                str(test_file),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=_subprocess_env(),
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        saved.append(out)
    code, text = run("diff", *saved, "--format", "json")
    assert code == 0
    changes = {c["figure"]: c for c in json.loads(text)["changes"]}
    # torch.empty(n) float32: 4n bytes, exact on the CPU counters: 4000 B, then 12000 B.
    assert (changes["peak"]["old"], changes["peak"]["new"]) == (4000, 12000)


# ---------------------------------------------------------------- the entry points


@pytest.mark.slow
def test_python_dash_m_and_console_script(tmp_path):
    env = _subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "memtorch", "--help"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0
    assert "{inspect,estimate,plan,fit,capacity,diagram,advise,diff}" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "memtorch", "inspect", "no_such_pkg_q:make"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr == "memtorch: error: cannot import 'no_such_pkg_q': no module named 'no_such_pkg_q'\n"
    script = shutil.which("memtorch", path=os.path.dirname(sys.executable))
    assert script, "the memtorch console script is not installed beside this Python (pip install -e .)"
    model_file = tmp_path / "tiny_model.py"
    model_file.write_text("import torch\ndef make():\n    return torch.nn.Linear(10, 10)\n")
    proc = subprocess.run(
        [script, "inspect", f"{model_file}:make", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total"] == (10 * 10 + 10) * 4
    assert units.format((10 * 10 + 10) * 4) == "440 B"


class _FakeReport:
    def __str__(self):
        return "fake report"

    def to_dict(self):
        return {"peak": 123}

    def _repr_html_(self):
        return "<p>fake</p>"


def test_advise_and_estimate_plumbing(models, monkeypatch):
    """What the subcommands hand to memtorch.advise / memtorch.estimate, checked with stand-ins."""
    name, _ = models
    calls = []

    def advise(model, *inputs, optimizer=None, budget=None, device=None):
        calls.append(("advise", model, inputs, optimizer, budget))
        return _FakeReport()

    def estimate(model, *inputs, optimizer="adamw", precision="fp32", loss_fn=None, device=None):
        calls.append(("estimate", model, inputs, optimizer, precision))
        return _FakeReport()

    monkeypatch.setattr(memtorch, "advise", advise, raising=False)
    monkeypatch.setattr(memtorch, "estimate", estimate, raising=False)
    code, text = run(
        "advise",
        f"{name}:mlp",
        "--input",
        "8x784",
        "--input",
        "8:int64",
        "--optimizer",
        "adam",
        "--budget",
        "2 GiB",
    )
    assert code == 0 and text == "fake report\n"
    _, model, inputs, optimizer, budget = calls.pop()
    assert isinstance(model, torch.nn.Sequential)
    # the inputs as estimate() reads them (advise makes real ones where it measures); the optimizer by name
    assert [(tuple(x.shape), x.dtype) for x in inputs] == [((8, 784), torch.float32), ((8,), torch.int64)]
    assert optimizer == "adam" and budget == "2 GiB"
    code, _ = run("advise", f"{name}:mlp", "--precision", "bf16-mixed")
    assert code == 2  # this stand-in takes no precision
    code, text = run(
        "estimate",
        f"{name}:mlp",
        "--input",
        "8x784",
        "--optimizer",
        "sgd",
        "--precision",
        "bf16-mixed",
        "--format",
        "json",
    )
    assert code == 0 and json.loads(text) == {"peak": 123}
    _, _, inputs, optimizer, precision = calls.pop()
    # estimate needs no real tensors: meta tensors of the shapes asked for
    assert [(tuple(x.shape), x.dtype, x.device.type) for x in inputs] == [((8, 784), torch.float32, "meta")]
    assert optimizer == "sgd" and precision == "bf16-mixed"
    # keyword inputs: one mapping after the positional ones, model(**batch); --loss output
    code, _ = run("estimate", f"{name}:mlp", "--input", "input_ids=1x16:int64", "--input", "labels=1x16:int64",
                  "--loss", "output")  # fmt: skip
    _, _, inputs, _, _ = calls.pop()
    assert code == 0 and list(inputs[0]) == ["input_ids", "labels"] and inputs[0]["labels"].dtype == torch.int64
    code, _ = run("estimate", f"{name}:mlp", "--input", "8x784", "--checkpointing", "blocks")
    assert code == 2  # this stand-in takes no checkpointing: said, not dropped
    code, text = run("estimate", f"{name}:with_input", "--format", "html")
    _, _, inputs, _, _ = calls.pop()
    assert code == 0 and "<p>fake</p>" in text and inputs[0].shape == (4, 784)  # the TARGET's own input


def test_inspect_text_depth(models, capsys):
    name, _ = models
    code, text = run("inspect", f"{name}:mlp", "--depth", "0")
    err = capsys.readouterr().err
    assert code == 0
    mm = memtorch.inspect(torch.nn.Linear(1, 1))
    if "depth" in getattr(mm, "to_text", lambda: None).__code__.co_varnames:
        assert err == "" and "Linear" not in text  # the children are folded into the model's row
    else:
        assert err == "memtorch: note: this install's tables take no depth: the whole module tree is shown\n"
        assert "Linear" in text


def test_diff_matches_named_rows_by_name(tmp_path):
    old = {"t::a": {"peak": 10, "modules": [{"name": "enc", "peak": 4}, {"name": "head", "peak": 2}]}}
    new = {"t::a": {"peak": 10, "modules": [{"name": "head", "peak": 3}, {"name": "enc", "peak": 4}]}}
    code, text = run(
        "diff", write(tmp_path, "o.json", old), write(tmp_path, "n.json", new), "--format", "json"
    )
    assert code == 0
    assert [(c["figure"], c["old"], c["new"]) for c in json.loads(text)["changes"]] == [
        ("modules.[head].peak", 2, 3)
    ]
