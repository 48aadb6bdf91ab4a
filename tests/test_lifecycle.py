"""The life of a sweep (issue 13): GPU resolution, run names and tags, nothing logged twice,
interrupted and crashed sweeps, reports of sweeps without results, `dpsweep mechanisms NAME`.

The tests here need no Ray (they call the pieces directly on a temporary SQLite store); the
end-to-end ones that run Ray are in tests/test_lifecycle_e2e.py.
"""

from __future__ import annotations

import pytest


def _uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def _ours(text: str) -> list[str]:
    """dpsweep's own console lines (MLflow's database set-up notes go to stderr too)."""
    return [line for line in text.splitlines() if line.startswith("dpsweep:")]


# --------------------------------------------------------------------------- point 14: GPUs


def test_auto_gpu_is_zero_without_gpus_and_a_share_with_them():
    from sweeps.cluster_checks import AUTO_GPU_SHARE, resolve_gpu

    assert resolve_gpu("auto", {"CPU": 2.0}, max_concurrent=None, can_autoscale=False) == 0.0
    assert resolve_gpu("auto", {"CPU": 2.0, "GPU": 0.0}, max_concurrent=4, can_autoscale=True) == 0.0
    assert resolve_gpu("auto", {"GPU": 1.0}, max_concurrent=None, can_autoscale=False) == AUTO_GPU_SHARE == 0.25
    assert resolve_gpu("auto", {"GPU": 1.0}, max_concurrent=4, can_autoscale=False) == 0.25
    assert resolve_gpu("auto", {"GPU": 2.0}, max_concurrent=4, can_autoscale=False) == 0.5
    assert resolve_gpu("auto", {"GPU": 8.0}, max_concurrent=2, can_autoscale=False) == 1.0
    assert resolve_gpu("auto", {"GPU": 1.0}, max_concurrent=3, can_autoscale=False) == 0.33


def test_explicit_gpu_without_gpus_is_refused_naming_the_field():
    from sweeps.cluster_checks import ResourcesRefused, resolve_gpu

    with pytest.raises(ResourcesRefused, match=r"^resources\.gpu: 1 GPU\(s\) per trial, but the Ray cluster has no GPU"):
        resolve_gpu(1.0, {"CPU": 2.0}, max_concurrent=None, can_autoscale=False)
    with pytest.raises(ResourcesRefused, match="has 1 GPU"):
        resolve_gpu(2.0, {"GPU": 1.0}, max_concurrent=None, can_autoscale=False)
    # a cluster that may autoscale (RAY_ADDRESS) can still get GPU workers: Ray waits for them
    assert resolve_gpu(1.0, {"CPU": 2.0}, max_concurrent=None, can_autoscale=True) == 1.0
    assert resolve_gpu(0.5, {"GPU": 1.0}, max_concurrent=None, can_autoscale=False) == 0.5
    assert resolve_gpu(0, {}, max_concurrent=None, can_autoscale=False) == 0.0


def test_spec_gpu_defaults_to_auto_and_takes_numbers():
    from sweeps.spec import SpecError, validate_spec

    base = {"name": "x", "trainables": [{"name": "pixeldp"}]}
    assert validate_spec(base).resources.gpu == "auto"
    assert validate_spec({**base, "resources": {"gpu": 0.25}}).resources.gpu == 0.25
    with pytest.raises(SpecError, match=r"^resources\.gpu: must be a number >= 0 or 'auto', got 'all'$"):
        validate_spec({**base, "resources": {"gpu": "all"}})


def test_device_name_on_cpu():
    import torch

    from trainables.runtime import device_name

    assert device_name(torch.device("cpu")) == "cpu"


# --------------------------------------------------------------------------- point 11: names and tags


def test_child_run_name_from_trainable_and_swept_values():
    from trainables.tracking import run_name

    cfg = {"epsilon": 1.0, "delta": 1e-5, "seed": 0, "lr": 0.001, "attacks": {"pgd": [0.1]}}
    assert run_name("dpsgd", cfg, ["epsilon"]) == "dpsgd epsilon=1 seed=0"
    assert run_name("dpsgd", cfg, ["epsilon", "lr", "seed"]) == "dpsgd epsilon=1 lr=0.001 seed=0"
    assert run_name("dpsgd", {"epsilon": None}, ["epsilon"]) == "dpsgd epsilon=None"


def test_swept_keys_are_those_that_vary():
    from sweeps.runner import swept_keys
    from sweeps.spec import expand_trials, validate_spec

    spec = validate_spec({"name": "x", "common": {"epochs": 1},
                          "trainables": [{"name": "pixeldp", "search": {"epsilon": [0.5, 1.0], "lr": 0.01}},
                                         {"name": "dpsgd", "search": {"epsilon": [1.0]}}]})
    keys = swept_keys(spec, expand_trials(spec))
    assert keys == {"pixeldp": ["epsilon"], "dpsgd": []}
    optuna = validate_spec({"name": "x", "search": {"algorithm": "optuna", "num_samples": 2, "metric": "acc_clean",
                                                    "mode": "max"},
                            "trainables": [{"name": "pixeldp", "search": {"epsilon": [0.5, 1.0], "lr": {
                                "loguniform": [1e-4, 1e-2]}, "epochs": 1}}]})
    assert swept_keys(optuna) == {"pixeldp": ["epsilon", "lr"]}


def test_experiment_kind_tag_on_create_and_on_reuse(tmp_path):
    from mlflow.tracking import MlflowClient

    from sweeps.tracking import start_parent_run

    uri = _uri(tmp_path)
    client = MlflowClient(uri)
    old = client.create_experiment("made-elsewhere")  # an experiment dpsweep did not create
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    for name in ("fresh", "made-elsewhere"):
        info = start_parent_run(uri, name, "sweep-1", {"name": name}, {})
        exp = client.get_experiment(info["experiment_id"])
        assert exp.name == name
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


# --------------------------------------------------------------------------- point 5: nothing twice


def test_reopened_trial_run_never_logs_a_step_twice(tmp_path):
    """A trial that logged epoch 2 and died before its checkpoint re-runs epoch 2 from the epoch-1
    checkpoint: its run must keep one point per (metric, step)."""
    from mlflow.tracking import MlflowClient

    from sweeps.tracking import start_parent_run
    from trainables.tracking import TrialTracker

    uri = _uri(tmp_path)
    info = start_parent_run(uri, "twice", "sweep", {"name": "twice"}, {})
    first = TrialTracker.open(info, trial_id="t1", trial_name="pixeldp epsilon=1 seed=0", trainable="pixeldp")
    first.log_metrics({"train_loss": 2.0, "test_acc": 0.1}, step=1)
    first.log_metrics({"train_loss": 1.5, "test_acc": 0.3}, step=2)  # then the trial dies
    # the retry restores the epoch-1 checkpoint (run id inside) and repeats epoch 2, then goes on
    again = TrialTracker.open(info, trial_id="t1", trial_name="ignored", trainable="pixeldp", run_id=first.run_id)
    assert again.run_id == first.run_id
    again.log_metrics({"train_loss": 1.5, "test_acc": 0.3}, step=2)
    again.log_metrics({"train_loss": 1.2, "test_acc": 0.5}, step=3)
    again.log_metrics({"acc_clean": 0.5}, step=3)
    again.log_metrics({"acc_clean": 0.5}, step=3)  # the final metrics, re-evaluated after a crash
    # a retry that finds its run by the trial-id tag (crash before the first checkpoint)
    third = TrialTracker.open(info, trial_id="t1", trial_name="ignored", trainable="pixeldp")
    assert third.run_id == first.run_id
    third.log_metrics({"train_loss": 2.0, "test_acc": 0.1}, step=1)
    client = MlflowClient(uri)
    for key, steps in (("train_loss", [1, 2, 3]), ("test_acc", [1, 2, 3]), ("acc_clean", [3])):
        hist = client.get_metric_history(first.run_id, key)
        assert sorted(h.step for h in hist) == steps, key
    run = client.get_run(first.run_id)
    assert run.info.run_name == "pixeldp epsilon=1 seed=0"


# --------------------------------------------------------------------------- points 4 and 7: status


class _FailingTuner:
    def fit(self):
        raise RuntimeError("searcher exploded\nsecond line")


def test_a_crashed_sweep_marks_its_parent_failed(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from sweeps.cli import EXIT_FAILED, _fit_and_finish
    from sweeps.spec import validate_spec
    from sweeps.tracking import start_parent_run
    from trainables.tracking import TrialTracker

    uri = _uri(tmp_path)
    spec = validate_spec({"name": "crash", "trainables": [{"name": "pixeldp"}]})
    info = start_parent_run(uri, "crash", "sweep", spec.raw, {})
    child = TrialTracker.open(info, trial_id="t1", trial_name="t1", trainable="pixeldp")
    assert _fit_and_finish(_FailingTuner(), info, str(tmp_path / "exp"), uri, spec, 1) == EXIT_FAILED
    err = _ours(capsys.readouterr().err)
    assert len(err) == 1 and "RuntimeError: searcher exploded" in err[0] and "FAILED" in err[0]
    client = MlflowClient(uri)
    assert client.get_run(info["parent_run_id"]).info.status == "FAILED"
    assert client.get_run(child.run_id).info.status == "FAILED"


class _InterruptedTuner:
    def fit(self):
        raise KeyboardInterrupt


def test_a_second_ctrl_c_marks_the_parent_killed_and_says_how_to_resume(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from sweeps.cli import EXIT_INTERRUPTED, _fit_and_finish
    from sweeps.spec import validate_spec
    from sweeps.tracking import reopen_parent_run, start_parent_run

    uri = _uri(tmp_path)
    spec = validate_spec({"name": "int", "trainables": [{"name": "pixeldp"}]})
    info = start_parent_run(uri, "int", "sweep", spec.raw, {})
    exp_dir = str(tmp_path / "exp")
    assert _fit_and_finish(_InterruptedTuner(), info, exp_dir, uri, spec, 2) == EXIT_INTERRUPTED == 130
    err = capsys.readouterr().err
    assert f"resume {exp_dir}" in err and "KILLED" in err
    client = MlflowClient(uri)
    parent = client.get_run(info["parent_run_id"])
    assert parent.info.status == "KILLED" and "resume" in parent.data.tags["dpsweep.interrupted"]
    reopen_parent_run(info)
    assert client.get_run(info["parent_run_id"]).info.status == "RUNNING"


# --------------------------------------------------------------------------- point 6: report


def _sweep_with_children(uri: str, experiment: str, name: str, statuses: list[str]) -> dict:
    from mlflow.tracking import MlflowClient

    from sweeps.tracking import finish_parent_run, start_parent_run
    from trainables.tracking import TrialTracker

    info = start_parent_run(uri, experiment, name, {"name": experiment}, {})
    for i, status in enumerate(statuses):
        t = TrialTracker.open(info, trial_id=f"{name}-{i}", trial_name=f"pixeldp epsilon={i + 1}", trainable="pixeldp")
        t.log_params({"trainable": "pixeldp", "epsilon": float(i + 1)})
        t.log_metrics({"acc_clean": 0.5 + 0.1 * i, "compute_seconds": 1.0}, step=1)
        MlflowClient(uri).set_terminated(t.run_id, status=status)
    finish_parent_run(info, {"trials": float(len(statuses))}, "FINISHED" if statuses else "KILLED")
    return info


def test_report_skips_a_latest_sweep_without_results(tmp_path, capsys):
    from sweeps.cli import main
    from sweeps.report.data import load_sweep

    uri = _uri(tmp_path)
    _sweep_with_children(uri, "exp", "sweep-a", ["FINISHED", "FINISHED"])
    _sweep_with_children(uri, "exp", "sweep-b", [])            # stopped before any trial
    _sweep_with_children(uri, "exp", "sweep-c", ["FAILED"])    # every trial errored
    sweep = load_sweep("exp", uri)
    assert sweep.parent.info.run_name == "sweep-a" and len(sweep.trials) == 2
    assert "reporting on sweep-a" in capsys.readouterr().err

    _sweep_with_children(uri, "empty", "sweep-x", [])
    code = main(["report", "empty", "--tracking-uri", uri, "--out", str(tmp_path / "rep")])
    err = _ours(capsys.readouterr().err)
    assert code == 2
    assert err == [
        "dpsweep: error: experiment: no sweep of 'empty' has a finished trial (the latest, sweep-x, is KILLED); "
        "nothing to report"]


# --------------------------------------------------------------------------- point 15: mechanisms NAME


def test_mechanisms_name_shows_defaults_allowed_values_and_meaning(capsys):
    from sweeps.cli import main

    assert main(["mechanisms", "pixeldp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pixeldp: ")
    assert "dpsgd:" not in out
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert "'l2' | 'l1'" in lines["norm"] and "l2: Gaussian noise" in lines["norm"]
    assert "float (> 0)" in lines["epsilon"] and "1.0" in lines["epsilon"]
    assert "'mnist' | 'fashion_mnist' | 'cifar10'" in lines["dataset"]
    assert "int | null (> 0)" in lines["train_size"]


def test_mechanisms_unknown_name_exits_2_with_did_you_mean(capsys):
    from sweeps.cli import main

    assert main(["mechanisms", "pixeldb"]) == 2
    err = _ours(capsys.readouterr().err)
    assert len(err) == 1 and "unknown trainable 'pixeldb' (did you mean 'pixeldp'?)" in err[0]


def test_results_table_marks_trials_that_did_not_learn():
    from types import SimpleNamespace

    from sweeps.runner import format_table, summarize

    grid = [SimpleNamespace(config={"trainable": "pixeldp", "epsilon": 1.0}, error=None,
                            metrics={"trial_id": "a", "acc_clean": 0.1, "evaluated": 1.0, "not_learned": 1.0}),
            SimpleNamespace(config={"trainable": "pixeldp", "epsilon": 2.0}, error=None,
                            metrics={"trial_id": "b", "acc_clean": 0.9, "evaluated": 1.0, "not_learned": 0.0})]
    rows, _, _ = summarize(grid)
    assert [(r["status"], r["!"]) for r in rows] == [("DONE", "!"), ("DONE", "")]  # status stays DONE (selection)
    table = format_table(rows).splitlines()
    assert table[0].rstrip().endswith("status  !") and table[2].rstrip().endswith("DONE    !")
    assert table[3].rstrip().endswith("DONE")


def test_asha_on_a_final_metric_is_refused_at_validation(tmp_path, capsys):
    """ASHA compares trials at rungs (epochs); a final-only metric with no per-epoch counterpart
    exists once per trial, after the last epoch, so no rung could compare it: refused with one line
    (docs/specs.md)."""
    import yaml

    from sweeps.cli import main

    spec = tmp_path / "asha.yaml"
    spec.write_text(yaml.safe_dump({"name": "asha", "trainables": [{"name": "pixeldp"}],
                                    "scheduler": {"type": "asha", "metric": "cert_acc_0.1", "mode": "max"}}))
    assert main(["validate", str(spec)]) == 2
    err = _ours(capsys.readouterr().err)
    assert len(err) == 1 and "scheduler.metric: asha compares per-epoch metrics" in err[0]


def test_asha_on_acc_clean_compares_test_acc_at_its_rungs(tmp_path, capsys):
    """acc_clean has a per-epoch counterpart (test_acc): ASHA runs on it, and validate says so."""
    import yaml

    from sweeps.cli import main
    from sweeps.runner import trial_scheduler
    from sweeps.spec import load_spec

    spec = tmp_path / "asha.yaml"
    spec.write_text(yaml.safe_dump({"name": "asha", "trainables": [{"name": "pixeldp"}],
                                    "scheduler": {"type": "asha", "metric": "acc_clean"}}))
    assert main(["validate", str(spec)]) == 0
    out = capsys.readouterr()
    assert "compares its per-epoch counterpart test_acc" in out.err + out.out
    loaded = load_spec(spec)
    assert loaded.scheduler.mode == "max"
    sched = trial_scheduler(loaded)
    assert sched._metric == "test_acc" and sched._mode == "max"


def test_mlflow_ui_hint_opens_the_training_view():
    from sweeps.cli import mlflow_ui_hint

    local = mlflow_ui_hint("sqlite:////tmp/x/mlflow.db", "3")
    assert "ui --backend-store-uri sqlite:////tmp/x/mlflow.db" in local
    assert local.endswith("http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning")
    assert mlflow_ui_hint("http://head:5000/", "7") == "http://head:5000/#/experiments/7/runs?workflowType=machine_learning"
