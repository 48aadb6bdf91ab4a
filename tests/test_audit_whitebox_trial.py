"""The ``audit`` trial key (issue 25, point 3): a white-box audit through the trainable and the
runtime logs its metrics; the flat audit_* keys still run the black-box audit; contradictory or
inapplicable combinations are refused with one line."""

from __future__ import annotations

import math
import types

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing"), pytest.mark.usefixtures("one_thread")]

TINY = {"dataset": "mnist", "train_size": 256, "test_size": 100, "batch_size": 64, "epochs": 2, "epsilon": 8.0,
        "model": "tb_cnn", "clipping": "bk", "certify_images": 0, "seed": 0}


def _run(monkeypatch, config: dict, info: dict | None = None) -> list[dict]:
    from ray import tune

    from trainables.registry import get_trainable

    results = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: types.SimpleNamespace(get_trial_id=lambda: "t0"))
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: results.append(dict(metrics)))
    get_trainable(config["trainable"]).fn({**config, **({"_mlflow": info} if info else {})})
    return results


def test_whitebox_audit_trial_logs_its_metrics(monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = MlflowClient(uri).create_experiment("wb", artifact_location=str(tmp_path / "artifacts"))
    info = {"tracking_uri": uri, "experiment_id": exp}
    audit = {"mode": "whitebox", "canaries": 500, "estimator": ["fdp", "steinke", "gdp"], "guess_fraction": 0.1}
    final = _run(monkeypatch, {"trainable": "dpsgd", **TINY, "audit": audit}, info)[-1]
    for key in ("audit_epsilon_lb", "audit_epsilon_lb_fdp", "audit_mu_lb_fdp", "audit_epsilon_lb_steinke",
                "audit_epsilon_est_gdp", "audit_claim", "audit_ratio", "audit_canaries", "audit_steps"):
        assert key in final, key
    assert final["audit_epsilon_lb"] == final["audit_epsilon_lb_fdp"]      # the first rigorous estimator
    assert final["audit_claim"] == final["epsilon"]
    assert 0 < final["audit_epsilon_lb"] <= final["epsilon"]
    assert final["audit_ratio"] == pytest.approx(final["audit_epsilon_lb"] / final["epsilon"])
    assert final["audit_steps"] == 2 * 4
    assert "epsilon_lower_bound" not in final          # the legacy name belongs to the flat keys
    (run,) = MlflowClient(uri).search_runs([str(exp)])
    assert run.data.metrics["audit_epsilon_lb_fdp"] == pytest.approx(final["audit_epsilon_lb_fdp"])
    assert "whitebox" in run.data.params["audit"]


def test_flat_keys_are_the_blackbox_audit(monkeypatch):
    final = _run(monkeypatch, {"trainable": "dpsgd", **TINY, "epochs": 1, "audit_canaries": 20})[-1]
    assert final["epsilon_lower_bound"] == final["audit_epsilon_lb"] == final["audit_epsilon_lb_steinke"]
    assert final["audit_claim"] == final["epsilon"] and math.isfinite(final["audit_ratio"])
    assert "audit_epsilon_lb_fdp" not in final and "audit_steps" not in final


def test_audit_key_rules():
    """Where the whitebox audit applies, and the one-line refusals."""
    from pydantic import ValidationError

    from trainables.dpal_sound import DPALSoundTrialConfig
    from trainables.dpgan import DPGANTrialConfig
    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import validate_config
    from trainables.secure_sgd import SecureSGDTrialConfig

    wb = {"mode": "whitebox", "canaries": 100}
    for schema in (DPSGDTrialConfig, DPALSoundTrialConfig, SecureSGDTrialConfig):
        assert schema(audit=wb).audit == {"mode": "whitebox", "canaries": 100, "estimator": ["steinke", "fdp", "gdp"],
                                          "confidence": 0.95, "direction": "dirac", "statistic": "llr",
                                          "guess_fraction": 0.2}
    assert DPGANTrialConfig(audit={"mode": "blackbox", "canaries": 50}).audit["mode"] == "blackbox"
    cases = [
        ({"audit": wb, "audit_canaries": 10}, "not both"),
        ({"audit": wb, "audit_beta": 0.1}, "not both"),
        ({"audit": {**wb, "canaries": 0}}, "canaries"),
        ({"audit": {**wb, "estimator": "gdp"}}, "'gdp' is an estimate"),
        ({"audit": {**wb, "estimator": ["fdp", "lira"]}}, "estimator"),
        ({"audit": {**wb, "colour": 1}}, "colour"),
        ({"audit": {**wb, "confidence": 1.0}}, "confidence"),
        ({"audit": {"mode": "greybox", "canaries": 10}}, "mode"),
        ({"audit": wb, "epsilon": None}, "non-private baseline"),
        ({"audit": "whitebox"}, "valid dictionary"),
    ]
    for extra, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            validate_config({"trainable": "dpsgd", **extra}, DPSGDTrialConfig)
        assert "\n" not in str(err.value) and str(err.value).startswith("config.")
    from trainables.dp_merf import DPMERFTrialConfig

    assert DPGANTrialConfig(audit=wb).audit["mode"] == "whitebox"       # the critic's private step
    with pytest.raises(ValidationError, match="does not train with it"):
        DPMERFTrialConfig(audit=wb)
    # a sweep's trial config carries every key: the flat keys at their defaults state no second audit
    full = {**DPSGDTrialConfig().model_dump(), "audit": wb}
    assert validate_config({"trainable": "dpsgd", **full}, DPSGDTrialConfig).audit["mode"] == "whitebox"


def test_spec_knows_the_audit_metrics():
    from sweeps.spec_space import reported_metrics

    config = {"trainable": "dpsgd", "audit": {"mode": "whitebox", "canaries": 10, "estimator": "fdp"}}
    got = reported_metrics("dpsgd", config)
    assert {"audit_epsilon_lb", "audit_epsilon_lb_fdp", "audit_ratio"} <= got
    assert "audit_epsilon_lb_steinke" not in got and "epsilon_lower_bound" not in got
    assert {"epsilon_lower_bound", "audit_epsilon_lb"} <= reported_metrics("dpsgd", {"audit_canaries": 10})
