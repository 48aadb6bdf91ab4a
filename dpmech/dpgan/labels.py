"""The labels y' of DPGAN's fake examples, and the private label histogram they can be drawn from.

Algorithm 1 of Xie et al. 2018 draws a conditional generator's labels uniformly. On a dataset whose
classes are not equally frequent the critic then sees class c in the real batches at rate p_c and in
the fake batches at rate 1/K, and the Wasserstein loss rewards a per-class offset in the critic's
score that grows with p_c - 1/K; the generator of the rarest class is pushed off the data (on MNIST
the class-5 generator makes noise; docs/dpgan.md, "Why class 5 fails").

The sound fix draws y' from the class frequencies, released once with the Gaussian mechanism:
adding or removing one training example changes one count by 1, so the histogram has L2
sensitivity 1 and ``counts + N(0, sigma_h^2 I)`` is the Gaussian mechanism with noise multiplier
sigma_h, recorded in the trainer's ledger and composed with the critic steps (at sigma_h = 100 on
full MNIST the critic's calibrated sigma rises by 0.08% at epsilon 1, and by less than the
bisection's precision at epsilon 10: about a thousandth of the budget). The probabilities are
post-processing of the release: negative counts clipped to 0, normalised (uniform if nothing is left).
"""

from __future__ import annotations

import torch

from dpmech import _validate as v


@torch.no_grad()
def release_label_histogram(y: torch.Tensor, classes: int, noise_multiplier: float,
                            generator: torch.Generator) -> torch.Tensor:
    """Gaussian mechanism on the class counts: ``bincount(y) + N(0, noise_multiplier^2 I)`` (float64,
    on the CPU). The only reader of the training labels for the fake labels."""
    v.positive_int("classes", classes)
    v.non_negative("noise_multiplier", noise_multiplier)
    counts = torch.bincount(y.detach().cpu().long(), minlength=classes).to(torch.float64)
    if counts.numel() != classes:
        raise ValueError(f"y must hold labels in [0, {classes})")
    noise = torch.randn(classes, generator=generator, dtype=torch.float64)
    return counts + noise_multiplier * noise


def label_probabilities(histogram: torch.Tensor) -> torch.Tensor:
    """Post-processing of a released histogram: counts clipped at 0 and normalised (float32); the
    uniform distribution when no count is positive."""
    h = histogram.detach().to(torch.float64).clamp(min=0.0)
    total = h.sum()
    if not torch.isfinite(total) or total <= 0:
        return torch.full((histogram.numel(),), 1.0 / histogram.numel())
    return (h / total).float()
