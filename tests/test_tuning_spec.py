"""Spec-level private hyperparameter selection (sweeps/spec/tuning.py): the rules Papernot & Steinke's
guarantee needs, the number of trials drawn, and the end-to-end epsilon over the search space.

A stand-in trainable (PixelDP's schema with a DP-SGD-like privacy event keyed on ``epsilon``)
keeps these tests independent of any one mechanism; the end-to-end sweep with a real DP
trainable is in tests/test_tuning_e2e.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy.stats import chisquare

from dpmech.privacy.accounting import epsilon, subsampled_gaussian_event
from dpmech.privacy.tuning import num_trials_pmf, tuning_epsilon, worst_case_rdp
from sweeps.spec import SpecError, expand_trials, validate_spec
from sweeps.spec.tuning import best_row, tuning_summary
from trainables.registry import REGISTRY


def stand_in_event(cfg):
    """One trial: 500 Poisson-subsampled Gaussian steps at q = 0.01, sigma = 2 / epsilon."""
    return subsampled_gaussian_event(0.01, 2.0 / cfg.epsilon, 500)


@pytest.fixture(autouse=True)
def stand_in():
    REGISTRY["dp_stand_in"] = dataclasses.replace(
        REGISTRY["pixeldp"], name="dp_stand_in", privacy_event="tests.test_tuning_spec:stand_in_event",
        privacy_keys=("epsilon",))
    yield
    del REGISTRY["dp_stand_in"]


def raw(**changes) -> dict:
    spec = {
        "name": "tuned",
        "common": {"train_size": 100, "test_size": 50},
        "trainables": [{"name": "dp_stand_in", "search": {"epsilon": {"choice": [1.0, 2.0]},
                                                           "lr": {"loguniform": [1e-4, 1e-2]}}}],
        "search": {"algorithm": "random", "seed": 3, "metric": "acc_clean", "mode": "max"},
        "tuning_privacy": {"distribution": "geometric", "mean": 5, "delta": 1e-5},
    }
    for path, value in changes.items():
        node = spec
        parts = path.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[parts[-1]] = value
    return spec


@pytest.mark.parametrize("changes, field", [
    ({"search.algorithm": "grid"}, "search.algorithm: tuning_privacy needs random search"),
    ({"search.algorithm": "optuna"}, "search.algorithm: tuning_privacy needs random search: an adaptive"),
    ({"scheduler": {"type": "asha", "metric": "test_acc"}}, "scheduler.type"),
    ({"search.num_samples": 3}, "search.num_samples"),
    ({"search.metric": None, "search.mode": None}, "search.metric"),
    ({"trainables.0.search.epsilon": [1.0, 2.0]}, "trainables[0].search.epsilon: a grid is not allowed"),
    ({"trainables.0.search.epsilon": {"uniform": [1.0, 2.0]}}, "trainables[0].search.epsilon: epsilon changes"),
    ({"trainables.0.name": "pixeldp"}, "trainables[0].name: pixeldp has no per-trial privacy guarantee"),
    ({"tuning_privacy": {"distribution": "geometric", "mean": 5, "shape": 0.5}}, "tuning_privacy.shape"),
    ({"tuning_privacy": {"distribution": "truncated_negative_binomial", "mean": 5}}, "tuning_privacy.shape"),
    ({"tuning_privacy": {"distribution": "binomial", "mean": 5}}, "tuning_privacy.distribution"),
    ({"tuning_privacy": {"distribution": "poisson", "mean": 0.5}}, "tuning_privacy.mean"),
    ({"tuning_privacy": {"distribution": "poisson", "mean": 5, "rate": 1}}, "tuning_privacy.rate"),
])
def test_refused_with_the_reason(changes, field):
    with pytest.raises(SpecError) as info:
        validate_spec(raw(**changes))
    assert str(info.value).startswith(field), str(info.value)


def test_ranges_allowed_on_keys_that_do_not_change_privacy():
    spec = validate_spec(raw())
    trials = expand_trials(spec)
    assert all(1e-4 <= t["lr"] <= 1e-2 for t in trials)
    assert {t["epsilon"] for t in trials} <= {1.0, 2.0}


def _bound(spec, key):
    spec.bind_noise_key(key)
    return spec


def test_k_is_drawn_from_the_distribution_and_fixed_by_the_sweeps_secret():
    from dpmech.privacy.secret import NoiseKey

    # 300 sweeps' secrets, fixed (the standards' fixed seeds) and independent: children of one test key
    root = NoiseKey(bytes(range(32)))
    ks = [len(expand_trials(_bound(validate_spec(raw(**{"search.seed": s})), root.derive(f"k{s}")))) for s in range(300)]
    key = NoiseKey.fresh()    # the same secret, the same K and candidates (a resume); the seed plays no part
    assert expand_trials(_bound(validate_spec(raw()), key)) == expand_trials(_bound(validate_spec(raw(**{"search.seed": 9})), key))
    # K follows the secret, not search.seed: over 40 fresh secrets and one seed, K varies
    assert len({len(expand_trials(_bound(validate_spec(raw()), root.derive(f"j{i}")))) for i in range(40)}) > 3
    # the research mode (noise_source: seed) draws K and the candidates from search.seed, as before issue 32
    research = raw(**{"common": {"train_size": 100, "test_size": 50, "noise_source": "seed"}})
    assert expand_trials(validate_spec(research)) == expand_trials(validate_spec(research))
    pmf = num_trials_pmf("geometric", 5, kmax=200)
    counts = np.bincount(ks, minlength=201)[:201]
    # bins 1..9 and a tail bin
    obs = [*counts[1:10], 300 - counts[1:10].sum()]
    exp = [*(pmf[1:10] * 300), 300 * (1 - pmf[1:10].sum() - pmf[0])]
    assert chisquare(obs, exp).pvalue > 1e-3
    # negative control: the same draws are far from a Poisson(5)
    pois = num_trials_pmf("poisson", 5, kmax=200)
    exp_p = [*(pois[1:10] * 300), 300 * (1 - pois[1:10].sum() - pois[0])]
    obs_p = [*counts[1:10], 300 - counts[1:10].sum() - counts[0]]
    assert chisquare(obs_p, np.array(exp_p) * sum(obs_p) / sum(exp_p)).pvalue < 1e-3


def test_end_to_end_epsilon_is_the_worst_case_over_the_space():
    spec = validate_spec(raw())
    summary = tuning_summary(spec)
    worst_event = subsampled_gaussian_event(0.01, 1.0, 500)  # epsilon 2.0: the least noise
    assert summary["trial_epsilon_worst"] == pytest.approx(epsilon(worst_event, 1e-5), rel=1e-6)
    assert summary["tuning_epsilon_papernot_steinke"] == pytest.approx(
        tuning_epsilon(worst_case_rdp([worst_event]), 1e-5, "geometric", 5), rel=1e-9)
    # charged: the smallest analysis; the candidate as drawn (epsilon 1 or 2, equally likely) is
    # cheaper than the worst case (issue 54.2, tests/test_tuning_analyses.py)
    assert summary["tuning_epsilon"] == summary["tuning_epsilon_papernot_steinke_mixture"]
    assert summary["tuning_epsilon"] < summary["tuning_epsilon_papernot_steinke"]
    assert summary["tuning_epsilon"] > summary["trial_epsilon_worst"]
    assert summary["tuning_configs"] == 2 and "tuning_trials" not in summary  # K is never logged
    one = validate_spec(raw(**{"trainables.0.search.epsilon": 1.0}))
    assert tuning_summary(one)["tuning_epsilon"] < summary["tuning_epsilon"]


def test_best_row_is_the_released_trial():
    rows = [{"trial_id": "a", "status": "DONE", "acc_clean": 0.5}, {"trial_id": "b", "status": "DONE", "acc_clean": 0.9},
            {"trial_id": "c", "status": "ERROR", "acc_clean": 0.99}]
    assert best_row(rows, "acc_clean", "max")["trial_id"] == "b"
    assert best_row(rows, "acc_clean", "min")["trial_id"] == "a"
    assert best_row([], "acc_clean", "max") is None
