"""Book-keeping clipping (dpmech.privacy.clipping): per-example norms of each layer type against
torch.func, the clipped sum against a per-example clip-and-sum reference, in every rule
(ghost norm, instantiation, mixed), and the refusal of layers it cannot handle."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from dpmech.privacy.clipping import BookKeeper
from dpmech.networks.dpsgd_models import build_dp_model
from dpmech.dpsgd.trainer import build_dpsgd_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _seeded(build, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def func_per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, P] per-example gradients of the trainable parameters with torch.func (the reference)."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}

    def loss(ps, xi, yi):
        out = functional_call(model, {**ps, **frozen}, (xi[None],))
        return F.cross_entropy(out, yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g[k].reshape(x.shape[0], -1) for k in params], dim=1)


def bk_norms_and_sum(model, x, y, c, prefer):
    bk = BookKeeper(model, prefer=prefer)
    for p in model.parameters():
        p.grad = None
    bk.enabled = True
    logits = model(x)
    bk.enabled = False
    norms = bk.clipped_sum(F.cross_entropy(logits, y, reduction="none").sum(), c)
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    bk.remove()
    return norms, got


def frozen_head(n_in: int) -> nn.Module:
    head = nn.Linear(n_in, 3)
    head.requires_grad_(False)
    return head


LAYERS = {
    # one trainable layer type each (the rest frozen), so each layer's norm is checked alone
    "linear_2d": lambda: nn.Sequential(nn.Flatten(), nn.Linear(48, 3)),
    "linear_3d": lambda: nn.Sequential(nn.Flatten(2), nn.Linear(16, 5), nn.Tanh(), nn.Flatten(), frozen_head(15)),
    "conv_stride_pad": lambda: nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(),
                                             frozen_head(4 * 2 * 2)),
    "conv_dilation_nobias": lambda: nn.Sequential(nn.Conv2d(3, 5, 2, dilation=2, bias=False), nn.Flatten(),
                                                  frozen_head(5 * 2 * 2)),
    "groupnorm": lambda: nn.Sequential(nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(), frozen_head(48)),
}


@pytest.mark.parametrize("prefer", ["ghost", "inst", "mixed"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_per_example_norm_of_each_layer_type_equals_torch_func(layer, prefer):
    model = _seeded(LAYERS[layer])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 4, 4, generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    ref = func_per_example_grads(model, x, y)
    norms, _ = bk_norms_and_sum(model, x, y, 1e9, prefer)
    assert torch.allclose(norms, ref.norm(dim=1), rtol=1e-4, atol=1e-6)
    # negative control: a wrong rule (the norm of the summed gradient, spread over the batch) differs
    assert not torch.allclose(norms, ref.sum(0).norm().expand(6) / 6, rtol=1e-2)


@pytest.mark.parametrize("prefer", ["ghost", "inst", "mixed"])
@pytest.mark.parametrize("name,input_range", [("tb_cnn", "pm1"), ("tb_cnn_gn", "pm1"), ("pixeldp_cnn", "pm1"),
                                              ("tb_cnn", "unit")])
def test_clipped_sum_equals_per_example_clip_and_sum(name, input_range, prefer):
    # input_range "unit": T&B's [0, 1] inputs through a parameter-free map in front of the network
    model = build_dpsgd_model("mnist", 0, name, input_range)   # in-place activations made out of place
    g = torch.Generator().manual_seed(2)
    x = torch.rand(5, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, 10, (5,), generator=g)
    ref = func_per_example_grads(model, x, y)
    sorted_norms = ref.norm(dim=1).sort().values
    c = float(sorted_norms[1] + sorted_norms[2]) / 2   # two examples below C, three clipped
    factor = (c / (ref.norm(dim=1) + 1e-6)).clamp(max=1.0)
    assert (factor < 1).any() and (factor == 1).any()
    norms, got = bk_norms_and_sum(model, x, y, c, prefer)
    assert torch.allclose(norms, ref.norm(dim=1), rtol=1e-4)
    manual = (ref * factor[:, None]).sum(0)
    assert torch.allclose(got, manual, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got, ref.sum(0), rtol=1e-2)   # negative control: the unclipped sum


def test_cifar_models_with_groupnorm_are_supported():
    for name in ("tb_cnn", "tb_cnn_gn", "pixeldp_cnn"):       # pixeldp_cnn: the WRN, BatchNorm -> GroupNorm
        model = build_dpsgd_model("cifar10", 0, name)
        x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
        y = torch.tensor([0, 1, 2])
        ref = func_per_example_grads(model, x, y)
        norms, got = bk_norms_and_sum(model, x, y, 1e9, "mixed")
        assert torch.allclose(norms, ref.norm(dim=1), rtol=1e-4)
        assert torch.allclose(got, ref.sum(0), rtol=1e-4, atol=1e-6)


def test_unsupported_layers_are_refused_by_name():
    from dpmech.robustness.noise_layer import BoundedConv2d

    model = nn.Sequential(BoundedConv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 3))
    with pytest.raises(ValueError, match="^clipping: .*BoundedConv2d"):
        BookKeeper(model)
    with pytest.raises(ValueError, match="^clipping: .*BatchNorm2d"):
        BookKeeper(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    # an in-place activation changes a saved layer output: refused, not silently wrong
    model = build_dp_model("pixeldp_cnn", "mnist", seed=0)     # its first ReLU is in place
    x, y = torch.zeros(2, 1, 28, 28), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="^clipping: .*in place"):
        bk_norms_and_sum(model, x, y, 1.0, "mixed")


def test_unit_input_range_is_the_same_network_on_rescaled_inputs():
    """input_range="unit" (dpmech.networks.dpsgd_models.InputAffine): the same parameters, fed (x + 1) / 2; it adds
    no parameter (nothing new to clip or account for)."""
    plain, unit = build_dpsgd_model("mnist", 3, "tb_cnn"), build_dpsgd_model("mnist", 3, "tb_cnn", "unit")
    assert sum(p.numel() for p in unit.parameters()) == sum(p.numel() for p in plain.parameters())
    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert torch.allclose(unit(x), plain((x + 1) / 2), atol=1e-6)
    assert not torch.allclose(unit(x), plain(x), atol=1e-3)       # control: the map does change the input
    with pytest.raises(ValueError, match="input_range"):
        build_dpsgd_model("mnist", 0, "tb_cnn", "zero_one")
