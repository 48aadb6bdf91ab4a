"""Noise calibration and noise samplers for the Laplace and Gaussian mechanisms.

* ``laplace_scale``: the Laplace mechanism, b = Delta_1 / epsilon (Dwork et al. 2006; the
  label-DP source document uses it with Delta_1 = 2 for one-hot labels).
* ``gaussian_sigma``: the classic Gaussian mechanism, sigma = sqrt(2 ln(1.25/delta)) Delta_2 /
  epsilon (Dwork & Roth 2014, Thm. A.1; PixelDP's ``_dp_mult``). Its proof needs epsilon <= 1,
  so larger epsilons are refused rather than silently given a wrong guarantee.
* ``analytic_gaussian_sigma``: the exact calibration of Balle & Wang (2018, Thm. 8), valid for
  every epsilon > 0: the smallest sigma whose privacy profile
  ``gaussian_delta(sigma, eps, Delta)`` does not exceed delta.
* samplers that add noise to a tensor with an explicit ``torch.Generator``.

Every function validates its inputs and raises ``ValueError`` naming the parameter.
"""

from __future__ import annotations

import math

import torch
from scipy.optimize import brentq
from scipy.stats import norm

from dpmech import _validate as v

__all__ = [
    "laplace_scale",
    "gaussian_sigma",
    "analytic_gaussian_sigma",
    "gaussian_delta",
    "laplace_noise",
    "gaussian_noise",
    "add_laplace_noise",
    "add_gaussian_noise",
]


def laplace_scale(epsilon: float, sensitivity: float) -> float:
    """Scale b of the Laplace mechanism: (epsilon, 0)-DP for L1 sensitivity ``sensitivity``."""
    epsilon = v.positive("epsilon", epsilon)
    sensitivity = v.positive("sensitivity", sensitivity)
    return sensitivity / epsilon


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Classic Gaussian mechanism: sigma = sqrt(2 ln(1.25/delta)) * sensitivity / epsilon.

    (epsilon, delta)-DP only for epsilon <= 1 (Dwork & Roth 2014, Thm. A.1); for larger
    epsilon use :func:`analytic_gaussian_sigma`.
    """
    epsilon = v.positive("epsilon", epsilon)
    delta = v.open_unit("delta", delta)
    sensitivity = v.positive("sensitivity", sensitivity)
    if epsilon > 1.0:
        raise ValueError(
            f"epsilon must be <= 1 for the classic Gaussian mechanism (got {epsilon}); "
            "use analytic_gaussian_sigma for epsilon > 1"
        )
    return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity / epsilon


def _gaussian_delta_unit(sigma: float, epsilon: float) -> float:
    """Privacy profile of N(0, sigma^2) noise for sensitivity 1 (Balle & Wang 2018, Thm. 8).

    delta(eps) = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma),
    with the second term computed in log space so large epsilons do not overflow.
    """
    a = 1.0 / (2.0 * sigma)
    b = epsilon * sigma
    first = norm.cdf(a - b)
    second = math.exp(epsilon + norm.logcdf(-a - b))
    return max(0.0, first - second)


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """Exact delta at which N(0, sigma^2) noise on an L2-``sensitivity`` query is epsilon-DP.

    Balle & Wang (2018), Theorem 8: the tight privacy profile of the Gaussian mechanism.
    """
    sigma = v.positive("sigma", sigma)
    epsilon = v.non_negative("epsilon", epsilon)
    sensitivity = v.positive("sensitivity", sensitivity)
    return _gaussian_delta_unit(sigma / sensitivity, epsilon)


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Analytic Gaussian mechanism (Balle & Wang 2018, Alg. 1 / Thm. 8): the smallest sigma
    with ``gaussian_delta(sigma, epsilon, sensitivity) <= delta``; valid for any epsilon > 0.

    The profile is strictly decreasing in sigma, so the root is bracketed and found by Brent's
    method to a relative tolerance of 1e-12.
    """
    epsilon = v.positive("epsilon", epsilon)
    delta = v.open_unit("delta", delta)
    sensitivity = v.positive("sensitivity", sensitivity)

    def excess(log_sigma: float) -> float:
        return _gaussian_delta_unit(math.exp(log_sigma), epsilon) - delta

    lo, hi = -10.0, 10.0
    while excess(lo) < 0:  # sigma so small that even it is private enough (tiny deltas only)
        lo -= 10.0
    while excess(hi) > 0:
        hi += 10.0
    log_sigma = brentq(excess, lo, hi, xtol=1e-14, rtol=1e-12, maxiter=500)
    sigma = math.exp(log_sigma)
    # brentq may land a hair below the root; step up until the constraint provably holds.
    while _gaussian_delta_unit(sigma, epsilon) > delta:
        sigma *= 1.0 + 1e-12
    return sigma * sensitivity


def _check_generator(generator) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            f"generator must be a torch.Generator (every random draw takes one explicitly), "
            f"got {type(generator).__name__}"
        )
    return generator


def laplace_noise(like: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """I.i.d. Laplace(0, scale) noise shaped like ``like``, drawn from ``generator``.

    Drawn as the difference of two Exp(1) variables times ``scale`` (no log(0) at the edges).
    """
    scale = v.positive("scale", scale)
    generator = _check_generator(generator)
    if not like.is_floating_point():
        raise ValueError(f"like must be a floating-point tensor, got {like.dtype}")
    e1 = torch.empty_like(like).exponential_(1.0, generator=generator)
    e2 = torch.empty_like(like).exponential_(1.0, generator=generator)
    return (e1 - e2).mul_(scale)


def gaussian_noise(like: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """I.i.d. N(0, sigma^2) noise shaped like ``like``, drawn from ``generator``."""
    sigma = v.positive("sigma", sigma)
    generator = _check_generator(generator)
    if not like.is_floating_point():
        raise ValueError(f"like must be a floating-point tensor, got {like.dtype}")
    return torch.empty_like(like).normal_(0.0, sigma, generator=generator)


def add_laplace_noise(x: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """``x`` plus Laplace(0, scale) noise (a new tensor; ``x`` is not modified)."""
    return x + laplace_noise(x, scale, generator)


def add_gaussian_noise(x: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``x`` plus N(0, sigma^2) noise (a new tensor; ``x`` is not modified)."""
    return x + gaussian_noise(x, sigma, generator)
