"""Only layers that treat each example alone (issue 32, point 3; dpmech/privacy/per_example.py).

A parameter-free BatchNorm, a BatchNorm without running statistics, an InstanceNorm that tracks
running statistics and a hand-written centring layer passed Opacus's validator and bk's
``check_model`` (they look at modules with trainable parameters only). Each is now refused, in one
line naming the module, by the trainer (every clipping engine) and by ``dpsweep validate`` / ``run``
(exit 2, nothing started); the shipped networks and random layers pass. The negative control
measures the leak on the code path without the check: removing one example moves the clipped sum
by more than C, and the released running_mean tells whether an outlier was in the data.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
from dpmech.privacy.per_example import per_example_problem

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:Full backward hook is firing")]

NETS = '''
import torch.nn as nn


class Centre(nn.Module):
    """x - mean over the batch: no parameters, no buffers, mixes every example."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def bn2d_noaffine(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * h * w, num_classes))


def bn1d_nostats(input_shape, num_classes):
    c, h, w = input_shape          # BatchNorm1d over [B, 4, 4]: batch statistics in eval mode too
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), nn.Unflatten(1, (4, 4)),
                         nn.BatchNorm1d(4, affine=False, track_running_stats=False), nn.Tanh(), nn.Flatten(),
                         nn.Linear(16, num_classes))


def in2d_stats(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.InstanceNorm2d(4, track_running_stats=True), nn.Tanh(),
                         nn.Flatten(), nn.Linear(4 * h * w, num_classes))


def centred(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), Centre(), nn.Tanh(), nn.Linear(16, num_classes))


def bn_affine(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * h * w, num_classes))


def grouped(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * h * w, num_classes))
'''

DATA = '''
import torch


def load():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (260,), generator=g)
    x = (0.3 * torch.randn(260, 1, 6, 6, generator=g)).clamp(-1, 1)
    x[:, 0, 0, :] = y[:, None].float() - 1.0
    return x[:200], y[:200], x[200:], y[200:]
'''

# factory -> the module the refusal must name
LEAKY = {
    "bn2d_noaffine": "module '1' (BatchNorm2d) mixes the examples",
    "bn1d_nostats": "module '3' (BatchNorm1d) mixes the examples",
    "in2d_stats": "module '1' (InstanceNorm2d) updates its buffers 'running_mean', 'running_var'",
    "centred": "module '2' (Centre) mixes the examples",
}
SHAPE, CLASSES = (1, 6, 6), 3


@pytest.fixture(scope="module")
def leakpkg(tmp_path_factory):
    base = tmp_path_factory.mktemp("leak")
    pkg = base / "leakpkg_h1"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(NETS)
    (pkg / "data.py").write_text(DATA)
    sys.path.insert(0, str(base))
    yield base
    sys.path.remove(str(base))
    for name in [m for m in sys.modules if m.startswith("leakpkg_h1")]:
        del sys.modules[name]


def _build(name: str, seed: int = 0) -> nn.Module:
    from dpmech.datasets.user_code import build_model

    return build_model(f"leakpkg_h1.nets:{name}", SHAPE, CLASSES, seed)


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *SHAPE, generator=g) * 2 - 1, torch.randint(0, CLASSES, (n,), generator=g)


def _one_line_error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ the trainer


@pytest.mark.parametrize("clipping", ["bk", "ghost", "flat"])
@pytest.mark.parametrize("name", list(LEAKY))
def test_trainer_refuses_each_leaky_model_with_every_engine(leakpkg, name, clipping):
    x, y = _data()
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=1.0, batch_size=16, epochs=1, clipping=clipping)
    msg = _one_line_error(lambda: DPSGDTrainer(_build(name), x, y, cfg))
    assert msg.startswith("model: " + LEAKY[name]), msg
    assert "GroupNorm" in msg


def test_trainer_takes_a_map_style_dataset_through_the_same_check(leakpkg):
    x, y = _data()
    data = torch.utils.data.TensorDataset(x, y)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=1.0, batch_size=16, epochs=1)
    msg = _one_line_error(lambda: DPSGDTrainer(_build("centred"), data, config=cfg))
    assert msg.startswith("model: " + LEAKY["centred"])


def test_non_private_baseline_is_not_checked_and_batchnorm_with_affine_is_converted_and_recorded(leakpkg):
    """The baseline (no guarantee) trains what it is given; BatchNorm with affine parameters is
    replaced by GroupNorm (Opacus's fix) in every run, and the trainer says so."""
    x, y = _data()
    base = DPSGDTrainer(_build("bn2d_noaffine"), x, y, DPSGDConfig(epsilon=None, batch_size=16, epochs=1))
    assert base.model_converted == "none"
    private = DPSGDConfig(epsilon=None, noise_multiplier=1.0, batch_size=16, epochs=1)
    tr = DPSGDTrainer(_build("bn_affine"), x, y, private)
    assert tr.model_converted.startswith("1: BatchNorm2d -> GroupNorm(")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in tr.model.modules())
    assert DPSGDTrainer(_build("grouped"), x, y, private).model_converted == "none"


# ------------------------------------------------------------------ dpsweep validate / run


def _spec(tmp_path, model: str, trainable: str = "dpsgd", **search) -> str:
    spec = tmp_path / f"{trainable}_{model.rpartition(':')[2]}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "leak", "common": {"dataset": "leakpkg_h1.data:load", "train_size": 200, "test_size": 50,
                                   "batch_size": 50, "epochs": 1},
        "trainables": [{"name": trainable, "search": {"model": model, "epsilon": 1.0, **search}}]}))
    return str(spec)


def _ours(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("dpsweep:")]


@pytest.mark.parametrize("name", list(LEAKY))
def test_validate_refuses_each_leaky_model_in_one_line(leakpkg, tmp_path, capsys, name):
    from sweeps.cli import main

    assert main(["validate", _spec(tmp_path, f"leakpkg_h1.nets:{name}")]) == 2
    err = _ours(capsys.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith("dpsweep: error: trainables[0].search: "), err[0]
    assert f"model 'leakpkg_h1.nets:{name}': {LEAKY[name]}" in err[0], err[0]


@pytest.mark.parametrize("trainable, search", [("dpsgd", {"clipping": "ghost"}), ("dpsgd", {"clipping": "flat"}),
                                               ("dpal_sound", {})])
def test_validate_refuses_for_every_engine_and_dpal_sound(leakpkg, tmp_path, capsys, trainable, search):
    from sweeps.cli import main

    assert main(["validate", _spec(tmp_path, "leakpkg_h1.nets:bn1d_nostats", trainable, **search)]) == 2
    err = _ours(capsys.readouterr().err)
    assert len(err) == 1 and LEAKY["bn1d_nostats"] in err[0], err


def test_run_refuses_before_anything_starts(leakpkg, tmp_path, capsys, monkeypatch):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, "leakpkg_h1.nets:centred")
    before = set(tmp_path.iterdir())
    assert main(["run", spec, "--storage", str(tmp_path / "ray"), "--tracking-uri",
                 f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 2
    err = _ours(capsys.readouterr().err)
    assert len(err) == 1 and LEAKY["centred"] in err[0], err
    assert set(tmp_path.iterdir()) == before          # no Ray storage, no MLflow database


def test_validate_accepts_the_shipped_and_safe_models_and_announces_a_conversion(leakpkg, tmp_path, capsys):
    from sweeps.cli import main

    assert main(["validate", _spec(tmp_path, "leakpkg_h1.nets:grouped")]) == 0
    assert not [line for line in _ours(capsys.readouterr().err) if "warning" in line]
    assert main(["validate", _spec(tmp_path, "leakpkg_h1.nets:bn_affine")]) == 0
    warnings = [line for line in _ours(capsys.readouterr().err) if "ModuleValidator.fix" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("dpsweep: warning: trainables[0].search.model: model 'leakpkg_h1.nets:bn_affine'")
    assert "1: BatchNorm2d -> GroupNorm(" in warnings[0] and "model_converted" in warnings[0]
    # the non-private baseline of a leaky model is no claim: accepted
    assert main(["validate", _spec(tmp_path, "leakpkg_h1.nets:centred", epsilon=None)]) == 0


def test_trial_params_record_the_conversion(leakpkg, tmp_path, monkeypatch):
    """A dpsgd trial of the BatchNorm model logs model_converted (the model trained is not the one
    written); a GroupNorm model logs "none". (Non-private trials: the engine converts the model the
    same way, without the seconds of a noise calibration.)"""
    import types

    from mlflow.tracking import MlflowClient
    from ray import tune

    from trainables.registry import get_trainable

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = MlflowClient(uri).create_experiment("conv", artifact_location=str(tmp_path / "artifacts"))
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: None)
    for i, name in enumerate(("bn_affine", "grouped")):
        monkeypatch.setattr(tune, "get_context", lambda i=i: types.SimpleNamespace(get_trial_id=lambda: f"t{i}"))
        get_trainable("dpsgd").fn({"trainable": "dpsgd", "dataset": "leakpkg_h1.data:load",
                                   "model": f"leakpkg_h1.nets:{name}", "train_size": 100, "test_size": 20,
                                   "batch_size": 50, "epochs": 1, "epsilon": None,
                                   "_mlflow": {"tracking_uri": uri, "experiment_id": exp}})
    params = {r.data.params["model"]: r.data.params for r in MlflowClient(uri).search_runs([exp])}
    assert params["leakpkg_h1.nets:bn_affine"]["model_converted"].startswith("1: BatchNorm2d -> GroupNorm(")
    assert params["leakpkg_h1.nets:grouped"]["model_converted"] == "none"


# ------------------------------------------------------------------ what must pass


def _shipped():
    from dpmech.dpgan.models import Critic
    from dpmech.dpsgd.trainer import build_dpsgd_model
    from dpmech.networks.dpsgd_models import build_feature_model
    from dpmech.secure_sgd.trainer import build_secure_sgd_model

    img = (torch.zeros(1, 1, 28, 28),)
    yield "pixeldp_cnn", build_dpsgd_model("mnist", 0, "pixeldp_cnn"), img
    yield "tb_cnn (unit inputs)", build_dpsgd_model("mnist", 0, "tb_cnn", "unit"), img
    yield "tb_cnn_gn", build_dpsgd_model("mnist", 0, "tb_cnn_gn"), img
    yield "wide ResNet (CIFAR-10, BatchNorm converted)", build_dpsgd_model("cifar10", 0, "pixeldp_cnn"), \
        (torch.zeros(1, 3, 32, 32),)
    for name in ("linear", "scatter_cnn"):
        yield f"{name} on ScatterNet features", build_feature_model(name, (81, 7, 7), 10), (torch.zeros(1, 81, 7, 7),)
    yield "SecureSGD's PixelDP network (noise layer)", build_secure_sgd_model(
        "mnist", mechanism="hgm", epsilon=1.0, delta=1e-5, attack_bound=0.1), img
    for arch in ("mlp", "conv"):
        yield f"DPGAN critic ({arch})", Critic((1, 28, 28), 10, 32, arch), img + (torch.tensor([0, 9]),)


def test_shipped_networks_pass():
    for label, model, examples in _shipped():
        assert per_example_problem(model, *examples) is None, label


def test_random_layers_are_not_mixing_but_a_mixing_random_model_is_still_caught():
    """Dropout and PixelDP's noise layer draw the same numbers in both passes (same seed, same
    shapes); a random model skips the removal test, the change test still catches BatchNorm."""
    from dpmech.robustness.noise_layer import NoiseLayer

    x = (torch.zeros(1, 12),)
    random = nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.5), NoiseLayer(1.0), nn.Linear(16, 3),
                           NoiseLayer(0.3, seed=4))
    assert per_example_problem(random, *x) is None
    mixing = nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.5),
                           nn.BatchNorm1d(16, affine=False, track_running_stats=False), nn.Linear(16, 3))
    assert per_example_problem(mixing, *x).startswith("model: module '2' (BatchNorm1d) mixes the examples")


def test_what_the_check_names():
    """Mixing in a parent's own forward code names the parent; a batch-size-dependent layer is
    caught by the removal test; a counter buffer is refused too (documented decision); a layer
    changing its input in place is no false positive; a failing forward pass is reported."""
    class Inline(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(12, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = self.a(x)
            return self.b(h - h.mean(0))

    class PerBatch(nn.Module):
        def forward(self, x):
            return x / x.shape[0]

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.steps += 1
            return x

    x = (torch.zeros(1, 12),)
    assert per_example_problem(Inline(), *x).startswith(
        "model: the model itself (Inline) mixes the examples of a batch in its own forward code (before its "
        "submodule 'b') (changing one example")
    assert per_example_problem(nn.Sequential(nn.Linear(12, 3), PerBatch()), *x).startswith(
        "model: module '1' (PerBatch) mixes the examples of a batch (removing one example")
    assert per_example_problem(nn.Sequential(nn.Linear(12, 3), Counter()), *x).startswith(
        "model: module '1' (Counter) updates its buffer 'steps'")
    class Doubles(nn.Module):                         # changes its input in place: per example, not mixing
        def forward(self, x):
            return x.mul_(2)

    assert per_example_problem(nn.Sequential(Doubles(), nn.Linear(12, 3)), *x) is None
    broken = nn.Sequential(nn.Linear(5, 3))
    assert per_example_problem(broken, *x).startswith("model: its training forward pass failed")


# ------------------------------------------------------------------ the leak (negative control)


def _clipped_sum(trainer: DPSGDTrainer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The engine's clipped sum of the batch (x, y) (bk, no noise: p.grad = sum / B)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.model.train()
    trainer.forward_backward(x, y)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()]) * trainer.config.batch_size


def test_without_the_check_one_example_moves_the_clipped_sum_by_more_than_c(leakpkg, monkeypatch):
    """The engine's code path with the check switched off (what main did): removing one example (an
    outlier, as a membership attacker would pick) from a batch of 16 moves bk's clipped sum of the
    mixing models by several times C, the sensitivity the noise is calibrated to; for a per-example
    model (GroupNorm) by at most C, the bound the guarantee assumes."""
    import dpmech.privacy.per_example as pe

    monkeypatch.setattr(pe, "check_per_example", lambda model, *examples, **kw: None)
    c, n = 0.5, 16
    x, y = _data(n, seed=1)
    x = x.double()
    x[0] = 1000.0
    keep = torch.arange(n) != 0
    moved = {}
    for name in ("bn2d_noaffine", "bn1d_nostats", "centred", "grouped"):
        cfg = DPSGDConfig(epsilon=None, noise_multiplier=0.0, max_grad_norm=c, batch_size=n, epochs=1)
        tr = DPSGDTrainer(_build(name).double(), x, y, cfg)
        moved[name] = float((_clipped_sum(tr, x, y) - _clipped_sum(tr, x[keep], y[keep])).norm())
    assert moved["grouped"] <= c + 1e-9, moved
    for name in ("bn2d_noaffine", "bn1d_nostats", "centred"):
        assert moved[name] > 4 * c, moved


def test_without_the_check_running_mean_reveals_an_outlier(leakpkg, monkeypatch):
    """InstanceNorm tracking running statistics mixes nothing, but its running_mean, released with
    the model, is a noise-free statistic of the training batches: one outlier in the data moves it
    far beyond what the other examples do."""
    import dpmech.privacy.per_example as pe

    monkeypatch.setattr(pe, "check_per_example", lambda model, *examples, **kw: None)
    x, y = _data(32, seed=2)
    with_outlier = x.clone()
    with_outlier[0] = 1000.0            # an image far outside the others
    means = []
    for data in (with_outlier, x[1:]):
        cfg = DPSGDConfig(epsilon=None, noise_multiplier=1.0, batch_size=8, epochs=1)
        tr = DPSGDTrainer(_build("in2d_stats"), data, y[:len(data)], cfg)
        tr._step(torch.arange(len(data)))
        means.append(tr.model[1].running_mean.abs().max().item())
    assert means[0] > 10 * means[1], means
