"""DPAL ("Differential Privacy in Adversarial Learning with Provable Robustness", seed 003): budget (Lemmas 2-4), config,
model, noise, objectives (Eq. 5-11), trainer (Alg. 1 l. 1-12), verify (l. 13-18), reference (its code's path). docs/dpal.md."""
