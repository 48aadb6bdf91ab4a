"""PixelDP certification: Monte Carlo expected scores, eta-confidence bounds, the robustness
test and the largest certified attack size (Lecuyer et al. 2018, Sec. 3.1-3.4 and Sec. 4).

The steps, one function each, in the order of the paper:

1. ``monte_carlo``: n draws of the noise per image (Sec. 3.4, "estimating the expected output");
   the deterministic pre-noise part is computed once per image.
2. ``argmax_bounds`` / ``hoeffding_bounds`` / ``bernstein_bounds``: eta-confidence intervals on
   the expected scores E[f_i(x)], simultaneous over the K classes by Bonferroni (Sec. 3.4 uses
   Hoeffding; the reference also counts argmax labels, for which Clopper-Pearson is exact).
3. ``robust``: Proposition 1, the generalised robustness condition
   E_lb f_k > e^(2 eps) max_{i != k} E_ub f_i + (1 + e^eps) delta.
4. ``certified_size``: the largest attack size L' for which some (eps', delta') with the
   model's fixed noise passes the test (the reference's search over delta' and eps', here with
   the exact Gaussian calibration so eps' > 1 is allowed; docs/pixeldp.md).
5. ``certify`` ties them together per example; ``certified_accuracy`` is
   #(correct and certified size >= T) / N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import log_ndtr, ndtr
from scipy.stats import beta as beta_dist

from dpmech import _validate as v

BOUNDS = ("argmax", "hoeffding", "bernstein")

# delta' values searched for the Gaussian mechanism (the reference searches a grid too).
DELTA_GRID = np.logspace(-12, math.log10(0.5), 60)
# the reference implementation's grid (columbia/pixeldp utils/robustness.py: np.arange(0.001, 0.3,
# 0.001)), searched by calibration "classic" so that it reproduces the reference's sizes
DELTA_GRID_CLASSIC = np.arange(1, 300) / 1000.0


# ----------------------------------------------------------------------------- 1. Monte Carlo


@dataclass
class MonteCarloEstimate:
    """Per-example statistics of n noisy forward passes."""

    counts: np.ndarray      # [N, K] int64, how often each class was the argmax
    mean: np.ndarray        # [N, K] float64, mean softmax score
    sq_mean: np.ndarray     # [N, K] float64, mean squared softmax score (for variances)
    n: int

    @property
    def variance(self) -> np.ndarray:
        """Unbiased sample variance of each class's softmax score."""
        var = (self.sq_mean - self.mean**2) * self.n / max(self.n - 1, 1)
        return np.clip(var, 0.0, None)


def _noisy_draws(model):
    """(pre, draw): ``pre`` is computed once per image, ``draw(h, k)`` returns the logits of k
    noise draws for every row of h, as a [b * k, K] tensor (rows grouped by image)."""
    noise = getattr(model, "noise", None)
    if all(hasattr(model, a) for a in ("pre_noise", "post_noise")) and hasattr(noise, "sample_shape"):
        def draw(h, k):
            b = h.shape[0]
            # draw the noise straight into the [b, k, ...] layout and add g(x) in place: no copy of
            # the repeated pre-noise activations is ever made.
            z = noise.sample_shape((b, k, *h.shape[1:]), h.dtype, h.device)
            z.add_(h.unsqueeze(1))
            return model.post_noise(z.view(b * k, *h.shape[1:]))
        return model.pre_noise, draw

    def draw_generic(x, k):
        b = x.shape[0]
        return model(x.unsqueeze(1).expand(b, k, *x.shape[1:]).reshape(b * k, *x.shape[1:]))
    return (lambda x: x), draw_generic


@torch.no_grad()
def monte_carlo(model: torch.nn.Module, x: torch.Tensor, n: int, *, batch_size: int = 4096,
                progress=None) -> MonteCarloEstimate:
    """Draw the model's noise ``n`` times for every image of ``x`` (Sec. 3.4).

    A model with ``pre_noise``/``noise``/``post_noise`` (``dpmech.models.PixelDPNet``) computes
    the pre-noise part once per image; any other model is simply called ``n`` times (its
    forward pass must be random). ``batch_size`` bounds the rows of one forward pass.
    ``progress`` is called with the number of images done.
    """
    n = v.positive_int("n", n)
    batch_size = v.positive_int("batch_size", batch_size)
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty batch [N, ...], got shape {tuple(x.shape)}")
    pre, draw = _noisy_draws(model)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    counts, means, sq_means = [], [], []
    try:
        # images per chunk so that one chunk covers whole images; draws split if n > batch_size.
        per_chunk = max(1, batch_size // n)
        draws_per_pass = min(n, batch_size)
        for start in range(0, x.shape[0], per_chunk):
            xb = x[start:start + per_chunk].to(device)
            h = pre(xb)
            b = xb.shape[0]
            cnt = None
            s1 = s2 = None
            done = 0
            while done < n:
                k = min(draws_per_pass, n - done)
                logits = draw(h, k).float()
                probs = torch.softmax(logits, dim=1).reshape(b, k, -1)
                top = logits.argmax(dim=1).reshape(b, k)
                K = probs.shape[2]
                c = torch.zeros(b, K, dtype=torch.int64, device=device).scatter_add_(
                    1, top, torch.ones_like(top))
                p1 = probs.double().sum(1)
                p2 = probs.double().pow(2).sum(1)
                cnt = c if cnt is None else cnt + c
                s1 = p1 if s1 is None else s1 + p1
                s2 = p2 if s2 is None else s2 + p2
                done += k
            counts.append(cnt.cpu())
            means.append((s1 / n).cpu())
            sq_means.append((s2 / n).cpu())
            if progress is not None:
                progress(min(start + per_chunk, x.shape[0]))
    finally:
        model.train(was_training)
    return MonteCarloEstimate(torch.cat(counts).numpy(), torch.cat(means).numpy(),
                              torch.cat(sq_means).numpy(), n)


# ----------------------------------------------------------------------------- 2. bounds


def clopper_pearson(k, n, alpha: float):
    """Two-sided Clopper-Pearson interval of level 1 - alpha for k successes in n trials.

    Vectorised over ``k``; uses the beta quantiles (Clopper & Pearson 1934).
    """
    alpha = v.open_unit("alpha", alpha)
    k = np.asarray(k, dtype=np.float64)
    lo = np.where(k > 0, beta_dist.ppf(alpha / 2, k, n - k + 1), 0.0)
    hi = np.where(k < n, beta_dist.ppf(1 - alpha / 2, k + 1, n - k), 1.0)
    return np.nan_to_num(lo, nan=0.0), np.nan_to_num(hi, nan=1.0)


def argmax_bounds(est: MonteCarloEstimate, eta: float):
    """Bounds on E[1{argmax = i}] from argmax counts: Clopper-Pearson at level 1-(1-eta)/K each
    (Bonferroni), so all K intervals hold together with probability >= eta."""
    eta = v.open_unit("eta", eta)
    K = est.counts.shape[1]
    return clopper_pearson(est.counts, est.n, (1.0 - eta) / K)


def hoeffding_bounds(est: MonteCarloEstimate, eta: float):
    """Bounds on E[softmax_i] in [0, 1] by Hoeffding's inequality (PixelDP Sec. 3.4), two-sided,
    Bonferroni over the K classes."""
    eta = v.open_unit("eta", eta)
    K = est.mean.shape[1]
    half = math.sqrt(math.log(2.0 * K / (1.0 - eta)) / (2.0 * est.n))
    return np.clip(est.mean - half, 0, 1), np.clip(est.mean + half, 0, 1)


def bernstein_bounds(est: MonteCarloEstimate, eta: float):
    """Empirical Bernstein bounds (Maurer & Pontil 2009, Thm. 4) on E[softmax_i] in [0, 1]:
    mean +- sqrt(2 V ln(2/a) / n) + 7 ln(2/a) / (3 (n - 1)) with a = (1 - eta) / (2K)."""
    eta = v.open_unit("eta", eta)
    if est.n < 2:
        raise ValueError(f"n must be >= 2 for empirical Bernstein bounds, got {est.n}")
    K = est.mean.shape[1]
    log_term = math.log(2.0 / ((1.0 - eta) / (2.0 * K)))
    half = np.sqrt(2.0 * est.variance * log_term / est.n) + 7.0 * log_term / (3.0 * (est.n - 1))
    return np.clip(est.mean - half, 0, 1), np.clip(est.mean + half, 0, 1)


_BOUND_FNS = {"argmax": argmax_bounds, "hoeffding": hoeffding_bounds, "bernstein": bernstein_bounds}


def top_and_runner_up(lower: np.ndarray, upper: np.ndarray, scores: np.ndarray):
    """Prediction k = argmax of ``scores``; returns (k, lower_k, max_{i != k} upper_i)."""
    k = scores.argmax(axis=1)
    rows = np.arange(len(k))
    lb = lower[rows, k]
    other = upper.copy()
    other[rows, k] = -np.inf
    return k, lb, other.max(axis=1)


# ----------------------------------------------------------------------------- 3. the test


def robust(lower_top, upper_other, epsilon: float, delta: float):
    """PixelDP Proposition 1: E_lb f_k > e^(2 eps) max_{i != k} E_ub f_i + (1 + e^eps) delta."""
    epsilon = v.positive("epsilon", epsilon)
    delta = v.unit_interval("delta", delta, high_open=True)
    lower_top = np.asarray(lower_top, dtype=np.float64)
    upper_other = np.asarray(upper_other, dtype=np.float64)
    return lower_top > math.exp(2 * epsilon) * upper_other + (1 + math.exp(epsilon)) * delta


# ----------------------------------------------------------------------------- 4. certified size


def max_epsilon(lower_top, upper_other, delta):
    """Largest eps' with lower > e^(2 eps') upper + (1 + e^eps') delta (supremum; <= 0: none).

    The condition is a quadratic in t = e^eps': upper t^2 + delta t + (delta - lower) < 0.
    """
    lb = np.asarray(lower_top, dtype=np.float64)
    ub = np.maximum(np.asarray(upper_other, dtype=np.float64), 0.0)
    d = np.asarray(delta, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        disc = d * d + 4.0 * ub * (lb - d)
        t_quad = (-d + np.sqrt(np.maximum(disc, 0.0))) / (2.0 * ub)
        t_lin = (lb - d) / d  # upper == 0
        t = np.where(ub > 0, t_quad, t_lin)
        eps = np.where((t > 1.0) & (lb - d > 0), np.log(np.where(t > 0, t, 1.0)), 0.0)
    return eps


def _gaussian_profile(sigma, eps):
    """Balle & Wang (2018) Thm. 8 privacy profile for sensitivity 1, vectorised."""
    a = 1.0 / (2.0 * sigma)
    b = eps * sigma
    return ndtr(a - b) - np.exp(eps + log_ndtr(-a - b))


def unit_gaussian_sigma(eps, delta, iters: int = 80):
    """Vectorised analytic-Gaussian calibration for sensitivity 1 (bisection in log sigma).

    Returns the upper end of the final bracket, so the calibration never undershoots: the
    certified sizes derived from it are conservative.
    """
    eps = np.asarray(eps, dtype=np.float64)
    delta = np.broadcast_to(np.asarray(delta, dtype=np.float64), eps.shape)
    lo = np.full(eps.shape, -14.0)
    hi = np.full(eps.shape, 14.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_leaky = _gaussian_profile(np.exp(mid), eps) > delta
        lo = np.where(too_leaky, mid, lo)
        hi = np.where(too_leaky, hi, mid)
    return np.exp(hi)


CALIBRATIONS = ("analytic", "classic")


def certified_size(lower_top, upper_other, *, noise_scale: float, sensitivity: float, norm: str,
                   calibration: str = "analytic"):
    """Largest attack size L' the PixelDP test certifies, per example (0 = not certified).

    l2 (Gaussian noise of std ``noise_scale``): for each delta' of a grid take the largest eps'
    that passes Prop. 1; the noise is (eps', delta')-DP for attacks of size
    L' = noise_scale / (sensitivity * s(eps', delta')); the certificate is the maximum over the
    grid. ``calibration="analytic"`` (default): s is the exact unit calibration (Balle & Wang),
    valid for every eps', over ``DELTA_GRID`` (1e-12 to 0.5). ``"classic"``: the reference
    implementation's procedure, s = sqrt(2 ln(1.25/delta')) / eps' with eps' capped at 1 (where
    that formula holds), over the reference's grid ``DELTA_GRID_CLASSIC`` (delta' = 0.001 to 0.299
    by 0.001); it reproduces the reference's sizes (docs/pixeldp.md: up to its bisection
    tolerance of 0.001 on eps') and is sound.
    l1 (Laplace noise of scale b): delta' = 0, eps' = ln(lower / upper) / 2, L' = b eps' / Delta.
    """
    norm = v.choice("norm", norm, ("l2", "l1"))
    calibration = v.choice("calibration", calibration, CALIBRATIONS)
    noise_scale = v.positive("noise_scale", noise_scale)
    sensitivity = v.positive("sensitivity", sensitivity)
    lb = np.asarray(lower_top, dtype=np.float64)
    ub = np.asarray(upper_other, dtype=np.float64)
    if norm == "l1":
        eps = max_epsilon(lb, ub, 0.0)
        return np.where(eps > 0, noise_scale * eps / sensitivity, 0.0)
    best = np.zeros(lb.shape)
    for d in (DELTA_GRID if calibration == "analytic" else DELTA_GRID_CLASSIC):
        eps = max_epsilon(lb, ub, d)
        ok = eps > 0
        if not ok.any():
            continue
        if calibration == "analytic":
            s = unit_gaussian_sigma(np.where(ok, eps, 1.0), d)
        else:
            s = math.sqrt(2.0 * math.log(1.25 / d)) / np.where(ok, np.minimum(eps, 1.0), 1.0)
        size = np.where(ok, noise_scale / (sensitivity * s), 0.0)
        best = np.maximum(best, size)
    return best


# ----------------------------------------------------------------------------- 5. per example


@dataclass
class CertificationResult:
    """Per-example certification output (plain numpy arrays, one row per test example)."""

    index: np.ndarray
    label: np.ndarray
    prediction: np.ndarray
    lower: np.ndarray          # eta-lower bound of the predicted class's expected score
    upper: np.ndarray          # eta-upper bound of the best other class's expected score
    certified_size: np.ndarray  # largest certified attack size (0: not certified)
    noise_scale: float
    sensitivity: float
    norm: str
    n: int
    eta: float
    bounds: str

    @property
    def correct(self) -> np.ndarray:
        return self.prediction == self.label

    def accuracy(self) -> float:
        """Conventional accuracy of the certifier's prediction (argmax of the expected scores)."""
        return float(self.correct.mean())

    def as_columns(self) -> dict[str, np.ndarray]:
        return {"index": self.index, "label": self.label, "prediction": self.prediction,
                "lower_bound": self.lower, "upper_bound": self.upper,
                "certified_size": self.certified_size}


def certify(model, x: torch.Tensor, y: torch.Tensor | np.ndarray, *, n: int = 1000, eta: float = 0.95,
            bounds: str = "argmax", batch_size: int = 4096, sensitivity: float | None = None,
            calibration: str = "analytic", index=None, progress=None) -> CertificationResult:
    """Certify every example of ``x`` (PixelDP Sec. 3.4 and Prop. 1).

    ``model`` is a ``PixelDPNet`` with its noise at full scale. ``sensitivity`` defaults to the
    model's exactly measured pre-noise sensitivity (never above the construction bound).
    """
    n = v.positive_int("n", n)
    eta = v.open_unit("eta", eta)
    bounds = v.choice("bounds", bounds, BOUNDS)
    noise = getattr(model, "noise", None)
    if noise is None or not hasattr(noise, "scale"):
        raise ValueError("model must be a PixelDP network with a noise layer")
    if noise.ramp != 1.0:
        raise ValueError(f"model.noise.ramp must be 1 (full noise) to certify, got {noise.ramp}")
    shape = getattr(model, "input_shape", None)
    if shape is not None and tuple(x.shape[1:]) != tuple(shape):
        raise ValueError(f"x must hold images of shape {tuple(shape)}, got {tuple(x.shape[1:])}")
    y = np.asarray(y.cpu() if torch.is_tensor(y) else y)
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must have shape [{x.shape[0]}], got {tuple(y.shape)}")
    if sensitivity is None:
        sensitivity = model.sensitivity_exact()
    sensitivity = v.positive("sensitivity", sensitivity)
    est = monte_carlo(model, x, n, batch_size=batch_size, progress=progress)
    lower, upper = _BOUND_FNS[bounds](est, eta)
    scores = est.counts if bounds == "argmax" else est.mean
    k, lb, ub = top_and_runner_up(lower, upper, scores)
    size = certified_size(lb, ub, noise_scale=noise.scale, sensitivity=sensitivity, norm=model.norm,
                          calibration=calibration)
    idx = np.arange(len(y)) if index is None else np.asarray(index)
    return CertificationResult(idx, y.astype(np.int64), k.astype(np.int64), lb, ub, size,
                               float(noise.scale), float(sensitivity), model.norm, n, eta, bounds)


def certified_accuracy(result: CertificationResult, sizes) -> dict[float, float]:
    """Certified accuracy at each attack size T: #(correct and certified size >= T) / N, where
    an uncertified example (size 0) counts at no T."""
    out = {}
    certified = result.certified_size > 0
    for t in sizes:
        t = v.non_negative("size", t)
        out[t] = float((result.correct & certified & (result.certified_size >= t)).mean())
    return out
