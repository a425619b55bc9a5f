"""Parse and format byte sizes.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (kB, MB,
GB, TB) are powers of 1000, as in IEC 80000-13. Parsing accepts both; output
is binary by default and always carries its unit.
"""

from __future__ import annotations

import decimal
import math
import numbers
import operator
import re
from fractions import Fraction
from typing import Any

from .errors import UnitError

__all__ = ["parse", "format", "format_delta", "UNITS"]

UNITS = {
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "kB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}
# Case-insensitive lookup; "KB" is read as the decimal kilobyte, like "kB".
_LOOKUP = {k.lower(): v for k, v in UNITS.items()}
_LOOKUP.update({"bytes": 1, "byte": 1, "": 1})

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")

_ACCEPTED = (
    "an int of bytes, or a number with a unit: B, KiB, MiB, GiB, TiB (1024-based) "
    "or kB, MB, GB, TB (1000-based), e.g. '64 MiB', '1.5GB', '512 kB', '0 B'"
)


# Sizes past this are refused: no memory is that large, and a typo (1e400)
# should say so rather than become a 400-digit int.
MAX_SIZE = 2**128


def _checked(n, size):
    if n < 0:
        raise UnitError(f"size must not be negative, got {size!r}")
    if n >= MAX_SIZE:
        raise UnitError(f"size {size!r} is too large: memtorch accepts sizes below 2**128 bytes")
    return n


def parse(size: int | float | str) -> int:
    """Return the number of bytes in ``size`` as an int.

    ``size`` is a non-negative integer (int, numpy.int64 or any integer-like
    number), a finite non-negative float, or a string such as "64 MiB",
    "1.5GB", "512 kB", "1e23", "0 B" or "4096". Strings are read exactly (as
    decimals, never through a float): "1e23" is 10**23. Fractions of a byte
    round to the nearest byte (halves to even). Raises UnitError (a
    ValueError) listing the accepted forms.
    """
    if isinstance(size, bool):
        raise UnitError(f"cannot parse size {size!r}: expected {_ACCEPTED}")
    if isinstance(size, numbers.Integral) or (
        hasattr(type(size), "__index__") and not isinstance(size, (str, bytes, float))
    ):
        try:
            n = operator.index(size)
        except TypeError:
            raise UnitError(f"cannot parse size {size!r} of type {type(size).__name__}: expected {_ACCEPTED}") from None
        return _checked(n, size)
    if isinstance(size, numbers.Real) and not isinstance(size, str):
        value = float(size)
        if not math.isfinite(value) or value < 0:
            raise UnitError(f"size must be a finite non-negative number, got {size!r}")
        return _checked(round(value), size)
    if not isinstance(size, str):
        raise UnitError(f"cannot parse size {size!r} of type {type(size).__name__}: expected {_ACCEPTED}")
    m = _SIZE_RE.match(size)
    if m is None:
        raise UnitError(f"cannot parse size {size!r}: expected {_ACCEPTED}")
    number, exponent, unit = m.groups()
    factor = _LOOKUP.get(unit.lower())
    if factor is None:
        raise UnitError(f"unknown unit {unit!r} in {size!r}: expected {_ACCEPTED}")
    if exponent and abs(int(exponent)) > 60:
        # 10**60 is past MAX_SIZE already; refused before any arithmetic.
        if int(exponent) > 0 and decimal.Decimal(number) != 0:
            raise UnitError(f"size {size!r} is too large: memtorch accepts sizes below 2**128 bytes")
        return 0 if int(exponent) < 0 or decimal.Decimal(number) == 0 else _checked(0, size)
    ctx = decimal.Context(prec=200, rounding=decimal.ROUND_HALF_EVEN)
    value = ctx.multiply(decimal.Decimal(number).scaleb(int(exponent or 0), ctx), decimal.Decimal(factor))
    return _checked(int(value.to_integral_value(rounding=decimal.ROUND_HALF_EVEN, context=ctx)), size)


def format(nbytes: int | float | Fraction, unit: str | None = None, binary: bool = True, precision: int = 1) -> str:
    """Format a byte count with its unit, e.g. ``format(1536) == '1.5 KiB'``.

    ``unit`` forces one unit ("MiB", "MB", "B"...); otherwise the largest unit
    that keeps the number >= 1 is chosen among the binary (default) or decimal
    ones. Negative counts keep their sign. A count that is not whole (a per-step
    rate such as ``Fraction(3998, 1000)``) is never floored: under 1 KiB it
    shows up to 3 decimals, with '≈' when they do not hold it exactly.
    """
    if not isinstance(nbytes, int):
        q = Fraction(nbytes)  # floats, Fractions, NumPy integers; NaN and inf raise
        if q.denominator != 1:
            return _format_fraction(q, unit, binary, precision)
        nbytes = int(q)
    if unit is not None:
        if unit not in UNITS:
            raise UnitError(f"unknown unit {unit!r}: expected one of {', '.join(UNITS)}")
        factor = UNITS[unit]
    else:
        choices = ("TiB", "GiB", "MiB", "KiB") if binary else ("TB", "GB", "MB", "kB")
        unit, factor = "B", 1
        for name in choices:
            if abs(nbytes) >= UNITS[name]:
                unit, factor = name, UNITS[name]
                break
    if factor == 1:
        return f"{nbytes} B"
    return f"{nbytes / factor:.{precision}f} {unit}"


def _format_fraction(q, unit, binary, precision):
    """format() of a count that is not a whole number of bytes."""
    if unit is None:
        choices = ("TiB", "GiB", "MiB", "KiB") if binary else ("TB", "GB", "MB", "kB")
        unit = next((name for name in choices if abs(q) >= UNITS[name]), "B")
    elif unit not in UNITS:
        raise UnitError(f"unknown unit {unit!r}: expected one of {', '.join(UNITS)}")
    if unit != "B":
        return f"{float(q / UNITS[unit]):.{precision}f} {unit}"
    sign = "-" if q < 0 else ""
    exact = (abs(q) * 1000).denominator == 1
    text = f"{float(abs(q)):.3f}".rstrip("0").rstrip(".")
    return f"{sign}{'' if exact else '≈'}{text} B"


def format_delta(nbytes: int | float | Fraction, **kwargs: Any) -> str:
    """Like format() but always signed: '+1.5 KiB', '-12 B', '+0 B'."""
    text = format(nbytes, **kwargs)
    return text if text.startswith("-") else "+" + text


def format_rate(rate: int | float | Fraction, signed: bool = True) -> str:
    """A per-step figure (bytes, possibly a fraction of a byte) as text that never reads lower
    than it is: whole bytes as units.format does ('+4 B', '+1.5 MiB'); a fraction under 1 KiB
    with up to 3 decimals, '≈' when those do not hold it exactly ('+3.998 B', '+≈1.333 B')."""
    rate = Fraction(rate)
    if rate.denominator == 1:
        n = int(rate)
        return format_delta(n) if signed else format(n)
    sign = "-" if rate < 0 else ("+" if signed else "")
    a = abs(rate)
    if a < 1024:
        return sign + format(a)  # up to 3 decimals, '≈' when they do not hold it
    return f"{sign}≈{format(round(a))}"
