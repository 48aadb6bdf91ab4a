"""Fault-suite small points (issue 33, point 11): the YAML number hint fits positive exponents; a
resumed sweep keeps no stale error tag and is called resumed only when it was interrupted."""

from __future__ import annotations

import pytest
import yaml

from sweeps.spec import SpecError, validate_spec
from sweeps.spec.space import yaml_float


@pytest.mark.parametrize("text, written", [("1e-3", "1.0e-3"), ("1.0e6", "1.0e+6"), ("1e6", "1.0e+6"),
                                           ("3E5", "3.0e+5")])
def test_the_hint_writes_a_number_yaml_reads_as_a_float(text, written):
    assert yaml_float(text) == written
    assert isinstance(yaml.safe_load(f"x: {written}")["x"], float)
    assert isinstance(yaml.safe_load(f"x: {text}")["x"], str)      # why the hint exists


def test_a_string_lr_gets_the_hint_for_its_own_exponent():
    raw = yaml.safe_load("name: s\ntrainables:\n  - name: dpsgd\n    search: {lr: 1.0e6}\n")
    with pytest.raises(SpecError, match=r"write 1\.0e\+6\)"):
        validate_spec(raw)


def test_resume_clears_a_stale_error_and_says_resumed_only_after_an_interrupt(tmp_path):
    from mlflow.tracking import MlflowClient

    from sweeps.tracking import reopen_parent_run

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    crashed = client.create_run(exp, tags={"dpsweep.error": "RuntimeError: disk full"}).info.run_id
    stopped = client.create_run(exp, tags={"dpsweep.interrupted": "SIGINT: dpsweep resume ..."}).info.run_id
    for run in (crashed, stopped):
        reopen_parent_run({"tracking_uri": uri, "parent_run_id": run, "experiment_id": exp})
    tags = client.get_run(crashed).data.tags
    assert "dpsweep.error" not in tags and "dpsweep.interrupted" not in tags
    assert client.get_run(stopped).data.tags["dpsweep.interrupted"] == "resumed"
    assert client.get_run(crashed).info.status == "RUNNING"
