"""What a membership inference attack's scores say, with their uncertainty (docs/mia.md).

Every function here takes the attack's scores (one per candidate, higher = "more likely a member")
and the game's membership vector; only :meth:`dpmech.privacy.mia.game.MembershipGame.evaluate`
holds both. Nothing here trains or queries a model.

* :func:`auc_with_interval`: the ROC AUC (Mann-Whitney, ties count 1/2) and DeLong et al. (1988)'s
  asymptotic normal interval.
* :func:`tpr_at_fpr`: the true-positive rate at the largest threshold whose *empirical* false-positive
  rate is at most ``fpr`` (Carlini et al. 2022, Sec. III-B: TPR at low FPR), with a two-sided
  Clopper-Pearson interval for the number of members, and the Clopper-Pearson upper bound of the FPR
  actually attained for the number of non-members (with fewer than 1 / fpr non-members the level
  cannot be resolved: "TPR at FPR 0.1%" on 250 non-members is the TPR at zero false positives, whose
  FPR is only known to be below 1.2% at 95%).
* :func:`epsilon_lower_bounds`: the epsilon at ``delta`` that the attack's guesses refute, at a stated
  confidence, **maximised over a grid of thresholds fixed before the run with a Bonferroni split**:

  - ``eps_lb`` (the one reported as ``mia_eps_lb``): the guesses "member" for the k highest scores
    (abstaining on the rest) are a one-run audit (Steinke, Nasr & Jagielski 2023): the candidates'
    membership bits are independent fair coins and the target is trained once, which is exactly their
    game, so Cor. 5.4 (``dpmech.privacy.audit.one_run.epsilon_lower_bound``, reused) bounds the number
    of members among the k guesses -- the true positives TP = v among r = TP + FP guesses -- for any
    (epsilon, delta)-DP training. It holds for one training run, where the candidates' outcomes are
    not independent trials.
  - ``eps_lb_rates``: the hypothesis-testing reading of the MIA literature (Kairouz et al. 2015's
    region, used by Jagielski et al. 2020 and Nasr et al. 2021): TPR <= e^eps FPR + delta, so eps >=
    log((TPR_lo - delta) / FPR_hi) with one-sided Clopper-Pearson bounds on both rates (each at
    beta / (2 G): a union bound over the two rates and the G thresholds). Clopper-Pearson treats each
    candidate as an independent trial, which holds when every candidate comes from its own training
    run; in one run it is not proven, so this figure is reported beside ``eps_lb`` and is not the one
    compared with the claim.

  A threshold grid in *counts* (guess the top k, k = round(f n) for f in ``guess_fractions``) is a
  function of the scores alone, fixed before the membership is looked at, so the maximum over the G
  distinct k is a (1 - beta)-confidence bound once each k is tested at beta / G.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import norm

from dpmech import _validate as v
from dpmech.privacy.audit.one_run import audit_possible, epsilon_lower_bound
from dpmech.robustness.certification import clopper_pearson

FPR_LEVELS = (0.001, 0.01)
GUESS_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def check_scores(scores, membership) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, membership)`` as float64 / bool arrays of one entry per candidate; refused when the
    shapes differ, a score is not finite, or there are fewer than 2 members or 2 non-members."""
    s = np.asarray(scores, dtype=np.float64)
    m = np.asarray(membership)
    if m.dtype != np.bool_:
        raise ValueError(f"membership must be a bool array, got dtype {m.dtype}")
    if s.ndim != 1 or s.shape != m.shape:
        raise ValueError(f"scores: need one score per candidate, got shape {s.shape} for {m.shape[0]} candidates")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores: every candidate's score must be finite")
    n1 = int(m.sum())
    if n1 < 2 or m.shape[0] - n1 < 2:
        raise ValueError(f"membership: need at least 2 members and 2 non-members, got {n1} and {m.shape[0] - n1}")
    return s, m


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(x.shape[0], dtype=np.float64)
    i = 0
    n = x.shape[0]
    while i < n:
        j = i
        while j + 1 < n and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def auc_with_interval(scores, membership, *, confidence: float = 0.95) -> tuple[float, float, float]:
    """``(auc, lo, hi)``: the probability that a random member scores above a random non-member
    (ties 1/2; Mann-Whitney), and DeLong, DeLong & Clarke-Pearson (1988)'s two-sided interval at
    ``confidence``: var(AUC) = var(V10) / n1 + var(V01) / n0 from the structural components V10 (each
    member's share of non-members below it) and V01 (each non-member's share of members above it),
    normal quantiles, cut to [0, 1]. Asymptotic; its width is 0 at AUC 0 or 1 (perfect separation)."""
    s, m = check_scores(scores, membership)
    confidence = v.open_unit("confidence", confidence)
    x, y = s[m], s[~m]
    n1, n0 = x.shape[0], y.shape[0]
    r_all = _midranks(np.concatenate([x, y]))
    r_x, r_y = r_all[:n1], r_all[n1:]
    auc = float((r_x.sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))
    v10 = (r_x - _midranks(x)) / n0
    v01 = 1.0 - (r_y - _midranks(y)) / n1
    se = math.sqrt(np.var(v10, ddof=1) / n1 + np.var(v01, ddof=1) / n0)
    z = float(norm.ppf(0.5 + confidence / 2.0))
    return auc, max(0.0, auc - z * se), min(1.0, auc + z * se)


def roc_counts(scores, membership) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(thresholds, tp, fp)``: for each distinct score t (descending) the members and non-members with
    score >= t; a first row (inf, 0, 0) guesses no one. Ties are never split."""
    s, m = check_scores(scores, membership)
    order = np.argsort(-s, kind="mergesort")
    ss, mm = s[order], m[order]
    last = np.r_[np.flatnonzero(ss[1:] != ss[:-1]), ss.shape[0] - 1]   # the last index of each distinct value
    tp = np.cumsum(mm)[last]
    fp = np.cumsum(~mm)[last]
    return np.r_[np.inf, ss[last]], np.r_[0, tp], np.r_[0, fp]


@dataclass(frozen=True)
class RateAtFPR:
    """TPR at a target FPR: the rate, its interval, and the counts it was read from."""

    fpr_target: float
    tpr: float
    tpr_lo: float            # two-sided Clopper-Pearson at `confidence`, n1 members
    tpr_hi: float
    tp: int
    members: int
    fp: int
    non_members: int
    fpr_hi: float            # one-sided (1 - confidence) upper Clopper-Pearson bound of the attained FPR
    threshold: float


def tpr_at_fpr(scores, membership, fpr: float, *, confidence: float = 0.95) -> RateAtFPR:
    """The TPR at the lowest threshold whose empirical FPR is <= ``fpr`` (FP <= floor(fpr n0)), with a
    two-sided Clopper-Pearson interval at ``confidence`` for the n1 members. The threshold is read
    off the non-members' scores, so the interval is conditional on it (it covers the TPR of that
    threshold, not of the threshold that would attain ``fpr`` exactly)."""
    fpr = v.unit_interval("fpr", fpr, high_open=True)
    confidence = v.open_unit("confidence", confidence)
    s, m = check_scores(scores, membership)
    thresholds, tp, fp = roc_counts(s, m)
    n1, n0 = int(m.sum()), int((~m).sum())
    ok = np.flatnonzero(fp <= math.floor(fpr * n0 + 1e-9))
    i = int(ok[-1])                       # fp is non-decreasing: the last admissible row has the largest TP
    lo, hi = clopper_pearson(int(tp[i]), n1, 1.0 - confidence)
    _, fpr_hi = clopper_pearson(int(fp[i]), n0, 2.0 * (1.0 - confidence))
    return RateAtFPR(fpr, float(tp[i]) / n1, float(lo), float(hi), int(tp[i]), n1, int(fp[i]), n0, float(fpr_hi),
                     float(thresholds[i]))


def guess_counts(n: int, guess_fractions=GUESS_FRACTIONS) -> list[int]:
    """The distinct k = max(1, round(f n)) of the grid (k <= n): how many top-scoring candidates each
    threshold guesses "member". A function of n alone, so fixed before the run."""
    n = v.positive_int("candidates", n)
    fr = list(guess_fractions)
    if not fr:
        raise ValueError("guess_fractions: give at least one fraction in (0, 1]")
    for f in fr:
        v.unit_interval("guess_fractions", f, low_open=True)
    return sorted({min(n, max(1, int(round(f * n)))) for f in fr})


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores, ties broken by candidate index (a public order, drawn before
    the membership): a function of the scores alone."""
    order = np.lexsort((np.arange(scores.shape[0]), -scores))
    return order[:k]


def epsilon_lower_bounds(scores, membership, *, delta: float, confidence: float = 0.95,
                         guess_fractions=GUESS_FRACTIONS) -> dict[str, float]:
    """The epsilon at ``delta`` that the attack refutes with ``confidence``, maximised over the
    threshold grid :func:`guess_counts` with a Bonferroni split (the module docstring):

    * ``eps_lb``: max over k of Steinke et al. (2023) Cor. 5.4 on r = k guesses "member" with v = TP
      right, at level beta / G (:func:`dpmech.privacy.audit.one_run.epsilon_lower_bound` with m = n
      candidates); valid for one training run.
    * ``eps_lb_rates``: max over k of log((TPR_lo - delta) / FPR_hi), one-sided Clopper-Pearson bounds
      at beta / (2 G) each (0 where TPR_lo <= delta); the independent-trials reading.

    Also ``eps_lb_k`` (the k of ``eps_lb``), ``eps_lb_tp``/``eps_lb_fp`` there, and ``thresholds`` = G.
    """
    s, m = check_scores(scores, membership)
    delta = v.unit_interval("delta", delta, high_open=True)
    confidence = v.open_unit("confidence", confidence)
    beta = 1.0 - confidence
    n = s.shape[0]
    n1, n0 = int(m.sum()), int((~m).sum())
    ks = guess_counts(n, guess_fractions)
    g = len(ks)
    # A threshold whose k guesses could not reject epsilon = 0 even if all were right, once the delta term
    # 2 n delta alpha is added, contributes 0 (small k at large n delta); if that is every threshold while
    # delta = 0 would allow one, the configuration can never give a bound and is refused.
    usable = [k for k in ks if audit_possible(n, delta, beta / g, k)]
    if not usable and any(audit_possible(n, 0.0, beta / g, k) for k in ks):
        raise ValueError(f"delta: with {n} candidates and delta = {delta:g}, no threshold of the grid can reject any "
                         f"epsilon at confidence {confidence} over {g} thresholds (the one-run bound's term "
                         "2 n delta alpha is too large); use fewer candidates or a lower confidence")
    best = {"eps_lb": 0.0, "eps_lb_k": 0, "eps_lb_tp": 0, "eps_lb_fp": 0, "eps_lb_rates": 0.0}
    for k in ks:
        tp = int(m[_top_k(s, k)].sum())
        fp = k - tp
        e1 = epsilon_lower_bound(k, tp, beta=beta / g, delta=delta, m=n) if k in usable else 0.0
        if e1 > best["eps_lb"]:
            best.update(eps_lb=e1, eps_lb_k=k, eps_lb_tp=tp, eps_lb_fp=fp)
        b = beta / (2 * g)
        tpr_lo, _ = clopper_pearson(tp, n1, 2 * b)
        _, fpr_hi = clopper_pearson(fp, n0, 2 * b)
        if float(tpr_lo) > delta:
            best["eps_lb_rates"] = max(best["eps_lb_rates"], math.log((float(tpr_lo) - delta) / float(fpr_hi)))
    best["thresholds"] = g
    return best


@dataclass(frozen=True)
class MiaResult:
    """One attack on one target: the figures of docs/mia.md and what they were computed at."""

    attack: str
    candidates: int
    members: int
    references: int
    confidence: float
    delta: float
    auc: float
    auc_lo: float
    auc_hi: float
    rates: tuple[RateAtFPR, ...]
    eps_lb: float
    eps_lb_rates: float
    eps_detail: dict = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Flat metric names (docs/mia.md): ``mia_auc``, ``mia_tpr_at_fpr_<fpr>`` (e.g.
        ``mia_tpr_at_fpr_0.001``), ``mia_eps_lb`` and their intervals and counts."""
        out = {"mia_auc": self.auc, "mia_auc_lo": self.auc_lo, "mia_auc_hi": self.auc_hi}
        for r in self.rates:
            key = f"mia_tpr_at_fpr_{r.fpr_target:g}"
            out[key] = r.tpr
            out[key + "_lo"] = r.tpr_lo
            out[key + "_hi"] = r.tpr_hi
            out[f"mia_fpr_hi_at_fpr_{r.fpr_target:g}"] = r.fpr_hi
        out.update({"mia_eps_lb": self.eps_lb, "mia_eps_lb_rates": self.eps_lb_rates,
                    "mia_candidates": float(self.candidates), "mia_members": float(self.members),
                    "mia_references": float(self.references), "mia_confidence": self.confidence,
                    "mia_delta": self.delta})
        return {k: float(val) for k, val in out.items()}


def evaluate_scores(scores, membership, *, attack: str = "", references: int = 0, delta: float,
                    confidence: float = 0.95, fpr_levels=FPR_LEVELS,
                    guess_fractions=GUESS_FRACTIONS) -> MiaResult:
    """Every figure of one attack's scores against the membership (AUC with its interval, TPR at each
    of ``fpr_levels``, the epsilon lower bounds at ``delta``), all at ``confidence``."""
    s, m = check_scores(scores, membership)
    auc, lo, hi = auc_with_interval(s, m, confidence=confidence)
    rates = tuple(tpr_at_fpr(s, m, f, confidence=confidence) for f in fpr_levels)
    eps = epsilon_lower_bounds(s, m, delta=delta, confidence=confidence, guess_fractions=guess_fractions)
    return MiaResult(attack, int(s.shape[0]), int(m.sum()), int(references), float(confidence), float(delta),
                     auc, lo, hi, rates, float(eps["eps_lb"]), float(eps["eps_lb_rates"]),
                     {k: eps[k] for k in ("eps_lb_k", "eps_lb_tp", "eps_lb_fp", "thresholds")})
