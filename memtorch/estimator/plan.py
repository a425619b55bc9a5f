"""plan(): which ways of training a model fit in a device's memory, cheapest first.

    p = memtorch.plan(model, x, device_memory="80 GiB", global_batch=1024)
    print(p)            # one row per combination: world size, sharding, precision,
                        # checkpointing, micro-batch, per-rank peak, margin
    p.best              # the cheapest combination that fits (an Option), or None

How plan() works. For each (precision, checkpointing, micro-batch)
memtorch.estimate() dry-runs one training step on one process (fake tensors, no
real memory); every world size and sharding after that is a replay of that dry
run per rank by estimate()'s own code (estimation._rank_results), so each row
is what estimate(..., world_size=N, sharding=...) reports, at the cost of one
replay of the recorded allocations (no new dry run) per world size and sharding.

The arithmetic of per_rank() / plan_from() (on a Breakdown, without a dry run;
an approximation kept for those who have only the figures), with P, G, O the bytes of parameters, gradients and optimizer state
of one process, G_peak and O_peak the gradient and optimizer-state bytes alive
at its peak, U the parameter bytes of the largest block, and shard(x) = x / n
rounded up to a whole element:

    ddp    peak + G                             (the reducer's gradient buckets: a
                                                 second copy of the gradients; none
                                                 on one rank, trained unwrapped)
    zero1  for each rank r, with s_r its share of the elements and b_r / b its
           largest parameter's / the model's largest parameter's elements:
           max(peak - O_peak + s_r O_peak - S + (b_r / b) S,
               peak_fb - O + s_r O) + G
                                                (torch's ZeroRedundancyOptimizer under
                                                 DDP: whole parameters per rank, split
                                                 as its greedy partition; S the
                                                 optimizer step's scratch at the peak,
                                                 elementwise per parameter, so it follows
                                                 the largest parameter a rank steps;
                                                 peak_fb the forward/backward peak)
    zero1-even peak - O_peak + shard(O_peak)    (DeepSpeed stage 1: optimizer state
                                                 split evenly by elements)
    zero2  zero1-even - G_peak + shard(G_peak) - S + shard(S)
                                                (gradients split as well; FSDP steps
                                                 shards, so the step's scratch is a
                                                 shard's)
    zero3  zero2 - P + shard(P) + 2 (U - shard(U))
                                                (parameters split; a block's full
                                                 parameters gathered for its compute,
                                                 and the next block's prefetched)
    and, given peak_fb, at least the forward/backward peak with the state
    sharded: zero2 peak_fb - O + shard(O) + shard(P) (every parameter gathered,
    and the shards), zero3 peak_fb - O + shard(O) - P + shard(P) + 2 U.

These are the ZeRO paper's model-state formulas (Rajbhandari et al. 2020,
section 5) applied to the measured breakdown; ``zero_model_states`` gives the
paper's own figures (16-bit parameters and gradients, K = 12 bytes of fp32
master weights and Adam state per parameter). This arithmetic is an
approximation (no FSDP2 buffers); plan() does not use it.

(memtorch.estimator.plan, first named memtorch.planning, which stays: inside the
package, importing it never shadows memtorch.plan the function.)

Cheapest first means: fewest devices; then without checkpointing (recomputing a
forward costs about a third more compute); then the sharding that communicates
least (ddp, zero1, zero1-even, zero2, zero3); then the largest micro-batch (fewest
accumulation steps); then the precision in the order given.
"""

import math
from collections import namedtuple

from .. import errors, units
from ..errors import MemtorchError
from .engine import DEFAULT_DEVICE_NOTE, device_memory_of  # cheap: the engine loads estimation when it runs
from ..reports.plan import Plan  # the result type's home; its old name stays

__all__ = ["SHARDINGS", "Breakdown", "Option", "Plan", "per_rank", "plan", "plan_from", "zero_model_states"]

SHARDINGS = ("ddp", "zero1", "zero1-even", "zero2", "zero3")
_CHEAP = {s: i for i, s in enumerate(SHARDINGS)}

Breakdown = namedtuple(
    "Breakdown",
    "peak parameter gradient optimizer_state gradient_at_peak optimizer_state_at_peak numel largest_block "
    "param_numels param_groups step_scratch_at_peak peak_outside_step",
    defaults=(None, None, 0, None),
)
Breakdown.__doc__ = """One process's training step, in bytes (what per_rank() splits).

peak: the step's peak, model states included; parameter, gradient,
optimizer_state: the model states' totals; gradient_at_peak,
optimizer_state_at_peak: the parts of them alive at the peak; numel: trainable
parameter elements (what ZeRO splits); largest_block: parameter bytes of the
largest block that FSDP gathers at once (zero3). For zero1 (whole parameters
per rank): param_numels, the elements of each trainable parameter;
param_groups, their indices per optimizer parameter group (default: one
group); step_scratch_at_peak, the optimizer step's temporaries alive at the
peak; peak_outside_step, the highest of the forward and backward peaks
(default: the peak).
"""

Option = namedtuple(
    "Option",
    "world_size sharding precision checkpointing micro_batch accumulation peak margin fits reserved peak_upper "
    "rank_peaks rank_peaks_upper",
    defaults=(None, None, None, None),
)
Option.__doc__ = """One combination, in bytes: per-rank peak and margin (device memory - reserve - the figure judged).

peak: the highest rank's peak, memtorch.estimate(..., world_size, sharding)'s
own figure; reserved (device="cuda"): the caching allocator's segments on the
highest rank, estimate()'s reserved_peak; peak_upper (device="cpu"): the peak
with gloo's scratch freed late (estimate()'s peak_upper); rank_peaks,
rank_peaks_upper: every rank's peak and (CPU) peak_upper. The figure judged against the device is reserved on CUDA (what
the device must hold), peak_upper on the CPU, else peak; margin < 0 is how far
over. accumulation: micro-batches per optimizer step on each rank
(global_batch / (world_size * micro_batch)), or None without a global batch.
"""


def _check_sharding(sharding):
    if sharding not in SHARDINGS:
        raise MemtorchError(f"unknown sharding {sharding!r}: expected one of {', '.join(SHARDINGS)}")


def _check_world(world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MemtorchError(f"world_size must be a positive int, got {world_size!r}")


def _shard(nbytes, numel, n, pad, what, sharding):
    """Bytes of one rank's shard of ``nbytes`` spread over ``numel`` elements split across n ranks."""
    if nbytes == 0 or n == 1:
        return nbytes
    if numel <= 0:
        return math.ceil(nbytes / n)
    if numel % n and not pad:
        raise MemtorchError(
            f"world_size {n} does not divide the {numel} trainable parameter elements that {sharding} splits "
            f"evenly ({what}); pass pad=True to round each shard up as FSDP and DeepSpeed do, or pick a "
            "world size that divides it"
        )
    per_elem = nbytes / numel
    return int(math.ceil(numel / n) * per_elem)


def per_rank(b, world_size, sharding, pad=True):
    """One rank's figures for ``world_size`` ranks: {parameter, gradient, optimizer_state, buckets, gathered,
    peak, peak_rank, rank_peaks}: the rank with the highest peak, and every rank's peak (they differ for
    zero1, where ranks hold different parameters).

    b: a Breakdown of one process. pad=False refuses a world size that does not
    divide b.numel for a sharding that splits the parameters' elements.
    """
    _check_sharding(sharding)
    _check_world(world_size)
    n = world_size
    P, G, O = b.parameter, b.gradient, b.optimizer_state
    Gp, Op = b.gradient_at_peak, b.optimizer_state_at_peak
    sh = lambda x, what: _shard(x, b.numel, n, pad, what, sharding)
    out = {"parameter": P, "gradient": G, "optimizer_state": O, "buckets": 0, "gathered": 0}
    peak = b.peak
    if sharding == "ddp":
        if n > 1:  # one rank trains without a DDP wrapper: no buckets
            out["buckets"] = G
            peak += G
    elif sharding == "zero1":
        return _zero1(b, n, out)
    else:
        out["optimizer_state"] = sh(O, "optimizer state")
        peak += sh(Op, "optimizer state") - Op
        if sharding in ("zero2", "zero3"):
            out["gradient"] = sh(G, "gradients")
            peak += sh(Gp, "gradients") - Gp
            # FSDP steps each rank's shard: the step's elementwise scratch is a shard's
            S = b.step_scratch_at_peak
            peak += sh(S, "the optimizer step's scratch") - S
        if sharding == "zero3":
            out["parameter"] = sh(P, "parameters")
            U = min(b.largest_block, P)
            gathered = 0 if n == 1 else 2 * (U - math.ceil(U / n))
            out["gathered"] = gathered
            peak += out["parameter"] - P + gathered
        if sharding in ("zero2", "zero3") and b.peak_outside_step is not None and n > 1:
            # the forward/backward peak: state sharded; zero2 keeps every parameter gathered besides the
            # shards, zero3 the shards and two blocks gathered
            fb = b.peak_outside_step - O + out["optimizer_state"]
            if sharding == "zero2":
                fb += sh(P, "parameters")
            else:
                fb += out["parameter"] - P + 2 * min(b.largest_block, P)
            peak = max(peak, fb)
    out["peak"] = int(peak)
    out["peak_rank"] = 0
    out["rank_peaks"] = [int(peak)] * n
    return out


def _zero1(b, n, out):
    """torch's ZeroRedundancyOptimizer (under DDP): each rank's figures from its whole parameters."""
    # lazy: ranks loads only when an estimate's dry run needs it
    from .ranks import zero_partition

    if b.param_numels is None:
        raise MemtorchError(
            "sharding='zero1' (torch's ZeroRedundancyOptimizer) gives each rank whole parameters: the Breakdown "
            "needs param_numels (the elements of each parameter); 'zero1-even' splits the elements evenly"
        )
    numels = list(b.param_numels)
    groups = b.param_groups or [list(range(len(numels)))]
    parts = zero_partition(groups, numels, n)
    total = max(1, sum(numels))
    big = max(numels, default=0) or 1
    S = b.step_scratch_at_peak
    fb = b.peak if b.peak_outside_step is None else b.peak_outside_step
    buckets = b.gradient if n > 1 else 0
    seen = {}  # (elements, largest parameter) of a rank -> its (peak, optimizer state): equal ranks computed once

    def figures(part):
        key = (sum(numels[i] for i in part), max((numels[i] for i in part), default=0))
        if key not in seen:
            share, big_r = key[0] / total, key[1]
            step = b.peak - b.optimizer_state_at_peak + round(share * b.optimizer_state_at_peak) - S + round(S * big_r / big)
            outside = fb - b.optimizer_state + round(share * b.optimizer_state)
            seen[key] = (int(max(step, outside) + buckets), round(share * b.optimizer_state))
        return seen[key]

    idle = figures(())  # a rank without parameters (more ranks than parameters)
    peaks, states = [idle[0]] * n, [idle[1]] * n
    for r, part in enumerate(parts):
        if part:
            peaks[r], states[r] = figures(part)
    top = peaks.index(max(peaks))  # the first rank with the highest peak
    out.update(optimizer_state=states[top], buckets=buckets, peak=peaks[top], peak_rank=top, rank_peaks=peaks)
    return out


def zero_model_states(numel, world_size, sharding, param_bytes=2, grad_bytes=2, k=12):
    """The ZeRO paper's model-state bytes per rank (section 5): (2 + 2 + K) * numel split per stage.

    ddp (baseline): (p + g + K) numel; zero1 (P_os): (p + g) numel + K numel / n;
    zero2 (P_os+g): p numel + (g + K) numel / n; zero3 (P_os+g+p): (p + g + K) numel / n.
    """
    _check_sharding(sharding)
    _check_world(world_size)
    n = world_size
    p, g, o = param_bytes * numel, grad_bytes * numel, k * numel
    if sharding == "ddp":
        return p + g + o
    if sharding == "zero1":
        return p + g + o / n
    if sharding == "zero2":
        return p + (g + o) / n
    return (p + g + o) / n


def _order_key(opt, precisions):
    return (
        opt.world_size,
        0 if not opt.checkpointing else 1,
        _CHEAP.get(opt.sharding, -1),  # one rank (sharding None) first
        -opt.micro_batch,
        precisions.index(opt.precision) if opt.precision in precisions else len(precisions),
    )


def _world_sizes(world_sizes, max_world_size, global_batch):
    if world_sizes is None:
        _check_world(max_world_size)
        out, n = [], 1
        while n <= max_world_size:
            out.append(n)
            n *= 2
        if global_batch is not None:
            out = [n for n in out if global_batch % n == 0]
        return out
    out = list(world_sizes)
    if not out:
        raise MemtorchError("plan() world_sizes is empty: give at least one world size")
    for n in out:
        _check_world(n)
        if global_batch is not None and global_batch % n:
            raise MemtorchError(
                f"world_size {n} does not divide global_batch {global_batch}: each rank must get the same "
                "number of samples per step"
            )
    return out


def plan_from(
    breakdowns,
    device_memory="80 GiB",
    world_sizes=None,
    max_world_size=1024,
    shardings=SHARDINGS,
    global_batch=None,
    reserve=0,
    pad=True,
    notes=(),
    seconds=0.0,
):
    """The arithmetic of plan(): breakdowns {(precision, checkpointing, micro_batch): Breakdown} -> Plan.

    device_memory, reserve: sizes (memtorch.units.parse); a combination fits
    when its per-rank peak <= device_memory - reserve. world_sizes: the world
    sizes to try (default: powers of two up to max_world_size, those dividing
    global_batch). global_batch: samples per optimizer step over all ranks;
    combinations whose world_size * micro_batch does not divide it are skipped.
    """
    import time

    t0 = time.perf_counter()
    memory = units.parse(device_memory)
    keep = units.parse(reserve)
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):  # fmt: skip
        raise MemtorchError(f"global_batch must be a positive int, got {global_batch!r}")
    shardings = list(shardings)
    for s in shardings:
        _check_sharding(s)
    worlds = _world_sizes(world_sizes, max_world_size, global_batch)
    precisions = []
    for prec, _ckpt, _mb in breakdowns:
        if prec not in precisions:
            precisions.append(prec)
    options = []
    skipped = 0
    zero1_needs = "zero1" in shardings and any(b.param_numels is None for b in breakdowns.values())
    if zero1_needs:
        raise MemtorchError(
            "sharding='zero1' (torch's ZeroRedundancyOptimizer) needs each Breakdown's param_numels; "
            "'zero1-even' splits the elements evenly"
        )
    for (prec, ckpt, mb), b in breakdowns.items():
        for n in worlds:
            accumulation = None
            if global_batch is not None:
                if global_batch % (n * mb):
                    skipped += 1
                    continue
                accumulation = global_batch // (n * mb)
            for s in shardings:
                if n == 1 and s != "ddp":
                    continue  # one rank: nothing to shard
                peak = per_rank(b, n, s, pad=pad)["peak"]
                margin = memory - keep - peak
                options.append(Option(n, s, prec, ckpt, mb, accumulation, peak, margin, margin >= 0))
    options.sort(key=lambda o: _order_key(o, precisions))
    notes = list(notes)
    if skipped:
        notes.append(
            f"{skipped} (world size, micro-batch) pair(s) skipped: world_size * micro_batch does not divide "
            f"global_batch {global_batch}"
        )
    return Plan(options, memory, keep, notes, seconds + time.perf_counter() - t0, len(breakdowns))


# ---------------------------------------------------------------------------
# From a model: one dry run per (precision, checkpointing, micro-batch)


def _largest_block(model, fsdp_units=None):
    """Parameter bytes of the largest unit FSDP gathers at once: the units estimate() wraps
    (ranks.resolve_units: each block of every nn.ModuleList at any depth, e.g. a Hugging Face
    model's model.layers.N, else each child holding parameters), the root holding what they leave."""
    import torch

    # lazy: ranks loads only when an estimate's dry run needs it
    from .ranks import resolve_units

    taken, best = set(), 0
    for _name, mod in resolve_units(model, fsdp_units, torch):  # innermost first, the root last
        own = 0
        for p in mod.parameters():
            if id(p) not in taken:
                taken.add(id(p))
                own += p.numel() * p.element_size()
        best = max(best, own)
    return best


def breakdown_of(estimate_report, model):
    """A Breakdown from one process's memtorch.estimate() report (world_size=1)."""
    states = estimate_report.model_states
    at_peak = estimate_report.breakdown
    numel = sum({id(p): p.numel() for p in model.parameters() if p.requires_grad}.values())
    fb = [p.peak for name, p in estimate_report.phases.items() if name in ("forward", "backward") and p.calls]
    return Breakdown(
        param_numels=getattr(estimate_report, "_param_numels", None),
        param_groups=getattr(estimate_report, "_param_groups", None),
        step_scratch_at_peak=getattr(estimate_report, "_step_scratch_at_peak", 0),
        peak_outside_step=max(fb) if fb else None,
        peak=int(estimate_report.peak),
        parameter=int(states.get("parameter", 0)),
        gradient=int(states.get("gradient", 0)),
        optimizer_state=int(states.get("optimizer_state", 0)),
        gradient_at_peak=int(at_peak.get("gradient", 0)),
        optimizer_state_at_peak=int(at_peak.get("optimizer_state", 0)),
        numel=numel,
        largest_block=_largest_block(model),
    )


def plan(
    model,
    *inputs,
    device_memory=None,
    world_sizes=None,
    max_world_size=1024,
    shardings=SHARDINGS,
    precisions=("fp32", "bf16-mixed"),
    checkpointing=(None, "blocks"),
    micro_batches=None,
    global_batch=None,
    optimizer="adamw",
    device=None,
    reserve="1 GiB",
    pad=True,
    fsdp_units=None,
    gpu=None,
    loss_fn=None,
    keep_output=True,
    exhaustive=False,
    _engine=None,
):
    """Which (world size, sharding, precision, checkpointing, micro-batch) fit in ``device_memory``, cheapest first.

    device_memory: one device's memory (a size: "80 GiB", "24 GB", bytes); by default the nominal memory of
    the GPU ``gpu`` names (as fit()'s: "l4" is 24 GiB; a name whose boards come in several sizes, "a100",
    needs device_memory=), else 80 GiB.

    inputs: one micro-batch of example inputs, as estimate() takes them
    (tensors, shapes such as (8, 128), (shape, dtype) pairs such as ((1, 2048),
    torch.long), specs such as "8x128:int64", and, last, a mapping of keyword
    inputs, memtorch._inputs); dimension 0 is the batch. micro_batches: batch
    sizes to try (default: the inputs' own). global_batch: samples per optimizer step over
    all ranks (sets the gradient accumulation; world sizes and micro-batches
    must divide it). device: what estimate() models ("cuda", the default as for
    estimate(): the caching allocator, and a combination fits when its reserved
    figure does). reserve: memory kept free per device for what no estimate sees
    (the CUDA context, typically 300-600 MiB, and library workspaces).
    optimizer, loss_fn, gpu, fsdp_units, keep_output: as estimate()'s, with its
    defaults. pad=False refuses zero1-even on a world size that does not
    divide the trainable elements (DeepSpeed pads them; so does the default).
    shardings: among ddp, zero1, zero1-even, zero2, zero3; None (the CLI's
    "none") alone asks for one device only, the model unwrapped.
    world_sizes: the world sizes to try; default: powers of two up to
    max_world_size, and for each (precision, checkpointing, micro-batch,
    sharding) only up to the first that fits (a larger world size of the same
    combination costs more devices; exhaustive=True computes them all).
    Returns a Plan.

    Every figure is estimate()'s: one dry run per (precision, checkpointing,
    micro-batch), then each world size and sharding replayed per rank by the
    code memtorch.estimate(model, x, world_size=N, sharding=...) reports from,
    so each row's figures equal that call's (memtorch.estimator.engine).
    """
    import time

    import torch

    # lazy: the engine loads estimation only when this path runs (importing planning stays cheap)
    from .engine import Engine
    from .estimate import weights_as_given  # lazy: estimation loads only when this path runs

    t0 = time.perf_counter()

    if not isinstance(model, torch.nn.Module):
        raise MemtorchError(errors.not_a_module("plan", model))
    if not inputs:
        raise MemtorchError("plan() needs example inputs: plan(model, x) with one micro-batch")
    # lazy: _inputs loads only when an estimate's dry run needs it
    from .. import _inputs

    given = _inputs.read(inputs, "plan()")  # the one reading of inputs (estimate's, advise's, the CLI's)
    batch = given.batch_size()
    if micro_batches is None:
        if batch is None:
            raise MemtorchError(
                "plan() could not read a batch size from the inputs (no input with a dimension 0): pass "
                "micro_batches=[...]"
            )
        micro_batches = [batch]
    for mb in micro_batches:
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise MemtorchError(f"plan() micro_batches must be positive ints, got {mb!r}")
    shardings = list(shardings)
    # None (the CLI's "none"): one process, the model unwrapped, the row every plan has at world size 1
    unwrapped_only = bool(shardings) and all(s is None for s in shardings)
    shardings = [s for s in shardings if s is not None] or ["ddp"]
    for s in shardings:
        _check_sharding(s)
    if device_memory is None and gpu is not None:  # the GPU named: its memory, as fit() takes it
        memory, source = device_memory_of(None, gpu, "plan()")
    else:
        memory, source = units.parse("80 GiB" if device_memory is None else device_memory), None
    keep = units.parse(reserve)
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):  # fmt: skip
        raise MemtorchError(f"global_batch must be a positive int, got {global_batch!r}")
    frontier = world_sizes is None and not exhaustive
    worlds = _world_sizes(world_sizes, max_world_size, global_batch)
    if unwrapped_only:
        worlds = [1]
    notes = []
    if source is not None:
        notes.append(f"device memory: {source}")
    # precision "fp32" casts nothing: for a model not all in float32 the table says "as given"
    weights = weights_as_given(model)
    if weights is not None and "fp32" in precisions:
        notes.append(f"precision 'as given': the parameters in their own dtypes ({weights}), no autocast "
                     "(precision='fp32' in the API and the JSON)")  # fmt: skip
    checkpointing = list(checkpointing)
    if "blocks" in checkpointing:
        if not any(isinstance(m, torch.nn.ModuleList) and len(m) for m in model.modules()):
            # the default option: a model with no nn.ModuleList of blocks is planned without it
            checkpointing.remove("blocks")
            notes.append("checkpointing='blocks' left out: the model has no nn.ModuleList of blocks")
            if not checkpointing:
                checkpointing = [None]
    fsdp = any(s in ("zero2", "zero3") for s in shardings) and any(n > 1 for n in worlds)
    eng = _engine
    if eng is None:
        eng = Engine(model, given, optimizer=optimizer, loss_fn=loss_fn, device=device, gpu=gpu,
                     keep_output=keep_output, fsdp_units=fsdp_units, units=fsdp)  # fmt: skip
    dev = eng.device
    options, skipped, beyond, cannot, flat = [], set(), 0, 0, 0
    runs0 = eng.dry_runs
    for prec in precisions:
        for ckpt in checkpointing:
            for mb in micro_batches:
                mb_inputs = given if mb == batch else given.with_batch(mb)
                one_fits = False
                for s in shardings:
                    trail = []  # this sharding's judged figures, world size by world size
                    for n in worlds:
                        if n == 1 and s != shardings[0]:
                            continue  # one rank: nothing to shard, trained unwrapped (one row)
                        if frontier and n > 1 and one_fits:
                            beyond += 1  # one device fits this combination: more cost more
                            continue
                        accumulation = None
                        if global_batch is not None:
                            if global_batch % (n * mb):
                                skipped.add((n, mb))
                                continue
                            accumulation = global_batch // (n * mb)
                        if n > 1 and s == "zero1-even" and not pad:
                            numel = eng.facts(prec, ckpt, mb_inputs)["trainable_numel"]
                            if numel % n:
                                raise MemtorchError(
                                    f"world_size {n} does not divide the {numel} trainable parameter elements "
                                    "that zero1-even splits (pad=False); DeepSpeed pads them, as pad=True models"
                                )
                        f = eng.figures(prec, ckpt, mb_inputs, world_size=n, sharding=None if n == 1 else s)
                        margin = memory - keep - f.judged
                        options.append(Option(n, None if n == 1 else s, prec, ckpt, mb, accumulation, f.peak,
                                              int(margin), margin >= 0, f.reserved, f.peak_upper, f.rank_peaks,
                                              f.rank_peaks_upper))  # fmt: skip
                        one_fits = one_fits or (n == 1 and margin >= 0)
                        if frontier and n > 1 and margin >= 0:
                            beyond += sum(1 for m in worlds if m > n)
                            break  # larger world sizes of this combination fit too, on more devices
                        if frontier and n > 1 and f.floor is not None and f.floor + keep > memory:
                            # what no sharding splits (activations, inputs, buffers, communication) is over the
                            # device already: no larger world size of this combination fits
                            cannot += sum(1 for m in worlds if m > n)
                            break
                        if n > 1:
                            trail.append(f.judged)
                        if frontier and len(trail) >= 3 and trail[-3] - trail[-1] < memory // 100:
                            # two doublings took less than 1% of the device off the highest rank: the figure has
                            # stopped falling (what the sharding splits is small beside what it does not)
                            flat += sum(1 for m in worlds if m > n)
                            break
    precs = list(dict.fromkeys(precisions))
    options.sort(key=lambda o: _order_key(o, precs))
    if skipped:
        notes.append(
            f"{len(skipped)} (world size, micro-batch) pair(s) skipped: world_size * micro_batch does not divide "
            f"global_batch {global_batch}"
        )
    if beyond:
        notes.append(
            f"{beyond} larger world size(s) not computed: each combination stops at the first world size that fits "
            "(more devices cost more); exhaustive=True (CLI --all) computes them"
        )
    if cannot:
        notes.append(
            f"{cannot} larger world size(s) not computed as they cannot fit: the highest rank's peak less what the "
            "sharding splits (parameters, gradients, optimizer state, step temporaries) is over the device already; "
            "exhaustive=True (CLI --all) computes them"
        )
    if flat:
        notes.append(
            f"{flat} larger world size(s) not computed: the highest rank's figure fell by less than 1% of the device "
            "over the last two doublings of its sharding (it is not bound to keep falling: FSDP pads each parameter "
            "to a multiple of the world size); exhaustive=True (CLI --all) computes them"
        )
    notes.append(
        "per-rank figures: one dry run per (precision, checkpointing, micro-batch), each world size and sharding "
        "replayed per rank as memtorch.estimate(..., world_size=N, sharding=...) does: every row's figures are "
        "that call's"
    )
    if dev == "cuda":
        notes.append("device='cuda': a combination fits when its reserved figure (the caching allocator's segments "
                     "on the highest rank) plus the reserve fits; the CUDA context and NCCL's buffers are outside "
                     "the figures (the reserve is for them)")  # fmt: skip
    if eng.defaulted:
        notes.append(DEFAULT_DEVICE_NOTE)
    return Plan(options, memory, keep, notes, time.perf_counter() - t0, eng.dry_runs - runs0, dev, beyond + cannot + flat,
                weights)  # fmt: skip
