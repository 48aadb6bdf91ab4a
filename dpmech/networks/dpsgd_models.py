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
``pixeldp_cnn``    the PixelDP networks without their noise layer (``dpmech.networks.pixeldp``; MNIST: conv
                   5x5x32 /2, conv 5x5x64 /2, FC 1024, FC 10, 3.2M parameters; CIFAR-10: the wide
                   ResNet with GroupNorm). The DPAL paper's baseline comparison trains every
                   mechanism on this network, so it is the default of the ``dpsgd`` trainable.
``lenet``          the LeNet the randomized-smoothing literature certifies MNIST with (Cohen et al.
                   2019's baselines as reported by the consistency-regularisation and SmoothMix
                   code): conv 20 5x5 -> ReLU -> maxpool 2x2 /2 -> conv 50 5x5 -> ReLU -> maxpool
                   2x2 /2 -> FC 500 -> ReLU -> FC 10 (431,080 parameters); 28 x 28 images only.
=================  =============================================================================

Padding of the first MNIST convolution: Tramer & Boneh's code pads by 2 (28 -> 13 -> 12 -> 5 ->
4), TF-Privacy's tutorial (Papernot et al.) uses 'SAME' (pad 3: 28 -> 14 -> 13 -> 5 -> 4); both
end in 32 x 4 x 4 features. We follow T&B's code (docs/dpsgd.md).

Input range (``input_range``): the project's images are in [-1, 1]; T&B's end-to-end CNNs read MNIST
through ``transforms.ToTensor()`` alone, i.e. in [0, 1] (ftramer/Handcrafted-DP ``data.py``,
``get_data``: no ``Normalize`` for MNIST/FashionMNIST). ``input_range="unit"`` puts a fixed
(parameter-free) map x -> (x + 1) / 2 in front of the network so it sees their inputs; ``"pm1"``
(default) feeds [-1, 1] unchanged. The map has no parameters, so clipping and privacy are unchanged.

Classifiers on ScatterNet features (:mod:`dpmech.networks.scatternet`; the ``dpsgd`` trial key ``features:
scatternet``), built by :func:`build_feature_model` for features of shape (K, h, w):

=================  =============================================================================
name               network
=================  =============================================================================
``linear``         Tramer & Boneh 2021's ScatterNet + linear model (Handcrafted-DP ``models.py``,
                   ``ScatterLinear``): GroupNorm(G, K, affine=False) on the K scattering channels,
                   then one Linear(K h w, classes) on the flattened features (39,700 parameters
                   on MNIST's 81 x 7 x 7).
``scatter_cnn``    their small CNN on ScatterNet features (``MNIST_CNN`` / ``CIFAR10_CNN`` with
                   ``in_channels`` = K): GroupNorm(G, K, affine=False), then on 7 x 7 (MNIST)
                   conv 16 3x3 /2 pad 1 -> tanh -> conv 32 3x3 /1 pad 1 -> tanh -> FC 32 -> tanh
                   -> FC classes (on 8 x 8, CIFAR-10: conv 64 3x3 -> tanh -> maxpool 2 -> conv 64
                   3x3 -> tanh -> FC classes).
=================  =============================================================================

The normalisation is T&B's "GroupNorm" option (their ``input_norm="GroupNorm"``): the statistics
are those of one example's own features (mean and variance over the channels of a group and all
positions), so it is part of the per-example function the model computes, needs no data statistic
and has no privacy cost; ``affine=False`` as in their code (no parameters). G = ``groups`` (27 by
default, T&B's choice wherever they use GroupNorm: their Fashion-MNIST recipes; their CLI's
default is 81), which must divide K; 0 = no normalisation. T&B's other option, a private
mean/variance "data normalisation" released with Gaussian noise (their MNIST recipes), is not
implemented (docs/dpsgd.md, "ScatterNet features").

Your own network: ``name`` may be an import path ``"package.module:factory"``, called as
``factory(input_shape=(C, H, W), num_classes=K)`` (:mod:`dpmech.datasets.user_code`, docs/own_model.md).
A dataset given as a loader's import path gets ``pixeldp_cnn`` at its image shape, and ``tb_cnn``
/ ``tb_cnn_gn`` when its images are 28 x 28 (the MNIST CNN) or 32 x 32 (the CIFAR-10 CNN).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dpmech import _validate as v
from dpmech.networks.pooling import FastMaxPool2d

DP_MODELS = ("pixeldp_cnn", "tb_cnn", "tb_cnn_gn", "lenet")
FEATURE_MODELS = ("linear", "scatter_cnn")
FEATURE_GROUPS = 27   # GroupNorm groups on the scattering channels (T&B's GroupNorm recipes)
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
    """Tramer & Boneh 2021's MNIST CNN (tanh; Papernot et al. 2021's tempered-sigmoid CNN). Its pools
    are :class:`~dpmech.networks.pooling.FastMaxPool2d`: the same function, about 4x faster inference
    on CPU (what CERTIFY's N = 100,000 draws per image spend)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, groups: int | None = None):
        super().__init__()
        self.features = nn.Sequential(
            *_conv_block(in_channels, 16, 8, 2, 2, groups), FastMaxPool2d(2, stride=1),
            *_conv_block(16, 32, 4, 2, 0, groups), FastMaxPool2d(2, stride=1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LeNet(nn.Module):
    """The LeNet of the randomized-smoothing literature's MNIST results (Cohen et al. 2019's MNIST
    baselines as the consistency-regularisation and SmoothMix repositories certify them): two 5x5
    convolutions of 20 and 50 channels, each with ReLU and a 2x2 max pool, a 500-unit ReLU layer, 10
    outputs; 431,080 parameters on 28 x 28 grey images (17x ``tb_cnn``'s 26,010). For 28 x 28 inputs."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, 5), nn.ReLU(), FastMaxPool2d(2, stride=2),
            nn.Conv2d(20, 50, 5), nn.ReLU(), FastMaxPool2d(2, stride=2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(50 * 4 * 4, 500), nn.ReLU(), nn.Linear(500, num_classes))

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
            layers.append(FastMaxPool2d(2, stride=2))
            c = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 128), nn.Tanh(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_dp_model(name: str, dataset: str, seed: int = 0, input_range: str = "pm1") -> nn.Module:
    """The network ``name`` (one of :data:`DP_MODELS`) for ``dataset``, initialised from ``seed``
    (PyTorch's default initialisation) without touching the global RNG; ``input_range="unit"`` puts
    :class:`InputAffine` ([-1, 1] -> [0, 1], T&B's input range) in front of it."""
    from dpmech.datasets.splits import check_dataset, input_shape, is_custom, num_classes
    from dpmech.datasets.user_code import build_model, is_import_path

    check_dataset(dataset)
    v.choice("input_range", input_range, INPUT_RANGES)
    if name in FEATURE_MODELS:
        raise ValueError(f"model: {name!r} is a classifier on ScatterNet features, not on images; build it with "
                         f"build_feature_model (trial key features: scatternet)")
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
            from dpmech.networks.pixeldp import PixelDPCNN

            return PixelDPCNN(None, noise_after=0, input_shape=shape, num_classes=k, seed=seed)
        groups = 8 if name == "tb_cnn_gn" else None
        if name == "lenet":
            if shape[1:] == (28, 28):
                return LeNet(shape[0], k)
        elif shape[1:] == (28, 28):
            return TBMnistCNN(shape[0], k, groups)
        elif shape[1:] == (32, 32):
            return TBCifarCNN(shape[0], k, groups)
    sizes = "28 x 28 images" if name == "lenet" else "28 x 28 and 32 x 32 images"
    raise ValueError(f"model: {name!r} is defined for {sizes}, the dataset's are "
                     f"{shape[1]} x {shape[2]}; use pixeldp_cnn or your own model ('package.module:factory')")


def _build(name: str, dataset: str, seed: int) -> nn.Module:
    if name == "lenet":                  # by the images' shape (refused, in one line, on CIFAR-10's)
        from dpmech.datasets.splits import input_shape

        return _build_for_shape(name, input_shape(dataset), 10, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "pixeldp_cnn":
            from dpmech.networks.pixeldp import build_pixeldp_model

            return build_pixeldp_model(dataset, None, noise_after=0, seed=seed)
        groups = 8 if name == "tb_cnn_gn" else None
        if dataset == "cifar10":
            return TBCifarCNN(3, 10, groups)
        return TBMnistCNN(1, 10, groups)


# ------------------------------------------------------------------ classifiers on ScatterNet features
def _feature_norm(channels: int, groups: int) -> nn.Module:
    """GroupNorm(groups, channels, affine=False) (per-example statistics, no parameters), or the
    identity for ``groups == 0``."""
    if groups == 0:
        return nn.Identity()
    return nn.GroupNorm(groups, channels, affine=False)


class ScatterLinear(nn.Module):
    """T&B's ScatterNet + linear model: per-example GroupNorm of the K channels, one Linear layer."""

    def __init__(self, feature_shape: tuple[int, int, int], num_classes: int = 10, groups: int = FEATURE_GROUPS):
        super().__init__()
        k, h, w = feature_shape
        self.norm = _feature_norm(k, groups)
        self.fc = nn.Linear(k * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).flatten(1))


class ScatterCNN(nn.Module):
    """T&B's small CNN on ScatterNet features (tanh): on 7 x 7 features (MNIST) two 3x3 convs
    (16 /2, 32 /1) and FC 32 -> FC classes; on 8 x 8 (CIFAR-10) conv 64, maxpool /2, conv 64 and
    FC classes. Per-example GroupNorm of the input channels first."""

    def __init__(self, feature_shape: tuple[int, int, int], num_classes: int = 10, groups: int = FEATURE_GROUPS):
        super().__init__()
        k, h, w = feature_shape
        self.norm = _feature_norm(k, groups)
        if (h, w) == (7, 7):
            self.features = nn.Sequential(nn.Conv2d(k, 16, 3, stride=2, padding=1), nn.Tanh(),
                                          nn.Conv2d(16, 32, 3, stride=1, padding=1), nn.Tanh())
            self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(),
                                            nn.Linear(32, num_classes))
        elif (h, w) == (8, 8):
            self.features = nn.Sequential(nn.Conv2d(k, 64, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2, 2),
                                          nn.Conv2d(64, 64, 3, padding=1), nn.Tanh())
            self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, num_classes))
        else:
            raise ValueError(f"model: 'scatter_cnn' is defined on 7 x 7 (28 x 28 images) and 8 x 8 (32 x 32 images) "
                             f"ScatterNet features, got {h} x {w}; use model 'linear'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(self.norm(x)))


def build_feature_model(name: str, feature_shape, num_classes: int, seed: int = 0,
                        groups: int = FEATURE_GROUPS) -> nn.Module:
    """The classifier ``name`` (one of :data:`FEATURE_MODELS`) on features of ``feature_shape``
    (K, h, w), e.g. :func:`dpmech.networks.scatternet.feature_shape`; initialised from ``seed`` (PyTorch's
    default initialisation) without touching the global RNG. ``groups``: GroupNorm groups on the K
    channels (must divide K; 0 = no normalisation)."""
    v.choice("model", name, FEATURE_MODELS)
    shape = tuple(int(s) for s in feature_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"feature_shape must be (K, h, w) of positive sizes, got {tuple(feature_shape)}")
    v.positive_int("num_classes", num_classes, minimum=2)
    groups = v.positive_int("feature_norm_groups", groups, minimum=0)
    if groups and shape[0] % groups:
        raise ValueError(f"feature_norm_groups must divide the {shape[0]} feature channels (GroupNorm), got {groups}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cls = ScatterLinear if name == "linear" else ScatterCNN
        return cls(shape, num_classes, groups)
