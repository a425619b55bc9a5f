"""memtorch.inspect against the pure-Python reference walker and torchinfo, in one process.

    python benchmarks/bench_inspect.py            # writes section "inspect" of BENCHMARKS.md
    python benchmarks/bench_inspect.py --quick    # smaller synthetic model, no file written

Models (both on the meta device, nothing allocated): a 12-layer nn.TransformerEncoder
(BERT-base shapes) and a synthetic Sequential of 25,000 Linear(8, 8), i.e. 50,000
parameter tensors. torchinfo must be installed (pip install torchinfo torch==2.13.0).
"""

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import memtorch  # noqa: E402
from memtorch import _reference, units  # noqa: E402
from memtorch.inspection import walk  # noqa: E402

import zoo  # noqa: E402
from _common import machine, write_section  # noqa: E402

CALLS = ("untyped_storage()", "._cdata", ".nbytes()", "numel()", "dtype", "device", "requires_grad", "layout", "grad")


def best(fn, repeat):
    """Minimum seconds of `repeat` calls (the least disturbed run on a shared machine)."""
    fn()
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def torch_calls_only(tensors):
    """The torch calls the walker makes per tensor, from a Python loop (an upper bound
    on their cost: it includes the interpreter's own overhead)."""
    for t in tensors:
        s = t.untyped_storage()
        s._cdata, s.nbytes(), t.numel(), t.dtype, t.device, t.requires_grad, t.layout, t.grad


def true_total(model):
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def run(name, model, repeat, peers=True):
    from torchinfo import summary

    params = list(model.parameters())
    n_tensors = len(params) + len(list(model.buffers()))
    res = {"name": name, "tensors": n_tensors, "true": true_total(model)}
    res["inspect"] = best(lambda: memtorch.inspect(model).total, repeat)
    res["reference"] = best(lambda: _reference.inspect(model).total, max(2, repeat // 2))
    res["c_walk"] = best(lambda: walk(model), repeat)
    res["py_walk"] = best(lambda: _reference.walk(model), max(2, repeat // 2))
    res["calls"] = best(lambda: torch_calls_only(params), repeat)
    res["list_params"] = best(lambda: list(model.parameters()), repeat)
    res["mm_total"] = memtorch.inspect(model).total
    res["ref_total"] = _reference.inspect(model).total
    if peers:
        res["torchinfo"] = best(lambda: summary(model, verbose=0), 2 if n_tensors > 10_000 else repeat)
        stats = summary(model, verbose=0)
        res["ti_bytes"] = stats.total_param_bytes
    return res


def table(results):
    lines = [
        "| model | tensors | memtorch.inspect | _reference (pure Python) | ratio | torchinfo.summary | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ti = r.get("torchinfo")
        lines.append(
            f"| {r['name']} | {r['tensors']:,} | {r['inspect'] * 1e3:.1f} ms | {r['reference'] * 1e3:.1f} ms | "
            f"{r['reference'] / r['inspect']:.1f}x | "
            + (f"{ti * 1e3:.1f} ms | {ti / r['inspect']:.1f}x |" if ti else "- | - |")
        )
    lines += [
        "",
        "Where the time goes (same runs; minimum of several calls):",
        "",
        "| model | C walk (`_C._walk`) | per tensor | figures in Python (inspect - walk) | "
        "torch calls alone, from a Python loop | `list(m.parameters())` | pure-Python walk |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['c_walk'] * 1e3:.1f} ms | {r['c_walk'] / r['tensors'] * 1e6:.2f} us | "
            f"{max(r['inspect'] - r['c_walk'], 0) * 1e3:.1f} ms | {r['calls'] * 1e3:.1f} ms | "
            f"{r['list_params'] * 1e3:.1f} ms | {r['py_walk'] * 1e3:.1f} ms |"
        )
    lines += ["", "Totals (bytes):", "", "| model | true (unique storages) | memtorch | _reference | torchinfo |",
              "|---|---:|---:|---:|---:|"]
    for r in results:
        ti = r.get("ti_bytes")
        lines.append(
            f"| {r['name']} | {r['true']:,} ({units.format(r['true'])}) | {r['mm_total']:,} | {r['ref_total']:,} | "
            + (f"{ti:,} |" if ti is not None else "- |")
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n = 5_000 if args.quick else 50_000
    t0 = time.perf_counter()
    big = zoo.synthetic_many(n)
    build = time.perf_counter() - t0
    print(f"built synthetic model of {n} tensors in {build:.1f} s", flush=True)
    tr = zoo.transformer_12()
    results = [
        run("12-layer TransformerEncoder (meta)", tr, repeat=7),
        run(f"synthetic, {n:,} parameter tensors (meta)", big, repeat=5),
    ]
    md = table(results)
    print(md)
    for r in results:
        assert r["mm_total"] == r["ref_total"] == r["true"], r
    if args.quick:
        return
    text = (
        "## inspect\n\n"
        f"Machine: {machine()}\n\n"
        "Command: `python benchmarks/bench_inspect.py` (torchinfo "
        f"{__import__('torchinfo').__version__ if hasattr(__import__('torchinfo'), '__version__') else '?'}). "
        "Times are the minimum over several calls in one process (the machine is shared). "
        "memtorch.inspect and the reference both build the same ModelMemory and read `.total`; "
        "torchinfo runs `summary(model, verbose=0)`.\n\n"
        + md
        + "\n\n"
        "Reading the split: the C walker makes the torch calls "
        + ", ".join(f"`{c}`" for c in CALLS)
        + " per tensor (torch's own methods, called through the C API); the column 'torch calls alone' "
        "makes the same calls from a Python loop. The walker's own work (dict reads of `_parameters`, "
        "`_buffers`, `_modules`, path strings, the row buffer) is what remains. torchinfo's byte total "
        "is compared in the last table: it is its `total_param_bytes`.\n"
    )
    write_section("inspect", text)


if __name__ == "__main__":
    main()
