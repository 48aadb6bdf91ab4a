"""Offline membership inference attacks: RMIA and LiRA (docs/mia.md, "The attacks").

Each attack is a function ``attack(view, refs, **params) -> scores`` of an
:class:`~dpmech.privacy.mia.game.AttackView` (the candidates and the target's outputs, never the
membership) and :class:`~dpmech.privacy.mia.references.ReferenceModels` (OUT models trained on
population data disjoint from the candidates). Scores are one float per candidate, higher = "more
likely a member". Citations (docs/mia.md, "The attacks"): LiRA's section, algorithm and equation
numbers were checked against the paper's text; RMIA's paper could not be read offline, so it is cited by
the names of its parts, and its offline formula and defaults were checked against the authors' code and
configurations (privacytrustlab/ml_privacy_meter ``research/2023_rmia``).

**RMIA, offline** (Zarifzadeh, Liu & Shokri, ICML 2024: the pairwise likelihood ratio LR_theta(x, z)
and Score_MIA of their attack, and its offline setting):

    Pr(x | theta)  = softmax(f_theta(x) / T)_y                  (the model's probability of the label)
    Pr(x)_OUT      = (1/K) sum_k Pr(x | theta'_k)               (K OUT reference models)
    Pr(x)          = 1/2 ((1 + a) Pr(x)_OUT + (1 - a))          (offline: Pr(x)_IN ~ a Pr(x)_OUT + (1 - a))
    LR_theta(x, z) = (Pr(x | theta) / Pr(x)) / (Pr(z | theta) / Pr(z))
    Score(x)       = Pr_z[ LR_theta(x, z) >= gamma ]            (z: population samples, no reference
                                                                 model's training data)

computed in log space (a = 1 reads Pr(x) = Pr(x)_OUT; Pr(z) by the same formula over the same models).
Defaults a = 0.33, gamma = 2, T = 2: the authors' CIFAR-10 offline configuration
(``rmia_offline_*_ref_models.yaml``: offline_a 0.33, offline_b 0.66 in p_IN(x) = a p_OUT(x) + b,
temperature 2, gamma 2) and LeakPro's defaults.

**LiRA, offline with a global variance** (Carlini et al., S&P 2022, Sec. IV-C, "Our offline attack":
Alg. 1 without its lines 5, 6, 10 and 12, the one-sided test of Eq. (4); logit scaling Sec. IV-C, its
stable form Sec. VI-A; one global variance Sec. VI-B, Fig. 9, better than per-example variances below
64 shadow models):

    phi(x; f)  = log(p / (1 - p)), p = softmax(f(x))_y  = f(x)_y - logsumexp_{j != y} f(x)_j   (logit scaling)
    mu_out(x)  = (1/K) sum_k phi(x; theta'_k)
    sigma      = one global standard deviation (K >= 2: the OUT values' spread around their own
                 mu_out(x), pooled over the candidates; K = 1: the spread of phi(x; theta'_1) over the
                 candidates, the only spread one model shows)
    score(x)   = (phi(x; theta) - mu_out(x)) / sigma

The one-sided test rejects "x is OUT" when phi is large: its p-value is 1 - Phi(score) (the paper's
Lambda = 1 - Pr[Z > phi_obs], Z ~ N(mu_out, sigma^2), their Eq. (4)). We return the standardised statistic rather
than Phi of it, which saturates at 1.0 in floating point and would tie the strongest members; the
order of the candidates (all the metrics read) is the same. With one global sigma the order does
not depend on sigma's value at all.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpmech import _validate as v
from dpmech.privacy.mia.game import AttackView, MembershipGame
from dpmech.privacy.mia.references import ReferenceModels

RMIA_DEFAULTS = {"a": 0.33, "gamma": 2.0, "temperature": 2.0}


def _check(view, refs) -> None:
    if isinstance(view, MembershipGame):
        raise TypeError("attack: give it game.attack_view(target), never the MembershipGame (which holds the "
                        "membership)")
    if not isinstance(view, AttackView):
        raise TypeError(f"attack: the first argument must be an AttackView, got {type(view).__name__}")
    if not isinstance(refs, ReferenceModels):
        raise TypeError(f"attack: refs must be ReferenceModels, got {type(refs).__name__}")
    refs.check_disjoint(view.x)


def _labels(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.min() < 0 or y.max() >= logits.shape[-1]:
        raise ValueError(f"labels must be in [0, {logits.shape[-1]}), got [{int(y.min())}, {int(y.max())}]")
    return y.long()


def log_label_probability(logits: torch.Tensor, y: torch.Tensor, temperature: float = 1.0) -> np.ndarray:
    """log softmax(logits / T)_y in float64, for logits [..., n, classes] and labels [n]."""
    y = _labels(logits, y)
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    idx = y.view(*([1] * (logits.dim() - 2)), -1, 1).expand(*logits.shape[:-1], 1)
    return logp.gather(-1, idx).squeeze(-1).numpy()


def scaled_logit(logits: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Carlini et al.'s logit scaling phi = log(p / (1 - p)) of the label's softmax probability,
    computed stably from logits: f_y - logsumexp_{j != y} f_j. Logits [..., n, classes], labels [n]."""
    y = _labels(logits, y)
    z = logits.double()
    idx = y.view(*([1] * (z.dim() - 2)), -1, 1).expand(*z.shape[:-1], 1)
    own = z.gather(-1, idx).squeeze(-1)
    others = z.scatter(-1, idx, float("-inf"))
    return (own - torch.logsumexp(others, dim=-1)).numpy()


def _log_marginal(logp_refs: np.ndarray, a: float) -> np.ndarray:
    """log Pr(x) = log(1/2 ((1 + a) Pr(x)_OUT + (1 - a))) from the reference models' log Pr(x | theta'_k)
    [K, n], in log space."""
    k = logp_refs.shape[0]
    log_out = np.logaddexp.reduce(logp_refs, axis=0) - math.log(k)
    with np.errstate(divide="ignore"):
        return math.log(0.5) + np.logaddexp(math.log1p(a) + log_out, math.log1p(-a) if a < 1 else -np.inf)


def rmia_offline(view: AttackView, refs: ReferenceModels, *, a: float = RMIA_DEFAULTS["a"],
                 gamma: float = RMIA_DEFAULTS["gamma"], temperature: float = RMIA_DEFAULTS["temperature"]
                 ) -> np.ndarray:
    """RMIA's score, offline (module docstring): the fraction of the population samples z that x
    beats by a likelihood ratio of at least ``gamma``, Pr(x) and Pr(z) from the OUT reference models
    by the offline formula with ``a``."""
    _check(view, refs)
    a = v.unit_interval("a", a)
    gamma = v.positive("gamma", gamma)
    temperature = v.positive("temperature", temperature)
    x, y = view.x, view.y
    log_ratio_x = (log_label_probability(view.target_logits, y, temperature)
                   - _log_marginal(log_label_probability(refs.logits(x), y, temperature), a))
    log_ratio_z = (log_label_probability(view.query(refs.z_x), refs.z_y, temperature)
                   - _log_marginal(log_label_probability(refs.z_logits(), refs.z_y, temperature), a))
    # LR(x, z) >= gamma  <=>  log ratio_z <= log ratio_x - log gamma
    ordered = np.sort(log_ratio_z)
    beaten = np.searchsorted(ordered, log_ratio_x - math.log(gamma), side="right")
    return beaten / float(ordered.shape[0])


def lira_offline(view: AttackView, refs: ReferenceModels) -> np.ndarray:
    """Offline LiRA with a fixed (global) variance (module docstring): the target's logit-scaled
    confidence standardised against the OUT reference models'."""
    _check(view, refs)
    x, y = view.x, view.y
    phi = scaled_logit(view.target_logits, y)
    phi_refs = scaled_logit(refs.logits(x), y)              # [K, n]
    mu = phi_refs.mean(axis=0)
    if phi_refs.shape[0] >= 2:
        sigma = float(np.sqrt(((phi_refs - mu) ** 2).sum() / (phi_refs.size - phi_refs.shape[1])))
    else:
        sigma = float(np.std(phi_refs[0], ddof=1))
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"lira: the reference models' logit-scaled confidences have no spread (sigma = {sigma}); "
                         "the Gaussian fit is undefined")
    return (phi - mu) / sigma


def random_guess(view: AttackView, refs=None, *, generator: torch.Generator) -> np.ndarray:
    """The negative control: uniform scores that ignore the target (AUC 1/2, TPR = FPR)."""
    if not isinstance(view, AttackView):
        raise TypeError(f"attack: the first argument must be an AttackView, got {type(view).__name__}")
    return torch.rand(view.num_candidates, generator=generator, dtype=torch.float64).numpy()


ATTACKS = {"rmia": rmia_offline, "lira": lira_offline}


def run_attack(game: MembershipGame, target, refs: ReferenceModels, *, attack: str = "rmia", delta: float,
               confidence: float = 0.95, fpr_levels=None, guess_fractions=None, **params):
    """One attack on one target, end to end: the view of ``target``, the scores of ``attack`` (one of
    :data:`ATTACKS`, with its ``params``) and the game's figures
    (:class:`~dpmech.privacy.mia.metrics.MiaResult`; ``.metrics()`` gives the ``mia_*`` names)."""
    v.choice("attack", attack, tuple(ATTACKS))
    if not isinstance(game, MembershipGame):
        raise TypeError(f"game must be a MembershipGame, got {type(game).__name__}")
    scores = ATTACKS[attack](game.attack_view(target), refs, **params)
    extra = {}
    if fpr_levels is not None:
        extra["fpr_levels"] = fpr_levels
    if guess_fractions is not None:
        extra["guess_fractions"] = guess_fractions
    return game.evaluate(scores, delta=delta, confidence=confidence, attack=attack, references=refs.count, **extra)
