"""Per-rank peaks of real DDP, ZeRO-1 and FSDP2 runs (gloo, CPU), beside memtorch.estimate().

For each model (an MLP, a GPT-style transformer with tied embeddings, a CNN),
each way of splitting the work and each world size (2 and 4 ranks), the script
starts that many processes on this machine (one per rank, gloo over localhost,
one torch thread each) and, on every rank:

  1. memtorch.cpu.start() first, so the counters see every tensor of the process;
  2. builds the model (same seed on every rank) and wraps it:
       ddp     DistributedDataParallel (gloo)
       zero1   ZeroRedundancyOptimizer(AdamW): optimizer state sharded (ZeRO-1)
       zero2   FSDP2 fully_shard(reshard_after_forward=False): parameters, gradients
               and optimizer state sharded; parameters stay gathered from forward to
               backward (ZeRO-2-like)
       zero3   FSDP2 fully_shard(reshard_after_forward=True): parameters re-sharded
               after forward and gathered again in backward (ZeRO-3)
     (FSDP2 shards each block (gpt) or each child holding parameters (mlp, cnn), then
     the root; AdamW everywhere, lr 1e-3.)
  3. runs --steps training steps (loss = output.sum(), as estimate()'s default)
     inside memtorch.track(), each on a fresh batch of the same shape;
  4. reports the peak: bytes allocated at the highest point of the steps, counted
     from before the model was built (so parameters, gradients, optimizer state,
     activations, inputs and communication buffers all count; everything that
     PyTorch's CPU allocator handed out on that rank).

The estimate column is memtorch.estimate(model, one rank's batch, optimizer="adamw",
world_size=N, sharding=..., fsdp_units=<the units wrapped>) for that rank, when this
memtorch has it; the error is (estimate - measured) / measured.

--from-json FILE takes the measurements from FILE (written by --json) and computes
only the estimates (seconds); --remeasure MODEL:WAY:WORLD[,...] runs those
configurations again even when FILE has them (the rest still come from FILE).

    python benchmarks/bench_distributed.py [--models mlp,gpt,cnn] [--ways ddp,zero1,zero2,zero3]
                                           [--worlds 2,4] [--steps 3] [--repeat 2] [--no-write]
                                           [--json FILE] [--from-json FILE] [--remeasure mlp:zero2:2,...]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WAYS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1 (ZeroRedundancyOptimizer)",
    "zero2": "FSDP2 reshard_after_forward=False",
    "zero3": "FSDP2 reshard_after_forward=True",
}


# ---------------------------------------------------------------------------
# Models (built identically here and in each rank)


def make_model(name):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16)
        )  # fmt: skip
        return model, (torch.randn(64, 512),)
    if name == "gpt":
        model = TinyGPT(vocab=2048, d=128, heads=4, layers=2, seq=64)
        return model, (torch.randint(0, 2048, (8, 64)),)
    if name == "cnn":

        def block(cin, cout):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)
            )

        model = nn.Sequential(
            block(3, 32), block(32, 64), block(64, 128), nn.Flatten(), nn.Linear(128 * 4 * 4, 16)
        )
        return model, (torch.randn(16, 3, 32, 32),)
    raise SystemExit(f"unknown model {name!r}: expected mlp, gpt or cnn")


def _gpt_classes():
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        """Token + position embeddings, pre-LN blocks, an output layer tied to the token embedding."""

        def __init__(self, vocab, d, heads, layers, seq):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.tok.weight  # tied

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return GPT


def TinyGPT(**kw):
    return _gpt_classes()(**kw)


def shard_units(model):
    """[(name, module)] FSDP2 shards on their own before the root: each block (gpt), else each child with
    parameters. estimate() is given the same names (fsdp_units=)."""
    if hasattr(model, "blocks"):
        return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    return [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]


# ---------------------------------------------------------------------------
# One rank


def worker(model_name, way, steps):
    import memtorch

    memtorch.cpu.start()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    base = memtorch.cpu.allocated()
    model, inputs = make_model(model_name)
    if way == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif way == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        from torch.distributed.fsdp import fully_shard

        reshard = way == "zero3"
        for _, unit in shard_units(model):
            fully_shard(unit, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    built = memtorch.cpu.allocated() - base
    gen = torch.Generator().manual_seed(rank)
    shapes = [(x.shape, x.dtype) for x in inputs]
    del inputs
    dist.barrier()
    t0 = time.perf_counter()
    with memtorch.track(model, optimizer=opt, modules=False) as t:
        for _ in range(steps):
            batch = [
                torch.randint(0, 2048, s, generator=gen)
                if dt == torch.int64
                else torch.randn(s, generator=gen)
                for s, dt in shapes
            ]
            model(*batch).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del batch
            t.step()
    seconds = time.perf_counter() - t0
    r = t.report
    try:  # this rank's model states after the run (FSDP2's DTensors count their local shard)
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's state in .optim
        states = {k: int(v) for k, v in memtorch.inspect(model, optimizer=inner).by_category.items()}
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        states = {"error": f"{type(e).__name__}: {e}"}
    out = {
        "rank": rank,
        "world": world,
        "built": built,
        "peak": r.peak - base,
        "end": r.end - base,
        "phases": {n: p.peak - base for n, p in r.phases.items()},
        "exact": r.exact and not r.unseen_frees,
        "states": states,
        "seconds": seconds,
    }
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# The driver


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_name, way, world, steps, timeout=600):
    """Run one configuration on `world` ranks; their RESULT dicts by rank, or (None, why)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
        )  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", model_name, way, "--steps", str(steps)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return None, f"did not finish in {timeout} s"
    results = []
    for p, out in zip(procs, outs):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            return None, f"rank failed: {last[0][:200]}"
        results.append(json.loads(lines[0][7:]))
    return sorted(results, key=lambda d: d["rank"]), None


def estimates(model_name, way, world):
    """memtorch.estimate()'s and memtorch.plan()'s per-rank figures for this configuration, or (None, why):
    peaks (gloo's scratch freed when its collective returns) and uppers (freed only at the next collective)."""
    import memtorch

    if "estimate" not in getattr(memtorch, "_EXPORTS", {}):
        return None, "no memtorch.estimate() in this tree"
    model, inputs = make_model(model_name)
    kw = {}
    if way in ("zero2", "zero3"):  # the units the runs wrap
        kw["fsdp_units"] = [name for name, _ in shard_units(model)]
    try:
        est = memtorch.estimate(model, *inputs, optimizer="adamw", world_size=world, sharding=way, device="cpu", **kw)
        # memtorch.plan()'s row for the same configuration (its figures come from the same replay)
        p = memtorch.plan(model, *inputs, world_sizes=[world], shardings=[way], precisions=["fp32"],
                          checkpointing=[None], optimizer="adamw", device="cpu", reserve=0, **kw)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - reported in the table
        return None, f"{type(e).__name__}: {e}"
    rows = [{k: v for k, v in r.items() if k != "spans"} for r in est.per_rank]
    opt = p.options[0]
    return {
        "peak": est.peak,
        "peaks": [int(r["peak"]) for r in est.per_rank],
        "uppers": [int(r.get("peak_upper", r["peak"])) for r in est.per_rank],
        "per_rank": rows,
        "plan": opt.peak,
        "plan_peaks": list(opt.rank_peaks),
        "plan_uppers": list(opt.rank_peaks_upper or opt.rank_peaks),
    }, None


def _commit():
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def _error(low, high, measured):
    """(estimate - measured) / measured, 0 when the measured peak lies in the estimated range [low, high]."""
    if low <= measured <= high:
        return 0.0
    nearest = low if measured < low else high
    return (nearest - measured) / measured


def _figure(low, high):
    import memtorch

    f = memtorch.units.format
    return f(low) if low == high else f"{f(low)} to {f(high)}"


def findings(raw):
    """Lines saying how many rank rows are within 5% and where the estimate misses, with figures from the
    runs (nothing typed by hand)."""
    import memtorch

    f = memtorch.units.format
    total = within = plan_within = 0
    in_range = 0
    misses = []
    for d in raw:
        if not d["ranks"] or not d.get("estimate"):
            continue
        e = d["estimate"]
        for r in d["ranks"]:
            total += 1
            k = r["rank"]
            lo, hi = e["peaks"][k], e.get("uppers", e["peaks"])[k]
            err = _error(lo, hi, r["peak"])
            if abs(err) <= 0.05:
                within += 1
            else:
                misses.append((d, r, lo, hi, err))
            if lo < hi and lo <= r.get("peak_low", r["peak"]) and r["peak"] <= hi:
                in_range += 1
            plo, phi = e["plan_peaks"][k], e.get("plan_uppers", e["plan_peaks"])[k]
            if abs(_error(plo, phi, r["peak"])) <= 0.05:
                plan_within += 1
    out = [
        "",
        f"**{within} of {total} rank rows are within 5% of the measured peak** (estimate column); the plan "
        f"column (memtorch.plan()'s row for the same configuration) has {plan_within} of {total}. Where FSDP "
        "runs on gloo, the estimate is a range: from every collective's scratch freed when the collective "
        "returns to each one freed only when the next collective's scratch is allocated (gloo's worker thread "
        "drops a finished work when it runs again); an error of 0 means the measured peak lies in the range "
        f"({in_range} rank rows have a range whose runs all fall inside it).",
        "",
    ]
    for d, r, lo, hi, err in misses:
        out.append(
            f"- miss: {d['model']}, {WAYS[d['way']]}, {d['world']} ranks, rank {r['rank']}: estimate "
            f"{_figure(lo, hi)}, measured {f(r['peak'])} ({err * 100:+.1f}%)"
        )
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "WAY"))
    ap.add_argument("--models", default="mlp,gpt,cnn")
    ap.add_argument("--ways", default="ddp,zero1,zero2,zero3")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--repeat", type=int, default=2, help="runs of each configuration (the peak: the highest)"
    )
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", help="also write the raw results to this file")
    ap.add_argument(
        "--from-json", help="take the measurements from this file (written by --json); run the rest"
    )
    ap.add_argument(
        "--remeasure", default="", help="MODEL:WAY:WORLD,... to run again even when --from-json has them"
    )
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker, args.steps)
        return
    import memtorch
    from benchmarks._common import machine, write_section

    f = memtorch.units.format
    rows, raw = [], []
    earlier = {}
    if args.from_json:  # measurements of an earlier run: only the estimates are computed now
        with open(args.from_json) as fh:
            for d in json.load(fh):
                earlier[(d["model"], d["way"], d["world"])] = d
    for item in filter(None, args.remeasure.split(",")):
        try:
            m_, w_, n_ = item.split(":")
            earlier.pop((m_, w_, int(n_)), None)
        except ValueError:
            raise SystemExit(f"--remeasure takes MODEL:WAY:WORLD items, got {item!r}") from None
    for model_name in args.models.split(","):
        for way in args.ways.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                t0 = time.perf_counter()
                if (model_name, way, world) in earlier:
                    d = earlier[(model_name, way, world)]
                    res, why, wall = d["ranks"], d["why"], d["wall"]
                    measured_at = d.get("measured_at", "?")
                else:
                    measured_at = _commit()
                    runs = []
                    why = None
                    for _ in range(args.repeat):
                        res, why = launch(model_name, way, world, args.steps)
                        if res is None:
                            break
                        runs.append(res)
                    res = None
                    if runs and why is None:
                        res = runs[0]
                        for r in res:  # the peak: highest and lowest over the runs
                            peaks = [run[r["rank"]]["peak"] for run in runs]
                            r["peak"], r["peak_low"] = max(peaks), min(peaks)
                    wall = time.perf_counter() - t0
                est, est_why = estimates(model_name, way, world)
                raw.append({"model": model_name, "way": way, "world": world, "ranks": res, "why": why,
                            "estimate": est, "estimate_why": est_why, "wall": wall,
                            "measured_at": measured_at})  # fmt: skip
                if res is None:
                    rows.append(
                        [model_name, WAYS[way], str(world), "-", f"could not run: {why}", "", "", "", "", ""]
                    )
                    print(model_name, way, world, "FAILED", why, flush=True)
                    continue
                for r in res:
                    if est is not None:
                        k = r["rank"]
                        lo, hi = est["peaks"][k], est["uppers"][k]
                        e_txt = _figure(lo, hi)
                        plo, phi = est["plan_peaks"][k], est["plan_uppers"][k]
                        p_txt = _figure(plo, phi)
                        p_err = f"{_error(plo, phi, r['peak']) * 100:+.1f}%"
                        err = f"{_error(lo, hi, r['peak']) * 100:+.1f}%"
                    else:
                        e_txt, err, p_txt, p_err = "-", (est_why or "")[:60], "-", ""
                    measured = f(r["peak"])
                    if r["peak_low"] != r["peak"]:
                        measured += f" (runs: {f(r['peak_low'])} to {f(r['peak'])})"
                    rows.append([model_name, WAYS[way], str(world), str(r["rank"]), measured,
                                 f(r["built"]), e_txt, err, p_txt, p_err])  # fmt: skip
                print(model_name, way, world, [f(r["peak"]) for r in res], f"{wall:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=1)
    header = ["model", "sharding", "ranks", "rank", "measured peak", "after wrapping", "estimate", "error",
              "plan", "plan error"]  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    md = "\n".join([
        "## Distributed: per-rank peaks of real runs beside memtorch.estimate()",
        "",
        f"Machine: {machine()}.",
        "",
        "Measured at memtorch " + ", ".join(sorted({d.get("measured_at", "?") for d in raw})) + "; estimates "
        f"at {_commit()}.",
        "",
        "`python benchmarks/bench_distributed.py` (gloo on localhost, one process per rank, one torch thread "
        f"each, AdamW, {args.steps} steps, loss = output.sum()). Models: mlp = Linear 512-1024-1024-16, batch 64; "
        "gpt = 2 pre-LN blocks, d 128, 4 heads, vocab 2048, sequence 64, batch 8, output layer tied to the "
        "token embedding; cnn = 3 conv-BatchNorm-ReLU-pool blocks (32, 64, 128 channels) and a linear layer, "
        "batch 16x3x32x32. Each rank uses one batch of that shape per step.",
        "",
        f"*measured peak*: the highest over {args.repeat} runs (the range where the runs differ) of "
        "the bytes PyTorch's CPU allocator had handed out on that rank at the highest point of the "
        "steps, counted by memtorch's exact CPU counters from before the model was built (parameters, gradients, "
        "optimizer state, activations, the batch, the wrappers' communication buffers and the scratch tensors "
        "gloo's all-gather and reduce-scatter take from that allocator; not what gloo allocates elsewhere). "
        "*after wrapping*: what was allocated once the model "
        "and optimizer were built and wrapped, before the first step. *estimate*: memtorch.estimate(model, "
        "batch, optimizer='adamw', world_size=N, sharding=..., fsdp_units=the units wrapped) for that rank; "
        "*error*: (estimate - measured) / measured, from the nearer end of a range, 0 inside it. *plan*: "
        "memtorch.plan()'s row for that configuration (one dry run, then estimate()'s own per-rank replay), and "
        "its error. "
        "`python benchmarks/bench_distributed.py --from-json benchmarks/bench_distributed.json --json "
        "benchmarks/bench_distributed.json` recomputes the estimate and plan columns from these measurements.",
        "",
        *table,
        *findings(raw),
    ])  # fmt: skip
    if args.no_write:
        print(md)
    else:
        write_section("distributed", md)


if __name__ == "__main__":
    main()
