"""Shared helpers for benchmark scripts: machine description, timing, BENCHMARKS.md sections.

Each script owns one section of BENCHMARKS.md, delimited by
<!-- bench:NAME --> ... <!-- /bench:NAME -->, and rewrites only that section.
"""

import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
HEADER = (
    "# memtorch benchmarks\n\n"
    "Written by the scripts in `benchmarks/`; never edited by hand. Each section says the command "
    "that rewrites it. Ratios compare runs made in one process, in one run of the script.\n"
)


def machine():
    """One line describing the machine and versions."""
    import numpy
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "?"
    return (
        f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
        f"numpy {numpy.__version__}; torch threads {torch.get_num_threads()}; memtorch at {commit or '?'}"
    )


def best_of(fn, repeat=5, number=1):
    """Median and minimum seconds per call of fn over `repeat` rounds of `number` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times), min(times)


def write_section(name, markdown):
    """Replace (or append) the section NAME of BENCHMARKS.md with `markdown`."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else HEADER
    block = f"<!-- bench:{name} -->\n{markdown.rstrip()}\n<!-- /bench:{name} -->"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda m: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)
    print(f"wrote section {name!r} of {BENCHMARKS_MD}")
