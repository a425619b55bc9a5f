"""fit(): the largest batch (or sequence length, or number of new tokens) whose step fits a device.

    f = memtorch.fit(model, {"input_ids": ((4, 2048), torch.long), "labels": ((4, 2048), torch.long)},
                     gpu="h100", precision="bf16-mixed", checkpointing="blocks")
    f.value            # the largest batch that fits; f.next_value the first that does not
    print(f)           # the estimate at both, the line, the dry runs made

How fit() searches, without running out of memory. Two dry runs come first: the inputs' own value (2 where
it is 1: a batch of 1 runs other paths, and its events predict no other value) and twice it (half it when it
does not fit). Where their events are the same (the same storages made and freed
in the same order, only their sizes differing: an activation's grows with the batch, a parameter's stays),
each storage's size is put on the line through its two sizes and the events are replayed through the
allocator's model, as estimate() replays its own: a figure for any value without a dry run, to the byte
where every size is affine in the value and the events stay the same (a batch, measured on Llama and GPT-2
shapes), close where not (a longer sequence may change a kernel's choice). The guess is the largest value
whose predicted figure fits; the answer and the value above it are then estimated in full: both
confirmed is four dry runs. Where the events differ, each phase gets its own line through the two values
(the step's peak is the largest of its phases' peaks: the optimizer's at small batches, the backward's at
large ones), and the first line to meet the budget gives the guess. Either way, where a guess is off, the
next is drawn through the last guess and its neighbour (a tangent where the pattern has settled), and the
gap is halved where two such guesses in a row did not halve it, until a value known to fit neighbours one
known not to: the answer is always a value whose estimate fits next to one whose estimate does not.
Measured on six 4-layer Llama-7B and GPT-2 shapes (benchmarks/bench_fit.py): four dry runs for each search
by batch, three by sequence length (the cap fits).

On cuda the reserved figure is not monotone in the value everywhere (a larger batch can pack into fewer
segments): past the first value predicted not to fit, a larger one may fit again, and it is the answer
when it does (no value whose peak alone is over the budget can fit: the values up to there are looked
at). The notes name the smaller values predicted not to fit, so that "the largest that fits" is not
read as "every smaller one fits". Without a prediction fit() answers the first crossing it finds from the
inputs' value, and a note says so where the reserved figure rises from the answer to the value above by
more than a segment beyond the peak's rise.

Each value's figure is memtorch.estimate()'s for that configuration (memtorch.estimator.engine: the same dry
run), judged as plan() judges it: the reserved figure on cuda (the caching allocator's segments), the
peak on the CPU, plus ``reserve`` kept free, against ``device_memory``.

(memtorch.estimator.fit, not memtorch.fit: a submodule of the package named fit would shadow the function
once imported; memtorch.fitting is this module's first name.)
"""

import time

from .. import errors, units
from ..errors import MemtorchError
from .engine import DEFAULT_DEVICE_NOTE  # cheap: the engine loads estimation when it runs
from ..reports.fit import VARY_WORDS, Fit  # the result type's home

__all__ = ["fit", "Fit", "VARY"]

VARY = ("batch", "seq", "max_new_tokens")
# the caching allocator's largest rounding of a segment (a 20 MiB large buffer): a reserved figure that rises
# by more than this beyond the peak's rise has met the segments' steps, not the step's bytes
_SEGMENT = 20 << 20
_MAX_RUNS = 64  # a search that needs more has met a figure that is not monotone in the value
# values looked at one by one in predicted figures (each a replay of the dry run's events: 0.2 ms for a 4-layer
# Llama shape, 1.1 ms for a 32-layer one's 20,801 events): below the answer and above the first crossing
_SCAN = 256
_SCAN_RANKS = 32  # the same with several ranks: each prediction replays every rank (11 ms, 7B shape, 8 ranks)


def fit(
    model,
    *inputs,
    device_memory=None,
    gpu=None,
    vary="batch",
    reserve="1 GiB",
    max_value=None,
    optimizer="adamw",
    loss_fn=None,
    precision="fp32",
    device=None,
    checkpointing=None,
    world_size=1,
    sharding=None,
    fsdp_units=None,
    keep_output=True,
    training=True,
    max_new_tokens=None,
    _engine=None,
):
    """The largest value of ``vary`` whose estimated step fits one device. Returns a Fit.

    inputs: example inputs as estimate() takes them (their values are never read); they give the value
    the search starts from (2 where it is 1). vary: "batch" (dimension 0 of every input), "seq" (dimension 1 of every
    input whose dimension 1 is the sequence length: input_ids, labels, an attention mask), or
    "max_new_tokens" (generation: model.generate() of that many tokens after the inputs' prompt;
    training=False; the search starts from max_new_tokens, default 16, or 2 for 1). With vary "batch" or "seq",
    training=False and max_new_tokens=N: the step is model.generate() of N new tokens (the largest
    number of sequences generated at once: memtorch.capacity()). device_memory: one device's
    memory (a size: "80 GiB", "24 GB", bytes); or gpu: a GPU's name ("h100", "a100-80gb", "l4":
    memtorch.estimator.allocator.GPU_MEMORY) whose nominal memory is taken and whose kernels are modelled
    (as estimate(gpu=...)). reserve: bytes kept free of the device for what no estimate sees (the CUDA
    context, typically 300-600 MiB), as plan()'s reserve. max_value: the largest value tried (default:
    for "seq", the model's config.max_position_embeddings or n_positions when it has one). The other
    arguments are estimate()'s, with its defaults (optimizer adamw, device cuda); world_size and
    sharding judge one rank's figures (the highest rank's).
    """
    import torch

    # lazy: _inputs and the engine (which loads estimation) only when this path runs (importing fitting
    # stays cheap)
    from .. import _inputs

    # lazy: as above
    from .engine import Engine, device_memory_of, judged_name

    t0 = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise MemtorchError(errors.not_a_module("fit", model))
    if vary not in VARY:
        raise MemtorchError(f"fit(vary={vary!r}): expected one of {', '.join(VARY)}")
    if not inputs:
        raise MemtorchError("fit() needs example inputs: fit(model, x, ...) with one batch")
    memory, source = device_memory_of(device_memory, gpu, "fit()")
    keep = units.parse(reserve)
    if keep >= memory:
        raise MemtorchError(
            f"fit(): the reserve ({units.format(keep)}) leaves nothing of the device's {units.format(memory)}"
        )
    if max_value is not None and (
        isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 1
    ):
        raise MemtorchError(f"fit(max_value=...) must be a positive int, got {max_value!r}")
    given = _inputs.read(inputs, "fit()")
    notes = []
    if vary == "max_new_tokens":
        if training:
            training = False  # generation is inference
        start = 16 if max_new_tokens is None else max_new_tokens
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise MemtorchError(f"fit(max_new_tokens=...) must be a positive int, got {start!r}")
    elif max_new_tokens is not None and training:
        raise MemtorchError(
            "fit(max_new_tokens=...) estimates generation: pass training=False with it (or vary="
            "'max_new_tokens', where it is the value the search starts from)"
        )
    elif vary == "batch":
        start = given.batch_size()
        if start is None:
            raise MemtorchError("fit(vary='batch'): no input has a dimension 0 to vary")
    else:
        start = given.seq_len()
        if start is None:
            raise MemtorchError("fit(vary='seq'): no input has a dimension 1 (a sequence) to vary")
        if max_value is None:
            cfg = getattr(model, "config", None)
            limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
            if isinstance(limit, int) and limit > 0:
                max_value = limit
                notes.append(
                    f"sequence lengths up to the model's {limit} positions (its config's); max_value= "
                    "sets another cap"
                )
    if max_value is not None and start > max_value:
        start = max_value
    if start == 1 and (max_value is None or max_value > 1):
        # a value of 1 takes other paths than larger ones (a dimension of 1 broadcasts; the optimizer's step is
        # the peak at batch 1 and 2, the backward's above), so its dry run's events differ from 2's and predict
        # no other value: the search starts at 2 and runs 1 only where 2 does not fit
        start = 2
    eng = _engine
    if eng is None:
        eng = Engine(
            model,
            given,
            optimizer=optimizer,
            loss_fn=loss_fn,
            device=device,
            gpu=gpu,
            keep_output=keep_output,
            fsdp_units=fsdp_units,
            units=world_size > 1 and sharding in ("zero2", "zero3"),
        )
    config = {
        "optimizer": optimizer if isinstance(optimizer, str) else type(optimizer).__name__,
        "precision": precision,
        "device": eng.device,
        "checkpointing": checkpointing,
        "world_size": world_size,
        "sharding": sharding,
        "training": training,
    }
    if max_new_tokens is not None and vary != "max_new_tokens":
        config["max_new_tokens"] = max_new_tokens
    if gpu is not None:
        config["gpu"] = gpu

    def inputs_at(v):
        if vary == "batch":
            return given if v == start and given.batch_size() == v else given.with_batch(v)
        if vary == "seq":
            return given if v == given.seq_len() else given.with_seq(v)
        return given

    done = {}  # value -> Figures
    tried = []

    def figures(v):
        if v not in done:
            if len(tried) >= _MAX_RUNS:
                raise MemtorchError(
                    f"fit() made {_MAX_RUNS} dry runs without two neighbouring values, one fitting and one "
                    f"not: the figure is not monotone in {vary} (tried {tried})"
                )
            try:
                done[v] = eng.figures(
                    precision,
                    checkpointing,
                    inputs_at(v),
                    world_size=world_size,
                    sharding=sharding,
                    training=training,
                    max_new_tokens=v if vary == "max_new_tokens" else max_new_tokens,
                )
            except MemtorchError as e:
                raise MemtorchError(f"fit(): the estimate at {vary}={v} failed: {e}") from None
            tried.append((v, done[v].judged))
            if hasattr(eng, "ledger"):  # its events predict other values (_predictor)
                ledgers[v] = eng.ledger(
                    precision, checkpointing, inputs_at(v), training,
                    v if vary == "max_new_tokens" else max_new_tokens,
                )  # fmt: skip
        return done[v]

    ledgers = {}  # value -> its dry run's ledger (one process)
    predictors = {}  # pair -> _predictor's, or None

    def predictor(pair):
        if pair is None or pair[0] not in ledgers or pair[1] not in ledgers:
            return None
        if pair not in predictors:
            predictors[pair] = _predictor(
                ledgers, done, pair, lambda led, sizes: eng.predicted(led, sizes, world_size, sharding)
            )
            if predictors[pair] is not None:
                last[:] = [predictors[pair], pair]
        return predictors[pair]

    last = [None, None]  # the last predictor made and its pair: the notes' figures for values not tried
    # values looked at one by one in predictions: fewer where each replays every rank
    scan = _SCAN if world_size == 1 else _SCAN_RANKS

    budget = memory - keep

    def fits(v):
        return figures(v).judged <= budget

    # two dry runs for the line: the inputs' value and twice it (half it when it does not fit)
    lo, hi = 0, None  # the largest value known to fit (0: none), the smallest known not to
    a = start
    if fits(a):
        lo = a
        b = 2 * a if max_value is None else min(2 * a, max_value)
    else:
        hi = a
        b = max(1, a // 2)
    if b != a:
        if fits(b):
            lo = max(lo, b)
        else:
            hi = b if hi is None else min(hi, b)
    line = None
    last_gap = None  # hi - lo before the last guess
    stalled = 0  # line guesses in a row that did not halve the gap
    pair = (a, b) if b != a else None  # the two values the next line is drawn through
    if b != a:
        slope = (done[b].judged - done[a].judged) / (b - a)
        line = (done[a].judged - slope * a, slope)
    # where two runs predict every value (_predictor): the largest value predicted to fit, on whichever side of
    # the runs it lies (on cuda a larger value may fit where a smaller one does not), estimated in full, and its
    # neighbour (above it where it fits, below where not): the answer where they are a fitting value next to
    # one that does not; else once more from the prediction of those two; then the search below, from the
    # largest value known to fit
    for _ in range(2):
        pred = predictor(pair)
        # the doubling towards the last value whose peak fits starts from the largest run whose peak does
        known = max((v for v in done if done[v].peak <= budget), default=0)
        c = None if pred is None else _largest_predicted(pred, budget, max_value, scan, known)
        if c is None:
            break
        if c == 0 or fits(c):  # then the value above it
            above = None if max_value is not None and c + 1 > max_value else fits(c + 1)
            if not above:  # False, or None past the cap
                lo, hi = c, None if above is None else c + 1
                break
            pair = (c, c + 1) if c > 0 else (1, 2)
        else:  # then the value below it
            if c == 1 or fits(c - 1):
                lo, hi = c - 1, c
                break
            pair = (c - 1, c)
    settled = hi == lo + 1 if hi is not None else max_value is not None and lo >= max_value
    if not settled:
        # not settled: between the largest value known to fit and the smallest above it known not to
        fitting = [v for v in done if done[v].judged <= budget]
        lo = max(fitting, default=0)
        hi = min((v for v in done if v > lo and done[v].judged > budget), default=None)
    while True:
        if hi is not None and hi == lo + 1:
            break
        if hi is None and max_value is not None and lo >= max_value:
            break  # the cap fits
        if lo == 0 and hi == 1:
            break
        # a line whose last two guesses did not halve the gap gives way to halving it (a figure that rises
        # in steps, or lines drawn where the pattern had not settled): the search ends in a few dozen runs.
        # One such guess is allowed: the first tangent is often drawn far from the answer (a guess from a
        # line through small values), and the next one, drawn near it, ends the search
        gap = None if hi is None else hi - lo
        stalled = stalled + 1 if gap is not None and last_gap is not None and gap > last_gap // 2 else 0
        halve = stalled >= 2
        if halve:
            stalled = 0
        last_gap = gap
        guess = _next_guess(
            done, lo, hi, budget, max_value, pair, bisect=halve, predicted=predictor(pair), scan=scan
        )
        if guess is None:
            break
        ok = fits(guess)
        if halve:  # no neighbour: the next line is drawn through the ends of the gap
            if ok:
                lo = guess
            else:
                hi = guess
            pair = (lo, hi) if lo in done and hi is not None else pair
            continue
        # the guess and its neighbour towards the answer: the answer confirmed, or the slope there for the
        # next guess (a tangent drawn where the pattern has settled)
        if ok:
            lo = guess
            nb = guess + 1
            if (hi is None or nb < hi) and (max_value is None or nb <= max_value):
                if fits(nb):
                    lo = nb
                else:
                    hi = nb
                pair = (guess, nb)
        else:
            hi = guess
            nb = guess - 1
            if nb > lo:
                if fits(nb):
                    lo = nb
                else:
                    hi = nb
                pair = (nb, guess)
    if lo == 0:
        notes.append(
            f"not even {vary}=1 fits: {units.format(done[1].judged)} {judged_name(eng.device)} "
            f"against {units.format(budget)}"
        )
    if hi is None:
        notes.append(f"the cap {vary}={max_value} fits: no value above it was tried")
    elif lo > 0 and eng.device == "cuda":
        a, b = done[lo], done[hi]
        word = VARY_WORDS[vary]
        pred = last[0]
        # the segments' share of the judged figure grows with the peak (fragmentation): a rise beyond the
        # peak's rise at the answer's ratio, by more than a segment, is the segments' step
        if pred is None and (b.judged - a.judged) - (b.peak - a.peak) * a.judged / max(a.peak, 1) > _SEGMENT:
            notes.append(
                f"from {vary}={lo:,} to {hi:,} the reserved figure rises by {units.format(b.judged - a.judged)} where "
                f"the peak rises by {units.format(b.peak - a.peak)}: the caching allocator's segments, which do "
                f"not grow steadily with the {word}; a larger {word} may pack into fewer and fit (not tried: "
                "estimate() it)"
            )
        # one process: its predictions take a millisecond; with several ranks, tens (FSDP's units replayed)
        if pred is not None and world_size == 1 and _checked(pred, done, last[1]):
            notes += _segment_notes(pred, lo, hi, budget, max_value, vary, word, scan)
    if source != "given":
        notes.append(f"device memory: {source}")
    if eng.defaulted:
        notes.append(DEFAULT_DEVICE_NOTE)
    notes.append(
        f"every figure is estimate()'s for that {vary} ({len(tried)} dry runs); fit judged on "
        f"{judged_name(eng.device)!r} + the reserve against the device's memory"
    )

    def as_dict(f):
        return None if f is None else {"peak": f.peak, "reserved": f.reserved, "judged": f.judged}

    return Fit(
        vary,
        lo,
        as_dict(done.get(lo)),
        hi,
        as_dict(done.get(hi) if hi is not None else None),
        eng.device,
        memory,
        source,
        keep,
        judged_name(eng.device),
        line,
        tried,
        config,
        notes,
        time.perf_counter() - t0,
    )


def _ranges(values):
    """'3, 5-9, 1,024' of sorted ints."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(f"{values[i]:,}" if i == j else f"{values[i]:,}-{values[j]:,}")
        i = j + 1
    return ", ".join(out)


def _segment_notes(predicted, lo, hi, budget, max_value, vary, word, scan=_SCAN):
    """On cuda, what the prediction (_predictor's) says of the values not tried: those below the answer whose
    reserved figure is over the budget (the segments' steps: a smaller value that does not fit), and those
    above the value found not to fit that fit again, up to the last whose peak alone is within it."""
    notes = []
    low = max(lo - scan, 1)
    holes = [v for v in range(low, lo) if predicted(v)[1] > budget]
    if holes:
        seen = f" (of {vary}={low:,} to {lo - 1:,}; smaller ones not looked at)" if low > 1 else ""
        notes.append(
            f"not every smaller {word} fits: {vary}={_ranges(holes)} predicted over the budget{seen} (the "
            f"caching allocator's segments: the reserved figure does not rise steadily with the {word}); "
            "estimate() a value before using it"
        )
    top = _last_fitting(lambda v: predicted(v)[0] <= budget, hi, None, max_value)
    if top is not None and predicted(hi)[0] <= budget:
        end = min(top[0], hi + scan)
        above = [v for v in range(hi + 1, end + 1) if predicted(v)[1] <= budget]
        if above:
            notes.append(
                f"{vary}={_ranges(above)} predicted to fit too, above {hi:,}, which does not (the caching "
                f"allocator's segments); estimate() one to be sure"
            )
        elif end < top[0]:
            notes.append(
                f"no {word} from {hi:,} to {end:,} is predicted to fit (the caching allocator's segments; larger "
                "ones not looked at)"
            )
        elif end > hi:  # (at hi itself the figure is known: nothing to add)
            notes.append(
                f"no {word} above {lo:,} is predicted to fit: to {end:,} the reserved figure is over the budget "
                f"(the caching allocator's segments), above {end:,} the peak alone"
            )
    if notes:
        notes.append(
            "predicted: the events of two dry runs replayed with each storage's size on the line through its "
            "two sizes, through the caching allocator's model (they give the figures of every value run, to "
            "the byte)"
        )
    return notes


def _phase_peaks(f):
    """{phase: peak} of one value's figures (the highest rank's phases: the step's peak is the largest), or
    the peak alone where the figures have no phases."""
    return f.phase_peaks or {"step": f.peak}


def _line_guess(done, pair, budget):
    """The largest value whose figure the line through ``pair`` (two values tried) puts within the budget,
    or None where no phase rises.

    The step's peak is the largest of its phases' peaks, each affine in the value once its pattern
    settles (the optimizer's phase highest at small batches, the backward's at large ones): each phase
    has its own line through the two values, and the guess is where the first of them meets the budget
    scaled by the peak's share of the judged figure at the nearer value (on cuda the caching allocator's
    segments, whose excess over the peak grows with it, in steps: measured 3% to 24% of it).
    """
    v1, v2 = sorted(pair)
    f1, f2 = done[v1], done[v2]
    near = f1 if abs(f1.judged - budget) <= abs(f2.judged - budget) else f2
    target = budget * near.peak // max(near.judged, 1)
    p1, p2 = _phase_peaks(f1), _phase_peaks(f2)
    guess = None
    for name, a in p1.items():
        b = p2.get(name)
        if b is None:
            continue
        slope = (b - a) / (v2 - v1)
        if slope <= 0:
            if a > target:
                return v1 - 1  # a phase that does not fall with the value is over already: below v1
            continue
        at = v1 + int((target - a) // slope)
        guess = at if guess is None else min(guess, at)
    return guess


def _predictor(ledgers, done, pair, replay):
    """The figures (peak, judged) at any value, from the dry runs of the two values of ``pair`` when their
    ledgers are the same events (the same storages made and freed in the same order; only their sizes
    differ): each storage's size on the line through its two sizes (an activation's grows with the batch, a
    parameter's stays), the events replayed through the allocator's model as estimate() replays its own
    (``replay(ledger, sizes)``: Engine.predicted, the caching allocator's on cuda, every rank's where there
    are several). Exact where every size is affine in the value and the events stay the same (measured: to
    the byte at the answer on Llama shapes), close where not; it only chooses the values tried, whose figures
    are their own dry runs'. None where the events differ, or where the replay does not give both values'
    own figures back."""
    import numpy

    # lazy: the per-rank replays load with the engine's dry runs (importing fitting stays cheap)
    from . import ranks

    a, b = pair
    ea, eb = ranks._encoded(ledgers[a]), ranks._encoded(ledgers[b])
    sa, sb = ranks.base_sizes(ledgers[a]).array, ranks.base_sizes(ledgers[b]).array
    if a == b or len(ea) != len(eb) or len(sa) != len(sb):
        return None
    if not numpy.array_equal(ea, eb) and not numpy.array_equal(_frees_sorted(ea), _frees_sorted(eb)):
        return None
    rise = sb - sa

    def predicted(v):
        return replay(ledgers[a], numpy.maximum(sa + (rise * (v - a)) // (b - a), 0))

    if predicted(a)[1] != done[a].judged or predicted(b)[1] != done[b].judged:
        return None
    return predicted


def _frees_sorted(encoded):
    """Encoded events (key, ~key for a free) with each run of consecutive frees in key order: two dry runs of
    the same step can free a run in another order (autocast's cache goes in address order), which changes no
    figure (the allocator's free blocks are kept by size and address, whatever order they came back in)."""
    import numpy

    free = encoded < 0
    group = numpy.cumsum(~free)  # an allocation and the frees after it share a group
    return encoded[numpy.lexsort((-encoded, free, group))]  # ~k falls as k rises: key order among the frees


def _checked(predicted, done, pair):
    """Whether ``predicted`` (_predictor's, drawn through ``pair``) gives the figures of every other value run
    (at least one: the answer and the value above it), peak and judged, to the byte: then its figures for the
    values not run are given in the notes, as predictions. Not where a size grows faster than its line (a
    mask with the square of a sequence) and the runs show it."""
    others = [v for v in done if v not in pair]
    return bool(others) and all(predicted(v) == (done[v].peak, done[v].judged) for v in others)


def _last_fitting(fits, lo, hi, max_value):
    """(the last value from lo on that ``fits``, the first that does not), doubling from lo then halving, with
    hi (known not to fit) and max_value as bounds; None where every value up to 2**40 fits."""
    good, bad, step = lo, None, 1
    while bad is None:
        v = lo + step
        if hi is not None and v >= hi:
            bad = hi
        elif max_value is not None and v > max_value:
            bad = max_value + 1
        elif not fits(v):
            bad = v
        else:
            good = v
            step *= 2
            if step > 1 << 40:
                return None
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, bad


def _largest_predicted(predicted, budget, max_value, scan=_SCAN, known=0):
    """The largest value whose predicted judged figure fits (0: none does), looked at from the last value
    whose predicted peak fits down (no value above it can fit: the reserved figure is never below the peak;
    found by doubling from ``known``, a value whose peak fits), else the first crossing from 1; None where
    every value up to 2**40 is predicted to fit."""
    top = _last_fitting(lambda v: predicted(v)[0] <= budget, known, None, max_value)
    if top is None:
        return None
    v = _fits_from_top(predicted, budget, top[0], max(0, top[0] - scan))
    if v is not None:
        return v
    first = _last_fitting(lambda v: predicted(v)[1] <= budget, 0, None, max_value)
    return None if first is None else first[0]


def _predicted_guess(predicted, lo, hi, budget, max_value, scan=_SCAN):
    """The largest value above lo (below hi, up to max_value) whose predicted judged figure fits; lo itself
    where none is predicted to; None where every value up to 2**40 is.

    On cuda the reserved figure rises in the segments' steps, not always with the value: past the first
    value predicted not to fit, a larger one may fit again. The peak never falls as the value rises (each
    size on its line), and no value whose peak is over the budget can fit: the values between the first
    crossing and the last whose peak fits are looked at from the top down, and the largest that fits is the
    guess."""
    first = _last_fitting(lambda v: predicted(v)[1] <= budget, lo, hi, max_value)
    if first is None:
        return None
    good, bad = first
    top = _last_fitting(lambda v: predicted(v)[0] <= budget, bad, hi, max_value)
    if top is not None and predicted(bad)[0] <= budget:
        v = _fits_from_top(predicted, budget, top[0], max(bad, top[0] - scan))
        if v is not None:
            return v
    return good


def _fits_from_top(predicted, budget, top, floor):
    """The largest value from ``top`` down to above ``floor`` whose predicted judged figure fits, or None."""
    for v in range(top, floor, -1):
        if predicted(v)[1] <= budget:
            return v
    return None


def _next_guess(done, lo, hi, budget, max_value, pair, bisect=False, predicted=None, scan=_SCAN):
    """The next value to try, strictly between lo and hi (0 and None: not known).

    predicted (_predictor's, of ``pair``): the largest value it puts within the budget. Else the line is
    drawn through ``pair``, the last two values tried together (the first two, then a guess and its
    neighbour), phase by phase (_line_guess). A guess that puts the answer at lo (or at or above hi) asks for
    lo's neighbour (hi's): the one value that confirms it. bisect: the middle of the gap instead (a guess
    that stalled).
    """
    guess = None
    if bisect and hi is not None:
        guess = (lo + hi) // 2
    elif predicted is not None:
        guess = _predicted_guess(predicted, lo, hi, budget, max_value, scan)
        if guess is not None:
            if guess <= lo:
                guess = lo + 1
            elif hi is not None and guess >= hi:
                guess = hi - 1
    elif pair is not None:
        guess = _line_guess(done, pair, budget)
        if guess is not None:
            if guess <= lo:
                guess = lo + 1
            elif hi is not None and guess >= hi:
                guess = hi - 1
    top = hi
    if guess is None:  # no line that rises: double past the largest fitting value, or halve the gap
        guess = 2 * max(lo, 1) if top is None else (lo + top) // 2
    if top is None and max_value is not None:
        top = max_value + 1
        if guess > max_value > lo:
            guess = max_value  # the line points past the cap: the cap itself is the value to try
    # strictly inside (lo, top); a line pointing outside is no guide: halve the gap (or double)
    if guess <= lo or (top is not None and guess >= top):
        guess = 2 * max(lo, 1) if top is None else (lo + top) // 2
    if guess <= lo or guess in done:
        if top is None:
            return None
        guess = (lo + top) // 2
        if guess <= lo or guess in done:
            return None
    return guess
