"""PixelDP's noise layer and the sensitivity-bounded layers in front of it.

Lecuyer et al. (2018), Sec. 3: a network ``f = h(g(x) + Z)`` whose pre-noise part ``g`` has
bounded sensitivity Delta_{p,q} and whose noise ``Z`` is calibrated to (epsilon, delta, L,
Delta) is (epsilon, delta)-PixelDP against attacks of p-norm size L (their Lemma 1 / Eq. 3):

* l2 attacks: Gaussian noise, sigma = sqrt(2 ln(1.25/delta)) Delta_{2,2} L / epsilon
  (epsilon <= 1; the analytic Gaussian of Balle & Wang beyond);
* l1 attacks: Laplace noise, b = Delta_{1,1} L / epsilon.

The noise is drawn at training and at prediction time, always from an explicit generator.

Sensitivity control (docs/pixeldp.md): the first convolution is normalised *in its forward
pass* by a provable upper bound of its operator norm, so Delta <= 1 holds at every step of
training and at certification, not only after a projection step:

* l2: ||conv||_{2->2} <= ||W_flat||_2 * ceil(k/s) (each input pixel lies in at most
  ceil(k/s)^2 patches), computed exactly from the small flattened kernel by an SVD;
* l1: ||conv||_{1->1} <= max_c sum_{o,u,v} |W[o,c,u,v]| (each input pixel meets each kernel
  weight at most once).

``exact_sensitivity`` then measures the operator norm of the layer as actually applied to the
input shape (a dense float64 matrix), which the certifier uses to correct the certified size
when the bound is not tight.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.mechanisms import analytic_gaussian_sigma, gaussian_sigma, laplace_scale

NORMS = ("l2", "l1")


def pixeldp_noise_scale(epsilon: float, delta: float, attack_bound: float, sensitivity: float = 1.0,
                        norm: str = "l2") -> float:
    """Noise scale of the PixelDP noise layer (Lecuyer et al. 2018, Sec. 3.2).

    l2: Gaussian sigma for L2 sensitivity ``sensitivity * attack_bound`` (the classic bound for
    epsilon <= 1 as in the reference ``_dp_mult``, the analytic Gaussian for epsilon > 1);
    l1: Laplace scale ``sensitivity * attack_bound / epsilon`` (delta unused).
    """
    norm = v.choice("norm", norm, NORMS)
    epsilon = v.positive("epsilon", epsilon)
    attack_bound = v.positive("attack_bound", attack_bound)
    sensitivity = v.positive("sensitivity", sensitivity)
    if norm == "l1":
        return laplace_scale(epsilon, sensitivity * attack_bound)
    delta = v.open_unit("delta", delta)
    if epsilon <= 1.0:
        return gaussian_sigma(epsilon, delta, sensitivity * attack_bound)
    return analytic_gaussian_sigma(epsilon, delta, sensitivity * attack_bound)


def _resolved(device: torch.device) -> torch.device:
    """``device`` with its index: an accelerator named without one ("cuda") is its current device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


STREAMS = 4  # independent generator streams per noise layer (fixed, so draws do not depend on threads)
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=STREAMS, thread_name_prefix="dpmech-noise")
    return _POOL


def _fill_gaussian(chunk: torch.Tensor, scale: float, gen: torch.Generator) -> None:
    chunk.normal_(0.0, scale, generator=gen)


def _fill_laplace(chunk: torch.Tensor, scale: float, gen: torch.Generator) -> None:
    """Laplace(0, scale) from one uniform per entry: the top bit is the sign, the rest an
    Exp(1) variable -log1p(-w) with w in [0, 1), which is always finite."""
    u = chunk.uniform_(0.0, 1.0, generator=gen)
    neg = u < 0.5
    w = torch.where(neg, 2.0 * u, 2.0 * u - 1.0)
    e = torch.log1p(-w).neg_().mul_(scale)
    chunk.copy_(torch.where(neg, -e, e))


class NoiseLayer(nn.Module):
    """Adds Gaussian (l2) or Laplace (l1) noise of scale ``scale * ramp`` on every call.

    Draws come from ``STREAMS`` generators seeded from ``seed``; on the CPU the streams fill
    their slices of the noise tensor in parallel threads (one CPU generator is sequential and
    was the bottleneck of certification), on a GPU one CUDA generator fills it. ``ramp`` in
    [0, 1] implements the optional noise ramp-up of training; it is 1 whenever a guarantee is
    claimed (certification refuses a model whose ramp is below 1).
    """

    def __init__(self, scale: float, norm: str = "l2", seed: int = 0):
        super().__init__()
        self.norm = v.choice("norm", norm, NORMS)
        self.scale = v.positive("scale", scale)
        self.ramp = 1.0
        self._seed = int(seed)
        self._gens: list[torch.Generator] = []

    def extra_repr(self) -> str:
        kind = "gaussian" if self.norm == "l2" else "laplace"
        return f"{kind}, scale={self.scale:.5g}, ramp={self.ramp:.3g}"

    def generators(self, device: torch.device) -> list[torch.Generator]:
        """The layer's generators on ``device`` (re-created, seeded deterministically, on a move).
        ``"cuda"`` and ``"cuda:<current device>"`` are the same device (a trainer given "cuda" asks
        for its checkpoint's state with the one, the forward pass draws with the other): comparing
        them as different would re-seed the streams, i.e. restart the noise, at every checkpoint."""
        device = torch.device(device)
        if not self._gens or _resolved(self._gens[0].device) != _resolved(device):
            n = 1 if device.type != "cpu" else STREAMS
            self._gens = [torch.Generator(device=device).manual_seed(self._seed * 7919 + i) for i in range(n)]
        return self._gens

    def get_rng_state(self, device: torch.device) -> list[torch.Tensor]:
        return [g.get_state() for g in self.generators(device)]

    def set_rng_state(self, device: torch.device, states: list[torch.Tensor]) -> None:
        gens = self.generators(device)
        if len(states) != len(gens):
            raise ValueError(f"noise RNG state has {len(states)} streams, the layer uses {len(gens)}")
        for g, st in zip(gens, states):
            g.set_state(st.cpu() if st.device.type != "cpu" else st)

    def sample(self, like: torch.Tensor) -> torch.Tensor:
        """Fresh noise shaped like ``like``."""
        return self.sample_shape(like.shape, like.dtype, like.device)

    def sample_shape(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        gens = self.generators(device)
        scale = self.scale * self.ramp
        fill = _fill_gaussian if self.norm == "l2" else _fill_laplace
        if len(gens) == 1:
            fill(out, scale, gens[0])
            return out
        chunks = out.view(-1).chunk(len(gens))
        list(_pool().map(fill, chunks, [scale] * len(chunks), gens[:len(chunks)]))
        return out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.ramp <= 0.0:
            return h
        return self.sample(h).add_(h)


class BoundedConv2d(nn.Conv2d):
    """A convolution whose operator norm (l2->l2 or l1->l1) is at most 1 by construction.

    The kernel is divided by a provable upper bound of the layer's operator norm in every
    forward pass (see the module docstring); gradients flow through the normalisation, as in
    spectral normalisation, so training cannot push the sensitivity above 1.
    """

    def __init__(self, *args, norm: str = "l2", **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = v.choice("norm", norm, NORMS)
        if self.groups != 1 or self.dilation != (1, 1):
            raise ValueError("BoundedConv2d supports groups=1 and dilation=1 only")

    def overlap_factor(self) -> int:
        """Max number of patches an input pixel belongs to: ceil(kh/sh) * ceil(kw/sw)."""
        kh, kw = self.kernel_size
        sh, sw = self.stride
        return math.ceil(kh / sh) * math.ceil(kw / sw)

    def norm_bound(self) -> torch.Tensor:
        """Provable upper bound of the operator norm of the un-normalised kernel."""
        w = self.weight
        if self.norm == "l2":
            flat = w.reshape(w.shape[0], -1)
            return torch.linalg.matrix_norm(flat, ord=2) * math.sqrt(self.overlap_factor())
        return w.abs().sum(dim=(0, 2, 3)).max()

    def normalised_weight(self) -> torch.Tensor:
        return self.weight / self.norm_bound().clamp_min(1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.normalised_weight(), self.bias)


@torch.no_grad()
def exact_sensitivity(layer: nn.Module, input_shape: tuple[int, ...], norm: str = "l2") -> float:
    """Operator norm of a linear layer (bias ignored) on inputs of ``input_shape`` (C, H, W).

    Builds the layer's dense matrix in float64 from the images of the basis vectors and returns
    its largest singular value (l2) or largest column l1 norm (l1). Exact up to float64
    rounding; used to tighten the certified size when the construction bound is loose.
    """
    norm = v.choice("norm", norm, NORMS)
    d = int(math.prod(input_shape))
    if d > 4096:
        raise ValueError(f"input_shape must have at most 4096 entries for the dense computation, got {d}")
    device = next(layer.parameters()).device
    basis = torch.eye(d, dtype=torch.float64, device=device).reshape(d, *input_shape)
    if isinstance(layer, BoundedConv2d):
        w = layer.normalised_weight().double()
        out = F.conv2d(basis, w, None, layer.stride, layer.padding, layer.dilation, layer.groups)
    else:  # any other linear module, evaluated in its own dtype, bias removed by differencing
        dtype = next(layer.parameters()).dtype
        zero = layer(torch.zeros(1, *input_shape, dtype=dtype, device=device)).double()
        out = layer(basis.to(dtype)).double() - zero
    m = out.reshape(d, -1)  # row i = image of basis vector i, i.e. M^T
    if norm == "l2":
        gram = m @ m.T  # d x d, = M^T M
        return float(torch.linalg.eigvalsh(gram)[-1].clamp_min(0).sqrt())
    return float(m.abs().sum(dim=1).max())
