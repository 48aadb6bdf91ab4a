"""One-run audit from a trade-off curve (Mahloujifar, Melis & Chaudhuri, ICML 2025, "Auditing
f-Differential Privacy in One Run").

The game is Steinke et al.'s (``dpmech.privacy.audit.one_run``): m canaries, each in the training set by a fair
coin; after one run the auditor guesses the membership of r of them (abstaining on the rest) and v
guesses are right. Mahloujifar et al. test the hypothesis "the mechanism is f-DP" for a whole
trade-off curve f instead of one (epsilon, delta) pair, which keeps the bound from degrading as m
grows.

The test (their Sec. 4, the recursion with a cap of r guesses). Write g for the inverse of the
"blow-up" 1 - f: g(y) is the least probability of a wrong guess on a canary given probability y
of a right one, for an f-DP mechanism (for the Gaussian curve G_mu, g(y) = Phi(Phi^-1(y) - mu)).
Suppose P[at least v right] >= beta. Averaged over the canaries, the events {at least i right}
carry a right-guess mass r_i and a wrong-guess mass h_i (per canary), with

    r_v = beta (r / m) (v / r),       h_v = beta (r / m) (r - v) / r,
    h_i = max(h_{i+1}, (k - 1) g(r_{i+1})),
    r_i = r_{i+1} + i / (r - i) (h_i - h_{i+1}),       i = v - 1, ..., 0.

(Flipping one canary's bit turns "right on it, >= i + 1 right" into "wrong on it, >= i right",
which f-DP constrains; g is convex, so the bound survives averaging over canaries; the outcomes
with exactly i right put right and wrong mass in the ratio i : r - i.) Every outcome has exactly
r guesses, so r_0 + h_0 cannot exceed r / m: if it does, the hypothesis "f-DP" is rejected at
level beta. k is the size of the secret's alphabet (2 for membership).

What the outputs mean:

* ``mu_lower_bound`` is a **rigorous (1 - beta)-confidence lower bound on mu** for the Gaussian
  family: every mu below it is rejected, i.e. the mechanism is not mu-GDP for any such mu.
* ``fdp_epsilon_lower_bound`` reports eps(mu_lower_bound, delta) (``dpmech.privacy.audit.gdp.gdp_epsilon``),
  the paper's "empirical privacy". It is a lower bound on epsilon *within the Gaussian family*
  (it refutes "the mechanism is dominated by the Gaussian curve whose epsilon at delta is below
  the bound"); a mechanism whose curve is not Gaussian could be (eps, delta)-DP at a smaller eps.
* ``eps_delta_lower_bound`` runs the same test against the (epsilon, delta)-DP curve itself
  (Kairouz et al. 2015: f(x) = max(0, 1 - delta - e^eps x, e^-eps (1 - delta - x))) and is a
  rigorous (1 - beta)-confidence lower bound on epsilon at delta with no assumption on the curve.
"""

from __future__ import annotations

import math
from typing import Callable

from scipy.special import ndtr, ndtri

from dpmech import _validate as v
from dpmech.privacy.audit.one_run import _check_counts, guess_outcome, largest_rejected
from dpmech.privacy.audit.gdp import gdp_epsilon


def gaussian_inverse_blowup(mu: float) -> Callable[[float], float]:
    """g for the Gaussian curve G_mu: the least wrong-guess probability given right-guess
    probability y, Phi(Phi^-1(y) - mu)."""
    return lambda y: float(ndtr(ndtri(min(max(y, 0.0), 1.0)) - mu))


def eps_delta_inverse_blowup(epsilon: float, delta: float) -> Callable[[float], float]:
    """g for the (epsilon, delta)-DP curve: the inverse of 1 - f(x) = min(1, delta + e^eps x,
    1 - e^-eps (1 - delta - x)), i.e. max(0, (y - delta) e^-eps, 1 - delta - e^eps (1 - y))."""
    a, b = math.exp(-epsilon), math.exp(epsilon)
    return lambda y: max(0.0, (y - delta) * a, 1.0 - delta - b * (1.0 - y))


def rejects(m: int, r: int, v_correct: int, inverse_blowup: Callable[[float], float], *,
            beta: float = 0.05, k: int = 2) -> bool:
    """Whether ``v_correct`` right guesses out of ``r`` (``m`` canaries) reject, at level ``beta``,
    the hypothesis that the mechanism is f-DP for the curve whose inverse blow-up is
    ``inverse_blowup`` (the recursion of the module docstring)."""
    _check_counts(m, r, v_correct)
    if v_correct == 0:
        return False
    scale = beta * r / m
    right, wrong = scale * v_correct / r, scale * (r - v_correct) / r
    for i in range(v_correct - 1, -1, -1):
        new_wrong = max(wrong, (k - 1) * inverse_blowup(right))
        if new_wrong == wrong:  # neither mass changes again: the recursion has settled
            break
        right += i / (r - i) * (new_wrong - wrong)
        wrong = new_wrong
        if right + wrong > r / m:
            return True
    return right + wrong > r / m


def mu_lower_bound(m: int, r: int, v_correct: int, *, beta: float = 0.05, k: int = 2,
                   tol: float = 1e-6) -> float:
    """The largest mu rejected by ``rejects`` for the Gaussian curve G_mu (0 when none is): a
    (1 - beta)-confidence lower bound on the mechanism's GDP parameter. Rejection is monotone
    (a larger mu lowers g everywhere), so bisection finds it; the low end of the final bracket
    is returned (never above the exact bound by more than ``tol``... never above it at all)."""
    beta = v.open_unit("beta", beta)
    k = v.positive_int("k", k, minimum=2)
    _check_counts(m, r, v_correct)

    def rej(mu: float) -> bool:
        return rejects(m, r, v_correct, gaussian_inverse_blowup(mu), beta=beta, k=k)

    if v_correct == 0 or not rej(1e-9):
        return 0.0
    return largest_rejected(rej, 1e-9, cap=64.0, tol=tol)  # G_64: perfect leakage in double precision


def fdp_epsilon_lower_bound(m: int, r: int, v_correct: int, *, delta: float, beta: float = 0.05,
                            k: int = 2) -> float:
    """Mahloujifar et al.'s empirical epsilon: eps at ``delta`` of the Gaussian curve at
    ``mu_lower_bound`` (a lower bound within the Gaussian family; module docstring)."""
    delta = v.open_unit("delta", delta)
    mu = mu_lower_bound(m, r, v_correct, beta=beta, k=k)
    return gdp_epsilon(mu, delta) if mu > 0 else 0.0


def eps_delta_lower_bound(m: int, r: int, v_correct: int, *, delta: float, beta: float = 0.05,
                          k: int = 2, tol: float = 1e-6) -> float:
    """The largest epsilon whose (epsilon, delta)-DP curve is rejected: a (1 - beta)-confidence
    lower bound on epsilon at ``delta`` with no assumption on the mechanism's curve."""
    beta = v.open_unit("beta", beta)
    delta = v.unit_interval("delta", delta, high_open=True)
    k = v.positive_int("k", k, minimum=2)
    _check_counts(m, r, v_correct)

    def rej(eps: float) -> bool:
        return rejects(m, r, v_correct, eps_delta_inverse_blowup(eps, delta), beta=beta, k=k)

    if v_correct == 0 or not rej(0.0):
        return 0.0
    return largest_rejected(rej, 0.0, cap=1e3, tol=tol)


def audit_fdp(scores, included, *, guess_fraction: float = 0.2, beta: float = 0.05,
              delta: float) -> dict[str, float]:
    """The one-run f-DP audit of a set of canary scores (higher = more likely a member): the same
    fixed guesses as ``dpmech.privacy.audit.one_run.audit`` (the top and bottom ``guess_fraction`` / 2 of the
    canaries), then ``mu_lower_bound`` and its epsilon at ``delta``."""

    m, r, correct = guess_outcome(scores, included, guess_fraction)
    mu = mu_lower_bound(m, r, correct, beta=beta)
    return {"fdp_mu_lower_bound": mu,
            "fdp_epsilon_lower_bound": gdp_epsilon(mu, v.open_unit("delta", delta)) if mu > 0 else 0.0,
            "audit_canaries": float(m), "audit_guesses": float(r), "audit_correct": float(correct),
            "audit_beta": float(beta)}
