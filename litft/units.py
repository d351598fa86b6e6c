"""One number style for everything litft prints: counts and rates with thousands separators and no false precision,
parameter counts in M or B with three significant digits, memory in GiB (2^30 bytes) with two decimals, or MiB
below a tenth of a GiB, so that a small figure is never printed as 0.00; fractions as percentages with one decimal,
losses with four."""

from __future__ import annotations

GIB = 2**30
MIB = 2**20


def count(n: int | float | None) -> str:
    """1234567 -> '1,234,567'; None -> 'n/a'."""
    return "n/a" if n is None else f"{round(n):,}"


def rate(per_second: float | None) -> str:
    """A rate (tok/s, samples/s): whole numbers with separators at 100 and above, else three significant digits."""
    if per_second is None:
        return "n/a"
    return f"{per_second:,.0f}" if abs(per_second) >= 100 else f"{per_second:.3g}"


def params(n: int | float) -> str:
    """A parameter count with three significant digits: 1,100,048,384 -> '1.10B', 13,015,900 -> '13.0M', 512 -> '512'."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:#.3g}{unit}" if value < 100 else f"{value:,.0f}{unit}"
    return f"{n:,.0f}"


def gib(value_gib: float | None) -> str:
    """GiB with two decimals ('12.34 GiB'), or MiB below 0.1 GiB ('48.0 MiB'); None -> 'n/a'."""
    if value_gib is None:
        return "n/a"
    if abs(value_gib) < 0.1:
        return f"{value_gib * GIB / MIB:.1f} MiB"
    return f"{value_gib:,.2f} GiB"


def size(n_bytes: int | float) -> str:
    """A size in bytes, as :func:`gib` prints it."""
    return gib(n_bytes / GIB)


def percent(fraction: float | None) -> str:
    """A fraction as a percentage with one decimal: 0.1234 -> '12.3%'; None -> 'n/a'."""
    return "n/a" if fraction is None else f"{fraction * 100:.1f}%"


def loss(value: float | None) -> str:
    """A loss with four decimals ('2.3026'); None -> 'n/a'."""
    return "n/a" if value is None else f"{value:.4f}"
