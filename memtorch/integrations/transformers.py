"""memtorch in a Hugging Face transformers Trainer: ``Trainer(..., callbacks=[MemoryCallback()])``.

Importing this module imports transformers (``import memtorch`` never does).
The block opens at ``on_train_begin`` with the Trainer's model and optimizer
(accelerate's AcceleratedOptimizer unwrapped to the torch optimizer it holds),
t.step() runs at each ``on_step_end`` (one optimizer step, after gradient
accumulation), and the block closes at ``on_train_end``: the report is printed
(print_report=True) and the budgets checked (memtorch.BudgetExceeded raised
from ``trainer.train()``). ``callback.report`` is the TrackReport.

transformers calls no callback when training raises: the block is then closed
by the next ``on_train_begin`` (auto_find_batch_size's retry) or by
``callback.close()``.
"""

from transformers import TrainerCallback

from . import Session

__all__ = ["MemoryCallback"]


class MemoryCallback(TrainerCallback):
    """A transformers TrainerCallback that tracks the training with memtorch.track().

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
        """Close a block left open by a train() that raised (hooks out); its report is dropped."""
        self._session.close(failed=True)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._session.open(model, optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self._session.step()

    def on_train_end(self, args, state, control, **kwargs):
        self._session.finish()
