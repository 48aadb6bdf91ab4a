"""The spec's ``reference`` block (published values beside measured ones, issue 13 point 10):
validation with the field path of each error, matching of trials, and the round trip through the
parent run's flattened params that ``dpsweep report`` reads."""

from __future__ import annotations

import copy

import pytest

from sweeps.report.data import reference_from_params
from sweeps.spec import SpecError, reference_matches, spec_to_flat_params, validate_spec

BASE = {
    "name": "t",
    "common": {"train_size": 500, "test_size": 50},
    "trainables": [{"name": "pixeldp", "search": {"attack_bound": [0.06, 0.2], "certify_sizes": [0.1, 0.2]}},
                   {"name": "dpsgd", "search": {"epsilon": [1.0, 2.0]}}],
}
REF = {
    "citation": "Lecuyer et al. 2018, Fig. 3a",
    "note": "inputs span 2 here",
    "points": [
        {"label": "L = 0.1", "where": {"trainable": "pixeldp", "attack_bound": 0.2},
         "metrics": {"cert_acc_0.2": 0.85, "acc_clean": 0.98}},
        {"where": {"trainable": "dpsgd", "epsilon": 2.0}, "metrics": {"acc_clean": 0.95}},
    ],
}


def spec(ref):
    return validate_spec({**copy.deepcopy(BASE), "reference": ref})


def with_point(**changes):
    ref = copy.deepcopy(REF)
    ref["points"][0].update(changes)
    return ref


def test_valid_block_is_kept():
    s = spec(REF)
    assert s.reference.citation.startswith("Lecuyer")
    assert s.reference.points[0].label == "L = 0.1"
    assert s.reference.points[0].metrics == {"cert_acc_0.2": 0.85, "acc_clean": 0.98}
    assert s.reference.points[1].label is None


@pytest.mark.parametrize("ref, message", [
    ({**REF, "citaton": "x"}, "reference.citaton: unknown key (did you mean 'citation'?)"),
    ({k: v for k, v in REF.items() if k != "citation"}, "reference.citation: required"),
    ({**REF, "points": []}, "reference.points: must not be empty"),
    (with_point(metric={"acc_clean": 1.0}), "reference.points[0].metric: unknown key (did you mean 'metrics'?)"),
    (with_point(where={"trainable": "pixeldp", "attack_bond": 0.2}),
     "reference.points[0].where.attack_bond: not a config key of 'pixeldp' (did you mean 'attack_bound'?)"),
    (with_point(where={"trainable": "adlm"}), "reference.points[0].where.trainable: 'adlm' is not a trainable"),
    (with_point(where={"trainable": "pixeldp", "attack_bound": 0.3}),
     "reference.points[0].where: no trial of the sweep has trainable='pixeldp', attack_bound=0.3"),
    (with_point(metrics={"cert_acc_0.3": 0.5}),
     "reference.points[0].metrics.cert_acc_0.3: 'cert_acc_0.3' is not reported by every trial of 'pixeldp'"),
    (with_point(metrics={"acc_clean": "high"}), "reference.points[0].metrics.acc_clean: must be a number"),
    (with_point(metrics={}), "reference.points[0].metrics: must not be empty"),
])
def test_invalid_blocks_name_the_field(ref, message):
    with pytest.raises(SpecError) as err:
        spec(ref)
    assert str(err.value).startswith(message), str(err.value)


def test_where_key_of_one_trainable_without_trainable_is_accepted():
    # no trainable given: the key must belong to some trainable of the spec (attack_bound: pixeldp's)
    s = spec(with_point(where={"attack_bound": 0.06}, metrics={"acc_clean": 0.9}))
    assert s.reference.points[0].where == {"attack_bound": 0.06}


def test_matching_compares_configured_values():
    assert reference_matches({"trainable": "pixeldp", "attack_bound": 0.2},
                             {"trainable": "pixeldp", "attack_bound": 0.2 + 1e-12, "epsilon": 1.0})
    assert not reference_matches({"attack_bound": 0.2}, {"trainable": "pixeldp", "attack_bound": 0.06})
    assert not reference_matches({"attack_bound": 0.2}, {"trainable": "dpsgd", "epsilon": 1.0})
    assert not reference_matches({"norm": "l2"}, {"norm": "l1"})


def test_a_non_private_point_matches_the_trials_whose_epsilon_was_logged_as_none():
    """``where: {epsilon: null}`` (a non-private anchor) against the report's trial rows, where MLflow's
    ``None`` reads back as NaN: measured and drawn, while epsilon-3 trials are not taken for it."""
    import pandas as pd

    from sweeps.report.data import measured
    from sweeps.report.plots import _matches_any

    where = {"trainable": "dpsgd", "epsilon": None, "augment_multiplicity": 1}
    rows = [{"run": r, "trainable": "dpsgd", "status": "FINISHED", "param.epsilon": eps,
             "param.augment_multiplicity": k, "smooth_cert_acc_1": acc}
            for r, eps, k, acc in (("a", float("nan"), 1.0, 0.9), ("b", float("nan"), 1.0, 0.8),
                                   ("c", 3.0, 1.0, 0.5), ("d", float("nan"), 4.0, 0.1))]
    trials = pd.DataFrame(rows)
    mean, _, n = measured(trials, where, "smooth_cert_acc_1")
    assert (mean, n) == (pytest.approx(0.85), 2)
    assert _matches_any(trials, where) and not _matches_any(trials.iloc[2:3], where)


def test_round_trip_through_the_parent_params():
    params = spec_to_flat_params(spec(REF))
    assert params["reference.points.0.metrics.cert_acc_0.2"] == "0.85"
    back = reference_from_params(params)
    assert back["citation"] == REF["citation"] and back["note"] == REF["note"]
    assert back["points"][0] == {"label": "L = 0.1", "where": {"trainable": "pixeldp", "attack_bound": 0.2},
                                 "metrics": {"cert_acc_0.2": 0.85, "acc_clean": 0.98}}
    assert back["points"][1] == {"label": None, "where": {"trainable": "dpsgd", "epsilon": 2.0},
                                 "metrics": {"acc_clean": 0.95}}
    assert reference_from_params({"search.seed": "0"}) is None


def test_a_published_average_over_attacks_is_checked_and_measured():
    import pandas as pd

    from sweeps.report.data import measured

    raw = {**copy.deepcopy(BASE), "common": {**BASE["common"], "attacks": {"fgsm": [0.2], "pgd": [0.2]}}}
    point = {"where": {"trainable": "dpsgd", "epsilon": 1.0}, "metrics": {"acc_attack_mean_0.2": 0.8}}
    spec = validate_spec({**raw, "reference": {"citation": "x", "points": [point]}})
    assert spec.reference.points[0].metrics == {"acc_attack_mean_0.2": 0.8}
    with pytest.raises(SpecError, match=r"reference.points\[0\].metrics.acc_attack_mean_0.3: .* no attack at size 0.3"):
        validate_spec({**raw, "reference": {"citation": "x", "points": [
            {**point, "metrics": {"acc_attack_mean_0.3": 0.8}}]}})
    trials = pd.DataFrame([{"run": "a", "trainable": "dpsgd", "status": "FINISHED", "param.epsilon": 1.0,
                            "acc_fgsm_0.2": 0.6, "acc_pgd_0.2": 0.4},
                           {"run": "b", "trainable": "dpsgd", "status": "FINISHED", "param.epsilon": 1.0,
                            "acc_fgsm_0.2": 0.8, "acc_pgd_0.2": 0.6}])
    mean, sd, n = measured(trials, point["where"], "acc_attack_mean_0.2")
    assert (mean, n) == (pytest.approx(0.6), 2) and sd == pytest.approx(0.1414, abs=1e-4)


@pytest.mark.parametrize("name", ["pixeldp_mnist_certified", "dpal_mnist_fig2", "dpal_mnist_fig4", "dpal_mnist_fig6", "dpal_cifar10",
                                  "dpal_paper_baselines"])
def test_specs_that_reproduce_a_figure_carry_the_published_values(name):
    from pathlib import Path

    from sweeps.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "sweeps" / f"{name}.yaml")
    assert spec.reference is not None and spec.reference.citation and spec.reference.note
    assert all(p.metrics for p in spec.reference.points)
