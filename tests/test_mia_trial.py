"""The ``mia`` trial key (issue 52, part 4; docs/mia.md, "In a sweep"): a dpsgd trial draws the
membership from its own noise key, trains on its subset plus the members with the sampling planned
from the public expected count, attacks its model with reference models cached on disk (owner-only,
shared by the next trial that matches, one trainer per key under a file lock) and logs the mia_*
metrics; the key's rules are one-line errors."""

from __future__ import annotations

import os
import stat
import threading
import time
import types

import pytest
import torch

pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing"), pytest.mark.usefixtures("one_thread")]

TINY = {"dataset": "mnist", "train_size": 200, "test_size": 100, "batch_size": 50, "epochs": 2, "epsilon": 8.0,
        "model": "tb_cnn", "clipping": "bk", "certify_images": 0, "seed": 0, "noise_source": "seed",
        "mia": {"attack": "rmia", "references": 1, "candidates": 200, "num_z": 200}}
MIA_METRICS = ("mia_auc", "mia_auc_lo", "mia_auc_hi", "mia_tpr_at_fpr_0.001", "mia_tpr_at_fpr_0.01", "mia_eps_lb",
               "mia_candidates", "mia_members", "mia_references", "mia_confidence", "mia_delta", "mia_num_z",
               "mia_references_cached", "mia_reference_seconds", "mia_attack_seconds", "mia_attack_rmia")


def _run(monkeypatch, config: dict) -> list[dict]:
    from ray import tune

    from trainables.registry import get_trainable

    results = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: types.SimpleNamespace(get_trial_id=lambda: "t0"))
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: results.append(dict(metrics)))
    get_trainable(config["trainable"]).fn(config)
    return results


def test_mia_trial_attacks_its_model_and_shares_references(monkeypatch, tmp_path):
    import dpmech.privacy.mia.attacks  # noqa: F401 - bound to the real MembershipGame before the spy replaces it
    import dpmech.privacy.mia.game as mia_lib
    from dpmech.privacy.secret import NoiseKey

    monkeypatch.setenv("DPSWEEP_CACHE", str(tmp_path / "cache"))
    seeds, sizes = [], []
    real_game = mia_lib.MembershipGame

    def spy_game(x, y, *, generator):
        seeds.append(generator.initial_seed())
        game = real_game(x, y, generator=generator)
        sizes.append(int(game.members()[0].shape[0]))
        return game

    monkeypatch.setattr(mia_lib, "MembershipGame", spy_game)
    final = _run(monkeypatch, {"trainable": "dpsgd", **TINY})[-1]
    for key in MIA_METRICS:
        assert key in final, key
    assert 0 <= final["mia_auc_lo"] <= final["mia_auc"] <= final["mia_auc_hi"] <= 1
    assert final["mia_candidates"] == 200 and final["mia_references"] == 1 and final["mia_references_cached"] == 0
    assert final["mia_eps_lb"] <= final["epsilon"] <= 8.0 + 1e-9
    # the coins: the trial's key (research mode here: its public seed's stream), never a fixed seed
    assert seeds == [NoiseKey.reproducible(0).stream_seed("mia.membership", 0)]
    assert final["mia_members"] == sizes[0]
    # the sampling rate is planned from train_size + candidates // 2, not from the drawn members
    assert final["sampling_rate"] == pytest.approx(50 / (200 + 100))
    # the cache: owner-only, the model and what made it
    cache = tmp_path / "cache" / "mia"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (pt,) = cache.glob("*.pt")
    assert stat.S_IMODE(pt.stat().st_mode) == 0o600 and pt.with_suffix(".json").exists()
    # another trial that matches (another seed, the other attack) reuses the reference model
    second = _run(monkeypatch, {"trainable": "dpsgd", **TINY, "seed": 1,
                                "mia": {**TINY["mia"], "attack": "lira"}})[-1]
    assert second["mia_references_cached"] == 1 and second["mia_attack_rmia"] == 0.0
    assert len(list(cache.glob("*.pt"))) == 1
    assert seeds[1] == NoiseKey.reproducible(1).stream_seed("mia.membership", 1)


def test_secret_trials_draw_the_membership_from_their_secret_key(monkeypatch, tmp_path):
    """noise_source secret: the membership follows the trial's derived secret key (another sweep
    key: another draw), not the public seed."""
    import dpmech.privacy.mia.attacks  # noqa: F401 - bound to the real MembershipGame before the spy replaces it
    import dpmech.privacy.mia.game as mia_lib
    from dpmech.privacy.secret import NoiseKey
    from trainables.dpsgd import DPSGDMechanism, DPSGDTrialConfig
    from trainables.mia_trial import mia_trial
    from trainables.runtime import trial_noise_key

    cfg = DPSGDTrialConfig(**{**{k: v for k, v in TINY.items()}, "noise_source": "secret"})
    x = torch.zeros(200, 1, 28, 28)
    y = torch.zeros(200, dtype=torch.long)
    draws = []
    for key in (NoiseKey.fresh(), NoiseKey.fresh()):
        tkey = trial_noise_key(cfg, "dpsgd", {}, key)
        m = mia_trial(cfg, x, y, torch.device("cpu"), tkey, DPSGDMechanism)
        draws.append(m.game.members()[1].tolist() + [m.game.members()[0].shape[0]])
        assert isinstance(m.game, mia_lib.MembershipGame)
    public = mia_trial(cfg, x, y, torch.device("cpu"), NoiseKey.reproducible(0), DPSGDMechanism)
    assert draws[0] != draws[1]
    assert public.game.members()[0].shape[0] != draws[0][-1] or public.game.members()[1].tolist() != draws[0][:-1]


def test_mia_key_rules():
    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import validate_config

    def err(config, schema=DPSGDTrialConfig) -> str:
        with pytest.raises(ValueError) as info:
            validate_config(config, schema)
        msg = str(info.value)
        assert "\n" not in msg
        return msg

    base = {k: v for k, v in TINY.items() if k != "mia"}
    assert "mia.references" in err({**base, "mia": {"attack": "rmia", "references": 5}})
    assert "less than or equal to 4" in err({**base, "mia": {"attack": "rmia", "references": 5}})
    assert "mia.attack" in err({**base, "mia": {"attack": "shadow"}})
    assert "mia.candidates" in err({**base, "mia": {"attack": "rmia", "candidates": 2}})
    assert "mia.oops" in err({**base, "mia": {"attack": "rmia", "oops": 1}})
    assert "train_size" in err({**base, "train_size": None, "mia": {"attack": "rmia"}})
    assert "black-box audit" in err({**base, "audit_canaries": 10, "mia": {"attack": "lira"}})
    from trainables.label_dp import LabelDPTrialConfig

    msg = err({"dataset": "mnist", "train_size": 200, "mia": {"attack": "rmia"}}, LabelDPTrialConfig)
    assert "mia" in msg and "dpsgd" in msg
    ok = validate_config({**base, "mia": {"attack": "lira"}}, DPSGDTrialConfig)
    assert ok.mia == {"attack": "lira", "references": 2, "candidates": 1000, "num_z": 1000, "confidence": 0.95}
    from trainables.dpsgd import privacy_event

    assert privacy_event(ok) is not None        # planned from train_size + 500


def test_reference_cache_trains_each_key_once_across_workers(tmp_path):
    """Two caches on one folder (two workers): the second asking for a key the first is training
    waits for it and loads its model; a torn file is trained again."""
    from trainables.mia_trial import ReferenceCache

    def load(state):
        m = torch.nn.Linear(2, 2)
        m.load_state_dict(state)
        return m

    a, b = ReferenceCache(tmp_path / "c", load), ReferenceCache(tmp_path / "c", load)
    key = "ab" * 32
    assert key not in a                 # a holds the key's lock: it trains
    got = {}

    def other():
        got["present"] = key in b       # waits for a's model
        got["model"] = b[key] if got["present"] else None

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()                 # blocked on the lock
    model = torch.nn.Linear(2, 2)
    a[key] = model
    t.join(5)
    assert got["present"] and torch.equal(got["model"].weight, model.weight) and b.hits == 1
    (tmp_path / "c" / f"{key}.pt").write_bytes(b"torn")
    c = ReferenceCache(tmp_path / "c", load)
    assert key not in c                 # unreadable: deleted, to be trained again
    c.close()
    assert not (tmp_path / "c" / f"{key}.pt").exists()
    assert oct(os.stat(tmp_path / "c").st_mode & 0o777) == "0o700"
