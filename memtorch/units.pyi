"""Type stubs for memtorch.units (parse and format byte sizes).

tests/test_typing.py checks that every public name of units.py is declared here.
"""

from fractions import Fraction
from typing import Optional, Union

UNITS: dict[str, int]
MAX_SIZE: int

def parse(size: Union[int, float, str]) -> int: ...
def format(nbytes: int, unit: Optional[str] = ..., binary: bool = ..., precision: int = ...) -> str: ...
def format_delta(
    nbytes: int, *, unit: Optional[str] = ..., binary: bool = ..., precision: int = ...
) -> str: ...
def format_rate(rate: Union[int, float, Fraction], signed: bool = ...) -> str: ...
