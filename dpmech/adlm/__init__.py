"""AdLM (Phan et al., ICDM 2017, the Adaptive Laplace Mechanism): budget (Alg. 1, the Theorem), relevance
(LRP), config and trainer (the Taylor loss and network of dpmech.dpal). Decisions: docs/adlm.md."""
