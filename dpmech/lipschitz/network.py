"""Lipschitz networks: a sequence of the layers of :mod:`dpmech.lipschitz.layers`, its Lipschitz
constant and the a-priori bound of every per-example parameter gradient.

**Lipschitz constant** (the certificate's L): the product of the layers' sound bounds (composition).

**Per-example gradient bound** (Bethune et al., ICLR 2024, Sec. 2, "Clipless DP-SGD": the bound is
computed by a forward pass of input-norm bounds and a backward pass of gradient-norm bounds, lip-dp's
``compute_gradient_bounds``). For layers f_1 .. f_n (f_1 the input clip), the loss l(z, y)
``loss_lipschitz``-Lipschitz in the logits z, and any input x and label y:

* forward: ||x_1|| <= R (the input clip's radius); ||x_{i+1}|| = ||f_i(x_i)|| <= L_i ||x_i|| (every layer
  maps 0 to 0), so X_i = R prod_{k<i} L_k bounds the input of layer i;
* backward: ||d l / d z|| <= loss_lipschitz, and ||d l / d x_i|| <= L_i ||d l / d x_{i+1}|| (a
  Jacobian of an L-Lipschitz map has norm <= L), so G_i = loss_lipschitz prod_{k>i} L_k bounds the
  gradient at the output of layer i;
* layer i's parameters: ||d l / d theta_i|| <= c_i X_i G_i (``param_gradient_factor`` c_i, proved
  per layer in :mod:`dpmech.lipschitz.layers`).

So Delta_i = c_i X_i G_i bounds the per-example gradient of layer i whatever the example: the L2
sensitivity of the sum of per-example gradients of layer i under adding or removing one example, with
no clipping. The bound uses the layers' current weights (public: the result of earlier noisy steps).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpmech.lipschitz.layers import (
    Flatten,
    GroupSort2,
    InputClip,
    L2NormPool2d,
    LipschitzConv2d,
    LipschitzDense,
)


class LipschitzSequential(nn.Sequential):
    """A sequence whose first layer is an :class:`InputClip` and whose every layer declares
    ``lipschitz_bound()`` (checked at construction)."""

    def __init__(self, *layers: nn.Module):
        super().__init__(*layers)
        if not layers or not isinstance(layers[0], InputClip):
            raise ValueError("layers: the first layer must be an InputClip (the input-norm bound R)")
        for i, layer in enumerate(layers):
            if not hasattr(layer, "lipschitz_bound"):
                raise ValueError(f"layers[{i}]: {type(layer).__name__} declares no lipschitz_bound()")
            if any(True for _ in layer.parameters(recurse=False)) and not hasattr(layer, "param_gradient_factor"):
                raise ValueError(f"layers[{i}]: {type(layer).__name__} has parameters but no param_gradient_factor")

    @property
    def input_radius(self) -> float:
        return self[0].radius

    def layer_bounds(self) -> list[float]:
        return [float(layer.lipschitz_bound()) for layer in self]

    def lipschitz_bound(self) -> float:
        """L: an upper bound of the network's l2 Lipschitz constant (product of the layers' bounds)."""
        return math.prod(self.layer_bounds())

    def parameterised(self) -> list[int]:
        """Indices of the layers with parameters, in order."""
        return [i for i, layer in enumerate(self) if any(True for _ in layer.parameters(recurse=False))]

    def gradient_bounds(self, loss_lipschitz: float) -> list[float]:
        """Delta_i of the module docstring for each layer with parameters (order of ``parameterised``)."""
        lips = self.layer_bounds()
        out = []
        for i in self.parameterised():
            x_i = self.input_radius * math.prod(lips[1:i])           # layer 0 is the clip: ||x_1|| <= R
            g_i = loss_lipschitz * math.prod(lips[i + 1:])
            out.append(self[i].param_gradient_factor * x_i * g_i)
        return out

    @torch.no_grad()
    def project_(self) -> None:
        """Every layer with parameters back to Lipschitz <= 1 (post-processing of an update)."""
        for layer in self:
            if hasattr(layer, "project_"):
                layer.project_()


def mnist_lipschitz_cnn(seed: int = 0, input_radius: float = 10.0, input_center: float = -1.0, width: int = 16,
                        hidden: int = 256, classes: int = 10, bjorck_iters: int = 0) -> LipschitzSequential:
    """A small 1-Lipschitz MNIST network (after lip-dp's MNIST ConvNet, without biases or centering):
    clip -> conv 3x3 (width) -> GroupSort2 -> l2-pool 2 -> conv 3x3 (2 width) -> GroupSort2 -> l2-pool 2
    -> flatten -> dense (hidden) -> GroupSort2 -> dense (classes). Inputs [N, 1, 28, 28] in [-1, 1]."""
    gen = torch.Generator().manual_seed(int(seed))
    return LipschitzSequential(
        InputClip(input_center, input_radius),
        LipschitzConv2d(1, width, 3, (28, 28), generator=gen), GroupSort2(), L2NormPool2d(2),
        LipschitzConv2d(width, 2 * width, 3, (14, 14), generator=gen), GroupSort2(), L2NormPool2d(2),
        Flatten(),
        LipschitzDense(2 * width * 49, hidden, bjorck_iters, generator=gen), GroupSort2(),
        LipschitzDense(hidden, classes, bjorck_iters, generator=gen))


def lipschitz_mlp(in_features: int, hidden: int, classes: int, seed: int = 0, input_radius: float = 1.0,
                  input_center: float = 0.0, depth: int = 2, bjorck_iters: int = 0) -> LipschitzSequential:
    """A small 1-Lipschitz MLP on flat inputs (the tests' networks): clip -> (dense -> GroupSort2) x
    (depth - 1) -> dense."""
    gen = torch.Generator().manual_seed(int(seed))
    layers: list[nn.Module] = [InputClip(input_center, input_radius)]
    width = in_features
    for _ in range(depth - 1):
        layers += [LipschitzDense(width, hidden, bjorck_iters, generator=gen), GroupSort2()]
        width = hidden
    layers.append(LipschitzDense(width, classes, bjorck_iters, generator=gen))
    return LipschitzSequential(*layers)
