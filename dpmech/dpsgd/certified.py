"""DP-SGD that trains a randomized-smoothing base classifier: several noise augmentations and a
consistency regulariser per example, inside the clipped gradient (docs/dp_certified.md).

Two additions to DP-SGD (Abadi et al. 2016, Alg. 1), both in the *per-example loss*, so that the
example's whole contribution is still ONE gradient clipped to norm <= C:

* **Augmentation multiplicity** (DP-CERT: Wu et al., "Augment then Smooth: Reconciling
  Differential Privacy with Certified Robustness", TMLR 2024, Sec. 4, the loss averaged over k
  Gaussian augmentations of each example before clipping; De et al. 2022's multiplicity with
  Gaussian noise as the augmentation)::

      l_i = (1/k) sum_{j=1..k} CE(f(x_i + z_ij), y_i),     z_ij ~ N(0, sigma^2 I),

  sigma = ``noise_augmentation_sigma`` (the smoothing sigma, [-1, 1] domain). The k copies of
  the batch are ONE forward pass of kB rows, rows ``j B + i`` holding example i's j-th copy; its
  gradient g_i = grad l_i (the sum over its k rows) is clipped once: book-keeping with
  ``BookKeeper(rows_per_example=k)`` (the k rows concatenated along the position axis, exact) or
  Opacus's per-row gradients summed over the k rows before Opacus clips (``flat``, exact).
  Opacus's ghost clipping would clip every row as an example of its own (sensitivity k C): refused.
* **Consistency regularisation** (Jeong & Shin, "Consistency Regularization for Certified
  Robustness of Smoothed Classifiers", NeurIPS 2020, Sec. 3.2, the loss L_con added to the
  averaged cross-entropy)::

      L_con,i = lambda (1/k) sum_j KL(p_hat_i || p_ij) + eta H(p_hat_i),
      p_ij = softmax f(x_i + z_ij),  p_hat_i = (1/k) sum_j p_ij,  H(p) = -sum_c p_c log p_c,

  lambda = ``consistency_weight``, eta = ``consistency_eta`` (the paper's default 0.5). The mean
  p_hat_i is over example i's own k rows only (never the batch), so L_con,i is a function of
  example i alone and joins l_i before clipping. The entropy is the true entropy of p_hat_i (the
  authors' code notes that its 'default' loss computes the entropy term differently; we take the
  paper's formula).

* **SmoothAdv** (Salman et al., "Provably Robust Deep Learning via Adversarially Trained Smoothed
  Classifiers", NeurIPS 2019, Sec. 3, SmoothAdv_PGD with the m = k noise draws fixed during the
  attack): with ``smoothadv_radius`` eps > 0, each example's input is first moved within the l2
  ball of radius eps ([-1, 1] domain, kept in [-1, 1]) by ``smoothadv_steps`` normalised gradient
  steps of size 2 eps / steps that lower log((1/k) sum_j softmax(f(x' + z_ij))_{y_i}) (the soft
  smoothed classifier's probability of the label, at example i's own draws), then l_i (and L_con,i)
  is computed at x'_i + z_ij. x'_i depends on (x_i, y_i, z_i, the parameters) only, and is held
  fixed (detached) in the gradient that is clipped, as in the paper's training.

Neither changes the privacy analysis: the sampling, C, sigma, the noise and the ledger are
:class:`~dpmech.dpsgd.trainer.DPSGDTrainer`'s (tests/test_dp_certified_training.py checks on
every clipping route, against a ``torch.func`` per-example reference in float64, that removing an
example moves the clipped sum by at most C, and that a regulariser mixing examples is caught).
The augmentation noise follows the public seed (``augment_gen``): it is data-independent
post-processing inside one example's loss.

    cfg = DPCertConfig(epsilon=3.0, delta=1e-5, noise_augmentation_sigma=1.0, augment_multiplicity=4,
                       consistency_weight=5.0, batch_size=512, epochs=10, lr=0.5, max_grad_norm=0.1)
    trainer = DPCertTrainer(build_dpsgd_model("mnist", 0, "tb_cnn"), x, y, cfg)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
from dpmech.privacy.clipping import BookKeeper


@dataclass
class DPCertConfig(DPSGDConfig):
    """DP-SGD's configuration plus the augmentation multiplicity k and the consistency weights."""

    augment_multiplicity: int = 1       # k Gaussian augmentations per example, averaged in its loss
    consistency_weight: float = 0.0     # lambda of Jeong & Shin's KL term (0: no regulariser)
    consistency_eta: float = 0.5        # eta of their entropy term (used only with consistency_weight > 0)
    smoothadv_radius: float = 0.0       # SmoothAdv's l2 eps, [-1, 1] domain (0: no attack)
    smoothadv_steps: int = 1            # its PGD steps (step size 2 eps / steps)

    def validate(self) -> None:
        super().validate()
        k = v.positive_int("augment_multiplicity", self.augment_multiplicity)
        lam = v.non_negative("consistency_weight", self.consistency_weight)
        v.non_negative("consistency_eta", self.consistency_eta)
        adv = v.non_negative("smoothadv_radius", self.smoothadv_radius)
        v.positive_int("smoothadv_steps", self.smoothadv_steps)
        if adv > 0 and self.noise_augmentation_sigma <= 0:
            raise ValueError("smoothadv_radius: > 0 needs noise_augmentation_sigma > 0 (SmoothAdv attacks the "
                             "smoothed classifier)")
        if k > 1 and self.noise_augmentation_sigma <= 0:
            raise ValueError("augment_multiplicity: k > 1 needs noise_augmentation_sigma > 0 (k noiseless copies of "
                             "an example are the same input)")
        if lam > 0 and k < 2:
            raise ValueError("consistency_weight: > 0 needs augment_multiplicity >= 2 (the consistency is between an "
                             "example's own noise augmentations)")
        if self.private and self.clipping == "ghost":
            raise ValueError("clipping: 'ghost' (Opacus) would clip each of an example's augment_multiplicity rows as "
                             "an example of its own (sensitivity k C); use 'bk' or 'flat'")

    @property
    def multi_row(self) -> bool:
        """True when the per-example loss is not plain DP-SGD's (k > 1, the regulariser or SmoothAdv)."""
        return self.augment_multiplicity > 1 or self.consistency_weight > 0 or self.smoothadv_radius > 0


def consistency_loss(logits: torch.Tensor, weight: float, eta: float) -> torch.Tensor:
    """Jeong & Shin 2020's L_con per example (module docstring) of ``logits`` [k, B, K] (example i's
    k augmentations in ``logits[:, i]``): lambda (1/k) sum_j KL(p_hat_i || p_ij) + eta H(p_hat_i), [B].
    p_hat_i averages over axis 0 only: example i's own rows."""
    logp = F.log_softmax(logits, dim=-1)                       # [k, B, K]
    p_hat = logp.exp().mean(0)                                 # [B, K]
    log_p_hat = p_hat.clamp_min(torch.finfo(p_hat.dtype).tiny).log()
    kl = (p_hat.unsqueeze(0) * (log_p_hat.unsqueeze(0) - logp)).sum(-1).mean(0)   # (1/k) sum_j KL(p_hat || p_j)
    entropy = -(p_hat * log_p_hat).sum(-1)
    return weight * kl + eta * entropy


def per_example_objective(logits: torch.Tensor, y: torch.Tensor, weight: float = 0.0,
                          eta: float = 0.5) -> torch.Tensor:
    """l_i of the module docstring from ``logits`` [k, B, K] and labels [B]: the mean over the k
    augmentations of CE(f(x_i + z_ij), y_i), plus L_con,i when ``weight`` > 0. Row i of the
    result depends on ``logits[:, i]`` and ``y[i]`` only."""
    k, b, n_cls = logits.shape
    ce = F.cross_entropy(logits.reshape(k * b, n_cls), y.repeat(k), reduction="none").reshape(k, b).mean(0)
    if weight > 0:
        ce = ce + consistency_loss(logits, weight, eta)
    return ce


def smoothadv(model, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, radius: float, steps: int,
              forward=None) -> torch.Tensor:
    """SmoothAdv_PGD (Salman et al. 2019, Sec. 3) per example: x' in the l2 ball of ``radius`` around
    each x_i (and in [-1, 1]) lowering log((1/k) sum_j softmax(f(x'_i + z_ij))_{y_i}) by ``steps``
    steps of 2 radius / steps along the l2-normalised gradient; z [k, B, ...] fixed. The objective
    is a sum over examples of terms of one example each, so row i of the gradient, and x'_i,
    depend on example i only (for a model that treats each example alone). Returns x' detached."""
    forward = forward or model
    k, b = z.shape[0], x.shape[0]
    x0 = x.detach()
    xa = x0.clone()
    step = 2.0 * radius / steps
    flat = (b,) + (1,) * (x.dim() - 1)
    for _ in range(steps):
        xa.requires_grad_(True)
        logits = forward((xa.unsqueeze(0) + z).reshape((k * b,) + tuple(x.shape[1:]))).reshape(k, b, -1)
        p_y = F.softmax(logits, -1).gather(-1, y.view(1, b, 1).expand(k, b, 1)).squeeze(-1).mean(0)   # [B]
        (g,) = torch.autograd.grad(-p_y.clamp_min(1e-12).log().sum(), xa)
        with torch.no_grad():
            g = g / g.flatten(1).norm(dim=1).clamp_min(1e-12).view(flat)
            d = xa + step * g - x0
            d = d * (radius / d.flatten(1).norm(dim=1).clamp_min(radius)).view(flat)   # into the l2 ball
            xa = (x0 + d).clamp(-1.0, 1.0)
    return xa.detach()


class DPCertTrainer(DPSGDTrainer):
    """:class:`DPSGDTrainer` whose per-example loss averages k Gaussian augmentations of the example
    and adds the consistency regulariser (module docstring); one clipped gradient per example.
    ``bk_prefer``: the book-keeping routes with k > 1 (:class:`~dpmech.privacy.clipping.BookKeeper`'s
    ``prefer``; "mixed" skips the one-off timing, whose compiled routes take tens of seconds)."""

    config: DPCertConfig

    def __init__(self, model, x_train, y_train=None, config: DPCertConfig | None = None, *, device="cpu",
                 plan_size=None, canaries=None, noise_key=None, bk_prefer: str = "measured"):
        if not isinstance(config, DPCertConfig):
            raise ValueError(f"config must be a DPCertConfig, got {type(config).__name__}")
        super().__init__(model, x_train, y_train, config, device=device, plan_size=plan_size, canaries=canaries,
                         noise_key=noise_key)
        k = config.augment_multiplicity
        if self.bookkeeper is not None and k > 1:
            # the k rows j B + i of example i are one example (clipping.py, rows_per_example)
            self.bookkeeper.remove()
            self.bookkeeper = BookKeeper(self.model, prefer=bk_prefer, rows_per_example=k)

    def augment(self, xb: torch.Tensor) -> torch.Tensor:
        """The base step's single augmentation is not used: :meth:`forward_backward` draws k."""
        return xb

    def augmentation_noise(self, xb: torch.Tensor) -> torch.Tensor:
        """z [k, B, ...] ~ N(0, sigma^2 I) from ``augment_gen`` (public seed; zeros when sigma is 0)."""
        cfg = self.config
        shape = (cfg.augment_multiplicity,) + tuple(xb.shape)
        if cfg.noise_augmentation_sigma <= 0:
            return xb.new_zeros(shape)
        z = torch.randn(shape, generator=self.augment_gen, device=xb.device, dtype=xb.dtype)
        return z.mul_(cfg.noise_augmentation_sigma)

    def objective(self, logits: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """Per-example losses [B] from logits [k, B, K] (:func:`per_example_objective`)."""
        cfg = self.config
        return per_example_objective(logits, yb, cfg.consistency_weight, cfg.consistency_eta)

    def forward_backward(self, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass of the kB rows [x + z_1; ...; x + z_k], the per-example objective, and its
        clipped sum: bk with k rows per example; flat: Opacus's per-row gradients summed over each
        example's rows before the optimizer clips them; the baseline: no clipping. Returns (the
        first augmentation's logits, per-example losses), detached."""
        cfg = self.config
        k, b = cfg.augment_multiplicity, int(xb.shape[0])
        z = self.augmentation_noise(xb)
        if cfg.smoothadv_radius > 0 and b > 0:
            xb = self.adversarial(xb, yb, z)
        inp = (xb.unsqueeze(0) + z).reshape((k * b,) + tuple(xb.shape[1:]))
        bk = self.bookkeeper
        if bk is not None:
            bk.enabled = True
        try:
            logits = self.forward_train(inp)
        finally:
            if bk is not None:
                bk.enabled = False
        logits = logits.reshape(k, b, -1)
        per_example = self.objective(logits, yb)
        if bk is not None:
            bk.clipped_sum(per_example.sum(), cfg.max_grad_norm)
            self._add_noise_and_scale()
        elif cfg.private:       # flat (ghost is refused by the config with k > 1)
            per_example.mean().backward()
            self._merge_rows(k, b)
        else:                   # the non-private baseline: DP-SGD's 1/B scaling, no clipping, no noise
            (per_example.sum() / cfg.batch_size).backward()
        return logits[0].detach(), per_example.detach()

    def adversarial(self, xb: torch.Tensor, yb: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """SmoothAdv's x' (:func:`smoothadv`) on the plain model: no clipping hook records the attack's
        passes (bk's hooks are off outside the training forward; Opacus's are switched off here)."""
        cfg = self.config
        hooks = self.gsm is not None and self.gsm.hooks_enabled
        if hooks:
            self.gsm.disable_hooks()
        try:
            return smoothadv(self.model, xb, yb, z, cfg.smoothadv_radius, cfg.smoothadv_steps)
        finally:
            if hooks:
                self.gsm.enable_hooks()

    def _merge_rows(self, k: int, b: int) -> None:
        """Opacus (``loss_reduction='mean'``) scaled each of the kB rows' gradients by its row count kB,
        i.e. row (j, i) holds k B / B = k times d l_i / d row: g_i = (1/k) sum_j grad_sample[j B + i]."""
        if k == 1:
            return
        for p in self.optimizer.params:
            gs = p.grad_sample
            if isinstance(gs, list):
                gs = torch.cat(gs)
            if gs.shape[0] != k * b:
                raise RuntimeError(f"clipping: 'flat' recorded {gs.shape[0]} per-row gradients, expected {k * b}")
            p.grad_sample = gs.reshape((k, b) + tuple(gs.shape[1:])).sum(0).div_(k)
