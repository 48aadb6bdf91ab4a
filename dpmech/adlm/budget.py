"""AdLM's privacy budget: the split of a target epsilon into eps_1 + eps_2 + eps_3, the three
sensitivities, the relevance-adaptive redistribution of eps_2 over the input features, and the
Laplace scales that realise each component.

References are to "Adaptive Laplace Mechanism: Differential Privacy Preservation in Deep Learning"
(Phan, Wu, Hu & Dou, ICDM 2017, arXiv 1709.05750), Algorithm 1:

* lines 1-7   the average relevance R_j(D) of every input feature (LRP), released with
              Lap(Delta_R / eps_1) (``relevance_sensitivity``);
* lines 8-14  the first affine transformation of a batch, sum_{x_i in L} W^T x_i, perturbed through its
              coefficients sum_{x_i in L} x_ij; feature j gets the budget share beta_j eps_2 / d with
              beta_j = d R_bar_j / sum_k R_bar_k (``redistribute``), so more relevant features get less
              noise; the shares add up to eps_2 (``feature_scales``, ``features_epsilon``);
* lines 16-19 the label coefficients of the Taylor-expanded loss at the output layer, perturbed with
              Lap(Delta_L / eps_3) (Delta_L = 2 |h_pi|: ``dpmech.dpal.budget.delta_l2``);
* Theorem     the whole of Algorithm 1 is (eps_1 + eps_2 + eps_3)-DP; the experiments split a target
              epsilon evenly, eps_1 = eps_2 = eps_3 = eps / 3 (``split_budget``).

What these numbers do and do not guarantee is in docs/adlm.md ("What the budget means"): they are the
paper's accounting, recomputed from the noise actually drawn, not an example-level DP guarantee.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.dpal.budget import delta_l2  # Lemma 4 of DPAL = AdLM's label-coefficient sensitivity

RELEVANCE_NORMS = ("linf", "l1")
LOSS_SENSITIVITIES = ("labels", "paper")
PAPER_SPLIT = (1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0)

__all__ = ["RELEVANCE_NORMS", "LOSS_SENSITIVITIES", "PAPER_SPLIT", "AdLMBudget", "split_budget", "relevance_sensitivity",
           "loss_sensitivity", "feature_copies", "feature_sensitivity", "redistribute", "feature_scales",
           "features_epsilon", "laplace_epsilon"]


@dataclass(frozen=True)
class AdLMBudget:
    """The three components of the Theorem's total (eps_1 + eps_2 + eps_3) for a target epsilon."""

    epsilon: float      # the target total
    eps_relevance: float  # eps_1: the average relevance (Alg. 1 lines 1-7)
    eps_features: float   # eps_2: the first affine transformation (lines 8-14)
    eps_loss: float       # eps_3: the label coefficients of the output layer (lines 16-19)

    def total(self) -> float:
        return self.eps_relevance + self.eps_features + self.eps_loss

    def to_dict(self) -> dict:
        return asdict(self)


def split_budget(epsilon: float, fractions=PAPER_SPLIT) -> AdLMBudget:
    """eps_1, eps_2, eps_3 = epsilon * fractions; the paper's experiments use equal thirds.

    ``fractions`` are three positive numbers adding up to 1 (within 1e-9)."""
    epsilon = v.positive("epsilon", epsilon)
    fr = tuple(fractions)
    if len(fr) != 3:
        raise ValueError(f"budget_split must hold 3 fractions (relevance, features, loss), got {len(fr)}")
    fr = tuple(v.positive("budget_split", f) for f in fr)
    if abs(sum(fr) - 1.0) > 1e-9:
        raise ValueError(f"budget_split must add up to 1, got {sum(fr)}")
    return AdLMBudget(epsilon, epsilon * fr[0], epsilon * fr[1], epsilon * fr[2])


def relevance_sensitivity(d: int, n: int, norm: str = "linf") -> float:
    """L1 sensitivity of the average relevance vector R(D) = (1/|D|) sum_i r(x_i) (Alg. 1 lines 1-7).

    ``linf``: every entry of every example's relevance map lies in [-1, 1] (the paper's assumption; the
    code normalises each map by its largest magnitude), so replacing one example moves R(D) by at most
    2d / |D| in L1 (the paper's Delta_R). ``l1``: every example's map has L1 norm <= 1 (the code
    normalises each map by its L1 norm), so the move is at most 2 / |D| -- d times less noise for the
    same eps_1 (not in the paper; docs/adlm.md).
    """
    d = v.positive_int("d", d)
    n = v.positive_int("n", n)
    norm = v.choice("relevance_norm", norm, RELEVANCE_NORMS)
    return (2.0 * d if norm == "linf" else 2.0) / n


def loss_sensitivity(h_pi: int, classes: int = 10, rule: str = "labels") -> float:
    """Delta_L of the coefficients that get chi_3 (Alg. 1 lines 16-19).

    ``labels``: 2 |h_pi|, the L1 sensitivity of the label coefficients sum_i h_pi,i y_i^T (all K classes
    together) for h_pi in [-1, 1] and one-hot labels (``dpmech.dpal.budget.delta_l2``); these are the
    coefficients perturbed here. ``paper``: K (|h_pi| + |h_pi|^2 / 4), the reference code's "Lemma 5"
    value, the sensitivity of ALL coefficients of the second-order expansion ((1/2 - y_ik) h_pi and
    h_pi h_pi^T / 8 for each of the K classes); used as a (much larger, conservative) scale for the same
    label coefficients.
    """
    h_pi = v.positive_int("h_pi", h_pi)
    classes = v.positive_int("classes", classes)
    rule = v.choice("loss_sensitivity", rule, LOSS_SENSITIVITIES)
    if rule == "labels":
        return delta_l2(h_pi)
    return float(classes * (h_pi + h_pi ** 2 / 4.0))


def feature_copies(input_shape, kernel: int, stride: int, padding: int) -> torch.Tensor:
    """c_j: how many hidden units of ONE feature map of the first convolution read input feature j.

    The coefficients of the batch's affine transformation sum_i W^T x_i are, per hidden unit and kernel
    tap, the batch sums sum_i x_ij of the inputs that tap reads (the paper counts them per hidden unit,
    as DPAL's Lemma 2 does, per feature map: Appendix M's reading). Feature j appears c_j times; c_j
    varies over the image (for the 5x5 / stride 2 MNIST layer: 9, 6 or 4 in the interior)."""
    c, h, w = (v.positive_int("input_shape", s) for s in input_shape)
    kernel = v.positive_int("kernel", kernel)
    stride = v.positive_int("stride", stride)
    padding = v.positive_int("padding", padding, minimum=0)
    ones = torch.ones(1, 1, h, w, dtype=torch.float64)
    taps = torch.ones(1, 1, kernel, kernel, dtype=torch.float64)
    out = F.conv2d(ones, taps, stride=stride, padding=padding)       # one feature map
    back = F.conv_transpose2d(torch.ones_like(out), taps, stride=stride, padding=padding,
                              output_padding=_output_padding(h, out.shape[2], kernel, stride, padding))
    return back[0, 0].expand(c, h, w).clone()


def _output_padding(size: int, out: int, kernel: int, stride: int, padding: int) -> int:
    return size - ((out - 1) * stride - 2 * padding + kernel)


def feature_sensitivity(copies: torch.Tensor, bound: float = 1.0) -> torch.Tensor:
    """s_j = 2 * bound * c_j: how much feature j's coefficient copies can move in L1 when one example
    (inputs in [-bound, bound]) is replaced. sum_j s_j is the paper's Delta_{h_0} of one feature map
    (2 * beta * d = 9,800 for MNIST's 14 x 14 map and 5 x 5 patch, less the taps that fall on padding)."""
    bound = v.positive("bound", bound)
    return 2.0 * bound * copies.to(torch.float64)


def redistribute(relevance: torch.Tensor, beta_min: float = 0.0) -> torch.Tensor:
    """The privacy-budget redistribution vector beta (Alg. 1 lines 8-14): beta_j proportional to the
    (noisy) average relevance R_bar_j, with sum_j beta_j = d, so feature j gets beta_j times the
    uniform share eps_2 / d.

    Negative noisy relevances count as 0 and every beta_j is at least ``beta_min`` (the reference code
    floors R_bar and beta at 1e-5): beta_j = beta_min + (d - d beta_min) * max(R_bar_j, 0) / sum_k
    max(R_bar_k, 0), uniform when no relevance is positive. This is post-processing of the released
    R_bar and keeps sum_j beta_j = d exactly.
    """
    beta_min = v.unit_interval("beta_min", beta_min, high_open=True)
    r = torch.clamp(relevance.detach().to(torch.float64), min=0.0)
    d = r.numel()
    total = r.sum()
    if not torch.isfinite(total):
        raise ValueError("relevance must be finite")
    if total <= 0:
        return torch.ones_like(r)
    return beta_min + (d - d * beta_min) * r / total


def feature_scales(beta: torch.Tensor, sensitivity: torch.Tensor, eps_features: float) -> torch.Tensor:
    """Laplace scales of the noise on each feature's batch coefficient sum_{x_i in L} x_ij:
    b_j = s_j / eps_j with eps_j = beta_j eps_2 / d (the adaptive share), so that sum_j s_j / b_j = eps_2.

    The paper writes b_j = Delta_{h_0} / (beta_j eps_2), i.e. every feature carries the uniform share
    Delta_{h_0} / d of the sensitivity; a feature read by more hidden units than average carries more
    (docs/adlm.md, decision 3), so the exact share s_j is used. Each example receives b_j / |L|
    (the paper's (1/|L|) Lap(...) per example; the batch sum then carries Lap(b_j)).
    """
    eps_features = v.positive("eps_features", eps_features)
    if beta.shape != sensitivity.shape:
        raise ValueError(f"beta and sensitivity must have the same shape, got {tuple(beta.shape)} and "
                         f"{tuple(sensitivity.shape)}")
    if (beta <= 0).any():
        raise ValueError("beta must be > 0 everywhere (set beta_min > 0 or use redistribute)")
    d = beta.numel()
    return sensitivity.to(torch.float64) * d / (beta.to(torch.float64) * eps_features)


def features_epsilon(scales: torch.Tensor, sensitivity: torch.Tensor) -> float:
    """eps_2 recomputed from the drawn scales: sum_j s_j / b_j (the Laplace mechanism per feature,
    composed over the features)."""
    return float((sensitivity.to(torch.float64) / scales.to(torch.float64)).sum())


def laplace_epsilon(scale: float, sensitivity: float) -> float:
    """sensitivity / scale: the epsilon of a Laplace draw of ``scale`` on a query of that L1 sensitivity."""
    scale = v.positive("scale", scale)
    sensitivity = v.positive("sensitivity", sensitivity)
    return sensitivity / scale


def uniform_share_loss(beta: torch.Tensor, copies: torch.Tensor, eps_features: float) -> float:
    """The worst-case privacy loss of the paper's literal scales Delta_{h_0} / (beta_j eps_2) (every feature
    credited the uniform share of Delta_{h_0}) when every feature moves by its full 2 c_j: it exceeds
    eps_2 whenever beta puts more weight on features read by more hidden units than average."""
    s = feature_sensitivity(copies)
    paper_scales = s.sum() / (beta.to(torch.float64) * eps_features)
    return float((s / paper_scales).sum())


def describe(budget: AdLMBudget) -> str:
    """One line for logs."""
    return (f"eps={budget.epsilon:g}: relevance {budget.eps_relevance:g}, features {budget.eps_features:g}, "
            f"loss {budget.eps_loss:g}")

