"""One driver per sweep (issue 49.3; docs/faults.md): ``dpsweep run`` and ``dpsweep resume`` hold an
exclusive OS lock on ``<experiment dir>/dpsweep.lock`` for their lifetime. A second driver of the
same experiment (two resumes, or a resume while the run still goes) is refused at once, in one line
naming the holder. The lock is ``flock``: the kernel drops it when the holding process dies, however
it dies, so a killed driver never leaves a stale lock behind; the file's text (pid, host, command,
start time) only names the holder. Remote storage (``s3://``) has no local folder to lock: a resume
there runs unguarded (docs/faults.md)."""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = "dpsweep.lock"


class SweepLocked(RuntimeError):
    """Another live driver holds the experiment (one line naming it)."""


class DriverLock:
    """The experiment's driver lock, held from :meth:`acquire` until :meth:`release` or the process's end."""

    def __init__(self, experiment_dir: str | Path):
        self.path = Path(experiment_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, command: str) -> "DriverLock":
        """Take the lock or raise SweepLocked naming its holder. Never blocks."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise SweepLocked(f"{self.path.parent}: another dpsweep driver holds this sweep ({holder}); wait for it "
                              "to finish or stop it (Ctrl-C), then resume") from None
        except OSError:
            os.close(fd)
            raise
        note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                           "since": dt.datetime.now().isoformat(timespec="seconds")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, note, 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)   # closing drops the flock


def _describe(text: bytes) -> str:
    try:
        who = json.loads(text.decode() or "{}")
    except ValueError:
        who = {}
    if not who:
        return "a process that has not said who it is yet"
    return f"pid {who.get('pid')} on {who.get('host')}, dpsweep {who.get('command')}, since {who.get('since')}"
