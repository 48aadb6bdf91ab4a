import math
import random

from sweeps.report.pareto import pareto_front


def dominated(i, eps, acc):
    return any((eps[j] <= eps[i] and acc[j] >= acc[i]) and (eps[j] < eps[i] or acc[j] > acc[i])
               for j in range(len(eps)))


def test_front_is_exactly_the_non_dominated_points():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        eps = [rng.choice([0.1, 0.5, 1.0, 2.0]) for _ in range(n)]
        acc = [rng.choice([0.2, 0.5, 0.8, 0.9]) for _ in range(n)]
        front = pareto_front(eps, acc)
        assert all(not dominated(i, eps, acc) for i in front)
        kept = {(eps[i], acc[i]) for i in front}
        for i in range(n):  # every non-dominated point is on the front (up to exact duplicates)
            assert dominated(i, eps, acc) or (eps[i], acc[i]) in kept
        assert [eps[i] for i in front] == sorted(eps[i] for i in front)


def test_non_finite_points_are_ignored():
    assert pareto_front([1.0, math.inf, math.nan], [0.5, 0.9, 0.99]) == [0]
