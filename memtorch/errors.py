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


def not_a_module(function, model):
    """The message for ``function``() given something other than an nn.Module; a name or a path (a Hub id, a
    config.json) says how to build the model from it."""
    text = f"{function}() needs a torch.nn.Module, got {type(model).__name__}"
    if isinstance(model, str) or type(model).__name__.endswith("Path"):
        command = function if function in ("estimate", "plan", "fit", "advise", "capacity") else "estimate"
        text += (
            f" {str(model)!r}: a model by Hub id or config.json is built with memtorch.load_model({str(model)!r}) "
            "(on the meta device, no weights), its batch with memtorch.example_inputs(model, batch, seq); "
            f"the command line takes the name itself (memtorch {command} NAME --batch 4 --seq 512)"
        )
    return text
