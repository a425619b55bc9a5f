"""memtorch beside the training frameworks: one callback added to a Trainer tracks its training.

    trainer = transformers.Trainer(..., callbacks=[memtorch.integrations.transformers.MemoryCallback()])
    trainer = pytorch_lightning.Trainer(..., callbacks=[memtorch.integrations.lightning.MemoryCallback()])

Each submodule imports its framework when it is imported itself, never with
``import memtorch``. The callback opens one track() block when training begins
(the model and the Trainer's optimizer given, wrappers unwrapped), marks a step
boundary after each optimizer step (per-step peaks, the leak judgement), closes
the block when training ends, then prints the report (print_report=True) and
checks the budgets given (peak=, delta=, leak=: memtorch.BudgetExceeded).
"""

import sys

from .. import units

__all__ = ["Session"]


class Session:
    """The track() block of one training run, opened and closed by a framework's callback.

    Not a public entry point of its own: the callbacks of memtorch.integrations.transformers
    and .lightning share it. ``report`` is the TrackReport of the last run that ended."""

    def __init__(self, peak=None, delta=None, leak=None, warmup=1, modules=True, timeline=False, largest=0,
                 print_report=True, file=None):  # fmt: skip

        for name, value in (("peak", peak), ("delta", delta), ("leak", leak)):
            if value is not None:
                units.parse(value)  # a bad budget is refused when the callback is made, not after training
        self.budgets = {"peak": peak, "delta": delta, "leak": leak}
        self.options = dict(warmup=warmup, modules=modules, timeline=timeline, largest=largest)
        self.print_report = bool(print_report)
        self.file = file
        self.tracker = None
        self.report = None

    def open(self, model, optimizer):
        """Open the block (a block left open by a run that raised is closed first, its report dropped)."""
        # lazy: tracking loads _C and NumPy; only this path needs it (importing integrations stays cheap)
        from ..tracking import track

        self.close()
        t = track(model, optimizer=optimizer, **self.options)  # TypeError for a bad optimizer: nothing opened
        t.__enter__()
        self.tracker = t

    def step(self):
        if self.tracker is not None:
            self.tracker.step()

    def close(self, failed=False):
        """Close the block: hooks out, the report kept (not when ``failed``). Safe to call again."""
        t, self.tracker = self.tracker, None
        if t is None:
            return None
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
