"""DPAL's verified inference (Alg. 1 lines 13-18; Sec. 3.3-3.4: Eq. 14-15, Theorem 5, Proposition 1;
Appendix L), and conventional and certified accuracy as Section 4 defines them.

For each input x:

1. Monte Carlo (Appendix L): n draws of f with the fixed training offsets chi_1/m and 2 chi_2/m plus
   fresh Laplace noise of scales b_x/psi on the input and b_h/psi on h (``noise.PsiNoisyScorer``);
   the expected scores are bounded with eta-confidence (Hoeffding on the softmax scores, as the
   paper says, or Clopper-Pearson on argmax counts, as the reference code does; both Bonferroni over
   the K classes, dpmech.robustness.certification).
2. eps_r (Eq. 15): the largest eps_r with E_lb f_k > e^(2 eps_r) max_{i != k} E_ub f_i (Eq. 14), i.e.
   eps_r = ln(E_lb f_k / E_ub f_i) / 2 (the constraint is monotone in eps_r and the objective
   increasing, so the maximisation is solved exactly; ``search_eps_r`` checks this numerically).
3. The robustness size. The fresh input noise makes f eps-DP for an attack a with eps = ||a||_1 / (b_x/psi);
   the fresh noise on h, conditioned on the input noise, makes it eps-DP with eps =
   ||h(x + a) - h(x)||_1 / (b_h/psi) <= S_h ||a||_p / (b_h/psi). So at eps_r the input noise covers
   attacks up to kappa = eps_r (b_x/psi) / S_x and the hidden noise up to phi = eps_r (b_h/psi) / S_h,
   where S_x = d (l_inf) or 1 (l1) and S_h is the first layer's l_inf -> l1 (or l1 -> l1) norm.
   f is a post-processing of either noisy layer, so it is eps_r-DP for attacks up to
   max(kappa, phi) and Proposition 1's conclusion holds there. The paper's (kappa + phi) does not
   follow (docs/dpal.md: the group-privacy step of Prop. 1 runs the wrong way); kappa and phi are
   reported per example so the paper's number can be recomputed.
4. isRobust(x) = (certified size >= mu_a) (Alg. 1 line 15).

Conventional accuracy = #correct / |test|; certified accuracy = #(correct and isRobust) / |test|
(Section 4), where "correct" is the verified prediction k = argmax of the expected scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dpmech import _validate as v
from dpmech.robustness.certification import argmax_bounds, hoeffding_bounds, max_epsilon, monte_carlo, top_and_runner_up
from dpmech.robustness.certification import certified_accuracy as _certified_accuracy
from dpmech.dpal.config import BOUNDS, NORMS
from dpmech.dpal.noise import PsiNoisyScorer, TrainingNoise

_BOUND_FNS = {"hoeffding": hoeffding_bounds, "argmax": argmax_bounds}


def search_eps_r(lower, upper):
    """Eq. 15's eps_r: the supremum of eps_r with lower > e^(2 eps_r) upper (Eq. 14), per example;
    0 when lower <= upper (no eps_r > 0 passes). Closed form ln(lower / upper) / 2."""
    return max_epsilon(np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64), 0.0)


def robustness_size(lower, upper, *, scale_x: float, scale_h: float, sensitivity_x: float,
                    sensitivity_h: float):
    """(eps_r, kappa, phi, size) per example (Eq. 15 with the sound composition, see the module doc).

    ``scale_x``/``scale_h`` are the fresh Laplace scales (b_x/psi, b_h/psi); ``sensitivity_x`` and
    ``sensitivity_h`` the L1 change of the noised input and of h per unit attack size.
    """
    scale_x = v.positive("scale_x", scale_x)
    scale_h = v.positive("scale_h", scale_h)
    sensitivity_x = v.positive("sensitivity_x", sensitivity_x)
    sensitivity_h = v.positive("sensitivity_h", sensitivity_h)
    eps_r = search_eps_r(lower, upper)
    kappa = eps_r * scale_x / sensitivity_x
    phi = eps_r * scale_h / sensitivity_h
    return eps_r, kappa, phi, np.maximum(kappa, phi)


@dataclass
class DPALCertification:
    """Per-example output of verified inference (one row per example; plain numpy arrays)."""

    index: np.ndarray
    label: np.ndarray
    prediction: np.ndarray
    lower: np.ndarray            # eta-lower bound of the predicted class's expected score
    upper: np.ndarray            # eta-upper bound of the best other class's expected score
    eps_r: np.ndarray            # Eq. 15's maximising eps_r (0: not robust even at size 0)
    kappa: np.ndarray            # attack size covered by the fresh input noise at eps_r
    phi: np.ndarray              # attack size covered by the fresh noise on h at eps_r
    certified_size: np.ndarray   # the robustness size max(kappa, phi) (0: not certified)
    mu_a: float
    norm: str
    n: int
    eta: float
    bounds: str
    psi: float
    noise_scale_x: float         # fresh b_x / psi
    noise_scale_h: float         # fresh b_h / psi
    sensitivity_x: float
    sensitivity_h: float

    @property
    def correct(self) -> np.ndarray:
        return self.prediction == self.label

    @property
    def is_robust(self) -> np.ndarray:
        """isRobust(x) of Alg. 1 line 15 at the configured attack size mu_a."""
        return (self.certified_size > 0) & (self.certified_size >= self.mu_a)

    def accuracy(self) -> float:
        """Conventional accuracy (Section 4): #isCorrect / |test|."""
        return float(self.correct.mean())

    def certified_accuracy(self, mu_a: float | None = None) -> float:
        """Certified accuracy (Section 4): #(isCorrect and isRobust at mu_a) / |test|."""
        mu = self.mu_a if mu_a is None else v.non_negative("mu_a", mu_a)
        return _certified_accuracy(self, [mu])[mu]

    def as_columns(self) -> dict[str, np.ndarray]:
        return {"index": self.index, "label": self.label, "prediction": self.prediction,
                "lower_bound": self.lower, "upper_bound": self.upper, "eps_r": self.eps_r,
                "kappa": self.kappa, "phi": self.phi, "certified_size": self.certified_size,
                "is_robust": self.is_robust}


def certified_accuracy(result: DPALCertification, sizes) -> dict[float, float]:
    """Certified accuracy at each attack size: #(correct and certified size >= size) / N."""
    return _certified_accuracy(result, sizes)


@torch.no_grad()
def verify_model(model, noise: TrainingNoise, x: torch.Tensor, y, *, psi: float, mu_a: float, n: int = 1000,
                 eta: float = 0.95, bounds: str = "hoeffding", norm: str = "linf", seed: int = 0,
                 batch_size: int = 4096, index=None, progress=None) -> DPALCertification:
    """Verified inference (Alg. 1 lines 13-18) of every example of ``x`` for a trained ``DPALNet``
    and its training noise."""
    psi = v.positive("psi", psi)
    mu_a = v.positive("mu_a", mu_a)
    n = v.positive_int("n", n)
    eta = v.open_unit("eta", eta)
    bounds = v.choice("bounds", bounds, BOUNDS)
    norm = v.choice("norm", norm, NORMS)
    seed = v.positive_int("seed", seed, minimum=0)
    y = np.asarray(y.cpu() if torch.is_tensor(y) else y)
    if x.dim() != 4 or y.shape != (x.shape[0],):
        raise ValueError(f"x must be [N, C, H, W] and y [N], got {tuple(x.shape)} and {y.shape}")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    scorer = PsiNoisyScorer(model, noise, psi, gen, fresh=True)
    est = monte_carlo(scorer, x, n, batch_size=batch_size, progress=progress)
    lower, upper = _BOUND_FNS[bounds](est, alpha=1.0 - eta)  # dpmech.robustness.certification's convention: alpha = 1 - eta
    scores = est.counts if bounds == "argmax" else est.mean
    k, lb, ub = top_and_runner_up(lower, upper, scores)
    sens_x = model.input_sensitivity(norm)
    sens_h = model.hidden_sensitivity(norm)
    eps_r, kappa, phi, size = robustness_size(lb, ub, scale_x=scorer.scale_x, scale_h=scorer.scale_h,
                                              sensitivity_x=sens_x, sensitivity_h=sens_h)
    idx = np.arange(len(y)) if index is None else np.asarray(index)
    return DPALCertification(idx, y.astype(np.int64), k.astype(np.int64), lb, ub, eps_r, kappa, phi, size,
                             mu_a, norm, n, eta, bounds, psi, scorer.scale_x, scorer.scale_h, sens_x, sens_h)


def verified_inference(trainer, x: torch.Tensor, y, *, n: int | None = None, eta: float | None = None,
                       mu_a: float | None = None, bounds: str | None = None, norm: str | None = None,
                       psi: float | None = None, seed: int = 0, batch_size: int = 4096, index=None,
                       progress=None) -> DPALCertification:
    """Verified inference with a ``DPALTrainer``'s model and noise; unset arguments come from its config."""
    cfg = trainer.config
    return verify_model(trainer.model, trainer.noise, x, y, psi=cfg.psi if psi is None else psi,
                        mu_a=cfg.mu_a if mu_a is None else mu_a, n=cfg.n if n is None else n,
                        eta=cfg.eta if eta is None else eta, bounds=cfg.bounds if bounds is None else bounds,
                        norm=cfg.norm if norm is None else norm, seed=seed, batch_size=batch_size, index=index,
                        progress=progress)


def conventional_accuracy_under_attack(trainer, x: torch.Tensor, y: torch.Tensor, attack_name: str, mu_a: float,
                                       *, steps: int = 10, n: int = 100, seed: int = 0,
                                       batch_size: int = 500, attack_labels: str = "true") -> float:
    """Section 4's conventional accuracy on adversarial examples: the attack (its own l_inf(mu_a) ball
    around the clean x, clamped to [-1, 1]) targets the deterministic centre f(x + chi_1/m) with
    h + 2 chi_2/m; the verified prediction (argmax of n psi-noisy draws) is compared with the true
    label. ``attack_labels``: "true" (the attack maximises the loss of the true label ``y``) or
    "predicted" (of the centre's own prediction, the paper's choice against label leaking)."""
    from dpmech.robustness.attacks import attack

    mu_a = v.positive("mu_a", mu_a)
    attack_labels = v.choice("attack_labels", attack_labels, ("true", "predicted"))
    y_all = torch.as_tensor(np.asarray(y.cpu() if torch.is_tensor(y) else y), dtype=torch.long)
    centre = trainer.scorer(fresh=False)
    gen = torch.Generator(device=trainer.device).manual_seed(seed)
    advs = []
    for s in range(0, x.shape[0], batch_size):
        xb = x[s:s + batch_size].to(trainer.device)
        kw = {"eps": mu_a, "norm": "linf"}
        if attack_name not in ("fgsm",):
            kw["steps"] = steps
        if attack_name in ("pgd", "madry", "madryetal"):
            kw["generator"] = gen
        yb = y_all[s:s + batch_size].to(trainer.device) if attack_labels == "true" else None
        advs.append(attack(attack_name, centre, xb, yb, **kw).cpu())
    x_adv = torch.cat(advs)
    res = verified_inference(trainer, x_adv, y, n=n, seed=seed + 1)
    return res.accuracy()
