"""PixelDP certification: Monte Carlo expected scores, confidence bounds, the robustness test
and the largest certified attack size (Lecuyer et al. 2018, Sec. 3.1-3.4 and Sec. 4).

Confidence convention (all of dpmech): ``alpha`` is the failure probability, the bounds hold
together with probability >= 1 - alpha (the paper's and the reference's "eta" confidence is
1 - alpha; ``eta=`` is still accepted, with a DeprecationWarning). Noise draws come from an
explicit ``generator`` (drawn on its device), never from a generator inside the model.

The steps, one function each, in the order of the paper:

1. ``monte_carlo``: n draws of the noise per image (Sec. 3.4, "estimating the expected output");
   for a PixelDP network the deterministic pre-noise part is computed once per image, any other
   module with a random forward pass is called n times.
2. ``argmax_bounds`` / ``hoeffding_bounds`` / ``bernstein_bounds``: (1 - alpha)-confidence
   intervals on the expected scores E[f_i(x)], simultaneous over the K classes by Bonferroni
   (Sec. 3.4 uses Hoeffding; the reference also counts argmax labels, for which Clopper-Pearson
   is exact). They take a ``MonteCarloEstimate`` or raw per-class counts [N, K].
3. ``robust``: Proposition 1, the generalised robustness condition
   E_lb f_k > e^(2 eps) max_{i != k} E_ub f_i + (1 + e^eps) delta.
4. ``certified_size``: the largest attack size L' for which some (eps', delta') with the
   model's fixed noise passes the test (the reference's search over delta' and eps', here with
   the exact Gaussian calibration so eps' > 1 is allowed; docs/pixeldp.md).
5. ``certify`` ties them together per example (any noisy ``nn.Module``, the noise's mechanism
   and scale as arguments; PixelDP networks need neither); ``certify_counts`` goes from counts
   (yours, or a result's) to certified sizes in one call; ``certified_accuracy`` is
   #(correct and certified size >= T) / N.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import log_ndtr, ndtr
from scipy.stats import beta as beta_dist

from dpmech import _validate as v

BOUNDS = ("argmax", "hoeffding", "bernstein")
MECHANISMS = ("gaussian", "laplace")
NORM_OF_MECHANISM = {"gaussian": "l2", "laplace": "l1"}
DEFAULT_ALPHA = 0.05


def resolve_alpha(alpha: float | None, eta: float | None = None, *, default: float = DEFAULT_ALPHA,
                  stacklevel: int = 3) -> float:
    """The failure probability ``alpha`` from ``alpha`` or the deprecated confidence ``eta``
    (alpha = 1 - eta; DeprecationWarning). Giving both is an error."""
    if eta is not None:
        if alpha is not None:
            raise ValueError("alpha: give alpha (the failure probability) or the deprecated eta = 1 - alpha, not both")
        warnings.warn("eta (a confidence) is deprecated in dpmech: pass alpha = 1 - eta, the failure probability",
                      DeprecationWarning, stacklevel=stacklevel)
        return 1.0 - v.open_unit("eta", eta)
    return v.open_unit("alpha", default if alpha is None else alpha)

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


def is_pixeldp_net(model) -> bool:
    """Whether ``model`` has PixelDP's split ``pre_noise`` -> ``noise`` -> ``post_noise`` with a
    noise layer that can draw a given shape (``dpmech.networks.pixeldp.PixelDPNet``)."""
    noise = getattr(model, "noise", None)
    return all(hasattr(model, a) for a in ("pre_noise", "post_noise")) and hasattr(noise, "sample_shape")


def has_random_forward(model, x: torch.Tensor) -> bool:
    """Whether two forward passes of ``model`` (eval mode, no gradient) on the first input of
    ``x`` differ: the test for a model whose forward pass draws noise. The global RNG state is
    restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _forked_global_rng(x.device):
            return not torch.equal(model(x[:1]), model(x[:1]))
    finally:
        model.train(was_training)


def model_device(model, fallback: torch.device) -> torch.device:
    """The device of a model's first parameter, else of its first buffer, else ``fallback`` (a model
    without parameters or buffers, or a plain callable)."""
    for tensors in ("parameters", "buffers"):
        try:
            return next(getattr(model, tensors)()).device
        except (AttributeError, StopIteration):
            continue
    return fallback


@contextmanager
def _forked_global_rng(device: torch.device, seed: int | None = None):
    """Fork torch's global RNG (CPU and ``device``), optionally seed it, restore it on exit."""
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def _child_generators(generator: torch.Generator, count: int) -> list[torch.Generator]:
    """``count`` generators on ``generator``'s device seeded from draws of ``generator``."""
    seeds = torch.randint(0, 2**62, (count,), generator=generator, device=generator.device).tolist()
    return [torch.Generator(device=generator.device).manual_seed(int(sd)) for sd in seeds]


@contextmanager
def _layer_draws_from(noise, generator: torch.Generator):
    """Make the PixelDP noise layer ``noise`` draw from streams seeded by ``generator`` (on the
    generator's device) for the duration of the block; its own generators are restored after."""
    from dpmech.robustness.noise_layer import STREAMS

    count = STREAMS if generator.device.type == "cpu" else 1
    saved = noise._gens  # noqa: SLF001 - the layer's own streams, put back below
    noise._gens = _child_generators(generator, count)  # noqa: SLF001
    try:
        yield
    finally:
        noise._gens = saved  # noqa: SLF001


def _noisy_draws(model, generator: torch.Generator | None):
    """(pre, draw, ctx): ``pre`` is computed once per image, ``draw(h, k)`` returns the logits of
    k noise draws for every row of h, as a [b * k, K] tensor (rows grouped by image); the draws
    happen inside the context ``ctx``.

    PixelDP network: the noise layer draws straight into the [b, k, ...] layout from streams
    seeded by ``generator`` (on the generator's device, then moved). Any other module is called
    on k copies of each image; with a ``generator``, torch's global RNG (the one a module's
    ``randn_like`` uses) is forked and seeded from it for the call, so the draws are a function
    of the generator and the caller's RNG state is left untouched.
    """
    if is_pixeldp_net(model):
        noise = model.noise

        def draw(h, k):
            b = h.shape[0]
            # draw the noise in the [b, k, ...] layout and add g(x) in place: no copy of the
            # repeated pre-noise activations is ever made.
            gdev = generator.device if generator is not None else h.device
            z = noise.sample_shape((b, k, *h.shape[1:]), h.dtype, gdev).to(h.device)
            z.add_(h.unsqueeze(1))
            return model.post_noise(z.view(b * k, *h.shape[1:]))
        ctx = _layer_draws_from(noise, generator) if generator is not None else nullcontext()
        return model.pre_noise, draw, ctx

    def draw_generic(x, k):
        b = x.shape[0]
        return model(x.unsqueeze(1).expand(b, k, *x.shape[1:]).reshape(b * k, *x.shape[1:]))
    if generator is None:
        return (lambda x: x), draw_generic, nullcontext()
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    return (lambda x: x), draw_generic, _forked_global_rng(model_device(model, torch.device("cpu")), seed)


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


@torch.no_grad()
def monte_carlo(model: torch.nn.Module, x: torch.Tensor, n: int, *, generator: torch.Generator | None = None,
                batch_size: int = 4096, progress=None) -> MonteCarloEstimate:
    """Draw the model's noise ``n`` times for every image of ``x`` (Sec. 3.4).

    A model with ``pre_noise``/``noise``/``post_noise`` (``dpmech.networks.pixeldp.PixelDPNet``) computes
    the pre-noise part once per image; any other model is simply called ``n`` times (its
    forward pass must be random). ``generator`` (a ``torch.Generator``) makes the draws a
    function of its state (``_noisy_draws``); ``None`` keeps the model's own source of noise
    (``certify`` always passes one). ``batch_size`` bounds the rows of one forward pass.
    ``progress`` is called with the number of images done.
    """
    n = v.positive_int("n", n)
    batch_size = v.positive_int("batch_size", batch_size)
    _check_generator(generator)
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty batch [N, ...], got shape {tuple(x.shape)}")
    was_training = model.training
    model.eval()
    device = model_device(model, x.device)
    pre, draw, ctx = _noisy_draws(model, generator)
    counts, means, sq_means = [], [], []
    try:
        with ctx:
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


def as_estimate(counts, n: int | None = None) -> MonteCarloEstimate:
    """A ``MonteCarloEstimate`` as is, or one built from raw argmax counts [N, K] (or [K] for one
    example): each row must sum to the number of draws ``n`` (default: the rows' common sum).
    The mean and second moment are those of the argmax indicators, so every bound applies."""
    if isinstance(counts, MonteCarloEstimate):
        return counts
    c = np.asarray(counts)
    if c.ndim == 1:
        c = c[None, :]
    if c.ndim != 2 or c.shape[1] < 2 or c.shape[0] == 0:
        raise ValueError(f"counts must be a MonteCarloEstimate or an array [N, K] of per-class counts with K >= 2, "
                         f"got shape {np.shape(counts)}")
    if not np.issubdtype(c.dtype, np.number) or np.any(c < 0) or np.any(c != np.round(c)):
        raise ValueError("counts must hold non-negative integers (how often each class was the argmax)")
    c = c.astype(np.int64)
    sums = c.sum(axis=1)
    total = int(sums[0]) if n is None else v.positive_int("n", n)
    if np.any(sums != total) or total < 1:
        raise ValueError(f"counts: every row must sum to the number of draws n = {total}, got row sums from "
                         f"{int(sums.min())} to {int(sums.max())}")
    mean = c / float(total)
    return MonteCarloEstimate(c, mean, mean.copy(), total)


def argmax_bounds(est, *, alpha: float | None = None, eta: float | None = None, n: int | None = None):
    """Bounds on E[1{argmax = i}] from argmax counts: Clopper-Pearson at level 1 - alpha/K each
    (Bonferroni), so all K intervals hold together with probability >= 1 - alpha.

    ``est``: a ``MonteCarloEstimate`` or raw counts [N, K] (``as_estimate``; ``n`` the draws).
    ``eta`` (= 1 - alpha) is deprecated."""
    alpha = resolve_alpha(alpha, eta)
    est = as_estimate(est, n)
    K = est.counts.shape[1]
    return clopper_pearson(est.counts, est.n, alpha / K)


def hoeffding_bounds(est, *, alpha: float | None = None, eta: float | None = None, n: int | None = None):
    """Bounds on E[softmax_i] in [0, 1] by Hoeffding's inequality (PixelDP Sec. 3.4), two-sided,
    Bonferroni over the K classes: mean +- sqrt(ln(2K / alpha) / (2n))."""
    alpha = resolve_alpha(alpha, eta)
    est = as_estimate(est, n)
    K = est.mean.shape[1]
    half = math.sqrt(math.log(2.0 * K / alpha) / (2.0 * est.n))
    return np.clip(est.mean - half, 0, 1), np.clip(est.mean + half, 0, 1)


def bernstein_bounds(est, *, alpha: float | None = None, eta: float | None = None, n: int | None = None):
    """Empirical Bernstein bounds (Maurer & Pontil 2009, Thm. 4) on E[softmax_i] in [0, 1]:
    mean +- sqrt(2 V ln(2/a) / n) + 7 ln(2/a) / (3 (n - 1)) with a = alpha / (2K)."""
    alpha = resolve_alpha(alpha, eta)
    est = as_estimate(est, n)
    if est.n < 2:
        raise ValueError(f"n must be >= 2 for empirical Bernstein bounds, got {est.n}")
    K = est.mean.shape[1]
    log_term = math.log(2.0 / (alpha / (2.0 * K)))
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


def _noise_scale(noise_scale, epsilon, delta, attack_bound, norm: str) -> float:
    """``noise_scale`` itself, or the PixelDP scale of (epsilon, delta, attack_bound): one of the two."""
    given = [k for k, val in (("epsilon", epsilon), ("delta", delta), ("attack_bound", attack_bound)) if val is not None]
    if noise_scale is not None:
        if given:
            raise ValueError(f"noise_scale: give the noise scale or the mechanism's parameters "
                             f"(epsilon, delta, attack_bound), not both (got noise_scale and {', '.join(given)})")
        return v.positive("noise_scale", noise_scale)
    needed = ("epsilon", "attack_bound") + (("delta",) if norm == "l2" else ())
    missing = [k for k in needed if k not in given]
    if missing:
        raise ValueError(f"noise_scale: give the noise scale, or {', '.join(needed)} of the mechanism "
                         f"(missing: {', '.join(missing)})")
    from dpmech.robustness.noise_layer import pixeldp_noise_scale

    return pixeldp_noise_scale(epsilon, delta if norm == "l2" else None, attack_bound, 1.0, norm)


def certified_size(lower_top, upper_other, *, noise_scale: float | None = None, sensitivity: float = 1.0,
                   norm: str = "l2", calibration: str = "analytic", epsilon: float | None = None,
                   delta: float | None = None, attack_bound: float | None = None):
    """Largest attack size L' the PixelDP test certifies, per example (0 = not certified).

    ``lower_top``/``upper_other``: the lower bound of the predicted class's expected score and
    the upper bound of the best other class's (``top_and_runner_up``). The noise is given by its
    scale ``noise_scale`` (Gaussian sigma for l2, Laplace b for l1) or by the noise layer's
    construction parameters ``epsilon``, ``delta`` (l2 only) and ``attack_bound`` L, from which
    the scale is ``pixeldp_noise_scale(epsilon, delta, L, 1, norm)`` (Sec. 3.2, construction
    bound Delta = 1). ``sensitivity``: the pre-noise sensitivity the size is divided by (1 for
    noise on the input, or the construction bound; ``PixelDPNet.sensitivity_exact()``).

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
    noise_scale = _noise_scale(noise_scale, epsilon, delta, attack_bound, norm)
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
    label: np.ndarray          # true labels (UNKNOWN_LABEL when not given: never "correct")
    prediction: np.ndarray
    lower: np.ndarray          # (1 - alpha)-lower bound of the predicted class's expected score
    upper: np.ndarray          # (1 - alpha)-upper bound of the best other class's expected score
    certified_size: np.ndarray  # largest certified attack size (0: not certified)
    noise_scale: float
    sensitivity: float
    norm: str
    n: int
    alpha: float               # failure probability of the bounds (the paper's eta = 1 - alpha)
    bounds: str
    counts: np.ndarray | None = None   # [N, K] argmax counts of the n draws (replay, re-bounding)
    mean: np.ndarray | None = None     # [N, K] mean softmax scores of the n draws

    @property
    def eta(self) -> float:
        """Deprecated: the confidence 1 - alpha (the PixelDP paper's eta)."""
        return 1.0 - self.alpha

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


UNKNOWN_LABEL = -2


def _batch(x: torch.Tensor, shape=None) -> torch.Tensor:
    """``x`` as a batch: a single input (its shape is the model's ``input_shape``, or it is a
    [C, H, W] image when the model declares none) becomes a batch of one."""
    if not torch.is_tensor(x):
        raise ValueError(f"x must be a tensor, got {type(x).__name__}")
    if shape is not None:
        if tuple(x.shape) == tuple(shape):
            return x.unsqueeze(0)
        if tuple(x.shape[1:]) != tuple(shape):
            raise ValueError(f"x must hold images of shape {tuple(shape)}: one image, or a batch "
                             f"[N, {', '.join(map(str, shape))}]; got {tuple(x.shape)}")
        return x
    if x.dim() == 3:
        return x.unsqueeze(0)
    return x


def _labels(y, N: int) -> np.ndarray:
    return v.labels_array(y, N, UNKNOWN_LABEL)  # unknown labels: never "correct"


def certify_counts(counts, y=None, *, alpha: float | None = None, bounds: str = "argmax",
                   noise_scale: float | None = None, epsilon: float | None = None, delta: float | None = None,
                   attack_bound: float | None = None, norm: str = "l2", sensitivity: float = 1.0,
                   calibration: str = "analytic", n: int | None = None, index=None,
                   eta: float | None = None) -> CertificationResult:
    """From Monte Carlo counts to certified sizes in one call (Sec. 3.4 bounds, Prop. 1, the
    size search of ``certified_size``).

    ``counts``: raw argmax counts [N, K] (or [K] for one example; rows sum to the draws ``n``),
    or a ``MonteCarloEstimate`` (needed for ``bounds="hoeffding"``/``"bernstein"`` on softmax
    scores; on raw counts those bound the argmax indicators). The noise: ``noise_scale`` or the
    mechanism's ``epsilon``, ``delta``, ``attack_bound`` (``certified_size``); ``norm`` "l2"
    (Gaussian) or "l1" (Laplace). ``alpha``: failure probability (default 0.05); ``eta`` is
    its deprecated complement. Returns a ``CertificationResult`` (``y`` optional).
    """
    alpha = resolve_alpha(alpha, eta)
    bounds = v.choice("bounds", bounds, BOUNDS)
    norm = v.choice("norm", norm, ("l2", "l1"))
    est = as_estimate(counts, n)
    scale = _noise_scale(noise_scale, epsilon, delta, attack_bound, norm)
    sensitivity = v.positive("sensitivity", sensitivity)
    lower, upper = _BOUND_FNS[bounds](est, alpha=alpha)
    scores = est.counts if bounds == "argmax" else est.mean
    k, lb, ub = top_and_runner_up(lower, upper, scores)
    size = certified_size(lb, ub, noise_scale=scale, sensitivity=sensitivity, norm=norm, calibration=calibration)
    N = est.counts.shape[0]
    label = _labels(y, N)
    idx = np.arange(N) if index is None else np.asarray(index)
    return CertificationResult(idx, label, k.astype(np.int64), lb, ub, size, float(scale), float(sensitivity), norm,
                               est.n, alpha, bounds, est.counts, est.mean)


def certify(model, x: torch.Tensor, y=None, *, n: int = 1000, alpha: float | None = None,
            bounds: str = "argmax", generator: torch.Generator | None = None, mechanism: str | None = None,
            noise_scale: float | None = None, sensitivity: float | None = None, calibration: str = "analytic",
            batch_size: int = 4096, index=None, progress=None, eta: float | None = None) -> CertificationResult:
    """Certify every example of ``x`` (PixelDP Sec. 3.4 and Prop. 1).

    ``model``: any ``nn.Module`` whose forward pass is random, with the noise's ``mechanism``
    ("gaussian": l2 attacks; "laplace": l1) and scale ``noise_scale`` given, and ``sensitivity``
    the l2 (l1) sensitivity of the noised quantity to the input (default 1: noise added to the
    input itself). A PixelDP network (``dpmech.networks.pixeldp.PixelDPNet``, the fast path: pre-noise
    part once per image) needs none of them: its noise layer and exactly measured sensitivity
    are used, and its noise must be at full scale.

    ``generator``: the ``torch.Generator`` the noise is drawn from (on its device; a CPU
    generator gives the same draws whatever the model's device). Default: one seeded with 0 on
    the model's device. For a PixelDP network the layer draws from streams seeded by it; any
    other module runs with torch's global RNG forked and seeded from it (``_noisy_draws``).
    ``x``: a batch [N, ...] or a single image [C, H, W]. ``y``: true labels (optional).
    ``alpha``: failure probability of the bounds (default 0.05; ``eta`` = 1 - alpha is
    deprecated). The result keeps the per-example ``counts`` and ``mean`` scores it used.
    """
    n = v.positive_int("n", n)
    alpha = resolve_alpha(alpha, eta)
    bounds = v.choice("bounds", bounds, BOUNDS)
    _check_generator(generator)
    if is_pixeldp_net(model):
        noise = model.noise
        if getattr(noise, "ramp", 1.0) != 1.0:
            raise ValueError(f"model.noise.ramp must be 1 (full noise) to certify, got {noise.ramp}")
        norm = model.norm
        layer_mechanism = {"l2": "gaussian", "l1": "laplace"}[norm]
        if mechanism is not None and v.choice("mechanism", mechanism, MECHANISMS) != layer_mechanism:
            raise ValueError(f"mechanism: the model's noise layer is {layer_mechanism}, got {mechanism!r}")
        if noise_scale is not None and not math.isclose(float(noise_scale), float(noise.scale), rel_tol=1e-9):
            raise ValueError(f"noise_scale: the model's noise layer has scale {noise.scale}, got {noise_scale}")
        scale = float(noise.scale)
        x = _batch(x, getattr(model, "input_shape", None))
        if sensitivity is None:
            sensitivity = model.sensitivity_exact()
    else:
        if mechanism is None or noise_scale is None:
            raise ValueError("mechanism: a model that is not a PixelDP network needs the noise's mechanism "
                             "('gaussian' or 'laplace') and noise_scale")
        mechanism = v.choice("mechanism", mechanism, MECHANISMS)
        norm = NORM_OF_MECHANISM[mechanism]
        scale = v.positive("noise_scale", noise_scale)
        x = _batch(x)
        if sensitivity is None:
            sensitivity = 1.0
    sensitivity = v.positive("sensitivity", sensitivity)
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty batch [N, ...] or one image [C, H, W], got shape {tuple(x.shape)}")
    label = _labels(y, x.shape[0])
    device = model_device(model, x.device)
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(0)
    if not is_pixeldp_net(model) and not has_random_forward(model, x.to(device)):
        raise ValueError("model: its forward pass is deterministic; certify needs the noise inside the forward pass "
                         "(for a deterministic base classifier use dpmech.robustness.smoothing.certify)")
    est = monte_carlo(model, x, n, generator=generator, batch_size=batch_size, progress=progress)
    return certify_counts(est, label if y is not None else None, alpha=alpha, bounds=bounds, noise_scale=scale,
                          norm=norm, sensitivity=sensitivity, calibration=calibration, index=index)


def certified_accuracy(result: CertificationResult, sizes) -> dict[float, float]:
    """Certified accuracy at each attack size T: #(correct and certified size >= T) / N, where
    an uncertified example (size 0) counts at no T."""
    out = {}
    certified = result.certified_size > 0
    for t in sizes:
        t = v.non_negative("size", t)
        out[t] = float((result.correct & certified & (result.certified_size >= t)).mean())
    return out
