"""PixelDP networks: the MNIST CNN of the reference implementation and a CIFAR-10 wide ResNet.

Both are split into ``pre_noise`` -> ``noise`` -> ``post_noise`` (Lecuyer et al. 2018, Fig. 1)
so the certifier can compute the deterministic pre-noise part once per image and draw only the
noise and the post-noise part ``n`` times.

``noise_after`` places the noise layer: 0 = on the input (pre-noise part is the identity,
sensitivity 1), 1 = after the first convolution (a ``BoundedConv2d``, sensitivity <= 1).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dpmech import _validate as v
from dpmech.robustness.noise_layer import NORMS, BoundedConv2d, NoiseLayer, exact_sensitivity


class PixelDPNet(nn.Module):
    """Common interface: ``pre_noise``, ``noise``, ``post_noise``, ``sensitivity_bound``."""

    input_shape: tuple[int, int, int]
    noise_after: int
    norm: str

    def __init__(self, noise_scale: float | None, norm: str, noise_after: int, seed: int):
        super().__init__()
        self.norm = v.choice("norm", norm, NORMS)
        if isinstance(noise_after, bool) or noise_after not in (0, 1):
            raise ValueError(f"noise_after must be 0 (on the input) or 1 (after the first conv), got {noise_after!r}")
        self.noise_after = noise_after
        # noise_scale None builds the same network without a noise layer (the benchmark baseline).
        self.noise = NoiseLayer(noise_scale, norm, seed) if noise_scale is not None else nn.Identity()

    # subclasses set self.first (the layer whose sensitivity is bounded) and self.body
    def pre_noise(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) if self.noise_after == 1 else x

    def post_noise(self, h: torch.Tensor) -> torch.Tensor:
        if self.noise_after == 0:
            h = self.first(h)
        return self.body(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_noise(self.noise(self.pre_noise(x)))

    @property
    def has_noise(self) -> bool:
        return isinstance(self.noise, NoiseLayer)

    def sensitivity_bound(self) -> float:
        """Delta_{p,p} of the pre-noise part guaranteed by construction (Sec. 3.3)."""
        return 1.0

    def sensitivity_exact(self) -> float:
        """Operator norm of the pre-noise part on this input shape, computed exactly (<= bound)."""
        if self.noise_after == 0:
            return 1.0
        return min(self.sensitivity_bound(), exact_sensitivity(self.first, self.input_shape, self.norm))


class PixelDPCNN(PixelDPNet):
    """The reference PixelDP MNIST CNN: conv 5x5x32 /2 -> noise -> ReLU -> conv 5x5x64 /2 -> ReLU
    -> FC 1024 -> ReLU -> FC 10 ("SAME" padding, so 28 -> 14 -> 7)."""

    def __init__(self, noise_scale: float | None, *, norm: str = "l2", noise_after: int = 1,
                 input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10, seed: int = 0):
        super().__init__(noise_scale, norm, noise_after, seed)
        c, h, w = input_shape
        self.input_shape = (c, h, w)
        if noise_after == 1:
            self.first = BoundedConv2d(c, 32, 5, stride=2, padding=2, norm=norm)
        else:
            self.first = nn.Conv2d(c, 32, 5, stride=2, padding=2)
        h2, w2 = (h + 1) // 2, (w + 1) // 2
        h4, w4 = (h2 + 1) // 2, (w2 + 1) // 2
        self.body = nn.Sequential(
            nn.ReLU(inplace=True),  # its input is always a fresh tensor (noise + g(x), or conv output)
            nn.Conv2d(32, 64, 5, stride=2, padding=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * h4 * w4, 1024),
            nn.ReLU(),
            nn.Linear(1024, num_classes),
        )


class _WideBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.shortcut = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = torch.relu(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(torch.relu(self.bn2(y)))
        return y + (x if self.shortcut is None else self.shortcut(o))


class PixelDPWideResNet(PixelDPNet):
    """A small wide ResNet (WRN-depth-width, Zagoruyko & Komodakis 2016) for CIFAR-10 with the
    PixelDP noise layer after the first 3x3 convolution (or on the input). Batch norm sits only
    after the noise (it does not touch the bounded pre-noise layer)."""

    def __init__(self, noise_scale: float | None, *, norm: str = "l2", noise_after: int = 1,
                 input_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10,
                 depth: int = 10, width: int = 2, seed: int = 0):
        super().__init__(noise_scale, norm, noise_after, seed)
        if (depth - 4) % 6 != 0 or depth < 10:
            raise ValueError(f"depth must be 6n+4 with n >= 1, got {depth}")
        n = (depth - 4) // 6
        c = input_shape[0]
        self.input_shape = tuple(input_shape)
        widths = [16, 16 * width, 32 * width, 64 * width]
        conv = BoundedConv2d(c, widths[0], 3, stride=1, padding=1, norm=norm) if noise_after == 1 \
            else nn.Conv2d(c, widths[0], 3, stride=1, padding=1)
        self.first = conv
        layers: list[nn.Module] = []
        cin = widths[0]
        for stage, cout in enumerate(widths[1:]):
            for i in range(n):
                layers.append(_WideBlock(cin, cout, stride=(1 if stage == 0 or i > 0 else 2)))
                cin = cout
        self.body = nn.Sequential(
            *layers, nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(cin, num_classes),
        )


def build_pixeldp_model(dataset: str, noise_scale: float | None, *, norm: str = "l2", noise_after: int = 1,
                        seed: int = 0) -> PixelDPNet:
    """The PixelDP network for ``dataset``: the CNN for MNIST/FashionMNIST, the WRN for CIFAR-10."""
    if dataset in ("mnist", "fashion_mnist"):
        return PixelDPCNN(noise_scale, norm=norm, noise_after=noise_after, seed=seed)
    if dataset == "cifar10":
        return PixelDPWideResNet(noise_scale, norm=norm, noise_after=noise_after, seed=seed)
    raise ValueError(f"dataset must be one of 'mnist', 'fashion_mnist', 'cifar10'; got {dataset!r}")
