"""Many ranks: each rank's track() figures gathered over torch.distributed.

    dist.init_process_group("gloo")             # or torchrun; NCCL on CUDA works the same
    with memtorch.track(model, optimizer=opt) as t:
        train_step()
    multi = t.report.gather()                  # a MultiRankReport on rank 0, None elsewhere
    if multi is not None:
        print(multi)                           # a row per rank, max, min, imbalance
        multi.check(peak="2 GiB")              # the budget applies to the rank that peaks highest

Each rank measures its own process with memtorch's counters, exactly as track()
does on one process. gather() then moves the figures (a few hundred bytes of
JSON per rank) with torch.distributed's own all_gather; memtorch has no
transport of its own.

No hang when a rank fails. Before any collective, every rank posts its status
(ready, or "my track() block raised X") in the process group's key-value store,
the one torch.distributed rendezvoused with, and waits until every rank of the
group has posted, at most ``timeout`` seconds. A track() block that ends with an
exception under a process group posts the failure for its rank by itself, so
the other ranks' gather() raises at once naming the rank and its exception,
and every rank raises (the failing one with its own exception) instead of
waiting forever in a collective. A rank that never arrives (hung, exited,
still running) makes the others raise after ``timeout`` seconds, naming it.
Since no collective has been started when these errors are raised, the process
group is still usable afterwards.

Assumptions: every rank of the group calls gather() the same number of times
in the same order (as with any collective). A failure notice from a track()
block goes to the next gather() on the default (world) group, and that gather()
fails on every rank even if the failing rank caught its exception and arrives
(the others may already have read the notice and raised).
"""

import json
import math
import time

from .errors import MemtorchError
from .reports import renders
from .reports.distributed import MultiRankReport, RankReport, _Leak  # the result types' home; old names stay

__all__ = ["MultiRankReport", "RankReport", "gather", "rank_info"]

_PREFIX = "memtorch/gather"
_rounds = {}  # group key -> gather() calls made by this process on that group
_MAX_MODULES = 10  # module rows sent per rank: the ones leaving the most alive


def _dist():
    """torch.distributed, or None when this torch build has no distributed support."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return dist if dist.is_available() else None


def rank_info():
    """{"rank": r, "world_size": n} under an initialised process group, else {}.

    Never imports torch.distributed by itself: a process that has not imported
    it has no process group.
    """
    import sys

    if "torch.distributed" not in sys.modules:
        return {}
    dist = sys.modules["torch.distributed"]
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    except Exception:  # a process group being torn down: no figures rather than an error
        return {}


# ---------------------------------------------------------------------------
# Per-rank figures


def _get(obj, name, default=None):
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _int_or_none(v):
    return None if v is None else int(v)


def _rate_or_none(v):
    """A leak rate for JSON: an int of whole bytes, else a float (never floored)."""
    if v is None:
        return None
    return int(v) if getattr(v, "denominator", 1) == 1 else float(v)


def figures(report):
    """The figures of one rank's TrackReport as a JSON-safe dict (what gather() sends).

    Read from the report's attributes (the TrackReport fields documented in
    memtorch.tracking), so that it does not depend on any other export format.
    """
    phases = {}
    for name, p in (_get(report, "phases") or {}).items():
        phases[name] = {
            "calls": int(_get(p, "calls", 0)),
            "delta": int(_get(p, "delta", 0)),
            "peak": int(_get(p, "peak", 0)),
            "peak_above_start": int(_get(p, "peak_above_start", 0)),
            "seconds": float(_get(p, "seconds", 0.0)),
            "exact": bool(_get(p, "exact", True)),
        }
    mods = [m for m in (_get(report, "modules") or []) if _get(m, "calls", 0)]
    mods.sort(key=lambda m: -int(_get(m, "activation_bytes", 0) or 0))
    modules = [
        {
            "name": _get(m, "name", "") or "",
            "type": _get(m, "type", "") or "",
            "calls": int(_get(m, "calls", 0)),
            "activation_bytes": int(_get(m, "activation_bytes", 0) or 0),
            "peak_above_start": int(_get(m, "peak_above_start", 0) or 0),
        }
        for m in mods[:_MAX_MODULES]
    ]
    leak = _get(report, "leak")
    leak_d = None
    if leak is not None:
        leak_d = {
            "per_step": _rate_or_none(_get(leak, "per_step")),
            "steps": [int(s) for s in (_get(leak, "steps") or [])],
            "warmup": int(_get(leak, "warmup", 0) or 0),
            "leaking": bool(_get(leak, "leaking", False)),
            "survivors": [
                s.describe() if hasattr(s, "describe") else str(s)
                for s in (_get(leak, "survivors") or [])[:5]
            ],
        }
    return {
        "rank": _int_or_none(_get(report, "rank")),
        "world_size": _int_or_none(_get(report, "world_size")),
        "device": str(_get(report, "device", "?")),
        "exact": bool(_get(report, "exact", False)),
        "mechanism": str(_get(report, "mechanism", "")),
        "start": int(_get(report, "start", 0)),
        "end": int(_get(report, "end", 0)),
        "peak": int(_get(report, "peak", 0)),
        "peak_upper": _int_or_none(_get(report, "peak_upper")),
        "reserved_peak": _int_or_none(_get(report, "reserved_peak")),
        "unseen_bytes": int(_get(report, "unseen_bytes", 0) or 0),
        "seconds": float(_get(report, "seconds", 0.0) or 0.0),
        "steps": int(_get(report, "steps", 0) or 0),
        "phases": phases,
        "modules": modules,
        "leak": leak_d,
    }


# ---------------------------------------------------------------------------
# The multi-rank report


# ---------------------------------------------------------------------------
# Status handshake (process group's store) and figures (collectives)


def _group_key(dist, group):
    if group is None or group is dist.group.WORLD:
        return "world", None
    ranks = dist.get_process_group_ranks(group)
    return "g" + "-".join(str(r) for r in ranks), ranks


def _store(dist, group):
    """The key-value store torch.distributed rendezvoused with (for ``group``), or None."""
    c10d = dist.distributed_c10d
    try:
        if group is None or group is dist.group.WORLD:
            return c10d._get_default_store()
        return c10d._get_process_group_store(group)
    except Exception:
        return None


def _failure_text(exc):
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def note_failure(exc):
    """Tell the other ranks' next gather() that this rank's track() block raised ``exc``.

    Called by track() when a block ends with an exception under an initialised
    process group of more than one rank. Never raises (the user's exception
    must propagate unchanged) and never waits.
    """
    try:
        info = rank_info()
        if not info or info["world_size"] < 2:
            return
        dist = _dist()
        store = _store(dist, None)
        if store is None:
            return
        n = _rounds.get("world", 0)
        store.set(f"{_PREFIX}/world/{n}/{info['rank']}", "failed:" + _failure_text(exc))
    except Exception:
        pass


def _handshake(store, prefix, me, ranks, status, timeout):
    """Post ``status`` for rank ``me``; wait until every rank of ``ranks`` posted. {rank: status}.

    A failure this rank's track() posted for this round stays: the other ranks
    may already have read it and raised, so this rank must raise too.
    """
    key = f"{prefix}/{me}"
    if store.check([key]):
        posted = store.get(key).decode("utf-8", "replace")
        if posted.startswith("failed:"):
            status = posted
    store.set(key, status)
    seen = {me: status}
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        for r in ranks:
            if r in seen:
                continue
            key = f"{prefix}/{r}"
            if store.check([key]):
                seen[r] = store.get(key).decode("utf-8", "replace")
        failed = {r: s for r, s in seen.items() if s.startswith("failed:")}
        if failed:
            return seen
        if len(seen) == len(ranks):
            return seen
        if time.monotonic() >= deadline:
            return seen
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _device_for(backend):
    """Where the collective's tensors live: CUDA for NCCL (its only device), else the CPU."""
    import torch

    if str(backend).lower() == "nccl":
        if not torch.cuda.is_available():
            raise MemtorchError("the process group's backend is NCCL but this process has no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(dist, group, payload, device):
    """all_gather of byte strings of different lengths: every rank gets every rank's bytes."""
    import torch

    n = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    width = max(lengths)
    buf = torch.zeros(width, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(device)
    out = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(out, buf, group=group)
    return [bytes(o[:k].cpu().tolist()) for o, k in zip(out, lengths)]


def _own_figures(report):
    """(status, figures or None) for what the user passed: a TrackReport, a Tracker or a RankReport."""
    # a Tracker, told by its class's ``report`` property as memtorch.budget tells it (tracking imports
    # this module: no import back)
    if isinstance(getattr(type(report), "report", None), property):
        failure = getattr(report, "_failure", None)
        if report._report is None and not report._open:
            return "failed:" + (failure or "its track() block has not run or ended with an exception"), None
        report = report.report
    if isinstance(report, RankReport):
        return "ready", report.to_dict()
    if not hasattr(report, "peak") or not hasattr(report, "start"):
        raise TypeError(
            f"memtorch.distributed.gather() takes a TrackReport (t.report) or a Tracker, got {type(report).__name__}"
        )
    return "ready", figures(report)


@renders("gather", "TrackReport")  # TrackReport.gather() reaches this by name (no import up a floor)
def gather(report, group=None, dst=0, timeout=60.0):
    """Gather every rank's figures: a MultiRankReport on ``dst``, None on the other ranks.

    report: this rank's TrackReport (``t.report``) or its Tracker (``t``: a
    block that raised is then reported to the other ranks as such). group: a
    torch.distributed process group (default: the world). dst: the global rank
    that receives the report, or None for every rank. timeout: seconds to wait
    for every rank to arrive (default 60) before raising. Every rank of the
    group must call it. Raises MemtorchError on every rank that arrives when a
    rank's block raised or a rank does not arrive in time.
    """
    dist = _dist()
    if dist is None or not dist.is_initialized():
        raise MemtorchError(
            "memtorch gather() needs an initialised torch.distributed process group, and this process has none: "
            "call torch.distributed.init_process_group(...) first (torchrun sets up its environment)"
        )
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (timeout > 0)
        or math.isinf(timeout)
    ):
        raise MemtorchError(f"gather() timeout must be a positive number of seconds, got {timeout!r}")
    gkey, ranks = _group_key(dist, group)
    if ranks is None:
        ranks = list(range(dist.get_world_size()))
    me = dist.get_rank()
    if me not in ranks:
        raise MemtorchError(f"gather(): this process (rank {me}) is not in the given group (ranks {ranks})")
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int) or dst not in ranks):
        raise MemtorchError(
            f"gather() dst must be one of the group's ranks {ranks} or None (every rank), got {dst!r}"
        )
    status, figs = _own_figures(report)
    store = _store(dist, group)
    n = _rounds.get(gkey, 0)
    _rounds[gkey] = n + 1
    prefix = f"{_PREFIX}/{gkey}/{n}"
    if store is not None:
        try:
            seen = _handshake(store, prefix, me, ranks, status, timeout)
        except Exception as e:
            raise MemtorchError(
                f"gather(): lost contact with the process group's store ({type(e).__name__}: {e})"
            )
        failed = {r: s[len("failed:") :] for r, s in seen.items() if s.startswith("failed:")}
        if failed:
            what = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            raise MemtorchError(
                f"gather() on rank {me}: a rank's track() block raised, no figures gathered ({what})"
            )
        missing = [r for r in ranks if r not in seen]
        if missing:
            # a rank arriving later must not wait in the collective for us: it reads this and raises
            try:
                store.set(
                    f"{prefix}/{me}", f"failed:gave up after {timeout:g} s waiting for rank(s) {missing}"
                )
            except Exception:
                pass
            raise MemtorchError(
                f"gather() on rank {me} timed out after {timeout:g} s: rank(s) {', '.join(map(str, missing))} "
                f"did not call gather() (still running, hung, or exited); rank(s) "
                f"{', '.join(str(r) for r in ranks if r in seen)} did"
            )
        if n > 0:  # every rank is past round n-1 (it finished that round's collective)
            try:
                store.delete_key(f"{_PREFIX}/{gkey}/{n - 1}/{me}")
            except Exception:
                pass
    elif status.startswith("failed:"):  # pragma: no cover - no store: nothing to tell before the collective
        raise MemtorchError(f"gather() on rank {me}: {status[len('failed:') :]}")
    device = _device_for(dist.get_backend(group))
    blobs = _exchange(dist, group, json.dumps(figs).encode(), device)
    if dst is not None and me != dst:
        return None
    gathered = []
    for r, blob in zip(ranks, blobs):
        d = json.loads(blob)
        d["rank"] = r
        gathered.append(RankReport(d))
    return MultiRankReport(gathered)
