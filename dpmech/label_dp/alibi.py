"""ALIBI (Malek, Mironov, Prasad, Shilov, Tramer, "Antipodes of Label Differential Privacy: PATE
and ALIBI", NeurIPS 2021, Sec. 4): the one-hot label released once with the Laplace mechanism
(scale b = 2/epsilon, the same release as the seed's ``laplace``, but the noisy vector is kept), then
Bayesian inference turns it into a soft label, post-processing of the release:

    P(y = c | o, x)  proportional to  prior(c | x) * P(o | y = c),
    P(o | y = c) / P(o | y = c')  =  exp((|o_c| - |o_c - 1| - |o_c'| + |o_c' - 1|) / b)

(the other coordinates have the same law under both labels and cancel), so the posterior is
``softmax(log prior + (|o| - |o - 1|) / b)`` over the classes. The prior may be uniform or the
current model's softmax on the example's image (``prior="model"``, refreshed once per epoch): both
read no label except through the release. Training minimises the cross-entropy against the soft
labels. The full benchmark runs it with the model prior (the reference code's default); docs/label_dp.md "ALIBI".
"""

from __future__ import annotations

import torch

from dpmech import _validate as v
from dpmech.label_dp.release import ONE_HOT_SENSITIVITY, laplace_one_hot
from dpmech.privacy.mechanisms import laplace_scale

PRIORS = ("uniform", "model")


def alibi_release(y: torch.Tensor, num_classes: int, epsilon: float, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """The epsilon-label-DP release: one-hot + Lap(2/eps)^K (float64 [N, K]) and the scale used."""
    b = laplace_scale(v.positive("epsilon", epsilon), ONE_HOT_SENSITIVITY)
    return laplace_one_hot(y, num_classes, b, generator), b


def alibi_soft_labels(noisy: torch.Tensor, scale: float, prior: torch.Tensor | None = None) -> torch.Tensor:
    """Posterior over the true label given the noisy one-hot vectors (float64 [N, K]); ``prior``
    [N, K] (probabilities, may contain zeros) or None for uniform."""
    scale = v.positive("scale", scale)
    if not torch.is_tensor(noisy) or noisy.dim() != 2:
        raise ValueError("noisy must be a [N, K] tensor of released one-hot vectors")
    o = noisy.double()
    loglik = (o.abs() - (o - 1.0).abs()) / scale
    if prior is not None:
        if prior.shape != noisy.shape or (prior < 0).any() or not torch.isfinite(prior).all():
            raise ValueError(f"prior must be non-negative probabilities shaped {tuple(noisy.shape)}")
        loglik = loglik + torch.log(prior.double().clamp_min(1e-300))
    return torch.softmax(loglik, dim=1)
