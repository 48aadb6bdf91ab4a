"""dpal_sound: a sound DPAL. DP-SGD on DPAL's adversarial objective, a randomized-smoothing classifier.

What is kept from DPAL (Phan et al., "Scalable Differential Privacy with Certified Robustness in
Adversarial Learning", ICML 2020 / the ICLR 2020 submission; docs/dpal.md): the adversarial
objective of Eq. 10, a benign term plus xi times an adversarial term normalised by (1 + xi),
adversarial examples crafted by an *ensemble* of l-inf attacks with a random size mu_t ~ U(0, mu_max)
(Alg. 1 lines 6-8), and a classifier that runs under its own Gaussian noise at training and at
inference. What is replaced, so that every number it reports is a guarantee:

* **Privacy** (example-level DP of everything trained): DP-SGD (Abadi et al. 2016, Alg. 1) on all
  parameters through :class:`dpmech.dpsgd.trainer.DPSGDTrainer`: Poisson sampling, per-example clipping,
  Gaussian noise calibrated to (epsilon, delta) over the planned steps, the RDP/PLD ledger of the
  steps taken. No eps_1/eps_2/gamma split: the whole epsilon goes to DP-SGD, and the robustness
  noise below costs no privacy (it touches only inputs that enter through the clipped loss).
* **Per-example loss inside the clipped gradient** (Eq. 10 per example)::

      loss_i = [CE(f(x_i + z_i), y_i) + xi CE(f(x_i^adv + z'_i), y_i)] / (1 + xi)

  with z_i, z'_i ~ N(0, sigma_s^2 I) fresh per example and per step, x_i^adv crafted from x_i (and
  y_i) alone; g_i = grad loss_i is clipped to C as one example (both forward passes of example i
  are one example: :class:`PairedBookKeeper` sums their contributions before the norm), so the
  sensitivity of the clipped sum is C exactly as in DP-SGD.
* **Attacks inside training** (DPAL's ensemble, made cheap): each example draws its size
  mu_i ~ U(0, mu_max) and one attack of ``attacks`` (uniformly): ``fgsm`` (one step of mu_i),
  ``ifgsm``, ``mim`` (decay 1) or ``pgd`` (uniform random start), ``attack_steps`` steps of
  2.5 mu_i / steps, l-inf, in the [-1, 1] domain, on the true label y_i, against the *noisy* model
  (each gradient is taken at f(x' + fresh N(0, sigma_s^2 I)): one EOT draw per step). The model has
  no cross-example layer (GroupNorm or none; BatchNorm is refused by ``make_private_compatible``),
  so x_i^adv depends on (x_i, y_i, the parameters, the draws) only (tested).
* **Certificate**: randomized smoothing (Cohen et al. 2019, :mod:`dpmech.robustness.smoothing`) with the same
  sigma_s: l2 radius R = sigma_s Phi^-1(p_A_lower); l-inf size implied R / sqrt(d) (an l-inf ball of
  size s lies in the l2 ball of radius s sqrt(d)).
* **Attack at evaluation**: white-box EOT-PGD (l-inf, true labels) on the noisy classifier, then the
  smoothed prediction of the adversarial input (:func:`evaluate`).

Modes (as in DP-SGD): epsilon set -> DP; epsilon and noise_multiplier None -> the *non-private*
adversarial training with the same attacks, the same noise and the same model (no clipping, no
noise), the baseline of the cost comparison (benchmarks/dpal_sound_full.py).

    cfg = DPALSoundConfig(epsilon=2.0, delta=1e-5, batch_size=512, epochs=10, lr=0.5, max_grad_norm=0.1,
                          smoothing_sigma=0.5, xi=1.0, mu_max=0.3, seed=0)
    trainer = DPALSoundTrainer(build_dpsgd_model("mnist", 0, "tb_cnn_gn"), x, y, cfg)
    trainer.fit(); trainer.privacy()
    metrics = evaluate(trainer.model, cfg.smoothing_sigma, x_test, y_test, seed=0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.clipping import BookKeeper
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, stream_seed

ENSEMBLE = ("fgsm", "ifgsm", "mim", "pgd")
DOMAIN = (-1.0, 1.0)
# streams of the trial seed beyond DP-SGD's (1 sampling, 2 gradient noise, 3 augmentation)
_ATTACK, _SMOOTH = 11, 12


@dataclass
class DPALSoundConfig(DPSGDConfig):
    """DP-SGD's configuration plus DPAL's adversarial objective and the smoothing noise.

    ``noise_augmentation_sigma`` of DP-SGD must stay 0: the input noise is ``smoothing_sigma``,
    drawn by this trainer (fresh for the benign and the adversarial pass)."""

    clipping: str = "bk"
    smoothing_sigma: float = 0.5        # sigma_s, [-1, 1] domain, training and inference
    xi: float = 1.0                     # weight of the adversarial term (Eq. 10)
    mu_max: float = 0.3                 # mu_i ~ U(0, mu_max), l-inf, [-1, 1] domain
    attacks: tuple = ("fgsm", "pgd")    # the ensemble; each example draws one uniformly
    attack_steps: int = 3               # steps of ifgsm / mim / pgd (fgsm: 1)

    def validate(self) -> None:
        super().validate()
        v.positive("smoothing_sigma", self.smoothing_sigma)
        v.non_negative("xi", self.xi)
        v.non_negative("mu_max", self.mu_max)
        v.positive_int("attack_steps", self.attack_steps)
        if isinstance(self.attacks, str) or not self.attacks:
            raise ValueError(f"attacks must be a non-empty list of {ENSEMBLE}, got {self.attacks!r}")
        self.attacks = tuple(self.attacks)
        for a in self.attacks:
            v.choice("attacks", a, ENSEMBLE)
        if self.noise_augmentation_sigma != 0:
            raise ValueError("noise_augmentation_sigma must be 0 for dpal_sound (its input noise is smoothing_sigma)")
        if self.private and self.clipping != "bk":
            raise ValueError("clipping must be 'bk' for dpal_sound: the benign and adversarial passes of one example are "
                             "clipped together by book-keeping (PairedBookKeeper); ghost/flat would clip them apart")


class PairedBookKeeper(BookKeeper):
    """Book-keeping clipping (:mod:`dpmech.privacy.clipping`) where rows i and B + i of a 2B-row forward pass
    (benign then adversarial) are ONE example: its gradient is the sum of both rows' gradients,
    clipped once (``BookKeeper(rows_per_example=2)``: the two rows are concatenated along the
    position axis, so the ghost-norm / instantiation rules apply exactly)."""

    def __init__(self, model: nn.Module, prefer: str = "mixed"):
        super().__init__(model, prefer=prefer, rows_per_example=2)


def per_example_loss(ce_benign: torch.Tensor, ce_adv: torch.Tensor, xi: float) -> torch.Tensor:
    """Eq. 10 per example: (CE_benign_i + xi CE_adv_i) / (1 + xi)."""
    return (ce_benign + xi * ce_adv) / (1.0 + xi)


def craft(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, sigma: float, mu_max: float,
          attacks=("fgsm", "pgd"), steps: int = 3, generator: torch.Generator) -> torch.Tensor:
    """DPAL's ensemble (Alg. 1 lines 6-8) per example: mu_i ~ U(0, mu_max), attack a_i uniform over
    ``attacks``, l-inf ball of mu_i around x_i in [-1, 1], true label y_i, every gradient at
    f(x' + N(0, sigma^2 I)) (fresh draw each step: the noisy model). fgsm: one step of mu_i; ifgsm /
    mim (decay 1, l1-normalised gradients) / pgd (uniform start in the ball): ``steps`` steps of
    2.5 mu_i / steps. All draws come from ``generator`` in a fixed order whose shapes depend on the
    batch size only, and the model is applied row by row (no cross-example layer), so row i of the
    result depends on x_i, y_i and the draws only."""
    x = x.detach()
    b = x.shape[0]
    gdev = generator.device
    shape1 = (b,) + (1,) * (x.dim() - 1)
    mu = (torch.rand(b, generator=generator, device=gdev, dtype=x.dtype) * mu_max).to(x.device).view(shape1)
    kind = torch.randint(len(attacks), (b,), generator=generator, device=gdev).to(x.device)
    start = (2 * torch.rand(x.shape, generator=generator, device=gdev, dtype=x.dtype) - 1).to(x.device) * mu
    names = list(attacks)
    is_fgsm = (kind == names.index("fgsm")) if "fgsm" in names else torch.zeros(b, dtype=torch.bool, device=x.device)
    is_pgd = (kind == names.index("pgd")) if "pgd" in names else torch.zeros(b, dtype=torch.bool, device=x.device)
    is_mim = (kind == names.index("mim")) if "mim" in names else torch.zeros(b, dtype=torch.bool, device=x.device)
    n_iter = 1 if set(names) == {"fgsm"} else steps
    x_adv = torch.where(is_pgd.view(shape1), (x + start).clamp(*DOMAIN), x)
    step = torch.where(is_fgsm.view(shape1), mu, 2.5 * mu / steps)
    momentum = torch.zeros_like(x)
    was = [(m_, m_.training) for m_ in model.modules()]
    try:
        for k in range(n_iter):
            # every row takes the first step; later steps only the iterative attacks' rows
            rows = torch.arange(b, device=x.device) if k == 0 else torch.nonzero(~is_fgsm).squeeze(1)
            z = torch.randn(x.shape, generator=generator, device=gdev, dtype=x.dtype).to(x.device) * sigma
            if rows.numel() == 0:
                continue
            with torch.enable_grad():
                xa = x_adv[rows].detach().requires_grad_(True)
                loss = F.cross_entropy(model(xa + z[rows]), y[rows], reduction="sum")
                (g,) = torch.autograd.grad(loss, xa)
            s1 = (rows.numel(),) + shape1[1:]
            l1 = g.flatten(1).abs().sum(1).clamp_min(1e-12).view(s1)
            mom = torch.where(is_mim[rows].view(s1), momentum[rows] + g / l1, g)
            momentum[rows] = mom
            new = x_adv[rows] + step[rows] * mom.sign()
            xr, mr = x[rows], mu[rows]
            x_adv[rows] = torch.max(torch.min(new, xr + mr), xr - mr).clamp(*DOMAIN)
    finally:
        for m_, t in was:
            m_.training = t
    return x_adv.detach()


class DPALSoundTrainer(DPSGDTrainer):
    """DP-SGD whose per-example loss is DPAL's adversarial objective under smoothing noise (module
    docstring). Everything else (sampling, clipping bound, noise, optimizer, ledger, checkpoints) is
    :class:`DPSGDTrainer`'s."""

    config: DPALSoundConfig

    def __init__(self, model, x_train, y_train, config: DPALSoundConfig, *, device="cpu", plan_size=None,
                 canaries=None, noise_key=None):
        if not isinstance(config, DPALSoundConfig):
            raise ValueError(f"config must be a DPALSoundConfig, got {type(config).__name__}")
        super().__init__(model, x_train, y_train, config, device=device, plan_size=plan_size, canaries=canaries,
                         noise_key=noise_key)
        if self.bookkeeper is not None:
            self.bookkeeper.remove()
            self.bookkeeper = PairedBookKeeper(self.model)
        self.attack_gen = torch.Generator(device=self.device).manual_seed(stream_seed(config.seed, _ATTACK))
        self.smooth_gen = torch.Generator(device=self.device).manual_seed(stream_seed(config.seed, _SMOOTH))

    def adversarial(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return craft(self.model, xb, yb, sigma=cfg.smoothing_sigma, mu_max=cfg.mu_max, attacks=cfg.attacks,
                     steps=cfg.attack_steps, generator=self.attack_gen)

    def paired_inputs(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """[x + z ; x_adv + z'] (2B rows), z and z' fresh N(0, sigma_s^2 I) per example."""
        x_adv = self.adversarial(xb, yb)
        s = self.config.smoothing_sigma
        z = torch.randn((2,) + tuple(xb.shape), generator=self.smooth_gen, device=xb.device, dtype=xb.dtype) * s
        return torch.cat([xb + z[0], x_adv + z[1]])

    def forward_backward(self, xb, yb):
        cfg = self.config
        b = xb.shape[0]
        inp = self.paired_inputs(xb, yb)
        bk = self.bookkeeper
        if bk is not None:
            bk.enabled = True
        try:
            logits = self.model(inp)
        finally:
            if bk is not None:
                bk.enabled = False
        ce = F.cross_entropy(logits, torch.cat([yb, yb]), reduction="none")
        per_example = per_example_loss(ce[:b], ce[b:], cfg.xi)
        if bk is not None:
            bk.clipped_sum(per_example.sum(), cfg.max_grad_norm)
            self._add_noise_and_scale()
        else:   # the non-private baseline: same 1/B scaling as DP-SGD's, no clipping, no noise
            (per_example.sum() / cfg.batch_size).backward()
        return logits[:b].detach(), per_example.detach()

    def state_dict(self) -> dict:
        # the attacks' and the smoothing noise's streams follow the public seed (per-example inputs, like
        # DP-SGD's augmentation): their states may be stored; the keyed sampling and noise are DP-SGD's
        # (no state of them in a secret-key checkpoint: docs/threat_model.md, "Checkpoints")
        state = super().state_dict()
        state["attack_gen"] = self.attack_gen.get_state()
        state["smooth_gen"] = self.smooth_gen.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.attack_gen.set_state(state["attack_gen"].cpu())
        self.smooth_gen.set_state(state["smooth_gen"].cpu())


# ----------------------------------------------------------------------------- evaluation

class NoisyClassifier(nn.Module):
    """f(x + N(0, sigma^2 I)), a fresh draw per call from ``generator``: the classifier the white-box
    attack targets (EOT over its draws)."""

    def __init__(self, base: nn.Module, sigma: float, generator: torch.Generator):
        super().__init__()
        self.base, self.sigma, self.generator = base, float(sigma), generator

    def forward(self, x):
        z = torch.randn(x.shape, generator=self.generator, device=self.generator.device, dtype=x.dtype)
        return self.base(x + self.sigma * z.to(x.device))


def linf_from_l2(radius: float, d: int) -> float:
    """The l-inf size certified by an l2 radius in dimension d: R / sqrt(d)."""
    return float(radius) / math.sqrt(d)


def fmt(s: float) -> str:
    from dpmech.robustness.evaluation import format_size

    return format_size(s)


def evaluate(model: nn.Module, sigma: float, x: torch.Tensor, y: torch.Tensor, *, seed: int = 0,
             predict_n: int = 100, predict_size: int | None = None, cert_size: int = 1000, cert_n0: int = 100,
             cert_n: int = 10_000, alpha: float = 0.001, l2_radii=(0.25, 0.5, 0.75, 1.0),
             linf_sizes=(0.01, 0.02, 0.03, 0.05), pgd_sizes=(0.1, 0.2), attacks: dict | None = None,
             pgd_size_n: int = 1000, pgd_steps: int = 20, eot_samples: int = 8, batch_size: int | None = None,
             progress=None) -> dict:
    """The dpal_sound metrics (docs/metrics.md) of a trained base model f under smoothing noise sigma:

    * ``acc_clean_smoothed`` (also ``acc_clean``): PREDICT (Cohen et al.'s, n = predict_n, alpha) on
      the first ``predict_size`` test inputs (all by default); an abstention is wrong;
      ``abstain_rate_smoothed`` its abstentions;
    * ``cert_l2_acc_<r>``, ``cert_linf_acc_<s>`` (certified l2 radius >= s sqrt(d)), ``cert_abstain_rate``:
      CERTIFY (n0, n, alpha) on the first ``cert_size`` test inputs (0: skipped);
    * ``acc_<attack>_<s>``: white-box EOT attack (l-inf s in [-1, 1], ``pgd_steps`` iterations,
      ``eot_samples`` noise draws per gradient, true labels; pgd with a random start) on the noisy
      classifier f(. + N(0, sigma^2 I)), then PREDICT of the adversarial input, on the first
      ``pgd_size_n`` test inputs; ``attacks`` maps names to sizes (default ``{"pgd": pgd_sizes}``);
      ``acc_worst_<s>``: correct clean and under every attack at size s (same inputs).
    Independent generators per part, from ``seed``."""
    from dpmech.robustness import smoothing
    from dpmech.robustness.attacks import attack as run_attack

    model.eval()
    dev = next(model.parameters()).device
    d = int(x[0].numel())
    out: dict[str, float] = {}
    gen = lambda k: torch.Generator(device=dev).manual_seed(stream_seed(seed, 100 + k))  # noqa: E731
    say = progress or (lambda msg: None)
    y_np = y.cpu().numpy()

    xp, yp = (x, y_np) if predict_size is None else (x[:predict_size], y_np[:predict_size])
    pred = smoothing.predict(model, sigma, xp.to(dev), n=predict_n, alpha=alpha, generator=gen(0), batch_size=batch_size)
    out["acc_clean_smoothed"] = out["acc_clean"] = float((pred == yp).mean())
    out["abstain_rate_smoothed"] = float((pred == smoothing.ABSTAIN).mean())
    clean_ok = pred == yp
    say(f"acc_clean_smoothed {out['acc_clean_smoothed']:.4f}")

    k = min(int(cert_size), x.shape[0])
    if k > 0:
        res = smoothing.certify(model, sigma, x[:k].to(dev), y_np[:k], n0=cert_n0, n=cert_n, alpha=alpha,
                                generator=gen(1), batch_size=batch_size)
        for r, acc in smoothing.certified_accuracy(res, l2_radii).items():
            out[f"cert_l2_acc_{fmt(r)}"] = acc
        for s in linf_sizes:
            out[f"cert_linf_acc_{fmt(s)}"] = smoothing.certified_accuracy(res, [s * math.sqrt(d)])[s * math.sqrt(d)]
        out["cert_abstain_rate"] = res.abstain_rate()
        say("certified " + ", ".join(f"{k_} {v_:.4f}" for k_, v_ in out.items() if k_.startswith("cert_")))

    attacks = {"pgd": tuple(pgd_sizes)} if attacks is None else attacks
    m = min(int(pgd_size_n), x.shape[0])
    xa_all, ya_all = x[:m], y[:m]
    noisy = NoisyClassifier(model, sigma, gen(2))
    start_gen = gen(3)
    worst: dict[float, np.ndarray] = {}
    for name, sizes in attacks.items():
        for s in sizes:
            kw = dict(eps=s, eot_samples=eot_samples, norm="linf")
            if name in ("ifgsm", "mim", "pgd"):
                kw["steps"] = pgd_steps
            if name == "pgd":
                kw["generator"] = start_gen
            advs = []
            for i in range(0, m, 250):
                xb, yb = xa_all[i:i + 250].to(dev), ya_all[i:i + 250].to(dev)
                advs.append(run_attack(name, noisy, xb, yb, **kw).cpu())
            adv = torch.cat(advs)
            pred = smoothing.predict(model, sigma, adv.to(dev), n=predict_n, alpha=alpha, generator=gen(4),
                                     batch_size=batch_size)
            ok = pred == y_np[:m]
            out[f"acc_{name}_{fmt(s)}"] = float(ok.mean())
            worst[s] = (worst[s] & ok) if s in worst else (ok & clean_ok[:m])
            say(f"acc_{name}_{fmt(s)} {out[f'acc_{name}_{fmt(s)}']:.4f}")
    for s, ok in worst.items():
        out[f"acc_worst_{fmt(s)}"] = float(ok.mean())
    return out
