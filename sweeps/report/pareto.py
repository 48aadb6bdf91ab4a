"""Pareto fronts of privacy against utility: lower epsilon and higher accuracy are both better."""

from __future__ import annotations

import math
from typing import Sequence


def pareto_front(eps: Sequence[float], acc: Sequence[float]) -> list[int]:
    """Indices of the points no other point dominates (epsilon <= and accuracy >=, one strictly),
    ordered by increasing epsilon; NaN/inf points are never on the front, exact duplicates keep one."""
    pts = [(e, a, i) for i, (e, a) in enumerate(zip(eps, acc)) if math.isfinite(e) and math.isfinite(a)]
    pts.sort(key=lambda p: (p[0], -p[1]))
    front, best = [], -math.inf
    for e, a, i in pts:
        if a > best:
            front.append(i)
            best = a
    return front
