"""The report's claimed-vs-audited section and figure (issue 25, point 3): every audited trial's
bound beside its claim, the Bonferroni-corrected bound from the logged counts, PNG + PDF."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from dpmech.privacy.audit.one_run import epsilon_lower_bound
from dpmech.privacy.audit.estimators import run_estimators
from sweeps.report.page import _md_table, _privacy_section
from sweeps.report.audit import audit_rows, plot_claimed_vs_audited
from sweeps.report.data import Sweep


def _trial(run, claim, m, r, v, estimators, mode="whitebox"):
    """A trial's final metrics as run_estimators logs them, from counts (scores that rank exactly
    v of the r guesses right)."""
    import numpy as np

    included = np.array([True] * (m // 2) + [False] * (m - m // 2))
    scores = np.zeros(m)
    # guesses: top r/2 "in", bottom r/2 "out"; make v of them right
    k = r // 2
    right_in, right_out = min(k, v), v - min(k, v)
    ins, outs = np.flatnonzero(included), np.flatnonzero(~included)
    scores[ins[:right_in]] = 10
    scores[outs[:k - right_in]] = 10
    scores[outs[k - right_in:k - right_in + right_out]] = -10
    scores[ins[right_in:right_in + k - right_out]] = -10
    out = run_estimators(scores, included, estimators=estimators, delta=1e-5, guess_fraction=r / m, claim=claim)
    assert out["audit_guesses"] == r and out["audit_correct"] == v
    return {"run": run, "trainable": "dpsgd", "epsilon": claim, "delta": 1e-5, **out,
            **({"audit_steps": 16.0} if mode == "whitebox" else {})}


def _sweep(trials):
    parent = SimpleNamespace(data=SimpleNamespace(metrics={}, tags={}, params={}))
    return Sweep(client=None, experiment="e", tracking_uri="sqlite://", parent=parent, trials=trials)


def test_claimed_vs_audited_table_and_bonferroni(tmp_path):
    trials = pd.DataFrame([
        _trial("ok", 8.0, 1000, 100, 90, ["steinke", "fdp"]),
        _trial("borderline", 1.55, 1000, 100, 90, ["steinke", "fdp"]),     # own level refutes, family-wise not
        _trial("fdp-first", 8.0, 1000, 100, 95, ["fdp", "steinke", "gdp"]),
    ])
    rows = {r["run"]: r for r in audit_rows(trials)}
    ok, border, fdp = rows["ok"], rows["borderline"], rows["fdp-first"]
    assert ok["estimator"] == "steinke" and fdp["estimator"] == "fdp"
    assert ok["audited lower bound"] == pytest.approx(epsilon_lower_bound(100, 90, beta=0.05, delta=1e-5, m=1000))
    corrected = epsilon_lower_bound(100, 90, beta=0.05 / 3, delta=1e-5, m=1000)
    assert ok["lower bound at 1 - beta/3"] == pytest.approx(corrected)
    assert corrected < ok["audited lower bound"]
    assert border["audited lower bound"] > 1.55 >= border["lower bound at 1 - beta/3"]
    assert border["consistent"] == "**NO**" and border["consistent (family-wise)"] == "yes"
    assert ok["consistent"] == "yes" and "gdp (estimate)" in fdp and ok["mode"] == "whitebox"
    assert fdp["lb / claim"] == pytest.approx(fdp["audited lower bound"] / 8.0)
    text = "\n".join(_privacy_section(_sweep(trials)))
    assert "claimed vs audited" in text and "Bonferroni" in text and "1 - beta/3" in text
    assert plot_claimed_vs_audited(trials, tmp_path / "claimed_vs_audited.png")
    assert (tmp_path / "claimed_vs_audited.png").stat().st_size > 0
    assert (tmp_path / "claimed_vs_audited.pdf").stat().st_size > 0


def test_the_report_names_the_canary_kind_and_keeps_the_gaussian_figure_apart():
    """Issue 32.5/32.6: a white-box row says which canaries ran; the Gaussian-family epsilon has
    its own column and never decides "consistent"; an exactly Gaussian trial's mu is compared."""
    engine = {**_trial("engine", 1.0, 1000, 100, 99, ["fdp", "steinke"]), "audit_engine_canaries": 1.0}
    inserted = {**_trial("inserted", 1.0, 1000, 100, 60, ["fdp", "steinke"]), "audit_engine_canaries": 0.0,
                "audit_mu_claim": 0.5}
    rows = {r["run"]: r for r in audit_rows(pd.DataFrame([engine, inserted]))}
    assert rows["engine"]["mode"] == "whitebox, engine canaries"
    assert rows["inserted"]["mode"] == "whitebox, inserted canaries"
    g = rows["engine"]["Gaussian-family epsilon (not a bound)"]
    assert g == engine["audit_epsilon_gaussian_fdp"] and g > rows["engine"]["audited lower bound"]
    assert rows["engine"]["consistent"] == ("yes" if engine["audit_epsilon_lb_fdp"] <= 1.0 else "**NO**")
    assert "mu lb / Gaussian claim" in rows["inserted"] and "mu lb / Gaussian claim" not in rows["engine"]


def test_no_audit_no_section(tmp_path):
    trials = pd.DataFrame([{"run": "a", "trainable": "dpsgd", "epsilon": 1.0}])
    assert audit_rows(trials) == []
    assert not plot_claimed_vs_audited(trials, tmp_path / "x.png")
    assert _md_table  # the renderer the section uses
