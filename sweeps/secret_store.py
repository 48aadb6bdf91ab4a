"""Where a sweep keeps its secret (docs/threat_model.md): ``<experiment dir>/dpsweep.secret``, created
exclusively with mode 0600 (its owner only) before any trial can draw from it, holding the hex
of the sweep's ``dpmech.privacy.secret.NoiseKey``. A sweep on remote storage (``s3://``) keeps it
in ``~/.dpsweep/secrets/<run name>.secret`` on the driver's machine. Nothing else reads or
writes it: it is never logged to MLflow, never in an artifact, never printed."""

from __future__ import annotations

import os
from pathlib import Path

SECRET_FILE = "dpsweep.secret"
def fingerprint(key) -> str | None:
    """A one-way fingerprint of the sweep's key (None for the research mode's key): stored with the
    sweep so a resume can tell another sweep's key from its own without storing the key
    (``NoiseKey.fingerprint``: 128 bits of an HMAC under the key, which tells nothing of it)."""
    if key is None or key.reproducible_mode:
        return None
    return key.fingerprint("sweep")


def check_fingerprint(key, expected: str | None, path: str) -> None:
    """ValueError in one line when ``key`` is not the key whose fingerprint the sweep stored."""
    if expected is None or key is None:
        return
    if fingerprint(key) != expected:
        raise ValueError(f"{path}: this secret is not the one the sweep was started with (its fingerprint "
                         f"differs from dpsweep.json's secret_fingerprint); restore the sweep's own dpsweep.secret")


def secret_path(exp_dir: str, run_name: str) -> Path:
    if "://" in exp_dir:
        return Path.home() / ".dpsweep" / "secrets" / f"{run_name}.secret"
    return Path(exp_dir) / SECRET_FILE


def save_secret(exp_dir: str, run_name: str, key) -> Path:
    """Write ``key`` (a NoiseKey; nothing is written for None or the research mode's key) readable
    by the owner only; returns the path (or a note when nothing was written)."""
    path = secret_path(exp_dir, run_name)
    if key is None or key.reproducible_mode:
        return path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return path


def load_secret(exp_dir: str, run_name: str):
    """The sweep's NoiseKey; ValueError naming the file when it is missing or unreadable."""
    from dpmech.privacy.secret import NoiseKey

    path = secret_path(exp_dir, run_name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: the sweep's secret is missing (it draws the noise, K and the candidates of the "
                         "trials still to run); restore the file from where the sweep ran") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the sweep's secret ({exc.strerror})") from None
    try:
        return NoiseKey.from_hex(text)
    except ValueError:
        raise ValueError(f"{path}: not a dpsweep secret (64 hex digits expected)") from None
