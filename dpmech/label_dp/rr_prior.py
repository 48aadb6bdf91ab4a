"""Randomized response with a prior (Ghazi, Golowich, Kumar, Manurangsi, Zhang, "Deep Learning with
Label Differential Privacy", NeurIPS 2021, Algorithm 2 "RRWithPrior", and its building block
Algorithm 1 "RR-Top-k"), for label DP with substitution neighbours (docs/label_dp.md).

For one example with true label y in {0..K-1} and a prior p over the K labels (any probability
vector that depends on the example's image and on earlier private releases only, never on y):

* RR-Top-k (Alg. 1): let Y_k be the k labels of highest prior (ties broken by the lower class
  index). If y is in Y_k, output y with probability ``e^eps / (e^eps + k - 1)`` and each other
  label of Y_k with probability ``1 / (e^eps + k - 1)``; if y is outside Y_k, output a label of
  Y_k uniformly at random (probability 1/k each).
* RRWithPrior (Alg. 2): ``k* = argmax_k  e^eps / (e^eps + k - 1) * sum_{y' in Y_k} p_y'`` (the
  expected probability that the output is the true label if y ~ p; the smallest k on ties), then
  RR-Top-k* .

Privacy (Ghazi et al., Lemma 2 / Thm. 3): k* and Y_k depend on p only, and for every output o in Y_k
the probabilities over y are e^eps / (e^eps+k-1) (y = o), 1 / (e^eps+k-1) (y in Y_k, y != o) and
1/k (y outside Y_k), whose largest ratio is e^eps (attained whenever k >= 2; for k = 1 the output
is the top label whatever y is: ratio 1). Outputs outside Y_k have probability 0 for every y.

With a uniform prior ``sum_{Y_k} p = k/K`` and ``k / (e^eps + k - 1)`` increases with k, so
k* = K: RRWithPrior is K-ary randomized response (LP-1ST is RR).

All probabilities are computed in a form that stays finite at large epsilon:
``e^eps / (e^eps + k - 1) = 1 / (1 + (k - 1) e^-eps)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpmech import _validate as v

__all__ = ["top_k_order", "rr_prior_choose_k", "rr_top_k", "rr_with_prior", "rr_top_k_matrix",
           "rr_prior_matrix", "matrix_epsilon", "uniform_prior"]


def _check_prior(prior: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(prior) or prior.dim() != 2 or prior.shape[1] < 2 or prior.shape[0] == 0:
        raise ValueError(f"prior must be a [N, K] tensor with K >= 2 and N >= 1, got "
                         f"{tuple(prior.shape) if torch.is_tensor(prior) else type(prior).__name__}")
    p = prior.detach().to("cpu", torch.float64)
    if not torch.isfinite(p).all() or (p < 0).any():
        raise ValueError("prior must hold finite non-negative probabilities")
    s = p.sum(1)
    if (s <= 0).any():
        raise ValueError("prior must have a positive sum in every row")
    return p / s[:, None]


def _check_y(y: torch.Tensor, n: int, k: int) -> torch.Tensor:
    if not torch.is_tensor(y) or y.dim() != 1 or y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ValueError(f"y must be a 1-D integer tensor of labels, got {getattr(y, 'dtype', type(y).__name__)}")
    if y.shape[0] != n:
        raise ValueError(f"y must have one label per prior row ({n}), got {y.shape[0]}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= k):
        raise ValueError(f"y must hold labels in [0, {k - 1}], got [{int(y.min())}, {int(y.max())}]")
    return y.detach().to("cpu", torch.int64)


def uniform_prior(n: int, num_classes: int) -> torch.Tensor:
    """The uniform prior (LP-1ST, and the first stage of LP-2ST): float64 [n, K] of 1/K."""
    n = v.positive_int("n", n)
    k = v.positive_int("num_classes", num_classes, minimum=2)
    return torch.full((n, k), 1.0 / k, dtype=torch.float64)


def top_k_order(prior: torch.Tensor) -> torch.Tensor:
    """Labels sorted by decreasing prior, ties by increasing class index (int64 [N, K])."""
    p = _check_prior(prior)
    return torch.sort(-p, dim=1, stable=True).indices


def _keep_prob(epsilon: float, k: torch.Tensor) -> torch.Tensor:
    """e^eps / (e^eps + k - 1) for a tensor of k, as 1 / (1 + (k - 1) e^-eps)."""
    return 1.0 / (1.0 + (k.to(torch.float64) - 1.0) * math.exp(-epsilon))


def _flip_prob(epsilon: float, k: torch.Tensor) -> torch.Tensor:
    """(k - 1) / (e^eps + k - 1), as (k-1) e^-eps / (1 + (k-1) e^-eps): keeps its relative accuracy
    when it is far below the double precision of the keep probability (large epsilon)."""
    t = (k.to(torch.float64) - 1.0) * math.exp(-epsilon)
    return t / (1.0 + t)


def rr_prior_choose_k(prior: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2's choice: ``k* = argmax_k e^eps/(e^eps+k-1) * P_prior(Y_k)`` per row (the smallest k
    among equal maxima, after rounding the objective to 12 significant digits so that ties in
    exact arithmetic stay ties). Returns (k* int64 [N], the top-k order int64 [N, K])."""
    epsilon = v.positive("epsilon", epsilon)
    p = _check_prior(prior)
    order = torch.sort(-p, dim=1, stable=True).indices
    mass = torch.gather(p, 1, order).cumsum(1)                          # P(Y_k), k = 1..K
    ks = torch.arange(1, p.shape[1] + 1, dtype=torch.float64)
    obj = _keep_prob(epsilon, ks)[None, :] * mass
    obj = torch.round(obj * 1e12) / 1e12
    kstar = obj.argmax(1) + 1                                           # argmax returns the first maximum
    return kstar.to(torch.int64), order


def rr_top_k(y: torch.Tensor, order: torch.Tensor, k: torch.Tensor, epsilon: float,
             generator: torch.Generator) -> torch.Tensor:
    """Alg. 1 (RR-Top-k) for each row: Y_k = ``order[i, :k[i]]``; returns the int64 [N] outputs.

    Sampling: the position of y in ``order`` is r. If r < k: keep y unless a uniform falls below
    the flip probability ``(k-1) e^-eps / (1 + (k-1) e^-eps)``, else position j uniform on the k - 1 other top positions; if r >= k:
    position uniform on {0..k-1}. Two float64 uniforms per example from ``generator``.
    """
    epsilon = v.positive("epsilon", epsilon)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not torch.is_tensor(order) or order.dim() != 2:
        raise ValueError("order must be an int [N, K] tensor of label permutations")
    n, kk = order.shape
    y = _check_y(y, n, kk)
    order = order.to("cpu", torch.int64)
    k = k.to("cpu", torch.int64)
    if k.shape != (n,) or (k < 1).any() or (k > kk).any():
        raise ValueError(f"k must be an int [N] tensor with 1 <= k <= K = {kk}")
    rank = (order == y[:, None]).to(torch.int64).argmax(1)              # position of y in the order
    inside = rank < k
    u_keep = torch.rand(n, generator=generator, dtype=torch.float64)
    u_pos = torch.rand(n, generator=generator, dtype=torch.float64)
    # replaced iff u < flip probability: a float64 uniform is a multiple of 2^-53, so a flip
    # probability below 2^-53 is rounded up to 2^-53 (more replacements, never fewer)
    keep = inside & ~(u_keep < _flip_prob(epsilon, k))
    # a replacement: inside -> uniform over the k-1 other top positions; outside -> uniform over k
    m_other = torch.where(inside, k - 1, k).clamp(min=1)
    j = torch.clamp((u_pos * m_other.to(torch.float64)).floor().to(torch.int64), max=m_other - 1)
    j = torch.where(inside & (j >= rank), j + 1, j)                     # skip y's own position
    pos = torch.where(keep, rank, j)
    return torch.gather(order, 1, pos[:, None]).squeeze(1)


def rr_with_prior(y: torch.Tensor, prior: torch.Tensor, epsilon: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2 (RRWithPrior): releases every label once; returns (labels int64 [N], k* int64 [N]).
    ``prior`` must not depend on ``y`` (only on images and earlier private releases)."""
    kstar, order = rr_prior_choose_k(prior, epsilon)
    out = rr_top_k(y, order, kstar, epsilon, generator)
    return out.to(y.device), kstar


def rr_top_k_matrix(order_row, k: int, epsilon: float) -> np.ndarray:
    """Exact ``M[y, o] = P(output o | true label y)`` of RR-Top-k for one example (Alg. 1)."""
    epsilon = v.positive("epsilon", epsilon)
    order_row = [int(c) for c in order_row]
    kk = len(order_row)
    k = v.positive_int("k", k)
    if k > kk:
        raise ValueError(f"k must be <= K = {kk}, got {k}")
    top = order_row[:k]
    t = math.exp(-epsilon)
    keep = 1.0 / (1.0 + (k - 1) * t)
    other = t / (1.0 + (k - 1) * t) if k > 1 else 0.0     # 1 / (e^eps + k - 1), finite at any epsilon
    m = np.zeros((kk, kk))
    for y in range(kk):
        if y in top:
            for o in top:
                m[y, o] = keep if o == y else other
        else:
            for o in top:
                m[y, o] = 1.0 / k
    return m


def rr_prior_matrix(prior_row, epsilon: float) -> np.ndarray:
    """Exact output matrix of RRWithPrior for one example with this prior (K x K)."""
    p = torch.as_tensor(np.asarray(prior_row, dtype=np.float64))[None, :]
    kstar, order = rr_prior_choose_k(p, epsilon)
    return rr_top_k_matrix(order[0].tolist(), int(kstar[0]), epsilon)


def matrix_epsilon(m: np.ndarray) -> float:
    """The smallest epsilon of a mechanism given by its output matrix: the largest
    ``log(M[y, o] / M[y', o])`` over outputs o and label pairs (inf if some output has probability
    0 under one label and not under another; outputs impossible under every label are skipped)."""
    m = np.asarray(m, dtype=np.float64)
    worst = 0.0
    for o in range(m.shape[1]):
        col = m[:, o]
        if (col == 0).all():
            continue
        if (col == 0).any():
            return math.inf
        worst = max(worst, float(np.log(col.max()) - np.log(col.min())))
    return worst


def denoise_rr_prior(p_noisy: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The stage-1 model learns P(released label | x), which K-ary RR flattens:
    ``p_noisy = q + (keep - q) p_clean`` with keep = e^eps/(e^eps+K-1), q = (1-keep)/(K-1).
    Inverting that known channel, ``p_clean = max(0, (p_noisy - q) / (keep - q))`` renormalised,
    gives the prior of the true label (post-processing of the stage-1 release: no privacy cost;
    our choice, docs/label_dp.md "LP-MST")."""
    epsilon = v.positive("epsilon", epsilon)
    k = p_noisy.shape[1]
    t = (k - 1) * math.exp(-epsilon)
    keep = 1.0 / (1.0 + t)
    q = (1.0 - keep) / (k - 1)
    clean = ((p_noisy.double() - q) / (keep - q)).clamp_min(0.0)
    s = clean.sum(1, keepdim=True)
    return torch.where(s > 0, clean / s.clamp_min(1e-300), torch.full_like(clean, 1.0 / k))
