"""Parse and format byte sizes.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (kB, MB,
GB, TB) are powers of 1000, as in IEC 80000-13. Parsing accepts both; output
is binary by default and always carries its unit.
"""

import math
import re

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


def parse(size):
    """Return the number of bytes in ``size`` as an int.

    ``size`` is a non-negative int, or a string such as "64 MiB", "1.5GB",
    "512 kB", "0 B" or "4096". Fractions of a byte round to the nearest byte.
    Raises UnitError (a ValueError) listing the accepted forms.
    """
    if isinstance(size, bool):
        raise UnitError(f"cannot parse size {size!r}: expected {_ACCEPTED}")
    if isinstance(size, int):
        if size < 0:
            raise UnitError(f"size must not be negative, got {size}")
        return size
    if isinstance(size, float):
        if not math.isfinite(size) or size < 0:
            raise UnitError(f"size must be a finite non-negative number, got {size!r}")
        return round(size)
    if not isinstance(size, str):
        raise UnitError(f"cannot parse size {size!r} of type {type(size).__name__}: expected {_ACCEPTED}")
    m = _SIZE_RE.match(size)
    if m is None:
        raise UnitError(f"cannot parse size {size!r}: expected {_ACCEPTED}")
    number, exponent, unit = m.groups()
    factor = _LOOKUP.get(unit.lower())
    if factor is None:
        raise UnitError(f"unknown unit {unit!r} in {size!r}: expected {_ACCEPTED}")
    value = float(number) * (10 ** int(exponent) if exponent else 1)
    if "." not in number and not exponent:
        return int(number) * factor
    return round(value * factor)


def format(nbytes, unit=None, binary=True, precision=1):
    """Format a byte count with its unit, e.g. ``format(1536) == '1.5 KiB'``.

    ``unit`` forces one unit ("MiB", "MB", "B"...); otherwise the largest unit
    that keeps the number >= 1 is chosen among the binary (default) or decimal
    ones. Negative counts keep their sign.
    """
    nbytes = int(nbytes)
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


def format_delta(nbytes, **kwargs):
    """Like format() but always signed: '+1.5 KiB', '-12 B', '+0 B'."""
    text = format(nbytes, **kwargs)
    return text if text.startswith("-") else "+" + text
