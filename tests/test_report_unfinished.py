"""The report of an unfinished sweep says so at the top (issue 51, point 7): how many trials finished
of how many, the parent run's status and the command that resumes it; and the tuning-private
report's owner-only sentence is whole."""

from __future__ import annotations


import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

RESUME = "dpsweep resume /data/ray_results/study-20261207-abcd"


def _log(tmp_path, parent_status="KILLED", statuses=("FINISHED", "FINISHED", "KILLED", "FAILED"), planned=6,
         note=f"interrupted; resume with: {RESUME}", tuning=False):
    from mlflow.tracking import MlflowClient

    from sweeps.tracking import start_parent_run
    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    info = start_parent_run(uri, "study", "study-1", {"name": "study"},
                            {"search.metric": "acc_clean", "search.mode": "max"}, planned=planned)
    client, parent = MlflowClient(uri), info["parent_run_id"]
    exp = info["experiment_id"]
    if note:
        client.set_tag(parent, "dpsweep.interrupted", note)
    if tuning:
        client.set_tag(parent, "dpsweep.selection_privacy", "tuning_privacy: geometric, mean 4")
        for k, v in {"tuning_epsilon": 3.0, "tuning_delta": 1e-5, "trial_epsilon_worst": 1.96}.items():
            client.log_metric(parent, k, v)
    for i, status in enumerate(statuses):
        run = client.create_run(exp, run_name=f"dpsgd-lr{i}", tags={TAG_PARENT: parent, TAG_TRAINABLE: "dpsgd"}).info.run_id
        for k, p in {"epsilon": 2.0, "lr": 0.1 * (i + 1), "seed": 0}.items():
            client.log_param(run, k, p)
        if status == "FINISHED":
            client.log_metric(run, "acc_clean", 0.8 + 0.01 * i)
            client.log_metric(run, "epsilon", 1.9)
        client.set_terminated(run, status)
    client.set_terminated(parent, parent_status)
    return uri


def test_an_interrupted_sweep_says_how_many_finished_of_how_many_and_how_to_resume(tmp_path):
    from sweeps.report import make_report

    text = make_report("study", _log(tmp_path), tmp_path / "r").read_text()
    head = text.split("\n## ")[0]
    assert "4 trials (2 finished)" in head
    assert "**Unfinished sweep: 2 of 6 trials finished** (1 FAILED, 1 KILLED; 2 not started)" in head, head
    assert f"is **KILLED** (interrupted; resume with: `{RESUME}`)" in head, head
    assert "over the finished trials only" in head


def test_a_crashed_sweep_without_a_resume_note_names_its_status_and_the_resume_command(tmp_path):
    from sweeps.report import make_report

    uri = _log(tmp_path, parent_status="FAILED", statuses=("FINISHED", "RUNNING"), planned=None, note=None)
    head = make_report("study", uri, tmp_path / "r").read_text().split("\n## ")[0]
    assert "**Unfinished sweep: 1 of 2 trials finished** (1 RUNNING)" in head and "is **FAILED**" in head, head
    assert "`dpsweep resume <storage>/<run name>`" in head and "`study-1`" in head


def test_a_finished_sweep_has_no_such_line(tmp_path):
    from sweeps.report import make_report

    uri = _log(tmp_path, parent_status="FINISHED", statuses=("FINISHED", "FINISHED"), planned=2, note=None)
    head = make_report("study", uri, tmp_path / "r").read_text().split("\n## ")[0]
    assert "Unfinished" not in head and "2 trials," in head and "finished)" not in head


def test_the_tuning_private_report_says_whole_who_it_is_for(tmp_path):
    from sweeps.report import make_report

    uri = _log(tmp_path, parent_status="FINISHED", statuses=("FINISHED", "FINISHED"), planned=2, note=None,
               tuning=True)
    text = make_report("study", uri, tmp_path / "r").read_text()
    assert ("must not be published: this report and its files are for the sweep's owner only, and what may be "
            "published is the release bundle that `dpsweep release` writes (below; docs/tuning_privacy.md).") in text
