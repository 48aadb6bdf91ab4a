"""Max pooling that is fast where certification spends its time: under ``torch.no_grad``.

Randomized smoothing's CERTIFY (Cohen et al. 2019, Alg. "certify") sends N = 100,000 noisy copies
of every certified image through the base classifier, so the base classifier's inference speed
decides what a certification costs. PyTorch's CPU kernel for ``nn.MaxPool2d`` is slow for the
small overlapping windows of Tramer & Boneh's MNIST CNN (2 x 2, stride 1): measured on one core
of this machine it took 58% of that network's forward pass (243 of 420 ms for 4,096 images).

:class:`FastMaxPool2d` computes the same function as the element-wise maximum of the
``kernel_size ** 2`` strided slices of its input (output[o] = max_(i, j) x[s o + (i, j)]), which
is the definition of max pooling without padding or dilation (taken over the window's rows, then its
columns: kh + kw - 2 maxima instead of kh kw - 1); a maximum is exact, so the values
are bit-for-bit those of ``F.max_pool2d`` (tests/test_pooling.py checks it, ties included). It is
used only when no gradient is recorded: with autograd on, PyTorch's own kernel runs, so training,
per-example gradients (Opacus, BookKeeper, ``torch.func``) and attacks see the gradient PyTorch
defines (one input of a tied window gets it, where the slices' maximum would split it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class FastMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose forward without autograd is a maximum of strided slices (same values).

    Other settings (padding, dilation, ceil_mode, return_indices) always take PyTorch's kernel.
    """

    def _sliceable(self) -> bool:
        pair = nn.modules.utils._pair
        return (pair(self.padding) == (0, 0) and pair(self.dilation) == (1, 1)
                and not self.ceil_mode and not self.return_indices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not self._sliceable():
            return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                                ceil_mode=self.ceil_mode, return_indices=self.return_indices)
        kh, kw = nn.modules.utils._pair(self.kernel_size)
        sh, sw = nn.modules.utils._pair(self.stride if self.stride is not None else self.kernel_size)
        h, w = x.shape[-2], x.shape[-1]
        oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
        if oh < 1 or ow < 1:
            return F.max_pool2d(x, self.kernel_size, self.stride)   # PyTorch's own error message
        rows = None                    # separable: the maximum over the window's rows, then its columns
        for i in range(kh):
            sl = x[..., i:i + sh * (oh - 1) + 1:sh, :]
            rows = sl if rows is None else torch.maximum(rows, sl)
        out = None
        for j in range(kw):
            sl = rows[..., j:j + sw * (ow - 1) + 1:sw]
            out = sl if out is None else torch.maximum(out, sl)
        return out.clone() if kh * kw == 1 else out      # never a view of the input
