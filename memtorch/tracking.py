"""STAND-IN track() for developing the pytest plugin; the real one replaces this file.

It follows the interface in HELPERS.md (track(), Tracker, TrackReport) but measures
by hand bookkeeping: a TorchDispatchMode sees every op's output tensors and keeps a
ledger of the storages they use (bytes counted once per storage, dropped when the
last tensor seen on it dies). Deterministic on CPU, slower than the real counters,
blind to allocations that never come out of an op. CUDA uses torch.cuda's counters.
"""

import functools
import heapq
import weakref

from . import _torch

__all__ = ["LeakReport", "TrackReport", "Tracker", "track"]

_open = []  # open trackers, for _debug_leftovers


def _debug_leftovers():
    return [f"open tracker {t!r}" for t in _open]


class LeakReport:
    def __init__(self, per_step, survivors=()):
        self.per_step = per_step
        self.survivors = list(survivors)


class TensorInfo:
    def __init__(self, shape, dtype, nbytes, has_graph):
        self.shape, self.dtype, self.nbytes, self.has_graph = shape, dtype, nbytes, has_graph

    def __repr__(self):
        return f"TensorInfo(shape={self.shape}, dtype={self.dtype}, nbytes={self.nbytes})"


class TrackReport:
    def __init__(self, device, exact, start, end, peak, largest=(), leak=None, reserved_peak=None):
        self.device = device
        self.exact = exact
        self.start = start
        self.end = end
        self.delta = end - start
        self.peak = peak
        self.peak_above_start = peak - start
        self.reserved_peak = reserved_peak
        self.phases = {}
        self.modules = []
        self.timeline = None
        self.leak = leak
        self.largest = list(largest)

    def check(self, peak=None, delta=None, leak=None):
        from .budget import assert_budget

        assert_budget(self, peak=peak, delta=delta, leak=leak)

    def __str__(self):
        from .budget import breakdown

        return breakdown(self)


def _ledger_mode_class():
    torch = _torch.torch()
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Ledger(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = {}  # storage data_ptr -> [nbytes, tensors seen alive, info]
            self.current = 0
            self.peak = 0
            self.largest = []

        def _drop(self, key):
            entry = self.live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[key]
                self.current -= entry[0]

        def _see(self, t, inputs):
            if t.device.type != "cpu" or t.is_meta:
                return
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if key == 0 or nbytes == 0:
                return
            entry = self.live.get(key)
            if entry is None and key in inputs:
                return  # a view or in-place result of a tensor from before the block
            if entry is None:
                info = TensorInfo(
                    tuple(t.shape), str(t.dtype).replace("torch.", ""), nbytes, t.grad_fn is not None
                )
                entry = self.live[key] = [nbytes, 0, info]
                self.current += nbytes
                if self.current > self.peak:
                    self.peak = self.current
                    self.largest = [e[2] for e in heapq.nlargest(5, self.live.values(), key=lambda e: e[0])]
            entry[1] += 1
            weakref.finalize(t, self._drop, key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {
                a.untyped_storage().data_ptr()
                for a in tree_flatten((args, kwargs))[0]
                if isinstance(a, torch.Tensor) and a.device.type == "cpu" and not a.is_meta
            }
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._see(t, inputs)
            return out

    return _Ledger


class Tracker:
    def __init__(self, model=None, optimizer=None, device="auto", timeline=False, modules=True, leaks=True):
        torch = _torch.torch()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = str(torch.device(device))
        self._mode = None
        self._steps = []
        self._report = None
        self._cuda_start = 0

    def _is_cuda(self):
        return self.device.startswith("cuda")

    def __enter__(self):
        torch = _torch.torch()
        if self._is_cuda():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _ledger_mode_class()()
            self._mode.__enter__()
        self._report = None
        _open.append(self)
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
        self._report = self._snapshot()
        _open.remove(self)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            with self:
                return fn(*a, **kw)

        return wrapper

    def _current(self):
        if self._is_cuda():
            return _torch.torch().cuda.memory_allocated(self.device)
        return self._mode.current

    def step(self):
        self._steps.append(self._current())

    def _snapshot(self):
        torch = _torch.torch()
        leak = None
        if len(self._steps) >= 2:
            diffs = [b - a for a, b in zip(self._steps, self._steps[1:])]
            leak = LeakReport(max(diffs))
        if self._is_cuda():
            torch.cuda.synchronize(self.device)
            return TrackReport(
                self.device,
                True,
                self._cuda_start,
                torch.cuda.memory_allocated(self.device),
                torch.cuda.max_memory_allocated(self.device),
                leak=leak,
                reserved_peak=torch.cuda.max_memory_reserved(self.device),
            )
        m = self._mode
        return TrackReport(self.device, False, 0, m.current, m.peak, largest=m.largest, leak=leak)

    @property
    def report(self):
        if self._report is not None:
            return self._report
        return self._snapshot()


def track(model=None, optimizer=None, device="auto", timeline=False, modules=True, leaks=True):
    """Stand-in: see the module docstring."""
    return Tracker(model, optimizer, device, timeline, modules, leaks)
