"""Sound upper bounds on the l2 operator norm (spectral norm) of dense and convolutional layers.

Power iteration gives a LOWER bound of the spectral norm (a Rayleigh quotient) that reaches it only in
the limit; a network normalised by it may be more than 1-Lipschitz, and its certificate and its gradient
bound with it. The bounds here are upper bounds:

* dense ``W`` [out, in]: ||W||_2^2 = lambda_max(G), G = W W^T on the smaller side (m x m), in float64
  (u = 2^-53). The computed Gram is G + E with |E_ij| <= gamma_n sum_k |W_ik| |W_jk| (n the inner
  dimension, gamma_n = n u / (1 - n u); Higham, Accuracy and Stability of Numerical Algorithms, 2nd
  ed., Sec. 3.5), so ||E||_2 <= gamma_n ||W||_F^2; LAPACK's symmetric eigensolver is backward stable,
  its lambda_max within c m u ||G~||_2 of the computed Gram's (Golub & Van Loan, Matrix Computations,
  4th ed., Sec. 8.3; c = 10 taken here, generous). Both terms are added before the square root
  (Weyl's inequality), then the relative ``SAFETY``. (Full SVD gives the same to 1e-12, 10x slower.)
* convolution (zero padding p, stride s, kernel K [c_out, c_in, kh, kw], input h x w): embed the
  padded input in a torus of N_h x N_w = (h + 2 p_h) x (w + 2 p_w) pixels. The circular correlation
  on that torus equals the layer on every output position it computes (no index wraps around), and
  the layer's outputs are a subset of the circular ones (stride: a subsampling), so
  ||conv|| <= ||circ||. The circular operator is block-diagonalised by the 2-D DFT (Sedghi, Gupta &
  Long, ICLR 2019, Theorem 6): its singular values are exactly those of the N_h N_w matrices
  K_hat(omega) [c_out, c_in], computed batched in float64 (then ``SAFETY`` as above).

Both are exact up to rounding for the operator they bound; the conv bound is the circular operator's,
which may exceed the zero-padded layer's own norm slightly (sound, a little loose).
"""

from __future__ import annotations

import math

import torch

SAFETY = 1e-6   # relative margin over the float64 singular value (see the module docstring)


def dense_norm_bound(weight: torch.Tensor) -> float:
    """An upper bound of ||W||_2 for a dense weight [out, in] (module docstring: float64 Gram on the
    smaller side, its rounding and the eigensolver's error added, times 1 + SAFETY)."""
    w = weight.detach().to("cpu", torch.float64)
    if w.shape[0] > w.shape[1]:
        w = w.t()
    m, n = w.shape
    u = 2.0 ** -53
    gram = w @ w.t()
    lam = float(torch.linalg.eigvalsh(gram)[-1])
    gamma = n * u / (1 - n * u)
    slack = gamma * float(w.pow(2).sum()) + 10 * m * u * max(abs(lam), 0.0)
    return math.sqrt(max(lam, 0.0) + slack) * (1.0 + SAFETY)


def conv_norm_bound(kernel: torch.Tensor, input_hw: tuple[int, int], padding: tuple[int, int]) -> float:
    """An upper bound of the l2 operator norm of ``conv2d(x, kernel, padding=padding, stride=any)`` on
    inputs of spatial size ``input_hw`` (the module docstring: the circular operator on the padded torus)."""
    k = kernel.detach().to("cpu", torch.float64)
    c_out, c_in, kh, kw = k.shape
    n_h, n_w = input_hw[0] + 2 * padding[0], input_hw[1] + 2 * padding[1]
    if n_h < kh or n_w < kw:
        raise ValueError(f"input_hw: {input_hw} with padding {padding} is smaller than the {kh} x {kw} kernel")
    spectrum = torch.fft.fft2(k, s=(n_h, n_w))                 # [c_out, c_in, n_h, n_w] complex
    blocks = spectrum.permute(2, 3, 0, 1).reshape(-1, c_out, c_in)
    return float(torch.linalg.matrix_norm(blocks, ord=2).max()) * (1.0 + SAFETY)


def power_iteration_lower_bound(linear_map, shape: tuple[int, ...], iters: int = 200,
                                generator: torch.Generator | None = None) -> float:
    """A LOWER bound of the operator norm of a linear map (any function of a batch, e.g. a layer without
    bias) by power iteration on A^T A through autograd: ||A v|| / ||v|| for the last iterate v. Used by
    the tests against the upper bounds above, never to normalise a layer."""
    v = torch.randn((1, *shape), generator=generator, dtype=torch.float64)
    value = 0.0
    for _ in range(iters):
        v = (v / v.norm()).requires_grad_(True)
        out = linear_map(v)
        value = float(out.detach().norm())
        (grad,) = torch.autograd.grad(0.5 * out.pow(2).sum(), v)
        v = grad.detach()
        if v.norm() == 0:
            return 0.0
    return value
