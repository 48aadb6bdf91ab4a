"""What ``dpsweep validate`` refuses or warns about before anything runs (issue 13, points 1, 3, 8
and 12): metrics a trainable never reports, randomized smoothing on a DP-SGD model without noise
augmentation, ``certify_images`` where no certifier runs, the delta rules for guarantees about the
training data, and the ``attack_labels`` key (the DPAL-paper specs use the predicted labels)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from sweeps.spec import load_spec, validate_spec
from sweeps.spec.space import reported_metrics
from trainables.registry import REGISTRY
from tests.test_spec import _error  # one-line SpecError text, shared with the spec tests

ROOT = Path(__file__).resolve().parent.parent

DPSGD = {
    "name": "t",
    "common": {"train_size": 1000, "test_size": 50},
    "trainables": [{"name": "dpsgd", "search": {"epsilon": [1.0, 2.0], "batch_size": 100}}],
}


def _spec(changes: dict, base: dict = DPSGD) -> dict:
    raw = copy.deepcopy(base)
    for path, value in changes.items():
        node = raw
        *parts, last = path.split(".")
        for part in parts:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last):int(last) + 1] = [value]
        else:
            node[last] = value
    return raw




def _full(name: str, **values) -> dict:
    return {"trainable": name, **REGISTRY[name].config_model(**values).model_dump()}


# --------------------------------------------------------------------------- point 8: metrics


@pytest.mark.parametrize("name", ["dpsgd", "adlm", "label_dp", "dpgan"])
def test_no_cert_acc_for_mechanisms_without_a_certificate(name):
    extra = {"epochs": 1} if name == "dpgan" else {}
    names = reported_metrics(name, _full(name, **extra))
    assert not {n for n in names if n.startswith("cert_acc_") or n == "acc_clean_expected"}, sorted(names)
    assert "not_learned" in names


@pytest.mark.parametrize("name", ["pixeldp", "secure_sgd", "secure_sgd_agm", "dpal"])
def test_cert_acc_for_mechanisms_with_a_certificate(name):
    names = reported_metrics(name, _full(name, epochs=1))
    assert "cert_acc_0.1" in names and "acc_clean_expected" in names


def test_dpsgd_lists_smoothing_metrics_only_with_smoothing_on():
    plain = reported_metrics("dpsgd", _full("dpsgd"))
    assert not {n for n in plain if n.startswith("smooth_")}
    smooth = reported_metrics("dpsgd", _full("dpsgd", noise_augmentation_sigma=0.5, certifier="smoothing"))
    assert "smooth_cert_acc_0.1" in smooth and "cert_acc_0.1" not in smooth


def test_search_metric_cert_acc_on_dpsgd_is_refused():
    msg = _error(_spec({"search": {"metric": "cert_acc_0.1", "mode": "max"}}))
    assert msg.startswith("search.metric: 'cert_acc_0.1' is not reported by every trial of 'dpsgd'")
    assert "no certificate of its own" in msg
    msg = _error(_spec({"search": {"algorithm": "optuna", "num_samples": 2,
                                   "objectives": [{"metric": "acc_clean", "mode": "max"},
                                                  {"metric": "cert_acc_0.2", "mode": "max"}]}}))
    assert msg.startswith("search.objectives[1].metric: 'cert_acc_0.2' is not reported")
    # with smoothing on (noise augmentation), the smoothing metric passes
    ok = _spec({"trainables.0.search.noise_augmentation_sigma": 0.5, "trainables.0.search.certifier": "smoothing",
                "search": {"metric": "smooth_cert_acc_0.1", "mode": "max"}})
    validate_spec(ok)


def test_not_learned_is_a_known_metric():
    validate_spec(_spec({"search": {"metric": "not_learned", "mode": "min"}}))


# --------------------------------------------------------------------------- point 8: smoothing, certify_images


def test_smoothing_on_dpsgd_without_noise_augmentation_is_refused():
    msg = _error(_spec({"trainables.0.search.certifier": "smoothing"}))
    assert "certifier: 'smoothing' is not available here" in msg and "noise_augmentation_sigma" in msg
    msg = _error(_spec({"common.certifier": "both"}))
    assert "certifier: 'both'" in msg and "noise_augmentation_sigma" in msg
    validate_spec(_spec({"common.certifier": "both", "common.noise_augmentation_sigma": 0.25}))


def test_smoothing_on_secure_sgd_needs_the_noise_on_the_input():
    raw = {"name": "t", "common": {"train_size": 1000},
           "trainables": [{"name": "secure_sgd", "search": {"certifier": "smoothing", "batch_size": 100}}]}
    assert "noise_after: 0" in _error(raw)
    raw["trainables"][0]["search"]["noise_after"] = 0
    validate_spec(raw)


def test_certify_images_without_a_certifier_is_refused():
    msg = _error(_spec({"trainables.0.search.certify_images": 200}))
    assert msg.startswith("trainables[0].search.certify_images: trainable 'dpsgd' runs no certifier")
    msg = _error(_spec({"common.certify_images": 200}))
    assert msg.startswith("common.certify_images: no trial of 'dpsgd' runs a certifier")
    adlm = {"name": "t", "common": {"train_size": 2000, "certify_images": 10},
            "trainables": [{"name": "adlm", "search": {"batch_size": 100}}]}
    assert _error(adlm).startswith("common.certify_images: no trial of 'adlm' runs a certifier")
    # the default (500) and an explicit 0 stay silent; smoothing is a certifier in use
    validate_spec(DPSGD)
    validate_spec(_spec({"common.certify_images": 0}))
    validate_spec(_spec({"trainables.0.search.certify_images": 20, "trainables.0.search.certifier": "smoothing",
                         "trainables.0.search.noise_augmentation_sigma": 0.5}))


def test_certify_images_in_common_serves_the_trainables_that_certify():
    raw = _spec({"common.certify_images": 40,
                 "trainables.1": {"name": "pixeldp", "search": {"epsilon": [1.0]}}})
    validate_spec(raw)  # pixeldp certifies 40 images; dpsgd does not need it
    # but a dpsgd search that sets it itself is still refused
    raw["trainables"][0]["search"]["certify_images"] = 20
    assert _error(raw).startswith("trainables[0].search.certify_images:")


def test_certify_images_beyond_the_evaluation_images_is_refused_not_capped():
    """issue 51.5: trainables.runtime capped certify_images at the evaluation images without a word."""
    raw = _spec({"common.certify_images": 40, "trainables.1": {"name": "pixeldp", "search": {"epsilon": [1.0]}}})
    raw["common"]["test_size"] = 30
    assert _error(raw) == ("common.certify_images: 40 is more than the 30 evaluation images (test_size); set "
                           "certify_images to at most 30, or raise test_size")
    raw["common"]["test_size"] = 60
    raw["selection"] = {"split": "test_half"}     # both halves are certified: 30 each
    assert "more than the 30 images of the smaller half of test_half's 60" in _error(raw)
    raw["common"]["test_size"] = 80
    validate_spec(raw)


def test_shipped_specs_still_validate():
    for path in sorted((ROOT / "sweeps").glob("*.yaml")):
        load_spec(path)


# --------------------------------------------------------------------------- point 12: delta


def test_delta_at_least_one_over_n_warns():
    spec = validate_spec(_spec({"trainables.0.search.delta": [1e-5, 1e-3, 0.05]}))
    assert len(spec.warnings) == 2  # 1e-3 = 1/N with N = 1000, and 0.05 above it; 1e-5 is fine
    w = validate_spec(_spec({"trainables.0.search.delta": 1e-3})).warnings[0]
    assert w.startswith("trainables[0].search.delta: delta 0.001 >= 1/N = 0.001 (N = 1000 ")
    assert "\n" not in w and "releasing a training example" in w
    assert validate_spec(_spec({"trainables.0.search.delta": 9.9e-4})).warnings == []
    # audit canaries join the training set: N = 1000 + 100
    spec = validate_spec(_spec({"trainables.0.search.delta": 9.5e-4, "common.audit_canaries": 100}))
    assert "N = 1100" in spec.warnings[0]
    # the default delta (1e-5) on the full training set: silent; the non-private baseline: silent
    assert validate_spec(_spec({"common.train_size": None})).warnings == []
    assert validate_spec(_spec({"trainables.0.search": {"epsilon": None, "delta": 0.05}})).warnings == []


def test_delta_above_a_tenth_is_refused():
    assert _error(_spec({"trainables.0.search.delta": [1e-5, 0.2]})) == (
        "trainables[0].search.delta[1]: must be <= 0.1 for a guarantee about the training data (delta bounds "
        "the probability that the epsilon guarantee fails), got 0.2")
    assert _error(_spec({"common.delta": 0.5})).startswith("common.delta: must be <= 0.1")
    for name in ("secure_sgd", "secure_sgd_agm", "dpgan"):
        raw = {"name": "t", "common": {"train_size": 1000},
               "trainables": [{"name": name, "search": {"delta": 0.3, "batch_size": 100}}]}
        assert _error(raw).startswith("trainables[0].search.delta: must be <= 0.1"), name


def test_delta_rules_spare_robustness_parameters():
    """PixelDP's delta and SecureSGD's robustness_delta are robustness parameters: neither rule."""
    raw = {"name": "t", "common": {"train_size": 100},
           "trainables": [{"name": "pixeldp", "search": {"delta": [0.05, 0.3]}},
                          {"name": "secure_sgd", "search": {"robustness_delta": 0.3, "delta": 1e-5,
                                                            "batch_size": 50}}]}
    assert validate_spec(raw).warnings == []


def test_cli_prints_the_warnings(tmp_path, capsys):
    from sweeps.cli import main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_spec({"trainables.0.search.delta": 0.01})))
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "dpsweep: warning: trainables[0].search.delta: delta 0.01 >= 1/N" in err


# --------------------------------------------------------------------------- point 1: attack_labels


def test_attack_labels_in_specs():
    spec = validate_spec(_spec({"common.attack_labels": True}))  # YAML's `true`
    from sweeps.spec import expand_trials

    assert {t["attack_labels"] for t in expand_trials(spec)} == {"true"}
    spec = validate_spec(_spec({"common.attack_labels": "predicted"}))
    assert {t["attack_labels"] for t in expand_trials(spec)} == {"predicted"}
    assert _error(_spec({"common.attack_labels": "own"})) == \
        "common.attack_labels: must be one of 'true', 'predicted'; got 'own'"
    assert {t["attack_labels"] for t in expand_trials(validate_spec(DPSGD))} == {"true"}  # the default


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_dpal_paper_specs_attack_the_predicted_labels(path):
    from sweeps.spec import expand_trials

    spec = load_spec(path)
    paper = path.name.startswith("dpal_") and not path.name.startswith("dpal_sound")  # dpal_sound: true labels
    if spec.search.algorithm == "optuna":
        trials = [sp.probes()[0] for sp in spec.spaces]
    else:
        trials = expand_trials(spec)
    # the DPAL-paper specs may run dpal_sound beside dpal (issue 15): only dpal attacks the predicted labels
    labels = {t["attack_labels"] for t in trials if not paper or t["trainable"] != "dpal_sound"}
    assert labels == ({"predicted"} if paper else {"true"})
    assert {t["attack_labels"] for t in trials if t["trainable"] == "dpal_sound"} <= {"true"}


def test_attack_labels_is_a_parent_param():
    from sweeps.spec import spec_to_flat_params

    assert spec_to_flat_params(validate_spec(DPSGD))["attack_labels"] == "true"
    assert spec_to_flat_params(load_spec(ROOT / "sweeps" / "dpal_mnist_fig4.yaml"))["attack_labels"] == "predicted"
    # Fig. 2 runs dpal (the paper's predicted labels) beside dpal_sound (true labels): both are recorded
    assert spec_to_flat_params(load_spec(ROOT / "sweeps" / "dpal_mnist_fig2.yaml"))["attack_labels"] == "predicted, true"
    both = _spec({"trainables.0.search.attack_labels": ["true", "predicted"]})
    assert spec_to_flat_params(validate_spec(both))["attack_labels"] == "predicted, true"


def test_only_keeps_one_trainable_of_a_multi_trainable_spec(capsys):
    """issue 51.5: `--set` cannot drop a trainable; `--only NAME` chooses (run and validate)."""
    from sweeps.cli import main
    from sweeps.spec import SpecError, load_spec

    path = ROOT / "sweeps" / "dp_certified_mnist.yaml"
    whole = load_spec(path)
    assert len({t.name for t in whole.trainables}) > 1
    one = load_spec(path, (), ["pixeldp"])
    assert {t.name for t in one.trainables} == {"pixeldp"}
    # what `dpsweep run` saves for `dpsweep resume` (dpsweep.json's spec) is the kept trainable alone: a resumed
    # --only sweep re-plans none of the dropped ones
    from sweeps.spec import validate_spec

    assert [t["name"] for t in one.raw["trainables"]] == ["pixeldp"]
    assert {t.name for t in validate_spec(one.raw).trainables} == {"pixeldp"}
    assert main(["validate", str(path), "--only", "secure_sgd"]) == 0
    assert "trainables: secure_sgd)" in capsys.readouterr().out
    assert main(["validate", str(path), "--only", "dpsdg"]) == 2
    assert "--only: 'dpsdg' is not a trainable of this spec (dpsgd, dpal_sound, secure_sgd, pixeldp) (did you mean " \
           "'dpsgd'?)" in capsys.readouterr().err
    with pytest.raises(SpecError):
        load_spec(path, (), ["nothing"])
