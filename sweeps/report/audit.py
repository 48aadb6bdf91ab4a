"""The report's "claimed vs audited" section: every audited trial's empirical lower bound beside
its claimed epsilon, as a table and a figure (docs/audit.md, docs/report.md).

Confidence across trials. Each trial's bound holds at its own level 1 - beta (``audit_beta``).
With k audited trials, the chance that *some* bound exceeds a true claim is up to k beta, so the
table also gives each trial's bound at level 1 - beta / k (Bonferroni), recomputed from the
trial's logged counts (``audit_canaries``, ``audit_guesses``, ``audit_correct``) and delta: the
column "refuted (family-wise)" is a statement about all k trials at once at confidence 1 - beta.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from sweeps.report.data import as_number as _num
from sweeps.words import all_of, counted




def lower_bound_column(trials) -> str | None:
    """``audit_epsilon_lb`` (the ``audit`` key and the flat keys since issue 25), or the older
    ``epsilon_lower_bound`` of sweeps logged before it; None when no trial was audited."""
    for col in ("audit_epsilon_lb", "epsilon_lower_bound"):
        if col in trials and trials[col].notna().any():
            return col
    return None


def primary_estimator(row) -> str:
    """Which estimator gave the trial's ``audit_epsilon_lb`` (the first rigorous one of its list)."""
    lb = _num(row.get("audit_epsilon_lb"))
    fdp = _num(row.get("audit_epsilon_lb_fdp"))
    steinke = _num(row.get("audit_epsilon_lb_steinke"))
    if math.isfinite(fdp) and lb == fdp and not (math.isfinite(steinke) and steinke == fdp):
        return "fdp"
    return "steinke"


def corrected_bound(row, estimator: str, k: int) -> float:
    """The trial's lower bound at level beta / k from its logged counts (nan without them)."""
    from dpmech.privacy.audit.fdp import eps_delta_lower_bound
    from dpmech.privacy.audit.one_run import epsilon_lower_bound

    m, r, v = (_num(row.get(c)) for c in ("audit_canaries", "audit_guesses", "audit_correct"))
    beta, delta = _num(row.get("audit_beta")), _num(row.get("audit_delta"))
    if not math.isfinite(delta):       # sweeps logged before audit_delta: the trial's delta
        delta = _num(row.get("delta"))
    if not all(math.isfinite(x) for x in (m, r, v, beta)):
        return math.nan
    delta = delta if math.isfinite(delta) else 0.0
    m, r, v, level = int(m), int(r), int(v), beta / max(k, 1)
    try:
        if estimator == "fdp":
            return eps_delta_lower_bound(m, r, v, delta=delta, beta=level)
        return epsilon_lower_bound(r, v, beta=level, delta=delta, m=m)
    except ValueError:      # e.g. the delta term leaves nothing of beta / k
        return 0.0


def audit_rows(trials) -> list[dict]:
    """One row per audited trial: claimed epsilon, the primary bound at the trial's own level,
    each estimator's figure, lb / claim, and the bound at 1 - beta / k (Bonferroni)."""
    col = lower_bound_column(trials)
    if col is None:
        return []
    audited = trials[trials[col].notna()]
    k = len(audited)
    rows = []
    for _, r in audited.iterrows():
        claim = _num(r.get("audit_claim", r.get("epsilon")))
        if not math.isfinite(claim):
            claim = _num(r.get("epsilon"))
        lb = _num(r[col])
        est = primary_estimator(r) if col == "audit_epsilon_lb" else "steinke"
        beta = _num(r.get("audit_beta"))
        fw = corrected_bound(r, est, k)
        row = {"run": r.get("run", ""), "trainable": r.get("trainable", ""), "mode": _mode(r),
               "claimed epsilon": claim, "audited lower bound": lb, "estimator": est,
               "confidence": f"{1 - beta:.3g}" if math.isfinite(beta) else "",
               "lb / claim": lb / claim if claim > 0 and math.isfinite(claim) else math.nan}
        for name, label in (("audit_epsilon_lb_steinke", "steinke"), ("audit_epsilon_lb_fdp", "fdp"),
                            ("audit_epsilon_gaussian_fdp", "Gaussian-family epsilon (not a bound)"),
                            ("audit_epsilon_est_gdp", "gdp (estimate)")):
            if name in r and math.isfinite(_num(r.get(name))):
                row[label] = _num(r[name])
        mu_claim, mu_lb = _num(r.get("audit_mu_claim")), _num(r.get("audit_mu_lb_fdp"))
        if math.isfinite(mu_claim) and math.isfinite(mu_lb):     # an exactly Gaussian mechanism
            row["mu lb / Gaussian claim"] = f"{mu_lb:.3g} / {mu_claim:.3g} ({'yes' if mu_lb <= mu_claim else '**NO**'})"
        row[f"lower bound at 1 - beta/{k}"] = fw
        row["consistent"] = "yes" if lb <= claim else "**NO**"
        row["consistent (family-wise)"] = "" if not math.isfinite(fw) else ("yes" if fw <= claim else "**NO**")
        rows.append(row)
    return rows


def _mode(row) -> str:
    """whitebox when the trial logged ``audit_steps`` (only the engine's canaries observe steps),
    with the kind of canary (``audit_engine_canaries``: engine, or inserted Dirac)."""
    if not math.isfinite(_num(row.get("audit_steps"))):
        return "blackbox"
    kind = _num(row.get("audit_engine_canaries"))
    return "whitebox" if not math.isfinite(kind) else ("whitebox, engine canaries" if kind == 1.0 else
                                                       "whitebox, inserted canaries")


def section_lines(trials, md_table) -> list[str]:
    """The report's "Claimed vs audited epsilon" section (``md_table`` renders rows)."""
    rows = audit_rows(trials)
    if not rows:
        return []
    k = len(rows)
    return ["", "### Empirical privacy audits: claimed vs audited epsilon", "",
            "An empirical lower bound on each audited trial's epsilon from canaries (docs/audit.md): a bound above "
            "the claimed epsilon refutes the claim (\"consistent\": NO); a bound below it proves nothing. "
            "\"audited lower bound\" holds at its trial's own confidence 1 - `audit_beta` and is not corrected for "
            f"the {counted(k, 'trial')} audited here: with k trials a few NO's can be chance (set `audit_beta` to 0.05 / k for "
            f"a sweep-wide 95% statement). The column \"lower bound at 1 - beta/{k}\" does that correction "
            f"(Bonferroni) from each trial's logged counts, so \"consistent (family-wise)\" is one statement about "
            f"{all_of(k, 'trial')} at confidence 1 - beta. \"gdp (estimate)\" is a point estimate, not a bound; the "
            "\"Gaussian-family epsilon\" is the epsilon of the weakest Gaussian mechanism the f-DP test does not "
            "reject, a bound only for a Gaussian mechanism (compared, as mu, where the trial's is exactly Gaussian). "
            "Figure: "
            "claimed vs audited (y = x: the claim).", "", *md_table(rows)]


def plot_claimed_vs_audited(trials, path: Path) -> bool:
    """Audited lower bound (each trial's own level) against claimed epsilon for every audited
    trial, a series per trainable and mode, with the line y = x (above it: refuted). PNG + PDF."""
    from sweeps.report.plots import _plt, _save, style

    rows = audit_rows(trials)
    pts = [(r["claimed epsilon"], r["audited lower bound"], f"{r['trainable']} ({r['mode']})") for r in rows
           if math.isfinite(r["claimed epsilon"]) and math.isfinite(r["audited lower bound"])]
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 4.6), dpi=120)
    top = max(max(p[0] for p in pts), max(p[1] for p in pts)) * 1.1 or 1.0
    ax.plot([0, top], [0, top], ls="--", color="black", lw=1, label="y = x (above: claim refuted)")
    for i, series in enumerate(sorted({p[2] for p in pts})):
        st = style(i)
        xs = np.array([p[0] for p in pts if p[2] == series])
        ys = np.array([p[1] for p in pts if p[2] == series])
        ax.plot(xs, ys, st["marker"], color=st["color"], ms=6, label=series, zorder=3)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("claimed epsilon (the trial's ledger)")
    ax.set_ylabel("audited lower bound on epsilon (own level)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, ax, path)
    return True
