"""Issue 33, point 4: a torn checkpoint (a truncated ``state.pt``) is skipped for the one before it,
or the trial starts afresh; it is never retried from the same file until the retries run out."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainables.runtime import _save_checkpoint, restore_checkpoint


class _Mech:
    def __init__(self, value: float):
        self.net = nn.Linear(4, 2)
        nn.init.constant_(self.net.weight, value)

    def state_dict(self):
        return {"model": self.net.state_dict()}


def _checkpoints(root: Path, values) -> list[Path]:
    out = []
    for i, v in enumerate(values, start=1):
        d = root / f"checkpoint_{i:06d}"
        d.mkdir(parents=True)
        _save_checkpoint(d, _Mech(v), {"mlflow_run_id": "r1", "history": [{"epoch": e} for e in range(1, i + 1)]})
        out.append(d)
    return out


def _truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _latest(d: Path):
    from ray import tune

    return tune.Checkpoint(path=str(d))


def test_a_truncated_latest_checkpoint_falls_back_to_the_one_before(tmp_path):
    first, second = _checkpoints(tmp_path / "trial", [1.0, 2.0])
    state, meta, note = restore_checkpoint(_latest(second), torch.device("cpu"))
    assert note is None and state["model"]["weight"][0, 0] == 2.0   # control: an intact latest is used
    _truncate(second / "state.pt")
    state, meta, note = restore_checkpoint(_latest(second), torch.device("cpu"))
    assert state["model"]["weight"][0, 0] == 1.0 and len(meta["history"]) == 1 and meta["mlflow_run_id"] == "r1"
    assert "checkpoint_000002" in note and "resumed from checkpoint_000001 (epoch 1)" in note
    assert "state_sha256" not in meta


def test_a_corrupted_byte_is_caught_by_the_digest(tmp_path):
    (only,) = _checkpoints(tmp_path / "trial", [3.0])
    data = bytearray((only / "state.pt").read_bytes())
    data[-30] ^= 0xFF                       # still a readable zip, perhaps: the SHA-256 decides
    (only / "state.pt").write_bytes(bytes(data))
    state, meta, note = restore_checkpoint(_latest(only), torch.device("cpu"))
    assert state is None and meta is None
    assert "checkpoint_000001" in note and "starts afresh" in note


def test_no_readable_checkpoint_starts_afresh_and_says_why(tmp_path):
    first, second = _checkpoints(tmp_path / "trial", [1.0, 2.0])
    _truncate(first / "state.pt")
    (second / "meta.json").unlink()
    state, meta, note = restore_checkpoint(_latest(second), torch.device("cpu"))
    assert state is None and "checkpoint_000002: FileNotFoundError" in note and "checkpoint_000001: state.pt" in note
