"""PixelDP (Lecuyer et al., S&P 2019): configuration, noise calibration, a resumable trainer and the guarantee
recomputed from the noise used (trainer); its networks are in dpmech.networks.pixeldp. docs/pixeldp.md."""
