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
    """A dpsgd trial with engine canaries (its default) and accountant pld: every audit metric is
    logged; audit_claim is the epsilon the trial was calibrated to (epsilon_pld, not the looser RDP
    figure); audit_beta and audit_delta are the configured 0.05 and the trial's delta, and every
    logged bound equals the bound recomputed from the logged counts at them (issue 35.6: an
    audit at twice its beta logged 0.1 and larger bounds)."""
    from mlflow.tracking import MlflowClient

    from dpmech.privacy.audit.fdp import eps_delta_lower_bound, mu_lower_bound
    from dpmech.privacy.audit.gdp import gdp_epsilon
    from dpmech.privacy.audit.one_run import epsilon_lower_bound

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = MlflowClient(uri).create_experiment("wb", artifact_location=str(tmp_path / "artifacts"))
    info = {"tracking_uri": uri, "experiment_id": exp}
    audit = {"mode": "whitebox", "canaries": 500, "estimator": ["fdp", "steinke", "gdp"], "guess_fraction": 0.1}
    final = _run(monkeypatch, {"trainable": "dpsgd", **TINY, "accountant": "pld", "audit": audit}, info)[-1]
    for key in ("audit_epsilon_lb", "audit_epsilon_lb_fdp", "audit_mu_lb_fdp", "audit_epsilon_gaussian_fdp",
                "audit_epsilon_lb_steinke", "audit_epsilon_est_gdp", "audit_claim", "audit_ratio", "audit_canaries",
                "audit_steps", "audit_beta", "audit_delta", "audit_engine_canaries"):
        assert key in final, key
    assert final["audit_engine_canaries"] == 1.0                           # dpsgd's default: engine canaries
    assert final["audit_epsilon_lb"] == final["audit_epsilon_lb_fdp"]      # the first rigorous estimator
    assert final["audit_claim"] == final["epsilon_pld"] != final["epsilon"]
    assert 0 < final["audit_epsilon_lb"] <= final["audit_claim"]
    assert final["audit_ratio"] == pytest.approx(final["audit_epsilon_lb"] / final["audit_claim"])
    assert final["audit_steps"] == 2 * 4
    assert "epsilon_lower_bound" not in final and "audit_mu_claim" not in final   # q = 1/4: not a Gaussian
    (run,) = MlflowClient(uri).search_runs([str(exp)])
    logged = run.data.metrics
    assert logged["audit_beta"] == 0.05 and logged["audit_delta"] == float(run.data.params["delta"])
    m, r, v = (int(logged[k]) for k in ("audit_canaries", "audit_guesses", "audit_correct"))
    beta, delta = 0.05, logged["audit_delta"]
    assert logged["audit_epsilon_lb_steinke"] == pytest.approx(epsilon_lower_bound(r, v, beta=beta, delta=delta, m=m))
    assert logged["audit_epsilon_lb_fdp"] == pytest.approx(eps_delta_lower_bound(m, r, v, delta=delta, beta=beta))
    mu = mu_lower_bound(m, r, v, beta=beta)
    assert logged["audit_mu_lb_fdp"] == pytest.approx(mu)
    assert logged["audit_epsilon_gaussian_fdp"] == pytest.approx(gdp_epsilon(mu, delta) if mu > 0 else 0.0)
    assert logged["audit_epsilon_lb"] == pytest.approx(logged["audit_epsilon_lb_fdp"])
    assert "whitebox" in run.data.params["audit"] and "'canary': 'engine'" in run.data.params["audit"]


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
    for schema, kind in ((DPSGDTrialConfig, "engine"), (DPALSoundTrialConfig, "inserted"),
                         (SecureSGDTrialConfig, "engine")):
        assert schema(audit=wb).audit == {"mode": "whitebox", "canaries": 100, "estimator": ["steinke", "fdp", "gdp"],
                                          "confidence": 0.95, "canary": kind, "direction": "dirac",
                                          "statistic": "llr", "guess_fraction": 0.2}
    assert DPSGDTrialConfig(audit={**wb, "canary": "inserted", "direction": "random"}).audit["canary"] == "inserted"
    with pytest.raises(ValidationError, match="use 'inserted'"):
        DPALSoundTrialConfig(audit={**wb, "canary": "engine"})
    with pytest.raises(ValidationError, match="audit.direction"):
        DPSGDTrialConfig(audit={**wb, "direction": "random"})
    with pytest.raises(ValidationError, match="only a white-box audit"):
        DPSGDTrialConfig(audit={"mode": "blackbox", "canaries": 10, "canary": "engine"})
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

    assert DPGANTrialConfig(audit=wb).audit["canary"] == "inserted"      # the critic's private step
    from trainables.adlm import AdLMTrialConfig
    from trainables.label_dp import LabelDPTrialConfig

    assert AdLMTrialConfig(audit_canaries=10).audit_canaries == 10      # the list in docs/audit.md
    with pytest.raises(ValidationError, match="no privacy guarantee for its training examples"):
        LabelDPTrialConfig(audit_canaries=10)                              # label DP protects labels only
    with pytest.raises(ValidationError, match="does not train with it"):
        DPMERFTrialConfig(audit=wb)
    # a sweep's trial config carries every key: the flat keys at their defaults state no second audit
    full = {**DPSGDTrialConfig().model_dump(), "audit": wb}
    assert validate_config({"trainable": "dpsgd", **full}, DPSGDTrialConfig).audit["mode"] == "whitebox"


def test_spec_knows_the_audit_metrics():
    from sweeps.spec.space import reported_metrics

    config = {"trainable": "dpsgd", "audit": {"mode": "whitebox", "canaries": 10, "estimator": "fdp"}}
    got = reported_metrics("dpsgd", config)
    assert {"audit_epsilon_lb", "audit_epsilon_lb_fdp", "audit_ratio"} <= got
    assert "audit_epsilon_lb_steinke" not in got and "epsilon_lower_bound" not in got
    assert {"epsilon_lower_bound", "audit_epsilon_lb"} <= reported_metrics("dpsgd", {"audit_canaries": 10})
