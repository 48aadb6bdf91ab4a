"""The Heterogeneous Gaussian Mechanism (HGM) of Phan et al. (IJCAI 2019, arXiv:1906.01444).

Two results of that paper (Sec. 3), implemented here:

* **Theorem 1 (the extended Gaussian bound, epsilon in (0, infinity)).** Adding N(0, sigma^2)
  noise to every coordinate of a query A with L2 sensitivity Delta_A is (epsilon, delta)-DP for
  every epsilon > 0 if

      sigma >= sqrt(2) * Delta_A / (2 epsilon) * (sqrt(s) + sqrt(s + epsilon)),
      s = ln( sqrt(2/pi) / delta ).

  (The authors' code, haiphanNJIT/SecureSGD ``sigmaEGM``, computes exactly this.) Unlike the
  classic sqrt(2 ln(1.25/delta)) Delta / epsilon it has no epsilon <= 1 restriction.
  :func:`egm_sigma`.

* **The heterogeneous mechanism.** The noise N(0, sigma^2 r_k) on coordinate k, with a
  redistribution vector r > 0 of K entries summing to K (so the total variance K sigma^2 is
  that of the homogeneous mechanism), is (epsilon, delta)-DP with sigma from Theorem 1 when
  Delta_A is the sensitivity *of the whitened query* diag(r)^(-1/2) A:

      Delta_A(r) = max_{D, D'} || diag(r)^(-1/2) (A(D) - A(D')) ||_2.

  That is the sound reading (the heterogeneous mechanism on A *is* the homogeneous one on the
  whitened query, followed by the post-processing diag(r)^(1/2)); reading Delta_A as the plain
  L2 sensitivity would under-noise every coordinate with r_k < 1 (docs/secure_sgd.md).
  :func:`hgm_sigma`, :func:`whitened_sensitivity_bound`, :func:`redistribution_vector`,
  :func:`hgm_noise`.

Soundness of Theorem 1 (checked exactly in tests/test_hgm.py and argued in docs/secure_sgd.md):
sigma solves epsilon sigma / Delta - Delta / (2 sigma) = t with t = sqrt(2 s), so the exact delta
of the Gaussian (Balle & Wang 2018, Thm. 8) is at most P[Z > t] (the privacy-loss tail), and the
Mills-ratio bound P[Z > t] <= phi(t) / t = delta / (2 t) <= delta once t >= 1/2; for t < 1/2,
P[Z > t] <= 1/2 < sqrt(2/pi) e^(-1/8) <= delta. So the bound holds for every epsilon > 0 and every
delta < sqrt(2/pi) (for larger delta, s <= 0 and the formula is undefined: refused). It is never
below the analytic Gaussian sigma (the exact minimum), which is what SecureSGD-AGM uses.
"""

from __future__ import annotations

import math

import torch

from dpmech import _validate as v
from dpmech.privacy.mechanisms import analytic_gaussian_sigma

__all__ = [
    "DELTA_MAX",
    "egm_sigma",
    "hgm_sigma",
    "agm_sigma",
    "mechanism_sigma",
    "MECHANISMS",
    "redistribution_vector",
    "whitened_sensitivity_bound",
    "hgm_noise",
]

DELTA_MAX = math.sqrt(2.0 / math.pi)  # Theorem 1 needs s = ln(sqrt(2/pi)/delta) > 0
MECHANISMS = ("hgm", "agm")


def _delta(delta) -> float:
    delta = v.open_unit("delta", delta)
    if delta >= DELTA_MAX:
        raise ValueError(f"delta must be < sqrt(2/pi) = {DELTA_MAX:.6f} for the HGM bound (Theorem 1), got {delta}")
    return delta


def egm_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Theorem 1 of Phan et al. (2019): sigma = sqrt(2) Delta (sqrt(s) + sqrt(s + eps)) / (2 eps),
    s = ln(sqrt(2/pi) / delta); (epsilon, delta)-DP for every epsilon > 0."""
    epsilon = v.positive("epsilon", epsilon)
    delta = _delta(delta)
    sensitivity = v.positive("sensitivity", sensitivity)
    s = math.log(DELTA_MAX / delta)
    return math.sqrt(2.0) * sensitivity * (math.sqrt(s) + math.sqrt(s + epsilon)) / (2.0 * epsilon)


def hgm_sigma(epsilon: float, delta: float, whitened_sensitivity: float) -> float:
    """The HGM's sigma (Phan et al. 2019, the heterogeneous mechanism with Theorem 1's bound):
    the base scale of N(0, sigma^2 r) noise, for the sensitivity of the whitened query
    diag(r)^(-1/2) A (:func:`whitened_sensitivity_bound`); equals :func:`egm_sigma` for r = 1."""
    return egm_sigma(epsilon, delta, whitened_sensitivity)


def agm_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The analytic Gaussian mechanism (Balle & Wang 2018, Thm. 8): the smallest valid sigma."""
    return analytic_gaussian_sigma(epsilon, delta, sensitivity)


def mechanism_sigma(mechanism: str, epsilon: float, delta: float, sensitivity: float) -> float:
    """sigma of ``mechanism`` ('hgm': Theorem 1, 'agm': Balle & Wang) for L2 ``sensitivity``."""
    mechanism = v.choice("mechanism", mechanism, MECHANISMS)
    fn = hgm_sigma if mechanism == "hgm" else agm_sigma
    return fn(epsilon, delta, sensitivity)


def redistribution_vector(weights: torch.Tensor, r_min: float) -> torch.Tensor:
    """A redistribution vector r for the HGM: r >= r_min everywhere and sum(r) = K.

    ``weights`` (any shape, >= 0) says where *more* noise goes (the paper puts more noise on the
    features the loss is most sensitive to); r = r_min + (1 - r_min) K w / sum(w). With all
    weights zero (or r_min = 1) r is all ones, the homogeneous mechanism.
    """
    r_min = v.unit_interval("r_min", r_min, low_open=True)
    if not torch.is_tensor(weights) or not weights.is_floating_point():
        raise ValueError("weights must be a floating-point tensor")
    if weights.numel() == 0 or not torch.isfinite(weights).all() or (weights < 0).any():
        raise ValueError("weights must be a non-empty tensor of finite values >= 0")
    w = weights.detach().double()
    k = w.numel()
    total = w.sum()
    if total <= 0:
        return torch.ones_like(w, dtype=weights.dtype)
    r = r_min + (1.0 - r_min) * k * w / total
    return r.to(weights.dtype)


def whitened_sensitivity_bound(sensitivity: float, r: torch.Tensor) -> float:
    """Delta_A(r) <= Delta_A / sqrt(min_k r_k): the L2 sensitivity of diag(r)^(-1/2) A for a query
    of plain L2 sensitivity ``sensitivity`` (tight when A can move along the smallest-r axis)."""
    sensitivity = v.positive("sensitivity", sensitivity)
    r_min = float(r.min())
    if not r_min > 0:
        raise ValueError(f"r must be > 0 everywhere, got min {r_min}")
    return sensitivity / math.sqrt(r_min)


def hgm_noise(like: torch.Tensor, sigma: float, r: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """N(0, sigma^2 r) noise shaped like ``like`` (r broadcast over the leading batch dims)."""
    sigma = v.positive("sigma", sigma)
    if not isinstance(generator, torch.Generator):
        raise ValueError("generator must be a torch.Generator")
    if tuple(like.shape[like.dim() - r.dim():]) != tuple(r.shape):
        raise ValueError(f"r of shape {tuple(r.shape)} does not match the trailing dims of {tuple(like.shape)}")
    z = torch.empty_like(like).normal_(0.0, sigma, generator=generator)
    return z.mul_(r.to(z.dtype).sqrt())
