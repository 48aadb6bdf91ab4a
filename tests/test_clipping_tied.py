"""Book-keeping clipping of a parameter shared by several modules (issue 32, point 4;
dpmech/privacy/clipping.py, "Shared parameters").

Two modules sharing one Parameter passed ``check_model``, and bk added their per-layer squared
norms: the cross term 2 <g_u, g_v> of the two uses was lost, so a per-example gradient was clipped
to more than C (0.108 for C = 0.1 on the first model below). Now the uses of a shared parameter are
one unit. Every test: float64, bk's clipped sum and per-example norms against torch.func
per-example gradients of the tied model (clip and sum), and every clipped per-example norm <= C. The
negative control computes the per-layer rule of main on the same gradients and finds clipped norms
above C. The other engines: Opacus's flat per-sample gradients are exact, its ghost clipping refuses
tying.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
from dpmech.privacy.clipping import BookKeeper

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:Full backward hook is firing")]

C = 0.1


class TiedMLP(nn.Module):
    """Two linear layers sharing one weight (separate biases), applied one after the other."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class TiedPositions(nn.Module):
    """A weight shared by a linear layer on [B, L, d] sequences and one on [B, d] vectors, and a
    bias shared by two other layers whose weights are separate."""

    def __init__(self):
        super().__init__()
        self.seq, self.vec = nn.Linear(5, 5), nn.Linear(5, 5, bias=False)
        self.vec.weight = self.seq.weight
        self.p, self.q = nn.Linear(5, 4), nn.Linear(5, 4)
        self.q.bias = self.p.bias
        self.head = nn.Linear(4, 3)

    def forward(self, x):                       # x [B, 4, 5]
        h = torch.tanh(self.seq(x)).mean(1)     # [B, 5]
        v = torch.tanh(self.vec(h))
        return self.head(torch.tanh(self.p(h) + self.q(v)))


class TiedConv(nn.Module):
    """A 3x3 kernel (and its bias) shared by two convolutions of different stride and padding, and
    the affine parameters of two GroupNorms shared."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, stride=2)
        self.c2.weight, self.c2.bias = self.c1.weight, self.c1.bias
        self.g1, self.g2 = nn.GroupNorm(1, 3), nn.GroupNorm(1, 3)
        self.g2.weight, self.g2.bias = self.g1.weight, self.g1.bias
        self.head = nn.Linear(3 * 3 * 3, 3)

    def forward(self, x):                       # x [B, 3, 8, 8]
        h = torch.tanh(self.g1(self.c1(x)))     # [B, 3, 8, 8]
        h = torch.tanh(self.g2(self.c2(h)))     # [B, 3, 3, 3]
        return self.head(h.flatten(1))


MODELS = {"mlp": (TiedMLP, (6,)), "positions": (TiedPositions, (4, 5)), "conv": (TiedConv, (3, 8, 8))}


def _model(name: str, seed: int = 0) -> nn.Module:
    cls, _ = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls().double()
    if name == "conv":                          # GroupNorm's affine parameters away from (1, 0)
        with torch.no_grad():
            model.g1.weight.uniform_(0.5, 1.5)
            model.g1.bias.uniform_(-0.5, 0.5)
    return model


def _data(name: str, n: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *MODELS[name][1], generator=g, dtype=torch.float64) * 2
    return x, torch.randint(0, 3, (n,), generator=g)


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int = 1):
    """[B, P] per-example gradients of the (deduplicated) parameters by torch.func (tied weights
    tied in ``functional_call``); with k > 1, rows i, B + i, ... are one example (their losses summed)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    b = x.shape[0] // k

    def loss(ps, xi, yi):
        return F.cross_entropy(functional_call(model, ps, (xi,)), yi, reduction="sum")

    xs = x.reshape(k, b, *x.shape[1:]).transpose(0, 1)
    ys = y.reshape(k, b).transpose(0, 1)
    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    return torch.cat([g[name].reshape(b, -1) for name in params], 1)


def clip_and_sum(grads: torch.Tensor, c: float):
    norms = grads.norm(dim=1)
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    return (factors[:, None] * grads).sum(0), norms


def bk_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, c: float, prefer: str, k: int = 1):
    bk = BookKeeper(model, prefer=prefer, rows_per_example=k)
    for p in model.parameters():
        p.grad = None
    bk.enabled = True
    logits = model(x)
    bk.enabled = False
    norms = bk.clipped_sum(F.cross_entropy(logits, y, reduction="none").sum(), c)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])   # the same order as named_parameters
    routes = dict(bk.routes)
    bk.remove()
    return got, norms, routes


@pytest.mark.parametrize("prefer", ["ghost", "inst", "bmm", "bmm_w", "bmm_f", "mixed", "measured"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bk_clips_shared_parameters_exactly(name, prefer):
    model = _model(name)
    x, y = _data(name)
    grads = reference(model, x, y)
    want, norms = clip_and_sum(grads, C)
    got, bk_norms, routes = bk_step(model, x, y, C, prefer)
    torch.testing.assert_close(bk_norms, norms, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    factors = (C / (bk_norms + 1e-6)).clamp(max=1.0)
    assert float((factors * norms).max()) <= C          # every clipped per-example norm
    assert float(norms.min()) > C                        # ... and every example was clipped
    shared = {"mlp": "a.weight+b.weight", "positions": "seq.weight+vec.weight", "conv": "c1.weight+c2.weight"}[name]
    assert shared in routes, routes                      # the shared weight is one unit, routed


def test_two_rows_per_example_with_shared_parameters():
    """rows_per_example = 2 (dpal_sound's benign and adversarial rows, clipped together) with tying."""
    for name in MODELS:
        model = _model(name, seed=1)
        x, y = _data(name, n=20, seed=1)
        want, norms = clip_and_sum(reference(model, x, y, k=2), C)
        got, bk_norms, _ = bk_step(model, x, y, C, "mixed", k=2)
        torch.testing.assert_close(bk_norms, norms, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def _per_use_rule(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The per-example norms main's bk computed on TiedMLP: per-layer squared norms added, each use
    of the shared weight counted alone (an untied copy gives each use's gradient)."""
    untied = TiedMLP().double()
    untied.load_state_dict(model.state_dict())
    untied.b.weight = nn.Parameter(model.a.weight.detach().clone())
    return reference(untied, x, y).norm(dim=1)


def test_negative_control_the_per_layer_rule_clips_above_c():
    """What main did: the per-layer rule underestimates the norm of the summed gradient (the uses'
    gradients are aligned here), so the clipped per-example norm exceeds C for many examples."""
    model = _model("mlp")
    x, y = _data("mlp", n=64)
    true = reference(model, x, y).norm(dim=1)
    per_layer = _per_use_rule(model, x, y)
    clipped = (C / (per_layer + 1e-6)).clamp(max=1.0) * true
    assert float(clipped.max()) > 1.05 * C, float(clipped.max())
    assert int((clipped > 1.01 * C).sum()) >= 10
    _, bk_norms, _ = bk_step(model, x, y, C, "mixed")
    assert float(((C / (bk_norms + 1e-6)).clamp(max=1.0) * true).max()) <= C


def test_trainer_engines_on_a_tied_model():
    """Through DPSGDTrainer (no noise): bk and flat give the reference clipped sum; Opacus's ghost
    clipping refuses tying at the first step."""
    x, y = _data("mlp", n=32)
    want, _ = clip_and_sum(reference(_model("mlp"), x, y), C)
    for clipping in ("bk", "flat"):
        tr = DPSGDTrainer(_model("mlp"), x, y, DPSGDConfig(epsilon=None, noise_multiplier=0.0, max_grad_norm=C,
                                                            batch_size=32, clipping=clipping))
        tr.model.train()
        if tr.gsm is not None:
            tr.gsm.enable_hooks()
        tr.forward_backward(x, y)
        if clipping == "flat":
            tr.optimizer.pre_step()                     # Opacus clips, sums, adds (zero) noise and scales
        got = torch.cat([p.grad.flatten() for p in tr.model.parameters()]) * 32
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    tr = DPSGDTrainer(_model("mlp"), x, y, DPSGDConfig(epsilon=None, noise_multiplier=0.0, max_grad_norm=C,
                                                        batch_size=32, clipping="ghost"))
    with pytest.raises(NotImplementedError, match="Parameter tying is not supported with Ghost Clipping"):
        tr._step(torch.arange(32))


def test_pinned_route_of_a_shared_weight_and_unknown_names():
    model = _model("conv")
    x, y = _data("conv")
    want, _ = clip_and_sum(reference(model, x, y), C)
    bk = BookKeeper(model, routes={"c1.weight+c2.weight": "ghost"})
    bk.enabled = True
    logits = model(x)
    bk.enabled = False
    bk.clipped_sum(F.cross_entropy(logits, y, reduction="none").sum(), C)
    assert bk.routes["c1.weight+c2.weight"] == "ghost"
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), want, rtol=1e-9,
                               atol=1e-12)
    with pytest.raises(ValueError, match="^routes: 'c2' shares a parameter .* 'c1.weight\\+c2.weight'"):
        BookKeeper(model, routes={"c2": "ghost"})
    with pytest.raises(ValueError, match="^routes: 'c3' is not a parameterised layer"):
        BookKeeper(model, routes={"c3": "ghost"})
