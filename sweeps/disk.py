"""Free space and writability of a sweep's local storage and tracking store (issue 33, point 5).

A full disk used to fail a sweep after minutes with ``EOFError: Ran out of input`` (a checkpoint
torn by ENOSPC). ``dpsweep run`` and ``resume`` check before Ray starts (``storage_problems``), and
``StorageWatch`` checks every few seconds while Tune runs: when a path runs low the sweep stops
at once with one line naming the path and its free space, resumable after space is freed.
Remote storage (``s3://``, ``gs://``) and remote stores are not checked here.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from ray import tune

#: below this many free MB a sweep does not start, and a running one stops (env DPSWEEP_MIN_FREE_MB)
MIN_FREE_MB = 64.0


def min_free_mb() -> float:
    try:
        return float(os.environ.get("DPSWEEP_MIN_FREE_MB", MIN_FREE_MB))
    except ValueError:
        return MIN_FREE_MB


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB"


def local_paths(storage: str, tracking_uri: str) -> list[tuple[str, Path]]:
    """(what, path) of the sweep's local places: the storage directory and a SQLite or file store."""
    out = []
    if "://" not in storage:
        out.append(("storage", Path(storage).expanduser()))
    if tracking_uri.startswith("sqlite:///"):
        out.append(("tracking store", Path(tracking_uri[len("sqlite:///"):]).expanduser().parent))
    elif tracking_uri.startswith("file:"):
        from urllib.parse import urlparse

        out.append(("tracking store", Path(urlparse(tracking_uri).path)))
    elif "://" not in tracking_uri and ":" not in tracking_uri.split("/", 1)[0]:
        out.append(("tracking store", Path(tracking_uri).expanduser()))
    return out


def space_problem(what: str, path: Path, minimum_mb: float | None = None) -> str | None:
    """One line when ``path`` (or its nearest existing parent) is read-only or has less than
    ``minimum_mb`` free, else None."""
    minimum_mb = min_free_mb() if minimum_mb is None else minimum_mb
    target = path
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        readonly = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
        usage = shutil.disk_usage(target)
    except OSError as exc:
        return f"{what} {path}: cannot be read ({exc})"
    if readonly or not os.access(target, os.W_OK):
        return f"{what} {path}: {target} is on a read-only file system or not writable by this user"
    if usage.free < minimum_mb * 2**20:
        return (f"{what} {path}: {_mb(usage.free)} free of {_mb(usage.total)} (a sweep needs at least "
                f"{minimum_mb:g} MB: its checkpoints and the tracking store; DPSWEEP_MIN_FREE_MB sets it)")
    return None


def storage_problems(storage: str, tracking_uri: str) -> list[str]:
    return [p for what, path in local_paths(storage, tracking_uri) if (p := space_problem(what, path))]


class StorageFull(RuntimeError):
    """A sweep's storage or store ran low while it ran (one line)."""


class StorageWatch(tune.Callback):
    """Stops the sweep, within ``every`` seconds, when its storage or store runs low or turns
    read-only: Tune's experiment snapshot is then still whole and ``dpsweep resume`` continues
    after space is freed (``sweeps.cli`` turns the ``StorageFull`` into one line, exit 1)."""

    def __init__(self, places: list[tuple[str, str]], every: float = 2.0):
        self.places = places           # (what, path) as strings: the callback is pickled with the experiment
        self.every = every
        self._last = 0.0

    def on_step_end(self, iteration, trials, **info):
        now = time.monotonic()
        if now - self._last < self.every:
            return
        self._last = now
        # a running sweep stops at a quarter of the start-up minimum: room for the final snapshot
        for what, path in self.places:
            problem = space_problem(what, Path(path), min_free_mb() / 4)
            if problem:
                raise StorageFull(problem)
