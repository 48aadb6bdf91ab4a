"""Architectures for DP-SGD training, chosen by name (the ``model`` key of the ``dpsgd`` trainable).

=================  =============================================================================
name               network
=================  =============================================================================
``tb_cnn``         Tramer & Boneh 2021 ("Differentially Private Learning Needs Better Features"),
                   end-to-end MNIST/FashionMNIST CNN with tanh, the same network as Papernot et
                   al. 2021's tempered-sigmoid CNN: conv 16 8x8 /2 -> tanh -> maxpool 2x2 /1 ->
                   conv 32 4x4 /2 -> tanh -> maxpool 2x2 /1 -> FC 32 -> tanh -> FC 10 (26,010
                   parameters). On CIFAR-10 their CNN: [conv 3x3 32, conv 32, maxpool /2,
                   conv 64, conv 64, maxpool /2, conv 128, conv 128, maxpool /2] (tanh after every
                   conv) -> FC 128 -> tanh -> FC 10.
``tb_cnn_gn``      the same networks with a GroupNorm (affine) after every convolution, before the
                   activation: the per-example-safe normalisation for deeper nets (BatchNorm mixes
                   the examples of a batch, which per-example clipping cannot bound).
``pixeldp_cnn``    the PixelDP networks without their noise layer (``dpmech.models``; MNIST: conv
                   5x5x32 /2, conv 5x5x64 /2, FC 1024, FC 10, 3.2M parameters; CIFAR-10: the wide
                   ResNet with GroupNorm). The DPAL paper's baseline comparison trains every
                   mechanism on this network, so it is the default of the ``dpsgd`` trainable.
=================  =============================================================================

Padding of the first MNIST convolution: Tramer & Boneh's code pads by 2 (28 -> 13 -> 12 -> 5 ->
4), TF-Privacy's tutorial (Papernot et al.) uses 'SAME' (pad 3: 28 -> 14 -> 13 -> 5 -> 4); both
end in 32 x 4 x 4 features. We follow T&B's code (docs/dpsgd.md).

Input range (``input_range``): the project's images are in [-1, 1]; T&B's end-to-end CNNs read MNIST
through ``transforms.ToTensor()`` alone, i.e. in [0, 1] (ftramer/Handcrafted-DP ``data.py``,
``get_data``: no ``Normalize`` for MNIST/FashionMNIST). ``input_range="unit"`` puts a fixed
(parameter-free) map x -> (x + 1) / 2 in front of the network so it sees their inputs; ``"pm1"``
(default) feeds [-1, 1] unchanged. The map has no parameters, so clipping and privacy are unchanged.

Your own network: ``name`` may be an import path ``"package.module:factory"``, called as
``factory(input_shape=(C, H, W), num_classes=K)`` (:mod:`dpmech.user_code`, docs/own_model.md).
A dataset given as a loader's import path gets ``pixeldp_cnn`` at its image shape, and ``tb_cnn``
/ ``tb_cnn_gn`` when its images are 28 x 28 (the MNIST CNN) or 32 x 32 (the CIFAR-10 CNN).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dpmech import _validate as v

DP_MODELS = ("pixeldp_cnn", "tb_cnn", "tb_cnn_gn")
INPUT_RANGES = ("pm1", "unit")


class InputAffine(nn.Module):
    """A fixed input map x -> scale * x + shift (buffers, no parameters): the change of input range
    of :func:`build_dp_model` (``input_range="unit"``: scale 1/2, shift 1/2, [-1, 1] -> [0, 1])."""

    def __init__(self, scale: float, shift: float):
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale)))
        self.register_buffer("shift", torch.tensor(float(shift)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def _conv_block(cin: int, cout: int, k: int, stride: int, pad: int, groups: int | None) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride=stride, padding=pad)]
    if groups:
        layers.append(nn.GroupNorm(min(groups, cout), cout))
    layers.append(nn.Tanh())
    return layers


class TBMnistCNN(nn.Module):
    """Tramer & Boneh 2021's MNIST CNN (tanh; Papernot et al. 2021's tempered-sigmoid CNN)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, groups: int | None = None):
        super().__init__()
        self.features = nn.Sequential(
            *_conv_block(in_channels, 16, 8, 2, 2, groups), nn.MaxPool2d(2, stride=1),
            *_conv_block(16, 32, 4, 2, 0, groups), nn.MaxPool2d(2, stride=1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TBCifarCNN(nn.Module):
    """Tramer & Boneh 2021's CIFAR-10 CNN (tanh, three stages of two 3x3 convs and a 2x2 max pool)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, groups: int | None = None):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for width in (32, 64, 128):
            layers += _conv_block(c, width, 3, 1, 1, groups) + _conv_block(width, width, 3, 1, 1, groups)
            layers.append(nn.MaxPool2d(2, stride=2))
            c = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 128), nn.Tanh(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_dp_model(name: str, dataset: str, seed: int = 0, input_range: str = "pm1") -> nn.Module:
    """The network ``name`` (one of :data:`DP_MODELS`) for ``dataset``, initialised from ``seed``
    (PyTorch's default initialisation) without touching the global RNG; ``input_range="unit"`` puts
    :class:`InputAffine` ([-1, 1] -> [0, 1], T&B's input range) in front of it."""
    from dpmech.data import check_dataset, input_shape, is_custom, num_classes
    from dpmech.user_code import build_model, is_import_path

    check_dataset(dataset)
    v.choice("input_range", input_range, INPUT_RANGES)
    if is_import_path(name):
        net = build_model(name, input_shape(dataset), num_classes(dataset), seed)
    elif is_custom(dataset):
        v.choice("model", name, DP_MODELS)
        net = _build_for_shape(name, input_shape(dataset), num_classes(dataset), seed)
    else:
        v.choice("model", name, DP_MODELS)
        net = _build(name, dataset, seed)
    return net if input_range == "pm1" else nn.Sequential(InputAffine(0.5, 0.5), net)


def _build_for_shape(name: str, shape: tuple[int, int, int], k: int, seed: int) -> nn.Module:
    """A built-in network for a loader's images of ``shape`` and ``k`` classes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "pixeldp_cnn":
            from dpmech.models import PixelDPCNN

            return PixelDPCNN(None, noise_after=0, input_shape=shape, num_classes=k, seed=seed)
        groups = 8 if name == "tb_cnn_gn" else None
        if shape[1:] == (28, 28):
            return TBMnistCNN(shape[0], k, groups)
        if shape[1:] == (32, 32):
            return TBCifarCNN(shape[0], k, groups)
    raise ValueError(f"model: {name!r} is defined for 28 x 28 and 32 x 32 images, the dataset's are "
                     f"{shape[1]} x {shape[2]}; use pixeldp_cnn or your own model ('package.module:factory')")


def _build(name: str, dataset: str, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "pixeldp_cnn":
            from dpmech.models import build_pixeldp_model

            return build_pixeldp_model(dataset, None, noise_after=0, seed=seed)
        groups = 8 if name == "tb_cnn_gn" else None
        if dataset == "cifar10":
            return TBCifarCNN(3, 10, groups)
        return TBMnistCNN(1, 10, groups)
