"""A user's own model and dataset by import path (docs/own_model.md): validation errors, the
built-in networks on a loader's shape, the map-style dataset source of DPSGDTrainer, shipping
the modules to Ray, and one sweep end to end through `dpsweep run` with MLflow."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent

NETS = '''
import torch, torch.nn as nn

def mlp(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 32), nn.Tanh(), nn.Linear(32, num_classes))

def conv1d(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(2), nn.Conv1d(c, 4, 3), nn.Flatten(), nn.Linear(4 * (h * w - 2), num_classes))

def wrong_out(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0] * input_shape[1] * input_shape[2], num_classes + 1))

def broken(input_shape, num_classes):
    return nn.Sequential(nn.Linear(3, num_classes))

def not_module(input_shape, num_classes):
    return "a string"

def raises(input_shape, num_classes):
    raise RuntimeError("no GPU here")
'''

DATA = '''
import torch

def _make(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 6, 6, generator=g)
    x[:, 0, 0, :] += (y[:, None].float() - 1.0)        # the label is written in the first row
    return x.clamp(-1, 1), y

def load():
    x, y = _make(300, 0)
    xt, yt = _make(90, 1)
    return x, y, xt, yt

def unscaled():
    x, y, xt, yt = load()
    return x * 127.5 + 127.5, y, xt, yt

def int32_labels():
    x, y, xt, yt = load()
    return x, y.int(), xt, yt.int()

def three_items():
    return load()[:3]

def numpy_images():
    x, y, xt, yt = load()
    return x.numpy(), y, xt, yt

def flat_images():
    x, y, xt, yt = load()
    return x.flatten(1), y, xt.flatten(1), yt

def shapes_differ():
    x, y, xt, yt = load()
    return x, y, xt[:, :, :5, :5], yt

def uint8_images():
    x, y, xt, yt = load()
    return ((x + 1) * 127.5).to(torch.uint8), y, xt, yt
'''


@pytest.fixture(scope="module")
def ownpkg(tmp_path_factory):
    """A temporary package ``ownpkg_h1`` (nets, data) importable for this module."""
    base = tmp_path_factory.mktemp("own")
    pkg = base / "ownpkg_h1"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(NETS)
    (pkg / "data.py").write_text(DATA)
    sys.path.insert(0, str(base))
    yield base
    sys.path.remove(str(base))
    for name in [m for m in sys.modules if m.startswith("ownpkg_h1")]:
        del sys.modules[name]


def _dpsgd(**kw):
    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import validate_config

    return validate_config({"dataset": "ownpkg_h1.data:load", "train_size": 200, "batch_size": 50, **kw},
                           DPSGDTrialConfig)


def _error(fn, **kw) -> str:
    with pytest.raises(ValueError) as info:
        fn(**kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ dataset checks


def test_loader_subsets_shapes_and_classes(ownpkg):
    from dpmech.datasets.splits import input_shape, load_held_out, load_splits, num_classes

    ds = "ownpkg_h1.data:load"
    assert input_shape(ds) == (1, 6, 6) and num_classes(ds) == 3
    train, test = load_splits(ds, train_size=100, test_size=30, seed=4)
    assert train.tensors[0].shape == (100, 1, 6, 6) and test.tensors[0].shape == (30, 1, 6, 6)
    again, _ = load_splits(ds, train_size=100, test_size=30, seed=4)
    assert torch.equal(again.tensors[0], train.tensors[0])
    held = load_held_out(ds, train_size=100, test_size=30, seed=4)   # the 200 training examples not selected
    assert held.tensors[0].shape[0] == 200
    rows = {tuple(r.flatten().tolist()) for r in train.tensors[0]}
    assert not any(tuple(r.flatten().tolist()) in rows for r in held.tensors[0])


@pytest.mark.parametrize("loader, rule", [
    ("ownpkg_h1.nope:load", "cannot import module 'ownpkg_h1.nope'"),
    ("ownpkg_h1.data:missing", "has no attribute 'missing'"),
    ("ownpkg_h1.data:unscaled", "values in [0, 255]; inputs must lie in [-1, 1]"),
    ("ownpkg_h1.data:int32_labels", "y_train of dtype torch.int32; labels must be int64"),
    ("ownpkg_h1.data:three_items", "a tuple of 3 items; it must return (x_train, y_train, x_test, y_test)"),
    ("ownpkg_h1.data:numpy_images", "x_train of type ndarray; it must be a torch.Tensor"),
    ("ownpkg_h1.data:flat_images", "x_train of shape (300, 36); it must be [N, C, H, W]"),
    ("ownpkg_h1.data:shapes_differ", "train images of shape (1, 6, 6) and test images of shape (1, 5, 5)"),
    ("ownpkg_h1.data:uint8_images", "x_train of dtype torch.uint8; it must be a float tensor"),
    ("not a path", "must be one of 'mnist', 'fashion_mnist', 'cifar10'; got 'not a path' (or your loader's import path"),
])
def test_dataset_errors_name_the_field_and_rule(ownpkg, loader, rule):
    msg = _error(_dpsgd, dataset=loader)
    assert msg.startswith("config.dataset: ") and rule in msg, msg


def test_named_dataset_mechanisms_refuse_a_loader(ownpkg):
    from trainables.dpal import DPALTrialConfig
    from trainables.runtime import validate_config

    msg = _error(validate_config, config={"dataset": "ownpkg_h1.data:load"}, schema=DPALTrialConfig)
    assert msg.startswith("config.dataset: ") and "builds its networks per named dataset" in msg


# ------------------------------------------------------------------ model checks


@pytest.mark.parametrize("model, rule", [
    ("ownpkg_h1.nets:nope", "has no attribute 'nope'"),
    ("nopkg_h1.nets:mlp", "cannot import module 'nopkg_h1.nets'"),
    ("ownpkg_h1.nets:wrong_out", "logits of shape (1, 4) for one input; they must be [1, 3]"),
    ("ownpkg_h1.nets:broken", "failed a forward pass on one input of shape [1, 1, 6, 6]"),
    ("ownpkg_h1.nets:not_module", "returned a str; it must return a torch.nn.Module"),
    ("ownpkg_h1.nets:raises", "raised RuntimeError: no GPU here when called with input_shape=(1, 6, 6), num_classes=3"),
    ("resnet", "must be one of 'pixeldp_cnn', 'tb_cnn', 'tb_cnn_gn', 'lenet' or an import path"),
])
def test_model_errors_name_the_field_and_rule(ownpkg, model, rule):
    msg = _error(_dpsgd, model=model)
    assert msg.startswith("config.model: ") and rule in msg, msg


def test_bk_refuses_an_unsupported_layer_and_names_the_engines_that_can(ownpkg):
    msg = _error(_dpsgd, model="ownpkg_h1.nets:conv1d")
    assert msg.startswith("config.clipping: ")
    assert "layer '1' (torch.nn.modules.conv.Conv1d)" in msg and "use clipping 'ghost' or 'flat'" in msg
    for ok in ({"clipping": "ghost"}, {"clipping": "flat"}, {"epsilon": None}):  # the others, or no clipping
        assert _dpsgd(model="ownpkg_h1.nets:conv1d", **ok).model == "ownpkg_h1.nets:conv1d"
    from trainables.dpal_sound import DPALSoundTrialConfig
    from trainables.runtime import validate_config

    msg = _error(validate_config, config={"dataset": "ownpkg_h1.data:load", "train_size": 200, "batch_size": 50,
                                          "model": "ownpkg_h1.nets:conv1d"}, schema=DPALSoundTrialConfig)
    assert msg.startswith("config.model: ") and "dpal_sound clips with 'bk' only" in msg and "Conv1d" in msg


def test_pixeldp_and_secure_sgd_refuse_a_model_but_take_a_loader(ownpkg):
    from trainables.pixeldp import PixelDPTrialConfig
    from trainables.runtime import validate_config
    from trainables.secure_sgd import SecureSGDTrialConfig

    for schema, name in ((PixelDPTrialConfig, "pixeldp"), (SecureSGDTrialConfig, "secure_sgd")):
        msg = _error(validate_config, config={"model": "ownpkg_h1.nets:mlp"}, schema=schema)
        assert msg.startswith("config.model: ") and f"{name} trains its own network" in msg
        cfg = validate_config({"dataset": "ownpkg_h1.data:load", "train_size": 200, "batch_size": 50}, schema)
        assert cfg.model_dump()["model"] is None


def test_pixeldp_trains_on_a_loader(ownpkg, one_thread):
    from dpmech.datasets.splits import load_splits
    from dpmech.pixeldp.trainer import PixelDPConfig, PixelDPTrainer

    (x, y), _ = (t.tensors for t in load_splits("ownpkg_h1.data:load", train_size=64, test_size=10))
    trainer = PixelDPTrainer(PixelDPConfig(dataset="ownpkg_h1.data:load", epochs=1, batch_size=32), x, y)
    trainer.train_epoch()
    assert trainer.model(x[:2]).shape == (2, 3)


def test_builtin_networks_on_a_loader_shape(ownpkg):
    from dpmech.networks.dpsgd_models import build_dp_model

    assert build_dp_model("pixeldp_cnn", "ownpkg_h1.data:load")(torch.zeros(2, 1, 6, 6)).shape == (2, 3)
    with pytest.raises(ValueError, match="^model: 'tb_cnn' is defined for 28 x 28 and 32 x 32 images"):
        build_dp_model("tb_cnn", "ownpkg_h1.data:load")


def test_user_model_is_seeded_and_source_hashed(ownpkg):
    from dpmech.datasets.user_code import build_model, source_params

    a, b, c = (build_model("ownpkg_h1.nets:mlp", (1, 6, 6), 3, seed=s) for s in (1, 1, 2))
    assert torch.equal(a[1].weight, b[1].weight) and not torch.equal(a[1].weight, c[1].weight)
    digest = hashlib.sha256((ownpkg / "ownpkg_h1" / "nets.py").read_bytes()).hexdigest()
    assert source_params({"model": "ownpkg_h1.nets:mlp", "dataset": "mnist"}) == {"model_sha256": digest}


def test_label_dp_trains_a_user_model(ownpkg, one_thread):
    from trainables.label_dp import LabelDPMechanism, LabelDPTrialConfig
    from trainables.runtime import validate_config

    cfg = validate_config({"dataset": "ownpkg_h1.data:load", "train_size": 100, "model": "ownpkg_h1.nets:mlp",
                           "epochs": 1, "mechanism": "rr", "epsilon": 2.0}, LabelDPTrialConfig)
    from dpmech.datasets.splits import load_splits

    (x, y), _ = (t.tensors for t in load_splits(cfg.dataset, train_size=100, test_size=10))
    mech = LabelDPMechanism(cfg, x, y, torch.device("cpu"))
    assert isinstance(mech.model[1], torch.nn.Linear) and mech.model[-1].out_features == 3
    mech.train_epoch()
    msg = _error(validate_config, config={"dataset": "ownpkg_h1.data:load", "task": "regression",
                                          "model": "ownpkg_h1.nets:wrong_out"}, schema=LabelDPTrialConfig)
    assert "must be [1, 1] (num_classes = 1)" in msg


# ------------------------------------------------------------------ DPSGDTrainer on a dataset


class _Indexed(torch.utils.data.Dataset):
    """A map-style dataset over tensors that records which indices were fetched."""

    def __init__(self, x, y):
        self.x, self.y, self.fetched = x, y, []

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        self.fetched.append(i)
        return self.x[i], int(self.y[i])


def test_trainer_takes_a_map_style_dataset_bit_for_bit(one_thread):
    from dpmech import DPSGDConfig, DPSGDTrainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(120, 1, 4, 4, generator=g) * 2 - 1, torch.randint(0, 3, (120,), generator=g)
    cfg = DPSGDConfig(epsilon=4.0, batch_size=30, epochs=1, seed=3)

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))

    # the same draws in the three runs: the research mode's noise key (the default is a fresh secret)
    from dpmech.privacy.secret import NoiseKey

    ref = DPSGDTrainer(net(), x, y, cfg, noise_key=NoiseKey.reproducible(3))
    ds = _Indexed(x, y)
    via = DPSGDTrainer(net(), ds, config=cfg, noise_key=NoiseKey.reproducible(3))
    loader = DPSGDTrainer(net(), torch.utils.data.DataLoader(_Indexed(x, y), batch_size=7, shuffle=True), config=cfg,
                          noise_key=NoiseKey.reproducible(3))
    stats = [t.train_epoch() for t in (ref, via, loader)]
    assert torch.equal(ref.model[1].weight, via.model[1].weight)
    assert torch.equal(ref.model[1].weight, loader.model[1].weight)
    assert ref.privacy() == via.privacy() and via.plan.sampling_rate == 30 / 120
    # exactly the Poisson-sampled examples were fetched, one by one (4 steps of q = 1/4 over 120), after
    # example 0, read once at construction for its shape (the per-example check of the model)
    assert ds.fetched[0] == 0
    assert len(ds.fetched) - 1 == round(stats[1]["batch_size_mean"] * via.plan.steps_per_epoch) > 0

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(x, y))

    with pytest.raises(ValueError, match="map-style dataset"):
        DPSGDTrainer(net(), Stream(), config=cfg)
    with pytest.raises(ValueError, match="^y_train: omit it"):
        DPSGDTrainer(net(), ds, y, cfg)


# ------------------------------------------------------------------ Ray runtime_env


def test_runtime_env_ships_user_packages_only(ownpkg):
    from sweeps.user_modules import import_paths, runtime_env

    spec = {"common": {"dataset": "ownpkg_h1.data:load"},
            "trainables": [{"name": "dpsgd", "search": {"model": {"grid": ["ownpkg_h1.nets:mlp", "tb_cnn"]}}},
                           {"name": "dpsgd", "search": {"model": "torch.nn:Identity", "lr": [0.1]}}]}
    assert import_paths(spec) == ["ownpkg_h1.data:load", "ownpkg_h1.nets:mlp", "torch.nn:Identity"]
    assert runtime_env(spec) == {"py_modules": [str((ownpkg / "ownpkg_h1").resolve())]}
    assert runtime_env({"common": {"dataset": "mnist"}}) is None


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_sweep_of_own_model_and_dataset_end_to_end(ownpkg, tmp_path):
    """`dpsweep run` in a fresh process (its own local Ray, which ships the package to the workers)
    from the folder that holds the package: a DP-SGD and a label-DP trial of the user's network on
    the user's data, logged to MLflow with the import paths and the source hash."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = {"dataset": "ownpkg_h1.data:load", "model": "ownpkg_h1.nets:mlp", "train_size": 200,
              "test_size": 60, "epochs": 2, "batch_size": 50, "seed": 0}
    spec = {"name": "own-model", "storage": str(tmp_path / "ray_results"), "mlflow": {"experiment": "own-model"},
            "common": common, "resources": {"cpu": 1}, "max_concurrent_trials": 2,
            "trainables": [{"name": "dpsgd", "search": {"epsilon": 8.0, "lr": 0.5, "certify_images": 0}},
                           {"name": "label_dp", "search": {"mechanism": "rr", "epsilon": 4.0, "lr": 0.01}}]}
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", "import sys; from sweeps.cli import main; sys.exit(main(sys.argv[1:]))",
                           "run", str(path), "--tracking-uri", uri], cwd=ownpkg, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("own-model")
    runs = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(runs) == 2
    digest = hashlib.sha256((ownpkg / "ownpkg_h1" / "nets.py").read_bytes()).hexdigest()
    data_digest = hashlib.sha256((ownpkg / "ownpkg_h1" / "data.py").read_bytes()).hexdigest()
    for run in runs:
        p, m = run.data.params, run.data.metrics
        assert run.info.status == "FINISHED"
        assert p["model"] == "ownpkg_h1.nets:mlp" and p["dataset"] == "ownpkg_h1.data:load"
        assert p["model_sha256"] == digest and p["dataset_sha256"] == data_digest
        assert run.data.tags["dpsweep.model_sha256"] == digest
        assert m["acc_clean"] > 0.6           # three classes, the label written in the first row
    dpsgd = next(r for r in runs if r.data.params["trainable"] == "dpsgd")
    assert 0 < dpsgd.data.metrics["epsilon"] <= 8.0
