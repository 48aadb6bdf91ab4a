"""What ``dpsweep release`` refuses, and what it leaves behind (issue 48.2 and 48.6), on a sweep built
directly in a local MLflow store (no Ray): an infinite end-to-end epsilon (MLflow stores it as the
largest float) or one above the spec's target is refused in one line with nothing written; a
release killed while writing leaves an owner-only draft that the next release removes; the
released candidate's diagnostics are read from the tag the trials actually write.

The repeat-and-select curve itself: a per-trial curve infinite at some orders (dp-accounting does
not converge at some fractional orders for large sampling rates) gives a finite end-to-end epsilon
from the finite orders, equal to dp-accounting's on those orders alone, and a spec whose guarantee
is infinite everywhere is refused at validation.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dpmech.privacy.accounting import RDP_ORDERS, rdp_curve, rdp_epsilon, subsampled_gaussian_event
from dpmech.privacy.tuning import repeat_and_select_rdp, tuning_epsilon

SPEC = {"name": "rel", "tuning_privacy": {"distribution": "geometric", "mean": 3, "delta": 1e-5},
        "search": {"algorithm": "random", "metric": "acc_clean", "mode": "max"},
        "trainables": [{"name": "dpsgd", "search": {"epsilon": 1.0}}]}


def _store(tmp: Path, *, epsilon: float, target: float | None = None, diag_tag: str = "none",
           child_metrics: dict | None = None) -> str:
    """A finished tuning-private sweep in ``tmp``'s MLflow store: a parent run and its released child."""
    from mlflow.tracking import MlflowClient

    from trainables.diagnostics import TAG_DIAGNOSTICS

    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("rel", artifact_location=(tmp / "mlruns").as_uri())
    spec = json.loads(json.dumps(SPEC))
    if target is not None:
        spec["tuning_privacy"]["target_epsilon"] = target
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep", "mlflow.runName": "rel-1"})
    pid = parent.info.run_id
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    client.log_artifact(pid, str(tmp / "spec.yaml"))
    client.log_metric(pid, "tuning_epsilon", epsilon)
    client.log_metric(pid, "tuning_delta", 1e-5)
    child = client.create_run(exp, tags={"mlflow.parentRunId": pid, "dpsweep.noise": "secret",
                                         TAG_DIAGNOSTICS: diag_tag})
    cid = child.info.run_id
    client.log_param(cid, "trainable", "dpsgd")
    client.log_param(cid, "lr", "0.1")
    for k, v in {"acc_clean": 0.9, **(child_metrics or {})}.items():
        client.log_metric(cid, k, v)
    (tmp / "model").mkdir()
    torch.save({"w": torch.zeros(3)}, tmp / "model" / "weights.pt")
    client.log_artifact(cid, str(tmp / "model" / "weights.pt"), "model")
    client.set_terminated(cid, "FINISHED")
    client.set_tag(pid, "dpsweep.released_run_id", cid)
    client.set_terminated(pid, "FINISHED")
    return uri


def _release(uri: str, out: Path, capsys) -> tuple[int, list[str]]:
    from sweeps.cli import main

    capsys.readouterr()
    code = main(["release", "rel", "--out", str(out), "--tracking-uri", uri])
    return code, capsys.readouterr().err.strip().splitlines()


def _drafts(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.*"))


@pytest.mark.parametrize("epsilon, target, words", [
    (math.inf, None, "not finite"),
    (3.2, 3.0, "above the spec's target_epsilon 3"),
])
def test_a_guarantee_that_is_no_guarantee_is_refused(tmp_path, capsys, epsilon, target, words):
    uri = _store(tmp_path, epsilon=epsilon, target=target)
    out = tmp_path / "bundle"
    code, err = _release(uri, out, capsys)
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not out.exists() and not _drafts(out)


def test_a_finite_guarantee_at_the_target_is_released(tmp_path, capsys):
    uri = _store(tmp_path, epsilon=2.9999, target=3.0)
    out = tmp_path / "bundle"
    code, err = _release(uri, out, capsys)
    assert code == 0, err
    assert json.loads((out / "guarantee.json").read_text())["epsilon"] == pytest.approx(2.9999)
    assert not _drafts(out)


def test_diagnostics_are_read_from_the_tag_the_trials_write(tmp_path, capsys):
    """Before issue 48 the release read a tag no trial writes, and let label DP's keep rates through."""
    uri = _store(tmp_path, epsilon=2.0, diag_tag="train_loss, clipped_fraction")
    code, err = _release(uri, tmp_path / "b1", capsys)
    assert code == 2 and "non-private diagnostics" in err[0]
    other = tmp_path / "other"
    other.mkdir()
    uri = _store(other, epsilon=2.0, child_metrics={"label_keep_rate": 0.9})
    code, err = _release(uri, other / "b2", capsys)
    assert code == 2 and "label_keep_rate" in err[0]


def test_a_killed_release_leaves_an_owner_only_draft_that_the_next_release_removes(tmp_path, capsys):
    uri = _store(tmp_path, epsilon=2.0)
    out = tmp_path / "bundle"
    # a release killed (SIGKILL) while writing: its draft folder stays, with the weights in it
    code = ("import os\n"
            "import sweeps.release as r\n"
            "r.Path.write_text = lambda *a, **k: os.kill(os.getpid(), 9)\n"
            f"r.make_release('rel', {str(out)!r}, {uri!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True)
    assert proc.returncode == -9
    drafts = _drafts(out)
    assert len(drafts) == 1 and (drafts[0] / "model" / "weights.pt").exists()
    assert drafts[0].stat().st_mode & 0o077 == 0
    code, err = _release(uri, out, capsys)
    assert code == 0, err
    assert not _drafts(out) and (out / "model" / "weights.pt").exists()


# ---------------------------------------------------------------- the repeat-and-select curve


def test_non_finite_orders_are_dropped_not_spread():
    """One infinite order used to make the whole repeat-and-select curve infinite."""
    base = rdp_curve(subsampled_gaussian_event(0.01, 1.0, 1000))
    holed = base.copy()
    holed[[1, 3, 5]] = np.inf
    out = repeat_and_select_rdp(holed, "geometric", 10)
    assert np.all(np.isinf(out[[1, 3, 5]]))
    assert np.all(np.isfinite(np.delete(out, [1, 3, 5])))
    # independently: dp-accounting's Thm 2 on the finite orders alone
    from dp_accounting.rdp import rdp_privacy_accountant as acc

    keep = np.isfinite(holed)
    orders = np.asarray(RDP_ORDERS)[keep]
    ref = acc._compute_rdp_repeat_and_select(list(orders), list(holed[keep]), 10, 1.0)  # noqa: SLF001
    np.testing.assert_allclose(out[keep], ref, rtol=1e-12)
    ref_eps = float(acc.compute_epsilon(orders, np.asarray(ref), 1e-5)[0])
    assert tuning_epsilon(holed, 1e-5, "geometric", 10) == pytest.approx(ref_eps, rel=1e-12)
    # the holes cost at most what the orders left out could have saved: never below the full curve
    assert tuning_epsilon(holed, 1e-5, "geometric", 10) >= tuning_epsilon(base, 1e-5, "geometric", 10) - 1e-12
    assert math.isfinite(rdp_epsilon(out, 1e-5))


def test_control_a_curve_infinite_everywhere_stays_infinite():
    out = repeat_and_select_rdp(np.full(len(RDP_ORDERS), np.inf), "geometric", 10)
    assert np.all(np.isinf(out))


def test_the_shipped_tuned_spec_at_a_small_train_size_has_a_finite_guarantee():
    """The review's case: sweeps/dpsgd_mnist_tuned.yaml at train_size 1,000 (q = 0.256) printed
    'end-to-end epsilon inf'; dp-accounting's curve is infinite at some fractional orders there."""
    from sweeps.spec import apply_overrides, validate_spec
    from sweeps.spec.tuning import tuning_summary

    root = Path(__file__).resolve().parent.parent
    raw = yaml.safe_load((root / "sweeps" / "dpsgd_mnist_tuned.yaml").read_text())
    spec = validate_spec(apply_overrides(raw, ["common.train_size=1000"]))
    summary = spec._tuning_summary or tuning_summary(spec)
    assert math.isfinite(summary["tuning_epsilon"]) and 2.0 < summary["tuning_epsilon"] < 6.0


def test_an_infinite_guarantee_is_refused_at_validation(monkeypatch):
    from sweeps.spec import SpecError, validate_spec
    from sweeps.spec import tuning as tuning_mod

    raw = {"name": "t", "common": {"dataset": "mnist", "train_size": 500, "test_size": 100, "diagnostics": False},
           "trainables": [{"name": "dpsgd", "search": {"epsilon": 2.0, "delta": 1e-5, "epochs": 1}}],
           "search": {"algorithm": "random", "seed": 0, "metric": "acc_clean", "mode": "max"},
           "tuning_privacy": {"distribution": "geometric", "mean": 2, "delta": 1e-5}}
    assert math.isfinite(validate_spec(raw)._tuning_summary["tuning_epsilon"])
    # a per-trial curve the accountant cannot bound at any order
    monkeypatch.setattr(tuning_mod, "tuning_summary",
                        lambda spec, ran=None: {"tuning_epsilon": math.inf, "tuning_delta": 1e-5,
                                                "trial_epsilon_worst": math.inf})
    with pytest.raises(SpecError, match=r"^tuning_privacy: the end-to-end epsilon is not finite"):
        validate_spec(raw)
