"""Lipschitz-constrained networks trained by clipless DP-SGD (Bethune et al., ICLR 2024): sound layer bounds (bounds),
1-Lipschitz layers and networks (layers, network), the trainer (trainer) and the deterministic l2 certificate (certify)."""
