"""DP-SGD (Abadi et al. 2016, Algorithm 1) for any nn.Module: Poisson sampling, per-example clipping
(dpmech.privacy.clipping), Gaussian noise and the privacy ledger; DPSGDConfig and DPSGDTrainer (trainer)."""
