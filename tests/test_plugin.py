"""The pytest plugin, run in pytester sessions: budgets that pass and fail, bad markers, save/compare, xdist.

Every expected figure is counted by hand: a float32 tensor of n elements holds 4 * n bytes,
so torch.empty(1000, 1000) is 4,000,000 B = 3.81 MiB, above "3 MB" (3,000,000 B) and
below "4 MiB" (4,194,304 B). Formatted figures are built with memtorch.units.format from
those counts, never pasted from a run.
"""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from memtorch import units

ROOT = Path(__file__).resolve().parents[1]


def _entry_point_installed():
    eps = metadata.entry_points()
    group = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
    return any(ep.value == "memtorch.pytest_plugin" for ep in group)


# Where memtorch is installed the pytest11 entry point loads the plugin (and loading it a
# second time with -p would be an error); in a source checkout it is loaded with -p.
PLUGIN_ARGS = [] if _entry_point_installed() else ["-p", "memtorch.pytest_plugin"]

FOUR_MILLION = 1000 * 1000 * 4  # bytes of torch.empty(1000, 1000), float32


def _warm_up():
    """Import now (at collection) what an in-process run would import first.

    pytester's fixture restores sys.modules to what it was when the fixture was set
    up: modules first imported by a run are dropped afterwards, and torch (or
    memtorch._C) imported a second time crashes the process.
    """
    torch = pytest.importorskip("torch")
    import memtorch
    import memtorch.budget
    import memtorch.pytest_plugin

    with memtorch.track(device="cpu"):
        torch.nn.functional.relu(torch.ones(1))
    return torch


torch = _warm_up()


@pytest.fixture
def run(pytester, monkeypatch):
    """Run pytest on pytester's files with the plugin; in-process unless subprocess=True."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    pytester.syspathinsert(ROOT)

    def run(*args, subprocess=False):
        runner = pytester.runpytest_subprocess if subprocess else pytester.runpytest_inprocess
        # Option values are written --opt=VALUE: a separate path argument would move pytest's rootdir.
        # The plugin is already imported here (see _warm_up), too late for assertion rewriting.
        quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
        return runner(*PLUGIN_ARGS, *quiet, "-p", "no:cacheprovider", "--strict-markers", *args)

    return run


def test_importing_the_plugin_imports_no_torch():
    # Every pytest run in an environment with memtorch installed imports the plugin.
    code = (
        "import sys, memtorch.pytest_plugin; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy', 'memtorch._C'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_marker_help_and_options(run):
    result = run("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.memory_budget(peak=None, delta=None, leak=None, device='auto', watch=()): Run the test body inside*"
        ]
    )
    result = run("--help")
    result.stdout.fnmatch_lines(
        [
            "memtorch memory budgets:",
            "*--memtorch-save=FILE*",
            "*--memtorch-compare=FILE*",
            "*--memtorch-fail-on-increase=MARGIN*",
            "*--memtorch-report*",
        ]
    )


def test_passing_and_failing_budgets(pytester, run):
    pytester.makepyfile(
        test_budgets="""
        import pytest, torch

        @pytest.mark.memory_budget(peak="4 MiB")
        def test_within_binary():
            x = torch.empty(1000, 1000)

        @pytest.mark.memory_budget(peak=4_000_000, device="cpu")
        def test_exactly_at_the_limit():
            x = torch.empty(1000, 1000)

        @pytest.mark.memory_budget(peak="3 MB", device="cpu")
        def test_over_decimal():
            x = torch.empty(1000, 1000)

        @pytest.mark.memory_budget("3999999 B", device="cpu")
        def test_over_by_one_byte():
            x = torch.empty(1000, 1000)
        """
    )
    result = run("-v", "-rf")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=2, failed=2)
    # 4,000,000 B vs 3,000,000 B: "3.8 MiB" and "2.9 MiB" already differ at one decimal;
    # a budget written in decimal units is also shown as written.
    over_decimal = (
        f"peak {units.format(FOUR_MILLION)} exceeds budget {units.format(3_000_000)} (3 MB) "
        f"by {units.format(FOUR_MILLION - 3_000_000)}"
    )
    # 4,000,000 B vs 3,999,999 B agree to three decimals of MiB: exact bytes, 1 B over.
    over_by_one = "peak 4000000 B exceeds budget 3999999 B by 1 B"
    result.stdout.fnmatch_lines(
        [
            "*::test_within_binary PASSED*",
            "*::test_exactly_at_the_limit PASSED*",
            "*::test_over_decimal OVER BUDGET*",
            "*::test_over_by_one_byte OVER BUDGET*",
        ]
    )
    lines = result.outlines
    # The failure: the verdict line first, then the breakdown section.
    first = lines.index(over_decimal)
    assert lines[first - 1].startswith("____") and "test_over_decimal" in lines[first - 1]
    assert lines[first + 1] == ""
    assert lines[first + 2].startswith("memtorch breakdown (device cpu, ")
    assert over_by_one in lines
    # The distinct summary section lists every test over budget, one line each.
    head = lines.index(next(x for x in lines if "memtorch: tests over budget" in x))
    assert lines[head + 1 : head + 3] == [
        f"test_budgets.py::test_over_decimal: {over_decimal}",
        f"test_budgets.py::test_over_by_one_byte: {over_by_one}",
    ]
    assert "Traceback" not in result.stdout.str()


def test_delta_budget(pytester, run):
    pytester.makepyfile(
        test_delta="""
        import pytest, torch
        KEEP = []

        @pytest.mark.memory_budget(delta="900 kB", device="cpu")
        def test_keeps_a_megabyte():
            KEEP.append(torch.empty(250_000))  # float32: 1,000,000 B left behind
        """
    )
    result = run()
    result.assert_outcomes(failed=1)
    expected = f"delta {units.format(1_000_000)} exceeds budget {units.format(900_000)} (900 kB) by {units.format(100_000)}"
    assert expected in result.outlines


def test_leak_budget_with_steps(pytester, run):
    pytester.makepyfile(
        test_leak="""
        import pytest, torch
        KEEP = []

        @pytest.mark.memory_budget(leak="1 kB", device="cpu")
        def test_leaks_every_step(memtorch_tracker):
            for _ in range(4):
                y = torch.ones(1000) * 2            # temporary, freed within the step
                KEEP.append(torch.empty(1000))     # kept: 4,000 B per step
                del y                              # so every step, the first too, keeps 4,000 B
                memtorch_tracker.step()

        @pytest.mark.memory_budget(leak="0 B", device="cpu")
        def test_no_leak(memtorch_tracker):
            for _ in range(4):
                y = torch.ones(1000) * 2
                del y
                memtorch_tracker.step()

        @pytest.mark.memory_budget(leak="0 B", device="cpu")
        def test_leak_budget_without_steps():
            torch.empty(10)
        """
    )
    result = run("-v")
    result.assert_outcomes(passed=1, failed=2)
    expected = f"leak {units.format(4000)} exceeds budget {units.format(1000)} (1 kB) by {units.format(3000)}"
    assert expected in result.outlines
    result.stdout.fnmatch_lines(["*::test_leaks_every_step OVER BUDGET*", "*::test_no_leak PASSED*"])
    # A leak budget on a test that marks no steps is a plain failure that says what to do.
    result.stdout.fnmatch_lines(["*::test_leak_budget_without_steps FAILED*"])
    result.stdout.fnmatch_lines(["a leak budget needs a per-step leak figure*memtorch_tracker.step()*"])


def test_a_leak_failure_names_the_local_list_that_kept_the_tensors(pytester, run):
    # the block ends after the test returns, when its `losses` is gone: the containers are named as
    # the test returns (a trace on that one frame), and no tracer is left behind
    pytester.makepyfile(
        test_losses="""
        import sys, pytest, torch

        @pytest.mark.memory_budget(leak="1 B", device="cpu")
        def test_train(memtorch_tracker):
            w = torch.ones(8, requires_grad=True)
            losses = []
            for _ in range(6):
                loss = (w * 2).sum()
                loss.backward()
                losses.append(loss)                # kept: a scalar holding its graph, every step
                memtorch_tracker.step()

        def test_no_tracer_left():
            assert sys.gettrace() is None
        """
    )
    result = run("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*leak: +4 B per step, * tensor(s) kept unexpectedly*"])
    result.stdout.fnmatch_lines(["*kept: * tensors float32[[]], * holding autograd graphs*in list `losses` (local of `test_train`)*"])
    assert not any("surviving tensor" in line for line in result.outlines)


BAD_MARKERS = {
    "test_unparsable_size": ('peak="lots"', "peak='lots': cannot parse size 'lots'"),
    "test_unknown_unit": ('peak="64 MiBs"', "peak='64 MiBs': unknown unit 'MiBs'"),
    "test_unknown_device": (
        'peak="1 MiB", device="tpu"',
        "unknown device 'tpu': expected 'auto', 'cpu', 'cuda' or 'cuda:N'",
    ),
    "test_device_not_a_device": ("device=3", "device=3 is not a device"),
    "test_unknown_keyword": (
        'peek="1 MiB"',
        "unknown keyword argument peek: expected peak, delta, leak, device, watch",
    ),
    "test_watch_not_names": ('peak="1 MiB", watch=3', "watch=3: expected the name of a fixture"),
    "test_watch_unknown_fixture": (
        'peak="1 MiB", watch="model"',
        "watch=['model']: the test requests no fixture named model",
    ),
    "test_two_positionals": ('"1 MiB", "2 MiB"', "takes at most one positional argument (the peak), got 2"),
}


def test_bad_marker_arguments_are_usage_errors_at_setup(pytester, run):
    pytester.makepyfile(
        test_bad="import pytest\n"
        + "".join(
            f"\n@pytest.mark.memory_budget({args})\ndef {name}():\n    raise AssertionError('body ran')\n"
            for name, (args, _) in BAD_MARKERS.items()
        )
    )
    result = run()
    result.assert_outcomes(errors=len(BAD_MARKERS))
    text = result.stdout.str()
    for name, (_, message) in BAD_MARKERS.items():
        result.stdout.fnmatch_lines([f"*ERROR at setup of {name}*"])
        assert f"usage error: memory_budget marker on test_bad.py::{name}: {message}" in text
    # A usage error, not a crash inside the plugin, and the body never ran.
    assert "Traceback" not in text and "pytest_plugin.py" not in text and "body ran" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the machine without CUDA")
def test_cuda_budget_without_cuda_is_skipped(pytester, run):
    pytester.makepyfile(
        test_cuda="""
        import pytest

        @pytest.mark.memory_budget(peak="1 MiB", device="cuda")
        def test_on_gpu():
            raise AssertionError("body ran")

        @pytest.mark.memory_budget(peak="1 MiB", device="cuda:1")
        def test_on_second_gpu():
            raise AssertionError("body ran")
        """
    )
    result = run("-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]1[]] test_cuda.py:3: memory_budget(device='cuda') needs CUDA, which is not available here",
            "SKIPPED [[]1[]] test_cuda.py:7: memory_budget(device='cuda:1') needs CUDA, which is not available here",
        ]
    )


def test_fixture_tracks_an_unmarked_test(pytester, run, tmp_path):
    # Without a marker the fixture tracks on device "auto": CUDA where available, else CPU.
    pytester.makepyfile(
        test_fixture="""
        import torch, memtorch

        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

        def test_asserts_itself(memtorch_tracker):
            x = torch.empty(10, device=DEVICE)
            # float32: 40 B on the CPU; CUDA's caching allocator rounds every block up to 512 B.
            assert memtorch_tracker.report.peak_above_start == (512 if DEVICE == "cuda" else 40)
            assert memtorch_tracker.report.peak_above_start <= memtorch.units.parse("64 MiB")

        def test_untracked():
            torch.empty(10)
        """
    )
    saved = tmp_path / "peaks.json"
    result = run(f"--memtorch-save={saved}")
    result.assert_outcomes(passed=2)
    data = json.loads(saved.read_text())
    assert list(data) == ["test_fixture.py::test_asserts_itself"]
    cuda = torch.cuda.is_available()
    assert data["test_fixture.py::test_asserts_itself"]["device"] == ("cuda" if cuda else "cpu")
    assert data["test_fixture.py::test_asserts_itself"]["peak"] == (512 if cuda else 40)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget(pytester, run, tmp_path):
    # torch.empty(1000, 1000) float32 asks 4,000,000 B; the caching allocator rounds blocks
    # up to a multiple of 512 B: 4,000,000 / 512 = 7812.5 -> 7813 * 512 = 4,000,256 B.
    pytester.makepyfile(
        test_gpu="""
        import pytest, torch

        @pytest.mark.memory_budget(peak="4 MiB", device="cuda")
        def test_within():
            x = torch.empty(1000, 1000, device="cuda")

        @pytest.mark.memory_budget(peak="3 MB", device="cuda:0")
        def test_over():
            x = torch.empty(1000, 1000, device="cuda")
        """
    )
    saved = tmp_path / "gpu.json"
    result = run(f"--memtorch-save={saved}")
    result.assert_outcomes(passed=1, failed=1)
    over = (
        f"peak {units.format(4_000_256)} exceeds budget {units.format(3_000_000)} (3 MB) "
        f"by {units.format(1_000_256)}"
    )
    assert over in result.outlines
    data = json.loads(saved.read_text())
    assert data["test_gpu.py::test_within"]["peak"] == 4_000_256
    assert data["test_gpu.py::test_within"]["device"].startswith("cuda")


SAVE_COMPARE_TESTS = """
import pytest, torch

@pytest.mark.memory_budget(peak="1 GiB", device="cpu")
def test_grew():
    x = torch.empty(1000, 1000)              # 4,000,000 B

@pytest.mark.memory_budget(peak="1 GiB", device="cpu")
def test_grew_a_little():
    x = torch.empty(1000, 1000)              # 4,000,000 B

@pytest.mark.memory_budget(peak="1 GiB", device="cpu")
def test_new():
    x = torch.empty(250, 1000)               # 1,000,000 B
"""


FIXTURE_FREES = """
import pytest
import torch

@pytest.fixture
def held():
    return {"x": torch.ones(1000)}           # 4,000 B, made before the body runs

@pytest.mark.memory_budget(device="cpu")
def test_frees_what_its_fixture_made(held):
    del held["x"]
"""


@pytest.mark.slow
def test_body_freeing_a_fixture_tensor_is_measured_from_the_first_test(pytester, run, tmp_path):
    """Counting starts before the fixtures of the first budgeted test (a fresh process):
    the body's free of the fixture's 1000 float32 (4,000 B) is seen, delta -4,000 B, peak 0."""
    pytester.makepyfile(test_ff=FIXTURE_FREES)
    saved = tmp_path / "peaks.json"
    result = run(f"--memtorch-save={saved}", subprocess=True)
    result.assert_outcomes(passed=1)
    figures = json.loads(saved.read_text())["test_ff.py::test_frees_what_its_fixture_made"]
    assert figures["delta"] == -4000 and figures["peak"] == 0 and figures["exact"] is True


def test_save_then_compare(pytester, run, tmp_path):
    pytester.makepyfile(test_sc=SAVE_COMPARE_TESTS)
    saved = tmp_path / "out" / "peaks.json"
    result = run(f"--memtorch-save={saved}")
    result.assert_outcomes(passed=3)
    data = json.loads(saved.read_text())
    assert {k: v["peak"] for k, v in data.items()} == {
        "test_sc.py::test_grew": FOUR_MILLION,
        "test_sc.py::test_grew_a_little": FOUR_MILLION,
        "test_sc.py::test_new": 1_000_000,
    }
    assert all(v["device"] == "cpu" and v["delta"] == 0 for v in data.values())

    # A baseline written by hand: 3,800,000 B for test_grew (4,000,000 is 5.26% more,
    # past 5%), 3,900,000 B for test_grew_a_little (2.56% more, within 5%), test_new absent.
    baseline = tmp_path / "baseline.json"
    baseline.write_text(
        json.dumps(
            {
                "test_sc.py::test_grew": {"peak": 3_800_000, "delta": 0, "device": "cpu"},
                "test_sc.py::test_grew_a_little": {"peak": 3_900_000, "delta": 0, "device": "cpu"},
            }
        )
    )
    result = run(
        "-v", f"--memtorch-compare={baseline}", "--memtorch-fail-on-increase=5%", "--memtorch-report"
    )
    result.assert_outcomes(passed=2, failed=1)
    grew = (
        f"peak {units.format(FOUR_MILLION)} exceeds baseline {units.format(3_800_000)} "
        f"by {units.format(200_000)}, +{200_000 * 100 / 3_800_000:.1f}% (allowed +5%, baseline from {baseline})"
    )
    assert grew == (
        f"peak 3.8 MiB exceeds baseline 3.6 MiB by 195.3 KiB, +5.3% (allowed +5%, baseline from {baseline})"
    )
    assert grew in result.outlines
    assert f"test_sc.py::test_grew: {grew}" in result.outlines
    result.stdout.fnmatch_lines(["*::test_grew MEMORY REGRESSION*", "*::test_grew_a_little PASSED*"])
    # The report table: old, new and the difference for each test.
    result.stdout.fnmatch_lines(
        [
            "*memtorch: memory of tracked tests*",
            "test *device*peak*delta*peak budget*baseline*change*status",
            f"test_sc.py::test_grew *cpu*{units.format(FOUR_MILLION)}*{units.format(3_800_000)}*+195.3 KiB (+5.3%)*regression",
            f"test_sc.py::test_grew_a_little *{units.format(3_900_000)}*+97.7 KiB (+2.6%)*ok",
            "test_sc.py::test_new *new*ok",
        ]
    )

    # An absolute margin: 200,000 B of growth is within "200 kB", past "195 KiB" (199,680 B).
    assert run(f"--memtorch-compare={baseline}", "--memtorch-fail-on-increase=200 kB").ret == 0
    run(f"--memtorch-compare={baseline}", "--memtorch-fail-on-increase=195 KiB").assert_outcomes(
        passed=2, failed=1
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memtorch-fail-on-increase=5%"], "--memtorch-fail-on-increase needs --memtorch-compare FILE"),
        (["--memtorch-compare=missing.json"], "--memtorch-compare: cannot read missing.json"),
        (["--memtorch-compare=bad.json"], "--memtorch-compare: bad.json is not JSON"),
        (["--memtorch-compare=list.json"], "--memtorch-compare: list.json is not a memtorch file"),
        (
            ["--memtorch-compare=list.json", "--memtorch-fail-on-increase=five"],
            "--memtorch-fail-on-increase='five': expected a percentage such as '5%' or a size such as '1 MiB'",
        ),
    ],
)
def test_bad_options_are_usage_errors(pytester, run, args, message):
    pytester.makefile(".json", bad="{", list="[1, 2]")
    pytester.makepyfile(test_x="def test_x(): pass")
    result = run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


DETERMINISM_TESTS = """
import pytest, torch

@pytest.mark.memory_budget(peak="64 MiB", device="cpu")
def test_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.slow  # three pytest processes, each importing torch
def test_same_test_same_peak_run_after_run(pytester, run, tmp_path):
    pytester.makepyfile(test_det=DETERMINISM_TESTS)
    # Three separate pytest processes (started together to save time), each saving its figures.
    saved = [tmp_path / f"run{i}.json" for i in range(3)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                *PLUGIN_ARGS,
                "-p",
                "no:cacheprovider",
                "-q",
                f"--memtorch-save={f}",
            ],
            cwd=pytester.path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for f in saved
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    peaks = [json.loads(f.read_text())["test_det.py::test_training_step"]["peak"] for f in saved]
    # The step holds at least the Adam state: 2 x (784*128 + 128 + 128*10 + 10) float32
    # = 2 x 101,770 x 4 = 814,160 B, created inside the body.
    assert peaks[0] >= 814_160
    assert peaks == [peaks[0]] * 3


@pytest.mark.slow  # a pytest process and two xdist workers, each importing torch
def test_xdist_workers_measure_their_own_tests(pytester, run, tmp_path):
    pytest.importorskip("xdist")
    pytester.makepyfile(
        test_par="""
        import pytest, torch

        @pytest.mark.memory_budget(peak="4 MiB", device="cpu")
        @pytest.mark.parametrize("rows", [1, 10, 100, 1000])
        def test_rows(rows):
            x = torch.empty(rows, 1000)      # 4,000 * rows B

        @pytest.mark.memory_budget(peak="3 MB", device="cpu")
        def test_over():
            x = torch.empty(1000, 1000)      # 4,000,000 B
        """
    )
    saved = tmp_path / "xdist.json"
    result = run("-n", "2", f"--memtorch-save={saved}", subprocess=True)
    result.assert_outcomes(passed=4, failed=1)
    data = json.loads(saved.read_text())
    expected = {f"test_par.py::test_rows[{r}]": 4000 * r for r in (1, 10, 100, 1000)}
    expected["test_par.py::test_over"] = FOUR_MILLION
    assert {k: v["peak"] for k, v in data.items()} == expected
    over = (
        f"peak {units.format(FOUR_MILLION)} exceeds budget {units.format(3_000_000)} (3 MB) "
        f"by {units.format(1_000_000)}"
    )
    result.stdout.fnmatch_lines(["*memtorch: tests over budget*", f"test_par.py::test_over: {over}"])


WATCHED = """
import pytest
import torch
import memtorch

memtorch.cpu.start()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


@pytest.fixture
def model():
    return _mlp()


@pytest.fixture
def opt(model):
    o = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256)
    model(x).sum().backward(); o.step(); o.zero_grad()  # Adam's state exists
    return o


@pytest.mark.memory_budget(peak="1 KiB", watch=["model", "opt"])
def test_by_marker(model, opt):
    x = torch.randn(64, 256)
    model(x).sum().backward(); opt.step(); opt.zero_grad()


@pytest.mark.memory_budget(peak="1 KiB")
def test_by_fixture(memtorch_tracker):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    memtorch_tracker.watch(model, opt)
    x = torch.randn(64, 256)
    model(x).sum().backward(); opt.step(); opt.zero_grad()
"""


def test_failure_names_the_five_largest_owners_at_the_peak(pytester, run):
    import memtorch

    if not memtorch.cpu.exact():
        pytest.skip("needs exact CPU counters")
    pytester.makepyfile(test_watched=WATCHED)
    result = run(subprocess=True)  # a fresh process: nothing of earlier tests among the owners
    result.assert_outcomes(failed=2)
    # the FAILURES section only: with CI set, pytest prints whole messages in the short summary too
    text = result.stdout.str().split("short test summary info")[0]
    # 0.weight is 512 x 256 float32: 512.0 KiB; its gradient and Adam's two state tensors too
    assert text.count("who held the bytes at the peak") == 2, text
    for name in ("0.weight.grad (gradient)", "0.weight.exp_avg (optimizer state)"):
        assert text.count(f"512.0 KiB  {name}") == 2, text
    assert "512.0 KiB  0.weight (parameter)" in text  # built while counting: in the peak


def test_watch_of_something_else_is_a_clear_error(pytester, run):
    pytester.makepyfile(
        test_w="""
        import pytest

        @pytest.fixture
        def model():
            return 3

        @pytest.mark.memory_budget(peak="1 MiB", watch="model")
        def test_w(model):
            pass
        """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fixture 'model' is a int: expected one torch.nn.Module and/or one torch.optim.Optimizer*"])


@pytest.mark.slow  # three pytest runs, each importing torch
def test_save_stores_every_figure_and_compare_compares_each(pytester, run, tmp_path):
    import memtorch

    pytester.makepyfile(
        test_s="""
        import os
        import pytest
        import torch

        N = int(os.environ.get("N_FLOATS", "1000"))

        KEPT = []

        @pytest.mark.memory_budget(peak="1 MiB", delta="1 MiB", leak="1 MiB", device="cpu")
        def test_s(memtorch_tracker):
            for _ in range(3):
                KEPT.append(torch.ones(N))
                memtorch_tracker.step()
        """
    )
    saved = tmp_path / "m.json"
    run(f"--memtorch-save={saved}", subprocess=True).assert_outcomes(passed=1)
    import json

    data = json.loads(saved.read_text())
    fig = data["test_s.py::test_s"]
    assert fig["budget"] == {"peak": 1 << 20, "delta": 1 << 20, "leak": 1 << 20}
    if memtorch.cpu.exact():
        # three tensors of 1,000 float32 kept: 12,000 B left, 4,000 B a step after the warm-up step
        assert fig["delta"] == 12000 and fig["peak"] == 12000 and fig["leak"] == 4000
    assert {"peak", "delta", "leak", "device", "exact"} <= set(fig)
    # twice the floats: every figure doubles, and each is compared
    import os

    os.environ["N_FLOATS"] = "2000"
    try:
        result = run(f"--memtorch-compare={saved}", "--memtorch-fail-on-increase=5%", subprocess=True)
    finally:
        del os.environ["N_FLOATS"]
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    if memtorch.cpu.exact():
        assert "peak 23.4 KiB exceeds baseline 11.7 KiB by 11.7 KiB, +100.0%" in text
        assert "delta 23.4 KiB exceeds baseline 11.7 KiB" in text
        assert "leak 7.8 KiB exceeds baseline 3.9 KiB" in text


@pytest.mark.slow  # two pytest runs, each importing torch
def test_a_leak_of_a_fraction_of_a_byte_is_saved_and_compared_exactly(pytester, run, tmp_path, monkeypatch):
    import memtorch

    if not memtorch.cpu.exact():
        pytest.skip("needs memtorch's exact CPU counters")
    # Three steps each keep 1,000 float32 (4,000 B); the last also keeps EXTRA int8 bytes. After the
    # warm-up step the rate is (4,000 + 4,000 + EXTRA) / 2 B: 4,000 B with EXTRA=0, 8,001/2 B with EXTRA=1.
    pytester.makepyfile(
        test_f="""
        import os
        import pytest
        import torch

        EXTRA = int(os.environ.get("EXTRA_BYTES", "0"))
        KEPT = []

        @pytest.mark.memory_budget(leak="1 MiB", device="cpu")
        def test_f(memtorch_tracker):
            for i in range(3):
                KEPT.append(torch.ones(1000))
                if i == 2 and EXTRA:
                    KEPT.append(torch.ones(EXTRA, dtype=torch.int8))
                memtorch_tracker.step()
        """
    )
    import json

    saved = tmp_path / "f.json"
    run(f"--memtorch-save={saved}", subprocess=True).assert_outcomes(passed=1)
    assert json.loads(saved.read_text())["test_f.py::test_f"]["leak"] == 4000
    # half a byte a step more than the baseline, nothing allowed: a regression (floored, it read 4,000 = 4,000)
    monkeypatch.setenv("EXTRA_BYTES", "1")
    result = run(f"--memtorch-compare={saved}", "--memtorch-fail-on-increase=0 B", subprocess=True)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*leak 3.907 KiB exceeds baseline 3.906 KiB by 0.5 B*"])  # 4,000.5 vs 4,000 B
    # a fractional baseline is saved as the exact fraction and read back
    resaved = tmp_path / "g.json"
    run(f"--memtorch-save={resaved}", subprocess=True).assert_outcomes(passed=1)
    assert json.loads(resaved.read_text())["test_f.py::test_f"]["leak"] == "8001/2"
    run(f"--memtorch-compare={resaved}", "--memtorch-fail-on-increase=0 B", subprocess=True).assert_outcomes(
        passed=1
    )


FAKE_CUDA_CONFTEST = """
import torch
import fake_cuda

fake_cuda.FAKE = torch.cuda = fake_cuda.FakeCuda(torch.cuda)  # one device; the tests drive its counters


def pytest_unconfigure(config):
    torch.cuda = fake_cuda.FAKE._real
"""


def test_cuda_budget_verdict_does_not_depend_on_an_earlier_higher_test(pytester, run, tmp_path, monkeypatch):
    # A fake torch.cuda (tests/fake_cuda.py) whose counters the tests drive. torch keeps one peak per
    # device: after test_a_high's 100 MiB, test_b_low's 64 MiB stays below that older peak, and
    # counters read around its body alone only bound its peak (between 0 and 100 MiB). The plugin
    # resets torch's peak at the start of a budgeted body, so 64 MiB is measured exactly and fails 32 MiB.
    monkeypatch.setattr(torch, "cuda", torch.cuda)  # put back after the run, whatever happens in it
    pytester.makepyfile(fake_cuda=(ROOT / "tests" / "fake_cuda.py").read_text())
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(
        test_order="""
        import pytest, torch

        MiB = 2**20

        def test_a_high():
            torch.cuda.alloc(100 * MiB)
            torch.cuda.free(100 * MiB)

        @pytest.mark.memory_budget(peak="32 MiB", device="cuda")
        def test_b_low():
            torch.cuda.alloc(64 * MiB)
            torch.cuda.free(64 * MiB)

        @pytest.mark.memory_budget(peak="128 MiB", device="cuda")
        def test_c_within():
            torch.cuda.alloc(64 * MiB)
            torch.cuda.free(64 * MiB)

        @pytest.fixture
        def held():
            torch.cuda.alloc(64 * MiB)
            yield
            torch.cuda.allocated = 0

        @pytest.mark.memory_budget(peak="32 MiB", device="cuda")
        def test_d_resets_torchs_peak_itself(held):
            torch.cuda.free(64 * MiB)
            torch.cuda.reset_peak_memory_stats()  # the body's own reset: its peak is only bounded now
            torch.cuda.alloc(16 * MiB)
            torch.cuda.free(16 * MiB)
        """
    )
    saved = tmp_path / "order.json"
    result = run("-v", f"--memtorch-save={saved}")
    result.assert_outcomes(passed=2, failed=2)
    MiB = 2**20
    result.stdout.fnmatch_lines(
        [
            "*::test_a_high PASSED*",
            "*::test_b_low OVER BUDGET*",
            "*::test_c_within PASSED*",
            "*::test_d_resets_torchs_peak_itself BUDGET INCONCLUSIVE*",
        ]
    )
    low = f"peak {units.format(64 * MiB)} exceeds budget {units.format(32 * MiB)} by {units.format(32 * MiB)}"
    assert low in result.outlines
    # test_d: the body started with 64 MiB held and ended with torch's peak (16 MiB) below that:
    # a reset inside it, so its peak is at least its start (0 B above it) with no upper bound
    unsure = f"peak budget {units.format(32 * MiB)} inconclusive: the peak is at least 0 B, with no upper bound"
    assert any(line.startswith(unsure) for line in result.outlines), result.outlines
    data = json.loads(saved.read_text())
    assert data["test_order.py::test_b_low"]["peak"] == 64 * MiB and data["test_order.py::test_b_low"]["exact"]
    assert data["test_order.py::test_c_within"]["peak"] == 64 * MiB and data["test_order.py::test_c_within"]["exact"]
    assert data["test_order.py::test_d_resets_torchs_peak_itself"]["exact"] is False


def test_cuda_regression_check_never_passes_on_a_lower_bound(pytester, run, tmp_path, monkeypatch):
    # --memtorch-fail-on-increase compares with a baseline; a peak only bounded from below (the
    # body reset torch's peak itself: no upper bound) cannot be shown within the allowed growth
    monkeypatch.setattr(torch, "cuda", torch.cuda)
    pytester.makepyfile(fake_cuda=(ROOT / "tests" / "fake_cuda.py").read_text())
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(
        test_base="""
        import pytest, torch

        MiB = 2**20

        @pytest.fixture
        def held():
            torch.cuda.alloc(64 * MiB)
            yield
            torch.cuda.allocated = 0

        def test_resets_itself(held, memtorch_tracker):
            torch.cuda.free(64 * MiB)
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.alloc(16 * MiB)
            torch.cuda.free(16 * MiB)
        """
    )
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps({"test_base.py::test_resets_itself": {"peak": 0, "device": "cuda:0"}}))
    result = run(f"--memtorch-compare={baseline}", "--memtorch-fail-on-increase=5%")
    result.assert_outcomes(failed=1)
    expected = (
        f"peak at least 0 B (no upper bound) cannot be compared with baseline 0 B (allowed +5%, "
        f"baseline from {baseline}): inconclusive, the body reset torch's peak counter itself"
    )
    assert expected in result.outlines, result.outlines


def test_cuda_budget_reset_keeps_an_enclosing_block_exact_and_says_what_the_user_sees(
    pytester, run, monkeypatch
):
    # The plugin resets torch's peak at test_b_low's start (torch's peak, 100 MiB, is above what is
    # allocated, 0): a memtorch block open around the tests keeps its exact 100 MiB (the reset is
    # folded into it); the user's own torch.cuda.max_memory_allocated() gives the peak since that reset.
    monkeypatch.setattr(torch, "cuda", torch.cuda)
    pytester.makepyfile(fake_cuda=(ROOT / "tests" / "fake_cuda.py").read_text())
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(
        test_user="""
        import pytest, torch, memtorch

        MiB = 2**20

        @pytest.fixture(scope="module")
        def outer():
            with memtorch.track(device="cuda") as t:
                yield t
            assert t.report.exact and t.report.peak_above_start == 100 * MiB, t.report

        def test_a_high(outer):
            torch.cuda.alloc(100 * MiB)
            torch.cuda.free(100 * MiB)

        @pytest.mark.memory_budget(peak="64 MiB", device="cuda")
        def test_b_low(outer):
            torch.cuda.alloc(16 * MiB)
            torch.cuda.free(16 * MiB)

        def test_c_users_view(outer):
            assert torch.cuda.max_memory_allocated() == 16 * MiB
            assert torch.cuda.calls["reset_peak_memory_stats"] == 1
        """
    )
    result = run("-v")
    result.assert_outcomes(passed=3)
