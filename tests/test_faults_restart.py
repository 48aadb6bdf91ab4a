"""Issue 33, points 1 and 2: a trial is identified by what survives a restart (its trainable, config
and repeat: ``dpsweep.trial_key``), never retrained once MLflow has it FINISHED, and never given a
second child run. The end-to-end case kills the driver (SIGKILL) in the seconds between a trial's
completion and Tune's next experiment snapshot, then resumes twice."""

from __future__ import annotations

import signal

import pytest

from tests.test_interrupts import _Sweep, _tiny_spec
from tests.test_sweep_e2e import _runs


def _info(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("keys", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}).info.run_id
    return {"tracking_uri": uri, "experiment_id": exp, "parent_run_id": parent}, client


def test_a_restarted_trial_under_a_new_ray_id_logs_into_its_own_run(tmp_path):
    """Point 2: ``Tuner.restore(restart_errored=True)`` gives an errored trial a new Ray id; its
    trial key finds the FAILED run, which it reopens (one child run, the new id recorded)."""
    from trainables.tracking import TAG_KEY, TAG_SESSION, TAG_TRIAL, TrialTracker

    info, client = _info(tmp_path)
    first = TrialTracker.open(info, trial_id="aaaa_00000", trial_name="dpsgd seed=0", trainable="dpsgd", key="k1",
                              session="driver1")
    first.finish("FAILED")
    again = TrialTracker.open(info, trial_id="bbbb_00000", trial_name="dpsgd seed=0", trainable="dpsgd", key="k1",
                              session="driver2")
    assert again.run_id == first.run_id
    run = client.get_run(first.run_id)
    assert run.info.status == "RUNNING" and run.data.tags[TAG_KEY] == "k1" and run.data.tags[TAG_TRIAL] == "bbbb_00000"
    assert run.data.tags[TAG_SESSION] == "driver2"
    other = TrialTracker.open(info, trial_id="bbbb_00001", trial_name="dpsgd seed=1", trainable="dpsgd", key="k2",
                              session="driver2")
    assert other.run_id != first.run_id   # negative control: another trial key is another run


def test_a_failed_run_is_not_handed_to_another_trial_of_the_same_driver(tmp_path):
    """Two trials of one driver with one key (a user's Tuner sweeping a key the trainable drops, as
    the crash-and-retry test's Tuner does under load): the first fails, the second starts before its
    retry. The second opens its own run; the retry finds its own by its Ray id. Without a driver session (a
    user's own Tuner) the key adopts nothing."""
    from trainables.tracking import TrialTracker

    info, client = _info(tmp_path)
    crashed = TrialTracker.open(info, trial_id="cccc_00000", trial_name="t", trainable="pixeldp", key="k", session="d1")
    crashed.finish("FAILED")
    sibling = TrialTracker.open(info, trial_id="cccc_00001", trial_name="t", trainable="pixeldp", key="k", session="d1")
    assert sibling.run_id != crashed.run_id
    retry = TrialTracker.open(info, trial_id="cccc_00000", trial_name="t", trainable="pixeldp", key="k", session="d1")
    assert retry.run_id == crashed.run_id
    retry.finish("FAILED")
    own_tuner = TrialTracker.open(info, trial_id="dddd_00000", trial_name="t", trainable="pixeldp", key="k")
    assert own_tuner.run_id not in (crashed.run_id, sibling.run_id)


def test_the_trial_key_is_the_config_and_repeat_not_the_ray_id():
    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import trial_key, validate_config

    base = {"trainable": "dpsgd", "dataset": "mnist", "epsilon": 1.0, "seed": 0, "repeat": 0}
    cfg = validate_config(base, DPSGDTrialConfig)
    same = trial_key(cfg, "dpsgd", {**base, "_mlflow": {"parent_run_id": "x"}})
    assert same == trial_key(cfg, "dpsgd", base)
    assert trial_key(cfg, "dpsgd", {**base, "repeat": 1}) != same
    assert trial_key(validate_config({**base, "epsilon": 2.0}, DPSGDTrialConfig), "dpsgd", base) != same


@pytest.mark.slow
def test_driver_killed_after_a_trial_completed_then_two_resumes_count_each_trial_once(tmp_path):
    """Point 1. Before: the clean-up deleted the completed trial's checkpoint at once; the snapshot
    still said RUNNING; the first resume failed it ("does not exist on storage anymore", exit 1)
    and the second retrained it under a new id beside its FINISHED run (3 child runs, 2 trials)."""
    name = "kill-completed"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sweep = _Sweep(tmp_path, ["run", str(_tiny_spec(tmp_path, name)), "--tracking-uri", uri], hook="completed")
    sweep.wait_for(lambda: sweep.marked("completed"))
    sweep.proc.send_signal(signal.SIGKILL)
    sweep.finish(60)
    exp_dirs = [p for p in (tmp_path / "ray_results").iterdir() if p.is_dir()]
    assert len(exp_dirs) == 1
    finished_before = {r.data.tags["dpsweep.trial_key"]: r.info.end_time
                       for r in _runs(uri, name)[2] if r.info.status == "FINISHED"}
    assert finished_before, sweep.out

    for attempt in (1, 2):
        resumed = _Sweep(tmp_path, ["resume", str(exp_dirs[0])])
        rc = resumed.finish(300)
        assert rc == 0, f"resume {attempt}:\n{resumed.out}"
        assert "does not exist on storage" not in resumed.out, resumed.out
        client, parents, children = _runs(uri, name)
        assert len(children) == 2, (attempt, [(r.info.run_name, r.info.status) for r in children], resumed.out)
        assert all(r.info.status == "FINISHED" for r in children)
        assert len({r.data.tags["dpsweep.trial_key"] for r in children}) == 2
        assert len({r.data.params["seed"] + r.data.params["epsilon"] for r in children}) == 2
        assert parents[0].info.status == "FINISHED"
        # the trial MLflow had FINISHED was reported from MLflow, not trained again
        ended = {r.data.tags["dpsweep.trial_key"]: r.info.end_time for r in children}
        assert all(ended[k] == t for k, t in finished_before.items())


def test_trials_differing_only_beyond_the_schema_have_their_own_keys():
    """A user's own Tuner may sweep a key the schema does not know (the crash-and-retry
    test's ``crash_at``): the two trials validate to one config, yet are two trials with two runs."""
    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import trial_key, validate_config

    base = {"trainable": "dpsgd", "dataset": "mnist", "epsilon": 1.0, "seed": 0}
    cfg = validate_config(base, DPSGDTrialConfig)
    assert trial_key(cfg, "dpsgd", {**base, "crash": True}) != trial_key(cfg, "dpsgd", {**base, "crash": False})
