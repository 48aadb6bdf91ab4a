"""SecureSGD (Phan et al., IJCAI 2019): the Heterogeneous Gaussian Mechanism (hgm, Theorems 1-2) and the
SecureSGD / SecureSGD-AGM trainer, DP-SGD with a PixelDP noise layer (trainer). Decisions: docs/secure_sgd.md."""
