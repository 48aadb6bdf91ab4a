"""Private selection in use and audited sweeps on the console (issue 34, points 8 and 9): the
calibration of a target epsilon reports its progress and is reused between ``--dry-run`` and ``run``;
candidates are labelled candidates; the closing lines restate the end-to-end epsilon; the console
table of an audited sweep carries the claim and the bounds; trials.csv drops the flat audit defaults
beside the ``audit`` mapping that ran."""

from __future__ import annotations

import json

import pytest

from sweeps.spec import validate_spec
from tests.test_tuning_spec import stand_in, stand_in_event  # noqa: F401  (registers dp_stand_in)
from tests.test_tuning_target import raw


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    from sweeps.spec import tuning

    monkeypatch.setenv("DPSWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_CALIBRATED", {})   # a new process: nothing calibrated in memory
    return tmp_path / "cache" / "calibration"


def _epsilon(spec) -> float:
    return spec.trainables[0].search["epsilon"]


def test_calibration_reports_progress_and_is_reused_by_the_next_process(cache, capsys, monkeypatch):
    from sweeps.spec import tuning

    first = _epsilon(validate_spec(raw(target=3.0, mean=5)))
    err = capsys.readouterr().err
    assert "tuning_privacy: calibrating the per-trial epsilon so that releasing the best of K ~ geometric(mean 5) " \
           "costs 3 end to end" in err
    steps = [ln for ln in err.splitlines() if "calibrating: step" in ln]
    assert len(steps) >= 3 and "-> end-to-end" in steps[-1] and "(target 3)" in steps[0]
    assert "(target 3, checked)" in steps[-1]     # the answer checked on dp-accounting's curves
    assert len(list(cache.glob("*.json"))) == 1
    monkeypatch.setattr(tuning, "_CALIBRATED", {})          # run after --dry-run: another process
    calls = []
    real = tuning._solve_trial_epsilon
    monkeypatch.setattr(tuning, "_solve_trial_epsilon", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = _epsilon(validate_spec(raw(target=3.0, mean=5)))
    err = capsys.readouterr().err
    assert again == first and not calls and "reused from" in err and "calibrating: step" not in err
    # another tuning section is another calibration (the negative control)
    monkeypatch.setattr(tuning, "_CALIBRATED", {})
    assert _epsilon(validate_spec(raw(target=2.0, mean=5))) < first and calls == [1]


def test_a_cached_value_that_misses_the_target_is_calibrated_again(cache, capsys, monkeypatch):
    from sweeps.spec import tuning

    first = _epsilon(validate_spec(raw(target=3.0, mean=5)))
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "trial_epsilon": first * 1.5}))   # stale or tampered: above the target
    monkeypatch.setattr(tuning, "_CALIBRATED", {})
    capsys.readouterr()
    assert _epsilon(validate_spec(raw(target=3.0, mean=5))) == pytest.approx(first)
    assert "calibrating: step" in capsys.readouterr().err


def _spec(tuning: bool):
    from types import SimpleNamespace

    tp = SimpleNamespace(distribution="geometric", mean=3.0) if tuning else None
    return SimpleNamespace(tuning_privacy=tp, search=SimpleNamespace(metric="acc_clean", mode="max"))


def test_candidates_are_labelled_candidates_and_the_closing_lines_restate_the_guarantee():
    from types import SimpleNamespace

    from sweeps.report.best import closing_lines, describe_released, label_candidates

    rows = [{"trial_id": "a", "cfg.repeat": 0, "acc_clean": 0.9}, {"trial_id": "b", "cfg.repeat": 1, "acc_clean": 0.8}]
    assert [list(r) for r in label_candidates(rows, _spec(True))] == [["trial_id", "candidate", "acc_clean"]] * 2
    assert label_candidates(rows, _spec(False)) == rows          # a plain sweep's repeats stay repeats
    tuning = {"tuning_epsilon": 2.9999, "tuning_delta": 1e-5}
    best = SimpleNamespace(compare_url="http://127.0.0.1:5000/#/compare-runs?runs=x", metric="acc_clean")
    lines = closing_lines(_spec(True), tuning, best, "sqlite:///m.db", "exp")
    assert lines[0].lstrip().startswith("compare view (the address assumes `mlflow ui` on port 5000")
    assert "pick acc_clean in the plot's Metrics box" in lines[0]
    assert lines[1].startswith("privacy:  end-to-end epsilon 3 at delta 1e-05 for the released trial")
    assert lines[1].endswith("publish with: dpsweep release exp --tracking-uri sqlite:///m.db --out release/")
    assert not any(ln.startswith("privacy:") for ln in closing_lines(_spec(False), None, best, "sqlite:///m.db", "e"))
    assert "port 5000" not in closing_lines(_spec(False), None, best, "http://head:5000", "e")[0]
    text = describe_released(_spec(True), {"trial_id": "b", "acc_clean": 0.95, "heldout_acc_clean": 0.941})
    assert text.splitlines()[1].startswith("headline: held-out acc_clean = 0.941 on the test images")
    assert len(describe_released(_spec(True), {"trial_id": "b", "acc_clean": 0.95}).splitlines()) == 1


def test_trials_csv_drops_the_flat_audit_defaults_beside_the_mapping():
    import pandas as pd

    from sweeps.report.data import without_shadowed_audit_keys

    mapping = "{'mode': 'whitebox', 'canaries': 1000}"      # as MLflow gives a mapping param back
    mixed = pd.DataFrame({"param.audit": [mapping, None], "param.audit_canaries": [0, 50],
                          "param.audit_beta": [0.05, 0.05], "param.epsilon": [1.0, 8.0]})
    out = without_shadowed_audit_keys(mixed)
    assert out["param.audit_canaries"].tolist()[0] is None and out["param.audit_canaries"].tolist()[1] == 50
    every = without_shadowed_audit_keys(mixed.assign(**{"param.audit": [mapping, mapping]}))
    assert "param.audit_canaries" not in every and "param.audit_beta" not in every and "param.epsilon" in every
    flat = mixed.assign(**{"param.audit": [None, None]})
    assert without_shadowed_audit_keys(flat).equals(flat)    # the flat keys ran: kept (negative control)


def test_progress_lines_call_a_candidate_a_candidate():
    from sweeps.runner import _describe

    trial = {"trial": {"trainable": "dpsgd", "lr": 0.5, "repeat": 1, "epsilon": 2.0, "seed": 3}}
    swept = {"swept": {"dpsgd": ["lr", "repeat"]}}
    assert "candidate=1" in _describe({**trial, "_mlflow": {**swept, "candidates": True}})
    plain = _describe({**trial, "_mlflow": swept})             # a plain sweep's repeat stays a repeat
    assert "repeat=1" in plain and "candidate" not in plain
