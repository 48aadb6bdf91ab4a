"""Label differential privacy: the labels of the training set are released once through an
epsilon-DP mechanism, and a freshly initialised network is trained on the images with the
released labels (docs/label_dp.md).

Neighbouring datasets differ in the label of one example (the images are public to the
mechanism: label DP protects labels only). The mechanisms, each epsilon-DP with delta = 0:

* ``laplace``, classification (the source document's Task 1): the one-hot label plus i.i.d.
  Laplace(b) noise on each of the K coordinates; two one-hot vectors differ by
  ``Delta_1 = ||e_a - e_b||_1 = 2``, so ``b = 2 / epsilon`` (Laplace mechanism, Dwork et al.
  2006). Post-processing to a label: ``argmax`` of the noisy vector (default), or the source
  code's clamp-and-round (``clamp_round``), which perturbs the digit value itself:
  ``clamp(round(y + Lap(b)), 0, K-1)`` with ``Delta_1 = K - 1 = 9`` (the source calibrated that
  scalar release with Delta = 2, which understates its cost 4.5x; here it uses 9).
* ``laplace``, regression (Task 2): the digit value as a real label, ``y + Lap(b)`` with
  ``Delta_1 = K - 1 = 9`` (labels in [0, 9]), ``b = 9 / epsilon``, clamped to [0, 9].
* ``rr`` (beyond the source; both tasks): K-ary randomized response (Warner 1965; Kairouz et al.
  2016): keep the true label with probability ``e^eps / (e^eps + K - 1)``, otherwise draw one of the
  other K - 1 labels uniformly. Every output probability ratio between two inputs is at most e^eps.
* ``lp1st`` / ``lp2st`` (beyond the source; classification): randomized response with a prior
  (Ghazi et al. 2021, Alg. 2, ``dpmech.label_dp.rr_prior``) in one stage (uniform prior: K-ary RR)
  or two (LP-MST, Alg. 3: the stage-1 model's predictions on part 2's images are the prior of part
  2's release; ``dpmech.label_dp.recipe``). Each label is released once: epsilon-label-DP.
* ``none``: the true labels (the non-private baseline, epsilon = inf).

Two training recipes: ``adam`` (the source's: Adam, constant learning rate, the source's CNN) and
``mixup_sgd`` (Ghazi et al.'s: mixup, SGD with momentum, linear warm-up then linear decay, the
smaller ``RecipeCNN``); docs/label_dp.md.

Every randomized step takes an explicit ``torch.Generator``. The release happens once, in the
trainer's constructor, before any training step; it is kept in ``state_dict()`` and reused in
every epoch (redrawing it each epoch, as the source's code does, composes the mechanism once per
epoch and multiplies epsilon by the number of epochs).

The epsilon reported is computed from what was drawn: ``Delta_1 / b`` for the Laplace scale b
actually used, and ``log(p (K - 1) / (1 - p))`` for RR's keep probability p actually used.
``label_epsilon`` gives the exact epsilon of the labels after post-processing (never larger).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.mechanisms import laplace_noise, laplace_scale

TASKS = ("classification", "regression")
MECHANISMS = ("laplace", "rr", "lp1st", "lp2st", "none")
RECIPES = ("adam", "mixup_sgd")
PRIOR_MODES = ("denoised", "softmax")
POSTPROCESS = ("argmax", "clamp_round")
DATASETS = ("mnist", "fashion_mnist", "cifar10")

#: L1 distance between two distinct one-hot vectors (the source document's Delta f = 2)
ONE_HOT_SENSITIVITY = 2.0


def scalar_sensitivity(num_classes: int) -> float:
    """L1 sensitivity of the digit value as a label in [0, K - 1]: K - 1 (9 for MNIST)."""
    return float(v.positive_int("num_classes", num_classes, minimum=2) - 1)


# --------------------------------------------------------------------------- randomized response


def rr_flip_prob(epsilon: float, num_classes: int) -> float:
    """Probability that K-ary randomized response replaces the label: ``(K-1) / (e^eps + K - 1)``,
    written as ``(K-1) e^-eps / (1 + (K-1) e^-eps)`` so it stays representable at large epsilon."""
    epsilon = v.positive("epsilon", epsilon)
    k = v.positive_int("num_classes", num_classes, minimum=2)
    t = (k - 1) * math.exp(-epsilon)
    return t / (1.0 + t)


def rr_keep_prob(epsilon: float, num_classes: int) -> float:
    """Keep probability of K-ary randomized response: ``e^eps / (e^eps + K - 1)``."""
    return 1.0 - rr_flip_prob(epsilon, num_classes)


def rr_epsilon(flip_prob: float, num_classes: int) -> float:
    """Epsilon of K-ary RR with this flip probability q: the largest output ratio is
    ``(1 - q) / (q / (K - 1))`` (keep vs. one given other label); inf if q = 0."""
    k = v.positive_int("num_classes", num_classes, minimum=2)
    q = v.unit_interval("flip_prob", flip_prob)
    if q > (k - 1) / k:
        raise ValueError(f"flip_prob must be <= (K-1)/K = {(k - 1) / k:.6g} (more flips favour another label), got {q}")
    if q == 0.0:
        return math.inf
    return max(0.0, math.log1p(-q) + math.log(k - 1) - math.log(q))


def rr_output_matrix(keep_prob: float, num_classes: int) -> np.ndarray:
    """``M[y, o] = P(output o | true label y)`` of K-ary RR with keep probability p: p on the
    diagonal, ``(1 - p) / (K - 1)`` elsewhere (for exact enumeration in tests and reports)."""
    k = v.positive_int("num_classes", num_classes, minimum=2)
    p = v.unit_interval("keep_prob", keep_prob)
    m = np.full((k, k), (1.0 - p) / (k - 1))
    np.fill_diagonal(m, p)
    return m


def randomized_response(y: torch.Tensor, num_classes: int, flip_prob: float,
                        generator: torch.Generator) -> torch.Tensor:
    """K-ary randomized response of integer labels ``y`` (a new int64 tensor on y's device).

    For each label: with probability ``flip_prob`` it is replaced by ``(y + 1 + J) mod K`` with J
    uniform on {0, ..., K-2} (uniform over the K - 1 other labels), otherwise kept. The
    uniform draw is float64, so a flip probability below 2^-53 is rounded up to 2^-53 (more
    flips, never fewer: the guarantee only gets stronger).
    """
    k = v.positive_int("num_classes", num_classes, minimum=2)
    q = v.unit_interval("flip_prob", flip_prob)
    _check_labels(y, k)
    _check_generator(generator)
    yc = y.detach().to("cpu", torch.int64)
    u = torch.rand(yc.shape, generator=generator, dtype=torch.float64)
    j = torch.randint(0, k - 1, yc.shape, generator=generator)
    flipped = (yc + 1 + j) % k
    return torch.where(u < q, flipped, yc).to(y.device)


# --------------------------------------------------------------------------- Laplace mechanisms


def laplace_one_hot(y: torch.Tensor, num_classes: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    """One-hot labels plus i.i.d. Laplace(scale) noise on every coordinate (float64 [N, K], CPU)."""
    k = v.positive_int("num_classes", num_classes, minimum=2)
    _check_labels(y, k)
    one_hot = F.one_hot(y.detach().to("cpu", torch.int64), k).to(torch.float64)
    return one_hot + laplace_noise(one_hot, scale, generator)


def laplace_value(y: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """The digit value as a real label plus Laplace(scale) noise (float64 [N], CPU)."""
    value = y.detach().to("cpu", torch.float64)
    return value + laplace_noise(value, scale, generator)


def _laplace_interval_logprob(lo: float, hi: float, b: float) -> float:
    """log P(lo <= L < hi) for L ~ Laplace(0, b), accurate in the far tails (log space)."""
    if lo >= hi:
        return -math.inf
    if lo >= 0:
        tail = 0.0 if hi == math.inf else math.exp(-(hi - lo) / b)
        return math.log(0.5) - lo / b + math.log1p(-tail)
    if hi <= 0:
        return _laplace_interval_logprob(-hi, -lo, b)
    left = 0.0 if lo == -math.inf else 0.5 * math.exp(lo / b)
    right = 0.0 if hi == math.inf else 0.5 * math.exp(-hi / b)
    return math.log1p(-(left + right))


def clamp_round_log_matrix(scale: float, num_classes: int) -> np.ndarray:
    """``log P(output o | label y)`` of ``clamp(round(y + Lap(scale)), 0, K-1)``: output o collects
    ``y + L`` in [o - 1/2, o + 1/2), the end labels collect everything beyond them."""
    b = v.positive("scale", scale)
    k = v.positive_int("num_classes", num_classes, minimum=2)
    out = np.empty((k, k))
    for y in range(k):
        for o in range(k):
            lo = -math.inf if o == 0 else o - 0.5 - y
            hi = math.inf if o == k - 1 else o + 0.5 - y
            out[y, o] = _laplace_interval_logprob(lo, hi, b)
    return out


def clamp_round_keep_prob(scale: float, num_classes: int, label_freq=None) -> float:
    """P(clamp(round(y + Lap(scale)), 0, K-1) = y), averaged over ``label_freq`` (default uniform):
    ``1 - e^(-1/(2b))`` for inner labels and ``1 - e^(-1/(2b)) / 2`` for 0 and K - 1."""
    diag = np.exp(np.diag(clamp_round_log_matrix(scale, num_classes)))
    w = _label_weights(label_freq, num_classes)
    return float(np.dot(w, diag))


def laplace_argmax_flip_prob(epsilon: float, num_classes: int, sensitivity: float = ONE_HOT_SENSITIVITY) -> float:
    """P(argmax(e_y + Lap(b)^K) != y) with ``b = sensitivity / epsilon``, by numerical integration.

    The true class scores 1 + N_y, each other class N_j, all i.i.d. Laplace(b); it wins iff every
    N_j < 1 + N_y, so the keep probability is  integral f(t) F(1 + t)^(K-1) dt  (f, F the Laplace
    density and CDF) and the flip probability  integral f(t) (1 - F(1 + t)^(K-1)) dt. In units of b
    (c = 1/b), integrated on the pieces where the integrand is smooth, (-inf, -c), (-c, 0),
    (0, inf), with ``1 - F^(K-1)`` as ``-expm1((K-1) log F)`` so that tiny flip probabilities (large
    epsilon) keep their relative accuracy. Ties have probability 0.
    """
    from scipy.integrate import quad

    epsilon = v.positive("epsilon", epsilon)
    k = v.positive_int("num_classes", num_classes, minimum=2)
    c = 1.0 / laplace_scale(epsilon, sensitivity)

    def log_cdf(x: float) -> float:
        return math.log(0.5) + x if x < 0 else math.log1p(-0.5 * math.exp(-x))

    def integrand(u: float) -> float:
        return 0.5 * math.exp(-abs(u)) * -math.expm1((k - 1) * log_cdf(u + c))

    total = 0.0
    for lo, hi in ((-math.inf, -c), (-c, 0.0), (0.0, math.inf)):
        val, _ = quad(integrand, lo, hi, epsabs=0.0, epsrel=1e-11, limit=200)
        total += val
    return min(max(total, 0.0), (k - 1) / k)


def laplace_argmax_keep_prob(epsilon: float, num_classes: int, sensitivity: float = ONE_HOT_SENSITIVITY) -> float:
    """P(argmax(e_y + Lap(b)^K) = y): one minus ``laplace_argmax_flip_prob``."""
    return 1.0 - laplace_argmax_flip_prob(epsilon, num_classes, sensitivity)


def laplace_keep_prob(epsilon: float, num_classes: int, *, task: str = "classification",
                      postprocess: str = "argmax", label_freq=None) -> float:
    """Keep probability of the Laplace label release at ``epsilon`` (see ``analytic_keep_prob``)."""
    v.choice("task", task, TASKS)
    v.choice("postprocess", postprocess, POSTPROCESS)
    if task == "classification" and postprocess == "argmax":
        return laplace_argmax_keep_prob(epsilon, num_classes)
    return clamp_round_keep_prob(laplace_scale(epsilon, scalar_sensitivity(num_classes)), num_classes, label_freq)


def analytic_keep_prob(mechanism: str, epsilon: float | None, num_classes: int, *,
                       task: str = "classification", postprocess: str = "argmax", label_freq=None) -> float:
    """The exact probability that a training label comes out of the release unchanged.

    rr: ``e^eps / (e^eps + K - 1)``; laplace + argmax: ``laplace_argmax_keep_prob``; laplace +
    clamp_round and laplace regression (a released value counts as kept when it rounds to the
    true digit): ``clamp_round_keep_prob`` averaged over ``label_freq``; none: 1.
    """
    v.choice("mechanism", mechanism, MECHANISMS)
    if mechanism == "none" or epsilon is None:
        return 1.0
    if mechanism == "lp2st":
        raise ValueError("mechanism 'lp2st' has no closed-form keep probability (it depends on the stage-1 "
                         "model's prior): LabelDPTrainer.privacy() averages the exact per-example values")
    if mechanism in ("rr", "lp1st"):
        return rr_keep_prob(epsilon, num_classes)
    return laplace_keep_prob(epsilon, num_classes, task=task, postprocess=postprocess, label_freq=label_freq)


# --------------------------------------------------------------------------- the release


@dataclass
class LabelRelease:
    """The released training labels and the parameters actually used to draw them."""

    labels: torch.Tensor          # int64 [N] (classification) or float32 [N] (regression)
    task: str
    mechanism: str                # "laplace", "rr", "lp1st", "lp2st" or "none"
    postprocess: str
    num_classes: int
    noise_scale: float = math.nan   # Laplace scale b actually used
    sensitivity: float = math.nan   # L1 sensitivity the scale was calibrated to
    flip_prob: float = math.nan     # RR flip probability actually used
    epsilon_value: float = math.nan  # lp1st / lp2st: the epsilon RRWithPrior was run with

    def epsilon(self) -> float:
        """Epsilon of the release (delta = 0), from the drawn mechanism's parameters."""
        if self.mechanism == "none":
            return math.inf
        if self.mechanism in ("lp1st", "lp2st"):
            return self.epsilon_value
        if self.mechanism == "rr":
            return rr_epsilon(self.flip_prob, self.num_classes)
        return self.sensitivity / self.noise_scale

    def label_epsilon(self) -> float:
        """Exact epsilon of the labels after post-processing (<= ``epsilon()``).

        argmax: the output is RR-shaped (keep p, each other label (1-p)/(K-1) by symmetry), so
        ``log(p (K-1) / (1-p))``; clamp_round: the largest log-ratio of the exact output matrix;
        regression: clamping keeps atoms at 0 and 9 whose ratio is exactly e^eps, so epsilon.
        """
        if self.mechanism != "laplace":
            return self.epsilon()   # RR and RRWithPrior spend exactly epsilon (k* >= 2 somewhere)
        if self.task == "regression":
            return self.epsilon()
        if self.postprocess == "argmax":
            q = laplace_argmax_flip_prob(self.epsilon(), self.num_classes, self.sensitivity)
            return rr_epsilon(q, self.num_classes)
        lm = clamp_round_log_matrix(self.noise_scale, self.num_classes)
        return float(max(0.0, (lm.max(axis=0) - lm.min(axis=0)).max()))

    def kept(self, y: torch.Tensor) -> torch.Tensor:
        """Boolean [N]: the released label equals the true one (regression: rounds to it)."""
        lab = self.labels.to(y.device)
        if self.task == "regression":
            lab = torch.round(lab)
        return lab.to(torch.int64) == y.to(torch.int64)

    def meta(self) -> dict:
        out = asdict(self)
        out.pop("labels")
        return out


def release_labels(y: torch.Tensor, *, num_classes: int, task: str, mechanism: str, epsilon: float | None,
                   generator: torch.Generator, postprocess: str = "argmax") -> LabelRelease:
    """Release the labels ``y`` once through the chosen mechanism (see the module docstring).

    ``epsilon=None`` or ``mechanism="none"``: the true labels (no noise, epsilon = inf).
    The returned labels live on CPU; the noisy one-hot vectors are not kept (only their argmax).
    """
    k = v.positive_int("num_classes", num_classes, minimum=2)
    v.choice("task", task, TASKS)
    v.choice("mechanism", mechanism, MECHANISMS)
    v.choice("postprocess", postprocess, POSTPROCESS)
    _check_labels(y, k)
    _check_generator(generator)
    y = y.detach().to("cpu", torch.int64)
    if mechanism == "none" or epsilon is None:
        labels = y.clone() if task == "classification" else y.to(torch.float32)
        return LabelRelease(labels, task, "none", postprocess, k)
    epsilon = v.positive("epsilon", epsilon)
    if mechanism in ("lp1st", "lp2st") and task != "classification":
        raise ValueError(f"mechanism {mechanism!r} applies to task 'classification' only")
    if mechanism == "lp2st":
        raise ValueError("mechanism 'lp2st' releases in two stages (the second needs the first stage's model): "
                         "use LabelDPTrainer or dpmech.label_dp.recipe.train_label_dp")
    if mechanism == "lp1st":
        from dpmech.label_dp.rr_prior import rr_with_prior, uniform_prior

        labels, _ = rr_with_prior(y, uniform_prior(y.shape[0], k), epsilon, generator)
        return LabelRelease(labels, task, "lp1st", postprocess, k, epsilon_value=epsilon)
    if mechanism == "rr":
        q = rr_flip_prob(epsilon, k)
        labels = randomized_response(y, k, q, generator)
        if task == "regression":
            labels = labels.to(torch.float32)
        return LabelRelease(labels, task, "rr", postprocess, k, flip_prob=q)
    if task == "classification" and postprocess == "argmax":
        sens = ONE_HOT_SENSITIVITY
        b = laplace_scale(epsilon, sens)
        labels = laplace_one_hot(y, k, b, generator).argmax(dim=1)
        return LabelRelease(labels, task, "laplace", postprocess, k, noise_scale=b, sensitivity=sens)
    sens = scalar_sensitivity(k)
    b = laplace_scale(epsilon, sens)
    value = laplace_value(y, b, generator).clamp_(0.0, k - 1.0)   # post-processing into [0, K-1]
    if task == "classification":                                   # clamp_round: the source's labels
        labels = torch.round(value).to(torch.int64)
    else:
        labels = value.to(torch.float32)
    return LabelRelease(labels, task, "laplace", postprocess, k, noise_scale=b, sensitivity=sens)


# --------------------------------------------------------------------------- helpers


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator (every random draw takes one explicitly), "
                         f"got {type(generator).__name__}")


def _check_labels(y: torch.Tensor, k: int) -> None:
    if not torch.is_tensor(y) or y.dim() != 1 or y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ValueError(f"y must be a 1-D integer tensor of labels, got {getattr(y, 'dtype', type(y).__name__)}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= k):
        raise ValueError(f"y must hold labels in [0, {k - 1}], got [{int(y.min())}, {int(y.max())}]")


def _label_weights(label_freq, k: int) -> np.ndarray:
    if label_freq is None:
        return np.full(k, 1.0 / k)
    w = np.asarray(label_freq, dtype=np.float64)
    if w.shape != (k,) or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"label_freq must be {k} non-negative finite weights with a positive sum")
    return w / w.sum()
