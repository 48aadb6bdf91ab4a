"""FastMaxPool2d computes max pooling's values exactly without autograd and is PyTorch's kernel with it."""

import pytest
import torch
import torch.nn.functional as F

from dpmech.networks.dpsgd_models import build_dp_model
from dpmech.networks.pooling import FastMaxPool2d


@pytest.mark.parametrize("kernel,stride", [(2, 1), (2, 2), (3, 1), (3, 2), (2, None), ((2, 3), (1, 2)), (1, 1)])
@pytest.mark.parametrize("shape", [(5, 3, 13, 13), (2, 1, 8, 9), (3, 4, 4)])
def test_values_equal_pytorch_max_pool_bit_for_bit(kernel, stride, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    x[..., ::2, :] = x[..., ::2, :].round()          # many ties (and saturated values, as tanh makes)
    pool = FastMaxPool2d(kernel, stride=stride)
    with torch.no_grad():
        fast = pool(x)
    ref = F.max_pool2d(x, kernel, stride)
    assert fast.shape == ref.shape
    assert torch.equal(fast, ref)


def test_with_autograd_it_is_pytorchs_kernel_and_its_gradient():
    x = torch.tensor([[[[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]]], requires_grad=True)  # a tied window
    FastMaxPool2d(2, stride=1)(x).sum().backward()
    y = x.detach().clone().requires_grad_(True)
    F.max_pool2d(y, 2, 1).sum().backward()
    assert torch.equal(x.grad, y.grad)
    # negative control: the slices' maximum splits a tie's gradient, which PyTorch's kernel does not
    z = x.detach().clone().requires_grad_(True)
    torch.maximum(torch.maximum(z[..., :-1, :-1], z[..., 1:, :-1]), torch.maximum(z[..., :-1, 1:], z[..., 1:, 1:])).sum().backward()
    assert not torch.equal(z.grad, y.grad)


def test_other_settings_take_pytorchs_kernel():
    x = torch.randn(2, 3, 9, 9)
    for kw in (dict(padding=1), dict(dilation=2), dict(ceil_mode=True)):
        with torch.no_grad():
            assert torch.equal(FastMaxPool2d(3, stride=2, **kw)(x), F.max_pool2d(x, 3, 2, **kw))
    out, idx = FastMaxPool2d(2, stride=2, return_indices=True)(x)
    ref, ridx = F.max_pool2d(x, 2, 2, return_indices=True)
    assert torch.equal(out, ref) and torch.equal(idx, ridx)


@pytest.mark.parametrize("name,dataset", [("tb_cnn", "mnist"), ("tb_cnn_gn", "mnist"), ("tb_cnn", "cifar10")])
def test_the_networks_predict_the_same_with_and_without_autograd(name, dataset):
    model = build_dp_model(name, dataset, seed=0).eval()
    c, h = (1, 28) if dataset == "mnist" else (3, 32)
    x = 3 * torch.randn(64, c, h, h, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fast = model(x)
    assert torch.equal(fast, model(x).detach())


def test_the_speed_benchmark_certifies_the_same_counts_with_either_pool(tmp_path):
    from benchmarks import smoothing_speed

    out = smoothing_speed.main(["--demo", "--out", str(tmp_path / "s.json")])
    assert out["same_counts"] is True
    assert set(out["variants"]) == {"maxpool2d_batch4096", "fast_batch4096", "fast_batch256"}
    assert all(v["noisy_img_s"] > 0 for v in out["variants"].values())
