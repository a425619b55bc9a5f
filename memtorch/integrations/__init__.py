"""memtorch beside the training frameworks: one callback added to a Trainer tracks its training.

    trainer = transformers.Trainer(..., callbacks=[memtorch.integrations.transformers.MemoryCallback()])
    trainer = pytorch_lightning.Trainer(..., callbacks=[memtorch.integrations.lightning.MemoryCallback()])

Each submodule imports its framework when it is imported itself, never with
``import memtorch``. The callback opens one track() block when training begins
(the model and the Trainer's optimizer given, wrappers unwrapped), marks a step
boundary after each optimizer step (per-step peaks, the leak judgement), closes
the block when training ends, then prints the report (print_report=True) and
checks the budgets given (peak=, delta=, leak=: memtorch.BudgetExceeded).

With log=True (the default) the callbacks put these figures into the framework's
own logs (transformers: every ``report_to`` backend and ``state.log_history``;
Lightning: the Trainer's loggers), each over the steps since the last time it
logged (one logging interval), in bytes:

    memtorch/peak_bytes                   the highest of the steps' peaks: the bytes held at once
    memtorch/peak_above_step_start_bytes  the highest of the steps' peaks above the bytes held when
                                          each began: what a step adds at most (activations, temporaries)
    memtorch/allocated_bytes              the bytes held at the end of the interval's last step
    memtorch/leak_bytes_per_step          the leak rate so far: the net growth over the judged steps
                                          (after ``warmup``) divided by their number, as the report's
                                          leak.per_step (an int when whole, else a float); absent
                                          until a step is judged
    memtorch/reserved_bytes               CUDA only: the bytes the caching allocator reserved at the
                                          interval's end (torch.cuda's counters, read through memtorch.cuda)

On the CPU the bytes are the exact counters' (memtorch.cpu); on CUDA torch.cuda's,
as the block counts them. torch keeps one peak per process, which memtorch never
resets: a step that stays below an older peak (after the first step, most do) has
its peak sampled at the phases' boundaries, a lower bound (memtorch.cuda.block_peak).
An interval with such a step logs its two peak figures as lower bounds, under their
own names, never as peaks:

    memtorch/peak_at_least_bytes, memtorch/peak_above_step_start_at_least_bytes
"""

import sys
from fractions import Fraction

from .. import units

__all__ = ["LOG_NAMES", "Session"]

# the names the callbacks log (see the module's docstring), in the order they are logged
LOG_NAMES = (
    "memtorch/peak_bytes",
    "memtorch/peak_above_step_start_bytes",
    "memtorch/peak_at_least_bytes",
    "memtorch/peak_above_step_start_at_least_bytes",
    "memtorch/allocated_bytes",
    "memtorch/leak_bytes_per_step",
    "memtorch/reserved_bytes",
)


class Session:
    """The track() block of one training run, opened and closed by a framework's callback.

    Not a public entry point of its own: the callbacks of memtorch.integrations.transformers
    and .lightning share it. ``report`` is the TrackReport of the last run that ended."""

    def __init__(self, peak=None, delta=None, leak=None, warmup=1, modules=True, timeline=False, largest=0,
                 print_report=True, file=None, log=True):  # fmt: skip

        for name, value in (("peak", peak), ("delta", delta), ("leak", leak)):
            if value is not None:
                units.parse(value)  # a bad budget is refused when the callback is made, not after training
        self.budgets = {"peak": peak, "delta": delta, "leak": leak}
        self.options = dict(warmup=warmup, modules=modules, timeline=timeline, largest=largest)
        if not isinstance(log, bool):
            raise TypeError(f"MemoryCallback(log=...) expects True or False, got {log!r}")
        self.print_report = bool(print_report)
        self.file = file
        self.log = log
        self.tracker = None
        self.report = None
        self._logged = 0  # the steps whose figures were logged already

    def open(self, model, optimizer):
        """Open the block (a block left open by a run that raised is closed first, its report dropped)."""
        # lazy: tracking loads _C and NumPy; only this path needs it (importing integrations stays cheap)
        from ..tracking import track

        self.close()
        t = track(model, optimizer=optimizer, **self.options)  # TypeError for a bad optimizer: nothing opened
        t.__enter__()
        self.tracker = t
        self._logged = 0

    def step(self):
        if self.tracker is not None:
            self.tracker.step()

    def figures(self):
        """The figures to log for the steps since the last call ({name: bytes}, names as LOG_NAMES),
        {} when no step ended since (or no block is open, or log=False)."""
        t = self.tracker
        if t is None or not self.log:
            return {}
        # the block's own per-step record (Tracker.step): [(peak, end)] per step, and the bytes held at
        # each boundary (the block's start, then each step's end); read here, nothing added to step()
        series, bounds = t._step_series, t._boundaries
        k, lo = len(series), self._logged
        if k <= lo:
            return {}
        self._logged = k
        lower = any(i in t._step_lower for i in range(lo, k))  # CUDA: a step's peak is a lower bound
        at_least = "_at_least" if lower else ""
        out = {
            f"memtorch/peak{at_least}_bytes": max(p for p, _ in series[lo:k]),
            f"memtorch/peak_above_step_start{at_least}_bytes": max(series[i][0] - bounds[i] for i in range(lo, k)),
            "memtorch/allocated_bytes": series[k - 1][1],
        }
        warm = min(t._warmup, k)
        if k > warm:  # leaks.judge's rate: the judged steps' growths add up to the boundaries' difference
            rate = Fraction(bounds[k] - bounds[warm], k - warm)
            out["memtorch/leak_bytes_per_step"] = int(rate) if rate.denominator == 1 else float(rate)
        if t._kind == "cuda":
            # lazy: memtorch.cuda loads torch; only a CUDA block's logging reads it
            from .. import cuda

            out["memtorch/reserved_bytes"] = cuda.reserved(t._index)
        return out

    def close(self, failed=False, exc=None):
        """Close the block: hooks out, the report kept (not when ``failed``). Safe to call again.

        exc: the exception training ended with, which the block sees leave it as a ``with track()`` would: an
        out-of-memory error gets its report (``exc.memtorch_report``, printed once), and under
        torch.distributed the other ranks are told of the failure."""
        t, self.tracker = self.tracker, None
        if t is None:
            return None
        if exc is not None:
            t.__exit__(type(exc), exc, exc.__traceback__)
        else:
            t.__exit__(None, None, None)
        if failed:
            return None
        self.report = t.report
        return self.report

    def finish(self):
        """The end of training: close, print, check the budgets (memtorch.BudgetExceeded)."""
        report = self.close()
        if report is None:
            return None
        if self.print_report:
            print(report, file=self.file if self.file is not None else sys.stdout)
        if any(v is not None for v in self.budgets.values()):
            report.check(**self.budgets)
        return report
