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
