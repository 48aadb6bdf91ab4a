"""benchmarks/mia_mnist.py (issue 52): the committed JSON holds every row and figure the issue names and
meets its targets (non-private RMIA AUC >= 0.6 and TPR at 0.1% FPR >= 1%; every eps_lb at most its claim);
each private row carries the white-box one-run audit of the same targets (``audit``: its canaries, guess
fraction, confidence and bounds, the rigorous ones at most the claim); docs/mia.md's table is the one
generated from it; a --demo run writes the same structure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "mia_mnist.json"
FIGS = ("auc", "auc_std", "tpr_at_fpr_0.001", "tpr_at_fpr_0.01", "eps_lb")
AUDIT_KEYS = ("fdp_lb", "fdp_eps_lb", "steinke_lb", "gdp_estimate", "canaries", "guess_fraction", "confidence",
              "kind", "correct_per_seed", "guesses")


def _check_row(entry: dict) -> None:
    for attack in ("rmia", "lira"):
        for k in FIGS:
            assert k in entry[attack], (attack, k)
    assert "epsilon" in entry and "seeds" in entry
    assert {"target_training_seconds", "reference_training_seconds_per_trial", "rmia_attack_seconds",
            "lira_attack_seconds"} <= set(entry["cost"])
    audit = entry["audit"]
    if entry["epsilon"] is None:          # non-private: no clipping, no noise, nothing for canaries to test
        assert set(audit) == {"skipped"}
        return
    for k in AUDIT_KEYS:
        assert k in audit, k
    assert audit["kind"] == "engine" and 0 < audit["guess_fraction"] <= 1 and audit["confidence"] == 0.95
    assert audit["guesses"] == round(audit["canaries"] * audit["guess_fraction"])
    for k in ("fdp_eps_lb", "steinke_lb"):   # rigorous (1 - beta) lower bounds: at most the claim
        assert 0 <= max(audit[f"{k}_per_seed"]) <= entry["epsilon"] + 1e-9, k


def test_committed_results_meet_the_targets():
    data = json.loads(RESULT.read_text())
    for row in ("eps_1", "eps_3", "eps_8", "non_private"):
        _check_row(data[row])
        assert data[row]["seeds"] == 3
    for row, claim in (("eps_1", 1.0), ("eps_3", 3.0), ("eps_8", 8.0)):
        assert abs(data[row]["epsilon"] - claim) < 0.01
        assert data[row]["audit"]["canaries"] == 1000 and data[row]["audit"]["seeds"] == 3
        # the canaries do not touch the game: each seed's membership draw is the one the non-private
        # row (no canaries) drew
        assert data[row]["members"] == data["non_private"]["members"]
        for attack in ("rmia", "lira"):
            assert max(data[row][attack]["eps_lb_per_seed"]) <= data[row]["epsilon"]
    assert data["non_private"]["epsilon"] is None
    assert data["non_private"]["rmia"]["auc"] >= 0.6 and data["non_private"]["rmia"]["tpr_at_fpr_0.001"] >= 0.01
    from benchmarks.mia_mnist import docs_table

    doc = (ROOT / "docs" / "mia.md").read_text()
    assert docs_table(data).splitlines()[2] in doc


@pytest.mark.usefixtures("one_thread")
def test_demo_run_writes_the_structure(tmp_path):
    from benchmarks.mia_mnist import main

    out = main(["--demo", "--rows", "non_private", "eps_8", "--out", str(tmp_path / "mia.json")])
    for row in ("non_private", "eps_8"):
        _check_row(out[row])
    assert out["eps_8"]["rmia"]["eps_lb"] <= out["eps_8"]["epsilon"]
    audit = out["eps_8"]["audit"]
    assert audit["canaries"] == 100 and out["setting"]["audit"]["canaries"] == 100
    # the canaries are extra rows: the game (candidates, members, plan) is the demo's own
    unit = json.loads((tmp_path / "mia_units" / "eps_8_seed0.json").read_text())
    assert unit["candidates"] == 200 and unit["plan_size"] == 100 and unit["audit"]["included"] > 0
    assert unit["audit"]["steps"] > 0 and unit["audit"]["canary_rows_per_step"] > 0
    # the docs table carries claim, audit bound and attack bound side by side
    from benchmarks.mia_mnist import docs_table

    table = docs_table(out)
    assert f"| eps_8 | {out['eps_8']['epsilon']:.2f} | {audit['steinke_lb']:.2f} / " in table
    assert "| non_private | inf (no clipping, no noise) | none (nothing to audit) |" in table
