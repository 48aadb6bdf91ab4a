"""1-Lipschitz building blocks (l2 norm), each declaring the constants the gradient bound and the
certificate need (Bethune et al., ICLR 2024, Sec. 2: every layer is Lipschitz in its input with a known
constant and, when it has parameters, Lipschitz in its parameters with a constant proportional to the
norm of its input).

Every layer ``f`` here maps 0 to 0 (no biases), so ||f(x)|| <= Lip(f) ||x||: a bound on the input norm
propagates forward. Layers with parameters declare ``param_gradient_factor`` c with
||d loss / d theta|| <= c ||x|| ||d loss / d f(x)|| (proof of each in its docstring) and are kept
Lipschitz by :meth:`project_` after every update (post-processing of the noisy gradient). The constant a
layer declares (``lipschitz_bound``) is a sound upper bound computed from its current weights
(:mod:`dpmech.lipschitz.bounds`), never an estimate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dpmech.lipschitz.bounds import conv_norm_bound, dense_norm_bound


class InputClip(nn.Module):
    """x -> P_R(x - c): subtract a public constant ``center`` (in the [-1, 1] domain; -1 sends MNIST's
    background to 0) and project onto the l2 ball of radius ``radius`` (lip-dp's input clipping). A
    translation and a projection onto a convex set: 1-Lipschitz; every output has norm <= radius, the
    input bound X_0 of the gradient bound."""

    def __init__(self, center: float = -1.0, radius: float = 10.0):
        super().__init__()
        if not (math.isfinite(radius) and radius > 0):
            raise ValueError(f"radius: must be a positive number, got {radius}")
        self.center, self.radius = float(center), float(radius)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x - self.center
        norm = z.flatten(1).norm(dim=1).clamp_min(1e-12)
        scale = (self.radius / norm).clamp(max=1.0)
        return z * scale.view(-1, *([1] * (z.dim() - 1)))

    def lipschitz_bound(self) -> float:
        return 1.0


class GroupSort2(nn.Module):
    """GroupSort with groups of 2 along dim 1 (MaxMin; Anil, Lucas & Grosse, ICML 2019): each pair
    (a, b) -> (max, min). A permutation of each pair, so it preserves the norm and is 1-Lipschitz
    (sorting is 1-Lipschitz in l2); maps 0 to 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % 2:
            raise ValueError(f"input: GroupSort2 needs an even number of channels, got {x.shape[1]}")
        a, b = x.unflatten(1, (x.shape[1] // 2, 2)).unbind(2)
        return torch.stack((torch.maximum(a, b), torch.minimum(a, b)), dim=2).flatten(1, 2)

    def lipschitz_bound(self) -> float:
        return 1.0


class L2NormPool2d(nn.Module):
    """l2-norm pooling over non-overlapping k x k windows: each window v -> sqrt(||v||^2 + e) - sqrt(e)
    (lip-dp's ScaledL2NormPooling2D with the smoothing e made to vanish at 0). Its gradient
    v / sqrt(||v||^2 + e) has norm < 1 and the windows are disjoint, so it is 1-Lipschitz; it maps 0 to
    0 and shrinks norms."""

    def __init__(self, kernel: int = 2, eps: float = 1e-6):
        super().__init__()
        self.kernel, self.eps = int(kernel), float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel
        s = F.avg_pool2d(x * x, k, stride=k) * (k * k)
        return torch.sqrt(s + self.eps) - math.sqrt(self.eps)

    def lipschitz_bound(self) -> float:
        return 1.0


class Flatten(nn.Flatten):
    """A reshape: an isometry."""

    def lipschitz_bound(self) -> float:
        return 1.0


def _bjorck_(w: torch.Tensor, iters: int) -> None:
    """Bjorck & Bowie (1971) orthonormalisation, in place: W <- W (3/2 I - 1/2 W^T W), ``iters`` times (its
    singular values move towards 1 when they are in (0, sqrt(3))). Only improves conditioning; the
    layer's Lipschitz constant is then bounded soundly by :meth:`project_`'s rescaling."""
    for _ in range(iters):
        w.copy_(1.5 * w - 0.5 * (w @ w.t()) @ w if w.shape[0] <= w.shape[1] else 1.5 * w - 0.5 * w @ (w.t() @ w))


class _CachedBound(nn.Module):
    """The sound bound of the weight, recomputed only when the weight changed (its tensor version
    counter, bumped by every in-place update: optimizer steps, projections, load_state_dict)."""

    _bound_cache: tuple | None = None

    def lipschitz_bound(self) -> float:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._bound_cache is None or self._bound_cache[0] != key:
            self._bound_cache = (key, self._compute_bound())
        return self._bound_cache[1]


class LipschitzDense(_CachedBound):
    """y = W x without bias, ||W||_2 <= 1 kept by :meth:`project_`.

    Parameter gradient: d loss / dW = g x^T for g = d loss / dy, and ||g x^T||_F = ||g|| ||x||, so
    ``param_gradient_factor`` = 1 (lip-dp's backpropagate_params of SpectralDense)."""

    param_gradient_factor = 1.0

    def __init__(self, in_features: int, out_features: int, bjorck_iters: int = 0,
                 generator: torch.Generator | None = None):
        super().__init__()
        w = torch.empty(out_features, in_features)
        nn.init.orthogonal_(w, generator=generator)
        self.weight = nn.Parameter(w)
        self.bjorck_iters = int(bjorck_iters)
        self.project_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def _compute_bound(self) -> float:
        return dense_norm_bound(self.weight)

    @torch.no_grad()
    def project_(self) -> None:
        """Optional Bjorck steps, then W <- W / max(1, bound(W)) with the sound bound of
        :func:`dense_norm_bound` (the division's rounding is absorbed by the bound's SAFETY margin:
        checked by ``lipschitz_bound`` <= 1 + 2 SAFETY in the tests)."""
        w = self.weight
        if self.bjorck_iters:
            _bjorck_(w, self.bjorck_iters)
        bound = self.lipschitz_bound()
        if bound > 1.0:
            w.div_(bound)


class LipschitzConv2d(_CachedBound):
    """2-D convolution without bias (zero padding, stride ``stride``), its operator norm on
    ``input_hw`` inputs kept <= 1 by :meth:`project_` with the sound bound of :func:`conv_norm_bound`.

    Parameter gradient: d loss / dK[:, :, a, b] = G X_ab^T, with G [c_out, P] the output gradient and
    X_ab [c_in, P] the padded input seen at offset (a, b); ||G X_ab^T||_F <= ||G||_F ||X_ab||_F <=
    ||g|| ||x|| (X_ab holds a subset of x's entries, each at most once). Summing the squares over the
    kh kw offsets: ||dK|| <= sqrt(kh kw) ||x|| ||g||, ``param_gradient_factor`` = sqrt(kh kw) (lip-dp's
    backpropagate_params of SpectralConv2D, without its padding coefficient)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, input_hw: tuple[int, int],
                 stride: int = 1, padding: int | None = None, generator: torch.Generator | None = None):
        super().__init__()
        k = int(kernel_size)
        self.stride, self.padding = int(stride), (k // 2 if padding is None else int(padding))
        self.input_hw = (int(input_hw[0]), int(input_hw[1]))
        w = torch.empty(out_channels, in_channels * k * k)
        nn.init.orthogonal_(w, generator=generator)
        self.weight = nn.Parameter(w.view(out_channels, in_channels, k, k) / k)
        self.param_gradient_factor = float(k)          # sqrt(kh kw) for a square kernel
        self.project_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, stride=self.stride, padding=self.padding)

    def output_hw(self) -> tuple[int, int]:
        k, p, s = self.weight.shape[-1], self.padding, self.stride
        return tuple((n + 2 * p - k) // s + 1 for n in self.input_hw)

    def _compute_bound(self) -> float:
        return conv_norm_bound(self.weight, self.input_hw, (self.padding, self.padding))

    @torch.no_grad()
    def project_(self) -> None:
        bound = self.lipschitz_bound()
        if bound > 1.0:
            self.weight.div_(bound)
