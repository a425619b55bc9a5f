"""CPU memory counters -- TEMPORARY STAND-IN written on the `track` branch.

The real module (exact counters in C, owned by the counters helper) replaces
this file on merge. This stand-in only offers the same interface so that
memtorch.tracking can be developed and tested:

* allocated() is glibc's heap in use (mallinfo2: ``uordblks + hblkhd``), which
  counts every malloc of the process, not only tensors; elsewhere the RSS.
* peaks are *sampled*: they rise only when someone reads the counters (any
  call to allocated(), a Scope's ``current``/``peak``, opening or closing a
  Scope). exact() is therefore False.
"""

import ctypes
import os
import threading
import time

__all__ = ["allocated", "peak", "reset_peak", "exact", "mechanism", "Scope"]

_lock = threading.Lock()
_open = []  # open Scopes (process-wide, like the real counters)
_peak = 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _load_mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_mallinfo2 = _load_mallinfo2()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _read():
    if _mallinfo2 is not None:
        m = _mallinfo2()
        return int(m.uordblks + m.hblkhd)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _sample():
    """Read the counter and raise the global peak and every open scope's peak."""
    global _peak
    now = _read()
    with _lock:
        if now > _peak:
            _peak = now
        for s in _open:
            s._see(now)
    return now


def allocated():
    """Bytes in use now (stand-in: the whole malloc heap in use)."""
    return _sample()


def peak():
    """Sampled process-wide peak since the last reset_peak()."""
    _sample()
    return _peak


def reset_peak():
    """Reset the global peak to the current value; open scopes keep their own peaks."""
    global _peak
    now = _read()
    with _lock:
        _peak = now


def exact():
    return False


def mechanism():
    return "mallinfo2-standin" if _mallinfo2 is not None else "rss-standin"


class Scope:
    """A counting scope with its own peak (stand-in: sampled)."""

    exact = False

    def __init__(self, timeline=False):
        self._timeline = bool(timeline)
        self._times = []
        self._bytes = []
        self._closed = False
        self._entered = False
        self.start = 0
        self.peak = 0
        self._end = None

    def _see(self, now):
        if now > self.peak:
            self.peak = now
        if self._timeline:
            self._times.append(time.perf_counter_ns())
            self._bytes.append(now)

    def __enter__(self):
        if self._entered:
            raise RuntimeError("a Scope can be entered only once")
        self._entered = True
        now = _read()
        self.start = self.peak = now
        with _lock:
            _open.append(self)
        if self._timeline:
            self._times.append(time.perf_counter_ns())
            self._bytes.append(now)
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def current(self):
        if self._closed:
            return self._end
        return _sample()

    @property
    def peak_above_start(self):
        if not self._closed:
            _sample()
        return self.peak - self.start

    def close(self):
        if self._closed or not self._entered:
            self._closed = True
            return
        self._end = _sample()
        with _lock:
            if self in _open:
                _open.remove(self)
        self._closed = True

    def timeline(self):
        import numpy as np

        return np.asarray(self._times, dtype=np.int64), np.asarray(self._bytes, dtype=np.int64)


def _debug_leftovers():
    with _lock:
        return [f"open Scope started at {s.start} B" for s in _open]
