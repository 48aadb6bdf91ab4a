"""Label inference: what a label-DP model's outputs reveal about its training labels (issue 52, part 5;
docs/mia.md, "Label DP: label inference").

The observational idea of Kalemaj, Mironov, Melis, Boucher & Mahloujifar ("Observational Auditing of
Label Privacy", arXiv 2511.14084, 2025; only its abstract could be read offline, so this follows the
idea, not the paper's estimator): no canaries and no change to training; the randomness the audit
rests on is the data's own -- each training label is a draw from a prior pi_i(.) given its input
(in their setting, counterfactual labels of a proxy model; in a test, labels drawn from a known
prior). The attacker guesses each training example's label from the released model's output.

**The bound.** If training is epsilon-label-DP, changing example i's label changes the
distribution of the output by at most e^epsilon, so for any guess g_i, the posterior
Pr[y_i = g_i | output] <= e^eps pi_i(g_i) / (e^eps pi_i(g_i) + 1 - pi_i(g_i)) =: f_eps(pi_i(g_i))
(the randomized-response bound; uniform prior over K classes: e^eps / (e^eps + K - 1)). The number of
correct guesses C is then a sum of Bernoulli(p_i) with p_i <= f_eps(pi_i(g_i)) given the output, and by
Hoeffding (1956, Thm. 4) Pr[C >= c] <= Pr[Binomial(n, mean_i f_eps(pi_i(g_i))) >= c] for c >= n
mean + 1. ``eps_lb`` is the smallest epsilon this test does not reject at level beta: a claim below it
is refuted at confidence 1 - beta. (Rigorous when the labels are independent draws from pi given the
inputs; with real labels and a proxy's pi it carries the proxy's error, which Kalemaj et al. bound
separately and which is not bounded here.)

**The advantage** is the attack's accuracy minus the prior's (mean_i max_k pi_i(k), the best guess
without the model): what the model adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.stats import binom

from dpmech import _validate as v


@dataclass(frozen=True)
class LabelInferenceResult:
    """The attack's figures (names as metrics: :meth:`metrics`)."""

    n: int
    correct: int
    accuracy: float
    prior_accuracy: float
    advantage: float
    eps_lb: float
    confidence: float

    def metrics(self) -> dict[str, float]:
        return {"label_inference_accuracy": self.accuracy, "label_inference_prior_accuracy": self.prior_accuracy,
                "label_inference_advantage": self.advantage, "label_inference_eps_lb": self.eps_lb,
                "label_inference_examples": float(self.n), "label_inference_correct": float(self.correct),
                "label_inference_confidence": self.confidence}


def _bound(p: np.ndarray, eps: float) -> np.ndarray:
    e = math.exp(min(eps, 700.0))
    return e * p / (e * p + 1.0 - p)


def label_epsilon_lower_bound(correct: int, guess_prior: np.ndarray, *, confidence: float = 0.95) -> float:
    """The smallest epsilon not refuted by ``correct`` right guesses, where ``guess_prior[i]`` is the
    prior probability pi_i(g_i) of example i's guess (module docstring); 0 when even epsilon = 0 is
    not refuted."""
    p = np.clip(np.asarray(guess_prior, dtype=np.float64), 1e-12, 1 - 1e-12)
    n = p.shape[0]
    beta = 1.0 - v.unit_interval("confidence", confidence)
    c = int(correct)

    def rejected(eps: float) -> float:       # > 0: epsilon is refuted at level beta
        mean = float(_bound(p, eps).mean())
        if c < n * mean + 1:                 # Hoeffding's theorem needs c >= n mean + 1
            return -1.0
        return beta - float(binom.sf(c - 1, n, mean))

    if rejected(0.0) <= 0:
        return 0.0
    hi = 1.0
    while rejected(hi) > 0:
        hi *= 2
        if hi > 1e3:
            return math.inf
    return float(brentq(rejected, 0.0, hi, xtol=1e-6))


def label_inference(outputs: torch.Tensor, labels: torch.Tensor, prior=None, *,
                    confidence: float = 0.95) -> LabelInferenceResult:
    """Guess each training label as the model's most likely class (``outputs``: logits or
    probabilities [n, K] of the released model on the training inputs) and score the guesses
    against ``labels`` and the ``prior`` pi [n, K] they were drawn from (None: uniform over K)."""
    out = torch.as_tensor(outputs).detach().double().cpu()
    y = torch.as_tensor(labels).detach().long().cpu()
    if out.dim() != 2 or y.dim() != 1 or out.shape[0] != y.shape[0] or out.shape[0] == 0:
        raise ValueError(f"outputs must be [n, classes] and labels [n], got {tuple(out.shape)} and {tuple(y.shape)}")
    n, k = out.shape
    if y.min() < 0 or y.max() >= k:
        raise ValueError(f"labels must be in [0, {k}), got [{int(y.min())}, {int(y.max())}]")
    if prior is None:
        pi = np.full((n, k), 1.0 / k)
    else:
        pi = np.asarray(torch.as_tensor(prior).detach().double().cpu())
        if pi.shape != (n, k) or np.any(pi < 0) or not np.allclose(pi.sum(axis=1), 1.0, atol=1e-6):
            raise ValueError(f"prior must be [n, classes] = {(n, k)} of probabilities summing to 1 per row")
    guess = out.argmax(dim=1).numpy()
    right = guess == y.numpy()
    correct = int(right.sum())
    guess_prior = pi[np.arange(n), guess]
    acc, prior_acc = correct / n, float(pi.max(axis=1).mean())
    return LabelInferenceResult(n, correct, acc, prior_acc, acc - prior_acc,
                                label_epsilon_lower_bound(correct, guess_prior, confidence=confidence), confidence)
