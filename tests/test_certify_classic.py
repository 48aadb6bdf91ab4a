"""``certify_calibration: classic`` reproduces the PixelDP reference implementation's certified
sizes (issue 13 point 10): the reference (columbia/pixeldp, utils/robustness.py) searches delta'
over 0.001, 0.002, ..., 0.299 and, for each, eps' <= 1 by bisection (tolerance 0.001), with the
classic Gaussian calibration sqrt(2 ln(1.25/delta')) / eps'."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpmech.robustness.certification import DELTA_GRID_CLASSIC, certified_size


def _mult(d):
    return math.sqrt(2 * math.log(1.25 / d))


# The reference's sizes for a PixelDP net with L = 0.1, epsilon = 1, delta = 0.05 (noise std
# sigma = sqrt(2 ln(1.25/0.05)) * 0.1 / 1, sensitivity 1), computed by hand with the reference's
# procedure (its loop over delta' and its bisection on eps', the oracle below).
L, DP_EPS, DP_DELTA = 0.1, 1.0, 0.05
SIGMA = _mult(DP_DELTA) * L / DP_EPS
REFERENCE = [  # (p_max lower bound, p_sec upper bound, the reference's size)
    (0.99, 0.005, 0.142336),
    (0.9, 0.05, 0.121610),
    (0.7, 0.2, 0.052444),
    (0.6, 0.3, 0.026974),
]


def _reference_size(p_max, p_sec):
    """The reference's loop, as a test oracle (its early exit p_max - delta <= p_sec + delta is
    not part of certified_size: docs/pixeldp.md)."""
    best = 0.0
    for delta in DELTA_GRID_CLASSIC:
        lo, hi, eps = 0.0, 1.0, 0.5
        while lo < eps <= hi:
            size = L * (eps / DP_EPS) * (_mult(DP_DELTA) / _mult(delta))
            if p_max >= math.e ** (2 * eps) * p_sec + (1 + math.e ** eps) * delta:
                best, lo = max(best, size), eps
            else:
                hi = eps
            eps = (lo + hi) / 2
            if hi - lo < 0.001:
                break
    return best


def test_grid_is_the_references():
    assert len(DELTA_GRID_CLASSIC) == 299
    assert DELTA_GRID_CLASSIC[0] == pytest.approx(0.001) and DELTA_GRID_CLASSIC[-1] == pytest.approx(0.299)
    assert np.allclose(np.diff(DELTA_GRID_CLASSIC), 0.001)


@pytest.mark.parametrize("p_max, p_sec, published", REFERENCE)
def test_classic_reproduces_the_reference_sizes(p_max, p_sec, published):
    ours = certified_size([p_max], [p_sec], noise_scale=SIGMA, sensitivity=1.0, norm="l2", calibration="classic")[0]
    assert _reference_size(p_max, p_sec) == pytest.approx(published, abs=1e-6)
    # the reference's bisection stops within 0.001 of the largest eps'; ours is that largest eps'
    assert published <= ours <= published * 1.002


def test_classic_matches_the_oracle_on_random_bounds():
    rng = np.random.default_rng(0)
    p_max = rng.uniform(0.55, 1.0, 12)
    p_sec = rng.uniform(0.0, 1.0, 12) * (p_max - 0.15)
    ours = certified_size(p_max, p_sec, noise_scale=SIGMA, sensitivity=1.0, norm="l2", calibration="classic")
    ref = np.array([_reference_size(a, b) for a, b in zip(p_max, p_sec)])
    assert np.all(ref > 0)
    assert np.all(ours >= ref) and np.all(ours <= ref * 1.01)


def test_analytic_is_unchanged():
    # the exact (Balle & Wang) calibration over the log grid 1e-12 .. 0.5, as before this change
    ours = certified_size([0.99, 0.9], [0.005, 0.05], noise_scale=SIGMA, sensitivity=1.0, norm="l2")
    assert ours == pytest.approx([0.340528, 0.286767], abs=2e-6)
