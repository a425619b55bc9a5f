"""Type stubs for memtorch.tracking (track(), Tracker and its reports).

tests/test_typing.py checks that every public name of tracking.py (module level,
and each class's methods, properties and attributes) is declared here. The result types
are dataclasses (memtorch.reports.Record / Report): their fields are declared in memtorch/reports/track.py,
with a comment each; this stub exists for track() and Tracker, whose code carries no types.
"""

import types
from fractions import Fraction
from typing import Any, Callable, Optional, TypeVar, Union

import numpy as np
import torch

from .reports import Record, Report

_F = TypeVar("_F", bound=Callable[..., Any])

PHASES: tuple[str, ...]

class PhaseStats(Record):
    name: str
    calls: int
    delta: int
    peak: int
    peak_above_start: int
    seconds: float
    exact: bool
    why: Optional[str]
    def __init__(self, name: str, calls: int = ..., delta: int = ..., peak: int = ..., peak_above_start: int = ...,
                 seconds: float = ..., exact: bool = ..., why: Optional[str] = ...) -> None: ...

class ModuleStats(Record):
    name: str
    type: str
    calls: int
    activation_bytes: int
    activation_total: int
    peak_above_start: int
    exact: bool
    why: Optional[str]
    recomputed: int
    recomputed_total: int
    recomputed_bytes: int
    note: Optional[str]
    def __init__(self, name: str, type: str, note: Optional[str] = None) -> None: ...

class TensorInfo(Record):
    shape: tuple[Any, ...]
    dtype: str
    device: str
    nbytes: int
    has_graph: bool
    graph_bytes: Optional[int]
    step: Optional[int]
    name: Optional[str]
    ref: Any
    def __init__(
        self,
        tensor: torch.Tensor,
        step: Optional[int] = ...,
        name: Optional[str] = ...,
        graph_bytes: Optional[int] = ...,
    ) -> None: ...
    def describe(self) -> str: ...

class LeakReport(Report):
    steps: list[int]
    warmup: int
    per_step: Optional[Fraction]
    leaking: bool
    survivors: list[TensorInfo]
    exact: bool
    why: Optional[str]
    groups: list[Any]
    notes: list[str]
    steps_after: Optional[int]
    evidence: dict[str, Any]
    def __init__(
        self,
        steps: list[int],
        warmup: int,
        survivors: list[TensorInfo],
        exact: bool,
        groups: Any = ...,
        notes: Any = ...,
        steps_after: Optional[int] = ...,
        why: Optional[str] = ...,
    ) -> None: ...
    def budget_bounds(self) -> tuple[Optional[Fraction], Optional[Fraction], Optional[str], Optional[str]]: ...
    def plot(self, *args: Any, **kwargs: Any) -> Any: ...
    def to_text(self) -> str: ...
    def to_html(self) -> str: ...
    def _repr_html_(self) -> str: ...

class TrackReport(Report):
    device: str
    exact: bool
    mechanism: Optional[str]
    start: int
    end: int
    delta: int
    peak: int
    peak_above_start: int
    peak_upper: Optional[int]
    reserved_peak: Optional[int]
    phases: dict[str, PhaseStats]
    modules: list[ModuleStats]
    timeline: Optional[tuple[np.ndarray, np.ndarray]]
    leak: Optional[LeakReport]
    largest: list[TensorInfo]
    seconds: float
    steps: int
    live: bool
    unseen_frees: int
    unseen_bytes: int
    at_peak: Any
    caveats: list[Any]
    step_series: list[Any]
    marks: Any
    rank: Optional[int]
    world_size: Optional[int]
    baseline: Optional[str]
    absolute_exact: bool
    def __init__(
        self,
        device: str,
        exact: bool,
        mechanism: Optional[str],
        start: int,
        end: int,
        peak: int,
        peak_upper: Optional[int] = ...,
        reserved_peak: Optional[int] = ...,
        seconds: float = ...,
        steps: int = ...,
        live: bool = ...,
        caveats: list[str] = ...,
        baseline: Optional[str] = ...,
        unseen_frees: int = ...,
        unseen_bytes: int = ...,
        rank: Optional[int] = ...,
        world_size: Optional[int] = ...,
        step_series: list[Any] = ...,
        leak: Optional[LeakReport] = ...,
        timeline: Optional[tuple[np.ndarray, np.ndarray]] = ...,
        marks: Any = ...,
    ) -> None: ...
    def budget_bounds(self, name: str) -> Optional[tuple[Any, Any, Optional[str], Optional[str]]]: ...
    def check(
        self,
        peak: Union[int, str, None] = ...,
        delta: Union[int, str, None] = ...,
        leak: Union[int, str, None] = ...,
    ) -> None: ...
    def to_dict(self) -> dict[str, Any]: ...
    def to_text(self, *args: Any, **kwargs: Any) -> str: ...
    def to_html(self, *args: Any, **kwargs: Any) -> str: ...
    def plot(self, *args: Any, **kwargs: Any) -> Any: ...
    def gather(self, *args: Any, **kwargs: Any) -> Any: ...
    def _repr_html_(self) -> str: ...

def module_figures(times: Any, nbytes: Any, starts: Any, ends: Any, known_from: Any = ...) -> Any: ...

class Tracker:
    def __init__(
        self,
        model: Optional[torch.nn.Module] = ...,
        optimizer: Optional[Any] = ...,
        device: Union[str, torch.device] = ...,
        timeline: bool = ...,
        modules: bool = ...,
        leaks: bool = ...,
        warmup: int = ...,
        largest: int = ...,
    ) -> None: ...
    def __enter__(self) -> Tracker: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[types.TracebackType],
    ) -> None: ...
    def __call__(self, fn: _F) -> _F: ...
    @property
    def report(self) -> TrackReport: ...
    def step(self) -> None: ...
    def watch(
        self, model: Optional[torch.nn.Module] = ..., optimizer: Optional[Any] = ...
    ) -> Tracker: ...
    def to_text(self) -> str: ...
    def to_html(self) -> str: ...
    def _repr_html_(self) -> str: ...

def track(
    model: Optional[torch.nn.Module] = ...,
    optimizer: Optional[Any] = ...,
    device: Union[str, torch.device] = ...,
    timeline: bool = ...,
    modules: bool = ...,
    leaks: bool = ...,
    warmup: int = ...,
    largest: int = ...,
) -> Tracker: ...
