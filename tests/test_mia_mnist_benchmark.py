"""benchmarks/mia_mnist.py (issue 52): the committed JSON holds every row and figure the issue names and
meets its targets (non-private RMIA AUC >= 0.6 and TPR at 0.1% FPR >= 1%; every eps_lb at most its claim);
docs/mia.md's table is the one generated from it; a --demo run writes the same structure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "mia_mnist.json"
FIGS = ("auc", "auc_std", "tpr_at_fpr_0.001", "tpr_at_fpr_0.01", "eps_lb")


def _check_row(entry: dict) -> None:
    for attack in ("rmia", "lira"):
        for k in FIGS:
            assert k in entry[attack], (attack, k)
    assert "epsilon" in entry and "seeds" in entry
    assert {"target_training_seconds", "reference_training_seconds_per_trial", "rmia_attack_seconds",
            "lira_attack_seconds"} <= set(entry["cost"])


def test_committed_results_meet_the_targets():
    data = json.loads(RESULT.read_text())
    for row in ("eps_1", "eps_3", "eps_8", "non_private"):
        _check_row(data[row])
        assert data[row]["seeds"] == 3
    for row, claim in (("eps_1", 1.0), ("eps_3", 3.0), ("eps_8", 8.0)):
        assert abs(data[row]["epsilon"] - claim) < 0.01
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
