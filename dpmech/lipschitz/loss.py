"""The Lipschitz loss of clipless DP-SGD: tau-scaled cross-entropy (lip-dp's TauCategoricalCrossentropy).

l_tau(z, y) = CE(tau z, y) / tau. Its gradient in the logits is softmax(tau z) - e_y, whose squared norm
is (1 - p_y)^2 + sum_{j != y} p_j^2 <= 2 (1 - p_y)^2 <= 2: l_tau is sqrt(2)-Lipschitz in z whatever tau
(``LOSS_LIPSCHITZ``). tau trades accuracy for margin: a small tau keeps pushing the margin up (the
certificate's radius), a large tau behaves like cross-entropy on confident logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOSS_LIPSCHITZ = math.sqrt(2.0)


def tau_cross_entropy(logits: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-example l_tau (no reduction)."""
    return F.cross_entropy(tau * logits, y, reduction="none") / tau
