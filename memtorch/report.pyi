"""Type stubs for memtorch.report (ModelMemory, ModuleRow): what editors and type checkers see.

tests/test_typing.py checks that every public name of the code (memtorch/reports/model.py, which
memtorch.report re-exports) is declared here.
"""

from typing import Any, NamedTuple, Optional

import numpy as np

CATEGORIES: tuple[str, ...]
MODULE_RULE: str

class ModuleRow(NamedTuple):
    name: str
    type: str
    own: int
    subtree: int
    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    alias_of: Optional[str]
    attributes: int
    shared: int

class ModelMemory:
    rows: np.ndarray
    paths: list[str]
    dtypes: list[str]
    devices: list[str]
    root_type: str
    def __init__(
        self,
        rows: np.ndarray,
        paths: list[str],
        dtypes: list[str],
        devices: list[str],
        modules: Any,
        root_type: str = ...,
    ) -> None: ...
    @property
    def module_table(self) -> list[tuple[str, str, int, int]]: ...
    @property
    def total(self) -> int: ...
    @property
    def logical(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def numel(self) -> int: ...
    @property
    def by_dtype(self) -> dict[str, int]: ...
    @property
    def by_device(self) -> dict[str, int]: ...
    @property
    def by_category(self) -> dict[str, int]: ...
    @property
    def trainable(self) -> int: ...
    @property
    def frozen(self) -> int: ...
    @property
    def shared(self) -> list[tuple[str, ...]]: ...
    @property
    def modules(self) -> list[ModuleRow]: ...
    @property
    def outside_modules(self) -> Any: ...
    def to_numpy(self) -> np.ndarray: ...
    def summary(self) -> dict[str, Any]: ...
    def to_text(self, *args: Any, **kwargs: Any) -> str: ...
    def to_html(self, *args: Any, **kwargs: Any) -> str: ...
    def to_dict(self, depth: int | None = None) -> dict[str, Any]: ...
    def plot(self, *args: Any, **kwargs: Any) -> Any: ...
    def _repr_html_(self) -> str: ...
