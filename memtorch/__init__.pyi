"""Type stubs for the memtorch package: the public API, as editors and type checkers see it.

memtorch/__init__.py exports its names lazily (a module __getattr__ over
_EXPORTS) so that `import memtorch` stays cheap; this stub declares them.
Every name in _EXPORTS must appear here: tests/test_typing.py checks it and
says which line to add.
"""

from typing import Optional, Union

import torch

from . import cpu as cpu
from . import cuda as cuda
from . import errors as errors
from . import units as units
from . import display as display
from . import distributed as distributed
from . import plot as plot
from .estimator.advise import Advice as Advice
from .estimator.advise import advise as advise
from .distributed import MultiRankReport as MultiRankReport
from .models import example_inputs as example_inputs
from .models import load_model as load_model
from .estimator.plan import plan as plan
from .estimator.fit import Fit as Fit
from .estimator.fit import fit as fit
from .estimator.capacity import Capacity as Capacity
from .estimator.capacity import capacity as capacity
from .errors import BudgetExceeded as BudgetExceeded
from .errors import BudgetInconclusive as BudgetInconclusive
from .errors import DeviceUnavailable as DeviceUnavailable
from .errors import MemtorchError as MemtorchError
from .errors import UnitError as UnitError
from .estimator.estimate import Estimate as Estimate
from .estimator.estimate import estimate as estimate
from .mermaid import diagram as diagram
from .report import ModelMemory as ModelMemory
from .tracking import Tracker as Tracker
from .tracking import TrackReport as TrackReport
from .tracking import track as track

__version__: str
__all__: list[str]

def inspect(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = ...) -> ModelMemory:
    """What `model` (and `optimizer`) hold in memory: each storage counted once."""

def sizeof(obj: object) -> ModelMemory:
    """Bytes held by any nest of containers of tensors, arrays, modules or optimizers (``.total``)."""

def assert_budget(
    report: TrackReport,
    peak: Union[int, str, None] = ...,
    delta: Union[int, str, None] = ...,
    leak: Union[int, str, None] = ...,
) -> None:
    """Raise BudgetExceeded if `report` goes over any given limit (bytes, or sizes such as '64 MiB'),
    BudgetInconclusive (a BudgetExceeded) if a figure is only bounded and a limit lies between its bounds."""
from .oom import on_oom as on_oom
from .reports.oom import OomReport as OomReport
