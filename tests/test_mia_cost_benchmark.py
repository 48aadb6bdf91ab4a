"""benchmarks/mia_cost.py (issue 52, part 3): the committed JSON states the measured ratio (references +
attacks + game draws) / training for a sweep of >= 8 trials sharing one reference set, with its setting,
device, versions, date and load; docs/mia.md quotes the measured ratio; a --demo run writes the same
structure (the first trial trains the references, the others load them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "mia_cost.json"

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:Full backward hook")]


def test_committed_result_states_the_ratio_against_the_target():
    data = json.loads(RESULT.read_text())
    assert data["setting"]["trials"] >= 8 and len(data["trials"]) == data["setting"]["trials"]
    for key in ("device", "versions", "date", "load_average"):
        assert data[key]
    t = data["total"]
    ratio = (t["reference_seconds"] + t["attack_seconds"] + t["game_seconds"]) / t["training_seconds"]
    assert data["ratio"] == pytest.approx(ratio, abs=2e-3)
    assert data["target"] == 0.2 and data["target_met"] == (data["ratio"] <= 0.2)
    assert data["trials"][0]["references_cached"] == 0
    assert all(r["references_cached"] == data["setting"]["references"] for r in data["trials"][1:])
    assert f"{data['ratio']:.3f}" in (ROOT / "docs" / "mia.md").read_text()


def test_demo_writes_the_same_structure(tmp_path):
    from benchmarks.mia_cost import main

    out = main(["--demo", "--out", str(tmp_path / "cost.json")])
    assert len(out["trials"]) == 3 and out["trials"][0]["references_cached"] == 0
    assert out["trials"][2]["references_cached"] == 1 and out["ratio"] > 0
    assert set(out["projection"]) >= {"ratio_at_8_trials", "ratio_at_16_trials"}
