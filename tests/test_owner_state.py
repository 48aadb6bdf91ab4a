"""The owner's working state (issue 48.3 and 48.6; docs/threat_model.md): a resume refuses a secret that
is not the sweep's own (a fingerprint is stored with the sweep, never the key), and dpsweep creates
what it writes owner-only unless ``DPSWEEP_UMASK`` asks otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dpmech.privacy.secret import NoiseKey
from sweeps.runner import save_state
from sweeps.secret_store import check_fingerprint, fingerprint, save_secret

RAW = {"name": "owner", "common": {"train_size": 100, "test_size": 50},
       "trainables": [{"name": "pixeldp", "search": {"epochs": 1}}], "search": {"algorithm": "grid"}}


def _experiment(tmp: Path, started_with: NoiseKey, on_disk: NoiseKey) -> Path:
    exp = tmp / "owner-1"
    save_state(exp, {"spec": RAW, "mlflow": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db"}, "run_name": "owner-1",
                     "total": 1, "secret_fingerprint": fingerprint(started_with)})
    save_secret(str(exp), "owner-1", on_disk)
    return exp


def test_resume_refuses_another_sweeps_key(tmp_path, capsys):
    from sweeps.cli import main

    exp = _experiment(tmp_path, NoiseKey(b"\x01" * 32), NoiseKey(b"\x02" * 32))
    assert main(["resume", str(exp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dpsweep.secret: this secret is not the one the sweep was started with" in err[0]
    assert not (tmp_path / "mlflow.db").exists()          # refused before anything else


def test_the_fingerprint_tells_keys_apart_and_reveals_none():
    a, b = NoiseKey(b"\x01" * 32), NoiseKey(b"\x02" * 32)
    check_fingerprint(a, fingerprint(a), "x")             # the sweep's own key passes
    with pytest.raises(ValueError, match="not the one"):
        check_fingerprint(b, fingerprint(a), "x")
    assert fingerprint(a) != fingerprint(b) and len(fingerprint(a)) == 32
    assert a.hex() not in fingerprint(a) and a.hex()[:16] not in fingerprint(a)
    assert fingerprint(NoiseKey.reproducible(0)) is None  # the research mode has no secret


def test_state_file_holds_the_fingerprint_not_the_key(tmp_path):
    key = NoiseKey(b"\x07" * 32)
    exp = _experiment(tmp_path, key, key)
    text = (exp / "dpsweep.json").read_text()
    assert json.loads(text)["secret_fingerprint"] == fingerprint(key) and key.hex() not in text


def test_cli_writes_owner_only_and_restores_the_umask(tmp_path, monkeypatch, capsys):
    """``dpsweep`` runs under umask 077 (its folders 0700, files 0600) and gives the caller's back."""
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    before = os.umask(0o022)
    try:
        # a report of an experiment that does not exist still creates the local MLflow store
        main(["report", "nothing-here", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db",
              "--out", str(tmp_path / "rep")])
        assert os.umask(0o022) == 0o022                     # restored after the command
    finally:
        os.umask(before)
    made = [p for p in tmp_path.rglob("*")]
    assert made and all(p.stat().st_mode & 0o077 == 0 for p in made), [(p, oct(p.stat().st_mode)) for p in made]


def test_the_user_may_ask_for_shared_files(tmp_path, monkeypatch):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPSWEEP_UMASK", "022")
    main(["report", "nothing-here", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--out", str(tmp_path / "r")])
    assert (tmp_path / "mlflow.db").stat().st_mode & 0o044 == 0o044


def test_a_bad_umask_is_one_line(monkeypatch, capsys):
    from sweeps.cli import main

    monkeypatch.setenv("DPSWEEP_UMASK", "rw-r--r--")
    assert main(["report", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DPSWEEP_UMASK" in err[0]
