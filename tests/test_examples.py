"""The examples in examples/ run as CI and the README run them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _plugin_args():
    """Load the plugin by hand only where it is not installed (its pytest11 entry point)."""
    from importlib.metadata import entry_points

    installed = any(ep.value == "memtorch.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "memtorch.pytest_plugin"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# examples that start several processes (torchrun) or make many dry runs are slow: the normal pass runs them
_SLOW = {"ddp_torchrun.py", "will_it_fit.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n
        for n in sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("test_"))
    ],
)
def test_example_script_runs(script):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip(), f"{script} printed nothing"


@pytest.mark.parametrize("testfile", sorted(p.name for p in EXAMPLES.glob("test_*.py")))
def test_example_test_file_passes(testfile):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *_plugin_args(), "-p", "no:cacheprovider", str(EXAMPLES / testfile)],
        cwd=EXAMPLES,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout, proc.stdout
