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
    assert len(steps) >= 3 and "-> end-to-end" in steps[-1] and "(target 3)" in steps[-1]
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
