"""benchmarks/lipschitz_mnist.py's units resume from their per-epoch checkpoint (a full-MNIST unit is about
half an hour of a core, longer than what is left of a session): stopped after its first epoch and run
again, a unit ends with the record an uninterrupted run has (accuracy, radii, ledger), trains only the
epochs it lacked, and the command removes its checkpoint once the unit's file is written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import lipschitz_mnist as bench  # noqa: E402

TINY = {"epochs": 3, "batch_size": 64, "width": 4, "hidden": 32}
KW = dict(epsilon=3.0, seed=0, split="test", train_size=256, cert_images=16, recipe=TINY)
SAME = ("acc_clean", "cert_acc", "radius_01", "correct", "epsilon", "epsilon_pld", "noise_multiplier", "steps",
        "train_loss_last", "lipschitz")


def test_a_unit_stopped_after_an_epoch_resumes_to_the_uninterrupted_record(tmp_path, monkeypatch, one_thread):
    from dpmech.lipschitz.trainer import LipschitzDPTrainer

    whole = bench.run_unit(**KW)

    ckpt = tmp_path / "unit.pt"
    real = LipschitzDPTrainer.train_epoch
    calls = []

    def stop_in_the_second(self):
        calls.append(self.epoch)
        if len(calls) == 2:
            raise KeyboardInterrupt   # a session's end, inside epoch 2
        return real(self)

    monkeypatch.setattr(LipschitzDPTrainer, "train_epoch", stop_in_the_second)
    with pytest.raises(KeyboardInterrupt):
        bench.run_unit(**KW, ckpt=ckpt)
    assert ckpt.exists()

    trained = []
    monkeypatch.setattr(LipschitzDPTrainer, "train_epoch", lambda self: (trained.append(self.epoch), real(self))[1])
    resumed = bench.run_unit(**KW, ckpt=ckpt)
    assert trained == [1, 2]                       # epochs 2 and 3 only
    for key in SAME:
        assert resumed[key] == whole[key], key


def test_the_command_removes_a_units_checkpoint_once_its_file_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "run_unit", lambda *a, **k: (Path(a[-1]).write_text("state"),
                                                            {"epsilon": 3.0, "acc_clean": 50.0, "cert_acc": {},
                                                             "lipschitz": 1.0, "train_seconds": 1.0,
                                                             "epsilon_target": 3.0})[1])
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir()
    assert bench.main(["--epsilons", "3", "--seeds", "0", "--split", "val", "--ckpt-dir", str(ckpts)]) == 0
    assert (tmp_path / "lipschitz_mnist" / "eps3_seed0_val_nall.json").exists()
    assert list(ckpts.iterdir()) == []
