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
* (epsilon, delta)-DP: the paper's bound adds a term proportional to delta; we take the
  conservative form P[W >= v] <= P[Binomial(r, p_eps) >= v] + 2 m delta, i.e. we spend 2 m delta of
  the level beta on it (docs/audit.md records this reading; with m = 1000 and delta = 1e-5 it costs
  0.02 of beta = 0.05).

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


def epsilon_lower_bound(r: int, v_correct: int, *, beta: float = 0.05, delta: float = 0.0, m: int | None = None) -> float:
    """The largest epsilon not rejected at level beta: P[Binomial(r, e^eps/(1+e^eps)) >= v] <= beta'
    with beta' = beta - 2 m delta (module docstring); 0 when no epsilon is rejected."""
    beta = v.open_unit("beta", beta)
    level = beta - 2 * (m or r) * delta
    if level <= 0:
        raise ValueError(f"delta: 2 m delta = {2 * (m or r) * delta:.3g} leaves nothing of beta = {beta}; "
                         "use fewer canaries or a larger beta")
    if r == 0 or v_correct == 0:
        return 0.0

    def tail(eps: float) -> float:  # P[Bin(r, p) >= v], increasing in eps
        p = 1.0 / (1.0 + math.exp(-eps))
        return float(binom.sf(v_correct - 1, r, p))

    if tail(0.0) > level:
        return 0.0
    lo, hi = 0.0, 1.0
    while tail(hi) <= level and hi < 100:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) <= level:
            lo = mid
        else:
            hi = mid
    return lo


def audit(scores: np.ndarray, included: np.ndarray, *, guess_fraction: float = 0.2, beta: float = 0.05,
          delta: float = 0.0) -> dict[str, float]:
    """The one-run audit of a set of canary scores: guesses on ``guess_fraction`` of the canaries
    (half "in", half "out"), fixed in advance so the bound is not tuned on the outcome."""
    included = np.asarray(included, dtype=bool)
    m = included.shape[0]
    guess_fraction = v.unit_interval("audit_guess_fraction", guess_fraction, low_open=True)
    k = max(1, int(round(m * guess_fraction / 2)))
    g = guesses(scores, k, k)
    secret = np.where(included, 1, -1)
    r = int(np.count_nonzero(g))
    correct = int(np.count_nonzero(g * secret == 1))
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
