"""memtorch's exceptions."""

__all__ = ["MemtorchError", "UnitError", "BudgetExceeded", "DeviceUnavailable"]


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
