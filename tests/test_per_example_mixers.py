"""Example-mixing models that passed the per-example check (issue 48 §4 and §5, issue 50 §3;
dpmech/privacy/per_example.py).

An independent review passed five example-mixing models through the check that then trained on
the bk, ghost and flat clipping routes: one that mixes only with gradients enabled (the check ran
under ``no_grad``), one that mixes from its third forward call on (a Python counter, not a buffer;
the check ran two calls per model copy), one that mixes only in batches above 9 (the check used 8
and 7), one whose forward pass is the identity and whose custom ``autograd.Function`` mixes the
examples' gradients in the backward pass, and one that keeps a running batch mean in a frozen
``nn.Parameter`` (no buffer). A sixth model, a tied autoencoder whose root reuses its encoder's
weight with ``F.linear(h, self.enc.weight.t())``, is clipped wrongly by every route (ghost clips the
hooked use only; bk and flat drop the other use's gradient). Each is now refused in one line naming
the module or the parameter. The negative control measures each leak on the engines' code path with
the check switched off: removing one example moves the clipped sum by more than C (or the released
parameter moves, or the sum is not the clipped sum of the true gradients), while the same model
without its mixing moves it by at most C.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
from dpmech.privacy import per_example as pe
from dpmech.privacy.per_example import per_example_problem

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:Full backward hook is firing")]

C = 0.1
D, H, K = 12, 16, 3          # input features, hidden units, classes


class GradModeCentre(nn.Module):
    """Centres over the batch only when gradients are enabled (training), not under no_grad."""

    def __init__(self, mix: bool = True):
        super().__init__()
        self.mix = mix

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.mix and torch.is_grad_enabled() else x


class LateCentre(nn.Module):
    """Centres over the batch from its third forward call on (a Python counter, not a buffer)."""

    def __init__(self, mix: bool = True, after: int = 2):
        super().__init__()
        self.mix, self.after, self.calls = mix, after, 0

    def forward(self, x):
        self.calls += 1
        return x - x.mean(0, keepdim=True) if self.mix and self.calls > self.after else x


class BigBatchCentre(nn.Module):
    """Centres over the batch only in batches of more than 9 examples."""

    def __init__(self, mix: bool = True):
        super().__init__()
        self.mix = mix

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.mix and x.shape[0] > 9 else x


class _CentreGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


class GradCentre(nn.Module):
    """The identity in the forward pass; its backward pass centres the output gradients over the
    batch (a custom autograd.Function)."""

    def __init__(self, mix: bool = True):
        super().__init__()
        self.mix = mix

    def forward(self, x):
        return _CentreGrad.apply(x) if self.mix else x


class FrozenMean(nn.Module):
    """The identity, keeping a running mean of its inputs in a frozen nn.Parameter (not a buffer)."""

    def __init__(self, mix: bool = True):
        super().__init__()
        self.mix = mix
        self.running = nn.Parameter(torch.zeros(H), requires_grad=False)

    def forward(self, x):
        if self.mix:
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * x.mean(0))
        return x


class DataMean(FrozenMean):
    """FrozenMean's update through ``.data`` (no version counter moves)."""

    def forward(self, x):
        self.running.data.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x


class SlightMean(nn.Module):
    """Adds 0.005 x the batch mean: moves another example's output by less than 1% (issue 50 §3)."""

    def forward(self, x):
        return x + 0.005 * x.mean(0, keepdim=True)


def mlp(layer: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, H), layer, nn.Tanh(), nn.Linear(H, K))


class TiedAutoencoder(nn.Module):
    """A classifier on a tied autoencoder's reconstruction: the decoder is ``F.linear(h,
    enc.weight.t())`` in the root's forward (tied=False: a decoder of its own, an nn.Linear)."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.tied = tied
        self.enc, self.head = nn.Linear(D, H), nn.Linear(D, K)
        self.dec = None if tied else nn.Linear(H, D, bias=False)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        r = F.linear(h, self.enc.weight.t()) if self.tied else self.dec(h)
        return self.head(torch.tanh(r))


# name -> (factory(mix), the start of the refusal)
MIXERS = {
    "grad_mode": (lambda mix: mlp(GradModeCentre(mix)), "model: module '1' (GradModeCentre) mixes the examples"),
    "late": (lambda mix: mlp(LateCentre(mix)), "model: module '1' (LateCentre) mixes the examples"),
    "big_batch": (lambda mix: mlp(BigBatchCentre(mix)), "model: module '1' (BigBatchCentre) mixes the examples"),
    "grad_fn": (lambda mix: mlp(GradCentre(mix)), "model: module '1' (GradCentre) mixes the examples' gradients"),
    "frozen": (lambda mix: mlp(FrozenMean(mix)), "model: module '1' (FrozenMean) updates its parameter 'running'"),
    "tied": (lambda mix: TiedAutoencoder(mix), "model: module 'enc' (Linear) has its parameter 'enc.weight' used "
                                               "outside its forward pass"),
}
ENGINES = ("bk", "ghost", "flat")
N = 16          # the trainer's expected batch size (and the batch the leaks are measured on)


def _build(name: str, mix: bool = True, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MIXERS[name][0](mix).double()


def _data(n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, D, generator=g, dtype=torch.float64) * 2 - 1,
            torch.randint(0, K, (n,), generator=g))


def _config(clipping: str, noise_multiplier: float = 0.0, max_grad_norm: float = C) -> DPSGDConfig:
    return DPSGDConfig(epsilon=None, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, batch_size=N,
                       epochs=1, clipping=clipping)


def _one_line_error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ refused


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("name", list(MIXERS))
def test_trainer_refuses_each_mixing_model_on_every_route(name, clipping):
    x, y = _data(64)
    msg = _one_line_error(lambda: DPSGDTrainer(_build(name), x, y, _config(clipping, noise_multiplier=1.0)))
    assert msg.startswith(MIXERS[name][1]), msg


@pytest.mark.parametrize("name", list(MIXERS))
def test_the_same_models_without_their_mixing_pass(name):
    x, _ = _data(4)
    assert per_example_problem(_build(name, mix=False), x, batch_size=N) is None


def test_a_change_through_data_is_seen_too():
    x, _ = _data(4)
    msg = per_example_problem(mlp(DataMean()), x.float())
    assert msg is not None and msg.startswith(
        "model: module '1' (DataMean) updates its parameter 'running' (requires_grad False) in a training forward "
        "pass"), msg


def test_a_mixing_of_less_than_one_percent_is_refused():
    """Issue 50 §3: adding 0.005 x the batch mean moves another example's output (and gradient) by
    a fraction of a percent; it must be refused (a tolerance 100 times looser lets it pass)."""
    x, _ = _data(4)
    msg = per_example_problem(mlp(SlightMean()), x.float())
    assert msg is not None and msg.startswith("model: module '1' (SlightMean) mixes the examples"), msg


class CentredLinear(nn.Linear):
    """A first layer whose backward pass centres its output gradients (in the layer itself: no
    module boundary shows it, only its parameters' gradients do)."""

    def forward(self, x):
        return _CentreGrad.apply(super().forward(x))


class InlineGradMix(nn.Module):
    """The gradient-mixing Function applied in the root's own forward code, between submodules."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, K)

    def forward(self, x):
        return self.b(torch.tanh(_CentreGrad.apply(self.a(x))))


@pytest.mark.parametrize("after", [2, 4])
def test_a_counter_is_past_its_count_before_the_second_probe(after):
    """The second probe's copies are of a copy called 4 times already: a model that starts mixing at
    its 5th forward pass is caught (one starting later is documented as out of reach)."""
    x, _ = _data(4)
    msg = per_example_problem(mlp(LateCentre(after=after)), x.float())
    assert msg is not None and msg.startswith("model: module '1' (LateCentre) mixes the examples"), msg
    assert per_example_problem(mlp(LateCentre(after=5)), x.float()) is None


def test_gradient_mixing_is_named_where_it_happens():
    """In a leaf's own backward pass: that leaf, through its parameters' gradients; in the root's own
    forward code: the root."""
    x, _ = _data(4)
    msg = per_example_problem(nn.Sequential(CentredLinear(D, H), nn.Tanh(), nn.Linear(H, K)), x.float())
    assert msg is not None and msg.startswith(
        "model: module '0' (CentredLinear) mixes the examples of a batch (changing one example moved the other "
        "examples' gradient of its parameter "), msg
    msg = per_example_problem(InlineGradMix(), x.float())
    assert msg is not None and msg.startswith(
        "model: the model itself (InlineGradMix) mixes the examples' gradients in its own forward code"), msg


def test_the_model_checked_is_left_as_it_was():
    """The check runs copies; a model that cannot be deep-copied is run itself and restored (its
    frozen parameter too), its training flag kept."""
    import threading

    model = mlp(FrozenMean()).eval()
    model.lock = threading.Lock()                   # deepcopy fails: the model itself is run
    x, _ = _data(4)
    msg = per_example_problem(model, x.float(), batch_size=N)
    assert msg.startswith("model: module '1' (FrozenMean) updates its parameter 'running' (requires_grad False)")
    assert not model.training and float(model[1].running.abs().sum()) == 0.0
    assert not any(k in m.__dict__ for m in model.modules() for k in m._parameters)


# ------------------------------------------------------------------ the leaks (negative control)


def _clipped_sum(tr: DPSGDTrainer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The engine's clipped sum of the batch (x, y): sum_i min(1, C/||g_i||) g_i as the engine
    computes it (no noise), flat over the trainable parameters."""
    tr.optimizer.zero_grad(set_to_none=True)
    tr.model.train()
    if tr.gsm is not None:
        tr.gsm.enable_hooks()
    try:
        tr.forward_backward(x, y)
    finally:
        if tr.gsm is not None:
            tr.gsm.disable_hooks()
    if tr.bookkeeper is None:
        tr.optimizer.pre_step()             # Opacus clips, sums, adds the (zero) noise and scales by 1/B
    params = [p for p in tr.model.parameters() if p.requires_grad]
    return torch.cat([p.grad.flatten() for p in params]) * N


def _without_check(monkeypatch):
    monkeypatch.setattr(pe, "check_per_example", lambda model, *examples, **kw: None)


def _moved(name: str, clipping: str, mix: bool) -> float:
    """How far removing one example moves the engine's clipped sum of a batch of N (one outlier
    among them), at the worst choice of the example (an attacker picks it)."""
    x, y = _data(N, seed=1)
    x[0] = 50.0
    tr = DPSGDTrainer(_build(name, mix), x, y, _config(clipping))
    with torch.no_grad():           # the first forward passes of training (evaluation counts too)
        tr.model(x)
        tr.model(x)
    full = _clipped_sum(tr, x, y)
    keep = [torch.arange(N) != i for i in range(N)]
    return max(float((full - _clipped_sum(tr, x[k], y[k])).norm()) for k in keep)


@pytest.mark.parametrize("name", ["grad_mode", "late", "big_batch", "grad_fn"])
def test_without_the_check_removing_one_example_moves_the_clipped_sum_by_more_than_c(monkeypatch, name):
    """The engines' code path with the check switched off: each mixing model's clipped sum moves by
    more than C, the sensitivity the noise is calibrated to, on every route; the same model without
    its mixing by at most C."""
    _without_check(monkeypatch)
    moved = {(clipping, mix): _moved(name, clipping, mix) for clipping in ENGINES for mix in (True, False)}
    print(name, {k: round(v / C, 2) for k, v in moved.items()})
    for clipping in ENGINES:
        assert moved[clipping, False] <= C * (1 + 1e-9), moved
        assert moved[clipping, True] > 1.05 * C, moved


def test_without_the_check_the_frozen_parameter_releases_a_batch_mean(monkeypatch):
    """The frozen parameter's running mean, released with the model, moves far when one outlier is
    removed from the data (the honest model's stays where it was)."""
    _without_check(monkeypatch)
    x, y = _data(2 * N, seed=1)
    x[0] = 50.0
    released = {}
    for mix in (True, False):
        for data, labels, which in ((x, y, "with"), (x[1:], y[1:], "without")):
            tr = DPSGDTrainer(_build("frozen", mix), data, labels, _config("bk"))
            tr._step(torch.arange(len(data)))
            released[mix, which] = tr.model[1].running.detach().clone()
    moved = {mix: float((released[mix, "with"] - released[mix, "without"]).norm()) for mix in (True, False)}
    print("frozen", moved)
    assert moved[True] > C and moved[False] == 0.0, moved


def test_without_the_check_the_tied_autoencoder_is_clipped_wrongly(monkeypatch):
    """ghost clips only the encoder's own use of the tied weight: an example's clipped gradient
    (its norm: what removing it moves) exceeds C; bk and flat drop the decoder's use, so their clipped
    sum with a C no gradient reaches is not the true gradient sum (they train something else)."""
    _without_check(monkeypatch)
    moved = {(clipping, mix): _moved("tied", clipping, mix) for clipping in ENGINES for mix in (True, False)}
    print("tied", {k: round(v / C, 2) for k, v in moved.items()})
    for clipping in ENGINES:
        assert moved[clipping, False] <= C * (1 + 1e-9), moved
    assert moved["ghost", True] > 1.05 * C, moved
    x, y = _data(N, seed=1)
    for clipping in ("bk", "flat"):
        tr = DPSGDTrainer(_build("tied"), x, y, _config(clipping, max_grad_norm=1e6))
        got = _clipped_sum(tr, x, y)
        model = _build("tied")
        F.cross_entropy(model(x), y, reduction="sum").backward()
        want = torch.cat([p.grad.flatten() for p in model.parameters()])
        gap = float((got - want).norm() / want.norm())
        print("tied", clipping, "relative gap to the true gradient", gap)
        assert gap > 0.05, gap
