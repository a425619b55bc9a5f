"""memtorch in a Lightning Trainer: ``Trainer(..., callbacks=[MemoryCallback()])``.

Importing this module imports Lightning (``pytorch_lightning``, else
``lightning.pytorch``); ``import memtorch`` never does. The block opens at
``on_train_start`` with the LightningModule and the Trainer's first optimizer
(a LightningOptimizer unwrapped), t.step() runs at each ``on_train_batch_end``,
and the block closes at ``on_train_end``: the report is printed
(print_report=True) and the budgets checked (memtorch.BudgetExceeded raised
from ``trainer.fit()``). An exception in training closes it too
(``on_exception``): an out-of-memory error leaves its report, who held the memory when the allocation
failed, on the exception (``err.memtorch_report``) and prints it once, as ``with memtorch.track()`` does.
``callback.report`` is the TrackReport.

Automatic optimisation steps with ``optimizer.step(closure)``: track() sees the
closure's forward and backward as the forward and backward phases and the
update after it as the optimizer phase. Validation inside fit() runs in the
block too (forward phases, no backward). A training_step that calls
``self(...)``, ``self.model(...)`` or a submodule, with automatic or manual
optimisation, has the same phases and per-pass module rows: the first module of
the model whose forward runs while none of the model's does stands for the model
(see memtorch.tracking).

The figures of each logging interval (memtorch.integrations.LOG_NAMES: peak,
peak above the step's start, bytes held, leak rate, reserved on CUDA) go to the
Trainer's loggers (log=True) with ``logger.log_metrics(figures, step=trainer.global_step)``
every ``log_every_n_steps`` optimizer steps, and once more at ``on_train_end`` for
the steps not logged yet. Not through ``LightningModule.log``: it would make a
tensor of each figure inside the tracked block, and keep it.
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
    print_report: print the report when training ends (to ``file``, default stdout);
    log: send the figures to the Trainer's loggers (memtorch.integrations.LOG_NAMES).
    After training: ``report`` (TrackReport); while training: ``tracker``.
    """

    def __init__(self, peak=None, delta=None, leak=None, warmup=1, modules=True, timeline=False, largest=0,
                 print_report=True, file=None, log=True):  # fmt: skip
        self._session = Session(peak, delta, leak, warmup, modules, timeline, largest, print_report, file, log)
        self._logged_at = None  # the global step logged last

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
        self._logged_at = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._session.step()
        every = getattr(trainer, "log_every_n_steps", 0)
        step = trainer.global_step
        if every and step and step != self._logged_at and step % every == 0:
            self._log(trainer)

    def _log(self, trainer):
        loggers = list(getattr(trainer, "loggers", None) or [])
        figures = self._session.figures() if loggers else {}
        if figures:
            self._logged_at = trainer.global_step
            for logger in loggers:
                logger.log_metrics(figures, step=trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self._log(trainer)  # the steps since the last interval logged
        self._session.finish()

    def on_exception(self, trainer, pl_module, exception):
        # the block sees the error leave it: an out-of-memory error gets its report (exception.memtorch_report)
        self._session.close(failed=True, exc=exception)
