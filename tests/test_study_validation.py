"""A study of one's own is validated before anything starts (issue 34, points 4 and 5): subset sizes
larger than the dataset's splits (a loader's, the default ``test_size`` on a small loader, MNIST's
own) are one line naming the key, the value and the size, exit 2, with nothing written and no Ray
started; a mistyped factory or loader name gets a did-you-mean; a DataLoader handed to
``DPSGDTrainer`` warns once that its batch size and shuffling are not used."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import yaml

DATA = '''
import torch

def _make(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    return (0.3 * torch.randn(n, 1, 4, 4, generator=g)).clamp(-1, 1), y

def load_digits():
    x, y = _make(130, 0)
    xt, yt = _make(45, 1)
    return x, y, xt, yt
'''

NETS = '''
import torch.nn as nn

def small_cnn(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))

def wide_mlp(input_shape, num_classes):
    return small_cnn(input_shape, num_classes)
'''

LOADER = "studypkg_v1.data:load_digits"


@pytest.fixture(scope="module")
def studypkg(tmp_path_factory):
    """A temporary package ``studypkg_v1`` (a loader of 130 training and 45 test images, two nets)."""
    base = tmp_path_factory.mktemp("study")
    pkg = base / "studypkg_v1"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "data.py").write_text(DATA)
    (pkg / "nets.py").write_text(NETS)
    sys.path.insert(0, str(base))
    yield base
    sys.path.remove(str(base))
    for name in [m for m in sys.modules if m.startswith("studypkg_v1")]:
        del sys.modules[name]


def _spec(tmp_path, common: dict, search: dict | None = None):
    spec = {"name": "study", "storage": str(tmp_path / "ray_results"), "mlflow": {"experiment": "study"},
            "common": common,
            "trainables": [{"name": "dpsgd", "search": {"epsilon": [1.0, 3.0], "batch_size": 20,
                                                        "certify_images": 0, **(search or {})}}]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from sweeps.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("dpsweep: error: ")
    return lines[0].removeprefix("dpsweep: error: ")


# ------------------------------------------------------------------ point 4: subset sizes


def test_train_size_beyond_a_loader_is_refused_with_the_key_value_and_size(studypkg, tmp_path, capsys):
    path = _spec(tmp_path, {"dataset": LOADER, "test_size": 40})
    assert _cli(capsys, "validate", path)[0] == 0          # positive control: sizes within the loader's
    code, _, err = _cli(capsys, "validate", path, "--set", "common.train_size=5000")
    assert code == 2
    msg = _one_error(err)
    assert msg.startswith("common.train_size: 5000 ")
    assert f"130 training images that loader {LOADER!r} returned" in msg
    assert "at most 130" in msg


def test_the_default_test_size_on_a_small_loader_is_refused(studypkg, tmp_path, capsys):
    code, _, err = _cli(capsys, "validate", _spec(tmp_path, {"dataset": LOADER, "train_size": 100}))
    assert code == 2
    msg = _one_error(err)
    assert msg.startswith("common.test_size: 1000 (the default) ")
    assert f"45 test images that loader {LOADER!r} returned" in msg


def test_a_swept_size_names_the_grid_item(studypkg, tmp_path, capsys):
    path = _spec(tmp_path, {"dataset": LOADER, "test_size": 40}, {"train_size": [100, 200]})
    code, _, err = _cli(capsys, "validate", path)
    assert code == 2
    assert _one_error(err).startswith("trainables[0].search.train_size[1]: 200 is more than the 130 training images")


def test_mnist_train_size_70000_is_refused_without_its_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DPSWEEP_DATA", str(tmp_path / "no-data-here"))   # the sizes are known, nothing is read
    path = _spec(tmp_path, {"dataset": "mnist", "train_size": 70000})
    code, _, err = _cli(capsys, "validate", path)
    assert code == 2
    msg = _one_error(err)
    assert msg.startswith("common.train_size: 70000 ") and "60000 training images of 'mnist'" in msg
    assert _cli(capsys, "validate", path, "--set", "common.train_size=60000")[0] == 0
    assert _cli(capsys, "validate", path, "--set", "common.test_size=10001")[0] == 2


def test_run_refuses_before_ray_or_mlflow_and_writes_nothing(studypkg, tmp_path, capsys, monkeypatch):
    import sweeps.runner
    import sweeps.tracking

    def never(*a, **k):
        raise AssertionError("the sweep started")

    monkeypatch.setattr(sweeps.runner, "ray_init", never)
    monkeypatch.setattr(sweeps.tracking, "start_parent_run", never)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path = _spec(tmp_path, {"dataset": LOADER, "test_size": 40})
    code, out, err = _cli(capsys, "run", path, "--set", "common.train_size=5000",
                          "--tracking-uri", f"sqlite:///{work}/mlflow.db")
    assert code == 2
    assert _one_error(err).startswith("common.train_size: 5000 ")
    assert out == ""
    assert list(work.iterdir()) == [] and not (tmp_path / "ray_results").exists()


# ------------------------------------------------------------------ point 5: names and a DataLoader


@pytest.mark.parametrize("path, meant", [
    ("studypkg_v1.nets:small_cnnn", "studypkg_v1.nets:small_cnn"),
    ("studypkg_v1.netz:small_cnn", "studypkg_v1.nets:small_cnn"),
    ("studypkg_v1.data:load_digit", "studypkg_v1.data:load_digits"),
])
def test_a_mistyped_factory_or_loader_gets_a_did_you_mean(studypkg, path, meant):
    from dpmech.datasets.user_code import resolve

    with pytest.raises(ValueError) as info:
        resolve(path, "model")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("model: ")
    assert msg.endswith(f"(did you mean {meant!r}?)") or f"(did you mean {meant!r}?);" in msg


def test_a_name_with_nothing_close_gets_no_guess(studypkg):
    from dpmech.datasets.user_code import resolve

    with pytest.raises(ValueError) as info:
        resolve("studypkg_v1.nets:resnet152", "model")
    assert "did you mean" not in str(info.value)


def test_the_spec_error_carries_the_did_you_mean(studypkg, tmp_path, capsys):
    path = _spec(tmp_path, {"dataset": LOADER, "train_size": 100, "test_size": 40},
                 {"model": "studypkg_v1.nets:small_cnnn"})
    code, _, err = _cli(capsys, "validate", path)
    assert code == 2
    msg = _one_error(err)
    assert msg.startswith("trainables[0].search.model: ")
    assert "(did you mean 'studypkg_v1.nets:small_cnn'?)" in msg
    path = _spec(tmp_path, {"dataset": "studypkg_v1.data:load_digit", "test_size": 40})
    code, _, err = _cli(capsys, "validate", path)
    assert code == 2 and "(did you mean 'studypkg_v1.data:load_digits'?)" in _one_error(err)


def test_a_dataloader_given_to_dpsgd_warns_once_that_its_batching_is_unused(monkeypatch, one_thread):
    import dpmech.dpsgd.trainer as tr
    from dpmech import DPSGDConfig, DPSGDTrainer
    from torch.utils.data import DataLoader, TensorDataset

    monkeypatch.setattr(tr, "_LOADER_WARNED", False)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.rand(60, 1, 4, 4, generator=g) * 2 - 1, torch.randint(0, 3, (60,), generator=g))
    cfg = DPSGDConfig(epsilon=4.0, batch_size=20, epochs=1, seed=0)

    def net():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DPSGDTrainer(net(), ds, config=cfg)                      # a dataset itself: nothing to say
        assert not [w for w in caught if issubclass(w.category, tr.LoaderSettingsIgnored)]
        DPSGDTrainer(net(), DataLoader(ds, batch_size=7, shuffle=True), config=cfg)
        DPSGDTrainer(net(), DataLoader(ds, batch_size=9), config=cfg)
    mine = [w for w in caught if issubclass(w.category, tr.LoaderSettingsIgnored)]
    assert len(mine) == 1
    text = str(mine[0].message)
    assert "batch_size (7)" in text and "shuffle (True)" in text and "Poisson" in text
    assert mine[0].filename == __file__          # points at the caller's line


def test_a_batchnorm_model_given_to_dpsgd_warns_once_that_trainer_model_is_the_trained_copy(one_thread):
    """Issue 51.6: BatchNorm is replaced by GroupNorm in a copy; the user's own object stays
    untrained, so the warning names what was replaced and trainer.model; an honest model is quiet."""
    import dpmech.dpsgd.trainer as tr
    from dpmech import DPSGDConfig, DPSGDTrainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 1, 6, 6, generator=g) * 2 - 1, torch.randint(0, 3, (40,), generator=g)
    cfg = DPSGDConfig(epsilon=4.0, batch_size=20, epochs=1, seed=0)
    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
    before = [p.detach().clone() for p in mine.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPSGDTrainer(mine, x, y, cfg)
        trainer.fit()
    replaced = [w for w in caught if issubclass(w.category, tr.ModelReplaced)]
    assert len(replaced) == 1, [str(w.message) for w in caught]
    text = str(replaced[0].message)
    assert "1: BatchNorm2d -> GroupNorm" in text and "trainer.model" in text and "untrained" in text
    assert replaced[0].filename == __file__          # points at the caller's line
    assert trainer.model is not mine and isinstance(trainer.model[1], torch.nn.GroupNorm)
    assert all(torch.equal(a, b) for a, b in zip(before, mine.parameters()))   # what the warning says

    honest = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4), torch.nn.ReLU(),
                                 torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert DPSGDTrainer(honest, x, y, cfg).model is honest
        DPSGDTrainer(tr.build_dpsgd_model("mnist", 0, "tb_cnn_gn"), torch.rand(8, 1, 28, 28) * 2 - 1,
                     torch.randint(0, 10, (8,)), DPSGDConfig(epsilon=4.0, batch_size=4, epochs=1, seed=0))
    assert not [w for w in caught if issubclass(w.category, tr.ModelReplaced)]
