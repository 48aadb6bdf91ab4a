"""Book-keeping per-example clipping (Bu, Wang, Zha & Karypis 2023, "Differentially Private
Optimization on Large Model at Small Cost", Alg. 1): the clipped sum of per-example gradients in
ONE backward pass, without autograd computing any parameter gradient.

For a batch of B examples with losses l_i, DP-SGD needs (Abadi et al. 2016, Alg. 1, "clip"):

    S = sum_i c_i g_i,   g_i = grad_theta l_i,   c_i = min(1, C / ||g_i||_2)

over the flat vector of all parameters. For a layer z = a W^T + b (linear; a convolution is one
after ``unfold``: a_i is [T, d] patches, z_i is [T, p] outputs, T the spatial positions), the
per-example weight gradient is g_i^W = dz_i^T a_i ([p, d]) and the bias gradient sum_t dz_i[t]
(dz_i = dl_i / dz_i, the layer's output gradient of example i). So:

1. **One backward pass** to the layers' outputs: ``torch.autograd.grad(sum_i l_i, [z_1..z_L])``
   (saved by forward hooks). Autograd computes the input gradients it needs on the way, but no
   parameter gradient.
2. **Per-example norms**, per layer, by the cheaper of two exact rules (the "mixed" rule of Bu et
   al. 2022, "Scalable and Efficient Training of Large Convolutional Neural Networks with DP"):
   * *ghost norm* (Goodfellow 2015; Li et al. 2022): ||g_i^W||^2 = sum_{t,s} (a_it . a_is)(dz_it . dz_is),
     cost O(T^2 (p + d)) per example; for T = 1 (a linear layer on vectors) ||a_i||^2 ||dz_i||^2;
   * *instantiation*: g_i^W = dz_i^T a_i, cost O(T p d) per example, then its norm;
   the clipped sum then costs O(p d) per example from the instantiated gradients, but another
   weight-gradient matmul O(T p d) after ghost norms, so instantiation costs O(T p d + p d) and
   the ghost route O(T^2 (p + d) + T p d): the rule (``prefer="mixed"``) instantiates when
   p d <= T^2 (p + d) and the B x p x d tensor stays under ``INST_MAX`` floats (memory), else
   uses ghost norms (Bu et al.'s rule 2 T^2 < p d compares the norm costs alone); ``"ghost"`` or
   ``"inst"`` force one (tests). GroupNorm's affine parameters: the per-example
   gradients (sum over positions of dz * x_hat, and of dz) are [B, C], always instantiated.
3. **Clipped sum**: c_i = C / (||g_i|| + 1e-6) capped at 1 (Opacus's factor), and the weight
   gradient of the *re-weighted* output gradients: S^W = sum_i c_i dz_i^T a_i, one matmul per
   layer, the same cost as the non-private weight gradient (or sum_i c_i g_i^W where g_i^W was
   instantiated).

The result is exact (no approximation; tested against a per-example clip-and-sum reference and
each layer's per-example norm against ``torch.func``). Supported parameterised modules:
``nn.Linear`` (inputs [B, d] or [B, ..., d]), ``nn.Conv2d`` (zero padding, any stride, dilation,
groups = 1), ``nn.GroupNorm``. Any other module with trainable parameters (e.g. the PixelDP
``BoundedConv2d``, whose kernel is renormalised in the forward pass) is refused with an error that
names it; use ``clipping="ghost"`` there. A module used twice in one forward pass is refused too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED = (nn.Linear, nn.Conv2d, nn.GroupNorm)
PREFER = ("mixed", "ghost", "inst")
INST_MAX = 1 << 26      # largest instantiated per-example weight gradient of one layer (B p d floats, 256 MB)


def _supported(module: nn.Module) -> bool:
    if type(module) not in SUPPORTED:        # subclasses may change the forward (BoundedConv2d)
        return False
    if isinstance(module, nn.Conv2d):
        return module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)
    return True


def check_model(model: nn.Module) -> list[nn.Module]:
    """The parameterised leaf modules of ``model`` (trainable parameters), or a ValueError naming the
    first one that book-keeping clipping cannot handle."""
    layers = []
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not _supported(m):
            raise ValueError(f"clipping: 'bk' cannot clip layer {name or 'model'!r} ({_type_path(m)}): it supports "
                             f"nn.Linear, nn.Conv2d (groups 1, zero padding) and nn.GroupNorm; {engines_that_can(m)}")
        layers.append(m)
    return layers


def _type_path(m: nn.Module) -> str:
    t = type(m)
    return f"{t.__module__}.{t.__qualname__}"


def engines_that_can(m: nn.Module) -> str:
    """Which other clipping engines handle the layer ``m`` (a phrase for error messages): Opacus's
    'ghost' and 'flat' through its per-sample gradient of that layer type, or through functorch
    (``torch.func``) for a layer type it has none for."""
    from opacus.grad_sample import GradSampleModule

    if type(m) in GradSampleModule.GRAD_SAMPLERS:
        return f"use clipping 'ghost' or 'flat' (Opacus has per-sample gradients of {type(m).__name__})"
    return (f"use clipping 'ghost' or 'flat' (Opacus computes per-sample gradients of {type(m).__name__} with "
            f"torch.func, which needs a forward pass free of in-place changes and batch statistics)")


def _patches(a: torch.Tensor, m: nn.Conv2d) -> torch.Tensor:
    """The convolution's input patches as a strided view [B, C, H_out, W_out, kh, kw] (what
    ``F.unfold`` gives, without its per-example im2col loop; one copy happens in the reshape)."""
    ph, pw = m.padding
    if ph or pw:
        a = F.pad(a, (pw, pw, ph, ph))
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    p = a.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)
    return p[..., ::dh, ::dw] if (dh > 1 or dw > 1) else p


class BookKeeper:
    """Forward hooks saving each supported layer's input and output; :meth:`clipped_sum` then
    computes sum_i min(1, C/||g_i||) g_i into ``p.grad`` of every trainable parameter."""

    def __init__(self, model: nn.Module, prefer: str = "mixed", rows_per_example: int = 1):
        if prefer not in PREFER:
            raise ValueError(f"prefer must be one of {PREFER}, got {prefer!r}")
        if rows_per_example < 1:
            raise ValueError(f"rows_per_example must be >= 1, got {rows_per_example}")
        self.model = model
        self.prefer = prefer
        # k > 1: rows i, B + i, ..., (k-1)B + i of a kB-row forward pass are ONE example (its gradient
        # is their sum, clipped once): per layer the k rows are concatenated along the position axis
        # (a linear layer on vectors becomes T = k positions, a convolution kT), so g_i^W =
        # sum_j dz_{jB+i}^T a_{jB+i} and the ghost-norm / instantiation rules apply exactly
        self.rows_per_example = rows_per_example
        self.layers = check_model(model)
        self._saved: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.enabled = False
        self._handles = [m.register_forward_hook(self._hook) for m in self.layers]

    def _hook(self, module, inputs, output):
        if not self.enabled:
            return
        if module in self._saved:
            raise ValueError(f"clipping: 'bk' needs every layer to run once per forward pass; "
                             f"{type(module).__name__} ran twice")
        self._saved[module] = (inputs[0].detach(), output, output._version)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ per layer
    def _per_layer(self, m: nn.Module, a: torch.Tensor, dz: torch.Tensor):
        """Squared per-example norms [B] of this layer's parameter gradients, and a closure giving
        the clipped sums (weight, bias) for factors c [B]."""
        k, rows = self.rows_per_example, a.shape[0]
        if rows % k:
            raise ValueError(f"clipping: {k} rows per example need a multiple of {k} rows, got {rows}")
        b = rows // k

        def fold(t: torch.Tensor) -> torch.Tensor:     # [kB, x, T] -> [B, x, kT] (rows jB + i -> example i)
            return t if k == 1 else t.reshape(k, b, *t.shape[1:]).permute(1, 2, 0, 3).reshape(b, t.shape[1], -1)

        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(a, m.num_groups, eps=m.eps)
            dims = tuple(range(2, dz.dim()))
            gw = (dz * xhat).sum(dims) if m.weight is not None else None      # [kB, C]
            gb = dz.sum(dims) if m.bias is not None else None
            gw, gb = (None if g is None else g.reshape(k, b, -1).sum(0) for g in (gw, gb))   # [B, C]
            sq = sum((g * g).sum(1) for g in (gw, gb) if g is not None)

            def clipped(c):
                return (None if gw is None else c @ gw), (None if gb is None else c @ gb)
            return sq, clipped

        # columns layout: u [B, d, T] (inputs / unfolded patches), g [B, p, T] (output gradients)
        conv = isinstance(m, nn.Conv2d)
        if conv:
            u = _patches(a, m).permute(0, 1, 4, 5, 2, 3).reshape(rows, -1, dz.shape[2] * dz.shape[3])   # [B, d, T]
            g = dz.reshape(rows, dz.shape[1], -1)
        else:
            u = a.reshape(rows, -1, a.shape[-1]).transpose(1, 2)
            g = dz.reshape(rows, -1, dz.shape[-1]).transpose(1, 2)
        u, g = fold(u), fold(g)
        d, t = u.shape[1], u.shape[2]
        p = g.shape[1]
        has_bias = m.bias is not None and m.bias.requires_grad
        gb = g.sum(2) if has_bias else None                  # [B, p]
        sq = (gb * gb).sum(1) if has_bias else torch.zeros(b, dtype=a.dtype, device=a.device)
        shape = m.weight.shape
        inst = None
        if t == 1:
            # rank one per example: ||dz_i a_i^T||^2 = ||a_i||^2 ||dz_i||^2
            u2, g2 = u[:, :, 0], g[:, :, 0]
            sq = sq + (u2 * u2).sum(1) * (g2 * g2).sum(1)

            def clipped(c):
                return (g2 * c[:, None]).t().mm(u2).reshape(shape), (None if gb is None else c @ gb)
            return sq, clipped
        if self.prefer == "inst" or (self.prefer == "mixed" and p * d <= t * t * (p + d) and b * p * d <= INST_MAX):
            inst = torch.bmm(g, u.transpose(1, 2))           # [B, p, d] per-example weight gradients
            flat = inst.reshape(b, -1)
            sq = sq + torch.linalg.vector_norm(flat, dim=1).square()
        else:
            aa = torch.bmm(u.transpose(1, 2), u)             # [B, T, T]
            gg = torch.bmm(g.transpose(1, 2), g)
            sq = sq + (aa * gg).sum((1, 2))

        def clipped(c):
            if inst is not None:
                w = (c @ inst.reshape(b, -1)).reshape(shape)
            elif conv:
                w = torch.nn.grad.conv2d_weight(a, shape, dz * c.repeat(k).reshape(-1, *([1] * (dz.dim() - 1))),
                                                stride=m.stride, padding=m.padding, dilation=m.dilation)
            else:
                w = torch.einsum("bpt,bdt->pd", g * c[:, None, None], u).reshape(shape)
            return w, (None if gb is None else c @ gb)
        return sq, clipped

    # ------------------------------------------------------------------ the step
    def per_example_norms(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, list]:
        """One backward pass of ``loss_sum`` (= sum_i l_i) to the saved layer outputs; the flat
        per-example gradient norms [B] and the per-layer clipped-sum closures."""
        mods = list(self._saved)
        if set(mods) != set(self.layers):
            missing = [type(m).__name__ for m in self.layers if m not in self._saved]
            raise ValueError(f"clipping: 'bk' saw no forward pass through {missing} (parameters outside the loss)")
        for m in mods:
            if self._saved[m][1]._version != self._saved[m][2]:
                self._saved.clear()
                raise ValueError(f"clipping: 'bk' needs each layer's output unchanged after the layer; the output of "
                                 f"{type(m).__name__} was modified in place (e.g. ReLU(inplace=True)): make it out of place")
        outs = [self._saved[m][1] for m in mods]
        grads = torch.autograd.grad(loss_sum, outs, allow_unused=True)
        sq, closures = None, []
        for m, dz in zip(mods, grads):
            a = self._saved[m][0]
            if dz is None:
                dz = torch.zeros_like(self._saved[m][1])
            s, clip = self._per_layer(m, a, dz.detach())
            sq = s if sq is None else sq + s
            closures.append((m, clip))
        self._saved.clear()
        return sq.clamp_min(0).sqrt(), closures

    def clipped_sum(self, loss_sum: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
        """Set ``p.grad`` = sum_i min(1, C / (||g_i|| + 1e-6)) g_i for every trainable parameter;
        returns the per-example norms ||g_i||."""
        norms, closures = self.per_example_norms(loss_sum)
        c = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        for m, clip in closures:
            w, b = clip(c)
            for p, g in ((m.weight, w), (getattr(m, "bias", None), b)):
                if p is not None and p.requires_grad and g is not None:
                    p.grad = g.to(p.dtype) if p.grad is None else p.grad + g.to(p.dtype)
        return norms
