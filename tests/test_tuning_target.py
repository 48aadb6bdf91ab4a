"""``tuning_privacy.target_epsilon`` (sweeps/spec/tuning.py): every trial's epsilon calibrated so the
end-to-end guarantee of releasing the best of K trials lands on the target (Papernot & Steinke
2022), checked against dp-accounting's own ``RepeatAndSelectDpEvent``."""

from __future__ import annotations

import pytest

from dpmech.privacy.tuning import repeat_and_select_epsilon
from sweeps.spec import SpecError, expand_trials, validate_spec
from sweeps.spec.tuning import tuning_summary

# the stand-in trainable of the spec tests (PixelDP's schema, a DP-SGD-like event keyed on epsilon):
# importing its autouse fixture registers it for these tests too
from tests.test_tuning_spec import stand_in, stand_in_event  # noqa: F401


def raw(target=3.0, mean=5, distribution="geometric", **search) -> dict:
    return {
        "name": "tuned",
        "common": {"train_size": 100, "test_size": 50},
        "trainables": [{"name": "dp_stand_in", "search": {"lr": {"loguniform": [1e-4, 1e-2]}, **search}}],
        "search": {"algorithm": "random", "seed": 3, "metric": "acc_clean", "mode": "max"},
        "tuning_privacy": {"distribution": distribution, "mean": mean, "delta": 1e-5, "target_epsilon": target},
    }


@pytest.mark.parametrize("distribution, mean, target", [("geometric", 5, 3.0), ("truncated_negative_binomial", 20, 1.0),
                                                        ("poisson", 10, 3.0)])
def test_the_end_to_end_epsilon_lands_on_the_target(distribution, mean, target):
    spec = validate_spec(raw(target, mean, distribution) | (
        {"tuning_privacy": {"distribution": distribution, "mean": mean, "delta": 1e-5, "target_epsilon": target,
                            **({"shape": 0.5} if distribution == "truncated_negative_binomial" else {})}}))
    e = spec.trainables[0].search["epsilon"]
    summary = tuning_summary(spec)
    assert summary["trial_epsilon_calibrated"] == e and summary["tuning_target_epsilon"] == target
    assert target * (1 - 2e-3) <= summary["tuning_epsilon"] <= target
    # dp-accounting's repeat-and-select event of the calibrated trial agrees (independent path)
    shape = 0.5 if distribution == "truncated_negative_binomial" else None
    reference = repeat_and_select_epsilon(stand_in_event(type("C", (), {"epsilon": e})), 1e-5, distribution, mean, shape)
    assert reference == pytest.approx(summary["tuning_epsilon"], rel=1e-6)
    assert e < target                                         # tuning is never free
    assert all(t["epsilon"] == e for t in expand_trials(spec))


def test_more_candidates_leave_each_a_smaller_budget():
    few = validate_spec(raw(3.0, 5)).trainables[0].search["epsilon"]
    many = validate_spec(raw(3.0, 50)).trainables[0].search["epsilon"]
    assert many < few < 3.0


def test_epsilon_in_the_search_is_refused_with_a_target():
    with pytest.raises(SpecError, match=r"^trainables\[0\]\.search\.epsilon: with tuning_privacy\.target_epsilon"):
        validate_spec(raw(3.0, 5, epsilon=1.0))


def test_an_unreachable_target_is_refused_in_one_line():
    with pytest.raises(SpecError, match=r"^tuning_privacy\.target_epsilon: 1e-06 is below what"):
        validate_spec(raw(1e-6, 5))


def test_a_wrong_fast_curve_in_the_search_cannot_overshoot_the_target(monkeypatch, tmp_path):
    """The calibration searches on vectorised RDP curves and checks its answer on dp-accounting's.
    A planted under-estimate (half of every fast curve) would land the per-trial epsilon far above
    the root; the check refuses it and the search runs again exactly: same answer as unplanted."""
    from dpmech.privacy import accounting
    from sweeps.spec import tuning

    monkeypatch.setenv("DPSWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_CALIBRATED", {})
    honest = validate_spec(raw(3.0, 5)).trainables[0].search["epsilon"]
    real = accounting._fast_curve  # noqa: SLF001
    monkeypatch.setattr(accounting, "_fast_curve", lambda ev: None if real(ev) is None else 0.5 * real(ev))
    monkeypatch.setattr(tuning, "_CALIBRATED", {})
    monkeypatch.setenv("DPSWEEP_CACHE", str(tmp_path / "cache2"))
    spec = validate_spec(raw(3.0, 5))
    assert spec.trainables[0].search["epsilon"] == pytest.approx(honest, rel=2e-3)
    assert tuning_summary(spec)["tuning_epsilon"] <= 3.0
