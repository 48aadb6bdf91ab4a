"""DPGAN (Xie et al. 2018): a conditional Wasserstein GAN whose critic takes clipped, noisy,
weight-clipped steps on Poisson-sampled real data, accounted with dp-accounting (docs/dpgan.md).

* :mod:`dpmech.dpgan.config`: hyperparameters, the step plan, noise calibration, Lemma 2's formula;
* :mod:`dpmech.dpgan.models`: the conditional generator and critic (no batch normalisation);
* :mod:`dpmech.dpgan.trainer`: Algorithm 1, resumable;
* :mod:`dpmech.dpgan.evaluate`: train-on-synthetic accuracy, sample scores, the sample grid.
"""

from dpmech.dpgan.config import DPGANConfig, paper_lemma2_epsilon, paper_lemma2_sigma, planned_event
from dpmech.dpgan.trainer import DPGANTrainer

__all__ = ["DPGANConfig", "DPGANTrainer", "paper_lemma2_epsilon", "paper_lemma2_sigma", "planned_event"]
