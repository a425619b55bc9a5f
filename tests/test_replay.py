"""_C.eventlog_replay held against a plain-Python twin on random event logs, and its bad input.

The twin below is written from the definitions (a list per address, a stack per
module row, slices for the maxima), not from the C code: the C pass uses a hash
table, a stack linked through an array and a segment tree instead.
"""

import numpy as np
import pytest

from memtorch import _C
from memtorch.peak import TAG_BITS

DTYPE = _C.eventlog_read_all(0, 0)[0].dtype
NO_NEXT = np.iinfo(np.int64).max


def twin(ev, start, dropped, peak, token, nrows, queries):
    rows = ev.tolist()  # (index, time, bytes, ptr, delta, kind, tag)
    n = len(rows)
    allocs = [i for i in range(n) if rows[i][5] == 0]
    base = start
    if dropped and allocs:
        base = rows[allocs[0]][2] - rows[allocs[0]][4]
    b, cur = [], base
    for r in rows:
        if r[5] == 0:
            cur = r[2]
        b.append(cur)
    mods = [[0, 0, 0, 0, 0] for _ in range(nrows)]
    stacks = {}
    phases, phase_open = [], {}
    for j, r in enumerate(rows):
        kind, num, tag = r[5], r[3], r[6]
        if kind == 0 or tag >> TAG_BITS != token:
            continue
        if kind == 3:
            if num >= 0x100:
                code = num & 0xFF
                if num & 0x100:
                    phase_open[code] = j
                elif code in phase_open:
                    p = phase_open.pop(code)
                    phases.append((code, b[p], b[j], max(b[p : j + 1])))
            continue
        if num >= nrows:
            continue
        if kind == 1:
            stacks.setdefault(num, []).append(j)
        elif stacks.get(num):
            p = stacks[num].pop()
            m = mods[num]
            m[0] += 1
            m[1] += 1
            m[2] += b[j] - b[p]
            m[3] = max(m[3], max(b[p : j + 1]) - b[p])
        else:
            mods[num][0] += 1
            mods[num][4] += 1
    for num, st in stacks.items():
        for p in st:
            m = mods[num]
            m[0] += 1
            m[1] += 1
            m[2] += b[n - 1] - b[p]
            m[3] = max(m[3], max(b[p:]) - b[p])
    k, reached, at = -1, True, peak
    if peak > base and allocs:
        hits = [i for i in allocs if rows[i][2] == peak]
        if hits:
            k = hits[0]
        else:
            top = max(rows[i][2] for i in allocs)
            k = next(i for i in allocs if rows[i][2] == top)
            reached = False
        at = rows[k][2]
    events_of = {}
    for i in allocs:
        events_of.setdefault(rows[i][3], []).append(i)
    live, freed_before = [], 0
    for ptr, idx in events_of.items():
        if idx[0] <= k and rows[idx[0]][4] < 0:
            freed_before -= rows[idx[0]][4]
        upto = [i for i in idx if i <= k]
        if upto and rows[upto[-1]][4] >= 0:
            after = [i for i in idx if i > k]
            r = rows[upto[-1]]
            live.append((upto[-1], [r[3], r[4], r[6], r[0], rows[after[0]][0] if after else NO_NEXT]))
    live = [v for _, v in sorted(live)]
    firsts = []
    for a in queries:
        idx = events_of.get(a)
        firsts.append([idx[0], rows[idx[0]][4], rows[idx[0]][0]] if idx else [-1, 0, 0])
    return base, k, at, reached, live, freed_before, firsts, mods, phases


def random_log(rng, n, token, nrows):
    """A log as a block writes it: allocations and frees of a few addresses (some freed
    before they are seen), module enters and exits (nested, some unmatched), phase marks,
    and marks of another block."""
    ev = np.zeros(n, dtype=DTYPE)
    live, cur = {}, int(rng.integers(0, 10_000))
    start = cur
    for i in range(n):
        ev[i]["index"] = 100 + i
        ev[i]["time"] = 1000 + i
        r = rng.random()
        if r < 0.6:
            ptr = int(rng.integers(1, 24)) * 64
            if ptr in live or rng.random() < 0.1:  # a free, maybe of a storage from before the log
                size = live.pop(ptr, int(rng.integers(1, 500)))
                delta = -size
            else:
                delta = int(rng.integers(0, 500))
                live[ptr] = delta
            cur += delta
            ev[i]["kind"], ev[i]["ptr"], ev[i]["delta"], ev[i]["bytes"] = 0, ptr, delta, cur
            ev[i]["tag"] = (token << TAG_BITS) | int(rng.integers(0, 16))
        else:
            kind = int(rng.integers(1, 4))
            if kind == 3:
                num = int(rng.choice([0, 0x101, 0x102, 0x103, 0x201, 0x202, 0x203]))
            else:
                num = int(rng.integers(0, nrows + 2))
            ev[i]["kind"], ev[i]["ptr"], ev[i]["delta"], ev[i]["bytes"] = kind, num, 0, -1
            ev[i]["tag"] = ((token if rng.random() < 0.9 else token % 255 + 1) << TAG_BITS) | 4
    return ev, start


def same(c, t):
    base, k, at, reached, live, freed, firsts, mods, phases = c
    assert (base, k, at, bool(reached), freed) == t[:4] + (t[5],)
    assert live.tolist() == t[4]
    assert firsts.tolist() == t[6]
    assert mods.tolist() == t[7]
    assert phases == t[8]


@pytest.mark.parametrize("seed", range(40))
def test_replay_matches_its_twin_on_random_logs(seed):
    rng = np.random.default_rng(seed)
    token, nrows = int(rng.integers(1, 256)), int(rng.integers(0, 6))
    ev, start = random_log(rng, int(rng.integers(0, 300)), token, nrows)
    allocated = ev["bytes"][ev["kind"] == 0]
    peaks = [start, start + 1] + ([int(allocated.max()), int(allocated.max()) + 7] if len(allocated) else [])
    queries = sorted({int(p) for p in ev["ptr"][ev["kind"] == 0][:5]} | {64 * 99, 0})
    for dropped in (0, 3):
        for peak in peaks:
            args = (ev, start, dropped, peak, token, nrows, queries)
            same(_C.eventlog_replay(*args), twin(*args))


def test_replay_of_a_hand_log():
    """Allocate 100 B at A, 50 B at B inside module 0's forward, free A, allocate 30 B at C:
    the peak (start 1000 + 150) is at the second event; live there: A and B."""
    tok = 7
    tag = tok << TAG_BITS
    spec = [  # (kind, ptr, delta)
        (3, 0x101, 0), (1, 0, 0), (0, 0xA0, 100), (0, 0xB0, 50), (2, 0, 0),
        (0, 0xA0, -100), (0, 0xC0, 30), (3, 0x201, 0),
    ]  # fmt: skip
    ev = np.zeros(len(spec), dtype=DTYPE)
    cur = 1000
    for i, (kind, ptr, delta) in enumerate(spec):
        cur += delta
        ev[i] = (10 + i, i, cur if kind == 0 else -1, ptr, delta, kind, tag)
    base, k, at, reached, live, freed, firsts, mods, phases = _C.eventlog_replay(
        ev, 1000, 0, 1150, tok, 1, [0xA0, 0xD0]
    )
    assert (base, k, at, reached, freed) == (1000, 3, 1150, True, 0)
    assert live.tolist() == [[0xA0, 100, tag, 12, 15], [0xB0, 50, tag, 13, NO_NEXT]]
    assert firsts.tolist() == [[2, 100, 12], [-1, 0, 0]]
    # module 0: one call, +150 B kept at its end, 150 B above its start at most
    assert mods.tolist() == [[1, 1, 150, 150, 0]]
    # forward phase: from 1000 to 1080, highest 1150
    assert phases == [(1, 1000, 1080, 1150)]


def test_replay_refuses_what_is_not_a_log():
    ev = np.zeros(3, dtype=DTYPE)
    with pytest.raises(TypeError, match="eventlog_read_all"):
        _C.eventlog_replay([1, 2], 0, 0, 0, 1, 0, [])
    with pytest.raises(TypeError, match="records"):
        _C.eventlog_replay(np.zeros(3, dtype=np.int64), 0, 0, 0, 1, 0, [])
    with pytest.raises(TypeError, match="records"):
        _C.eventlog_replay(ev[::2], 0, 0, 0, 1, 0, [])
    with pytest.raises(TypeError, match="queries"):
        _C.eventlog_replay(ev, 0, 0, 0, 1, 0, (1,))
    with pytest.raises(ValueError, match="nrows"):
        _C.eventlog_replay(ev, 0, 0, 0, 1, -1, [])
    with pytest.raises(TypeError, match="7 arguments"):
        _C.eventlog_replay(ev, 0)
    with pytest.raises(OverflowError):
        _C.eventlog_replay(ev, 0, 0, 0, 1, 0, [-1])


def test_names_of_a_hand_log():
    """Live at the peak: A (allocated at index 12, next event 15) and B (13, none). Walks:
    one at index 14 names A and a storage P made before the log; one at 11 (before A was
    allocated) also names A's address, wrongly for this allocation, and Q, freed after the
    peak at index 20 (first event: a free of 64 B). R has no event and is not counted now."""
    no = NO_NEXT
    live = np.array([[0xA0, 100, 0, 12, 15], [0xB0, 50, 0, 13, no]], dtype=np.int64)
    a_late, a_early = ("a", "gradient", None, None, None), ("old a", "gradient", None, None, None)
    p, q, r = (("p", "parameter", None, None, None), ("q", "optimizer state", None, None, None),
               ("r", "buffer", None, None, None))  # fmt: skip
    snapshots = [(14, {0xA0: a_late, 0x10: p, 0x30: r}), (11, {0xA0: a_early, 0x20: q})]
    queries = [0xA0, 0x10, 0x20, 0x30]
    firsts = np.array([[2, 100, 12], [-1, 0, 0], [9, -64, 20], [-1, 0, 0]], dtype=np.int64)
    named, before = _C.eventlog_names(live, snapshots, queries, firsts, 3, {0x10: 400, 0x30: -1})
    assert named == [a_late, None]
    assert before == [(p, 400), (q, 64)]


def test_names_refuses_bad_input():
    live = np.zeros((0, 5), dtype=np.int64)
    firsts = np.zeros((1, 3), dtype=np.int64)
    with pytest.raises(TypeError, match="6 arguments"):
        _C.eventlog_names(live)
    with pytest.raises(TypeError, match="expects"):
        _C.eventlog_names([], [], [0], firsts, 0, {})
    with pytest.raises(ValueError, match="not what eventlog_replay"):
        _C.eventlog_names(live, [], [], firsts, 0, {})
    with pytest.raises(TypeError, match="pairs"):
        _C.eventlog_names(live, [(1, 2, 3)], [0], firsts, 0, {})
    with pytest.raises(KeyError, match="not among the queries"):
        _C.eventlog_names(live, [(1, {5: None})], [0], firsts, 0, {})
