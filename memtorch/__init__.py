"""memtorch: exact, cheap memory accounting for PyTorch.

    mm = memtorch.inspect(model, optimizer=opt)   # what a model holds
    memtorch.sizeof(batch)                        # any nest of tensors/ndarrays
    with memtorch.track(model) as t: ...          # a tracked training step
    memtorch.cpu.allocated(), memtorch.cuda.peak()

The submodules behind functions are named apart from them (inspection.py holds
inspect(), tracking.py holds track(), mermaid.py holds diagram()) so that importing a submodule never
shadows the function of the same name on the package.

Submodules are imported on first use so that ``import memtorch`` (and the
pytest plugin) stays cheap and never imports torch by itself.
"""

import importlib

__version__ = "0.1.0"

# public name -> (submodule, attribute or None for the submodule itself)
_EXPORTS = {
    "inspect": ("inspection", "inspect"),
    "sizeof": ("inspection", "sizeof"),
    "ModelMemory": ("report", "ModelMemory"),
    "track": ("tracking", "track"),
    "Tracker": ("tracking", "Tracker"),
    "TrackReport": ("tracking", "TrackReport"),
    "assert_budget": ("budget", "assert_budget"),
    "distributed": ("distributed", None),
    "MultiRankReport": ("distributed", "MultiRankReport"),
    "plan": ("estimator.plan", "plan"),
    "fit": ("estimator.fit", "fit"),
    "Fit": ("estimator.fit", "Fit"),
    "capacity": ("estimator.capacity", "capacity"),
    "Capacity": ("estimator.capacity", "Capacity"),
    "units": ("units", None),
    "cpu": ("cpu", None),
    "cuda": ("cuda", None),
    "errors": ("errors", None),
    "MemtorchError": ("errors", "MemtorchError"),
    "BudgetExceeded": ("errors", "BudgetExceeded"),
    "BudgetInconclusive": ("errors", "BudgetInconclusive"),
    "UnitError": ("errors", "UnitError"),
    "DeviceUnavailable": ("errors", "DeviceUnavailable"),
    "advise": ("estimator.advise", "advise"),
    "Advice": ("estimator.advise", "Advice"),
    "display": ("display", None),
    "plot": ("plot", None),
    "estimate": ("estimator.estimate", "estimate"),
    "load_model": ("models", "load_model"),
    "example_inputs": ("models", "example_inputs"),
    "Estimate": ("estimator.estimate", "Estimate"),
    "diagram": ("mermaid", "diagram"),
    "on_oom": ("oom", "on_oom"),
    "OomReport": ("reports.oom", "OomReport"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    try:
        modname, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'memtorch' has no attribute {name!r}") from None
    mod = importlib.import_module(f".{modname}", __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# MEMTORCH_ON_OOM=1: the out-of-memory post-mortem for code with no block, on from the start (memtorch.oom:
# an excepthook; it imports neither torch nor NumPy until an error is reported)
if __import__("os").environ.get("MEMTORCH_ON_OOM", "").strip() not in ("", "0"):
    importlib.import_module(".oom", __name__).on_oom()
