"""The deterministic l2 certificate of a Lipschitz classifier: no Monte-Carlo, no abstention.

If the logit map f is L-Lipschitz in l2 (R^d -> R^K, l2 on both sides), each margin f_c - f_j is
sqrt(2) L-Lipschitz (||e_c - e_j|| = sqrt(2)), so the prediction c = argmax f(x) cannot change within
the l2 ball of radius

    radius_pm1 = (f_c(x) - max_{j != c} f_j(x)) / (sqrt(2) L)

(Tsuzuku, Sato & Sugiyama, NeurIPS 2018, Proposition 1; the certificate lip-dp reports through
deel-lip's CategoricalProvableRobustAccuracy with disjoint_neurons=False). The radius is in the input
domain of the model, dpsweep's [-1, 1]; an image in [0, 1] maps to [-1, 1] by 2 x - 1, so the same
ball has radius ``radius_01 = radius_pm1 / 2`` in the literature's [0, 1] domain. A tie (margin 0)
certifies nothing (radius 0). Floating point: the margin is computed in float64 from the model's
float32 logits; a margin's rounding error (about 1e-6 of the logits) is far below the radii reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dpmech import _validate as v


@dataclass
class LipschitzCertificate:
    """Per-example results: prediction, margin, certified l2 radius in both domains, correctness."""

    label: np.ndarray
    prediction: np.ndarray
    margin: np.ndarray
    radius_pm1: np.ndarray       # l2 radius in the [-1, 1] input domain
    lipschitz: float             # L used

    @property
    def radius_01(self) -> np.ndarray:
        """The same balls' radii in the [0, 1] domain (half the [-1, 1] radii)."""
        return self.radius_pm1 / 2.0

    @property
    def correct(self) -> np.ndarray:
        return self.prediction == self.label

    def certified_accuracy_01(self, radii_01) -> dict[float, float]:
        """Fraction of examples predicted correctly with radius_01 >= r, for each r ([0, 1] domain);
        r = 0 is the clean accuracy (a certified radius of 0 still predicts)."""
        return {float(r): float((self.correct & (self.radius_01 >= v.non_negative("radius", r))).mean())
                for r in radii_01}

    def certified_accuracy_pm1(self, radii_pm1) -> dict[float, float]:
        """The same at radii in the [-1, 1] domain."""
        return {float(r): float((self.correct & (self.radius_pm1 >= v.non_negative("radius", r))).mean())
                for r in radii_pm1}


@torch.no_grad()
def certify(model, x: torch.Tensor, y: torch.Tensor, lipschitz: float | None = None,
            batch_size: int = 1000) -> LipschitzCertificate:
    """The certificate of every example of ``x`` (module docstring). ``lipschitz``: L, by default
    ``model.lipschitz_bound()`` (a sound upper bound; an understated L makes the radii unsound)."""
    L = float(model.lipschitz_bound() if lipschitz is None else lipschitz)
    v.positive("lipschitz", L)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"y: {y.shape[0]} labels for {x.shape[0]} inputs")
    model.eval()
    device = next(model.parameters()).device
    preds, margins = [], []
    for s in range(0, x.shape[0], batch_size):
        z = model(x[s:s + batch_size].to(device)).double().cpu()
        top2 = z.topk(2, dim=1)
        preds.append(top2.indices[:, 0])
        margins.append(top2.values[:, 0] - top2.values[:, 1])
    margin = torch.cat(margins).numpy()
    return LipschitzCertificate(label=y.cpu().numpy(), prediction=torch.cat(preds).numpy(), margin=margin,
                                radius_pm1=margin / (math.sqrt(2.0) * L), lipschitz=L)
