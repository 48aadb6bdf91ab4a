"""The conditional generator (an MLP) and critic (an MLP or a small convolutional network) of DPGAN.

The critic f_w(x, y) reads an image and its label (one-hot) and returns one unbounded score (the
Wasserstein critic). It has no batch normalisation (or any layer that mixes examples), so the
gradient of a batch's summed score is the sum of per-example gradients and each can be clipped
on its own. The generator G(z, y) maps a latent vector and a label to an image in [-1, 1] (tanh):
an MLP (default) or a narrowed DCGAN-shaped generator (``generator="dcgan"``, the reference code's
shape). Per-example gradients of an MLP critic are cheap on a CPU (the reference code has an MLP
variant beside its DCGAN one); the architecture is not part of the privacy argument.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _onehot(y: torch.Tensor, classes: int) -> torch.Tensor:
    """Integer labels -> float one-hot rows; float input is taken to be one-hot already."""
    if y.is_floating_point():
        return y
    return F.one_hot(y, classes).float()


class Critic(nn.Module):
    """f_w(x, y) = v . phi(x) + e_y . phi(x).

    phi is either an MLP (``"mlp"``: image -> 2h -> h) or the reference code's DCGAN critic without
    normalisation, narrowed (``"conv"``: conv 4x4/2 with 32 channels, conv 4x4/2 with 64, a fully
    connected layer of width h); LeakyReLU(0.2) after each layer. The head v and the label embedding
    E form a projection critic (Miyato & Koyama 2018): the label acts multiplicatively on the
    features. No batch normalisation (or any layer that mixes examples).
    """

    def __init__(self, input_shape: tuple[int, ...], classes: int, hidden: int, architecture: str = "mlp"):
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.classes = classes
        c, h, w = self.input_shape
        if architecture == "conv":
            self.phi = nn.Sequential(
                nn.Conv2d(c, 32, 4, 2, 1), nn.LeakyReLU(0.2),
                nn.Conv2d(32, 64, 4, 2, 1), nn.LeakyReLU(0.2),
                nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), hidden), nn.LeakyReLU(0.2))
        elif architecture == "mlp":
            self.phi = nn.Sequential(
                nn.Flatten(), nn.Linear(c * h * w, 2 * hidden), nn.LeakyReLU(0.2),
                nn.Linear(2 * hidden, hidden), nn.LeakyReLU(0.2))
        else:
            raise ValueError(f"architecture must be 'mlp' or 'conv', got {architecture!r}")
        self.head = nn.Linear(hidden, 1)
        self.embed = nn.Linear(classes, hidden, bias=False)  # E^T one_hot(y) = e_y

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.phi(x)
        return self.head(h).squeeze(1) + (self.embed(_onehot(y, self.classes)) * h).sum(1)


class Generator(nn.Module):
    """G(z, y): [latent, one-hot label] -> h -> 2h -> image, ReLU, tanh output in [-1, 1]."""

    def __init__(self, latent_dim: int, input_shape: tuple[int, ...], classes: int, hidden: int):
        super().__init__()
        self.latent_dim = latent_dim
        self.input_shape = tuple(input_shape)
        self.classes = classes
        self.net = nn.Sequential(
            nn.Linear(latent_dim + classes, hidden), nn.ReLU(),
            nn.Linear(hidden, 2 * hidden), nn.ReLU(),
            nn.Linear(2 * hidden, math.prod(self.input_shape)), nn.Tanh())

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cat([z, _onehot(y, self.classes)], dim=1)
        return self.net(h).view(-1, *self.input_shape)


class ConvGenerator(nn.Module):
    """G(z, y) shaped like the reference code's DCGAN generator (illidanlab/dpgan ``mnist/dcgan.py``:
    fully connected to a 7 x 7 map, two 4x4 stride-2 transposed convolutions to 28 x 28; 128 and 64
    channels there), narrowed to ``hidden // 4`` and ``hidden // 8`` channels for CPUs, with GroupNorm
    where the reference has batch norm: a sample is normalised on its own, so it does not depend on
    the other samples drawn with it (and the weight EMA has no running statistics to track). tanh
    output in [-1, 1]. Reads z and y only: the generator never sees data, so its layers are not part
    of the privacy argument."""

    def __init__(self, latent_dim: int, input_shape: tuple[int, ...], classes: int, hidden: int):
        super().__init__()
        self.latent_dim = latent_dim
        self.input_shape = tuple(input_shape)
        self.classes = classes
        c, h, w = self.input_shape
        if h % 4 or w % 4:
            raise ValueError(f"generator 'dcgan' needs image sides divisible by 4, got {h} x {w}")
        c1, c2 = max(hidden // 4, 8), max(hidden // 8, 8)
        self.start = (c1, h // 4, w // 4)
        self.fc = nn.Linear(latent_dim + classes, c1 * (h // 4) * (w // 4))
        self.net = nn.Sequential(
            nn.GroupNorm(8, c1), nn.ReLU(),
            nn.ConvTranspose2d(c1, c2, 4, 2, 1), nn.GroupNorm(8, c2), nn.ReLU(),
            nn.ConvTranspose2d(c2, c, 4, 2, 1), nn.Tanh())

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat([z, _onehot(y, self.classes)], dim=1))
        return self.net(h.view(-1, *self.start))


GENERATORS = {"mlp": Generator, "dcgan": ConvGenerator}


class DPGANModel(nn.Module):
    """The released pair: the generator and the (noisily trained, weight-clipped) critic."""

    def __init__(self, input_shape: tuple[int, ...], classes: int, latent_dim: int, hidden: int,
                 architecture: str = "mlp", generator: str = "mlp"):
        super().__init__()
        if generator not in GENERATORS:
            raise ValueError(f"generator must be one of {sorted(GENERATORS)}, got {generator!r}")
        self.generator = GENERATORS[generator](latent_dim, input_shape, classes, hidden)
        self.critic = Critic(input_shape, classes, hidden, architecture)
