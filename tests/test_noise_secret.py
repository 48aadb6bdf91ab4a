"""The noise a guarantee rests on comes from a secret (issue 32.1; docs/threat_model.md).

The attack: an adversary who knows the public seed, the config and every training example but one
replays training on both neighbouring datasets with the shipped engine and compares the replays
with the released weights. With noise derived from the public seed (the research mode, the
negative control) the replay of the true world is bit-identical and membership is decided with
certainty; with the secret key no replay matches, and the exact-replay attack learns nothing.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, stream_seed
from dpmech.privacy.secret import REPRODUCIBLE_LABEL, NoiseKey

pytestmark = pytest.mark.usefixtures("one_thread")


def test_keys_are_fresh_hidden_and_derive_independent_streams():
    a, b = NoiseKey.fresh(), NoiseKey.fresh()
    assert a != b and a.stream_seed("s", 0) != b.stream_seed("s", 0)
    assert "secret" in repr(a) and a.hex() not in repr(a) and a.hex() not in str(a)
    assert NoiseKey.from_hex(a.hex()) == a                              # the owner can keep and reload it
    assert pickle.loads(pickle.dumps(a)) == a                           # Ray hands it to the trials
    assert a.derive("trial 1") != a.derive("trial 2") and a.derive("x") == a.derive("x")
    assert a.stream_seed("dpsgd.noise", 7) != a.stream_seed("dpsgd.sampling", 7)
    assert 0 <= a.stream_seed("s", 0) < 2 ** 63
    # the research mode replays the earlier public-seed streams exactly, and says so
    r = NoiseKey.reproducible(5)
    assert r.reproducible_mode and r.stream_seed("dpsgd.noise", stream_seed(5, 2)) == stream_seed(5, 2)
    assert r.label() == REPRODUCIBLE_LABEL and a.label() == ""
    with pytest.raises(ValueError, match="noise_key"):
        NoiseKey.resolve(1234)


def _data(n: int = 64, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long()
    x[0] = 8.0                                     # the target: an outlier, so its presence matters
    y[0] = 1
    return x, y


def _train(x, y, key) -> torch.Tensor:
    torch.manual_seed(0)                           # public initialisation
    model = nn.Linear(x.shape[1], 2)
    cfg = DPSGDConfig(epsilon=1.0, delta=1e-5, max_grad_norm=1.0, batch_size=16, epochs=3, lr=0.5,
                      momentum=0.0, seed=3)
    trainer = DPSGDTrainer(model, x, y, cfg, noise_key=key, plan_size=64)
    trainer.fit()
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def _replay_decides(released: torch.Tensor, x, y) -> str:
    """The adversary: replays both worlds from the public seed; 'in' / 'out' when a replay equals the
    release, '?' when neither does (the attack has nothing to go on)."""
    if torch.equal(_train(x, y, NoiseKey.reproducible(3)), released):
        return "in"
    if torch.equal(_train(x[1:], y[1:], NoiseKey.reproducible(3)), released):
        return "out"
    return "?"


@pytest.mark.parametrize("world", ["in", "out"])
def test_replay_attack_decides_membership_only_in_the_research_mode(world):
    x, y = _data()
    xs, ys = (x, y) if world == "in" else (x[1:], y[1:])
    decided_research = [_replay_decides(_train(xs, ys, NoiseKey.reproducible(3)), x, y) for _ in range(3)]
    decided_secret = [_replay_decides(_train(xs, ys, None), x, y) for _ in range(3)]   # the default: a fresh secret
    assert decided_research == [world] * 3       # negative control: certainty at a claimed epsilon of 1
    assert decided_secret == ["?"] * 3           # no replay matches: the seed tells the adversary nothing


def test_every_private_trainer_draws_from_its_key():
    """Two trainers with different secrets draw different noise; the same key, the same noise."""
    from dpmech.dp_merf.trainer import DPMERFConfig, DPMERFTrainer
    from dpmech.label_dp.trainer import LabelDPConfig, LabelDPTrainer

    x = torch.rand(40, 1, 28, 28) * 2 - 1
    y = torch.arange(40) % 10
    cfg = LabelDPConfig(mechanism="rr", epsilon=0.5, epochs=1, batch_size=20, seed=1)
    k = NoiseKey.fresh()
    assert torch.equal(LabelDPTrainer(cfg, x, y, noise_key=k).labels, LabelDPTrainer(cfg, x, y, noise_key=k).labels)
    assert not torch.equal(LabelDPTrainer(cfg, x, y).labels, LabelDPTrainer(cfg, x, y).labels)
    m = DPMERFConfig(epsilon=1.0, n_features=50, epochs=1, steps_per_epoch=1, seed=1)
    assert not torch.equal(DPMERFTrainer(m, x, y).released, DPMERFTrainer(m, x, y).released)
    assert torch.equal(DPMERFTrainer(m, x, y, noise_key=k).released, DPMERFTrainer(m, x, y, noise_key=k).released)


def test_a_checkpoint_from_another_device_kind_is_refused_in_one_line():
    """Research mode (the only one whose checkpoints hold stream states since issue 48): a CUDA
    generator's state cannot continue a CPU stream (and a fresh stream could reuse noise): the
    trainer refuses, naming the field, instead of failing deep in torch. With a secret key there is
    no stream state to refuse (tests/test_checkpoint_replay.py)."""
    x, y = _data()
    torch.manual_seed(0)
    t = DPSGDTrainer(nn.Linear(16, 2), x, y, DPSGDConfig(epsilon=1.0, batch_size=16, epochs=1, seed=3),
                     noise_key=NoiseKey.reproducible(3))
    state = t.state_dict()
    state["noise_gen"] = torch.zeros(16, dtype=torch.uint8)     # the size of a CUDA (Philox) generator's state
    with pytest.raises(ValueError, match=r"checkpoint.noise_gen: saved by a generator on another kind of device"):
        t.load_state_dict(state)
