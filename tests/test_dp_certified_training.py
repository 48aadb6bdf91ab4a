"""DP-SGD for certification (dpmech/dpsgd/certified.py): one example's k noise augmentations and its
consistency regulariser are ONE clipped contribution, on every clipping route.

The clipped sum S of a step is read from the update (SGD, lr 1, no momentum, noise multiplier 0:
p <- p - S / B), so the test sees what the engine applied, not an internal value. It is compared
with a float64 torch.func reference (each example's gradient computed from its own k rows alone,
clipped to C, summed), and removing any one example must move S by at most C. Negative control: a
planted regulariser that ties each example to its neighbour in the batch (mixing two examples)
moves S by far more than C and departs from the per-example reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from dpmech.dpsgd.certified import DPCertConfig, DPCertTrainer, consistency_loss, per_example_objective, smoothadv
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
from dpmech.privacy.secret import NoiseKey

B, K, C, SIGMA, LAMBDA, ETA = 6, 3, 0.05, 0.5, 4.0, 0.5
ADV_RADIUS, ADV_STEPS = 0.5, 2


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, stride=2), nn.Tanh(), nn.GroupNorm(1, 3), nn.Flatten(),
                         nn.Linear(27, 4)).double()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(B, 1, 8, 8, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 4, (B,), generator=g)
    z = torch.randn(K, B, 1, 8, 8, generator=g, dtype=torch.float64) * SIGMA
    return x, y, z


def config(clipping: str, **kw) -> DPCertConfig:
    base = dict(epsilon=None, noise_multiplier=0.0, max_grad_norm=C, batch_size=B, epochs=1, lr=1.0, momentum=0.0,
                optimizer="sgd", clipping=clipping, noise_augmentation_sigma=SIGMA, augment_multiplicity=K,
                consistency_weight=LAMBDA, consistency_eta=ETA, seed=0)
    base.update(kw)
    return DPCertConfig(**base)


class MixingTrainer(DPCertTrainer):
    """The negative control: example i's loss also fits its augmentations to the label of the NEXT
    example in the batch (i + 1 mod B), a consistency target taken from another example: a
    regulariser that mixes two examples."""

    def objective(self, logits, yb):
        k, b, n_cls = logits.shape
        partner = yb.roll(-1, 0).repeat(k)                     # row (j, i): example i + 1's label
        mix = F.cross_entropy(logits.reshape(k * b, n_cls), partner, reduction="none").reshape(k, b).mean(0)
        return super().objective(logits, yb) + 20.0 * mix


def clipped_sum(route: str, x, y, z, keep, trainer_cls=DPCertTrainer, **kw) -> torch.Tensor:
    """S = sum_i clip_C(g_i) over the examples ``keep`` with their augmentation noise z[:, keep],
    read from one real step of the engine (``route``: flat, or bk with that BookKeeper route)."""
    model = small_net()
    cfg = config("flat" if route == "flat" else "bk", **kw)
    tr = trainer_cls(model, x, y, cfg, noise_key=NoiseKey.reproducible(0))
    if route != "flat":
        tr.bookkeeper.prefer = route        # the trainer's own BookKeeper, forced onto one route
    keep = torch.as_tensor(keep)
    tr.augmentation_noise = lambda xb: z[:, keep]
    before = torch.cat([p.detach().flatten().clone() for p in tr.model.parameters()])
    tr._step(keep)
    after = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    tr.close()
    return (before - after) * B        # lr 1: p <- p - S / B


def reference(x, y, z, keep, weight=LAMBDA, c_max=C, adv=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.func in float64: g_i = grad of l_i from example i's own k rows; sum_i min(1, C/||g_i||) g_i
    (Opacus's factor C / (||g_i|| + 1e-6)); also the norms ||g_i||. ``adv`` > 0: each example's
    SmoothAdv input computed from that example ALONE (a batch of one), then held fixed."""
    model = small_net()
    params = {n: p.detach() for n, p in model.named_parameters()}
    if adv > 0:
        x = x.clone()
        for i in keep:
            x[i:i + 1] = smoothadv(model, x[i:i + 1], y[i:i + 1], z[:, i:i + 1], adv, ADV_STEPS)

    def loss_i(prm, xi, zi, yi):
        logits = functional_call(model, prm, (xi.unsqueeze(0) + zi,))         # [k, K]
        return per_example_objective(logits.unsqueeze(1), yi.unsqueeze(0), weight, ETA)[0]

    keep = torch.as_tensor(keep)
    g = vmap(grad(loss_i), in_dims=(None, 0, 1, 0))(params, x[keep], z[:, keep], y[keep])
    flat = torch.cat([g[n].reshape(len(keep), -1) for n in params], 1)
    norms = flat.norm(dim=1)
    c = (c_max / (norms + 1e-6)).clamp(max=1.0)
    return (c[:, None] * flat).sum(0), norms


ROUTES = ["ghost", "inst", "bmm_f", "grouped", "flat"]


@pytest.mark.parametrize("route", ROUTES)
def test_k_augmentations_and_regulariser_are_one_clipped_contribution(route, data):
    x, y, z = data
    everyone = list(range(B))
    ref, norms = reference(x, y, z, everyone)
    assert (norms > 2 * C).all()                     # every example clipped: the bound is attained
    s = clipped_sum(route, x, y, z, everyone)
    assert torch.allclose(s, ref, rtol=1e-8, atol=1e-12), (s - ref).norm()
    moves = []
    for i in everyone:
        rest = [j for j in everyone if j != i]
        moves.append(float((s - clipped_sum(route, x, y, z, rest)).norm()) / C)
    assert max(moves) <= 1 + 1e-9, moves
    assert min(moves) > 1 - 1e-6                     # each removal moves S by exactly C (clipped examples)


@pytest.mark.parametrize("route", ["ghost", "bmm_f", "flat"])
def test_smoothadv_inputs_and_their_loss_are_one_clipped_contribution(route, data):
    """SmoothAdv on top of k augmentations and the regulariser: the attacked input of each example
    depends on that example alone (the reference attacks it in a batch of one), its loss is clipped
    once, and every removal moves the clipped sum by exactly C."""
    x, y, z = data
    everyone = list(range(B))
    ref, norms = reference(x, y, z, everyone, adv=ADV_RADIUS)
    plain, _ = reference(x, y, z, everyone)
    assert (norms > 2 * C).all() and (ref - plain).norm() > 0.1 * C      # the attack changed the step
    kw = dict(smoothadv_radius=ADV_RADIUS, smoothadv_steps=ADV_STEPS)
    s = clipped_sum(route, x, y, z, everyone, **kw)
    assert torch.allclose(s, ref, rtol=1e-7, atol=1e-11), (s - ref).norm()
    moves = [float((s - clipped_sum(route, x, y, z, [j for j in everyone if j != i], **kw)).norm()) / C
             for i in everyone]
    assert max(moves) <= 1 + 1e-9 and min(moves) > 1 - 1e-6, moves


def test_smoothadv_stays_in_the_ball_and_the_domain_and_lowers_the_smoothed_probability():
    model = small_net()
    g = torch.Generator().manual_seed(7)
    x = torch.rand(5, 1, 8, 8, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 4, (5,), generator=g)
    z = torch.randn(3, 5, 1, 8, 8, generator=g, dtype=torch.float64) * SIGMA
    xa = smoothadv(model, x, y, z, 0.5, 3)
    assert ((xa - x).flatten(1).norm(dim=1) <= 0.5 + 1e-9).all() and xa.abs().max() <= 1

    def p_y(inp):
        with torch.no_grad():
            logits = model((inp.unsqueeze(0) + z).reshape(15, 1, 8, 8)).reshape(3, 5, -1)
        return torch.softmax(logits, -1)[:, torch.arange(5), y].mean(0)
    assert (p_y(xa) < p_y(x)).all()


@pytest.mark.parametrize("route", ["ghost", "bmm_f", "flat"])
def test_unclipped_sum_is_the_sum_of_the_per_example_gradients(route, data):
    """C far above every norm: nothing is clipped, so a wrong scale of g_i (e.g. k g_i) would show
    (with every example clipped, clip(k g_i) = clip(g_i) hides it)."""
    x, y, z = data
    everyone = list(range(B))
    ref, norms = reference(x, y, z, everyone, c_max=1e3)
    assert (norms < 1e3 / 10).all()
    s = clipped_sum(route, x, y, z, everyone, max_grad_norm=1e3)
    assert torch.allclose(s, ref, rtol=1e-8, atol=1e-12), (s - ref).norm()


@pytest.mark.parametrize("route", ["ghost", "flat"])
def test_negative_control_a_regulariser_mixing_examples_is_caught(route, data):
    x, y, z = data
    everyone = list(range(B))
    s = clipped_sum(route, x, y, z, everyone, trainer_cls=MixingTrainer)
    moves = [float((s - clipped_sum(route, x, y, z, [j for j in everyone if j != i],
                                    trainer_cls=MixingTrainer)).norm()) / C for i in everyone]
    assert max(moves) > 1.5, moves                   # sensitivity above C: caught (1.83 C measured)
    ref, _ = reference(x, y, z, everyone)
    assert (s - ref).norm() > 0.1 * C                # and not the per-example clip-and-sum


def test_consistency_loss_is_the_papers_formula():
    """lambda (1/k) sum_j KL(p_hat || p_j) + eta H(p_hat), written out with explicit loops."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    got = consistency_loss(logits, 2.0, 0.3)
    for i in range(5):
        ps = [torch.softmax(logits[j, i], 0) for j in range(3)]
        ph = sum(ps) / 3
        kl = sum(float((ph * (ph / p).log()).sum()) for p in ps) / 3
        h = -float((ph * ph.log()).sum())
        assert abs(float(got[i]) - (2.0 * kl + 0.3 * h)) < 1e-12
    # identical augmentations: KL 0, only the entropy remains
    same = logits[:1].expand(3, 5, 4)
    p = torch.softmax(same[0], -1)
    assert torch.allclose(consistency_loss(same, 2.0, 0.3), 0.3 * -(p * p.log()).sum(-1))


def test_objective_row_i_depends_on_example_i_only():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 10, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 10, (6,), generator=g)
    out = per_example_objective(logits, y, 5.0, 0.5)
    (jac,) = torch.autograd.grad(out[2], logits)
    assert jac[:, 2].abs().sum() > 0 and jac[:, [0, 1, 3, 4, 5]].abs().max() == 0


def test_multiplicity_one_without_regulariser_is_plain_dp_sgd():
    """k = 1, lambda = 0: the same steps as DPSGDTrainer (same draws, same update) to float rounding."""
    g = torch.Generator().manual_seed(4)
    x = (torch.rand(64, 1, 8, 8, generator=g) * 2 - 1)
    y = torch.randint(0, 4, (64,), generator=g)
    common = dict(epsilon=None, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=16, epochs=1, lr=0.1,
                  noise_augmentation_sigma=0.5, seed=3)
    a = DPSGDTrainer(small_net().float(), x, y, DPSGDConfig(**common), noise_key=NoiseKey.reproducible(3))
    b = DPCertTrainer(small_net().float(), x, y, DPCertConfig(**common), noise_key=NoiseKey.reproducible(3))
    for _ in range(3):
        a.train_step(), b.train_step()
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_training_runs_and_checkpoints_on_bk():
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(64, 1, 8, 8, generator=g) * 2 - 1)
    y = torch.randint(0, 4, (64,), generator=g)
    cfg = DPCertConfig(epsilon=None, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=16, epochs=2, lr=0.1,
                       noise_augmentation_sigma=0.5, augment_multiplicity=2, consistency_weight=1.0, seed=0)
    a = DPCertTrainer(small_net().float(), x, y, cfg, noise_key=NoiseKey.reproducible(0))
    a.train_epoch()
    state = a.state_dict()
    b = DPCertTrainer(small_net().float(), x, y, copy.deepcopy(cfg), noise_key=NoiseKey.reproducible(0))
    b.load_state_dict(state)
    a.train_epoch(), b.train_epoch()
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5)
    assert a.privacy()["steps"] == 8


@pytest.mark.parametrize("kw, message", [
    (dict(augment_multiplicity=0), "augment_multiplicity"),
    (dict(augment_multiplicity=2, noise_augmentation_sigma=0.0, consistency_weight=0.0), "augment_multiplicity"),
    (dict(augment_multiplicity=1), "consistency_weight"),
    (dict(consistency_weight=-1.0), "consistency_weight"),
    (dict(consistency_eta=-0.1), "consistency_eta"),
    (dict(clipping="ghost"), "clipping"),
    (dict(augment_multiplicity=1, consistency_weight=0.0, clipping="ghost"), "clipping"),
    (dict(smoothadv_radius=-0.1), "smoothadv_radius"),
    (dict(smoothadv_radius=0.5, smoothadv_steps=0), "smoothadv_steps"),
    (dict(smoothadv_radius=0.5, noise_augmentation_sigma=0.0, augment_multiplicity=1, consistency_weight=0.0),
     "smoothadv_radius"),
])
def test_bad_settings_fail_with_one_line_naming_the_key(kw, message):
    base = dict(epsilon=1.0, noise_augmentation_sigma=0.5, augment_multiplicity=2, consistency_weight=1.0)
    base.update(kw)
    with pytest.raises(ValueError) as err:
        DPCertConfig(**base)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- trial keys (trainables/dpsgd.py)

@pytest.mark.parametrize("kw, key", [
    (dict(augment_multiplicity=2), "augment_multiplicity"),                       # no noise_augmentation_sigma
    (dict(consistency_weight=1.0, noise_augmentation_sigma=0.5), "consistency_weight"),   # k = 1
    (dict(augment_multiplicity=2, noise_augmentation_sigma=0.5, clipping="ghost"), "clipping"),
    (dict(smoothadv_radius=0.5), "smoothadv_radius"),                             # no noise_augmentation_sigma
    (dict(augment_multiplicity=2, noise_augmentation_sigma=0.5, audit={"mode": "whitebox", "canaries": 100}),
     "audit.canary"),
])
def test_trial_keys_refuse_bad_combinations_naming_the_key(kw, key):
    from pydantic import ValidationError

    from trainables.dpsgd import DPSGDTrialConfig

    with pytest.raises(ValidationError) as err:
        DPSGDTrialConfig(train_size=2000, **kw)
    assert f"Value error, {key}:" in str(err.value)


def test_trial_keys_build_the_certified_trainer():
    from trainables.dpsgd import DPSGDMechanism, DPSGDTrialConfig

    g = torch.Generator().manual_seed(6)
    x = torch.rand(64, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, 10, (64,), generator=g)
    cfg = DPSGDTrialConfig(train_size=64, batch_size=16, model="tb_cnn", noise_augmentation_sigma=1.0,
                           augment_multiplicity=3, consistency_weight=2.0, consistency_eta=0.25,
                           smoothadv_radius=0.5, smoothadv_steps=2)
    mech = DPSGDMechanism(cfg, x, y, torch.device("cpu"))
    assert isinstance(mech.trainer, DPCertTrainer)
    assert mech.trainer.bookkeeper.rows_per_example == 3
    c = mech.trainer.config
    assert (c.consistency_weight, c.consistency_eta, c.smoothadv_radius, c.smoothadv_steps) == (2.0, 0.25, 0.5, 2)
    mech.trainer.train_step()
    plain = DPSGDMechanism(DPSGDTrialConfig(train_size=64, batch_size=16), x, y, torch.device("cpu"))
    assert type(plain.trainer) is DPSGDTrainer
