"""memtorch in a Lightning Trainer: ``Trainer(..., callbacks=[MemoryCallback()])``.

Importing this module imports Lightning (``pytorch_lightning``, else
``lightning.pytorch``); ``import memtorch`` never does. The block opens at
``on_train_start`` with the LightningModule and the Trainer's first optimizer
(a LightningOptimizer unwrapped), t.step() runs at each ``on_train_batch_end``,
and the block closes at ``on_train_end``: the report is printed
(print_report=True) and the budgets checked (memtorch.BudgetExceeded raised
from ``trainer.fit()``). An exception in training closes it too
(``on_exception``). ``callback.report`` is the TrackReport.

Automatic optimisation steps with ``optimizer.step(closure)``: track() sees the
closure's forward and backward as the forward and backward phases and the
update after it as the optimizer phase. Validation inside fit() runs in the
block too (forward phases, no backward).
"""

import sys

if "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules:
    from lightning.pytorch import Callback
else:
    try:
        from pytorch_lightning import Callback
    except ImportError:
        from lightning.pytorch import Callback

from . import Session

__all__ = ["MemoryCallback"]


class MemoryCallback(Callback):
    """A Lightning Callback that tracks ``trainer.fit``'s training with memtorch.track().

    peak / delta / leak: budgets (sizes as memtorch.units.parse reads them) checked when
    training ends; warmup, modules, timeline, largest: as memtorch.track's;
    print_report: print the report when training ends (to ``file``, default stdout).
    After training: ``report`` (TrackReport); while training: ``tracker``.
    """

    def __init__(self, peak=None, delta=None, leak=None, warmup=1, modules=True, timeline=False, largest=0,
                 print_report=True, file=None):  # fmt: skip
        self._session = Session(peak, delta, leak, warmup, modules, timeline, largest, print_report, file)

    @property
    def report(self):
        return self._session.report

    @property
    def tracker(self):
        return self._session.tracker

    def close(self):
        """Close a block left open (hooks out); its report is dropped."""
        self._session.close(failed=True)

    def on_train_start(self, trainer, pl_module):
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        self._session.open(pl_module, optimizers[0] if optimizers else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._session.step()

    def on_train_end(self, trainer, pl_module):
        self._session.finish()

    def on_exception(self, trainer, pl_module, exception):
        self._session.close(failed=True)
