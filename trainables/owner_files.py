"""Who may read what a sweep writes (docs/threat_model.md, issue 48.3): the owner's working state
(experiment folder, checkpoints, local MLflow store, report, release drafts) is created owner-only,
0700 folders and 0600 files, through the process umask of the driver and of every trial process.
``DPSWEEP_UMASK`` (octal, e.g. ``022``) asks otherwise."""

from __future__ import annotations

import os

OWNER_UMASK = 0o077   # the owner's working state: 0700 folders, 0600 files (DPSWEEP_UMASK overrides)


def owner_umask() -> int:
    """The umask dpsweep creates its working state with (docs/threat_model.md): ``DPSWEEP_UMASK``
    (octal, e.g. ``022`` to share it with the group and others, asked for explicitly), else 077."""
    text = os.environ.get("DPSWEEP_UMASK", "").strip()
    if not text:
        return OWNER_UMASK
    try:
        value = int(text, 8)
    except ValueError:
        raise ValueError(f"DPSWEEP_UMASK: an octal umask such as 077 or 022 is expected, got {text!r}") from None
    if not 0 <= value <= 0o777:
        raise ValueError(f"DPSWEEP_UMASK: an octal umask between 000 and 777 is expected, got {text!r}")
    return value


def apply_owner_umask() -> int:
    """Set this process's umask to :func:`owner_umask`; returns the previous one."""
    return os.umask(owner_umask())
