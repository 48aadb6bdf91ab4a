"""LabelDP-Pro (Ghazi, Huang, Kamath, Kumar, Manurangsi, Zhang, "LabelDP-Pro: Learning with Label
Differential Privacy via Projections", ICLR 2024, Algorithm 1) on a linear head over public features:
the baseline of issue 38 (docs/label_dp.md, "High privacy"). Approximate DP (Gaussian noise).

Each step of gradient descent on a batch B (our reading of Alg. 1, for the network we train: a linear
layer ``W`` on standardised ScatterNet features with a bias, the same network as ``cluster_rr``):

* the per-example gradient of the cross-entropy is ``(p_i - e_{y_i}) xhat_i^T`` with ``xhat_i = [x_i, 1]``
  scaled to L2 norm at most ``clip`` (an image-only operation) and ``p_i`` the model's softmax (public:
  it depends on the weights released so far and the image);
* the label enters only through ``S = sum_i e_{y_i} xhat_i^T``; changing one label changes S by
  ``(e_b - e_a) xhat_i^T``, Frobenius norm at most ``sqrt(2) clip``: S gets N(0, sigma^2) noise
  on every entry and the noisy gradient is ``g = (sum_i p_i xhat_i^T - S_noisy) / |B|``;
* **projection** (the paper's denoising step): g is projected onto the span of the gradients
  ``{grad loss(x_j, c) : j in P, c = 0..K-1}`` of a fresh public batch P of ``proj_images`` images for
  every possible label. For a linear head that span is exactly {M : 1^T M = 0, rows of M in
  span{xhat_j}} (``(p_j - e_c)`` over c spans the sum-zero vectors), so the projection is
  ``(I - 11^T/K) g Q Q^T`` with Q an orthonormal basis of the ``xhat_j`` (QR). ``proj_images = 0``
  projects onto the span of the batch's own gradients (no bias: the true gradient lies in it).

Privacy: batches are the disjoint blocks of a public random order (no privacy amplification by
sampling is claimed), so every label is read once per epoch; E epochs are an adaptive composition of
E Gaussian mechanisms of L2 sensitivity ``sqrt(2) clip`` and noise sigma, i.e. one Gaussian mechanism
of sensitivity ``sqrt(2 E) clip`` (mu-GDP composition, Dong, Roth & Su 2022, Cor. 3.3), whose exact
(epsilon, delta) is the Balle & Wang (2018, Thm. 8) profile (``dpmech.privacy.mechanisms.gaussian_delta``).
sigma is calibrated with ``analytic_gaussian_sigma``; the epsilon reported is recomputed from the sigma
drawn with and the epochs run. Projection and everything after it are post-processing.

Randomness and checkpoints (docs/threat_model.md; DESIGN.md, Conventions: "a checkpoint holds the
step, not a generator state"): the Gaussian noise of pass e comes from the secret key's stream at
step e (:class:`dpmech.privacy.secret.StepStream`, seeded by HMAC(key, stream, e)); a checkpoint
(:meth:`LabelDPProRun.state_dict`) holds the pass counter and no state of that stream (research mode:
the running stream's state, as before). The batch order and the projection images follow the public
seed and keep their generator's state.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from scipy.optimize import brentq

from dpmech import _validate as v
from dpmech.label_dp.cluster_prior import LabelLedger, PrivateLabels, derive_seed
from dpmech.privacy.mechanisms import analytic_gaussian_sigma, gaussian_delta
from dpmech.privacy.secret import NoiseKey

__all__ = ["LabelDPProConfig", "LabelDPProRun", "gaussian_epsilon", "project_linear_span", "train_labeldp_pro"]


@dataclass
class LabelDPProConfig:
    epochs: int = 10
    batch_size: int = 5000
    lr: float = 0.5                # plain gradient descent with momentum on the projected gradient
    momentum: float = 0.9
    clip: float = 1.0              # L2 bound of [x, 1] (each row scaled to this norm)
    proj_images: int = 256         # public images whose per-label gradients span the projection; 0 = the batch
    delta: float = 1e-5

    def __post_init__(self):
        v.positive_int("epochs", self.epochs)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.unit_interval("momentum", self.momentum, high_open=True)
        v.positive("clip", self.clip)
        v.positive_int("proj_images", self.proj_images, minimum=0)
        v.open_unit("delta", self.delta)

    def to_dict(self) -> dict:
        return asdict(self)


def gaussian_epsilon(sigma: float, delta: float, sensitivity: float) -> float:
    """The smallest epsilon at which N(0, sigma^2) noise on an L2-``sensitivity`` query is
    (epsilon, delta)-DP (inverse of Balle & Wang's profile in epsilon; 0 if delta already holds at 0)."""
    if gaussian_delta(sigma, 0.0, sensitivity) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(sigma, hi, sensitivity) > delta:
        hi *= 2.0
    return float(brentq(lambda e: gaussian_delta(sigma, e, sensitivity) - delta, 0.0, hi, xtol=1e-12, rtol=1e-10))


def project_linear_span(g: torch.Tensor, xhat_public: torch.Tensor) -> torch.Tensor:
    """Projection of g [K, D] onto span{(p - e_c) xhat_j^T} = {M : 1^T M = 0, rows in span(xhat_j)}."""
    q, _ = torch.linalg.qr(xhat_public.double().T)            # [D, m] orthonormal columns (float64)
    gp = (g.double() @ q) @ q.T
    return gp - gp.mean(0, keepdim=True)


def _xhat(x: torch.Tensor, clip: float) -> torch.Tensor:
    """[x, 1] scaled to norm ``clip`` (float32; an image-only operation)."""
    xa = torch.cat([x.float(), torch.ones(x.shape[0], 1)], 1)
    return xa * (clip / xa.double().norm(dim=1, keepdim=True)).float()


class LabelDPProRun:
    """The noisy passes of LabelDP-Pro; the ledger charges all ``cfg.epochs`` passes at construction
    (the labels are read there, inside the recorded release). One pass per ``train_epoch``."""

    def __init__(self, feats: torch.Tensor, labels: PrivateLabels, epsilon: float, cfg: LabelDPProConfig, *,
                 seed: int, noise_key: NoiseKey | None = None):
        epsilon = v.positive("epsilon", epsilon)
        self.cfg = cfg
        self.ledger = LabelLedger(labels)
        self.n, self.k = len(labels), labels.num_classes
        key = NoiseKey.resolve(noise_key)
        self.sens_total = math.sqrt(2.0 * cfg.epochs) * cfg.clip
        self.sigma = analytic_gaussian_sigma(epsilon, cfg.delta, self.sens_total)
        eps_used = gaussian_epsilon(self.sigma, cfg.delta, self.sens_total)
        self.xh = _xhat(feats, cfg.clip)
        self.w = torch.zeros(self.k, self.xh.shape[1])
        self.mom = torch.zeros_like(self.w)
        self.pub = torch.Generator().manual_seed(derive_seed(seed, 30))
        self.noise_stream = key.step_stream("label_dp.labeldp_pro", derive_seed(seed, 31))
        self.noise = self.noise_stream.generator   # reseeded per pass by at() (secret key)
        with self.ledger.release("labeldp_pro_gaussian", max(eps_used, 1e-300), None, cfg.delta) as tok:
            self._y = self.ledger.labels.reveal(tok)
        self.epoch = 0
        self.info = {"sigma": self.sigma, "sensitivity_total": self.sens_total, "epsilon": eps_used,
                     "delta": cfg.delta}

    def train_epoch(self) -> float:
        """One pass over disjoint batches in a public random order. Returns 0.0 as the loss: a training
        loss would read the labels outside the charged release."""
        if self.epoch >= self.cfg.epochs:
            raise ValueError(f"epochs: LabelDP-Pro was charged for {self.cfg.epochs} passes; no more may run")
        cfg, k, d = self.cfg, self.k, self.xh.shape[1]
        self.noise_stream.at(self.epoch)   # this pass's noise generator
        order = torch.randperm(self.n, generator=self.pub)
        for s in range(0, self.n, cfg.batch_size):
            idx = order[s:s + cfg.batch_size]
            xb = self.xh[idx]
            p = torch.softmax(xb @ self.w.T, 1)
            s_noisy = torch.zeros(k, d, dtype=torch.float64).index_add_(0, self._y[idx], xb.double())
            s_noisy += self.sigma * torch.randn(k, d, generator=self.noise, dtype=torch.float64)
            g = ((p.T @ xb).double() - s_noisy) / len(idx)
            proj = xb if cfg.proj_images == 0 else self.xh[torch.randint(self.n, (cfg.proj_images,), generator=self.pub)]
            g = project_linear_span(g, proj).float()
            self.mom = cfg.momentum * self.mom + g
            self.w -= cfg.lr * self.mom
        self.epoch += 1
        return 0.0

    def predict(self, feats: torch.Tensor) -> torch.Tensor:
        return (_xhat(feats, self.cfg.clip) @ self.w.T).argmax(1)

    def state_dict(self) -> dict:
        """Weights, momentum, the public generator, the pass counter; the noise stream's state only
        in the research mode (with a secret key the noise of pass e follows from the key and e)."""
        noise = self.noise_stream.state_dict()
        return {"w": self.w.clone(), "mom": self.mom.clone(), "pub": self.pub.get_state(),
                **({"noise": noise} if noise is not None else {}), "epoch": self.epoch}

    def load_state_dict(self, st: dict) -> None:
        self.w, self.mom = st["w"].clone(), st["mom"].clone()
        self.pub.set_state(st["pub"])
        self.noise_stream.load_state_dict(st.get("noise"), "noise")   # secret key: not read
        self.epoch = int(st["epoch"])


def train_labeldp_pro(feats: torch.Tensor, labels: PrivateLabels, epsilon: float, cfg: LabelDPProConfig, *,
                      seed: int, noise_key: NoiseKey | None = None, log=None):
    """LabelDP-Pro at (epsilon, cfg.delta)-label-DP. Returns (predict function, ledger, info)."""
    t0 = time.perf_counter()
    run = LabelDPProRun(feats, labels, epsilon, cfg, seed=seed, noise_key=noise_key)
    for e in range(cfg.epochs):
        run.train_epoch()
        if log is not None:
            log(f"    labeldp_pro epoch {e + 1}/{cfg.epochs} ({time.perf_counter() - t0:.0f} s)")
    info = {**run.info, "train_seconds": time.perf_counter() - t0}
    return run.predict, run.ledger, info
