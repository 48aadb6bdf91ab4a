"""DPAL's noise: the three training noises drawn once (Alg. 1 line 1) and the psi-shifted Monte Carlo
noise of verified inference (Appendix L).

The training noise is stored as the offsets the computation adds:

* ``x``: chi_1 / m, Laplace(Delta_R / (m eps_1)) per input coordinate, added to every training input
  (Alg. 1 line 2: B_bar_i = {x + chi_1 / m}); shape = the noised input shape.
* ``h``: 2 chi_2 / m, Laplace(2 Delta_R / (m eps_1)) per hidden unit of h_1 (Eq. 7); shape = h_1's.
* ``y``: chi_3, Laplace(Delta_L2 / eps_2) per label coefficient sum_i h_pi,i y_ik (Theorem 3);
  shape [|h_pi|, K] (Lemma 4 bounds all K classes together, so all K columns get noise).

At inference (Appendix L) each Monte Carlo draw uses x + chi_1/m + Lap(b_x / psi) and
h + 2 chi_2/m + Lap(b_h / psi): the fixed training offsets plus fresh Laplace noise scaled down by psi.
Only the fresh part is random, so only it carries the robustness (verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpmech import _validate as v
from dpmech.privacy.mechanisms import laplace_noise


@dataclass
class TrainingNoise:
    """chi_1 / m, 2 chi_2 / m and chi_3 with the Laplace scales they were drawn at."""

    x: torch.Tensor
    h: torch.Tensor
    y: torch.Tensor
    scale_x: float
    scale_h: float
    scale_y: float

    @classmethod
    def draw(cls, *, x_shape, h_shape, y_shape, scale_x: float, scale_h: float, scale_y: float,
             generator: torch.Generator) -> "TrainingNoise":
        """Alg. 1 line 1: draw all three noises once, in this order, from ``generator``."""
        def lap(shape, scale):
            return laplace_noise(torch.empty(tuple(shape), dtype=torch.float32), scale, generator)
        return cls(x=lap(x_shape, scale_x), h=lap(h_shape, scale_h), y=lap(y_shape, scale_y),
                   scale_x=float(scale_x), scale_h=float(scale_h), scale_y=float(scale_y))

    def to(self, device) -> "TrainingNoise":
        return TrainingNoise(self.x.to(device), self.h.to(device), self.y.to(device),
                             self.scale_x, self.scale_h, self.scale_y)

    def state_dict(self) -> dict:
        return {"x": self.x.detach().cpu().clone(), "h": self.h.detach().cpu().clone(),
                "y": self.y.detach().cpu().clone(), "scale_x": self.scale_x, "scale_h": self.scale_h,
                "scale_y": self.scale_y}

    @classmethod
    def from_state_dict(cls, state: dict, device="cpu") -> "TrainingNoise":
        return cls(state["x"].clone(), state["h"].clone(), state["y"].clone(), float(state["scale_x"]),
                   float(state["scale_h"]), float(state["scale_y"])).to(device)


def psi_scales(noise: TrainingNoise, psi: float) -> tuple[float, float]:
    """Appendix L: the fresh Laplace scales (b_x / psi, b_h / psi) of one Monte Carlo draw."""
    psi = v.positive("psi", psi)
    return noise.scale_x / psi, noise.scale_h / psi


class PsiNoisyScorer(torch.nn.Module):
    """The randomized scoring function of verified inference (Alg. 1 lines 13-18, Appendix L):
    logits of g(a(x + chi_1/m + Lap(b_x/psi)) + 2 chi_2/m + Lap(b_h/psi)), fresh noise every call
    and every row, drawn from ``generator``. ``fresh=False`` gives the deterministic centre
    f(x + chi_1/m) with h + 2 chi_2/m (Appendix L's limit, used to craft attacks and for
    ``DPALTrainer.accuracy``)."""

    def __init__(self, model, noise: TrainingNoise, psi: float, generator: torch.Generator | None = None,
                 fresh: bool = True):
        super().__init__()
        self.model = model
        self.noise = noise
        self.fresh = fresh
        self.scale_x, self.scale_h = psi_scales(noise, psi)
        if fresh and not isinstance(generator, torch.Generator):
            raise ValueError("generator must be a torch.Generator when fresh noise is drawn")
        self.generator = generator
        self.train(False)

    def train(self, mode: bool = True) -> "PsiNoisyScorer":
        """Always in evaluation mode (the model's batch norm uses its recalibrated statistics, so every
        output depends on its own example only): ``train(True)`` is ignored."""
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.model.crop(x)
        x_bar = x + self.noise.x
        if self.fresh:
            x_bar = x_bar + laplace_noise(x_bar, self.scale_x, self.generator)
        h = self.model.affine(x_bar)
        h_bar = h + self.noise.h
        if self.fresh:
            h_bar = h_bar + laplace_noise(h_bar, self.scale_h, self.generator)
        return self.model.output(self.model.hidden(h_bar))
