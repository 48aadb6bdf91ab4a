"""Non-private diagnostics (trainables/diagnostics.py; docs/metrics.md "Non-private diagnostics";
issue 25, point 5): metrics computed on the training data without noise are labelled, dropped from
every output with ``diagnostics: false``, and no searcher or scheduler of a private trial selects on
them (refused at validation, one line)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from sweeps.spec import SpecError, validate_spec

pytestmark = pytest.mark.usefixtures("one_thread")

NOISE_FREE = {"train_loss", "train_acc", "batch_size_mean", "wasserstein", "clipped_fraction", "loss_near_chance"}

DPGAN = {"trainable": "dpgan", "epsilon": 5.0, "train_size": 200, "test_size": 50, "epochs": 2, "batch_size": 50,
         "hidden": 16, "latent_dim": 8, "tstr_samples": 50, "tstr_epochs": 1, "judge_size": 50, "judge_epochs": 1,
         "quality_samples": 20, "eval_samples": 20}
DPSGD = {"trainable": "dpsgd", "epsilon": 5.0, "train_size": 200, "test_size": 50, "epochs": 2, "batch_size": 50,
         "model": "tb_cnn"}


def _run(monkeypatch, config: dict, info: dict | None = None):
    """run_trial with Ray's tune calls replaced by recorders: (per-epoch and final results, the
    checkpoint meta.json of each epoch)."""
    from ray import tune

    from trainables.registry import get_trainable

    results, metas = [], []

    def report(metrics, checkpoint=None):
        results.append(dict(metrics))
        if checkpoint is not None:
            metas.append(json.loads((Path(checkpoint.path) / "meta.json").read_text()))

    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: types.SimpleNamespace(get_trial_id=lambda: "t0"))
    monkeypatch.setattr(tune, "report", report)
    get_trainable(config["trainable"]).fn({**config, **({"_mlflow": info} if info else {})})
    return results, metas


def _mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = MlflowClient(uri).create_experiment("diag", artifact_location=str(tmp_path / "artifacts"))
    return {"tracking_uri": uri, "experiment_id": exp}


def _run_record(info):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(info["tracking_uri"])
    (run,) = client.search_runs([str(info["experiment_id"])])
    history = {k: [m.step for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    return run, history


@pytest.mark.parametrize("diagnostics", [True, False])
def test_dpgan_diagnostics_switch(monkeypatch, tmp_path, diagnostics):
    """diagnostics: true (default; negative control) reports and logs train_loss, wasserstein and
    clipped_fraction, tagged as non-private; false leaves them out of every Ray result, checkpoint
    and MLflow metric, while test_acc, epsilon and the final metrics stay."""
    info = _mlflow(tmp_path)
    results, metas = _run(monkeypatch, {**DPGAN, "diagnostics": diagnostics}, info)
    run, history = _run_record(info)
    per_epoch, final = results[:-1], results[-1]
    assert [r["epoch"] for r in per_epoch] == [1, 2] and all("test_acc" in r for r in per_epoch)
    assert final["epsilon"] <= 5.0 and "acc_clean" in final
    assert history["test_acc"] == [1, 2]
    seen = set().union(*results) | set(run.data.metrics) | {k for m in metas for h in m["history"] for k in h}
    if diagnostics:
        assert {"train_loss", "wasserstein"} <= set(per_epoch[0]) and "clipped_fraction" in final
        assert history["train_loss"] == [1, 2] and "clipped_fraction" in run.data.metrics
        assert run.data.tags["dpsweep.nonprivate_diagnostics"] == ("train_loss, clipped_fraction, loss_near_chance, "
                                                                   "label_keep_rate, analytic_keep_prob")
    else:
        assert not seen & NOISE_FREE, seen & NOISE_FREE
        assert run.data.tags["dpsweep.nonprivate_diagnostics"] == "none"
        assert run.data.params["diagnostics"] == "False"


@pytest.mark.parametrize("diagnostics", [True, False])
def test_dpsgd_diagnostics_switch(monkeypatch, diagnostics):
    results, metas = _run(monkeypatch, {**DPSGD, "diagnostics": diagnostics})
    seen = set().union(*results) | {k for m in metas for h in m["history"] for k in h}
    if diagnostics:  # negative control
        assert {"train_loss", "train_acc", "batch_size_mean", "loss_near_chance"} <= seen
    else:
        assert not seen & NOISE_FREE, seen & NOISE_FREE
        assert {"test_acc", "acc_clean", "epsilon", "not_learned"} <= set(results[-1])


def test_dp_merf_train_loss_is_not_a_diagnostic(monkeypatch):
    """DP-MERF's train_loss is a function of the release only: kept with diagnostics: false."""
    from trainables.diagnostics import diagnostic_names
    from trainables.dp_merf import DPMERFTrialConfig
    from trainables.dpgan import DPGANTrialConfig

    assert "train_loss" not in diagnostic_names(DPMERFTrialConfig)
    assert "train_loss" in diagnostic_names(DPGANTrialConfig)
    cfg = {"trainable": "dp_merf", "epsilon": 1.0, "train_size": 100, "test_size": 50, "n_features": 40, "epochs": 1,
           "steps_per_epoch": 1, "batch_size": 10, "tstr_samples": 50, "tstr_epochs": 1, "judge_size": 50,
           "judge_epochs": 1, "quality_samples": 20, "eval_samples": 20, "diagnostics": False}
    results, _ = _run(monkeypatch, cfg)
    assert "train_loss" in results[0]


# ------------------------------------------------------------------ searchers and schedulers

def _spec(trainable: str, space: dict, **sections) -> dict:
    return {"name": "t", "common": {"train_size": 2000, "test_size": 50},
            "trainables": [{"name": trainable, "search": space}], **sections}


def _error(raw) -> str:
    with pytest.raises(SpecError) as info:
        validate_spec(raw)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("trainable", ["dpsgd", "dpgan", "dpal_sound", "label_dp", "adlm"])
def test_scheduler_on_train_loss_refused_for_private_trainables(trainable):
    msg = _error(_spec(trainable, {"epsilon": [1.0, 2.0]}, scheduler={"type": "asha", "metric": "train_loss"}))
    assert msg.startswith("scheduler.metric: train_loss is a non-private diagnostic (computed on the training data "
                          "without noise, not covered by epsilon) of the private trainable")


def test_scheduler_and_search_on_private_metrics_accepted():
    validate_spec(_spec("dpsgd", {"epsilon": [1.0, 2.0]}, scheduler={"type": "asha", "metric": "test_acc"}))
    validate_spec(_spec("dpsgd", {"epsilon": [1.0, 2.0]}, scheduler={"type": "asha", "metric": "acc_clean"},
                        search={"metric": "acc_clean", "mode": "max"}))
    validate_spec(_spec("dp_merf", {"epsilon": [1.0, 2.0]}, scheduler={"type": "asha", "metric": "train_loss"}))


def test_non_private_trials_may_schedule_on_train_loss_unless_dropped():
    """Negative controls: PixelDP (no privacy guarantee) and a DP-SGD baseline (epsilon null) keep
    ASHA on train_loss; diagnostics: false refuses it even there (nothing to compare)."""
    asha = {"type": "asha", "metric": "train_loss"}
    validate_spec(_spec("pixeldp", {"epsilon": [0.5, 1.0]}, scheduler=asha))
    validate_spec(_spec("dpsgd", {"epsilon": [None]}, scheduler=asha))
    msg = _error(_spec("dpsgd", {"epsilon": [None, 1.0]}, scheduler=asha))
    assert "non-private diagnostic" in msg
    raw = _spec("pixeldp", {"epsilon": [0.5, 1.0]}, scheduler=asha)
    raw["common"]["diagnostics"] = False
    assert _error(raw) == ("scheduler.metric: train_loss is a non-private diagnostic and trials with diagnostics: "
                           "false do not report it; use test_acc or a final metric such as acc_clean (docs/metrics.md)")


@pytest.mark.parametrize("metric", ["train_loss", "train_acc", "clipped_fraction", "loss_near_chance"])
def test_search_metric_on_a_diagnostic_refused(metric):
    msg = _error(_spec("dpgan", {"epsilon": [1.0, 2.0]}, search={"metric": metric, "mode": "min"}))
    assert msg.startswith(f"search.metric: {metric} is a non-private diagnostic")
