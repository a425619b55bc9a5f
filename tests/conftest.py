"""Shared fixtures. The autouse check fails any test that leaves memtorch state behind."""

import os
import sys
import threading

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture
def worker_start():
    """The start method for the worker processes a test makes (DataLoader's multiprocessing_context): None,
    the platform's default (fork on Linux), except under AddressSanitizer (.ci/run's second stage), where a
    DataLoader worker forked from the test process (an xdist worker: threads of its own) once deadlocked in
    the child, and the stage waited for it until CI's limit; forkserver forks the workers from a server
    process of one thread. What the tests check (processes made during a block) holds for either."""
    return "forkserver" if os.environ.get("MEMTORCH_UNDER_ASAN") else None


def _leftovers():
    """What memtorch or torch still holds that a finished test should have released."""
    found = []
    # Every memtorch module with process-wide state reports what is still open.
    for name, mod in list(sys.modules.items()):
        if name.startswith("memtorch.") and hasattr(mod, "_debug_leftovers"):
            found += [f"{name}: {item}" for item in mod._debug_leftovers()]
    torch_mod = sys.modules.get("torch.nn.modules.module")
    if torch_mod is not None:
        for attr in dir(torch_mod):
            if attr.startswith("_global_") and (attr.endswith("hooks") or attr.endswith("_called")):
                hooks = getattr(torch_mod, attr)
                if hooks:
                    found.append(f"torch.nn.modules.module.{attr} holds {len(hooks)} hook(s)")
    optim_mod = sys.modules.get("torch.optim.optimizer")
    if optim_mod is not None:
        for attr in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            hooks = getattr(optim_mod, attr, None)
            if hooks:
                found.append(f"torch.optim.optimizer.{attr} holds {len(hooks)} hook(s)")
    return found


@pytest.fixture
def raw_counters():
    """Release memtorch's own held CPU-counter installation (keep_counting) around
    a test that checks the installation mechanism itself."""
    from memtorch import cpu

    cpu.keep_counting(False)
    yield
    cpu.keep_counting(True)


@pytest.fixture(autouse=True)
def no_state_left_behind(request):
    threads_before = {t.ident for t in threading.enumerate()}
    before = _leftovers()
    yield
    after = [x for x in _leftovers() if x not in before]
    new_threads = [
        t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive() and not t.daemon
    ]
    problems = after + [f"thread {n!r} still running" for n in new_threads]
    if problems:
        pytest.fail("test left state behind:\n  " + "\n  ".join(problems), pytrace=False)


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/*.txt from the current renderers instead of comparing (tests/test_golden.py)",
    )
