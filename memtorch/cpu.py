"""CPU memory counters: exact current and peak bytes of live CPU tensor memory.

PyTorch has no ``memory_allocated`` for the CPU; this module gives it one.

Mechanisms (``mechanism()`` says which one this process uses):

``"libc10-got"`` (Linux x86_64/aarch64 where libc10 imports them, exact)
    The C core patches the two import-table (GOT) entries through which
    PyTorch's CPU allocator in libc10 calls ``posix_memalign`` and ``free``
    (``c10::alloc_cpu`` / ``c10::free_cpu``), as memory profilers do. Every CPU
    storage allocation and free, from any thread, goes through a C hook that
    keeps a pointer -> size table and atomic counters; it never takes the GIL.
    Counted bytes are the bytes PyTorch asked for (a storage's ``nbytes()``),
    not malloc's rounded block sizes.

``"rss-fallback"`` (elsewhere, or forced, approximate: e.g. torch's aarch64
libc10, which links mimalloc and imports no ``posix_memalign``)
    The process's resident set size. It counts everything the process holds,
    not only tensors, and peaks are sampled (on every read, at open and close)
    unless the process-wide high-water mark rose meanwhile, in which case that
    mark is the peak. Every figure from it is labelled approximate:
    ``exact()`` is False and so is ``Scope.exact``.

Counting runs while installed: inside a :class:`Scope` (``memtorch.track()``
opens one) or between :func:`install` and :func:`uninstall`. Installation is
refcounted; the first install zeroes the counters and the last uninstall
restores the original import entries. Exact semantics while installed:

* ``allocated()`` is the bytes of CPU storages allocated since installation
  and not freed yet. Storages allocated before installation are not seen at
  all: freeing them later changes nothing (never counted negative).
* ``peak()`` is the highest ``allocated()`` since installation or the last
  ``reset_peak()``; ``reset_peak()`` never disturbs the peaks of open scopes.
* Outside any installation ``allocated()`` and ``peak()`` are 0 (exact
  mechanism) or the resident set size (fallback).
* Not seen: memory PyTorch does not allocate through libc10's CPU allocator
  (``torch.from_numpy`` buffers, ``mmap``-ed or shared-memory storages,
  oneDNN/MKL scratch space).

Counting keeps going after the first Scope closes. Frees are only seen for
storages allocated while counting, so a block that frees memory allocated
before counting began (the last step's gradients, say) would otherwise report
too high a delta and peak. memtorch therefore holds one installation of its
own from the first Scope on (``keep_counting()``, the default), released by
``stop()`` or at interpreter exit; each Scope still counts the frees it could
not see (``Scope.unseen_frees``/``unseen_bytes``), and reports flag them. Call
``start()`` at start-up to see every storage from the start;
``keep_counting(False)`` (or ``MEMTORCH_CPU_KEEP=0``) restores the original
import entries when the last Scope closes.

Other tools patch the same slots (memray, pytest-memray, sanitizers).
memtorch chains to whatever a slot holds when it patches it, never cuts out a
tool that patched after it when it uninstalls (its hook then only forwards),
and cannot recurse through a tool that chains back to it. memray writes libc's
functions back into every slot when its Tracker stops, memtorch's included:
memtorch checks its slots at every Scope's open and close (and in
``allocated()``/``peak()``, ``check()``); where its hooks are gone it patches
them back on top of what is there, starts its table afresh, and marks every
Scope open meanwhile not exact. ``Scope.caveats`` says so in a sentence, as it
does for what the counters cannot see: allocations by other threads (counted,
process-wide: ``Scope.other_thread_bytes``; a thread that runs Python, such as
a DataLoader's pin-memory thread or a user's thread: torch's intra-op and
inter-op workers, native threads that allocate inside an operator the Python
thread called, are that thread's), processes started or running
during the block (DataLoader workers: batches in shared memory, not seen;
``exact`` is False), frees of memory allocated before counting began. Frees
that cannot be tensor storage (libc10 frees demangled names through its
address-taken ``&free``; c10's allocator aligns to 64 bytes) are not counted
as unseen.

The environment variable ``MEMTORCH_CPU_MECHANISM`` chooses: ``auto``
(default: exact where possible, else the fallback), ``libc10-got`` (exact or
an error) or ``rss`` (always the fallback).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from typing import TYPE_CHECKING, Literal

from . import _C, _torch, units
from .errors import MemtorchError

if TYPE_CHECKING:  # annotations only: importing this module loads no NumPy
    import numpy as np

__all__ = [
    "allocated",
    "peak",
    "reset_peak",
    "exact",
    "mechanism",
    "fallback_reason",
    "install",
    "uninstall",
    "installed",
    "Scope",
    "keep_counting",
    "start",
    "stop",
    "check",
    "baseline",
]

EXACT = "libc10-got"
FALLBACK = "rss-fallback"
# how the caveat of a scope that began counting opens (Scope.caveats); track()'s out-of-memory report
# looks for it among its block's caveats
COUNTING_BEGAN = "Counting began when this block opened"
ENV = "MEMTORCH_CPU_MECHANISM"
KEEP_ENV = "MEMTORCH_CPU_KEEP"
_CHOICES = ("auto", "libc10-got", "rss")

_lock = threading.RLock()
# Fallback state (the exact mechanism keeps its state in C).
_rss_installs = 0
_rss_open = 0
_rss_hwm0 = -1  # high-water mark at the last reset_peak()
_rss_seen = 0  # highest RSS sampled since then
# memtorch's own installation, held from the first Scope on (keep_counting()).
_keep = os.environ.get(KEEP_ENV, "1").strip() not in ("0", "false", "no", "off")
_held = False
_atexit_registered = False


# The one Python owner of _C's allocation-counter family (counters_*, scope_*, eventlog_*): this
# module's Scope and functions call them, and tracking.py and peak.py reach the raw ones they need
# through these names (no other module calls them on _C). Plain references: no wrapper on the
# hooks' path. The module-name family (names_walk, modules_fingerprint, ModuleMarks) is
# tracking.py's, the walker's (_walk, _walker_setup) inspection.py's; _torch.py hands _C torch's
# types and its source folder (_set_types, eventlog_sites_skip) when torch loads.
_counters_serials = _C.counters_serials
_counters_sizes = _C.counters_sizes
_counters_last_failure = _C.counters_last_failure  # the out-of-memory post-mortem (tracking, oom)
_scope_end = _C.scope_end
_eventlog_head = _C.eventlog_head
_eventlog_mark = _C.eventlog_mark
_eventlog_read_all = _C.eventlog_read_all
_eventlog_sites = _C.eventlog_sites
_eventlog_replay = _C.eventlog_replay
_eventlog_names = _C.eventlog_names
_counters_open_scopes = _C.counters_open_scopes


def _choice():
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise MemtorchError(f"{ENV}={value!r} is not one of {', '.join(_CHOICES)}")
    return value


def _resolve():
    """(mechanism, reason the exact one is not used or None).

    The name comes from the C core: the mechanism patched now, or the one it
    found usable (None where libc10 imports no posix_memalign, as torch's
    aarch64 builds with mimalloc): never a name for what is not in use.
    """
    if _C.counters_installed():
        return EXACT, None  # installed = libc10's slots patched (counters_install checked them)
    choice = _choice()
    if choice == "rss":
        return FALLBACK, f"forced by {ENV}=rss"
    _torch.torch()  # libc10 must be loaded to be found
    reason = _C.counters_probe()
    name = _C.counters_mechanism()
    if reason is None and name is not None:
        return name, None
    reason = reason or "no exact CPU allocation counting on this platform"
    if choice == EXACT:
        raise MemtorchError(f"exact CPU counting is unavailable ({ENV}=libc10-got): {reason}")
    return FALLBACK, reason


def mechanism() -> str:
    """"libc10-got" (exact) or "rss-fallback" (approximate): what this process counts with."""
    return _resolve()[0]


def fallback_reason() -> str | None:
    """Why the exact mechanism is not used (str), or None when it is."""
    return _resolve()[1]


def exact() -> bool:
    """True if CPU figures are exact bytes of tensor storage in this process."""
    return mechanism() != FALLBACK


def _rss():
    """Sample the resident set size; raise the fallback peak. Returns bytes."""
    global _rss_seen
    now, _ = _C.counters_rss()
    with _lock:
        if now > _rss_seen:
            _rss_seen = now
    return now


def _rss_peak(hwm0, seen):
    """Peak RSS since the high-water mark was hwm0 and `seen` the highest sample."""
    _, hwm = _C.counters_rss()
    # The process-wide high-water mark only moves on a new all-time high: if it
    # rose, that high happened after hwm0 was read and is the exact peak.
    return max(seen, hwm) if hwm > hwm0 else seen


def install() -> None:
    """Start counting (refcounted). Exact mechanism: patch libc10's imports on the first call."""
    global _rss_installs
    with _lock:
        if mechanism() != FALLBACK:
            _C.counters_install()
        else:
            _rss_installs += 1


def uninstall() -> None:
    """Undo one install(); the last one restores libc10's original import entries."""
    global _rss_installs
    with _lock:
        if _C.counters_installed():
            try:
                _C.counters_uninstall()
            except RuntimeError as e:
                raise MemtorchError(str(e)) from None
        elif _rss_installs:
            _rss_installs -= 1
        else:
            raise MemtorchError("memtorch.cpu.uninstall() without a matching install()")


def keep_counting(on: bool = True) -> None:
    """Keep counting between Scopes (default on): see the module docstring.

    Turning it off releases memtorch's own installation now (restoring the
    original import entries unless something else still counts).
    """
    global _keep
    if not isinstance(on, bool):
        raise TypeError(f"keep_counting() takes a bool, not {type(on).__name__}")
    with _lock:
        _keep = on
        if not on:
            stop()


def start() -> None:
    """Start counting now and keep counting (memtorch's own installation) until stop().

    Unlike install(), needs no matching uninstall(); tensors allocated from now on
    are seen when freed, so later Scopes do not meet unseen frees. Idempotent.
    Does nothing with the fallback mechanism (the resident set needs no start).
    """
    with _lock:
        if mechanism() != FALLBACK:
            _take_hold()


def stop() -> None:
    """Release memtorch's own installation (held since the first Scope or start()). Idempotent."""
    global _held
    with _lock:
        if _held:
            _held = False
            if _C.counters_installed():
                _C.counters_uninstall()


def _take_hold():
    """Take memtorch's own installation once (exact mechanism, under _lock)."""
    global _held, _atexit_registered
    if _held:
        return
    _C.counters_install()
    _held = True
    if not _atexit_registered:
        import atexit

        atexit.register(_release_at_exit)
        _atexit_registered = True


def _release_at_exit():
    global _held
    if _held and _C.counters_installed() and not _C.counters_open_scopes():
        _held = False
        _C.counters_uninstall()


def installed() -> bool:
    """True while counting (some install() or Scope is open)."""
    return bool(_C.counters_installed() or _rss_installs)


def check() -> bool:
    """Check that memtorch's allocation hooks are still in libc10's import slots.

    Another tool that patches the same slots (memray and pytest-memray do, and
    write libc's functions back when they stop) can take them away; then
    nothing is counted. memtorch checks at every Scope's open and close and in
    allocated()/peak(); where the hooks are gone it patches them back on top of
    what is there (so that tool keeps working), starts its table afresh (the
    frees missed meanwhile make the old entries untrue) and marks every open
    Scope not exact. Returns True if the hooks were found gone (and put back).
    """
    return bool(_C.counters_installed() and _C.counters_check())


def allocated() -> int:
    """Bytes of live CPU tensor memory counted now (see the module docstring for exactly what)."""
    if _C.counters_installed():
        _C.counters_check()
        return _C.counters_current()
    if mechanism() == FALLBACK:
        return _rss()
    return 0


def peak() -> int:
    """Highest allocated() since installation or the last reset_peak(), process-wide."""
    if _C.counters_installed():
        _C.counters_check()
        return _C.counters_peak()
    if mechanism() == FALLBACK:
        now = _rss()
        with _lock:
            return max(now, _rss_peak(_rss_hwm0, _rss_seen))
    return 0


def reset_peak() -> None:
    """Set the process-wide peak to allocated(); open Scopes keep their own peaks."""
    global _rss_hwm0, _rss_seen
    if _C.counters_installed():
        _C.counters_reset_peak()
        return
    with _lock:
        _rss_seen, _rss_hwm0 = _C.counters_rss()
        _rss_seen = max(_rss_seen, 0)


_mp_process = None  # multiprocessing.process once something imported it


# How the process counter is read: its pickling state (N,) where itertools still has it
# (deprecated in Python 3.12, with a warning), else its repr "count(N)". Between training
# steps this runs with cold caches, where the repr's formatting costs about 3 times more.
_COUNT_BY_REDUCE = sys.version_info < (3, 12)


def _processes():
    """(multiprocessing's process counter, pids of its live child processes): cheap.

    DataLoader workers (num_workers > 0) hand their batches over in shared
    memory, which the counters do not see. multiprocessing numbers every
    Process it creates (``multiprocessing.process._process_counter``, an
    itertools.count, read without advancing it: its next number, or its repr
    ``count(N)`` where it cannot be read so); persistent workers started
    before a block are among ``multiprocessing.active_children()`` (a
    Process forgets its target once started, so a DataLoader worker cannot
    be told from another child). Called at every Scope's open and close:
    kept to a few attribute reads.
    """
    global _mp_process
    mp = _mp_process
    if mp is None:
        mp = _mp_process = sys.modules.get("multiprocessing.process")
        if mp is None:  # nothing imported multiprocessing: no process was made
            return "", ()
    alive = tuple(p.pid for p in mp.active_children()) if mp._children else ()
    counter = getattr(mp, "_process_counter", "")
    if _COUNT_BY_REDUCE and type(counter) is itertools.count:
        state = counter.__reduce__()[1]
        if len(state) == 1:  # count(N): step 1
            return state[0], alive
    return repr(counter), alive


def _workers_between(procs0, procs1):
    """(processes started, DataLoader workers alive at either end) between two _processes() reads, or ()."""
    started = _started(procs0[0], procs1[0])
    workers = len(set(procs0[1]) | set(procs1[1])) if (procs0[1] or procs1[1]) else 0
    return (started, workers) if (started or workers) else ()


def _exact_close(raw):
    """An exact scope's figures are exact by its scope_end tuple: no table entry lost, its hooks never gone."""
    return raw[8] == 0 and not raw[5]


def _scope_begin_known(timeline, known):
    """Open an exact scope by its own C call while counting is held, after entering ``known``
    ((address, bytes) of storages made before counting began, as Scope._adopt enters them):
    (scope_begin's tuple, the processes now, counters_restarted() now), what Scope._from_calls makes
    a Scope of, later. track()'s blocks open so, and make their Scope only if it is asked for (raises
    RuntimeError where another thread stopped counting meanwhile: then the Scope's own path)."""
    if known:
        _C.counters_adopt([a for a, _ in known], [n for _, n in known])
    return _C.scope_begin(timeline), _processes(), _C.counters_restarted()


def _closed_calls(opening, closing):
    """(start, end, peak, exact, first event, other threads' (bytes, allocations), unseen (frees, bytes))
    of the scope opened and closed by its own calls (``opening``: _scope_begin_known's; ``closing``:
    (scope_end's tuple, the processes then)), as a Scope made of them would read them, without
    making one (track()'s block makes it with its report: Scope._from_calls)."""
    o, c = opening[0], closing[0]
    exact = _exact_close(c) and not _workers_between(opening[1], closing[1])
    return c[0], c[1], c[2], exact, o[4], (c[6], c[7]), (c[9] - o[6], c[10] - o[7])


class _CallScope:
    """An exact scope opened and closed by its own C calls while counting is held (_scope_begin_known),
    with no Scope object: track()'s blocks and the scopes of their steps, phases and module calls. close()
    is idempotent and returns _closed_calls' figures; scope() makes the Scope that these calls amount to
    (Scope._from_calls), for what only a Scope says (caveats, the figures so far of an open one)."""

    __slots__ = ("_opening", "_closing")

    def __init__(self, timeline=False, known=None):
        self._opening = _scope_begin_known(timeline, known)  # RuntimeError where counting stopped meanwhile
        self._closing = None

    @property
    def start(self):
        return self._opening[0][2]

    @property
    def hooks_lost(self):
        """Closed: whether memtorch's hooks were found gone while it was open."""
        return bool(self._closing[0][5])

    def close(self):
        self.end()
        return _closed_calls(self._opening, self._closing)

    def end(self):
        """close() reading nothing back (its figures come with scope()): whether the hooks were lost."""
        if self._closing is None:
            o = self._opening[0]
            self._closing = (_C.scope_end(o[0], o[1]), _processes())
        return self.hooks_lost

    def scope(self):
        return Scope._from_calls(self._opening, self._closing)


def _started(before, after):
    """Processes created between two _processes() counters (numbers, or reprs "count(N)")."""
    if before == after:
        return 0
    try:
        if not isinstance(before, int):
            before = int(before[6:-1])
        if not isinstance(after, int):
            after = int(after[6:-1])
        return max(after - before, 0)
    except (ValueError, TypeError):  # not the "count(N)" we know: say nothing rather than guess
        return 0


def _baseline_sentence(restart_ns):
    """The sentence for absolute figures after the counters restarted at ``restart_ns`` (0: None)."""
    if not restart_ns:
        return None
    ago = max(_C.monotonic_ns() - restart_ns, 0) / 1e9
    return (
        f"The baseline is unknown since memtorch re-took its allocation hooks {ago:.1f} s ago (another tool, "
        "memray or pytest-memray, had replaced them) and started its table afresh: start, end, peak, "
        "memtorch.cpu.allocated() and the storages at the peak count only what was allocated since, so "
        "these absolute figures are not exact; delta and peak above start are."
    )


def baseline() -> str | None:
    """None when allocated() counts every storage since counting began; else why its baseline
    is unknown (memtorch re-took its hooks from another tool and started its table afresh)."""
    if not _C.counters_installed():
        return None
    _C.counters_check()
    return _baseline_sentence(_C.counters_restarted())


def _plural(n, one, many=None):
    return f"{n} {one if n == 1 else (many or one + 's')}"


class Scope:
    """One counting window with its own start and peak; any number may be open at once.

    ``with Scope() as s: ...`` installs counting (refcounted) and opens the
    window; leaving closes it. ``s.start`` is allocated() when opened,
    ``s.current`` allocated() now (frozen at the close once closed), ``s.peak``
    the highest allocated() while open (absolute, unaffected by other scopes
    and by reset_peak()), ``s.peak_above_start`` = peak - start. With
    ``timeline=True`` every allocation and free while open is logged:
    ``s.timeline()`` returns (times_ns, bytes) int64 arrays, starting with
    (open time, start) and, once closed, ending with (close time, end).

    ``s.caveats`` lists, in plain sentences for a user, what the counters
    could not see during the window (empty when all is well): another tool
    took the allocation hooks (then ``s.exact`` is False), other threads
    allocated (the counters are process-wide), DataLoader worker processes
    ran (their batches come through shared memory; ``s.exact`` is False),
    memory allocated before counting began was freed.
    """

    # What a scope holds before it is opened (class defaults: a scope per block is made
    # cheaply; open() and close() set them on the instance).
    _mechanism = None
    _handle = None
    _start = _end = _peak = 0
    _t0 = _t1 = 0
    _ev0 = 0
    _events = None
    _samples = None
    _hwm0 = -1
    _exact = False
    timeline_dropped: int = 0  # timeline samples the event log dropped (its ring overwritten)
    # Frees the exact counters saw of storages they never saw allocated (made before
    # counting began) while this scope was open, and their usable bytes: when non-zero,
    # delta and peak may be too high.
    unseen_frees: int = 0  # those frees
    unseen_bytes: int = 0  # their usable bytes
    _unseen0 = (0, 0)
    # Integrity: hooks found gone while open, other threads' allocations, processes made /
    # DataLoader workers alive (at open, at close).
    _hook_lost = 0
    _other_bytes = _other_allocs = 0
    _loss_where = None
    _procs0 = _procs1 = None
    _lost_entries = 0
    _lost0 = 0
    _restart = 0  # counters_restarted() at the open: the baseline unknown since then (0: known)
    _fresh = False  # counting began when this scope opened: storages made before it are not counted
    # (address, bytes) of storages made before counting began that the scope's opener knows of (track():
    # the model's and optimizer's), entered into the counters as it opens (_adopt); and their bytes entered
    _known = None
    _adopted = 0
    # False: the event log is recorded while open (timeline=True) for another reader (track()'s report, which
    # reads it whole), and its (times, bytes) arrays are not read again at the close
    _keep_events = True

    def __init__(self, timeline: bool = False) -> None:
        if timeline is not False and timeline is not True:
            raise TypeError(f"Scope(timeline=...) must be a bool, not {type(timeline).__name__}")
        self._want_timeline = timeline
        self._state = "new"

    # -- opening and closing -------------------------------------------------
    def open(self) -> Scope:
        """Open the scope (what ``with`` does); returns self."""
        global _rss_open, _rss_installs
        with _lock:
            if self._state != "new":
                raise MemtorchError("a memtorch.cpu.Scope can be opened only once")
            mech = EXACT if _held else mechanism()  # held: installed, so exact (_resolve)
            if mech != FALLBACK:
                fresh = False  # counting begins with this scope (set below)
                if _held:  # one call: an installation of its own, the scope, the statistics it starts from
                    self._adopt()
                    raw = _C.scope_begin(self._want_timeline)
                else:
                    fresh = not _C.counters_installed()
                    _C.counters_install()  # the first installation patches (and may raise)
                    try:
                        self._adopt()
                        raw = _C.scope_open(self._want_timeline)
                    except BaseException:
                        _C.counters_uninstall()
                        raise
                    stats = _C.counters_stats()
                    raw += (stats[1], stats[4], stats[5])
                    if _keep:
                        _take_hold()
                self._set_open(raw, _processes())
                self._fresh = fresh
                return self
            _rss_installs += 1
            _rss_open += 1
            now = _rss()
            self._start = self._peak = now
            self._hwm0 = _C.counters_rss()[1]
            self._t0 = _C.monotonic_ns()
            self._samples = [(self._t0, now)] if self._want_timeline else None
            self._opened(mech, _processes())
        return self

    def _adopt(self):
        """Counting is on and this scope not open yet: the known storages the counters have not seen
        enter them (none while another scope is open: _C.counters_adopt refuses)."""
        known, self._known = self._known, None
        if known:
            self._adopted = _C.counters_adopt([a for a, _ in known], [n for _, n in known])

    def close(self) -> None:
        """Close the scope and release its share of the installation. Idempotent."""
        global _rss_open, _rss_installs
        if self._state != "open":  # it never opens again once closed
            return
        with _lock:
            if self._state != "open":
                return
            if self._mechanism != FALLBACK:
                # one call: the close, the statistics, the installation given back
                self._set_closed(_C.scope_end(*self._handle), _processes())
                return
            self._end = self._sample()
            self._peak = _rss_peak(self._hwm0, self._peak)
            self._t1 = _C.monotonic_ns()
            if self._samples is not None:
                self._samples.append((self._t1, self._end))
            _rss_open -= 1
            _rss_installs -= 1
            self._closed(_processes())

    # What every open and close ends with, on either mechanism.
    def _opened(self, mech, procs):
        self._procs0 = procs
        self._mechanism = mech
        self._state = "open"

    def _closed(self, procs):
        self._procs1 = procs
        if self._workers_seen():
            self._exact = False
        self._state = "closed"

    # The exact mechanism's open and close from the C core's tuples (scope_begin's, or
    # scope_open's with the statistics added; scope_end's) and the processes at that time:
    # also how track()'s counters-only block makes its Scope from its own calls.
    def _set_open(self, raw, procs, restart=None):
        sid, gen, start, t0, ev0, lost0, unseen0, unseen_b0 = raw
        self._handle = (sid, gen)
        self._unseen0 = (unseen0, unseen_b0)
        self._lost0 = lost0
        self._start = self._peak = start
        self._t0, self._ev0 = t0, ev0
        self._restart = _C.counters_restarted() if restart is None else restart  # read at the open
        self._opened(EXACT, procs)

    def _set_closed(self, raw, procs):
        (self._start, self._end, self._peak, self._t1, ev1, self._hook_lost, self._other_bytes,
         self._other_allocs, lost, unseen, unseen_b) = raw  # fmt: skip
        if self._want_timeline and self._keep_events:
            t, b, self.timeline_dropped = _C.eventlog_read(self._ev0, ev1)
            self._events = (t, b)
        self._lost_entries = lost - self._lost0
        self._exact = _exact_close(raw)
        self.unseen_frees = unseen - self._unseen0[0]
        self.unseen_bytes = unseen_b - self._unseen0[1]
        if self._hook_lost:
            self._loss_where = _C.counters_loss_info()[1]
        self._closed(procs)

    @classmethod
    def _from_calls(cls, opening, closing=None):
        """A Scope from what track()'s own C calls read: open, or closed as well."""
        s = cls()
        s._set_open(*opening)
        if closing is not None:
            s._set_closed(*closing)
        return s

    def __enter__(self) -> Scope:
        return self.open()

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def __del__(self):
        # A scope dropped while open must not keep its C slot (and the
        # interposer) forever.
        try:
            self.close()
        except Exception:
            pass

    # -- figures -------------------------------------------------------------
    def _need_opened(self):
        if self._state == "new":
            raise MemtorchError("this memtorch.cpu.Scope has not been opened yet")

    def _sample(self):
        """Fallback: sample RSS now and raise this scope's sampled peak."""
        now = _rss()
        if now > self._peak:
            self._peak = now
        if self._samples is not None:
            self._samples.append((_C.monotonic_ns(), now))
        return now

    @property
    def mechanism(self) -> str | None:
        self._need_opened()
        return self._mechanism

    @property
    def exact(self) -> bool:
        """True if this scope's figures are exact bytes of tensor storage.

        False with the fallback mechanism, when memtorch's hooks were taken by
        another tool while open, when DataLoader worker processes ran (their
        shared-memory batches are not seen), or when the table ran out of
        memory. ``caveats`` says why.
        """
        self._need_opened()
        if self._mechanism == FALLBACK:
            return False
        if self._state == "closed":
            return self._exact
        return _C.counters_stats()[1] == 0 and not self._live()[3] and not self._workers_seen()

    def _live(self):
        """scope_read() of an open exact scope (checks the hooks first)."""
        _C.counters_check()
        return _C.scope_read(*self._handle)

    def _workers_seen(self):
        """(processes started while open, DataLoader workers alive at open or close)."""
        if self._procs0 is None:
            return ()
        return _workers_between(self._procs0, self._procs1 if self._procs1 is not None else _processes())

    @property
    def other_thread_bytes(self) -> int:
        """Bytes allocated while open by other threads than the one that opened the scope.

        They are in the figures (the counters are process-wide); ``caveats`` says so. Only threads that
        run Python count here (a DataLoader's pin-memory thread, a user's threading.Thread): torch's
        intra-op workers (OpenMP) and inter-op pool (torch.jit.fork) are native threads that allocate
        inside an operator a Python thread called, and their bytes are that thread's, filed under its
        phase and module.
        """
        self._need_opened()
        if self._mechanism == FALLBACK:
            return 0
        return self._other_bytes if self._state == "closed" else self._live()[4]

    @property
    def other_thread_allocations(self) -> int:
        """Number of allocations behind other_thread_bytes."""
        self._need_opened()
        if self._mechanism == FALLBACK:
            return 0
        return self._other_allocs if self._state == "closed" else self._live()[5]

    @property
    def caveats(self) -> list[str]:
        """What these figures could not see, as sentences for a user; [] when all is well."""
        return [text for text, _ in self._caveats()]

    @property
    def baseline(self) -> str | None:
        """None when start, end and peak count every storage since counting began; else a
        sentence: memtorch re-took its hooks (from memray, say) before this scope opened and
        started its table afresh, so absolute figures count only what was allocated since
        (delta and peak_above_start stay exact)."""
        self._need_opened()
        return _baseline_sentence(self._restart) if self._mechanism != FALLBACK else None

    @property
    def why_not_exact(self) -> list[str]:
        """The sentences of ``caveats`` that make the figures not exact ([] when ``exact``)."""
        return [text for text, inexact in self._caveats() if inexact]

    def _caveats(self):
        """[(sentence, whether it makes the figures not exact)]."""
        self._need_opened()
        out = []
        if self._mechanism == FALLBACK:
            out.append((
                "CPU figures are the process's resident set size, not exact bytes of tensor memory "
                f"(exact counting is unavailable: {fallback_reason() or 'see memtorch.cpu'}).", True,
            ))  # fmt: skip
            procs = self._workers_seen()
            if procs:
                out.append((self._workers_sentence(*procs), True))
            return out
        if self._state == "closed":
            lost, other_b, other_n = self._hook_lost, self._other_bytes, self._other_allocs
            unseen_n, unseen_b, entries = self.unseen_frees, self.unseen_bytes, self._lost_entries
            where = self._loss_where
        else:
            _, _, _, lost, other_b, other_n = self._live()
            stats = _C.counters_stats()
            unseen_n, unseen_b = stats[4] - self._unseen0[0], stats[5] - self._unseen0[1]
            entries = max(stats[1] - self._lost0, 0)
            where = _C.counters_loss_info()[1] if lost else None
        if lost:
            found = f" (its import slots pointed into {os.path.basename(where)} instead)" if where else ""
            out.append((
                "Another tool replaced memtorch's allocation hooks in libc10 during this block"
                f"{found}; memray and pytest-memray do this, and put libc's functions back when they "
                "stop. Allocations and frees made meanwhile were not counted, so these figures are not "
                "exact. memtorch has put its hooks back for the blocks that follow.", True,
            ))  # fmt: skip
        if other_n:
            out.append((
                f"{units.format(other_b)} ({_plural(other_n, 'allocation')}) were allocated by other "
                "threads than the one that opened this block. The CPU counters are process-wide, so "
                "these bytes are included in the figures.", False,
            ))  # fmt: skip
        procs = self._workers_seen()
        if procs:
            out.append((self._workers_sentence(*procs), True))
        base = _baseline_sentence(self._restart)
        if base:
            out.append((base, False))
        elif self._fresh and self._adopted:
            out.append((
                f"{COUNTING_BEGAN}: start, end and peak count the storages allocated since "
                f"and the {units.format(self._adopted)} held then by the model and optimizer given to the block "
                "(parameters, buffers, gradients, optimizer state), not other storages made before it (a batch, a "
                "dataset, the state of an optimizer it was not given); delta and peak above start are exact. Call "
                "memtorch.cpu.start() at start-up to count from the start.", False,
            ))  # fmt: skip
        elif self._fresh:
            out.append((
                f"{COUNTING_BEGAN}: start, end and peak count only the storages allocated "
                "since (not the model's parameters or a batch made before it); delta and peak above start are "
                "exact. Call memtorch.cpu.start() at start-up to count from the start.", False,
            ))  # fmt: skip
        if unseen_n:
            before = (
                "before memtorch re-took its allocation hooks (the table started afresh then)" if base
                else "before counting began"
            )
            fix = (
                "Stop the other tool before the first block, or keep it off while measuring." if base
                else "Call memtorch.cpu.start() at start-up to count from the start."
            )
            out.append((
                f"{_plural(unseen_n, 'free')} of memory allocated {before} "
                f"({units.format(unseen_b)} as malloc sized them): delta and peak may be up to that much too "
                f"high. {fix}", False,
            ))  # fmt: skip
        if entries:
            out.append((
                f"{_plural(entries, 'allocation')} could not be recorded (memtorch's pointer table ran "
                "out of memory), so these figures are not exact.", True,
            ))  # fmt: skip
        return out

    @staticmethod
    def _workers_sentence(started, workers):
        what = []
        if started:
            what.append(f"{_plural(started, 'process', 'processes')} started")
        if workers:
            what.append(f"{_plural(workers, 'child process', 'child processes')} running")
        return (
            f"{' and '.join(what).capitalize()} during this block (a DataLoader with num_workers > 0, "
            "for example). Their tensors and the batches they hand over in shared memory are not seen by "
            "the CPU counters, so these figures are not exact."
        )

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    @property
    def start(self) -> int:
        """allocated() when the scope was opened (bytes)."""
        self._need_opened()
        return self._start

    @property
    def current(self) -> int:
        """allocated() now while open; at the close once closed (bytes)."""
        self._need_opened()
        if self._state == "closed":
            return self._end
        if self._mechanism != FALLBACK:
            return self._live()[1]
        return self._sample()

    end = current

    @property
    def peak(self) -> int:
        """Highest allocated() while the scope was open (absolute bytes)."""
        self._need_opened()
        if self._state == "closed":
            return self._peak
        if self._mechanism != FALLBACK:
            return self._live()[2]
        self._sample()
        return _rss_peak(self._hwm0, self._peak)

    @property
    def peak_above_start(self) -> int:
        """peak - start: what the scope itself added at its highest (bytes)."""
        return self.peak - self.start

    @property
    def delta(self) -> int:
        """current - start (bytes)."""
        return self.current - self.start

    def timeline(self) -> tuple[np.ndarray, np.ndarray]:
        """(times_ns, bytes) as int64 NumPy arrays; needs Scope(timeline=True).

        Times are CLOCK_MONOTONIC nanoseconds (time.monotonic_ns() on Linux);
        bytes are allocated() after each event. Events from several threads
        are sorted by time. ``timeline_dropped`` counts events lost to the
        ring buffer's wrap-around (it keeps the latest 131072).
        """
        import numpy as np

        self._need_opened()
        if not self._want_timeline:
            raise MemtorchError("this Scope was opened without timeline=True")
        if self._mechanism == FALLBACK:
            arr = np.array(self._samples, dtype=np.int64).reshape(-1, 2)
            return arr[:, 0].copy(), arr[:, 1].copy()
        if self._state == "closed":
            if not self._keep_events:
                raise MemtorchError("this Scope's timeline was left to another reader (track()'s report)")
            t, b = self._events
            ends = [(self._t0, self._start)], [(self._t1, self._end)]
        else:
            t, b, self.timeline_dropped = _C.eventlog_read(self._ev0, _C.eventlog_head())
            ends = [(self._t0, self._start)], []
        order = np.argsort(t, kind="stable")
        t, b = t[order], b[order]
        head = np.array(ends[0], dtype=np.int64)
        tail = np.array(ends[1], dtype=np.int64).reshape(-1, 2)
        times = np.concatenate([head[:, 0], t, tail[:, 0]])
        values = np.concatenate([head[:, 1], b, tail[:, 1]])
        return times, values

    def __repr__(self):
        if self._state == "new":
            return "<memtorch.cpu.Scope (not opened)>"
        return (
            f"<memtorch.cpu.Scope {self._state} {self._mechanism}: start={self.start} "
            f"current={self.current} peak={self.peak}>"
        )


def _debug_leftovers():
    """What is still open process-wide (empty when clean)."""
    found = []
    n = _C.counters_open_scopes()
    if n:
        found.append(f"{n} CPU counter scope(s) still open")
    k = _C.counters_installed() - (1 if _held else 0)
    if k:
        found.append(f"CPU allocation interposer still installed (refcount {k})")
    if _rss_open:
        found.append(f"{_rss_open} fallback CPU scope(s) still open")
    if _rss_installs:
        found.append(f"fallback CPU counting still installed (refcount {_rss_installs})")
    return found
