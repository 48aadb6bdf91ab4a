"""Issue 24, point 12 (and the Tuner-metric part of point 3): dp-accounting's convergence
warnings stay off the console; ``dpsweep mechanisms`` describes dpsgd's default clipping and
shows ``Annotated`` types in words; ``dpmech.certify(...)`` is a function; ``trials.csv`` spells
booleans ``true``/``false``; a final metric works as a Tuner metric and an Optuna objective."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

_COMPOSE = ("from dp_accounting import dp_event\n"
            "from dp_accounting.rdp import rdp_privacy_accountant as r\n"
            "a = r.RdpAccountant()\n"
            "a.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.0)))\n"
            "print('epsilon', a.get_epsilon(1e-5))\n"
            "import logging; logging.getLogger('absl').warning('another absl warning')\n")


def _stderr_of(prefix: str) -> str:
    proc = subprocess.run([sys.executable, "-c", prefix + _COMPOSE], capture_output=True, text=True, cwd=ROOT,
                          check=True)
    assert "epsilon" in proc.stdout
    return proc.stderr


def test_accounting_convergence_warnings_are_dropped_once_trainables_load():
    # negative control: this composition makes dp-accounting warn for several orders
    assert _stderr_of("").count("_compute_log_a_frac failed to converge") >= 3
    quiet = _stderr_of("import trainables\n")
    assert "failed to converge" not in quiet
    assert "another absl warning" in quiet  # only that message is dropped


def test_the_cli_installs_the_filter_too():
    code = ("import logging, sweeps.cli as c\n"
            "c.main(['validate', 'sweeps/quickstart.yaml'])\n"
            "assert any(type(f).__name__ == '_AccountingNoiseFilter' for f in logging.getLogger('absl').filters)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)


def test_mechanisms_dpsgd_names_the_default_clipping_and_shows_bounds_in_words(capsys):
    from sweeps.cli import main

    assert main(["mechanisms", "dpsgd"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "(ghost or flat)" not in first and "bk" in first and "book-keeping" in first
    eot = next(line for line in out.splitlines() if line.startswith("eot_samples "))
    assert "int (> 0) | 'auto'" in eot
    assert "Annotated" not in out and "FieldInfo" not in out


def test_dpmech_certify_is_a_function():
    import dpmech
    from dpmech.robustness.certification import certify, certify_counts
    from dpmech.robustness.noise_layer import NoiseLayer  # noqa: F401 - public names still load

    assert dpmech.certify is certify and callable(certify_counts)

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.softmax(self.lin(x + torch.randn_like(x)), dim=1)

    torch.manual_seed(0)
    model, x, y = Noisy(), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    kw = dict(n=50, mechanism="gaussian", noise_scale=1.0, generator=None)
    a = dpmech.certify(model, x, y, **{**kw, "generator": torch.Generator().manual_seed(1)})
    b = certify(model, x, y, **{**kw, "generator": torch.Generator().manual_seed(1)})
    assert (a.counts == b.counts).all() and (a.certified_size == b.certified_size).all()


def test_trials_csv_spells_booleans_as_the_spec_does(tmp_path):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from sweeps.report import make_report
    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("csv")
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}, run_name="sweep")
    for i, eps in enumerate((0.5, 1.0)):
        run = client.create_run(exp, run_name=f"t{i}", tags={TAG_PARENT: parent.info.run_id, TAG_TRAINABLE: "pixeldp"})
        client.log_batch(run.info.run_id, params=[Param("epsilon", str(eps)), Param("attack_labels", "true"),
                                                  Param("certifier", "default")],
                         metrics=[Metric("acc_clean", 0.8 + i / 10, 0, 0), Metric("robustness_epsilon", eps, 0, 0)])
        client.set_terminated(run.info.run_id, "FINISHED")
    client.set_terminated(parent.info.run_id, "FINISHED")
    make_report("csv", uri, tmp_path / "report")
    import csv

    rows = list(csv.DictReader((tmp_path / "report" / "trials.csv").open()))
    assert [r["param.attack_labels"] for r in rows] == ["true", "true"]
    assert [r["released"] for r in rows] == ["false", "false"]
    assert [r["param.certifier"] for r in rows] == ["default", "default"]
    assert "True" not in (tmp_path / "report" / "trials.csv").read_text()


def test_importing_trainables_lets_a_final_metric_be_the_tuner_metric():
    env = {k: v for k, v in os.environ.items() if k != "TUNE_DISABLE_STRICT_METRIC_CHECKING"}
    code = ("import os\n"
            "before = os.environ.get('TUNE_DISABLE_STRICT_METRIC_CHECKING')\n"
            "from trainables.pixeldp import pixeldp\n"
            "print(before, os.environ['TUNE_DISABLE_STRICT_METRIC_CHECKING'])\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None 1"
    env["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "0"  # a user's own choice stands
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0 0"


def test_final_metric_optuna_search_skips_per_epoch_results():
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from trainables import FinalMetricOptunaSearch

    def searcher(cls):
        s = cls(metric="acc_clean", mode="max", seed=0)
        s.set_search_properties("acc_clean", "max", {"epsilon": tune.uniform(0.1, 2.0)})
        assert "epsilon" in s.suggest("t1")
        return s

    epoch = {"train_loss": 1.2, "test_acc": 0.5, "training_iteration": 1}
    with pytest.raises(KeyError, match="acc_clean"):  # negative control: Ray's own
        searcher(OptunaSearch).on_trial_result("t1", epoch)
    s = searcher(FinalMetricOptunaSearch)
    s.on_trial_result("t1", epoch)
    s.on_trial_complete("t1", {**epoch, "acc_clean": 0.9, "training_iteration": 2})
    (trial,) = s._ot_study.trials
    assert math.isclose(trial.value, 0.9)
    from sweeps.runner import _final_metric_optuna

    assert _final_metric_optuna() is FinalMetricOptunaSearch  # the CLI's searcher is the public one


def test_dpmech_audit_is_a_function_like_certify():
    """``dpmech.audit(scores, included)`` runs the one-run audit."""
    import numpy as np

    import dpmech
    from dpmech.privacy.audit import one_run as audit_module

    rng = np.random.default_rng(0)
    included = rng.random(200) < 0.5
    scores = included * 3.0 + rng.normal(size=200)
    assert dpmech.audit is audit_module.audit
    out = dpmech.audit(scores, included, guess_fraction=0.2, beta=0.05, delta=0.0)
    assert out == audit_module.audit(scores, included, guess_fraction=0.2, beta=0.05, delta=0.0)
    assert out["epsilon_lower_bound"] > 0
