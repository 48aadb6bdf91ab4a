"""DPAL's privacy budget: the sensitivities, gamma and gamma_x, the split of a target eps_t into
eps_1 and eps_2, and the Laplace scales of the three training noises.

Equation, lemma and line numbers refer to "Differential Privacy in Adversarial Learning with
Provable Robustness" (DPAL, ICLR 2020 submission; seed document 003).

* ``delta_r``      Lemma 2:  Delta_R = d (beta + 2) per input channel (Appendix M: d is the patch
                   of one hidden neuron, beta the hidden neurons of one feature map; MNIST
                   (14^2 + 2) * 25, CIFAR-10 3 * (14^2 + 2) * 16).
* ``delta_l2``     Lemma 4:  Delta_L2 = 2 |h_pi|.
* ``gamma``        Lemma 3:  the perturbed affine transformation h_bar = theta_1^T x_bar + 2 chi_2 / m
                   is (eps_1 / gamma)-DP with gamma = 2 Delta_R / (m Delta_h1), where Delta_h1 is the
                   l1 -> l1 operator norm of x -> theta_1^T x (the bound enforced on theta_1).
* ``gamma_x``      Lemma 3:  the perturbed inputs x_bar = x + chi_1 / m are (eps_1 / gamma_x)-DP with
                   gamma_x = Delta_R / (m Delta_x), Delta_x = 1.
* ``split_budget`` Theorem 4 and Appendix M: eps_t = eps_1 + eps_1/gamma_x + eps_1/gamma + eps_2.
                   MNIST: eps_2 = 0.1, eps_1 = (eps_t - eps_2) / (1 + 1/gamma + 1/gamma_x).
                   CIFAR-10: eps_t = 2 + r, eps_2 = 1 + r/3, eps_1 = (1 + 2r/3) / (1 + 1/gamma + 1/gamma_x).
* ``noise_scales`` Alg. 1 line 1 and Eq. 7: the per-coordinate Laplace scales of chi_1 / m
                   (Delta_R / (m eps_1)), 2 chi_2 / m (2 Delta_R / (m eps_1)) and chi_3
                   (Delta_L2 / eps_2).

What these numbers do and do not guarantee is discussed in docs/dpal.md ("What the budget
means"): they are the paper's accounting, reproduced exactly, not an example-level DP
guarantee under replace-one neighbouring datasets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dpmech import _validate as v

DATASETS = ("mnist", "cifar10")

# Appendix M: eps_2 of MNIST, and the eps_t at which CIFAR-10's ratio r is 0.
MNIST_EPS2 = 0.1
CIFAR10_BASE = 2.0


def delta_r(patch_size: int, beta: int, channels: int = 1) -> float:
    """Lemma 2: Delta_R = channels * d * (beta + 2), the L1 sensitivity of the coefficients
    {h_i / 2, x_i} of the first-order Taylor reconstruction function (Eq. 6) per feature map.

    ``patch_size`` is d (the inputs one hidden neuron reads in one channel, e.g. 25 for 5x5),
    ``beta`` the hidden neurons of one feature map (14^2 for a 14x14 map), ``channels`` the input
    channels (Appendix M multiplies by 3 for CIFAR-10).
    """
    patch_size = v.positive_int("patch_size", patch_size)
    beta = v.positive_int("beta", beta)
    channels = v.positive_int("channels", channels)
    return float(channels * patch_size * (beta + 2))


def delta_l2(h_pi: int) -> float:
    """Lemma 4: Delta_L2 = 2 |h_pi|, the L1 sensitivity of the label coefficients
    sum_i h_pi,i y_i,k (all K classes together) when h_pi is bounded in [-1, 1]."""
    h_pi = v.positive_int("h_pi", h_pi)
    return float(2 * h_pi)


def gamma(delta_R: float, batch_size: int, theta1_norm: float) -> float:
    """Lemma 3 (proof in Appendix D): gamma = 2 Delta_R / (m Delta_h1).

    The affine transformation gets noise 2 chi_2 / m = Lap(2 Delta_R / (m eps_1)); with sensitivity
    Delta_h1 = ``theta1_norm`` (the l1 -> l1 operator norm of x -> theta_1^T x) that is the Laplace
    mechanism at eps_1 / gamma.
    """
    delta_R = v.positive("delta_R", delta_R)
    batch_size = v.positive_int("batch_size", batch_size)
    theta1_norm = v.positive("theta1_norm", theta1_norm)
    return 2.0 * delta_R / (batch_size * theta1_norm)


def gamma_x(delta_R: float, batch_size: int, delta_x: float = 1.0) -> float:
    """Lemma 3: gamma_x = Delta_R / (m Delta_x); the inputs get chi_1 / m = Lap(Delta_R / (m eps_1)),
    the Laplace mechanism at eps_1 / gamma_x for an input sensitivity Delta_x (the paper's 1)."""
    delta_R = v.positive("delta_R", delta_R)
    batch_size = v.positive_int("batch_size", batch_size)
    delta_x = v.positive("delta_x", delta_x)
    return delta_R / (batch_size * delta_x)


@dataclass(frozen=True)
class Budget:
    """Every component of DPAL's privacy budget (Theorem 4) and what it was computed from."""

    dataset: str
    eps_t: float          # the total, eps_1 + eps_x + eps_h + eps_2
    eps_1: float          # the auto-encoder's functional mechanism (Theorem 1)
    eps_x: float          # eps_1 / gamma_x: the perturbed inputs (Lemma 3)
    eps_h: float          # eps_1 / gamma: the perturbed affine transformation (Lemma 3)
    eps_2: float          # the label coefficients of the output layer (Theorem 3)
    gamma: float
    gamma_x: float
    delta_R: float
    delta_L2: float
    delta_h1: float       # the l1 -> l1 norm bound of theta_1 used in gamma
    delta_x: float
    batch_size: int

    def total(self) -> float:
        """eps_1 + eps_1/gamma_x + eps_1/gamma + eps_2 (Theorem 4), recomputed from the parts."""
        return self.eps_1 + self.eps_x + self.eps_h + self.eps_2

    def to_dict(self) -> dict:
        return asdict(self)


def split_budget(eps_t: float, dataset: str, *, gamma: float, gamma_x: float) -> tuple[float, float]:
    """(eps_1, eps_2) for a target total ``eps_t`` as Appendix M does.

    MNIST: eps_2 = 0.1 and eps_1 = (eps_t - eps_2) / (1 + 1/gamma + 1/gamma_x) (needs eps_t > 0.1).
    CIFAR-10: with r = eps_t - 2 >= 0, eps_2 = 1 + r/3 and eps_1 = (1 + 2r/3) / (1 + 1/gamma + 1/gamma_x),
    so that eps_1 (1 + 1/gamma + 1/gamma_x) + eps_2 = 2 + r = eps_t (needs eps_t >= 2).
    """
    eps_t = v.positive("eps_t", eps_t)
    dataset = v.choice("dataset", dataset, DATASETS)
    gamma = v.positive("gamma", gamma)
    gamma_x = v.positive("gamma_x", gamma_x)
    denom = 1.0 + 1.0 / gamma + 1.0 / gamma_x
    if dataset == "mnist":
        if eps_t <= MNIST_EPS2:
            raise ValueError(f"eps_t must be > {MNIST_EPS2} for MNIST (Appendix M fixes eps_2 = {MNIST_EPS2}), got {eps_t}")
        return (eps_t - MNIST_EPS2) / denom, MNIST_EPS2
    if eps_t < CIFAR10_BASE:
        raise ValueError(f"eps_t must be >= {CIFAR10_BASE} for CIFAR-10 (Appendix M: eps_t = 2 + r, r >= 0), got {eps_t}")
    r = eps_t - CIFAR10_BASE
    return (1.0 + 2.0 * r / 3.0) / denom, 1.0 + r / 3.0


def dpal_budget(eps_t: float, dataset: str, *, delta_R: float, delta_L2: float, batch_size: int,
                theta1_norm: float, delta_x: float = 1.0) -> Budget:
    """The full budget for a target ``eps_t``: gamma and gamma_x (Lemma 3) from the sensitivities, the
    batch size and the enforced norm bound of theta_1, then the Appendix M split (Theorem 4)."""
    g = gamma(delta_R, batch_size, theta1_norm)
    gx = gamma_x(delta_R, batch_size, delta_x)
    eps_1, eps_2 = split_budget(eps_t, dataset, gamma=g, gamma_x=gx)
    return Budget(dataset=dataset, eps_t=float(eps_t), eps_1=eps_1, eps_x=eps_1 / gx, eps_h=eps_1 / g,
                  eps_2=eps_2, gamma=g, gamma_x=gx, delta_R=float(delta_R), delta_L2=float(delta_L2),
                  delta_h1=float(theta1_norm), delta_x=float(delta_x), batch_size=int(batch_size))


@dataclass(frozen=True)
class NoiseScales:
    """Per-coordinate Laplace scales of the three training noises (Alg. 1 line 1, Eq. 7)."""

    x: float   # chi_1 / m on every input coordinate:          Delta_R / (m eps_1)
    h: float   # 2 chi_2 / m on every hidden unit of h_1:      2 Delta_R / (m eps_1)
    y: float   # chi_3 on every label coefficient sum_i h y:   Delta_L2 / eps_2


def noise_scales(budget: Budget) -> NoiseScales:
    """The Laplace scales that realise ``budget`` (Alg. 1 line 1; Eq. 7; Lemma 3; Theorem 3)."""
    m = budget.batch_size
    return NoiseScales(x=budget.delta_R / (m * budget.eps_1),
                       h=2.0 * budget.delta_R / (m * budget.eps_1),
                       y=budget.delta_L2 / budget.eps_2)


def laplace_epsilon(scale: float, sensitivity: float) -> float:
    """The epsilon of Laplace noise of ``scale`` on a query of L1 ``sensitivity`` (sensitivity / scale);
    used to recompute each budget component from the noise actually drawn."""
    scale = v.positive("scale", scale)
    sensitivity = v.positive("sensitivity", sensitivity)
    return sensitivity / scale

