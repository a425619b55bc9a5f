"""_C.alloc_replay, the C replay behind estimate()'s and every rank's figures, held against its Python
reference (memtorch.estimator.allocator.CachingAllocator, itself held against the H200's traces in
test_estimate_cuda) event by event, and _estimate_ranks._replay's sequence with inserts against the
sequence built by hand."""

import gc
import random
import sys

import numpy as np
import pytest

from memtorch import _C
from memtorch.estimator import ranks as _estimate_ranks
from memtorch.estimator.allocator import CachingAllocator, round_size

# The allocation model's entry points in _C, each exercised by the leak loop below.
ALLOC_FUNCTIONS = {"alloc_replay"}

MiB = 1 << 20


def _random_sequence(seed, n=2500):
    """(events [(key, +1/-1)], sizes [bytes per key]): requests around the allocator's thresholds."""
    rng = random.Random(seed)
    live, events, sizes = [], [], []
    choices = [0, 1, 511, 512, 513, 4096, MiB - 1, MiB, MiB + 1, 10 * MiB - 1, 10 * MiB, 21 * MiB]
    for _ in range(n):
        if live and rng.random() < 0.45:
            events.append((live.pop(rng.randrange(len(live))), -1))
        else:
            pick = rng.random()
            size = rng.choice(choices) if pick < 0.4 else rng.randrange(1, 3000 if pick < 0.7 else 40 * MiB)
            live.append(len(sizes))
            events.append((len(sizes), 1))
            sizes.append(size)
    return events, sizes


def _encode(events):
    return np.array([k if s > 0 else ~k for k, s in events], dtype=np.int64)


def _live_at(events, at):
    live = set()
    for k, s in events[: at + 1]:
        (live.add if s > 0 else live.discard)(k)
    return live


@pytest.mark.parametrize("seed", range(40))
def test_c_model_is_the_python_model_event_by_event(seed):
    events, sizes = _random_sequence(seed)
    ref = CachingAllocator()
    allocated, reserved = ref.replay(events, dict(enumerate(sizes)))
    curve, peak, at, res, live, unsplit = _C.alloc_replay(_encode(events), np.array(sizes, np.int64), True)
    assert curve.tolist() == allocated
    assert res == reserved[-1] == max(reserved)
    assert peak == max(allocated)
    assert at == allocated.index(peak)  # the first event reaching it
    assert set(live.tolist()) == _live_at(events, at)
    assert list(live) == sorted(live)
    assert unsplit == sum(ref.unsplit.get(k, 0) for k in _live_at(events, at))
    assert unsplit > 0 or seed % 2  # the sequences hand out whole blocks (a test that can fail)


@pytest.mark.parametrize("seed", range(10))
def test_without_cuda_the_curve_is_the_sum_of_the_requests(seed):
    events, sizes = _random_sequence(seed)
    curve, peak, at, res, live, unsplit = _C.alloc_replay(_encode(events), sizes, False)
    cur, want = 0, []
    for k, s in events:
        cur += s * sizes[k]
        want.append(cur)
    assert curve.tolist() == want
    assert (peak, at, res, unsplit) == (max(want), want.index(max(want)), None, 0)
    assert set(live.tolist()) == _live_at(events, at)


def test_hand_counted_blocks():
    # a 1 MiB + 1 request rounds to 1 MiB + 512 and takes a 20 MiB segment (LARGE_BUFFER), the rest split off
    # as a free block; 100 B takes a 512 B block of a 2 MiB small segment; a request of 0 bytes takes nothing.
    # Once the first is freed it merges back into its whole 20 MiB segment; the last request, 19 MiB once
    # rounded, takes that block whole: a remainder of 1 MiB is not above SMALL_SIZE, so it is not split off,
    # and allocated counts the whole 20 MiB (1 MiB of it beyond the request)
    events = [(0, 1), (1, 1), (2, 1), (0, -1), (3, 1)]
    sizes = [MiB + 1, 100, 0, 20 * MiB - round_size(MiB + 1) + 1]
    curve, peak, at, res, live, unsplit = _C.alloc_replay(_encode(events), sizes, True)
    first = round_size(MiB + 1)
    assert first == MiB + 512 and round_size(sizes[3]) == 19 * MiB
    assert curve.tolist() == [first, first + 512, first + 512, 512, 512 + 20 * MiB]
    assert res == 20 * MiB + 2 * MiB
    assert (peak, at, set(live.tolist()), unsplit) == (512 + 20 * MiB, 4, {1, 2, 3}, MiB)


def test_the_encoder_trace_replays_as_the_python_model():
    # the H200 encoder step's own events (tests/cuda, from ../shared/gpu/h200): the same curve, peak and
    # segments as the Python model, whose figures test_estimate_cuda holds against the trace's
    import test_estimate_cuda as tc

    rows = [r for r in tc._encoder_rows() if r[0] in ("alloc", "free_completed")]
    index, events, sizes = {}, [], []
    for kind, size, addr, *_ in rows:
        if kind == "alloc":
            index[addr] = len(sizes)
            sizes.append(size)
            events.append((index[addr], 1))
        elif addr in index:
            events.append((index.pop(addr), -1))
    assert len(events) > 1000
    ref = CachingAllocator()
    allocated, reserved = ref.replay(events, dict(enumerate(sizes)))
    curve, peak, at, res, _live, unsplit = _C.alloc_replay(_encode(events), sizes, True)
    assert curve.tolist() == allocated
    assert (peak, res) == (max(allocated), reserved[-1])


def _reference_replay(events, size_of, inserts):
    """_estimate_ranks._replay's sequence as it was built in Python: each position's inserts before its event,
    the ones past the end after everything, in position order."""
    seq = []
    for i in range(len(events) + 1):
        seq.extend(inserts.get(i, ()))
        if i < len(events):
            seq.append(events[i])
    for p in sorted(p for p in inserts if p > len(events)):
        seq.extend(inserts[p])
    cur, curve = 0, []
    for key, sign in seq:
        cur += sign * size_of(key)
        curve.append(cur)
    return curve


class _Ledger:
    def __init__(self, events, sizes):
        self.events = events
        self.info = {k: [s, None, None, "activation"] for k, s in enumerate(sizes)}


@pytest.mark.parametrize("cuda", [False, True])
def test_rank_replay_with_inserts_is_the_hand_built_sequence(cuda):
    events, sizes = _random_sequence(7, n=400)
    ledger = _Ledger(events, sizes)
    pseudo = {("buckets",): (3 * MiB, "communication"), ("x", 1): (700, "gradient"), ("x", 2): (1, "gradient")}
    n = len(events)
    inserts = {0: [(("buckets",), 1)], 5: [(("x", 1), 1), (("x", 2), 1)], 9: [(("x", 2), -1)],
               n: [(("x", 1), -1)], n + 3: [(("buckets",), -1)]}  # fmt: skip
    over = {3: 0, 4: 12345}
    base = _estimate_ranks.base_sizes(ledger, round_size if cuda else None)
    size_of = _estimate_ranks._Sizes(base, over, pseudo)
    spans = [("forward", 0, 5), ("backward", 5, n)]
    rep = _estimate_ranks._replay(ledger, size_of, inserts, spans, cuda)
    peak, live, end, phases, reserved = rep.peak, rep.live, rep.end, rep.phases, rep.reserved
    if not cuda:
        want = _reference_replay(events, size_of, inserts)
        assert peak == max(want) and end == want[-1]
        # the forward's phase: from before the buckets (inserted at 0) to after position 5's inserts
        assert phases[0][1:3] == (0, want[5 + 2])
        assert phases[1][2] == want[-2]  # after position n's inserts, before those past the end
    else:
        ref = CachingAllocator()
        seq = []
        for i in range(n + 1):
            seq.extend(inserts.get(i, ()))
            if i < n:
                seq.append(events[i])
        seq.extend(inserts[n + 3])
        allocated, res = ref.replay(seq, {k: size_of(k) for k, _ in seq})
        assert (peak, end, reserved) == (max(allocated), allocated[-1], res[-1])
    assert ("buckets",) in live
    # the sizes _figures sums: every key's, the pseudo keys' after the ledger's
    assert [int(v) for v in rep.sizes] == [size_of(k) for k in range(len(sizes))] + [size_of(k) for k in pseudo
                                                                                   if k in rep.pseudo_at.values()]
    assert dict(rep.pseudo_live()) == {k: size_of(k) for k in live if isinstance(k, tuple)}


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="beyond the 1 sizes"):
        _C.alloc_replay([0, 1], [10], True)
    with pytest.raises(ValueError, match="beyond"):
        _C.alloc_replay([~5], [10], False)
    with pytest.raises(TypeError, match="events must be a 1-d sequence of integers"):
        _C.alloc_replay("abc", [10], True)
    with pytest.raises(TypeError, match="sizes"):
        _C.alloc_replay([0], [[1, 2]], True)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        _C.alloc_replay([0], [1])
    # nothing at all: no peak, no event reaching it
    curve, peak, at, res, live, unsplit = _C.alloc_replay([], [], True)
    assert (len(curve), peak, at, res, len(live), unsplit) == (0, 0, -1, 0, 0, 0)


def test_alloc_replay_does_not_leak():
    events, sizes = _random_sequence(3, n=300)
    enc, arr = _encode(events), np.array(sizes, np.int64)

    def once():
        _C.alloc_replay(enc, arr, True)
        _C.alloc_replay(enc, arr, False)
        try:
            _C.alloc_replay(enc, arr[:2], True)
        except ValueError:
            pass

    for _ in range(3):
        once()
    deltas, refs = [], []
    for _ in range(5):
        r0 = sys.getrefcount(enc) + sys.getrefcount(arr)
        gc.collect()
        b0 = sys.getallocatedblocks()
        for _ in range(50):
            once()
        gc.collect()
        deltas.append(sys.getallocatedblocks() - b0)
        refs.append(sys.getrefcount(enc) + sys.getrefcount(arr) - r0)
    assert not all(d > 0 for d in deltas), deltas
    assert refs == [0] * 5
