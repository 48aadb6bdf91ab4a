"""Fault suite (issue 33, point 7): a failed trial's MLflow run says why: the exception's last line
as the tag ``dpsweep.error`` and the traceback as the artifact ``error/traceback.txt``; a retry that
finishes keeps the traceback and moves the tag to ``dpsweep.error_retried``."""

from __future__ import annotations

from pathlib import Path

from trainables.runtime import TAG_ERROR, clear_failure, record_failure
from trainables.tracking import TrialTracker


def _tracker(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    exp = MlflowClient(uri).create_experiment("e")
    return TrialTracker.open({"tracking_uri": uri, "experiment_id": exp}, trial_id="t1", trial_name="t1",
                             trainable="dpsgd")


def test_a_failed_trial_run_says_why(tmp_path):
    tracker = _tracker(tmp_path)
    try:
        raise ValueError("config.model: mystudy.nets:small_cnnn is not a function of the module\nsecond line")
    except ValueError as exc:
        record_failure(tracker, exc)
    tracker.finish("FAILED")
    run = tracker.client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags[TAG_ERROR] == "second line"                       # the exception's last line
    path = tracker.client.download_artifacts(tracker.run_id, "error/traceback.txt", str(tmp_path))
    text = Path(path).read_text()
    assert text.startswith("Traceback") and "ValueError: config.model" in text


def test_a_retry_that_finishes_keeps_the_history_without_the_error_tag(tmp_path):
    tracker = _tracker(tmp_path)
    record_failure(tracker, RuntimeError("worker died"))
    clear_failure(tracker)
    tags = tracker.client.get_run(tracker.run_id).data.tags
    assert TAG_ERROR not in tags and tags["dpsweep.error_retried"] == "RuntimeError: worker died"
    clear_failure(tracker)                                              # nothing to clear: no change
    assert tracker.client.get_run(tracker.run_id).data.tags["dpsweep.error_retried"] == "RuntimeError: worker died"
