"""Randomized smoothing: certified l2 robustness of a Gaussian-smoothed classifier
(Cohen, Rosenfeld & Kolter, ICML 2019, "Certified Adversarial Robustness via Randomized Smoothing").

The smoothed classifier of a base classifier f is g(x) = argmax_c P(f(x + eps) = c) with
eps ~ N(0, sigma^2 I). Theorem 1: if p_A_lower <= P(f(x + eps) = c_A) and p_A_lower > 1/2, then
g(x + delta) = c_A for every ||delta||_2 < R = sigma * Phi^{-1}(p_A_lower) (the two-class form,
p_B_upper = 1 - p_A_lower, used by the paper's CERTIFY).

One function per paragraph of the paper (Section 3.2, "Practical algorithms", and its
Pseudocode box), the statistics delegated to statsmodels and scipy:

* ``sample_noise``: SAMPLEUNDERNOISE, the counts of f's argmax over n Gaussian draws per input;
* ``lower_confidence_bound``: LOWERCONFBOUND, the one-sided (1 - alpha) Clopper-Pearson bound;
* ``max_radius``: the largest radius CERTIFY can return at a given sigma, n and alpha (its reach);
* ``count_from_radius`` / ``projected_radius``: a record's c_A count recovered from its radius, and the radius
  CERTIFY would be expected to return with more draws (a plug-in projection for choosing among
  configurations explored at a small n; never a certificate);
* ``certify``: CERTIFY(f, sigma, x, n0, n, alpha), selection with n0 draws, estimation with n,
  abstain when p_A_lower <= 1/2, else radius sigma * Phi^{-1}(p_A_lower);
* ``predict``: PREDICT(f, sigma, x, n, alpha), the top two counts and a two-sided binomial test
  of nA against nA + nB at p = 1/2, abstain when its p-value exceeds alpha.

Inputs live in [-1, 1] (DESIGN.md); sigma and the radius are in that domain, so a radius R here
is R / 2 in the [0, 1] domain of the paper's figures (docs/smoothing.md).

``base`` is any ``torch.nn.Module`` mapping a batch of inputs to logits *without* adding the
smoothing noise itself (e.g. a PixelDP network with its noise layer bypassed, see
``trainables.pixeldp.PixelDPMechanism.smoothing_classifier``); it is run in eval mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.stats import binomtest, norm
from statsmodels.stats.proportion import proportion_confint

from dpmech import _validate as v

ABSTAIN = -1


# ----------------------------------------------------------------------------- SAMPLEUNDERNOISE


CPU_BATCH, ACCELERATOR_BATCH = 256, 4096


def default_batch_size(device) -> int:
    """Noisy inputs per forward pass when none is given: 256 on a CPU, where a batch that stays in the
    caches is fastest (Tramer & Boneh's MNIST CNN with the noise draws, one core: 29,000 noisy images/s
    at 256, 25,000 at 1,024, 15,600 at 4,096; docs/dp_certified.md), 4,096 on an accelerator."""
    return CPU_BATCH if torch.device(device).type == "cpu" else ACCELERATOR_BATCH


@torch.no_grad()
def sample_noise(base: torch.nn.Module, x: torch.Tensor, num: int, sigma: float, *,
                 generator: torch.Generator, batch_size: int | None = None,
                 num_classes: int | None = None) -> np.ndarray:
    """SAMPLEUNDERNOISE(f, x, num, sigma) of the pseudocode: for every input of the batch ``x``
    ([N, ...]), draw ``num`` noise vectors eps ~ N(0, sigma^2 I) from ``generator`` and count how
    often each class is the argmax of ``base(x + eps)``. Returns an int64 array [N, K].

    At most ``batch_size`` noisy inputs go through ``base`` at once (None: :func:`default_batch_size`
    of the device ``base`` runs on). The draws are a function of (generator state, N, num,
    batch_size): the same arguments give the same counts. The noise is
    drawn on the generator's device and moved to the device of ``base`` (its first parameter's,
    else its first buffer's, else the input's), where ``base`` runs: a CPU generator and an explicit
    ``batch_size`` give the same draws, and the same counts, whatever the model's device (a GPU
    generator is faster; the default batch size is the device's).
    """
    num = v.positive_int("num", num)
    sigma = v.positive("sigma", sigma)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty batch [N, ...], got shape {tuple(x.shape)}")
    from dpmech.robustness.certification import model_device

    gdev = generator.device                  # where the noise is drawn
    device = model_device(base, x.device)    # where the base classifier runs
    batch_size = v.positive_int("batch_size", default_batch_size(device) if batch_size is None else batch_size)
    was_training = base.training
    base.eval()
    per_chunk = max(1, batch_size // num)   # whole inputs per chunk when num <= batch_size
    draws_per_pass = min(num, batch_size)   # else the draws of one input are split over passes
    out = []
    try:
        for start in range(0, x.shape[0], per_chunk):
            xb = x[start:start + per_chunk].to(device)
            b, shape = xb.shape[0], xb.shape[1:]
            counts = None
            done = 0
            while done < num:
                k = min(draws_per_pass, num - done)
                z = torch.randn((b, k, *shape), generator=generator, device=gdev, dtype=xb.dtype).to(device)
                z.mul_(sigma).add_(xb.unsqueeze(1))
                logits = base(z.view(b * k, *shape))
                top = logits.argmax(dim=1).view(b, k)
                if counts is None:
                    K = num_classes or int(logits.shape[1])
                    counts = torch.zeros(b, K, dtype=torch.int64, device=top.device)
                counts.scatter_add_(1, top, torch.ones_like(top))
                done += k
            out.append(counts.cpu())
    finally:
        base.train(was_training)
    return torch.cat(out).numpy()


# ----------------------------------------------------------------------------- LOWERCONFBOUND


def lower_confidence_bound(count, n: int, alpha: float) -> np.ndarray:
    """LOWERCONFBOUND(k, n, 1 - alpha): the one-sided (1 - alpha) lower Clopper-Pearson bound on a
    binomial proportion, i.e. the lower end of the two-sided interval at level 1 - 2 alpha
    (statsmodels ``proportion_confint(method="beta")``). Vectorised over ``count``."""
    n = v.positive_int("n", n)
    alpha = v.open_unit("alpha", alpha)
    if not 2 * alpha < 1:
        raise ValueError(f"alpha must be < 0.5 for a one-sided bound, got {alpha}")
    count = np.asarray(count, dtype=np.float64)
    if np.any(count < 0) or np.any(count > n):
        raise ValueError(f"count must be in [0, n={n}]")
    lo, _ = proportion_confint(count, n, alpha=2 * alpha, method="beta")
    return np.nan_to_num(np.asarray(lo, dtype=np.float64), nan=0.0)


def max_radius(sigma: float, n: int, alpha: float = 0.001) -> float:
    """The largest radius CERTIFY can return with ``n`` estimation draws at noise ``sigma``: every draw
    counted for c_A, so p_A_lower is LOWERCONFBOUND(n, n, 1 - alpha) = alpha^(1/n) and the radius
    sigma * Phi^{-1}(alpha^(1/n)) (Theorem 1 with that bound). Certified accuracy beyond it is 0 by
    construction, whatever the model: a limit of N and sigma, not a measurement. Radius and sigma are in
    the same domain (a [0, 1]-domain sigma gives a [0, 1]-domain radius)."""
    sigma = v.positive("sigma", sigma)
    return sigma * float(norm.ppf(lower_confidence_bound(n, n, alpha)))


@lru_cache(maxsize=8)
def _bound_table(n: int, alpha: float) -> np.ndarray:
    """LOWERCONFBOUND(k, n, 1 - alpha) for every k = 0..n (increasing in k)."""
    return lower_confidence_bound(np.arange(n + 1), n, alpha)


def count_from_radius(radius, n: int, sigma: float, alpha: float = 0.001) -> np.ndarray:
    """The c_A count CERTIFY drew for each returned ``radius`` (its inverse: radius = sigma * Phi^{-1}(
    LOWERCONFBOUND(count, n, 1 - alpha))), for records that kept radii, not counts: the count whose bound is
    nearest Phi(radius / sigma) (successive counts' radii differ by far more than a radius rounded to 1e-5).
    A radius of 0 (an abstention: the count lay somewhere below the threshold) gives -1."""
    n = v.positive_int("n", n)
    sigma = v.positive("sigma", sigma)
    radius = np.asarray(radius, dtype=np.float64)
    table = _bound_table(n, float(alpha))
    p = norm.cdf(radius / sigma)
    hi = np.clip(np.searchsorted(table, p), 1, n)
    count = np.where(np.abs(table[hi - 1] - p) <= np.abs(table[hi] - p), hi - 1, hi)
    return np.where(radius > 0, count, -1).astype(np.int64)


def projected_radius(count_a, n: int, n_target: int, sigma: float, alpha: float = 0.001) -> np.ndarray:
    """The radius CERTIFY would be expected to return with ``n_target`` estimation draws where ``n`` draws
    counted ``count_a`` for c_A: the observed proportion carried to round(count_a * n_target / n) of
    ``n_target`` draws, then LOWERCONFBOUND and sigma * Phi^{-1} as in ``certify`` (abstain at <= 1/2).

    A plug-in projection for *choosing* among configurations explored at a small n (CERTIFY at N 10,000
    reaches only 3.2 sigma; at 100,000 3.8 sigma, so a comparison near the small n's reach favours the larger
    sigma): a function of the validation data like any other selection statistic, **not a certificate**.
    The plug-in is slightly optimistic: an image whose n draws were all c_A projects to the larger n's reach
    (its proportion may be a little below 1), and near the threshold the small n's spread lifts more images
    over it than it drops (tests/test_smoothing.py measures 2.4 points with every image there; the
    benchmark's check on models certified at both N, 0.4 on average). Counts below 0 (an abstention whose
    count was not kept) stay abstentions."""
    n = v.positive_int("n", n)
    n_target = v.positive_int("n_target", n_target)
    sigma = v.positive("sigma", sigma)
    count_a = np.asarray(count_a, dtype=np.int64)
    if np.any(count_a > n):
        raise ValueError(f"count_a must be at most n={n}")
    scaled = np.clip(np.rint(count_a.astype(np.float64) * n_target / n), 0, n_target).astype(np.int64)
    p = _bound_table(n_target, float(alpha))[scaled]
    ok = (count_a >= 0) & (p > 0.5)
    return np.where(ok, sigma * norm.ppf(np.where(ok, p, 0.75)), 0.0)


# ----------------------------------------------------------------------------- results


@dataclass
class SmoothingResult:
    """Per-example output of CERTIFY (plain numpy arrays, one row per input).

    Shaped like ``dpmech.robustness.certification.CertificationResult`` where the runtime uses it:
    ``certified_size`` (the l2 radius, 0 when abstaining), ``correct`` (an abstention is never
    correct), ``accuracy()`` and ``as_columns()`` (the Parquet table).
    """

    index: np.ndarray
    label: np.ndarray
    prediction: np.ndarray     # c_A, or ABSTAIN (-1)
    count_a: np.ndarray        # nA: draws (of n) classified as c_A
    p_a_lower: np.ndarray      # one-sided (1 - alpha) lower bound on P(f(x + eps) = c_A)
    radius: np.ndarray         # sigma * Phi^{-1}(p_a_lower); 0 when abstaining
    sigma: float
    n0: int
    n: int
    alpha: float
    norm: str = "l2"
    # PREDICT's answer on the same inputs (ABSTAIN = -1), when it was run (trainables.runtime)
    smoothed_prediction: np.ndarray | None = None
    counts0: np.ndarray | None = None   # [N, K] selection counts (n0 draws) that chose c_A
    counts: np.ndarray | None = None    # [N, K] estimation counts (n draws); count_a is counts[i, c_A]

    @property
    def abstained(self) -> np.ndarray:
        return self.prediction == ABSTAIN

    @property
    def certified_size(self) -> np.ndarray:
        return self.radius

    @property
    def correct(self) -> np.ndarray:
        return self.prediction == self.label

    def accuracy(self) -> float:
        """Fraction of inputs CERTIFY labels correctly (abstentions count as wrong)."""
        return float(self.correct.mean())

    def abstain_rate(self) -> float:
        return float(self.abstained.mean())

    def as_columns(self) -> dict[str, np.ndarray]:
        cols = {"index": self.index, "label": self.label, "prediction": self.prediction,
                "abstained": self.abstained, "count_a": self.count_a, "p_a_lower": self.p_a_lower,
                "radius": self.radius}
        if self.smoothed_prediction is not None:
            cols["smoothed_prediction"] = self.smoothed_prediction
        return cols


def as_batch(x: torch.Tensor) -> torch.Tensor:
    """Inputs as a batch [N, ...]: a single image [C, H, W] (3 dimensions) or a single vector [D]
    (1 dimension) becomes a batch of one; [N, C, H, W] and [N, D] are batches already."""
    if not torch.is_tensor(x):
        raise ValueError(f"x must be a tensor: a batch [N, C, H, W] or [N, D], or one input [C, H, W] or [D]; "
                         f"got {type(x).__name__}")
    if x.dim() in (1, 3):
        return x.unsqueeze(0)
    if x.dim() not in (2, 4) or x.shape[0] == 0:
        raise ValueError(f"x must be a batch [N, C, H, W] or [N, D] (N > 0), or one input [C, H, W] or [D]; "
                         f"got shape {tuple(x.shape)}")
    return x


def _labels(y, N: int) -> np.ndarray:
    return v.labels_array(y, N, ABSTAIN - 1)  # unknown labels: never "correct"


# ----------------------------------------------------------------------------- CERTIFY


def certify(base: torch.nn.Module, sigma: float, x: torch.Tensor, y=None, *, n0: int = 100, n: int = 100_000,
            alpha: float = 0.001, generator: torch.Generator, batch_size: int | None = None,
            index=None) -> SmoothingResult:
    """CERTIFY(f, sigma, x, n0, n, alpha) of the pseudocode, for every input of the batch ``x``:

    1. counts0 <- SAMPLEUNDERNOISE(f, x, n0, sigma); c_A <- the top index of counts0 (selection);
    2. counts <- SAMPLEUNDERNOISE(f, x, n, sigma) (fresh draws: estimation);
    3. p_A_lower <- LOWERCONFBOUND(counts[c_A], n, 1 - alpha);
    4. if p_A_lower <= 1/2 abstain, else return c_A and radius sigma * Phi^{-1}(p_A_lower).

    Proposition 2 of the paper: with probability >= 1 - alpha over the draws, a returned c_A is
    g(x) and g is constant on the l2 ball of the returned radius. The paper abstains when
    p_A_lower < 1/2; at exactly 1/2 the radius would be 0, which certifies nothing, so we abstain
    there too. ``y`` (optional) are the true labels, for ``correct``/``accuracy``.

    ``x``: a batch [N, C, H, W] / [N, D], or a single input [C, H, W] / [D] (``as_batch``;
    the result then has one row). The result keeps both count tables (``counts0``, ``counts``).
    """
    sigma = v.positive("sigma", sigma)
    n0 = v.positive_int("n0", n0)
    n = v.positive_int("n", n)
    alpha = v.open_unit("alpha", alpha)
    x = as_batch(x)
    N = x.shape[0]
    y = _labels(y, N)
    counts0 = sample_noise(base, x, n0, sigma, generator=generator, batch_size=batch_size)
    c_a = counts0.argmax(axis=1)
    counts = sample_noise(base, x, n, sigma, generator=generator, batch_size=batch_size,
                          num_classes=counts0.shape[1])
    n_a = counts[np.arange(N), c_a]
    p_lower = lower_confidence_bound(n_a, n, alpha)
    certified = p_lower > 0.5
    radius = np.where(certified, sigma * norm.ppf(np.where(certified, p_lower, 0.75)), 0.0)
    prediction = np.where(certified, c_a, ABSTAIN).astype(np.int64)
    idx = np.arange(N) if index is None else np.asarray(index)
    return SmoothingResult(idx, y, prediction, n_a.astype(np.int64), p_lower, radius, sigma, n0, n, alpha,
                           counts0=counts0, counts=counts)


# ----------------------------------------------------------------------------- PREDICT


def predict(base: torch.nn.Module, sigma: float, x: torch.Tensor, *, n: int = 100_000, alpha: float = 0.001,
            generator: torch.Generator, batch_size: int | None = None) -> np.ndarray:
    """PREDICT(f, sigma, x, n, alpha) of the pseudocode, for every input of the batch ``x``:

    counts <- SAMPLEUNDERNOISE(f, x, n, sigma); c_A, c_B <- the top two indices; nA, nB their
    counts; if BINOMPVALUE(nA, nA + nB, 0.5) <= alpha return c_A, else abstain (ABSTAIN = -1).

    Proposition 1 of the paper: the probability that PREDICT returns a class other than g(x) is
    at most alpha. The p-value is scipy's exact two-sided ``binomtest``. ``x`` as in
    :func:`certify` (a single input gives an array of one prediction).
    """
    sigma = v.positive("sigma", sigma)
    n = v.positive_int("n", n)
    alpha = v.open_unit("alpha", alpha)
    x = as_batch(x)
    counts = sample_noise(base, x, n, sigma, generator=generator, batch_size=batch_size)
    if counts.shape[1] < 2:
        raise ValueError(f"base must output at least 2 classes, got {counts.shape[1]}")
    order = np.argsort(-counts, axis=1, kind="stable")
    rows = np.arange(counts.shape[0])
    c_a = order[:, 0]
    n_a, n_b = counts[rows, c_a], counts[rows, order[:, 1]]
    pairs, where = np.unique(np.stack([n_a, n_b], axis=1), axis=0, return_inverse=True)
    pvalue = np.array([binomtest(int(a), int(a + b), 0.5).pvalue for a, b in pairs])[where.reshape(-1)]
    return np.where(pvalue <= alpha, c_a, ABSTAIN).astype(np.int64)


# ----------------------------------------------------------------------------- certified accuracy


def certified_accuracy(result: SmoothingResult, radii) -> dict[float, float]:
    """Approximate certified accuracy of the paper's Section 4 at each l2 radius r:
    #(CERTIFY returns the true label with radius >= r) / N; an abstention counts at no r (and a
    radius of 0 is never returned without abstaining)."""
    out = {}
    ok = result.correct & ~result.abstained
    for r in radii:
        r = v.non_negative("radius", r)
        out[r] = float((ok & (result.radius >= r)).mean())
    return out


def smoothing_metrics(result: SmoothingResult, radii) -> dict[str, float]:
    """The trial metrics of randomized smoothing (docs/smoothing.md):

    * ``smooth_cert_acc_<r>``: certified accuracy at l2 radius >= r (``certified_accuracy``);
    * ``smooth_cert_abstain_rate``: fraction of inputs on which CERTIFY abstains;
    * ``smooth_acc_clean`` / ``smooth_abstain_rate``: accuracy of PREDICT (an abstention is
      wrong) and the fraction on which it abstains, when PREDICT was run.
    """
    from dpmech.robustness.evaluation import format_size

    out = {f"smooth_cert_acc_{format_size(r)}": acc for r, acc in certified_accuracy(result, radii).items()}
    out["smooth_cert_abstain_rate"] = result.abstain_rate()
    if result.smoothed_prediction is not None:
        out["smooth_acc_clean"] = float((result.smoothed_prediction == result.label).mean())
        out["smooth_abstain_rate"] = float((result.smoothed_prediction == ABSTAIN).mean())
    return out
