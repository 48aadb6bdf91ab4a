"""Counts and ranges in words, as a person writes them (issue 34, point 10): ``counted(1, "trial")``
is "1 trial", ``all_of(2, "trial")`` "both trials", ``best_of(1, "trial")`` "the only trial",
``span(8, 8)`` "8" (not "8 to 8"). The console, the report and the parent run's tags use them."""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``noun`` for one, else ``many`` (default ``noun + "s"``)."""
    return noun if n == 1 else (many or noun + "s")


def counted(n: int, noun: str, many: str | None = None) -> str:
    """``"1 trial"``, ``"12 trials"``."""
    return f"{n} {plural(n, noun, many)}"


def all_of(n: int, noun: str, many: str | None = None) -> str:
    """``"the one trial"``, ``"both trials"``, ``"all 12 trials"``."""
    if n == 1:
        return f"the one {noun}"
    if n == 2:
        return f"both {plural(2, noun, many)}"
    return f"all {counted(n, noun, many)}"


def best_of(n: int, noun: str, many: str | None = None) -> str:
    """``"the only trial"`` (nothing was chosen), ``"the best of 12 trials"``."""
    return f"the only {noun}" if n == 1 else f"the best of {counted(n, noun, many)}"


def span(lo: float, hi: float, fmt: str = ".4g") -> str:
    """``"1 to 8"``; a single value when the two are written alike (``"8"``)."""
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a} to {b}"
