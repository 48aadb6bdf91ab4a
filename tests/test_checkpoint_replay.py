"""A checkpoint is as good as the secret (issue 48 §3; docs/threat_model.md, "Checkpoints").

The review's attack: from one checkpoint (after epoch 1 of 3) and every training example but one,
an adversary without the key loads the checkpoint into trainers on both neighbouring datasets,
trains on, and compares with the released weights. When a checkpoint held the sampling and noise
generators' states, the true world's replay was bit-identical to the release: membership was decided
with certainty at a claimed epsilon of 1. Since issue 48 the draws of step t come from
HMAC(key, stream, t) (:class:`dpmech.privacy.secret.StepStream`) and a secret-key checkpoint holds
the step, not a generator state: the attack decides nothing, while the owner, with the key, resumes
bit for bit. Negative controls: the research mode (public seed, states checkpointed) and the old
behaviour (a running stream whose state the checkpoint holds) both let the attack decide.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, stream_seed
from dpmech.privacy.secret import NoiseKey, StepStream

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ helpers
def _saved(state: dict) -> dict:
    """``state`` through torch.save / torch.load(weights_only=True), as a checkpoint file is read."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _streams(obj) -> list[StepStream]:
    return [s for s in vars(obj).values() if isinstance(s, StepStream)]


def assert_no_keyed_state(state: dict, streams: list[StepStream], steps: int) -> None:
    """The checkpoint's bytes hold no seed of a keyed stream: neither a per-step seed of steps
    0 .. ``steps`` nor the stream's whole-run seed (a CPU generator's state holds its seed, so a
    stored state of a keyed stream would show here)."""
    blob = _bytes(state)
    assert streams
    for s in streams:
        seeds = [s.key.step_seed(s.name, t) for t in range(steps + 1)] + [s.key.stream_seed(s.name, 0)]
        for seed in seeds:
            assert seed.to_bytes(8, "little") not in blob, (s.name, seed)


class OldBehaviour:
    """The code before issue 48, simulated: a keyed stream is one running generator seeded by
    HMAC(key, stream name), whose state the checkpoint holds (what the review attacked)."""

    def __enter__(self):
        self._mp = pytest.MonkeyPatch()
        self._mp.setattr(StepStream, "keyed", property(lambda self: False))
        return self

    def __exit__(self, *exc):
        self._mp.undo()


# ------------------------------------------------------------------ the stream
def test_a_step_stream_draws_a_function_of_key_stream_and_step():
    key = NoiseKey.fresh()
    a, b = key.step_stream("dpsgd.noise", 0), key.step_stream("dpsgd.noise", 0)
    for t in range(5):                                    # a's history: steps 0..4, several draws each
        torch.rand(3, generator=a.at(t))
        torch.rand(3, generator=a.at(t))
    assert torch.equal(torch.rand(8, generator=a.at(7)), torch.rand(8, generator=b.at(7)))   # no history
    first = torch.rand(4, generator=b.at(9))
    assert not torch.equal(first, torch.rand(4, generator=b.at(9)))   # the same step draws on
    assert torch.equal(first, torch.rand(4, generator=key.step_stream("dpsgd.noise", 0).at(9)))
    assert not torch.equal(torch.rand(4, generator=key.step_stream("dpsgd.noise", 0).at(10)), first)
    assert not torch.equal(torch.rand(4, generator=key.step_stream("dpsgd.sampling", 0).at(9)), first)
    assert not torch.equal(torch.rand(4, generator=NoiseKey.fresh().step_stream("dpsgd.noise", 0).at(9)), first)
    assert a.state_dict() is None and a.keyed
    seeds = {key.step_seed("s", t) for t in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2 ** 63 for s in seeds) and max(seeds) >= 2 ** 61
    assert key.step_seed("ab", 1) != key.step_seed("a", 11) and key.step_seed("a:1", 1) != key.step_seed("a", 11)
    with pytest.raises(ValueError, match="step"):
        key.step_seed("s", -1)


def test_the_research_mode_stream_is_the_earlier_running_generator():
    r = NoiseKey.reproducible(5)
    s = r.step_stream("dpsgd.noise", stream_seed(5, 2))
    ref = torch.Generator().manual_seed(stream_seed(5, 2))
    for t in range(4):                                    # the step does not matter: one running stream
        assert torch.equal(torch.rand(6, generator=s.at(t)), torch.rand(6, generator=ref))
    assert not s.keyed and torch.equal(s.state_dict(), ref.get_state())
    with pytest.raises(ValueError, match="research mode"):
        r.step_seed("s", 0)
    with pytest.raises(ValueError, match=r"checkpoint.noise_gen: missing"):
        s.load_state_dict(None, "noise_gen")


# ------------------------------------------------------------------ DP-SGD: the review's attack
N_STEPS_EPOCH, EPOCHS = 4, 3


def _data(n: int = 64, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long()
    x[0] = 8.0                                     # the target: an outlier, so its presence matters
    y[0] = 1
    return x, y


def _trainer(x, y, key, clipping: str = "bk") -> DPSGDTrainer:
    torch.manual_seed(0)                           # public initialisation
    model = nn.Linear(x.shape[1], 2)
    cfg = DPSGDConfig(epsilon=1.0, delta=1e-5, max_grad_norm=1.0, batch_size=16, epochs=EPOCHS, lr=0.5,
                      momentum=0.9, clipping=clipping, seed=3)
    return DPSGDTrainer(model, x, y, cfg, noise_key=key, plan_size=64)


def _weights(t) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in t.model.parameters()])


def _owner_run(x, y, key, clipping="bk"):
    """The owner's run: (the checkpoint after epoch 1, the released weights after epoch 3)."""
    t = _trainer(x, y, key, clipping)
    t.train_epoch()
    ckpt = _saved(t.state_dict())
    t.fit()
    return ckpt, _weights(t)


def _continue(x, y, ckpt, key, clipping="bk") -> torch.Tensor:
    t = _trainer(x, y, key, clipping)
    t.load_state_dict(ckpt)
    t.fit()
    return _weights(t)


def _attack(ckpt, released, x, y, key_factory, clipping="bk") -> str:
    """The adversary: the checkpoint on D and on D' (without the target) with a key of its own; 'in' /
    'out' when a continuation equals the release, '?' when neither does."""
    if torch.equal(_continue(x, y, ckpt, key_factory(), clipping), released):
        return "in"
    if torch.equal(_continue(x[1:], y[1:], ckpt, key_factory(), clipping), released):
        return "out"
    return "?"


def _worlds(world, x, y):
    return (x, y) if world == "in" else (x[1:], y[1:])


@pytest.mark.parametrize("world", ["in", "out"])
def test_the_checkpoint_attack_decides_nothing_and_the_owner_resumes_bit_for_bit(world):
    x, y = _data()
    xs, ys = _worlds(world, x, y)
    for clipping in ("bk", "ghost"):               # noise by the trainer (bk) and by Opacus's optimizer
        owner = NoiseKey.fresh()
        ckpt, released = _owner_run(xs, ys, owner, clipping)
        assert ckpt["steps"] == N_STEPS_EPOCH and "sample_gen" not in ckpt and "noise_gen" not in ckpt
        # the owner, with the key, continues bit for bit
        assert torch.equal(_continue(xs, ys, ckpt, owner, clipping), released)
        # the adversary (any other key, or the research mode's) decides nothing
        assert _attack(ckpt, released, x, y, NoiseKey.fresh, clipping) == "?"


def test_a_research_mode_trainer_refuses_a_secret_checkpoint_in_one_line():
    x, y = _data()
    ckpt, _ = _owner_run(x, y, NoiseKey.fresh())
    with pytest.raises(ValueError, match=r"checkpoint.sample_gen: missing; .*secret key"):
        _continue(x, y, ckpt, NoiseKey.reproducible(3))


@pytest.mark.parametrize("world", ["in", "out"])
def test_negative_controls_the_attack_decides_with_a_public_seed_or_the_old_checkpoints(world):
    """Research mode: the checkpoint holds the public streams' states, and the attack decides, as
    it decides without a checkpoint (tests/test_noise_secret.py). The old behaviour (a keyed running
    stream whose state the checkpoint holds): the attack decides with any key of its own."""
    x, y = _data()
    xs, ys = _worlds(world, x, y)
    ckpt, released = _owner_run(xs, ys, NoiseKey.reproducible(3))
    assert "sample_gen" in ckpt and "noise_gen" in ckpt
    assert _attack(ckpt, released, x, y, lambda: NoiseKey.reproducible(99)) == world
    with OldBehaviour():
        ckpt, released = _owner_run(xs, ys, NoiseKey.fresh())
        assert "sample_gen" in ckpt and "noise_gen" in ckpt
        assert _attack(ckpt, released, x, y, NoiseKey.fresh) == world


def test_a_secret_checkpoint_holds_no_seed_of_a_keyed_stream():
    x, y = _data()
    t = _trainer(x, y, NoiseKey.fresh())
    t.train_epoch()
    state = t.state_dict()
    assert t.sample_stream.keyed and t.noise_stream.keyed
    assert_no_keyed_state(state, [t.sample_stream, t.noise_stream], t.steps + 2)
    assert set(state) >= {"model", "optimizer", "ledger", "steps", "epoch", "augment_gen"}   # augment: public
    with OldBehaviour():                           # the scan sees a stored keyed state (its negative control)
        t = _trainer(x, y, NoiseKey.fresh())
        t.train_epoch()
        with pytest.raises(AssertionError):
            assert_no_keyed_state(t.state_dict(), [t.sample_stream, t.noise_stream], t.steps + 2)


def test_a_checkpoint_written_before_issue_48_loads_and_its_generator_states_are_ignored():
    """A secret-key checkpoint of the old code held ``sample_gen`` and ``noise_gen``: it loads, the
    states are not read (the steps to come draw from the key and the step), so the continuation is
    the new code's uninterrupted run."""
    x, y = _data()
    key = NoiseKey.fresh()
    ckpt, released = _owner_run(x, y, key)
    old = dict(ckpt, sample_gen=torch.Generator().manual_seed(1).get_state(),
               noise_gen=torch.Generator().manual_seed(2).get_state())
    assert torch.equal(_continue(x, y, old, key), released)
