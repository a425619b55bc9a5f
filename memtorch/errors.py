"""memtorch's exceptions."""

__all__ = ["MemtorchError", "UnitError", "BudgetExceeded", "BudgetInconclusive", "DeviceUnavailable"]


class MemtorchError(Exception):
    """Base class of every error memtorch raises on purpose."""


class UnitError(MemtorchError, ValueError):
    """A size that cannot be parsed (e.g. "64 MiBs")."""


class DeviceUnavailable(MemtorchError, RuntimeError):
    """A device was asked for that this process cannot use (e.g. CUDA without a GPU)."""


class BudgetExceeded(MemtorchError, AssertionError):
    """A measured figure went over its budget.

    ``failures`` is a list of (name, measured_bytes, limit_bytes); ``report`` the
    report the figures come from, ``str()`` gives the one-line verdict per figure
    followed by the breakdown.
    """

    def __init__(self, message, failures=(), report=None):
        super().__init__(message)
        self.failures = list(failures)
        self.report = report


class BudgetInconclusive(BudgetExceeded):
    """A budget that cannot be judged: the figure is only bounded and the limit lies between its bounds.

    A CUDA block that stayed below a peak the device reached before it has only a
    range for its peak (torch's counters keep one global peak); such a budget fails
    with this error, never passes. It is a BudgetExceeded, so ``except
    BudgetExceeded`` still catches every budget failure. ``failures`` as in
    BudgetExceeded: each has ``upper`` (None: no upper bound), ``why`` and ``fix``
    (how to get an exact figure). Raised only when no figure is over budget for sure.
    """
