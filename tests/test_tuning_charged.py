"""A tuning-private sweep is charged the smallest end-to-end epsilon among the analyses that apply
(issue 54.2): ``dpsweep validate`` prints each, ``dpsweep release`` names the charged one in
guarantee.json, and refuses a logged epsilon that none of the recorded analyses backs."""

from __future__ import annotations

import json

import pytest
import yaml

from sweeps.spec import validate_spec
from sweeps.spec.tuning import charged_analysis_name, epsilon_total_by_analysis, refuse_guarantee, tuning_summary
from tests.test_release_refusals import _release, _store
# the stand-in trainable (a DP-SGD-like event keyed on epsilon), registered by its autouse fixture
from tests.test_tuning_spec import raw, stand_in  # noqa: F401


def test_validate_prints_every_analysis_and_the_charged_one(tmp_path, capsys):
    from sweeps.cli import main

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw()))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    summary = tuning_summary(validate_spec(raw()))
    by = epsilon_total_by_analysis(summary)
    assert set(by) == {"papernot_steinke", "papernot_steinke_mixture"}
    line = next(x for x in out.splitlines() if x.startswith("end-to-end epsilon by analysis"))
    for name, eps in by.items():
        assert f"{name} {eps:.4g}" in line
    assert line.split("charged: ")[1].startswith("papernot_steinke_mixture")


def test_the_target_check_uses_the_charged_epsilon():
    summary = tuning_summary(validate_spec(raw()))
    ps, mix = summary["tuning_epsilon_papernot_steinke"], summary["tuning_epsilon"]
    target = (ps + mix) / 2          # above the charged epsilon, below Papernot & Steinke's
    refuse_guarantee(summary, target)
    from sweeps.spec import SpecError

    with pytest.raises(SpecError, match=r"^tuning_privacy\.target_epsilon: .* above the target .*charged under "
                                        r"papernot_steinke_mixture"):
        refuse_guarantee(summary, mix * 0.99)


def _with_analyses(uri: str, **metrics) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("rel").experiment_id],
                                   "tags.`dpsweep.kind` = 'sweep'")
    for k, v in metrics.items():
        client.log_metric(parent.info.run_id, k, v)


def test_the_release_names_the_charged_analysis(tmp_path, capsys):
    uri = _store(tmp_path, epsilon=2.95, target=3.0)
    _with_analyses(uri, tuning_epsilon_papernot_steinke=3.02, tuning_epsilon_papernot_steinke_mixture=2.95)
    code, err = _release(uri, tmp_path / "bundle", capsys)
    assert code == 0, err
    g = json.loads((tmp_path / "bundle" / "guarantee.json").read_text())
    assert g["analysis"] == "papernot_steinke_mixture" and g["epsilon"] == pytest.approx(2.95)
    assert g["epsilon_total_by_analysis"] == pytest.approx({"papernot_steinke": 3.02, "papernot_steinke_mixture": 2.95})
    assert "candidate as drawn" in g["accounting"]["method"]


def test_a_sweep_recorded_before_the_analyses_is_papernot_steinkes(tmp_path, capsys):
    uri = _store(tmp_path, epsilon=2.5)
    code, err = _release(uri, tmp_path / "bundle", capsys)
    assert code == 0, err
    g = json.loads((tmp_path / "bundle" / "guarantee.json").read_text())
    assert g["analysis"] == "papernot_steinke" and g["epsilon_total_by_analysis"] == {"papernot_steinke": 2.5}
    assert charged_analysis_name({"tuning_epsilon": 2.5}) == "papernot_steinke"


def test_an_epsilon_no_analysis_backs_is_refused(tmp_path, capsys):
    """Negative control: a parent run whose tuning_epsilon is below every analysis' figure."""
    uri = _store(tmp_path, epsilon=1.0)
    _with_analyses(uri, tuning_epsilon_papernot_steinke=3.02, tuning_epsilon_papernot_steinke_mixture=2.95)
    out = tmp_path / "bundle"
    code, err = _release(uri, out, capsys)
    assert code == 2 and len(err) == 1 and "is not the smallest of its analyses' figures" in err[0], err
    assert not out.exists()
