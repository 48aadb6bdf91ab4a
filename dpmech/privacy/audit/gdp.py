"""Gaussian differential privacy (GDP) for audits: conversions and a per-step estimate.

* ``gdp_delta`` / ``gdp_epsilon``: a mu-GDP mechanism (Dong, Roth & Su 2022, "Gaussian Differential
  Privacy", Def. 2.6: trade-off G_mu(x) = Phi(Phi^-1(1 - x) - mu)) is (epsilon, delta(epsilon))-DP
  for every epsilon >= 0 with (their Cor. 2.13)

      delta(epsilon) = Phi(-epsilon / mu + mu / 2) - e^epsilon Phi(-epsilon / mu - mu / 2),

  and for no smaller delta. ``gdp_epsilon`` inverts it (delta is decreasing in epsilon).
* ``estimate_gdp``: an epsilon **point estimate** from per-step canary statistics, in the manner of
  Nasr et al. (USENIX Security 2023, "Tight Auditing of Differentially Private Machine Learning",
  Sec. 4): at each step the auditor sees a statistic of the noisy update (e.g. its projection on
  the canary's direction) with the canary in and with it out; under the Gaussian mechanism the two
  are Gaussians with equal spread, so mu_t = |mean_in - mean_out| / sd is that step's GDP
  parameter; T steps compose to sqrt(mu_1^2 + ... + mu_T^2)-GDP (Dong et al. Cor. 3.3), which is
  sqrt(T) mu for T steps with one mu. The result is an *estimate* (it is consistent when the
  statistics are Gaussian, and carries no confidence level): it is not a lower bound and cannot
  refute a claim on its own. The rigorous one-run bounds are ``dpmech.privacy.audit.one_run`` (Steinke et al.)
  and ``dpmech.privacy.audit.fdp`` (Mahloujifar et al.).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

from dpmech import _validate as v


def gdp_delta(mu: float, epsilon: float) -> float:
    """The smallest delta such that a mu-GDP mechanism is (epsilon, delta)-DP (Dong et al. Cor. 2.13)."""
    mu = v.non_negative("mu", mu)
    epsilon = v.non_negative("epsilon", epsilon)
    if mu == 0:
        return 0.0
    # log-domain difference: Phi(a) - e^eps Phi(b) with b < a
    a, b = -epsilon / mu + mu / 2, -epsilon / mu - mu / 2
    la, lb = norm.logcdf(a), epsilon + norm.logcdf(b)
    if lb >= la:
        return 0.0
    return float(math.exp(la) * -math.expm1(lb - la))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon such that a mu-GDP mechanism is (epsilon, delta)-DP; 0 when delta(0) <= delta."""
    mu = v.non_negative("mu", mu)
    delta = v.open_unit("delta", delta)
    if mu == 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2
        if hi > 1e6:
            raise ValueError(f"mu: {mu:g} is too large to convert to epsilon at delta {delta:g}")
    return float(brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


def step_mu(in_stats, out_stats) -> float:
    """One step's GDP parameter from samples of the statistic with the canary in and out: the
    difference of the means over the pooled standard deviation (a point estimate)."""
    a = _sample("in_stats", in_stats)
    b = _sample("out_stats", out_stats)
    pooled = ((a.size - 1) * a.var(ddof=1) + (b.size - 1) * b.var(ddof=1)) / (a.size + b.size - 2)
    if not pooled > 0:
        raise ValueError("in_stats, out_stats: the statistics have zero spread; mu is undefined (no noise?)")
    return float(abs(a.mean() - b.mean()) / math.sqrt(pooled))


def compose_mu(mus) -> float:
    """GDP composition: mu_1-, ..., mu_T-GDP steps compose to sqrt(sum mu_t^2)-GDP (Dong et al. Cor. 3.3)."""
    arr = np.asarray(mus, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError("mus must be a non-empty 1-d sequence of finite values >= 0")
    return float(math.sqrt(float(np.sum(arr ** 2))))


def estimate_gdp(in_stats, out_stats, *, delta: float, same_mu: bool = False) -> dict[str, object]:
    """Epsilon estimate at ``delta`` from per-step statistics (rows: steps; columns: samples).

    ``in_stats[t]`` holds step t's statistic over repetitions (or canaries) with the canary in,
    ``out_stats[t]`` with it out. ``same_mu=False`` estimates mu_t per step and composes
    sqrt(sum mu_t^2); ``same_mu=True`` assumes every step has one mu (e.g. DP-SGD with a fixed
    noise multiplier), estimates it from all steps' standardised differences, and composes
    sqrt(T) mu. Returns ``mu_step`` (array), ``mu`` (composed), ``epsilon`` — a point estimate,
    not a bound (module docstring).
    """
    delta = v.open_unit("delta", delta)
    ins, outs = _rows("in_stats", in_stats), _rows("out_stats", out_stats)
    if len(ins) != len(outs):
        raise ValueError(f"in_stats, out_stats: need one row per step in each, got {len(ins)} and {len(outs)} rows")
    mus = np.array([step_mu(a, b) for a, b in zip(ins, outs)])
    if same_mu:
        mu = math.sqrt(len(mus)) * float(np.sqrt(np.mean(mus ** 2)))
    else:
        mu = compose_mu(mus)
    return {"mu_step": mus, "mu": mu, "epsilon": gdp_epsilon(mu, delta), "steps": len(mus)}


def _sample(name: str, x) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64).ravel()
    if arr.size < 2:
        raise ValueError(f"{name}: need at least 2 samples per step, got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: every statistic must be finite")
    return arr


def _rows(name: str, x) -> list[np.ndarray]:
    if isinstance(x, np.ndarray) and x.ndim == 1:
        raise ValueError(f"{name}: need one row per step (a 2-d array or a list of arrays), got a 1-d array")
    rows = [np.asarray(r, dtype=np.float64) for r in x]
    if not rows:
        raise ValueError(f"{name}: need at least one step")
    return rows
