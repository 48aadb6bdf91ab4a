"""Label inference: what a label-DP model's outputs reveal about its training labels (issue 52, part 5;
docs/mia.md, "Label DP: label inference").

Reference: Kalemaj, Mironov, Melis, Boucher & Mahloujifar, "Observational Auditing of Label Privacy"
(arXiv 2511.14084, 2025). Their privacy notion is simulation-based (SIM-DP): M(D) must be
(epsilon, delta)-close to an imputation simulator, M(D with (x, y) replaced by (x, y')) where
y' ~ D|x, the data's own conditional label distribution; an attacker who guesses y from the output
better than from the prior refutes the claim, and the randomness the audit rests on is the data's, not
canaries'. Their estimator, its section and theorem numbers and their proxy-model correction were not
read offline (only the abstract and a summary of the setting): this module follows the idea, and its
bound is its own (below), stated so that it can be checked.

**The prior.** Example i's label is a draw from a prior pi_i(.) given its input; the attacker knows
pi. In their setting pi is a proxy model's estimate of D|x (the audit then carries the proxy's error,
which they bound and this module does not); in :class:`LabelGame` (the sweep's ``label_attack`` key)
the audited examples' labels are drawn from the uniform prior by the owner's secret key, so pi is
known exactly and the bound is rigorous. (With real MNIST labels D|x is nearly a point mass and a
model that generalises guesses a training label from its *other* examples without any leak: the
uniform prior would then "refute" every claim, falsely.)

The attacker guesses each training example's label from the released model's output.

**The bound.** If training is epsilon-label-DP, changing example i's label changes the
distribution of the output by at most e^epsilon, so for any guess g_i, the posterior
Pr[y_i = g_i | output] <= e^eps pi_i(g_i) / (e^eps pi_i(g_i) + 1 - pi_i(g_i)) =: f_eps(pi_i(g_i))
(the randomized-response bound; uniform prior over K classes: e^eps / (e^eps + K - 1)). The number of
correct guesses C is then a sum of Bernoulli(p_i) with p_i <= f_eps(pi_i(g_i)) given the output, and by
Hoeffding (1956, Thm. 4) Pr[C >= c] <= Pr[Binomial(n, mean_i f_eps(pi_i(g_i))) >= c] for c >= n
mean + 1. ``eps_lb`` is the smallest epsilon this test does not reject at level beta: a claim below it
is refuted at confidence 1 - beta. (Rigorous when the labels are independent draws from pi given the
inputs; with real labels and a proxy's pi it carries the proxy's error, which Kalemaj et al. bound
separately and which is not bounded here.) Pure epsilon only: an (epsilon, delta) release adds up to
delta per example to each p_i and is not covered by this test.

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
from dpmech.privacy.mia.game import batched_outputs


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


def label_guess_outputs(model, x: torch.Tensor, *, batch_size: int = 1000) -> torch.Tensor:
    """The attack's whole view: the released ``model``'s outputs [n, K] on the audited inputs ``x``
    (eval mode, no gradients, on CPU). It takes no label: the guess is the output's most likely class
    (:func:`label_inference`), and the true labels only score it."""
    return batched_outputs(model, x, batch_size, "label_guess_outputs")


class LabelGame:
    """Kalemaj et al.'s game with a prior known exactly (module docstring): ``index`` names n audited
    examples of a training set (public: which examples are audited, and that their labels were
    released by the trial's mechanism like every other); each one's label is replaced by a draw from
    the uniform prior over ``num_classes`` with ``generator`` (the owner's secret in a sweep). The
    mechanism trains on :meth:`training_labels`; the attack sees the inputs and the model only
    (:func:`label_guess_outputs`); :meth:`evaluate` scores its guesses against the drawn labels.

    The drawn labels live in a slotted attribute with no accessor and the game cannot be pickled
    (nothing logs or ships it by accident); as with :class:`~dpmech.privacy.mia.game.MembershipGame`
    this guards against mistakes, it is not a sandbox."""

    __slots__ = ("index", "num_classes", "_labels")

    def __init__(self, index: torch.Tensor, num_classes: int, *, generator: torch.Generator):
        if not isinstance(generator, torch.Generator):
            raise TypeError("generator: a torch.Generator the attack never receives (the owner's secret key's)")
        idx = torch.as_tensor(index, dtype=torch.int64).flatten()
        if idx.numel() == 0 or idx.unique().numel() != idx.numel() or int(idx.min()) < 0:
            raise ValueError("index: n >= 1 distinct non-negative positions of the audited examples")
        self.index = idx
        self.num_classes = v.positive_int("num_classes", num_classes, minimum=2)
        self._labels = torch.randint(0, self.num_classes, (idx.numel(),), generator=generator)

    def training_labels(self, y: torch.Tensor) -> torch.Tensor:
        """A copy of the training labels ``y`` with the audited ones replaced by the drawn labels (what
        the mechanism releases and trains on; it sees its training labels, as it must)."""
        if int(self.index.max()) >= y.shape[0]:
            raise ValueError(f"index: positions up to {int(self.index.max())} in a training set of {y.shape[0]}")
        out = y.clone()
        out[self.index.to(y.device)] = self._labels.to(y.device, y.dtype)
        return out

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The audited examples' inputs (the attacker's: public)."""
        return x[self.index.to(x.device)]

    def evaluate(self, outputs: torch.Tensor, *, confidence: float = 0.95) -> LabelInferenceResult:
        """The guesses (argmax of ``outputs``) scored against the drawn labels under the uniform prior."""
        return label_inference(outputs, self._labels, None, confidence=confidence)

    def __reduce__(self):
        raise TypeError("LabelGame cannot be pickled: it holds the audited examples' secret labels")
