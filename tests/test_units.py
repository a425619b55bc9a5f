"""memtorch.units: parsing and formatting sizes, binary vs decimal."""

from fractions import Fraction

import pytest

from memtorch import units
from memtorch.errors import UnitError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("64 MiB", 64 * 1024 * 1024),
        ("1.5GB", 1_500_000_000),
        ("512 kB", 512_000),
        ("512 KB", 512_000),
        ("512 KiB", 512 * 1024),
        ("0 B", 0),
        ("4096", 4096),
        ("1 TiB", 1024**4),
        ("2 tb", 2 * 1000**4),
        (" 3 mib ", 3 * 1024**2),
        ("1e3 B", 1000),
        ("0.5 KiB", 512),
        ("7 bytes", 7),
        (1024**2, 1024**2),
        (0, 0),
    ],
)
def test_parse(text, expected):
    assert units.parse(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "64 MiBs", "-1 MiB", "1..5 GB", "64 Mb/s", "ten MB", None, [1], True])
def test_parse_rejects_with_accepted_forms(bad):
    with pytest.raises(ValueError) as info:
        units.parse(bad)
    assert isinstance(info.value, UnitError)
    message = str(info.value)
    assert "KiB" in message and "kB" in message, message


def test_parse_negative_int():
    with pytest.raises(UnitError, match="negative"):
        units.parse(-5)


@pytest.mark.parametrize(
    "nbytes, kwargs, expected",
    [
        (0, {}, "0 B"),
        (1023, {}, "1023 B"),
        (1024, {}, "1.0 KiB"),
        (1536, {}, "1.5 KiB"),
        (407_080, {}, "397.5 KiB"),  # 407080 / 1024 = 397.539...
        (3 * 1024**3, {}, "3.0 GiB"),
        (1_500_000, {"binary": False}, "1.5 MB"),
        (1_500_000, {"unit": "MiB", "precision": 3}, "1.431 MiB"),  # 1.5e6 / 2**20 = 1.4305...
        (-2048, {}, "-2.0 KiB"),
    ],
)
def test_format(nbytes, kwargs, expected):
    assert units.format(nbytes, **kwargs) == expected


def test_format_delta_sign():
    assert units.format_delta(2048) == "+2.0 KiB"
    assert units.format_delta(-12) == "-12 B"
    assert units.format_delta(0) == "+0 B"


def test_format_unknown_unit():
    with pytest.raises(UnitError, match="unknown unit"):
        units.format(1, unit="MiBs")


def test_roundtrip_binary():
    for n in (1, 1023, 1024, 10**6, 2**30 + 7):
        text = units.format(n, precision=12)
        assert abs(units.parse(text) - n) <= 1


# ---------------------------------------------------------------- exactness (issue 10)
def test_exponent_strings_are_exact():
    from memtorch import units

    assert units.parse("1e23") == 10**23  # float("1e23") is 99999999999999991611392
    assert units.parse("1.5e3 kB") == 1_500_000
    assert units.parse("2.5 B") == 2 and units.parse("3.5 B") == 4  # halves to even


def test_huge_sizes_are_a_unit_error():
    from memtorch import units
    from memtorch.errors import UnitError

    for bad in ("1e400", "1e39", 2**200):
        with pytest.raises(UnitError, match="too large"):
            units.parse(bad)


def test_integer_like_numbers_are_accepted():
    import numpy as np

    from memtorch import units

    assert units.parse(np.int64(64)) == 64
    assert units.parse(np.uint32(7)) == 7
    assert units.parse(np.float64(2.0)) == 2


def test_format_never_floors_a_fraction_of_a_byte():
    # a leak of 3,998 B over 1,000 steps is 3.998 B a step, not "3 B"
    assert units.format(Fraction(3998, 1000)) == "3.998 B"
    assert units.format(Fraction(4, 3)) == "≈1.333 B"
    assert units.format_delta(Fraction(-1, 2)) == "-0.5 B"
    assert units.format(Fraction(3 * 1024 * 1024 + 1, 2)) == "1.5 MiB"
    assert units.format(Fraction(8, 2)) == "4 B" and units.format(2048.0) == "2.0 KiB"
    with pytest.raises(UnitError):
        units.format(Fraction(1, 2), unit="XB")
