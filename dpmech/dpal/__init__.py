"""DPAL: Differential Privacy in Adversarial Learning with Provable Robustness (ICLR 2020 submission,
seed document 003; reference code lineage haiphanNJIT/StoBatch). Decisions: docs/dpal.md.

* ``budget``      Lemmas 2-4 (Delta_R, Delta_L2, gamma, gamma_x), Theorem 4 and Appendix M's split
* ``config``      ``DPALConfig``
* ``model``       ``DPALNet``: a(x, theta_1) with the enforced norm bound, g, Appendix M's architectures
* ``noise``       chi_1..chi_3 drawn once (Alg. 1 line 1); the psi-shifted inference noise (Appendix L)
* ``objectives``  Eq. 5-7 (auto-encoder), Eq. 10-11 (DP adversarial objective), Lemma 2/4 coefficients
* ``trainer``     ``DPALTrainer`` (Alg. 1 lines 1-12), resumable
* ``verify``      verified inference (Alg. 1 lines 13-18, Eq. 14-15, Theorem 5, Proposition 1)
"""

from dpmech.dpal.budget import (Budget, NoiseScales, delta_l2, delta_r, dpal_budget, gamma, gamma_x,
                                noise_scales, split_budget)
from dpmech.dpal.config import DPALConfig
from dpmech.dpal.model import DPALNet, NonPrivateNet
from dpmech.dpal.noise import PsiNoisyScorer, TrainingNoise
from dpmech.dpal.trainer import DPALTrainer
from dpmech.dpal.verify import (DPALCertification, certified_accuracy, conventional_accuracy_under_attack,
                                robustness_size, search_eps_r, verified_inference, verify_model)

__all__ = [
    "Budget", "NoiseScales", "delta_l2", "delta_r", "dpal_budget", "gamma", "gamma_x", "noise_scales",
    "split_budget", "DPALConfig", "DPALNet", "NonPrivateNet", "PsiNoisyScorer", "TrainingNoise", "DPALTrainer",
    "DPALCertification", "certified_accuracy", "conventional_accuracy_under_attack", "robustness_size",
    "search_eps_r", "verified_inference", "verify_model",
]
