"""Empirical privacy audit in one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

A claimed epsilon is only as good as the code behind it. The audit inserts m canaries, each
included in the training set independently with probability 1/2 (the secret S_i), trains once,
scores every canary with a membership score computed from the trained model only (higher = more
likely a member), and guesses: the k_+ highest-scoring canaries "in", the k_- lowest "out", the
rest abstain. With r = k_+ + k_- guesses of which v are right:

* Steinke et al. Thm 3.1 (epsilon-DP): the number of correct guesses W is stochastically dominated
  by Binomial(r, e^eps / (1 + e^eps)) — the canaries' independent inclusion is what makes one run
  enough (no group privacy). So every eps with P[Binomial(r, p_eps) >= v] <= beta is rejected at
  level beta, and the largest such eps is a (1 - beta)-confidence **lower bound** on epsilon.
* (epsilon, delta)-DP: Steinke et al. Cor. 5.4 (their App. D, ``p_value_DP_audit``; also
  jax_privacy's ``auditing.py``): P[W >= v] <= F(v) + 2 m delta alpha, with F(v) =
  P[Binomial(r, p_eps) >= v] and alpha = max_{1 <= i <= v} (F(v - i) - F(v)) / i <= 1. The
  delta term is weighted by alpha, so it is far smaller than 2 m delta when the binomial has
  little mass just below v (m = 1,000, r = v = 200, delta = 1e-5: 4.17, against 4.03 with the
  unweighted 2 m delta).

The audit can only *refute* a claim (lower bound above the claimed epsilon) or fail to: a bound
below the claim does not prove the claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binom

from dpmech import _validate as v


@dataclass
class Canaries:
    """m canary examples with random (wrong) labels and their secret membership bits."""

    x: torch.Tensor
    y: torch.Tensor
    included: np.ndarray          # bool, S_i = +1

    @property
    def m(self) -> int:
        return int(self.included.shape[0])

    def members(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The canaries that join the training set."""
        idx = torch.from_numpy(np.flatnonzero(self.included))
        return self.x[idx], self.y[idx]


def make_canaries(x_pool: torch.Tensor, y_pool: torch.Tensor, m: int, num_classes: int, seed: int) -> Canaries:
    """Draw m canaries from a pool of examples outside the training and evaluation sets, give each
    a uniformly random *wrong* label (mislabelled examples are the easiest to detect, so the audit
    is as strong as a black-box loss audit gets), and include each with probability 1/2."""
    m = v.positive_int("audit_canaries", m)
    if x_pool.shape[0] < m:
        raise ValueError(f"audit_canaries: {m} canaries need {m} examples outside the training and evaluation "
                         f"sets, only {x_pool.shape[0]} are available (lower train_size or test_size)")
    gen = torch.Generator().manual_seed(int(seed) ^ 0x5EED_CA7)
    pick = torch.randperm(x_pool.shape[0], generator=gen)[:m]
    y_true = y_pool[pick]
    shift = torch.randint(1, num_classes, (m,), generator=gen)
    y = (y_true + shift.to(y_true.device)) % num_classes
    included = torch.rand(m, generator=gen).numpy() < 0.5
    return Canaries(x_pool[pick].clone(), y.clone(), included)


def guesses(scores: np.ndarray, k_pos: int, k_neg: int) -> np.ndarray:
    """+1 for the k_pos highest scores, -1 for the k_neg lowest, 0 (abstain) otherwise."""
    scores = np.asarray(scores, dtype=np.float64)
    if k_pos + k_neg > scores.shape[0]:
        raise ValueError(f"audit: {k_pos} + {k_neg} guesses exceed the {scores.shape[0]} canaries")
    order = np.argsort(scores, kind="stable")
    out = np.zeros(scores.shape[0], dtype=np.int64)
    if k_neg:
        out[order[:k_neg]] = -1
    if k_pos:
        out[order[scores.shape[0] - k_pos:]] = 1
    return out


def p_value(m: int, r: int, v_correct: int, epsilon: float, delta: float = 0.0) -> float:
    """P-value of ``v_correct`` right guesses among ``r`` under the null hypothesis that the
    mechanism is (epsilon, delta)-DP, with ``m`` canaries (Steinke et al. 2023, Cor. 5.4):

        min(1, F(v) + 2 m delta alpha),  F(u) = P[Binomial(r, e^eps / (1 + e^eps)) >= u],
        alpha = max_{1 <= i <= v} (F(v - i) - F(v)) / i.
    """
    _check_counts(m, r, v_correct)
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v_correct - 1, r, q))   # F(v)
    if delta == 0 or v_correct == 0:
        return min(tail, 1.0)
    i = np.arange(1, v_correct + 1)
    below = binom.sf(v_correct - i - 1, r, q) - tail  # F(v - i) - F(v) = P[v - i <= W < v]
    alpha = float(np.max(below / i))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def _check_counts(m, r, v_correct) -> None:
    for name, value in (("m", m), ("r", r), ("v_correct", v_correct)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not v_correct <= r <= m:
        raise ValueError(f"audit counts must satisfy v_correct <= r <= m, got v_correct={v_correct}, r={r}, m={m}")


def audit_possible(m: int, delta: float, beta: float = 0.05, r: int | None = None) -> bool:
    """Whether ``r`` guesses (default: every one of the m canaries) can reject any epsilon at all
    at level ``beta``: the best outcome (all r right) must reject epsilon = 0, i.e.
    ``p_value(m, r, r, 0, delta) < beta``. The p-value grows with epsilon, so when this fails no
    outcome of the audit can ever give a bound above 0."""
    r = m if r is None else r
    if r == 0:
        return False
    return p_value(m, r, r, 0.0, delta) < beta


def epsilon_lower_bound(r: int, v_correct: int, *, beta: float = 0.05, delta: float = 0.0,
                        m: int | None = None) -> float:
    """The largest epsilon rejected at level ``beta``: ``p_value(m, r, v, eps, delta) <= beta``
    for every smaller eps (Steinke et al. 2023, Cor. 5.4 and App. D's ``get_eps_audit``); 0 when
    no epsilon is rejected. A (1 - beta)-confidence lower bound on the mechanism's epsilon.

    ``m`` (the number of canaries, not the number of guesses) is required when ``delta > 0``.
    The bisection returns the low end of its final bracket (never above the exact bound).
    """
    beta = v.open_unit("beta", beta)
    delta = v.unit_interval("delta", delta, high_open=True)
    if m is None:
        if delta > 0:
            raise ValueError("m: the number of canaries is required when delta > 0 (the delta term is 2 m delta alpha)")
        m = r
    _check_counts(m, r, v_correct)
    if r == 0 or v_correct == 0:
        return 0.0
    if delta > 0 and audit_possible(m, 0.0, beta, r) and not audit_possible(m, delta, beta, r):
        raise ValueError(f"delta: with m = {m} canaries, r = {r} guesses and delta = {delta:g}, even {r} right guesses "
                         f"reject no epsilon at beta = {beta} (the term 2 m delta alpha is too large); use fewer "
                         "canaries or a larger beta")

    def rejected(eps: float) -> bool:  # the p-value grows with eps: the rejected set is [0, bound)
        return p_value(m, r, v_correct, eps, delta) <= beta

    if not rejected(0.0):
        return 0.0
    return largest_rejected(rejected, 0.0, cap=1e4, tol=1e-12)


def largest_rejected(rej, lo: float, *, cap: float, tol: float) -> float:
    """The largest parameter that ``rej`` rejects, given that ``lo`` is rejected and the rejected
    set is an interval from ``lo`` up (monotone): doubling to bracket it (at most ``cap``), then
    bisection; the low end of the final bracket, so never above the exact value. Every one-run
    bound here (epsilon, mu) is found this way."""
    hi = 1.0
    while rej(hi):
        lo, hi = hi, hi * 2
        if hi > cap:
            return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if rej(mid):
            lo = mid
        else:
            hi = mid
    return lo


def guess_counts(m: int, guess_fraction: float) -> tuple[int, int]:
    """(k_+, k_-): round(m * guess_fraction) guesses (at least 1, at most m), split in half; an odd
    total gives the extra guess to "in". So ``guess_fraction = 1`` guesses every canary, also
    for odd m and m = 1."""
    m = v.positive_int("audit_canaries", m)
    total = min(m, max(1, int(round(m * guess_fraction))))
    return total - total // 2, total // 2


def guess_outcome(scores, included, guess_fraction: float, name: str = "audit_guess_fraction"
                  ) -> tuple[int, int, int]:
    """``(m, r, v)``: canaries, guesses and right guesses when the top and bottom ``guess_fraction``
    / 2 of the scores are guessed "in" and "out" (fixed in advance, so no bound is tuned on the
    outcome; the one guessing rule of every estimator here)."""
    included = np.asarray(included, dtype=bool)
    m = included.shape[0]
    guess_fraction = v.unit_interval(name, guess_fraction, low_open=True)
    g = guesses(scores, *guess_counts(m, guess_fraction))
    r = int(np.count_nonzero(g))
    return m, r, int(np.count_nonzero(g * np.where(included, 1, -1) == 1))


def audit(scores: np.ndarray, included: np.ndarray, *, guess_fraction: float = 0.2, beta: float = 0.05,
          delta: float = 0.0) -> dict[str, float]:
    """The one-run audit of a set of canary scores: guesses on ``guess_fraction`` of the canaries
    (half "in", half "out"), fixed in advance so the bound is not tuned on the outcome."""
    m, r, correct = guess_outcome(scores, included, guess_fraction)
    return {"epsilon_lower_bound": epsilon_lower_bound(r, correct, beta=beta, delta=delta, m=m),
            "audit_canaries": float(m), "audit_guesses": float(r), "audit_correct": float(correct),
            "audit_beta": float(beta)}


@torch.no_grad()
def loss_scores(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """Membership scores of a classifier: the negative cross-entropy of each canary (members are fit)."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, x.shape[0], batch_size):
        logits = model(x[i:i + batch_size])
        out.append(-torch.nn.functional.cross_entropy(logits, y[i:i + batch_size], reduction="none").cpu())
    model.train(was_training)
    return torch.cat(out).numpy().astype(np.float64)
