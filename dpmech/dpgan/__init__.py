"""DPGAN (Xie et al. 2018): config (step plan, noise calibration, Lemma 2), models (generator, critic), labels
(DP label histogram), trainer (Algorithm 1), evaluate (train-on-synthetic accuracy). Decisions: docs/dpgan.md."""
