"""DPAL's perturbed objective functions and the coefficients whose sensitivities Lemmas 2 and 4 bound.

* ``reconstruction_loss``: the perturbed first-order Taylor reconstruction function R_bar (Eq. 7),
  sum_i [sum_j 1/2 theta_1j h_bar_i - x_bar_i . x_tilde_i] = sum_i <1/2 - x_bar_i, x_tilde_i>,
  with x_tilde_i = theta_1 h_bar_i (the constant d log 2 of Eq. 6 is dropped).
* ``reconstruction_coefficients``: the coefficients {h_i / 2, x_ij} of Eq. 6 per feature map, laid out
  as in the proof of Lemma 2 (one copy of sum_i h_i / 2 and one sum_i x_ij for each of the d inputs).
* ``taylor_label_free`` / ``label_coefficients`` / ``dp_taylor_loss``: Eq. 11, the second-order Taylor
  expansion of the (per-class logistic) cross-entropy, split into the label-free part L_1 and the
  label part L_2 = sum_k sum_i (h_pi,i y_ik) W_pi,k whose coefficients get chi_3 (Lemma 4, Theorem 3).
* ``dp_adversarial_objective``: Eq. 10, (L_bar(B) + xi Upsilon_bar(B_adv)) / (m (1 + xi)).
"""

from __future__ import annotations

import math

import torch

LOG2 = math.log(2.0)


def reconstruction_loss(x_bar: torch.Tensor, h_bar: torch.Tensor, decode) -> torch.Tensor:
    """Eq. 7: R_bar = sum_i <1/2 - x_bar_i, theta_1 h_bar_i> summed over the batch.

    Eq. 6 expands F_1j(z) = x log(1 + e^-z) and F_2j(z) = (1 - x) log(1 + e^z) at z = 0 to first
    order: log 2 + (1/2 - x_ij) z with z = theta_1j h_i; summing over j gives <1/2 - x_i, x_tilde_i>.
    ``decode`` maps h_bar to the reconstruction x_tilde (tied weights).
    """
    x_tilde = decode(h_bar)
    return ((0.5 - x_bar) * x_tilde).sum()


def reconstruction_coefficients(x_patch: torch.Tensor, h_map: torch.Tensor) -> torch.Tensor:
    """Lemma 2's coefficients of one batch for one feature map: a [d, beta + 1] tensor whose row j is
    (sum_i h_i / 2, sum_i x_ij). ``x_patch`` is [m, d] (the d inputs a hidden neuron reads), ``h_map``
    [m, beta] (the feature map). Its L1 change between neighbouring batches is at most d (beta + 2)."""
    if x_patch.dim() != 2 or h_map.dim() != 2 or x_patch.shape[0] != h_map.shape[0]:
        raise ValueError("x_patch must be [m, d] and h_map [m, beta] with the same m")
    d = x_patch.shape[1]
    half_h = (h_map / 2).sum(0)                      # [beta]
    xs = x_patch.sum(0)                              # [d]
    return torch.cat([half_h.unsqueeze(0).expand(d, -1), xs.unsqueeze(1)], dim=1)


def taylor_label_free(z: torch.Tensor) -> torch.Tensor:
    """L_1 of Eq. 11 per example: sum_k [log 2 + z_k / 2 + z_k^2 / 8], the label-free part of the
    second-order expansion of log(1 + e^z) - z y at z = 0."""
    return (LOG2 + z / 2 + z * z / 8).sum(dim=1)


def label_coefficients(h_pi: torch.Tensor, y_onehot: torch.Tensor) -> torch.Tensor:
    """Lemma 4's coefficients sum_i h_pi,i y_ik of one batch, as a [|h_pi|, K] matrix."""
    return h_pi.transpose(0, 1) @ y_onehot


def dp_taylor_loss(h_pi: torch.Tensor, y_onehot: torch.Tensor, w_pi: torch.Tensor,
                   chi3: torch.Tensor) -> torch.Tensor:
    """The perturbed Eq. 11 for one batch: sum_i L_1(z_i) - <sum_i h_pi,i y_i^T + chi_3, W_pi>.

    chi_3 (Laplace, scale Delta_L2 / eps_2, drawn once) is the sum over the batch of the paper's
    per-example shares (1/m) Lap(Delta_L2 / eps_2).
    """
    z = h_pi @ w_pi
    coeff = label_coefficients(h_pi, y_onehot) + chi3
    return taylor_label_free(z).sum() - (coeff * w_pi).sum()


def dp_adversarial_objective(h_pi: torch.Tensor, y_onehot: torch.Tensor, h_pi_adv: torch.Tensor,
                             y_adv_onehot: torch.Tensor, w_pi: torch.Tensor, chi3: torch.Tensor,
                             xi: float) -> torch.Tensor:
    """Eq. 10: (L_bar(B_t) + xi Upsilon_bar(B_adv)) / (m + xi m_adv), both terms perturbed by Eq. 11.

    Only L_bar + xi Upsilon_bar enters the gradient, so its label coefficients are
    C(B_t) + xi C(B_adv) + (1 + xi) chi_3; an example lies in one of the two disjoint batches, so
    that sum changes by at most max(1, xi) Delta_L2 while its noise has scale (1 + xi) Delta_L2 / eps_2:
    the reuse of chi_3 in both terms is within eps_2.
    """
    benign = dp_taylor_loss(h_pi, y_onehot, w_pi, chi3)
    adv = dp_taylor_loss(h_pi_adv, y_adv_onehot, w_pi, chi3)
    return (benign + xi * adv) / (h_pi.shape[0] + xi * h_pi_adv.shape[0])
