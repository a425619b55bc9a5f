"""Per-rank figures of estimate(world_size=N, sharding=...): the one-process dry run replayed per rank.

The dry run (estimation._dry_run) records every allocation of one process's
training step in order, and for the optimizer step which trainable parameter
each storage belongs to (its state, and the temporaries the optimizer computes
from its parameter, gradient and state: dispatch follows ownership from
an operator's inputs to its outputs). A rank's step is that same sequence with
the sizes of what the rank does not hold changed, and the wrappers' own
buffers inserted where the wrapper allocates and frees them. Nothing here is
fitted to measurements; each rule below follows the torch source named.

ddp: DistributedDataParallel's Reducer allocates, at wrapping, one flat tensor
    per gradient bucket (torch/nn/parallel/distributed.py, bucket_cap_mb and a
    smaller first bucket); the buckets together hold one copy of every gradient
    (gradient_as_bucket_view=False, the default) and live as long as the model.
zero1: torch.distributed.optim.ZeroRedundancyOptimizer under DDP. Whole
    parameters go to ranks (its _partition_parameters): per parameter group,
    parameters sorted by numel, largest first (a stable sort: ties keep their
    order), each to the rank with the fewest elements so far (the lowest rank on
    a tie), the running totals carried across groups. A rank's optimizer keeps
    state, and computes its step's temporaries, only for its own parameters;
    the broadcast of the updated parameters is in place. DDP's buckets as above.
zero1-even: DeepSpeed's ZeRO stage 1 (deepspeed/runtime/zero/stage_1_and_2.py,
    DeepSpeedZeroOptimizer.__init__): each parameter group's trainable
    parameters are flattened into one buffer padded with zeros to a multiple of
    nccl_start_alignment_factor (2: 4-byte alignment / 2-byte fp16, checked against
    DeepSpeed's master in 2026-12; only MS-AMP's fp8 subclass uses 4) * N elements
    (flatten_dense_tensors_aligned),
    which get_data_parallel_partitions cuts into N equal partitions; each rank's
    fp32 master weights and optimizer state are its partition, padding included
    (2 * ceil(E / 2N) elements of a group of E elements, on every rank). DeepSpeed's
    optimizer steps that one flat partition (single_partition_of_fp32_groups), so
    each state (exp_avg, exp_avg_sq, the master copy) is one tensor of the partition
    per group, a scalar state (Adam's step) one per group, and the outputs of one
    foreach call over a group's parameters one tensor of the partition
    (_flat_partitions: one allocation, rounded once by CUDA's allocator); any other
    elementwise storage of the step of a parameter of E_p elements is scaled to its
    part of the rank's partition (E_p / E of it, the rounding left to the group's
    last parameter); communication buffers are not modelled.
zero2, zero3: FSDP2, fully_shard on each unit then on the root
    (torch/distributed/fsdp/_fully_shard), reshard_after_forward False (zero2) or
    True (zero3). Each parameter is split into N chunks along dim 0, each rank
    storing one chunk padded to ceil(dim0 / N) rows; the optimizer state and the
    step's elementwise temporaries are the rank's chunk (unpadded). A unit's
    all-gather allocates one flat output of its padded unsharded size, then the
    unsharded parameters (one padded tensor each); in forward the flat output is
    kept until the next unit's all-gather has been copied out (the root's
    post-forward frees the last), in backward it is freed at once. zero3 frees
    a unit's unsharded parameters after its forward (never the root's) and
    gathers them again when its backward begins, prefetching the unit before it
    (the flat output only, copied out when that unit's backward begins). After a
    unit's backward (or at the end of backward, for a unit whose inputs need no
    gradient, and the root) its unsharded parameters are freed and its
    gradients reduce-scattered: a flat input of their padded size, the
    autograd gradients freed, a flat output of 1/N that the sharded gradients
    view until zero_grad; the flat input is freed at the next unit's
    reduce-scatter (the last at the end of backward). On the CPU (gloo), the
    all-gather and the reduce-scatter each take a scratch tensor from PyTorch's
    allocator as large as the gathered output / the reduce-scatter input while
    they run (measured with memtorch's counters around one collective on 2 and 4
    gloo ranks); on CUDA (NCCL) none is modelled. gloo hands the work to a worker
    thread (ProcessGroupGloo::runLoop), which drops its reference to a finished
    work, and so the scratch, only when it runs again: the scratch can outlive the
    collective, at the latest until the worker takes the next collective. So on
    the CPU each rank has two figures: ``peak`` with every scratch freed when its
    collective returns, ``peak_upper`` with each one freed only once the next
    collective's scratch is allocated (the highest the late frees can reach).

device="cuda": each rank's sequence of allocations goes through the caching
allocator's model (allocator.CachingAllocator), which gives that rank's
allocated and reserved curves; a rank's ``reserved_peak`` is its own.
"""

import bisect
import heapq
import math

import numpy

from .. import _C, words
from ..errors import MemtorchError

EVEN = ("zero1-even",)  # the shardings that split elements evenly and need a dividing world size
FSDP = ("zero2", "zero3")


# ---------------------------------------------------------------------------
# ZeroRedundancyOptimizer's partition


def zero_partition(groups, numels, world_size):
    """torch's ZeroRedundancyOptimizer partition: [rank -> [parameter indices]].

    groups: [[parameter index]] in the optimizer's param_groups order; numels:
    the elements of each parameter. Greedy, as _partition_parameters: within a
    group, by numel, largest first (stable), each to the rank holding the fewest
    elements so far (the first such rank); totals carry over between groups.
    """
    out = [[] for _ in range(world_size)]
    heap = [(0, r) for r in range(world_size)]  # (elements so far, rank): the first rank among the fewest on top
    for group in groups:
        for i in sorted(group, key=lambda i: numels[i], reverse=True):
            size, rank = heap[0]
            out[rank].append(i)
            heapq.heapreplace(heap, (size + numels[i], rank))
    return out


# ---------------------------------------------------------------------------
# FSDP units


def resolve_units(model, spec, torch):
    """[(name, module)] that fully_shard wraps, innermost first, the root last.

    spec None: each item of every nn.ModuleList, or without one each child of
    the model holding parameters (how fully_shard is usually called: on each
    block, then on the root). A list of module names (str) and/or module types
    (classes), or a predicate(name, module) -> bool, selects them instead.
    """
    named = list(model.named_modules())
    if spec is None:
        lists = [m for _, m in named if isinstance(m, torch.nn.ModuleList)]
        if lists:
            picked = {id(x) for lst in lists for x in lst}
        else:
            picked = {id(c) for c in model.children() if any(True for _ in c.parameters())}
        chosen = [(n, m) for n, m in named if id(m) in picked]
    elif callable(spec) and not isinstance(spec, (list, tuple, type)):
        chosen = []
        for n, m in named:
            if m is model:
                continue
            got = spec(n, m)
            if not isinstance(got, bool):
                raise MemtorchError(f"fsdp_units predicate must return True or False, got {got!r} for {n!r}")
            if got:
                chosen.append((n, m))
    elif isinstance(spec, (list, tuple)) and spec:
        names = {n for n, _ in named}
        for item in spec:
            if isinstance(item, str):
                if item not in names:
                    raise MemtorchError(f"fsdp_units: no module named {item!r} in the model")
            elif not (isinstance(item, type) and issubclass(item, torch.nn.Module)):
                raise MemtorchError(
                    f"fsdp_units items must be module names (str) or module types (nn.Module subclasses), got "
                    f"{item!r}"
                )
        strs = {x for x in spec if isinstance(x, str)}
        types = tuple(x for x in spec if isinstance(x, type))
        chosen = [(n, m) for n, m in named if m is not model and (n in strs or (types and isinstance(m, types)))]
    else:
        raise MemtorchError(
            "fsdp_units must be None, a list of module names and/or module types, or a predicate "
            f"(name, module) -> bool, got {spec!r}"
        )
    depth = {id(m): n.count(".") + 1 for n, m in chosen}
    chosen.sort(key=lambda nm: -depth[id(nm[1])])  # innermost first: fully_shard on nested units first
    return chosen + [("", model)]


def unit_params(units, param_index):
    """[[trainable parameter indices]] each unit manages: its parameters not taken by a unit wrapped before."""
    taken = set()
    out = []
    for _, mod in units:
        mine = []
        for p in mod.parameters():
            i = param_index.get(id(p))
            if i is not None and i not in taken:
                taken.add(i)
                mine.append(i)
        out.append(mine)
    return out


def unit_sizes(facts, n):
    """[{name, gathered_bytes}]: each FSDP unit holding parameters and its parameters' padded unsharded bytes
    (what its all-gather brings back on every rank)."""
    out = []
    for name, ps in zip(facts["unit_names"], facts["units"]):
        if ps:
            full = sum(_padded(facts, i, n) * _esize(facts, i) for i in ps)
            out.append({"name": words.root_or(name), "gathered_bytes": int(full)})
    return out


def _padded(facts, i, n):
    """Padded unsharded elements of parameter i: ceil(dim0 / n) rows on each of n ranks."""
    shape = facts["param_shapes"][i]
    d0 = shape[0] if shape else 1
    _, cs = _chunk_rows(d0, n, 0)
    return cs * n * (facts["param_numels"][i] // d0 if d0 else 0)


def _esize(facts, i):
    numel = facts["param_numels"][i]
    return facts["param_bytes"][i] // numel if numel else 0


def _chunk_rows(d0, n, rank):
    """Rows of dim 0 that torch.chunk(n) gives ``rank`` (FSDP2's _chunk_with_empty) and the padded chunk rows."""
    cs = math.ceil(d0 / n) if d0 else 0
    return max(0, min(cs, d0 - rank * cs)), cs


# ---------------------------------------------------------------------------
# The replay


class _Sizes:
    """A rank's bytes per key, size_of(key): the one process's (``base``, rounded to the allocator's blocks on
    cuda), ``over`` where the rank holds another amount, and the pseudo keys' (tuples) from ``pseudo``."""

    __slots__ = ("base", "over", "pseudo")

    def __init__(self, base, over, pseudo):
        self.base, self.over, self.pseudo = base, over, pseudo

    def __call__(self, k):
        if isinstance(k, tuple):
            return self.pseudo[k][0]
        v = self.over.get(k)
        return self.base.values[k] if v is None else v

    def array(self, extra):
        """int64 sizes of the ledger's keys then of ``extra`` (pseudo keys, in order)."""
        arr = self.base.array
        if self.over or extra:
            arr = numpy.concatenate((arr, numpy.fromiter((self.pseudo[k][0] for k in extra), numpy.int64, len(extra))))
            if self.over:
                arr[numpy.fromiter(self.over, numpy.int64, len(self.over))] = numpy.fromiter(
                    self.over.values(), numpy.int64, len(self.over)
                )
        return arr


class _Base:
    """The one process's bytes per ledger key, as a list and an int64 array (rounded on cuda)."""

    __slots__ = ("values", "array")

    def __init__(self, values):
        self.values = values
        self.array = numpy.array(values, dtype=numpy.int64)


def _encoded(ledger):
    """The ledger's events as alloc_replay takes them (key, ~key for a free), made once per ledger."""
    enc = getattr(ledger, "_encoded", None)
    if enc is None or len(enc) != len(ledger.events):
        enc = numpy.fromiter((k if s > 0 else ~k for k, s in ledger.events), numpy.int64, len(ledger.events))
        ledger._encoded = enc
    return enc


def base_sizes(ledger, rnd=None):
    """_Base of the ledger's keys: info[key][0], through rnd (the allocator's rounding) when given."""
    cache = ledger.__dict__.setdefault("_base_sizes", {})
    got = cache.get(rnd)
    if got is None or len(got.values) != len(ledger.info):
        info = ledger.info
        vals = [info[k][0] for k in range(len(info))]
        if rnd is not None:
            vals = [rnd(v) for v in vals]
        got = cache[rnd] = _Base(vals)
    return got


def replay(ledger, sizes, cuda=False):
    """(curve as a list, peak, index of the event reaching it, reserved, live keys at it, unsplit bytes) of the
    ledger's own events with int64 ``sizes`` per key (_C.alloc_replay; cuda: through the caching allocator's
    model, whose requests it rounds itself)."""
    curve, peak, at, reserved, live, unsplit = _C.alloc_replay(_encoded(ledger), sizes, cuda)
    return curve.tolist(), peak, at, reserved, set(live.tolist()), unsplit


def replay_peaks(ledger, sizes, cuda=False):
    """(peak, reserved: None but on cuda) of the ledger's own events with int64 ``sizes`` per key, as replay()
    gives them without the curve (fit()'s predictions, many per search: 1.1 ms each for a 32-layer Llama
    shape's 20,801 events)."""
    _curve, peak, _at, reserved, _live, _unsplit = _C.alloc_replay(_encoded(ledger), sizes, cuda)
    return int(peak), None if reserved is None else int(reserved)


def _categories(ledger):
    """(category names, int64 array of each ledger key's category index), made once per ledger."""
    got = getattr(ledger, "_categories", None)
    info = ledger.info
    if got is None or len(got[1]) != len(info):
        index = {}
        codes = numpy.fromiter((index.setdefault(info[k][3], len(index)) for k in range(len(info))), numpy.int64,
                               len(info))  # fmt: skip
        got = ledger._categories = (list(index), codes)
    return got


class _Rep:
    """A rank's replay (_replay): peak, live (the keys live at the peak: ledger keys and pseudo keys), end
    (bytes at the end), phases [(phase, start, end, highest)], reserved, unsplit; and, for the sums of
    _figures, sizes (int64 bytes per index: the ledger's keys, then the pseudo keys'), live_ix (the indices
    live at the peak) and pseudo_at ({index: pseudo key})."""

    __slots__ = ("peak", "end", "phases", "reserved", "unsplit", "sizes", "live_ix", "pseudo_at")

    def __init__(self, peak, end, phases, reserved, unsplit, sizes, live_ix, pseudo_at):
        self.peak, self.end, self.phases, self.reserved, self.unsplit = peak, end, phases, reserved, unsplit
        self.sizes, self.live_ix, self.pseudo_at = sizes, live_ix, pseudo_at

    @property
    def live(self):
        at = self.pseudo_at
        return {at.get(k, k) for k in self.live_ix.tolist()}

    def pseudo_live(self):
        """[(pseudo key, bytes)] live at the peak."""
        nk = len(self.sizes) - len(self.pseudo_at)
        extra = self.live_ix[self.live_ix >= nk]
        return [(self.pseudo_at[i], int(self.sizes[i])) for i in extra.tolist()]


def _replay(ledger, size_of, inserts, spans, cuda=False):
    """A rank's curve (a _Rep): ledger events with sizes from size_of (a _Sizes), inserts {pos: [(pseudo key,
    +1/-1)]}.

    Its peak, the keys live at it, the bytes at the end, [(phase, start, end, highest)], the reserved peak and
    unsplit; cuda: the curve is the caching allocator's allocated bytes (its blocks), the reserved peak its
    segments' and unsplit the bytes of the blocks live at the peak beyond their rounded requests (None and 0
    otherwise). The sequence runs in C (_C.alloc_replay; allocator.CachingAllocator is its reference).
    """
    events = ledger.events
    n = len(events)
    nkeys = len(ledger.info)
    index = {}  # pseudo key -> its index after the ledger's keys
    at, values, tail = [], [], []
    for p in sorted(inserts):
        for key, sign in inserts[p]:
            if isinstance(key, tuple):
                ix = index.get(key)
                if ix is None:
                    ix = index[key] = nkeys + len(index)
            else:
                ix = key
            v = ix if sign > 0 else ~ix
            if p > n:
                tail.append(v)
            else:
                at.append(p)
                values.append(v)
    seq = _encoded(ledger)
    if at:
        seq = numpy.insert(seq, at, values)  # before each position, in the order given
    if tail:
        seq = numpy.concatenate((seq, numpy.array(tail, dtype=numpy.int64)))
    sizes = size_of.array(list(index))
    curve, best, _best_at, reserved, live, unsplit = _C.alloc_replay(seq, sizes, cuda)

    def before(i):  # where the inserts at ledger position i begin in the sequence
        return i + bisect.bisect_left(at, i)

    def after(i):
        return i + bisect.bisect_right(at, i)

    def value(i):
        return int(curve[i - 1]) if i > 0 else 0

    phases = []  # (name, bytes at its start, at its end, its highest)
    ends = {e for _n, _s, e in spans}
    for name, s, e in spans:
        # what was inserted at a phase's end (FSDP's final callback) belongs to that phase
        s2 = after(s) if s in ends else before(s)
        e2 = after(e)
        start = value(s2)
        high = int(curve[s2:e2].max()) if e2 > s2 else start
        phases.append((name, start, value(e2), max(high, start)))
    return _Rep(best, int(curve[-1]) if len(curve) else 0, phases, reserved, unsplit, sizes, live,
                {ix: key for key, ix in index.items()})  # fmt: skip


def even_partition(groups, numels, n):
    """DeepSpeed ZeRO stage 1/2's partition: [elements of one rank's partition] per parameter group, and
    {parameter index: its part of that partition} (elements).

    Each group's E elements are padded to a multiple of 2 * n (nccl_start_alignment_factor 2 times the
    world size, flatten_dense_tensors_aligned) and cut into n equal partitions of 2 * ceil(E / 2n); a
    parameter's part is its share E_p / E of it, rounded down, the rest going to the group's last parameter.
    """
    sizes, parts = [], {}
    for group in groups:
        e = sum(numels[i] for i in group)
        align = 2 * n
        size = (e + align - 1) // align * align // n
        sizes.append(size)
        given = 0
        for j, i in enumerate(group):
            share = size - given if j == len(group) - 1 else (numels[i] * size // e if e else 0)
            parts[i] = share
            given += share
    return sizes, parts


def per_rank(ledger, hooks, facts, n, sharding, rnd=None, cuda=False):
    """[{rank figures}] for every rank, by replaying the ledger. rnd(bytes): the allocator's rounding (CUDA);
    cuda: each rank's sequence replayed through the caching allocator's model (allocated and reserved)."""
    base = base_sizes(ledger, rnd)
    rnd = rnd or (lambda b: b)
    info = ledger.info
    owner = ledger.owner
    state_keys = facts["state_keys"]
    numels = facts["param_numels"]

    def size0(k):
        return base.values[k]

    G = sum(size0(k) for k in facts["last_grads"])

    def in_step(k):
        # allocated by the optimizer step (state, temporaries) or kept as optimizer state
        return k in state_keys or info[k][1] == "optimizer"

    pseudo = {}  # pseudo key (a tuple) -> (bytes, category)

    def sized(over):
        return _Sizes(base, over, pseudo)

    # (key, parameter index) of every storage of a parameter's step (its state, its temporaries)
    stepped = [(k, o) for k, o in owner.items() if o is not None and o >= 0 and in_step(k)]

    results = []
    if sharding in ("ddp", "zero1"):
        pseudo[("buckets",)] = (rnd(G), "communication")  # the Reducer's buckets, from wrapping on
        inserts = {0: [(("buckets",), 1)]}
        parts = zero_partition(facts["param_groups"], numels, n) if sharding == "zero1" else None
        cache = {}
        for r in range(n):
            mine = None if parts is None else frozenset(parts[r])
            if mine not in cache:
                over = {} if mine is None else {k: 0 for k, o in stepped if o not in mine}
                cache[mine] = (over, _replay(ledger, sized(over), inserts, hooks.spans, cuda))
            over, rep = cache[mine]
            fig = _figures(r, rep, ledger, pseudo, facts, G, rnd(G), 0)
            if parts is not None:
                fig["parameters_stepped"] = len(parts[r])
            results.append(fig)
        if sharding == "zero1" and facts.get("floor"):
            # a rank stepping no parameter: what every rank holds whatever the world size (memtorch.plan stops
            # adding ranks once this is over the device)
            idle = frozenset()
            if idle not in cache:
                over = {k: 0 for k, _o in stepped}
                cache[idle] = (over, _replay(ledger, sized(over), inserts, hooks.spans, cuda))
            for fig in results:
                fig["floor"] = int(cache[idle][1].peak)
        return results
    if sharding in EVEN:
        sizes, part = even_partition(facts["param_groups"], numels, n)
        over = _flat_partitions(ledger, facts, in_step, sizes, part, rnd)
        rep = _replay(ledger, sized(over), {}, hooks.spans, cuda)
        fig = _figures(0, rep, ledger, pseudo, facts, G, 0, 0)
        if facts.get("floor"):
            # no partition at all: what a rank holds whatever the world size (memtorch.plan's stopping bound)
            none = {k: 0 for k in over}
            fig["floor"] = int(_replay(ledger, sized(none), {}, hooks.spans, cuda).peak)
        return [dict(fig, rank=r) for r in range(n)]
    return _fsdp(ledger, hooks, facts, n, sharding, size0, rnd, pseudo, sized, stepped, G, cuda)


def _flat_partitions(ledger, facts, in_step, sizes, part, rnd):
    """{key: bytes on a rank} of the optimizer step's storages under DeepSpeed's ZeRO stage 1/2.

    DeepSpeed steps one flat fp32 partition per parameter group (single_partition_of_fp32_groups[g], of
    sizes[g] elements), so each state of the optimizer (exp_avg, exp_avg_sq, a master copy) is one tensor of
    the partition per group, and a scalar one (Adam's step) one per group; the one-process run holds them per
    parameter. The first of a group's storages of one state carries the whole flat tensor, rounded once by the
    allocator, the others nothing. Likewise the step's temporaries: the outputs one foreach call makes for the
    parameters of a group (one burst of allocations, each parameter once) are one tensor of the partition.
    Any other storage of the step is its parameter's part (part[i] elements) of the partition, as before.
    """
    info, owner, elements = ledger.info, ledger.owner, ledger.elements
    numels = facts["param_numels"]
    names = facts.get("state_names", {})
    group_of = {i: g for g, grp in enumerate(facts["param_groups"]) for i in grp}

    def elementwise(k, o):
        return numels[o] and elements.get(k) == numels[o]

    slots = {}  # (group, state name or burst, elementwise) -> [keys], in allocation order
    burst, seen = 0, set()
    for k, sign in ledger.events:
        o = owner.get(k) if sign > 0 else None
        if o is None or o < 0 or not in_step(k) or o not in group_of:
            if seen:
                burst, seen = burst + 1, set()
            continue
        if k in names:
            slot = ("state", names[k])
        elif elementwise(k, o):
            if o in seen:  # a parameter again: the next call's outputs
                burst, seen = burst + 1, set()
            seen.add(o)
            slot = ("burst", burst)
        else:
            continue
        slots.setdefault((group_of[o], slot, bool(elementwise(k, o))), []).append(k)
    over = {}
    for (g, _slot, whole), keys in slots.items():
        first = keys[0]
        if whole:
            # bytes per element of this state (fp32 moments of bf16 parameters: 4) times the partition
            per = info[first][0] // elements[first]
            over[first] = rnd(sizes[g] * per)
        else:
            over[first] = rnd(info[first][0])  # a scalar state: one per group
        for k in keys[1:]:
            over[k] = 0
    for k in info:
        o = owner.get(k)
        if k not in over and o is not None and o >= 0 and in_step(k):
            over[k] = rnd(_scaled(info[k][0], numels[o], part.get(o, 0), elements.get(k)))
    return over


def _scaled(nbytes, numel, part, elements):
    """Bytes of a storage of a parameter's step for ``part`` of the parameter's elements: scaled when the
    storage has as many elements as the parameter (elementwise: a moment, a temporary), else kept whole (a
    step count, a scalar)."""
    if numel and elements == numel:
        return int(nbytes // numel * part)
    return nbytes


def _figures(rank, rep, ledger, pseudo, facts, grads, buckets, gathered, upper=None):
    sizes, live = rep.sizes, rep.live_ix
    names, codes = _categories(ledger)
    own = live[live < len(codes)]
    # per category of the ledger's keys live at the peak, in the order of their first key
    cats = codes[own]
    totals = numpy.zeros(len(names), numpy.int64)
    numpy.add.at(totals, cats, sizes[own])
    present, first = numpy.unique(cats, return_index=True)
    breakdown = {names[c]: int(totals[c]) for c in present[numpy.argsort(first, kind="stable")].tolist()}
    for key, nbytes in rep.pseudo_live():
        cat = pseudo[key][1]
        breakdown[cat] = breakdown.get(cat, 0) + nbytes
    if rep.reserved is not None:  # cuda: the blocks handed out whole, as the peak counts them
        breakdown[words.ALLOCATOR_ROUNDING] = int(rep.unsplit)

    def total(keys):
        return int(sizes[numpy.fromiter(keys, numpy.int64)].sum()) if keys else 0

    # between steps: what the one process keeps (parameters, buffers, state, inputs) at this rank's
    # sizes, and DDP's buckets
    steady = total(facts["end_live"]) + buckets
    peak = rep.peak
    return {
        "rank": rank,
        "peak": int(peak),
        # gloo (CPU FSDP): the peak if each collective's scratch is freed only when the next one begins
        "peak_upper": int(peak if upper is None else max(peak, upper)),
        "reserved_peak": None if rep.reserved is None else int(rep.reserved),
        "steady": int(steady),
        # each storage once: several parameters may view one (cuDNN's flat RNN weights)
        "parameter": total(set(facts["param_keys"])),
        "gradient": int(grads),
        "optimizer_state": total(facts["last_state"]),
        "communication_buckets": int(buckets),
        "gathered_parameters": int(gathered),
        "breakdown": breakdown,
        "phases": {name: max(top for n, _s, _e, top in rep.phases if n == name) for name, *_ in rep.phases},
        "spans": rep.phases,
    }


def _fsdp(ledger, hooks, facts, n, sharding, size0, rnd, pseudo, sized, stepped, G, cuda=False):
    gloo = facts.get("device", "cpu") == "cpu"
    info = ledger.info
    shapes = facts["param_shapes"]
    numels = facts["param_numels"]
    units = facts["units"]  # [[param index]]: innermost first, the root last
    root = len(units) - 1
    grad_keys = facts["grad_keys"]  # key -> parameter index
    reshard_fwd = sharding == "zero3"
    spans = hooks.spans

    def d0_of(i):
        return shapes[i][0] if shapes[i] else 1

    def padded(i):
        return _padded(facts, i, n)

    esize = [_esize(facts, i) for i in range(len(numels))]
    gsize = dict(enumerate(esize))
    for k, i in grad_keys.items():  # a gradient's bytes per element: its storage's over the storage's elements
        whole = ledger.elements.get(k) or numels[i]
        for j in [v[2] for v in ledger.views.get(k, ())] or [i]:  # every parameter viewing that storage
            gsize[j] = info[k][0] // whole if whole else esize[j]
    full_u = [rnd(sum(padded(i) * esize[i] for i in u)) for u in units]
    rs_in_u = [sum(padded(i) * gsize[i] for i in u) for u in units]
    rs_out_u = [rnd(x // n) for x in rs_in_u]
    rs_in_u = [rnd(x) for x in rs_in_u]
    grad_free, first_alloc = {}, {}
    for pos, (k, sign) in enumerate(ledger.events):
        if k in grad_keys:
            if sign > 0:
                first_alloc.setdefault(k, pos)
            else:
                grad_free[k] = pos
    unit_of = {i: u for u, ps in enumerate(units) for i in ps}
    final_order = [root] + [u for u in facts["unit_module_order"] if u != root]
    # the unit hooks recorded in the dry run, the gradients' allocations, phase bounds; in time order
    ev = [(s, 0, "step-start", None) for name, s, _e in spans if name == "forward"]
    ev += [(pos, 1, kind, u) for pos, kind, u in facts["unit_events"]]
    ev += [(first_alloc[k], 2, "grad", k) for k in grad_keys if k in first_alloc]
    ev += [(e, 3, "backward-end", None) for name, _s, e in spans if name == "backward"]
    ev.sort(key=lambda t: (t[0], t[1]))  # stable: the hooks keep the order they fired in

    # cuDNN's recurrent layers read their parameters' flat buffer in place; FSDP2's unsharded parameters are
    # each its own tensor, so each training forward copies them into a flat weight_buf of cuDNN's, saved for
    # backward with the reserve (freed with it)
    trainable_keys = set(facts["param_keys_trainable"])
    in_place = [(p, b, res) for p, b, res in getattr(facts.get("cuda_state"), "rnn_in_place", ())
                if b in trainable_keys]  # fmt: skip
    freed_at = {k: pos for pos, (k, sign) in enumerate(ledger.events) if sign < 0}
    cache = {}
    results = []
    # rank r's rows of each parameter's dim 0 (_chunk_rows for every parameter at once)
    d0s = numpy.fromiter((d0_of(i) for i in range(len(numels))), numpy.int64, len(numels))
    chunk = -(-d0s // n)
    shards = {}
    for i, k in enumerate(facts["param_keys_trainable"]):
        # the padded shard FSDP2 keeps, one per parameter: a storage several parameters view (cuDNN's flat
        # RNN weights) holds all of theirs
        shards[k] = shards.get(k, 0) + rnd(padded(i) // n * esize[i])
    for r in range(n):
        mine = numpy.clip(d0s - r * chunk, 0, chunk)
        sig = mine.tobytes()
        if sig in cache:
            results.append(dict(cache[sig], rank=r))
            continue
        rows = mine.tolist()
        over = dict(shards)
        for k, o in stepped:
            d0 = d0_of(o)
            part = rows[o] * (numels[o] // d0) if d0 else 0
            over[k] = rnd(_scaled(info[k][0], numels[o], part, ledger.elements.get(k)))
        for k in grad_keys:  # autograd's unsharded gradient: replaced by a pseudo key freed when reduced
            over[k] = 0
        inserts = {}
        late = {}  # the same with each gloo scratch freed only once the next collective's is allocated
        counter = [0]
        last_scratch = [None]

        def at(pos, *items, inserts=inserts, late=late):
            inserts.setdefault(pos, []).extend(items)
            late.setdefault(pos, []).extend(items)

        def new(name, nbytes, cat, counter=counter):
            counter[0] += 1
            key = (name, counter[0])
            pseudo[key] = (int(nbytes), cat)
            return key

        def scratch(pos, nbytes):
            # gloo's all-gather and reduce-scatter work through a scratch tensor as large as the
            # gathered output / the reduce-scatter input, freed when the collective returns
            if gloo:
                key = new("gloo scratch", nbytes, "communication")
                inserts.setdefault(pos, []).extend([(key, 1), (key, -1)])
                later = late.setdefault(pos, [])
                later.append((key, 1))
                if last_scratch[0] is not None:
                    later.append((last_scratch[0], -1))
                last_scratch[0] = key

        unsharded = [None] * len(units)
        prefetched = {}
        st = {"ag": None, "rs": None}
        post_done, post_order, live_grads, unit_gkeys = set(), [], {}, {}

        def post_backward(u, pos):
            if u in post_done or not units[u]:
                return
            post_done.add(u)
            if unsharded[u] is not None:
                at(pos, (unsharded[u], -1))
                unsharded[u] = None
            if st["rs"] is not None:  # the previous unit's reduce-scatter input
                at(pos, (st["rs"], -1))
                st["rs"] = None
            grads = live_grads.pop(u, [])
            if not grads:
                return
            rin = new("reduce-scatter input", rs_in_u[u], "communication")
            at(pos, (rin, 1), *[(g, -1) for g in grads])
            rout = new("sharded gradients", rs_out_u[u], "gradient")
            at(pos, (rout, 1))
            scratch(pos, rs_in_u[u])
            st["rs"] = rin
            frees = [grad_free[k] for k in unit_gkeys.pop(u, []) if k in grad_free]
            at(min(frees) if frees else len(ledger.events), (rout, -1))

        for pos, _c, kind, x in ev:
            if kind == "step-start":
                post_done.clear()
                post_order.clear()
            elif kind == "fwd_pre":
                if unsharded[x] is None and units[x]:
                    ag = new("all-gather output", full_u[x], "communication")
                    at(pos, (ag, 1))
                    scratch(pos, full_u[x])
                    unsharded[x] = new("unsharded parameters", full_u[x], "parameter")
                    at(pos, (unsharded[x], 1))
                    if st["ag"] is not None:  # the previous unit's, freed once this one is copied out
                        at(pos, (st["ag"], -1))
                    st["ag"] = ag
            elif kind == "fwd_post":
                if x == root:
                    if st["ag"] is not None:
                        at(pos, (st["ag"], -1))
                        st["ag"] = None
                elif reshard_fwd and unsharded[x] is not None:
                    at(pos, (unsharded[x], -1))
                    unsharded[x] = None
                if units[x]:
                    post_order.append(x)
            elif kind == "pre_bwd":
                if unsharded[x] is None and units[x]:
                    ag = prefetched.pop(x, None)
                    if ag is None:
                        ag = new("all-gather output", full_u[x], "communication")
                        at(pos, (ag, 1))
                        scratch(pos, full_u[x])
                    unsharded[x] = new("unsharded parameters", full_u[x], "parameter")
                    at(pos, (unsharded[x], 1), (ag, -1))
                if x in post_order:  # prefetch the unit whose forward ended before this one's
                    idx = len(post_order) - 1 - post_order[::-1].index(x)
                    t = post_order[idx - 1] if idx > 0 else None
                    if t is not None and unsharded[t] is None and t not in prefetched:
                        prefetched[t] = new("all-gather output", full_u[t], "communication")
                        at(pos, (prefetched[t], 1))
                        scratch(pos, full_u[t])
            elif kind == "grad":
                g = new("gradient", size0(x), "gradient")
                at(pos, (g, 1))
                u = unit_of.get(grad_keys[x])
                live_grads.setdefault(u, []).append(g)
                unit_gkeys.setdefault(u, []).append(x)
            elif kind == "post_bwd":
                post_backward(x, pos)
            elif kind == "backward-end":  # the final callback: units whose inputs need no gradient, the root
                for u in final_order:
                    post_backward(u, pos)
                if st["rs"] is not None:
                    at(pos, (st["rs"], -1))
                    st["rs"] = None
        for p, b, res in in_place:
            copy = new("cuDNN weight copy", rnd(info[b][0]), "activation")
            at(p, (copy, 1))
            at(freed_at.get(res, len(ledger.events)) + 1, (copy, -1))
        if last_scratch[0] is not None:
            late.setdefault(len(ledger.events) + 1, []).append((last_scratch[0], -1))
        size_of = sized(over)
        rep = _replay(ledger, size_of, inserts, spans, cuda)
        upper = _replay(ledger, size_of, late, spans).peak if gloo else None
        gathered = sum(b for k, b in rep.pseudo_live() if k[0] == "unsharded parameters")
        fig = _figures(r, rep, ledger, pseudo, facts, sum(rs_out_u), 0, gathered, upper)
        cache[sig] = fig
        results.append(fig)
    return results
