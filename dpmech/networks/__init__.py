"""Networks shared by the mechanisms: PixelDP's CNN / wide ResNet with a noise layer (pixeldp), the DP-SGD
architectures by name (dpsgd_models), ScatterNet features (scatternet), non-private classifier fitting (fit)."""
