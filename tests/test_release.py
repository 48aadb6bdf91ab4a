"""``dpsweep release`` and the replay attack through the trainable path (issue 32.1, 32.2).

One tuning-private sweep of the shipped epsilon-3 spec at a small ``--set`` subset, run twice: with
the sweep's secret (the default) and in the research mode (``noise_source: seed``, the negative
control). From everything MLflow holds (the released candidate's params and weights) an adversary
replays the candidate's training with the shipped trainable and the public seed: in the research
mode the replay equals the release (membership would be decided with certainty), with the secret it
does not. The release bundle of the secret sweep is read file by file: no K, no other candidate, no
seed, no non-private metric, no secret.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "sweeps" / "dpsgd_mnist_scatternet_tuned_eps3.yaml"
SUBSET = ["common.train_size=128", "common.test_size=32", "tuning_privacy.mean=2",
          "trainables.0.search.batch_size=32", "trainables.0.search.epochs=1"]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    # address="local": a private Ray even where another one runs on the machine (issue 49.9)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _sweep(tmp: Path, name: str, extra=()) -> tuple[str, str]:
    from sweeps.cli import main

    uri = f"sqlite:///{tmp}/mlflow.db"
    sets = [x for s in [*SUBSET, f"mlflow.experiment={name}", *extra] for x in ("--set", s)]
    assert main(["run", str(SPEC), *sets, "--storage", str(tmp / "ray_results"), "--tracking-uri", uri]) == 0
    return uri, name


def _released(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if r.data.tags.get("dpsweep.kind") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    child = next(r for r in children if r.info.run_id == parent.data.tags["dpsweep.released_run_id"])
    return client, parent, child, children


def _replay_equals_release(client, child, tmp: Path) -> bool:
    """The adversary: the candidate's config from its MLflow params, the public data subset, the
    shipped trainable, noise from the public seed; True when the replay equals the released weights
    (to a relative 1e-4: the noise alone moves them by far more)."""
    import torch

    from dpmech.datasets.splits import load_splits
    from dpmech.privacy.secret import NoiseKey
    from sweeps.release import _value
    from trainables.dpsgd import DPSGDMechanism, DPSGDTrialConfig

    keys = set(DPSGDTrialConfig.model_fields)
    cfg = DPSGDTrialConfig(**{k: _value(v) for k, v in child.data.params.items() if k in keys})
    train, _ = load_splits(cfg.dataset, train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.data_seed)
    x, y = train.tensors
    mech = DPSGDMechanism(cfg, x, y, torch.device("cpu"), noise_key=NoiseKey.reproducible(cfg.seed))
    while mech.epoch < cfg.epochs:
        mech.train_epoch()
    path = client.download_artifacts(child.info.run_id, "model/weights.pt", str(tmp))
    released = torch.load(path, weights_only=True)
    replay = mech.model.state_dict()
    # equal up to float rounding: the engine's measured clipping routes may differ between processes
    diff = sum(float((replay[k].cpu().double() - released[k].double()).norm() ** 2) for k in released) ** 0.5
    size = sum(float(released[k].double().norm() ** 2) for k in released) ** 0.5
    return diff <= 1e-4 * size


def test_secret_sweep_release_bundle_and_replay(tmp_path, ray_local, monkeypatch, capsys):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri, name = _sweep(tmp_path, "rel-secret")
    out = capsys.readouterr().out
    assert "K = " not in out                                  # K is never printed for publication
    client, parent, child, children = _released(uri, name)
    assert "tuning_trials" not in parent.data.metrics and "tuning_trials" not in parent.data.params
    assert child.data.tags["dpsweep.noise"] == "secret"
    secret_file = next((tmp_path / "ray_results").glob("*/dpsweep.secret"))
    assert secret_file.stat().st_mode & 0o077 == 0             # the owner's only
    # so is all the working state: the experiment folder, the checkpoints, the local MLflow store (issue 48.3)
    state = [*secret_file.parent.rglob("*"), secret_file.parent, tmp_path / "mlflow.db", *(tmp_path / "mlruns").rglob("*")]
    readable = [f"{p} {oct(p.stat().st_mode)}" for p in state if p.exists() and p.stat().st_mode & 0o077]
    assert not readable, readable[:5]
    secret = secret_file.read_text().strip()
    for run in (parent, *children):                            # never logged
        logged = json.dumps([run.data.params, run.data.tags, run.data.metrics])
        assert secret not in logged

    assert not _replay_equals_release(client, child, tmp_path / "adv")   # the seed tells the adversary nothing

    bundle = tmp_path / "bundle"
    assert main(["release", name, "--out", str(bundle), "--tracking-uri", uri]) == 0
    files = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    assert files == ["MANIFEST.json", "THREAT_MODEL.md", "guarantee.json", "hyperparameters.json", "model/weights.pt"]
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == set(files) - {"MANIFEST.json"} and "K" in manifest["left_out"]
    hyper = json.loads((bundle / "hyperparameters.json").read_text())
    assert not {"seed", "data_seed", "repeat", "noise_source"} & set(hyper)
    # issue 51.7: the per-candidate epsilon is named so that nobody quotes it as the guarantee
    assert "epsilon" not in hyper and "candidate_epsilon" in hyper and "not the guarantee" in hyper["candidate_epsilon_note"]
    guarantee = json.loads((bundle / "guarantee.json").read_text())
    assert guarantee["epsilon"] == pytest.approx(parent.data.metrics["tuning_epsilon"]) and guarantee["epsilon"] <= 3.0
    others = [r.info.run_id for r in children if r.info.run_id != child.info.run_id]
    forbidden = ["tuning_trials", "train_loss", "train_acc", "batch_size_mean", "clipped_fraction", '"seed"',
                 secret, child.info.run_id, parent.info.run_id, *others]
    for f in files:
        data = (bundle / f).read_bytes()
        for word in forbidden:
            assert word.encode() not in data, (f, word)
    # a second release into the same (non-empty) folder is refused, nothing changed
    assert main(["release", name, "--out", str(bundle), "--tracking-uri", uri]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_research_mode_is_replayable_and_refused_for_release(tmp_path, ray_local, monkeypatch, capsys):
    """Negative control: noise from the public seed is replayed bit for bit from MLflow alone."""
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    # (a fixed per-trial epsilon instead of the target's calibration: this control is about the noise)
    uri, name = _sweep(tmp_path, "rel-seed", ["common.noise_source=seed", "tuning_privacy.target_epsilon=null",
                                              "trainables.0.search.epsilon=1.0"])
    assert "research mode" in capsys.readouterr().out
    client, parent, child, _ = _released(uri, name)
    assert child.data.tags["dpsweep.noise"].startswith("reproducible noise")
    assert _replay_equals_release(client, child, tmp_path / "adv")
    capsys.readouterr()
    code = main(["release", name, "--out", str(tmp_path / "bundle"), "--tracking-uri", uri])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "public seed" in err[0]
    assert not (tmp_path / "bundle").exists()
