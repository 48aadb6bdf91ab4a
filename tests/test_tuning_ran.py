"""A tuning-private sweep reports the guarantee of what ran (issue 32.2): the per-trial epsilon the
candidates were configured with, not a calibration made again, and no candidate beyond the per-trial
epsilon the end-to-end bound assumed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sweeps.spec.tuning import candidates_beyond_guarantee, ran_trial_epsilon


def _spec(target):
    return SimpleNamespace(tuning_privacy=SimpleNamespace(target_epsilon=target))


def test_the_candidates_configured_epsilon_is_what_ran():
    rows = [{"trial_id": "a", "cfg.epsilon": 1.63107, "status": "DONE"},
            {"trial_id": "b", "cfg.epsilon": 1.63107, "status": "DONE"}]
    assert ran_trial_epsilon(_spec(3.0), rows) == 1.63107
    assert ran_trial_epsilon(_spec(None), rows) is None          # a fixed per-trial epsilon: nothing to recompute
    with pytest.raises(ValueError, match="different per-trial epsilons"):
        ran_trial_epsilon(_spec(3.0), [*rows, {"trial_id": "c", "cfg.epsilon": 1.63242}])


def test_a_candidate_beyond_the_assumed_epsilon_is_named():
    summary = {"trial_epsilon_worst": 1.637}
    ok = [{"trial_id": "a", "epsilon": 1.6370}, {"trial_id": "b", "epsilon": 1.2}]
    assert candidates_beyond_guarantee(ok, summary) == []
    bad = ok + [{"trial_id": "c", "epsilon": 1.64}]          # negative control: a candidate ran leakier
    lines = candidates_beyond_guarantee(bad, summary)
    assert len(lines) == 1 and "trial c" in lines[0] and "1.64" in lines[0]


def test_summary_at_the_ran_epsilon_is_the_end_to_end_epsilon_of_that_epsilon():
    import dataclasses

    from sweeps.spec import validate_spec
    from sweeps.spec.tuning import end_to_end_epsilon, tuning_summary
    from tests.test_tuning_spec import raw
    from trainables.registry import REGISTRY

    REGISTRY["dp_stand_in"] = dataclasses.replace(
        REGISTRY["pixeldp"], name="dp_stand_in", privacy_event="tests.test_tuning_spec:stand_in_event",
        privacy_keys=("epsilon",))
    try:
        spec = validate_spec(raw(**{"trainables.0.search.epsilon": 1.0}))
        ran = tuning_summary(spec, ran_epsilon=0.8)
        assert ran["tuning_epsilon"] == pytest.approx(end_to_end_epsilon(spec, 0.8), rel=1e-12)
        assert ran["tuning_epsilon"] < tuning_summary(spec)["tuning_epsilon"]     # 0.8 < the configured 1.0
    finally:
        del REGISTRY["dp_stand_in"]
