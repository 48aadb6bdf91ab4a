"""ScatterNet features (Oyallon & Mallat 2015) for DP-SGD, as in Tramer & Boneh (ICLR 2021,
"Differentially Private Learning Needs Better Features (or Much More Data)", Sec. 3).

What is computed: the 2-D scattering transform of order 2 (Bruna & Mallat 2013; Oyallon & Mallat
2015, Eq. 1-3) with ``J`` scales and ``L`` orientations, through kymatio's PyTorch frontend.
For an image x (one channel) and the Morlet wavelets psi_{j,theta} and the Gaussian low-pass
phi_J of the scale 2^J:

* order 0:  S_0 x = x * phi_J                                       (1 channel)
* order 1:  S_1 x = |x * psi_{j1,t1}| * phi_J                       (J L channels)
* order 2:  S_2 x = ||x * psi_{j1,t1}| * psi_{j2,t2}| * phi_J, j2 > j1  (L^2 J (J - 1) / 2 channels)

each subsampled by 2^J in both directions. T&B's setting (their ``data.py``,
``get_scatter_transform``): J = 2, L = 8 on 28 x 28 MNIST, so 1 + 16 + 64 = 81 channels of
7 x 7 (3,969 features); an image with C channels gives 81 C channels (each channel transformed
separately; CIFAR-10: 243 x 8 x 8).

Input range: T&B read MNIST through ``transforms.ToTensor()`` alone (Handcrafted-DP ``data.py``,
``get_data``), i.e. pixels in [0, 1], and scatter those. The project's images are in [-1, 1];
``input_range="unit"`` (T&B's, the default here) maps x -> (x + 1) / 2 before the transform, so
an MNIST pixel enters as uint8 / 255, exactly what ``ToTensor`` gives. ``"pm1"`` scatters the
[-1, 1] image as it is. The difference is small after the group normalisation of the models
(order 0 is affine in x, orders 1 and 2 are positively homogeneous: S(2u - 1) = 2 S(u) for
orders >= 1, since the wavelets have zero mean), but the cache keeps the two apart.

**No privacy cost.** The transform is a fixed function of one image: its filters depend only on
(J, L, the image size), never on any data, and the features of example i are a function of x_i
alone. DP-SGD on the pairs (S x_i, y_i) is therefore DP-SGD on the images with a model g o S whose
first part has no trainable parameters: adding or removing one image adds or removes exactly one
feature row, the per-example gradients that are clipped are those of g o S at x_i, and the Poisson
sampling rate, noise and steps (the whole privacy event) are unchanged. The features need no
budget, like any fixed preprocessing of each example. (The counter-example is a transform fit to
the data, e.g. the PCA projection of Abadi et al. 2016, which they compute privately and charge.)

The cache (:func:`scatter_features`) stores features of training images on local disk next to
the data (under :func:`dpmech.datasets.splits.data_root`, ``features/``): it is as sensitive as the images
(a scattering representation can be inverted approximately) and is never logged or released.

Why kymatio is imported from its 2-D frontend module: ``import kymatio.torch`` imports the 1-D,
2-D and 3-D frontends, and kymatio 0.3.0's 3-D filter bank imports ``scipy.special.sph_harm``,
which current SciPy removed (an ImportError). The 2-D frontend does not touch it.
:func:`scattering_2d` is the one place that imports it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from dpmech import _validate as v

log = logging.getLogger(__name__)

INPUT_RANGES = ("unit", "pm1")
DEFAULT_J, DEFAULT_L = 2, 8          # Tramer & Boneh 2021 (Handcrafted-DP data.py: Scattering2D(J=2, ...), L = 8)
CHUNK_ROWS = 4096                    # images per cache file (a partial run keeps its finished chunks)
_BATCH = 512                         # images per scattering call inside a chunk (memory)
_FORMAT = 1                          # cache file layout version


def scattering_2d(J: int, shape: tuple[int, int], L: int) -> nn.Module:
    """kymatio's 2-D scattering (PyTorch frontend) for images of ``shape`` (H, W).

    Imported from ``kymatio.scattering2d.frontend.torch_frontend``, not ``kymatio.torch``: the
    latter also imports the 3-D frontend, whose filter bank needs ``scipy.special.sph_harm``
    (removed from SciPy; kymatio 0.3.0 fails to import there). The 2-D transform does not use it.
    """
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    return ScatteringTorch2D(J=J, shape=tuple(shape), L=L)


def kymatio_version() -> str:
    import kymatio

    return str(kymatio.__version__)


def num_channels(J: int, L: int, max_order: int = 2) -> int:
    """Scattering channels per input channel: 1 + J L + L^2 J (J - 1) / 2 (order 2); 81 for J=2, L=8."""
    return 1 + J * L + (L * L * J * (J - 1) // 2 if max_order >= 2 else 0)


def check_params(input_shape, J: int, L: int, input_range: str) -> tuple[int, int, int]:
    """Validate (J, L, input_range) for images of ``input_shape`` (C, H, W); returns (C, H, W)."""
    v.positive_int("J", J)
    v.positive_int("L", L)
    v.choice("input_range", input_range, INPUT_RANGES)
    if len(tuple(input_shape)) != 3:
        raise ValueError(f"input_shape must be (C, H, W), got {tuple(input_shape)}")
    c, h, w = (int(s) for s in input_shape)
    if h % (2 ** J) or w % (2 ** J):
        raise ValueError(f"features: scatternet with J={J} needs image height and width divisible by 2^J = {2 ** J} "
                         f"(the output is subsampled by 2^J), got {h} x {w}")
    return c, h, w


def feature_shape(input_shape, J: int = DEFAULT_J, L: int = DEFAULT_L) -> tuple[int, int, int]:
    """(channels, height, width) of the features of images of ``input_shape`` (C, H, W):
    (C * num_channels(J, L), H / 2^J, W / 2^J); (81, 7, 7) for MNIST with T&B's J=2, L=8."""
    c, h, w = check_params(input_shape, J, L, "unit")
    return c * num_channels(J, L), h // 2 ** J, w // 2 ** J


class ScatterNet(nn.Module):
    """Images [N, C, H, W] in the project's [-1, 1] -> ScatterNet features [N, C K, H/2^J, W/2^J]
    (K = :func:`num_channels`), no trainable parameters (the filters are buffers).

    ``input_range="unit"`` (T&B's) scatters (x + 1) / 2; ``"pm1"`` scatters x. The module is
    differentiable in its input (FFTs, complex modulus), so attacks on a deployed
    ``nn.Sequential(ScatterNet(...), classifier)`` take gradients through it.
    """

    def __init__(self, input_shape, J: int = DEFAULT_J, L: int = DEFAULT_L, input_range: str = "unit"):
        super().__init__()
        c, h, w = check_params(input_shape, J, L, input_range)
        self.input_shape = (c, h, w)
        self.J, self.L, self.input_range = int(J), int(L), input_range
        self.scattering = scattering_2d(self.J, (h, w), self.L)
        self.out_shape = (c * num_channels(self.J, self.L), h // 2 ** self.J, w // 2 ** self.J)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"x must be [N, {', '.join(map(str, self.input_shape))}], got {tuple(x.shape)}")
        if self.input_range == "unit":
            x = (x + 1.0) * 0.5
        s = self.scattering(x.contiguous())                 # [N, C, K, h, w]
        return s.reshape(x.shape[0], *self.out_shape)

    def extra_repr(self) -> str:
        return f"J={self.J}, L={self.L}, input_range={self.input_range!r}, out_shape={self.out_shape}"


# ---------------------------------------------------------------------------------------- cache
def cache_root() -> Path:
    """``<data root>/features`` (``$DPSWEEP_DATA`` or ``~/.cache/dpsweep``, :func:`dpmech.datasets.splits.data_root`)."""
    from dpmech.datasets.splits import data_root

    return data_root() / "features"


def _tag(dataset: str) -> str:
    """A file-name-safe form of a dataset name or a loader's import path."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(dataset)).strip("_")[:60] or "data"


def _digest(chunk: torch.Tensor) -> str:
    """sha256 of the chunk's shape, dtype and bytes: the cache key of what was scattered."""
    t = chunk.detach().to("cpu", torch.float32).contiguous()
    h = hashlib.sha256(f"{tuple(t.shape)}|{t.dtype}|".encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def _valid(obj, digest: str, rows: int, shape: tuple[int, int, int], key: dict) -> bool:
    if not isinstance(obj, dict) or obj.get("format") != _FORMAT or obj.get("digest") != digest:
        return False
    if any(obj.get(k) != val for k, val in key.items()):
        return False
    f = obj.get("features")
    return (torch.is_tensor(f) and f.dtype == torch.float32 and tuple(f.shape) == (rows, *shape)
            and bool(torch.isfinite(f).all()))


def _load(path: Path, digest: str, rows: int, shape, key: dict) -> torch.Tensor | None:
    """The cached features of ``path`` if the file is complete and matches, else None (logged)."""
    if not path.exists():
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: recompute it
        log.warning("scatternet cache %s unreadable (%s: %s); recomputing", path.name, type(exc).__name__, exc)
        return None
    if not _valid(obj, digest, rows, shape, key):
        log.warning("scatternet cache %s does not match its images; recomputing", path.name)
        return None
    return obj["features"]


def _atomic_save(obj: dict, path: Path) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path`` (readers
    see the old file or the complete new one, never a partial one)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@torch.no_grad()
def _compute(net: ScatterNet, chunk: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = []
    for s in range(0, chunk.shape[0], _BATCH):
        out.append(net(chunk[s:s + _BATCH].to(device, torch.float32)).to("cpu", torch.float32))
    return torch.cat(out)


def scatter_features(x: torch.Tensor, *, J: int = DEFAULT_J, L: int = DEFAULT_L, input_range: str = "unit",
                     dataset: str = "data", cache: bool = True, cache_dir: str | os.PathLike | None = None,
                     device: str | torch.device | None = None, chunk_rows: int = CHUNK_ROWS,
                     progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """ScatterNet features of the images ``x`` [N, C, H, W] (in [-1, 1]) as float32 on the CPU,
    [N, C K, H / 2^J, W / 2^J], computed in chunks of ``chunk_rows`` images and cached on disk.

    Cache (``cache=True``): one file per chunk under ``cache_dir`` (default
    ``<data root>/features``) ``/scatternet-kymatio<version>-J<J>-L<L>-<input_range>/``, named
    ``<dataset>-<sha256 of the chunk's images>.pt``. The key is the content of the images, so it
    separates datasets, split selections (train_size, data_seed, appended audit canaries) and
    everything else that changes the pixels; J, L, the input range and the kymatio version are in
    the directory name and checked again in the file. A chunk is written atomically (temporary
    file, fsync, rename); a file that cannot be read, is truncated or does not match its chunk is
    recomputed and replaced. Two processes computing the same chunk (two Ray workers starting the
    same sweep) serialise on an ``fcntl`` lock next to it: the second waits and then reads the
    first one's file. ``progress(done_rows, total_rows)`` is called after every chunk.

    No privacy cost: see the module docstring.
    """
    if not torch.is_tensor(x) or x.dim() != 4:
        got = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        raise ValueError(f"x must be a tensor [N, C, H, W], got {got}")
    v.positive_int("chunk_rows", chunk_rows)
    c, h, w = check_params(tuple(x.shape[1:]), J, L, input_range)
    device = torch.device(device) if device is not None else x.device
    net = ScatterNet((c, h, w), J, L, input_range).to(device)
    shape = net.out_shape
    n = int(x.shape[0])
    key = {"J": int(J), "L": int(L), "input_range": input_range, "kymatio": kymatio_version()}
    folder = None
    if cache:
        folder = Path(cache_dir) if cache_dir is not None else cache_root()
        folder = folder / f"scatternet-kymatio{key['kymatio']}-J{J}-L{L}-{input_range}"
        folder.mkdir(parents=True, exist_ok=True)
    out, done, hits = [], 0, 0
    for s in range(0, n, chunk_rows):
        chunk = x[s:s + chunk_rows]
        rows = int(chunk.shape[0])
        if folder is None:
            feats = _compute(net, chunk, device)
        else:
            digest = _digest(chunk)
            path = folder / f"{_tag(dataset)}-{digest[:32]}.pt"
            feats = _load(path, digest, rows, shape, key)
            if feats is None:
                with open(folder / f".{path.name}.lock", "a+") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be writing this chunk
                    try:
                        feats = _load(path, digest, rows, shape, key) if path.exists() else None
                        if feats is None:
                            feats = _compute(net, chunk, device)
                            _atomic_save({"format": _FORMAT, "digest": digest, **key, "features": feats}, path)
                        else:
                            hits += 1
                    finally:
                        fcntl.flock(lock, fcntl.LOCK_UN)
            else:
                hits += 1
        out.append(feats)
        done += rows
        if progress is not None:
            progress(done, n)
        log.info("scatternet features %s: %d / %d images", _tag(dataset), done, n)
    if folder is not None:
        log.info("scatternet features %s: %d of %d chunks from the cache %s", _tag(dataset), hits,
                 len(out), folder)
    return torch.cat(out) if out else torch.empty(0, *shape)
