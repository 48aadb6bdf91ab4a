"""The end of a big sweep (issue 49, point 8): 200 tiny trials finished at 535 s and the command
exited at 686 s on a loaded machine. Measured (benchmarks/sweep_scale.py, ``closing_s``): at 960
trials the closing took 16 s, in three parts that grew with the trials: a search of every child run
to count the finished ones (though Ray had every final result), Tune's read-back of every trial's
history into pandas (which nothing used), and the garbage collector walking the driver's whole
heap (imports and results) again and again, at exit too. These tests pin each fix; no Ray, no wall
time.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace


def _uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def _trial(trial_id: str, seed: int, acc: float | None):
    """A Tune trial as ``tuner.fit()`` leaves it: TERMINATED, with its final result (``acc``) or
    without one (``None``: the sweep stopped before Ray had it)."""
    last = {"trial_id": trial_id, "evaluated": 1.0, "acc_clean": acc, "epsilon": 1.0, "delta": 1e-5} \
        if acc is not None else {"trial_id": trial_id, "epoch": 1}
    return SimpleNamespace(trial_id=trial_id, status="TERMINATED", last_result=last,
                           config={"trainable": "pixeldp", "seed": seed, "epsilon": 1.0}, local_path="/x")


class _Results(list):
    """What ``summarize`` and ``_after_fit`` read of a ResultGrid: each trial's result, and the trials."""

    def __init__(self, trials):
        super().__init__(SimpleNamespace(config=t.config, metrics=t.last_result, error=None) for t in trials)
        self._experiment_analysis = SimpleNamespace(trials=trials)


class _Tuner:
    def __init__(self, trials, seen: dict | None = None):
        self.trials, self.seen = trials, seen if seen is not None else {}

    def fit(self):
        from ray.tune.analysis.experiment_analysis import ExperimentAnalysis

        self.seen["frozen"] = gc.get_freeze_count()
        self.seen["histories"] = ExperimentAnalysis._fetch_trial_dataframes
        return _Results(self.trials)


def _sweep(tmp_path, finished_in_mlflow: list[str]):
    from mlflow.tracking import MlflowClient

    from sweeps.spec import validate_spec
    from sweeps.tracking import start_parent_run
    from trainables.tracking import TrialTracker

    uri = _uri(tmp_path)
    spec = validate_spec({"name": "closing", "trainables": [{"name": "pixeldp", "search": {"seed": [0, 1]}}],
                          "search": {"algorithm": "grid", "metric": "acc_clean", "mode": "max"}})
    info = start_parent_run(uri, "closing", "sweep", spec.raw, {})
    children = {}
    for i, trial_id in enumerate(("t0", "t1")):
        t = TrialTracker.open(info, trial_id=trial_id, trial_name=f"pixeldp seed={i}", trainable="pixeldp")
        t.log_metrics({"acc_clean": 0.5 + 0.1 * i}, step=1)
        if trial_id in finished_in_mlflow:
            MlflowClient(uri).set_terminated(t.run_id, status="FINISHED")
        children[trial_id] = t.run_id
    return uri, spec, info, children


def _count_child_searches(monkeypatch, info) -> list[str]:
    """The searches of every child run of the parent (``search_runs`` with the parent filter alone)."""
    from mlflow.tracking import MlflowClient

    calls: list[str] = []
    original = MlflowClient.search_runs

    def counted(self, experiment_ids, filter_string="", *args, **kwargs):
        if filter_string.strip().endswith(f"= '{info['parent_run_id']}'"):
            calls.append(filter_string)
        return original(self, experiment_ids, filter_string, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "search_runs", counted)
    return calls


def test_a_finished_sweep_searches_its_children_once_and_records_the_same(tmp_path, monkeypatch, capsys):
    """Ray has every trial's final result: the closing needs no count of the finished child runs from
    MLflow (before: one full search for it, then another for the best trial: 4 s each at 960 trials
    on a loaded 2-core machine). The records are those of before: the parent FINISHED with its
    summary, the best trial and its run tagged."""
    from mlflow.tracking import MlflowClient

    from sweeps.cli import EXIT_OK, _fit_and_finish

    uri, spec, info, children = _sweep(tmp_path, finished_in_mlflow=["t0", "t1"])
    searches = _count_child_searches(monkeypatch, info)
    tuner = _Tuner([_trial("t0", 0, 0.5), _trial("t1", 1, 0.6)])
    assert _fit_and_finish(tuner, info, str(tmp_path / "exp"), uri, spec, 2) == EXIT_OK
    assert len(searches) == 1, searches          # the best trial's: trial id -> run id
    parent = MlflowClient(uri).get_run(info["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials"] == 2.0
    # the two seeds are one configuration, represented by its first trial
    assert parent.data.tags["dpsweep.best_trial_id"] == "t0" and parent.data.metrics["best_acc_clean_n"] == 2.0
    assert parent.data.tags["dpsweep.best_run_id"] == children["t0"]
    assert f"trials t0, t1, run {children['t0']}" in capsys.readouterr().out


def test_a_trial_ray_lacks_the_result_of_is_still_looked_up_in_mlflow(tmp_path, monkeypatch, capsys):
    """A trial that closed its FINISHED run before the sweep stopped, Ray without its final result
    (issue 24, point 11): MLflow still decides, with one search more, as before. Finished there, the
    sweep is not interrupted; unfinished there too, it is."""
    from mlflow.tracking import MlflowClient

    from sweeps.cli import EXIT_OK, _fit_and_finish

    uri, spec, info, _ = _sweep(tmp_path, finished_in_mlflow=["t0", "t1"])
    searches = _count_child_searches(monkeypatch, info)
    tuner = _Tuner([_trial("t0", 0, 0.5), _trial("t1", 1, None)])
    assert _fit_and_finish(tuner, info, str(tmp_path / "exp"), uri, spec, 2) == EXIT_OK
    assert len(searches) == 2, searches          # the finished ones', then the best trial's
    assert MlflowClient(uri).get_run(info["parent_run_id"]).info.status == "FINISHED"

    uri, spec, info, _ = _sweep(tmp_path / "second", finished_in_mlflow=["t0"])
    tuner = _Tuner([_trial("t0", 0, 0.5), _trial("t1", 1, None)])
    assert _fit_and_finish(tuner, info, str(tmp_path / "exp2"), uri, spec, 2) == 130
    assert "1 of 2 trials finished" in capsys.readouterr().err
    assert MlflowClient(uri).get_run(info["parent_run_id"]).info.status == "KILLED"


def test_fit_reads_no_trial_histories_and_runs_with_the_imports_frozen(tmp_path):
    """Inside ``tuner.fit()``: Tune's read-back of every trial's history (``result.json`` into
    pandas, 3 ms a trial) is off, and the objects that existed before are out of the collector's
    way (``gc.freeze``). Both undone when the sweep's closing returns; the freeze comes back at exit."""
    from ray.tune.analysis.experiment_analysis import ExperimentAnalysis

    from sweeps import cli
    from sweeps.runner import _no_histories, results_without_histories

    original = ExperimentAnalysis._fetch_trial_dataframes
    before = gc.get_freeze_count()
    uri, spec, info, _ = _sweep(tmp_path, finished_in_mlflow=["t0", "t1"])
    seen: dict = {}
    assert cli._fit_and_finish(_Tuner([_trial("t0", 0, 0.5), _trial("t1", 1, 0.6)], seen), info,
                               str(tmp_path / "exp"), uri, spec, 2) == cli.EXIT_OK
    assert seen["histories"] is _no_histories and ExperimentAnalysis._fetch_trial_dataframes is original
    assert seen["frozen"] > before and gc.get_freeze_count() == before
    assert cli._FREEZE_AT_EXIT == [True]

    # the analysis Tune builds when fit returns: each trial's result, no DataFrame read
    class _Unread:
        trials = [SimpleNamespace(trial_id="t0")]

    with results_without_histories():
        assert ExperimentAnalysis._fetch_trial_dataframes(_Unread()) == {}
    assert ExperimentAnalysis._fetch_trial_dataframes is original
