"""memtorch in a Hugging Face transformers Trainer: ``Trainer(..., callbacks=[MemoryCallback()])``.

Importing this module imports transformers (``import memtorch`` never does).
The block opens at ``on_train_begin`` with the Trainer's model and optimizer
(accelerate's AcceleratedOptimizer unwrapped to the torch optimizer it holds),
t.step() runs at each ``on_step_end`` (one optimizer step, after gradient
accumulation), and the block closes at ``on_train_end``: the report is printed
(print_report=True) and the budgets checked (memtorch.BudgetExceeded raised
from ``trainer.train()``). ``callback.report`` is the TrackReport.

The figures of each logging interval (memtorch.integrations.LOG_NAMES: peak,
peak above the step's start, bytes held, leak rate, reserved on CUDA) go into
the Trainer's logs at ``on_log`` (log=True): the ``logs`` dict that every
``report_to`` backend (TensorBoard, W&B, ...) and the console's printer read,
and the entry ``Trainer.log()`` appended to ``state.log_history`` just before.
The reporting callbacks come before the user's in the Trainer's list, so at
``on_train_begin`` the callback moves itself to the front of the list (moving an
item to the front at its own index while the list is iterated skips nothing and
repeats nothing); its ``on_train_end`` runs last (it steps aside, its place
taken by a no-op callback, and runs again at the end of the list, where it takes
its original place back), so that a budget failure raised there skips no other
callback's ``on_train_end`` (TensorBoard's writer is closed first).

transformers calls no callback when training raises: the block is then closed
by the next ``on_train_begin`` (auto_find_batch_size's retry) or by
``callback.close(err)`` with the error train() raised (an out-of-memory error then gets
its report, ``err.memtorch_report``).
"""

import sys

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from . import Session

__all__ = ["MemoryCallback"]


class _Aside(TrainerCallback):
    """Holds MemoryCallback's place in the list while its on_train_end runs at the end: does nothing."""


def _handler_list(callback):
    """The list of the CallbackHandler that is calling ``callback`` now (its call_event frame), or None.

    transformers gives a callback no reference to its Trainer; CallbackHandler.call_event calls each
    callback's method itself, with the handler as its ``self``."""
    frame = sys._getframe(2)  # 0: here, 1: the callback's method, 2: call_event
    handler = frame.f_locals.get("self")
    del frame
    if isinstance(handler, CallbackHandler) and any(c is callback for c in handler.callbacks):
        return handler.callbacks
    return None


class MemoryCallback(TrainerCallback):
    """A transformers TrainerCallback that tracks the training with memtorch.track().

    peak / delta / leak: budgets (sizes as memtorch.units.parse reads them) checked when
    training ends; warmup, modules, timeline, largest: as memtorch.track's;
    print_report: print the report when training ends (to ``file``, default stdout);
    log: put the figures into the Trainer's logs (memtorch.integrations.LOG_NAMES).
    After training: ``report`` (TrackReport); while training: ``tracker``.
    """

    def __init__(self, peak=None, delta=None, leak=None, warmup=1, modules=True, timeline=False, largest=0,
                 print_report=True, file=None, log=True):  # fmt: skip
        self._session = Session(peak, delta, leak, warmup, modules, timeline, largest, print_report, file, log)
        self._place = None  # (the handler's list, our index in it before we moved to the front)

    @property
    def report(self):
        return self._session.report

    @property
    def tracker(self):
        return self._session.tracker

    def close(self, exc=None):
        """Close a block left open by a train() that raised (hooks out); its report is dropped, and the
        callback goes back to its place in the Trainer's list. exc: the exception train() raised: an
        out-of-memory error gets its report of who held the memory (``exc.memtorch_report``, printed once)."""
        self._session.close(failed=True, exc=exc)
        place, self._place = self._place, None
        if place is not None:
            cbs, i = place
            if cbs and cbs[0] is self:
                del cbs[0]
                cbs.insert(i, self)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._session.log:
            cbs = _handler_list(self)
            if cbs is not None and cbs[0] is not self:
                i = next(j for j, c in enumerate(cbs) if c is self)
                self._place = (cbs, i)
                del cbs[i]
                cbs.insert(0, self)  # the items after us keep their indexes: the iteration goes on as it was
            elif cbs is not None and self._place is None:  # first already (a user's list put us there)
                self._place = (cbs, 0)
        self._session.open(model, optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self._session.step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        entry = state.log_history[-1] if state.log_history else None
        # the entry Trainer.log() made of these logs: {**logs, "step": global_step}
        mine = (
            entry is not None and entry.get("step") == state.global_step
            and all(k in entry and entry[k] is v for k, v in logs.items())
        )  # fmt: skip
        figures = self._session.figures()
        logs.update(figures)
        if mine:
            entry.update(figures)

    def on_train_end(self, args, state, control, **kwargs):
        place = self._place
        if place is not None:
            cbs, i = place
            if cbs and cbs[0] is self:  # first: step aside, and run last
                cbs[0] = _Aside()
                cbs.append(self)
                return
            # last now: our place back (the iteration is over: nothing after us)
            self._place = None
            if cbs and cbs[-1] is self and isinstance(cbs[0], _Aside):
                del cbs[-1]
                del cbs[0]
                cbs.insert(i, self)
        self._session.finish()
