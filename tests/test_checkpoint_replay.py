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


# ------------------------------------------------------------------ label DP (LP-2ST's second release)
def _label_data(n: int = 60):
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (n,), generator=g)


def _label_trainer(x, y, key):
    from dpmech.label_dp.trainer import LabelDPConfig, LabelDPTrainer

    cfg = LabelDPConfig(mechanism="lp2st", epsilon=1.0, epochs=2, stage1_epochs=1, stage1_fraction=0.4,
                        batch_size=20, seed=2)
    return LabelDPTrainer(cfg, x, y, noise_key=key)


def _label_neighbours():
    """(x, y) and (x, y') differing in the label of one example of part 2 (released after the checkpoint)."""
    x, y = _label_data()
    part1 = set(_label_trainer(x, y, NoiseKey.fresh()).part1.tolist())
    target = next(i for i in range(len(y)) if i not in part1)
    y2 = y.clone()
    y2[target] = (y[target] + 1) % 10
    return x, y, y2


def _label_run(x, y, key):
    t = _label_trainer(x, y, key)
    t.train_epoch()                                # stage 1; part 2 not released yet
    ckpt = _saved(t.state_dict())
    t.train_epoch()                                # stage 2: part 2's randomized response, then training
    return ckpt, _weights(t)


def _label_continue(x, y, ckpt, key) -> torch.Tensor:
    t = _label_trainer(x, y, key)
    t.load_state_dict(ckpt)
    t.train_epoch()
    return _weights(t)


def _label_replays(ckpt, released, x, y, y2, key_factory) -> tuple[bool, bool]:
    """Whether the continuation on the true labels, and on the neighbouring labels, equals the release."""
    return (torch.equal(_label_continue(x, y, ckpt, key_factory()), released),
            torch.equal(_label_continue(x, y2, ckpt, key_factory()), released))


def test_label_dp_the_checkpoint_attack_on_lp2st_replays_nothing_without_the_key():
    """LP-2ST releases part 2's labels by randomized response after a stage-1 checkpoint: with the
    stream's state in the checkpoint (research mode, or the old behaviour), a continuation on the
    true labels with any key is the release bit for bit (the attacker decides whenever the other
    world's differs); with the secret key neither world's continuation is, and the owner's is."""
    x, y, y2 = _label_neighbours()
    # fixed keys (the standards' fixed seeds): with some owners' keys the stage-1 prior is so sharp that
    # part 2's release is its top label whatever the key and the label (then both worlds replay it and
    # nothing is decided either); this owner's release depends on the key, so the test can fail
    owner = NoiseKey(bytes([3]) * 32)
    ckpt, released = _label_run(x, y, owner)
    assert ckpt["stage"] == 1 and "label_gen" not in ckpt
    assert torch.equal(_label_continue(x, y, ckpt, owner), released)
    assert _label_replays(ckpt, released, x, y, y2, lambda: NoiseKey(bytes([103]) * 32)) == (False, False)
    # negative controls
    ckpt, released = _label_run(x, y, NoiseKey.reproducible(2))
    assert _label_replays(ckpt, released, x, y, y2, lambda: NoiseKey.reproducible(7))[0]
    with OldBehaviour():
        ckpt, released = _label_run(x, y, NoiseKey.fresh())
        assert "label_gen" in ckpt
        assert _label_replays(ckpt, released, x, y, y2, NoiseKey.fresh)[0]


def test_label_dp_pro_checkpoint_holds_the_pass_not_the_noise_stream():
    from dpmech.label_dp.cluster_prior import PrivateLabels
    from dpmech.label_dp.labeldp_pro import LabelDPProConfig, LabelDPProRun

    g = torch.Generator().manual_seed(0)
    feats, y = torch.randn(120, 8, generator=g), torch.randint(0, 4, (120,), generator=g)
    cfg = LabelDPProConfig(epochs=3, batch_size=40, proj_images=8)

    def run(key):
        return LabelDPProRun(feats, PrivateLabels(y, 4), 1.0, cfg, seed=0, noise_key=key)

    owner = NoiseKey.fresh()
    a = run(owner)
    a.train_epoch()
    st = _saved(a.state_dict())
    assert "noise" not in st
    assert_no_keyed_state(st, [a.noise_stream], cfg.epochs)
    a.train_epoch()
    a.train_epoch()
    b, c = run(owner), run(NoiseKey.fresh())
    for r in (b, c):
        r.load_state_dict(st)
        r.train_epoch()
        r.train_epoch()
    assert torch.equal(b.w, a.w) and not torch.equal(c.w, a.w)


# ------------------------------------------------------------------ DPGAN
def _gan_data(n: int = 80):
    g = torch.Generator().manual_seed(3)
    x = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, 10, (n,), generator=g)
    x[0] = 1.0                                     # the target: an outlier image
    return x, y


def _gan_trainer(x, y, key):
    from dpmech.dpgan.config import DPGANConfig
    from dpmech.dpgan.trainer import DPGANTrainer

    cfg = DPGANConfig(epsilon=5.0, delta=1e-5, epochs=3, batch_size=20, hidden=8, latent_dim=4, seed=1)
    return DPGANTrainer(cfg, x, y, plan_size=80, noise_key=key)


def _gan_run(x, y, key):
    t = _gan_trainer(x, y, key)
    t.train_epoch()
    ckpt = _saved(t.state_dict())
    while t.epoch < t.config.epochs:
        t.train_epoch()
    return ckpt, _weights(t)


def _gan_continue(x, y, ckpt, key):
    t = _gan_trainer(x, y, key)
    t.load_state_dict(dict(ckpt, n=t.n))          # the adversary edits the size the trainer checks
    while t.epoch < t.config.epochs:
        t.train_epoch()
    return _weights(t)


def _gan_attack(ckpt, released, x, y, key_factory) -> str:
    if torch.equal(_gan_continue(x, y, ckpt, key_factory()), released):
        return "in"
    if torch.equal(_gan_continue(x[1:], y[1:], ckpt, key_factory()), released):
        return "out"
    return "?"


@pytest.mark.parametrize("world", ["in", "out"])
def test_dpgan_the_checkpoint_attack_decides_nothing_and_the_owner_resumes(world):
    x, y = _gan_data()
    xs, ys = _worlds(world, x, y)
    owner = NoiseKey.fresh()
    ckpt, released = _gan_run(xs, ys, owner)
    assert "sample_gen" not in ckpt and "noise_gen" not in ckpt and "latent_gen" in ckpt   # latents: public
    t = _gan_trainer(xs, ys, owner)
    assert_no_keyed_state(ckpt, [t.sample_stream, t.noise_stream], 3 * t.steps_per_epoch)
    assert torch.equal(_gan_continue(xs, ys, ckpt, owner), released)
    assert _gan_attack(ckpt, released, x, y, NoiseKey.fresh) == "?"
    with OldBehaviour():                           # negative control: the old checkpoints decide
        ckpt, released = _gan_run(xs, ys, NoiseKey.fresh())
        assert _gan_attack(ckpt, released, x, y, NoiseKey.fresh) == world


# ------------------------------------------------------------------ once-drawn noise (DPAL, AdLM)
def test_adlm_checkpoint_holds_no_training_noise_and_refuses_another_key():
    """AdLM's chi_3 (training only, never released) is redrawn from the key, not stored; the key's
    fingerprint refuses another key, which would train on a second draw of chi_3."""
    from dpmech.adlm.config import AdLMConfig
    from dpmech.adlm.trainer import AdLMTrainer

    g = torch.Generator().manual_seed(4)
    x, y = torch.rand(200, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (200,), generator=g)
    pub = (torch.rand(50, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (50,), generator=g))
    cfg = AdLMConfig(epsilon=5.0, batch_size=50, lr=1e-3, epochs=2, relevance_epochs=0, seed=11)
    owner = NoiseKey.fresh()
    a = AdLMTrainer(cfg, x, y, relevance_data=pub, noise_key=owner)
    a.train_epoch()
    state = _saved(a.state_dict())
    assert not {"chi3", "noise_gen", "relevance_gen"} & set(state)
    assert_no_keyed_state(state, [a.noise_stream, a.relevance_stream], 0)
    assert a.chi3.detach().cpu().numpy().tobytes() not in _bytes(state)
    a.train_epoch()
    b = AdLMTrainer(cfg, x, y, relevance_data=pub, noise_key=owner)
    b.load_state_dict(state)
    b.train_epoch()
    assert torch.equal(_weights(b), _weights(a))
    with pytest.raises(ValueError, match=r"checkpoint.noise_key_check: .*another noise key"):
        AdLMTrainer(cfg, x, y, relevance_data=pub, noise_key=NoiseKey.fresh()).load_state_dict(state)
    with pytest.raises(ValueError, match=r"checkpoint.chi3: missing"):
        AdLMTrainer(cfg, x, y, relevance_data=pub, noise_key=NoiseKey.reproducible(11)).load_state_dict(state)
    # a checkpoint written before issue 48 (chi_3 stored): its chi_3 goes on, whatever the key
    old = dict(state, chi3=a.chi3.detach().cpu() + 1.0)
    c = AdLMTrainer(cfg, x, y, relevance_data=pub, noise_key=NoiseKey.fresh())
    c.load_state_dict(old)
    assert torch.equal(c.chi3.cpu(), a.chi3.detach().cpu() + 1.0)
