"""The reference protocol: how the reference code (haiphanNJIT/StoBatch, ``MNIST/StoBatch.py``) trains and
evaluates, reproduced to show where the DPAL paper's MNIST numbers come from.

**Reference protocol: not a DP guarantee, not a white-box attack, not a certificate.** Its outputs are
reported under their own metric names (``ref_*``, docs/metrics.md), never as ``acc_*`` / ``cert_acc_*``.
What each piece is and why it is not valid: docs/dpal.md ("The reference protocol"). Line numbers below
are ``MNIST/StoBatch.py`` at HEAD (08a6505), identical to the first upload (cdf1220) except the
certificate (``certificate_size``).

* ``RefNet``: the reference's network (lines 127-182): conv 5x5/2 32 maps (ReLU, the fixed h noise added
  before it), batch norm on the current batch's statistics (``is_training=True``; its gamma/beta are in no
  optimiser's variable list, lines 135, 163, 492-499, so they stay 1/0), average pool 2, conv 5x5/2 64 maps
  (ReLU), fc 1024 -> 256, batch norm (batch statistics), clip to [-1, 1], fc 256 -> 10 with bias. The input
  is x + noise clipped to [-10, 10] (lines 385-389). ``RefNet.surrogate`` is ``inference_test_input``
  (lines 210-254): no h noise, no clip, and batch norms with fresh, never-updated statistics (mean 0,
  variance 1): about the identity. Attacks are computed on it.
* ``reference_budget``: eps_2 = eps_t - 0.1 (lines 276-278, 862), eps_2' = eps_2 / (1 + 1/gamma + 1/gamma_x)
  with gamma = 2 Delta_2 / (L ||W_conv1||_2) at initialisation and gamma_x = Delta_2 / L (lines 323-328,
  541-544); the fixed input noise Lap(Delta_2 / (L eps_2')) (line 77-81, 698-702), the fixed h noise
  Lap(2 Delta_2 / (eps_2' L)) (line 662), the label noise Lap(2 hk / (eps_3 L)) with eps_3 = 0.1 (line 316, 393).
* ``ae_loss`` (``mlp.py`` ``get_train_ops2``) and ``task_loss`` (lines 470-488): the two objectives; the
  adversarial half is fed with zero input noise (line 838-839: ``adv_noise: AdvLnoise_test``, a
  Lap(0) draw).
* ``surrogate_attack``: cleverhans' FGSM / BasicIterativeMethod / MomentumIterativeMethod / MadryEtAl on
  the surrogate with the surrogate's own predicted labels (lines 584-645: ``generate`` gets no ``y``).
* ``shared_draw_counts``: lines 771-785: one fresh input-noise tensor and one fresh h-noise tensor per Monte
  Carlo iteration, each of shape [1, ...] and so shared by the whole test batch, the product of the two
  softmaxes (input noise only x h noise only), argmax votes; batch norm on the test batch's statistics.
* ``certificate_size``: ``robustness.robustness_size_argmax`` (Clopper-Pearson, Bonferroni over 10
  classes, dp_epsilon 1: eps_r = ln(p_lb / p_ub) / 2) divided by the first upload's dp_mult
  (cdf1220 line 549, 743) or multiplied by HEAD's (line 550, 744).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpmech import _validate as v

HK = 256                     # line 265
DELTA2 = (14 * 14 + 2) * 25  # line 266: 4950
DELTA3 = 2 * HK              # lines 267-268: 512
EPS3 = 0.1                   # line 277
BN_EPS = 1e-3                # tf.contrib.layers.batch_norm's default epsilon
ATTACKS = ("fgsm", "ifgsm", "mim", "pgd")  # pgd = MadryEtAl (line 526: the four switched on)
CERTIFICATES = ("first_upload", "head")

__all__ = ["RefBudget", "RefNet", "reference_budget", "ae_loss", "task_loss", "surrogate_attack",
           "shared_draw_counts", "certificate_size", "clopper_pearson_eps_r", "ReferenceTrainer", "HK",
           "DELTA2", "ATTACKS", "CERTIFICATES"]


@dataclass(frozen=True)
class RefBudget:
    """The reference's budget and noise scales for one eps_t (``reference_budget``)."""

    eps_t: float
    eps2: float          # epsilon2 of line 276 (eps_t - eps_3)
    eps2_update: float   # line 544
    gamma: float         # line 328, from the spectral norm at initialisation
    gamma_x: float       # line 543
    spectral_norm: float
    b_x: float           # fixed input noise scale Delta_2 / (L eps2_update)
    b_h: float           # fixed h noise scale 2 Delta_2 / (L eps2_update)
    b_y: float           # label noise scale Delta_3 / (eps_3 L)
    batch_size: int


def reference_budget(eps_t: float, spectral_norm: float, batch_size: int = 2499) -> RefBudget:
    """Lines 276-278, 316, 328, 541-544, 662, 698: eps_2 = eps_t - 0.1 (needs eps_t > 0.1)."""
    eps_t = v.positive("eps_t", eps_t)
    if eps_t <= EPS3:
        raise ValueError(f"eps_t must be > {EPS3} (the reference fixes eps_3 = 0.1), got {eps_t}")
    spectral_norm = v.positive("spectral_norm", spectral_norm)
    L = v.positive_int("batch_size", batch_size)
    eps2 = eps_t - EPS3
    gamma = 2 * DELTA2 / (L * spectral_norm)
    gamma_x = DELTA2 / L
    eps2u = eps2 / (1.0 + 1.0 / gamma + 1.0 / gamma_x)
    return RefBudget(eps_t=eps_t, eps2=eps2, eps2_update=eps2u, gamma=gamma, gamma_x=gamma_x,
                     spectral_norm=spectral_norm, b_x=DELTA2 / (L * eps2u), b_h=2 * DELTA2 / (L * eps2u),
                     b_y=DELTA3 / (EPS3 * L), batch_size=L)


def _pad_same(x: torch.Tensor, k: int, s: int) -> torch.Tensor:
    """TensorFlow's 'SAME' padding (the extra row/column goes bottom/right)."""
    h = x.shape[-1]
    out = math.ceil(h / s)
    total = max((out - 1) * s + k - h, 0)
    lo = total // 2
    return F.pad(x, (lo, total - lo, lo, total - lo))


def _batch_norm(h: torch.Tensor, dims) -> torch.Tensor:
    """Batch norm on the current batch's statistics, gamma 1, beta 0 (lines 135, 163: is_training=True;
    the scale/offset variables are in no optimiser's var_list)."""
    mean = h.mean(dim=dims, keepdim=True)
    var = h.var(dim=dims, keepdim=True, unbiased=False)
    return (h - mean) / torch.sqrt(var + BN_EPS)


def _xavier(shape, fan_in, fan_out, gen):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


class RefNet(nn.Module):
    """The reference's MNIST network (lines 127-182, parameters lines 320-349, Xavier initialisation,
    biases 1e-4). ``forward`` is ``inference`` (training and Monte Carlo path), ``surrogate`` is
    ``inference_test_input`` (the attacked network)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(int(seed))
        self.w1 = nn.Parameter(_xavier((32, 1, 5, 5), 25, 25 * 32, g))   # TF fan: 5*5*1 in, 5*5*32 out
        self.b1 = nn.Parameter(torch.full((32,), 1e-4))
        self.w2 = nn.Parameter(_xavier((64, 32, 5, 5), 25 * 32, 25 * 64, g))
        self.b2 = nn.Parameter(torch.full((64,), 1e-4))
        self.fc1 = nn.Parameter(_xavier((HK, 4 * 4 * 64), 1024, HK, g))
        self.fb1 = nn.Parameter(torch.full((HK,), 1e-4))
        self.fc2 = nn.Parameter(_xavier((10, HK), HK, 10, g))
        self.fb2 = nn.Parameter(torch.full((10,), 1e-4))

    def encoder_parameters(self):
        """AECODER_VARIABLES (lines 320-321): trained only by the auto-encoder step."""
        return [self.w1, self.b1]

    def task_parameters(self):
        """CONV_VARIABLES (lines 335-342): trained only by the classification step."""
        return [self.w2, self.b2, self.fc1, self.fb1, self.fc2, self.fb2]

    def spectral_norm(self) -> float:
        """Lines 323-327: the largest singular value of W_conv1 reshaped to [25, 32]."""
        return float(torch.linalg.matrix_norm(self.w1.detach().reshape(32, 25), ord=2))

    def conv1(self, z: torch.Tensor) -> torch.Tensor:
        return F.conv2d(_pad_same(z, 5, 2), self.w1, self.b1, stride=2)

    def _top(self, h1: torch.Tensor, batch_stats: bool, clip: bool) -> torch.Tensor:
        h = F.avg_pool2d(h1, 2)
        h = F.relu(F.conv2d(_pad_same(h, 5, 2), self.w2, self.b2, stride=2))
        z2 = h.flatten(1) @ self.fc1.t() + self.fb1
        z2 = _batch_norm(z2, (0,)) if batch_stats else z2 / math.sqrt(1.0 + BN_EPS)
        if clip:
            z2 = z2.clamp(-1, 1)  # line 167 (max_out with hk units is the identity, line 166)
        return z2 @ self.fc2.t() + self.fb2

    def forward(self, x: torch.Tensor, x_noise: torch.Tensor | float = 0.0,
                h_noise: torch.Tensor | float = 0.0) -> torch.Tensor:
        """``inference`` (lines 127-182) on clip(x + x_noise, -10, 10) (lines 385-389); every batch norm on
        this batch's statistics: the output of one example depends on the whole batch."""
        z = (x + x_noise).clamp(-10, 10)
        h1 = F.relu(self.conv1(z) + h_noise)
        h1 = _batch_norm(h1, (0, 2, 3))
        return self._top(h1, batch_stats=True, clip=True)

    def surrogate(self, x: torch.Tensor, x_noise: torch.Tensor | float = 0.0) -> torch.Tensor:
        """``inference_test_input`` (lines 210-254): x + x_noise, no clip, no h noise, batch norms with
        never-updated statistics (x / sqrt(1 + 1e-3)), no clip of h_fc1. Per-example: the network the
        attacks see."""
        h1 = F.relu(self.conv1(x + x_noise)) / math.sqrt(1.0 + BN_EPS)
        return self._top(h1, batch_stats=False, clip=False)


def _parity_matrices() -> torch.Tensor:
    """A[s, o + 1, u] = 1 when tap u of a 5-tap kernel reads input row (i + u - 2) // 2 = i // 2 + o of the
    half-resolution map, for output rows i of parity s (nearest 2x upsampling followed by a 5x5 'SAME' conv)."""
    A = torch.zeros(2, 3, 5)
    for s in range(2):
        for u in range(5):
            A[s, (s + u - 2) // 2 + 1, u] = 1.0
    return A


def _upsample_conv(h: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """conv2d(upsample_nearest_2x(h), w_t, padding 2) for w_t [1, C, 5, 5], computed exactly as four 3x3
    convolutions of h (one per output parity) without materialising the upsampled map."""
    A = _parity_matrices().to(h)
    K = torch.einsum("sau,cuv,tbv->stcab", A, w_t[0], A).reshape(4, w_t.shape[1], 3, 3)
    out = F.conv2d(h, K, padding=1)
    N, H = h.shape[0], h.shape[2]
    return out.view(N, 2, 2, H, H).permute(0, 3, 1, 4, 2).reshape(N, 1, 2 * H, 2 * H)


class _BroadcastAbsCost(torch.autograd.Function):
    """sum_k sum |relu(c + b_k) a + log 2| over the K biases b_k (``decode2`` adds the 32 biases to the one
    reconstructed channel), computed one bias at a time (no [N, K, 28, 28] tensor); gradients for c and b."""

    @staticmethod
    def forward(ctx, c, b, a):
        total = c.new_zeros(())
        gc = torch.zeros_like(c)
        gb = torch.zeros_like(b)
        for k in range(b.shape[0]):
            z = c + b[k]
            pos = z > 0
            inner = z * a + LOG2
            total = total + torch.where(pos, inner.abs(), torch.full_like(z, LOG2)).sum()
            d = torch.where(pos, inner.sign() * a, torch.zeros_like(z))
            gc += d
            gb[k] = d.sum()
        ctx.save_for_backward(gc, gb)
        return total

    @staticmethod
    def backward(ctx, grad):
        gc, gb = ctx.saved_tensors
        return grad * gc, grad * gb, None


LOG2 = math.log(2.0)


def ae_loss(net: RefNet, x: torch.Tensor, x_noise, h_noise) -> torch.Tensor:
    """``mlp.py`` ``EncLayer.get_train_ops2``: h = clip(BN(relu(conv1(x + noise))), -1, 1) + h_noise;
    r = relu(conv(upsample_nearest(h), W_conv1 transposed) + b_conv1) (``decode2``; the 32 biases broadcast
    over the one output channel); cost sum |r (1/2 - (x + noise)) + log 2|."""
    xn = x + x_noise
    h = _batch_norm(F.relu(net.conv1(xn)), (0, 2, 3)).clamp(-1, 1) + h_noise
    c = _upsample_conv(h, net.w1.permute(1, 0, 3, 2))               # [N, 1, 28, 28], perm [1, 0, 3, 2]
    return _BroadcastAbsCost.apply(c, net.b1, (0.5 - xn).detach())


def _ae_loss_direct(net: RefNet, x: torch.Tensor, x_noise, h_noise) -> torch.Tensor:
    """``ae_loss`` written as the reference computes it (upsampled map, [N, 32, 28, 28] broadcast); tests."""
    xn = x + x_noise
    h = _batch_norm(F.relu(net.conv1(xn)), (0, 2, 3)).clamp(-1, 1) + h_noise
    up = F.interpolate(h, size=(28, 28), mode="nearest")
    r = F.relu(F.conv2d(up, net.w1.permute(1, 0, 3, 2), padding=2) + net.b1.view(1, -1, 1, 1))
    return (r * (0.5 - xn) + LOG2).abs().sum()


def task_loss(net: RefNet, x_b, y_b, x_a, y_a, x_noise, h_noise, chi3: torch.Tensor, alpha: float = 1.0):
    """Lines 470-488: per logit entry relu(z) - z y + log 2 - |z|/2 + z^2/8 - <chi_3, W_fc2> (the chi term
    once per entry), summed, (benign + alpha adv) / (L (1 + alpha)); the adversarial half with zero input
    noise (line 839) and the same fixed h noise."""
    def taylor(z, y):
        yo = F.one_hot(y, 10).to(z.dtype)
        return (F.relu(z) - z * yo + math.log(2.0) - z.abs() / 2 + z * z / 8).sum() - z.numel() * (chi3 * net.fc2.t()).sum()
    zb = net(x_b, x_noise, h_noise)
    za = net(x_a, 0.0, h_noise)
    return (taylor(zb, y_b) + alpha * taylor(za, y_a)) / (x_b.shape[0] * (1 + alpha))


def surrogate_attack(net: RefNet, x: torch.Tensor, name: str, eps: float, steps: int, step_size: float,
                     x_noise=0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """cleverhans (lines 584-645) on ``net.surrogate`` with its predicted labels (no y given): FGSM (one
    step of size eps), BasicIterativeMethod (ifgsm), MomentumIterativeMethod (mim, decay 1, l1-normalised
    gradients) and MadryEtAl (pgd: uniform start in the ball); projection to the eps ball and [-1, 1]."""
    if name not in ATTACKS:
        raise ValueError(f"attack must be one of {ATTACKS}, got {name!r}")
    with torch.no_grad():
        y = net.surrogate(x, x_noise).argmax(1)

    def grad(xa):
        xa = xa.detach().requires_grad_(True)
        loss = F.cross_entropy(net.surrogate(xa, x_noise), y, reduction="sum")
        return torch.autograd.grad(loss, xa)[0]

    if name == "fgsm":
        return (x + eps * grad(x).sign()).clamp(-1, 1).detach()
    xa = x.clone()
    if name == "pgd":
        u = (torch.rand(x.shape, generator=generator).to(x.device) if generator is not None else torch.rand_like(x))
        xa = (x + (u * 2 - 1) * eps).clamp(-1, 1)
    mom = torch.zeros_like(x)
    for _ in range(steps):
        g = grad(xa)
        if name == "mim":
            mom = mom + g / g.abs().flatten(1).mean(1).clamp_min(1e-12).view(-1, 1, 1, 1)
            g = mom
        xa = xa + step_size * g.sign()
        xa = torch.min(torch.max(xa, x - eps), x + eps).clamp(-1, 1)
    return xa.detach()


@torch.no_grad()
def shared_draw_counts(net: RefNet, x: torch.Tensor, x_fixed: torch.Tensor, h_fixed: torch.Tensor, b_x: float,
                       b_h: float, n: int, generator: torch.Generator, *, psi: float = 2.0,
                       per_example: bool = False) -> torch.Tensor:
    """Lines 771-785: vote counts [N, 10]. The first vote is the prediction with the fixed noise alone; each
    of the n - 1 further votes is argmax of softmax(f(x; x_fixed, h_fixed + h'/psi)) * softmax(f(x; x_fixed +
    x'/psi, h_fixed)) with x' ~ Lap(b_x) of shape [1, 1, 28, 28] and h' ~ Lap(b_h) of shape [1, 32, 14, 14]:
    one draw per iteration shared by the whole batch (the reference's protocol). The batch norms use the
    batch's statistics. ``per_example=True`` draws x', h' per example instead (the estimator the paper
    describes; the contrast the tests measure)."""
    n = v.positive_int("n", n)
    lap = torch.distributions.Laplace(0.0, 1.0)
    N = x.shape[0]
    counts = torch.zeros(N, 10, dtype=torch.long, device=x.device)
    pred = net(x, x_fixed, h_fixed).argmax(1)
    lead = N if per_example else 1

    def draw(shape, scale):
        u = torch.rand((lead, *shape), generator=generator).to(x.device).clamp(1e-12, 1 - 1e-12) - 0.5
        return -scale * u.sign() * torch.log1p(-2 * u.abs())   # Laplace(0, scale) by inversion
    del lap
    for i in range(n):
        counts[torch.arange(N), pred] += 1
        if i == n - 1:
            break
        xp = draw((1, 28, 28), b_x)
        hp = draw((32, 14, 14), b_h)
        p = F.softmax(net(x, x_fixed, h_fixed + hp / psi), 1) * F.softmax(net(x, x_fixed + xp / psi, h_fixed), 1)
        pred = p.argmax(1)
    return counts


def clopper_pearson_eps_r(counts: np.ndarray, alpha: float = 0.05) -> np.ndarray:
    """``robustness.py`` ``robustness_size_argmax`` with dp_epsilon 1: Clopper-Pearson bounds of the top two
    counts at alpha / K (Bonferroni), eps_r = ln(p_lb / p_ub) / 2, 0 when p_lb <= p_ub."""
    from scipy.stats import beta

    counts = np.asarray(counts, dtype=float)
    K = counts.shape[1]
    tot = counts.sum(1)
    srt = np.sort(counts, axis=1)
    c1, c2 = srt[:, -1], srt[:, -2]
    lb = beta.ppf(alpha / K, c1, tot - c1 + 1)
    ub = beta.ppf(1 - alpha / K, c2 + 1, tot - c2)
    lb = np.nan_to_num(lb, nan=0.0)
    ub = np.nan_to_num(ub, nan=1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps_r = np.where(lb > ub, np.log(lb / np.maximum(ub, 1e-300)) / 2, 0.0)
    return eps_r


def certificate_size(eps_r: np.ndarray, mu: float, budget: RefBudget, which: str = "first_upload") -> np.ndarray:
    """The reference's robustness size at attack size mu (image_size^2 = 784, beta = 14^2):
    delta_r = 784 mu, delta_h = ||W_conv1||_2 * 196 (lines 331, 547-548).

    * ``first_upload`` (cdf1220 lines 549, 743): eps_r / dp_mult with dp_mult = b_x / delta_r + b_h / delta_h
      (dp_epsilon 1): more noise, a SMALLER size. Fig. 6 of the paper matches this one.
    * ``head`` (08a6505 lines 550, 744): eps_r * b_x / (delta_h / 2 + delta_r) = eps_r / (1/kappa' + 1/phi').
    """
    if which not in CERTIFICATES:
        raise ValueError(f"certificate must be one of {CERTIFICATES}, got {which!r}")
    delta_r = mu * 28 * 28
    delta_h = budget.spectral_norm * 14 ** 2
    if which == "first_upload":
        return eps_r / (budget.b_x / delta_r + budget.b_h / delta_h)
    return eps_r * budget.b_x / (delta_h / 2 + delta_r)


def _laplace(shape, scale, gen):
    u = torch.rand(shape, generator=gen, dtype=torch.float64).clamp(1e-15, 1 - 1e-15) - 0.5
    return (-scale * u.sign() * torch.log1p(-2 * u.abs())).float()


class ReferenceTrainer:
    """The reference's training loop (lines 714-839) and evaluation (lines 719-803).

    Each step: three groups of L/3 examples give I-FGSM, MIM and MadryEtAl examples on the surrogate (with
    the fixed adversarial input noise AdvLnoise, line 825-832) at mu_t ~ U(0, 1) (``d_eps``, line 823);
    MadryEtAl's step is mu_a / T (line 644, the run's ``fgsm_eps``); then the auto-encoder step and the
    classification step on a fresh batch of L (lines 836-839). Batches are drawn at random (``next_batch``
    with reshuffling each pass). ``attack_steps`` replaces the reference's 100 iterations (step size
    mu / attack_steps).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, eps_t: float, *, mu_a: float = 0.2, batch_size: int = 2499,
                 lr: float = 1e-4, alpha: float = 1.0, attack_steps: int = 10, seed: int = 0,
                 device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else x.device
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.L = v.positive_int("batch_size", batch_size)
        if x.shape[0] < 2 * self.L:
            raise ValueError(f"batch_size must be at most half the training set ({x.shape[0]}), got {self.L}")
        self.mu_a = v.positive("mu_a", mu_a)
        self.alpha = float(alpha)
        self.attack_steps = v.positive_int("attack_steps", attack_steps)
        self.seed = int(seed)
        self.net = RefNet(seed)
        self.budget = reference_budget(eps_t, self.net.spectral_norm(), self.L)
        self.net.to(self.device)
        g = torch.Generator().manual_seed(self.seed + 7)
        b = self.budget
        self.noise = {
            "adv": _laplace((1, 1, 28, 28), b.b_x, g),        # AdvLnoise (line 698)
            "benign": _laplace((1, 1, 28, 28), b.b_x, g),     # BenignLNoise (line 702)
            "h": _laplace((1, 32, 14, 14), b.b_h, g),         # perturbFM_h (line 662)
            "chi3": _laplace((HK, 10), b.b_y, g),             # perturbFM (line 393)
        }
        self.noise = {k: t.to(self.device) for k, t in self.noise.items()}
        self.opt_ae = torch.optim.Adam(self.net.encoder_parameters(), lr=lr)
        self.opt_task = torch.optim.Adam(self.net.task_parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(self.seed + 11)
        self.step_count = 0
        self._perm = torch.randperm(x.shape[0], generator=self.gen)
        self._pos = 0

    @property
    def steps_per_epoch(self) -> int:
        """Line 288: int(D / L) with D the training-set size."""
        return max(1, self.x.shape[0] // self.L)

    def _next(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pos + k > self._perm.numel():
            self._perm = torch.randperm(self.x.shape[0], generator=self.gen)
            self._pos = 0
        idx = self._perm[self._pos:self._pos + k].to(self.device)
        self._pos += k
        return self.x[idx], self.y[idx]

    def step(self) -> float:
        """One step of lines 714-839 (without the evaluation)."""
        k = self.L // 3
        d_eps = float(torch.rand((), generator=self.gen))
        T = self.attack_steps
        advs, ys = [], []
        for name, step_size in (("ifgsm", d_eps / T), ("mim", d_eps / T), ("pgd", self.mu_a / T)):
            xb, yb = self._next(k)
            advs.append(surrogate_attack(self.net, xb, name, d_eps, T, step_size, self.noise["adv"], self.gen))
            ys.append(yb)
        x_adv, y_adv = torch.cat(advs), torch.cat(ys)
        xb, yb = self._next(self.L)
        nz = self.noise
        self.opt_ae.zero_grad(set_to_none=True)
        (ae_loss(self.net, x_adv, 0.0, nz["h"]) + ae_loss(self.net, xb, nz["benign"], nz["h"])).backward()
        self.opt_ae.step()
        self.opt_task.zero_grad(set_to_none=True)
        loss = task_loss(self.net, xb, yb, x_adv, y_adv, nz["benign"], nz["h"], nz["chi3"], self.alpha)
        loss.backward()
        self.opt_task.step()
        self.step_count += 1
        return float(loss.detach())

    def evaluate(self, xt: torch.Tensor, yt: torch.Tensor, *, attacks=ATTACKS, sizes=(0.2,), n: int = 2000,
                 attack_steps: int = 100, psi: float = 2.0, cert_sizes=(), seed: int = 0) -> dict[str, float]:
        """Lines 725-803 for each attack and size: craft on the surrogate (zero input noise, line 769), vote
        with ``shared_draw_counts`` on the whole attacked test batch, accuracy of the votes; for sizes in
        ``cert_sizes`` also the reference certificate at that size (robust if size >= mu, line 792) and
        #(robust and correct) / N (line 802). Keys: ``ref_acc_clean``, ``ref_acc_<attack>_<size>``,
        ``ref_cert_acc_<attack>_<size>`` (the first upload's certificate, Fig. 6) and
        ``ref_cert_head_acc_<attack>_<size>`` (HEAD's)."""
        from dpmech.robustness.evaluation import metric_name

        g = torch.Generator().manual_seed(int(seed) * 1000 + 17)
        nz = self.noise
        xt, yt = xt.to(self.device), yt.to(self.device)
        out: dict[str, float] = {}
        with torch.no_grad():
            out["ref_acc_clean"] = float((self.net(xt, nz["benign"], nz["h"]).argmax(1) == yt).float().mean())
        for name in attacks:
            for mu in sizes:
                steps = 1 if name == "fgsm" else attack_steps
                xa = surrogate_attack(self.net, xt, name, mu, steps, mu / steps, 0.0, g)
                counts = shared_draw_counts(self.net, xa, nz["benign"], nz["h"], self.budget.b_x, self.budget.b_h,
                                            n, g, psi=psi)
                correct = (counts.argmax(1) == yt).cpu().numpy()
                out["ref_" + metric_name(name, mu)] = float(correct.mean())
                if mu in cert_sizes:
                    eps_r = clopper_pearson_eps_r(counts.cpu().numpy())
                    for which, tag in (("first_upload", "ref_cert_"), ("head", "ref_cert_head_")):
                        robust = certificate_size(eps_r, mu, self.budget, which) >= mu
                        out[tag + metric_name(name, mu)] = float((robust & correct).mean())
        return out

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "opt_ae": self.opt_ae.state_dict(), "opt_task": self.opt_task.state_dict(),
                "gen": self.gen.get_state(), "step_count": self.step_count, "perm": self._perm, "pos": self._pos,
                "noise": self.noise}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["net"])  # (load_state_dict copies onto the parameters' device)
        self.opt_ae.load_state_dict(state["opt_ae"])
        self.opt_task.load_state_dict(state["opt_task"])
        self.gen.set_state(state["gen"])
        self.step_count = int(state["step_count"])
        self._perm, self._pos = state["perm"], int(state["pos"])
        self.noise = {k: t.to(self.device) for k, t in state["noise"].items()}
