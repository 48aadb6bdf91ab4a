"""Networks shared by the mechanisms: PixelDP's CNN / wide ResNet with a noise layer (pixeldp),
the DP-SGD architectures chosen by name (dpsgd_models), ScatterNet features (scatternet)."""
