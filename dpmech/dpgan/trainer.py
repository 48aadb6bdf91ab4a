"""DPGAN training (Xie et al. 2018, Algorithm 1), resumable epoch by epoch.

Critic step (Alg. 1 lines 3-9), with the paper's assumption on c_g *enforced*:

* line 4: a real batch drawn by Poisson sampling, each training example independently with
  probability q = m / N (explicit generator; N is ``plan_size``, the public size the plan assumes,
  by default the number of examples given); the only place that reads the training tensors is
  :meth:`DPGANTrainer._sample_real_batch`;
* line 5: m fake examples G(z, y') with z ~ N(0, I) and labels y' uniform over the classes (no real
  data: neither images nor the label distribution), or with ``fake_labels: dp_histogram`` drawn from
  the class frequencies released once, before the first step, by the Gaussian mechanism
  (:mod:`dpmech.dpgan.labels`; recorded in the ledger as (1, sigma_h, 1) and composed with the
  critic steps; docs/dpgan.md, "Why class 5 fails");
* line 6: the critic loss L = mean_fake f(G(z, y'), y') - (1/m) sum_real f(x_i, y_i); the real term's
  per-example gradients are each clipped to norm <= c_g by the book-keeping engine
  (:mod:`dpmech.privacy.clipping`; :meth:`clipped_real_gradients` is the torch.func reference the tests use);
  with ``clip_fake`` each fake example's gradient is clipped to c_g too (docs/dpgan.md);
* line 7: Gaussian noise N(0, (sigma c_g)^2 I) is added to the *sum* of the clipped real gradients,
  which is then divided by the expected batch size m (Abadi et al. 2016's normalisation, so the
  divisor does not depend on the data); the fake term's gradient is added without noise, as it is
  a function of the previous critic weights and the generator only;
* line 8: one RMSProp (or Adam) step on the noisy gradient (post-processing);
* line 9: the critic weights are clipped to [-c_p, c_p] (post-processing);
* every critic step taken is recorded in the :class:`PrivacyLedger` as (q, sigma, 1).

White-box audit canaries (``canaries=WhiteBoxCanaries(m)``, :mod:`dpmech.privacy.audit.whitebox`; docs/audit.md,
"DPGAN's critic"): the critic's private step is DP-SGD's (clip to C = c_g, Gaussian noise of std sigma
c_g on the sum, Poisson sampling at q), so the same canaries attach to it unchanged. Canary j is an
example of D (by its fair coin) whose clipped real-term gradient is C e_c (or C u); each canary in D
joins each critic step's Poisson batch with the same q as every real example (its own generator: the
trainer's streams are untouched); its gradient joins the clipped sum of line 7 before the noise, and
the auditor observes every critic step's noisy sum (before the division by m). The fake term, the
optimizer, the weight clipping and the generator steps are functions of released critic updates and
public randomness (post-processing) and are not observed. Canaries add nothing to the label histogram
(``fake_labels: dp_histogram``): they audit the critic steps, a part of the claimed composition.

Generator step (lines 10-12), after every ``n_critic`` critic steps: z and labels y' are drawn
afresh and G descends -mean f(G(z, y'), y'). It reads the critic's released weights only, never a
real example, and is not counted (post-processing).

The non-private baseline (epsilon None) is the plain conditional WGAN: the same sampling and
weight clipping, no per-example clipping, no noise; its ledger records sigma = 0 (epsilon inf).

Randomness and checkpoints (docs/threat_model.md; DESIGN.md, Conventions: "a checkpoint holds the
step, not a generator state"): the Poisson sampling and the Gaussian noise of critic step t come
from per-step streams of the secret key (:class:`dpmech.privacy.secret.StepStream`, seeded by
HMAC(key, stream, t)); the label histogram is drawn once, from its own keyed stream, and the
checkpoint holds its released value. A checkpoint holds the critic step counter and no state of a
keyed stream, so resuming needs the owner's key; the latents (z and fake labels, a public stream of
``seed``: post-processing) keep their generator's state. The research mode (``NoiseKey.reproducible``)
keeps running streams from the public seed and checkpoints their states, as before.
"""

from __future__ import annotations

import copy
import math

import torch
from torch.func import functional_call, grad_and_value, vmap

from dpmech import _validate as v
from dpmech.privacy.secret import NoiseKey
from dpmech.privacy.accounting import PrivacyLedger
from dpmech.privacy.clipping import BookKeeper
from dpmech.datasets.splits import num_classes
from dpmech.dpgan.config import (DPGANConfig, calibrate_noise, histogram_noise_multiplier, paper_lemma2_epsilon,
                                 planned_critic_steps, sampling_rate, steps_per_epoch)
from dpmech.dpgan.evaluate import JudgedSampler
from dpmech.dpgan.labels import label_probabilities, release_label_histogram
from dpmech.dpgan.models import DPGANModel


class DPGANTrainer(JudgedSampler):
    """Trains a conditional DPGAN on in-memory tensors (images in [-1, 1], int64 labels)."""

    def __init__(self, config: DPGANConfig, x_train: torch.Tensor, y_train: torch.Tensor, *,
                 device: str | torch.device = "cpu", judge_data: tuple[torch.Tensor, torch.Tensor] | None = None,
                 judge_epochs: int = 3, eval_samples: int = 500, plan_size: int | None = None, canaries=None,
                 noise_key=None):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        v.training_images(x_train, y_train)
        self.classes = num_classes(config.dataset)
        if y_train.min().item() < 0 or y_train.max().item() >= self.classes:
            raise ValueError(f"y_train must hold labels in [0, {self.classes})")
        self._x = x_train.to(self.device)
        self._y = y_train.to(self.device)
        self.n = int(x_train.shape[0])
        if plan_size is not None and (isinstance(plan_size, bool) or not isinstance(plan_size, int) or plan_size < 1):
            raise ValueError(f"plan_size must be a positive integer (the N the privacy plan assumes), got {plan_size!r}")
        self.input_shape = tuple(x_train.shape[1:])
        # The privacy plan -- q, critic steps per epoch, sigma calibrated for all planned steps -- from
        # plan_size, a public number (the configured train_size), never from |D| (default: the N given).
        # The sampler reads the n examples actually given, each at rate q, so a trial whose audit
        # draws canaries in plans and accounts exactly as one without them (docs/dpgan.md).
        self.plan_size = int(plan_size) if plan_size is not None else self.n
        self.sampling_rate = sampling_rate(self.plan_size, config.batch_size)
        self.expected_batch = self.sampling_rate * self.plan_size
        self.steps_per_epoch = steps_per_epoch(self.plan_size, config.batch_size)
        self.planned_critic_steps = planned_critic_steps(config, self.plan_size)
        self.noise_multiplier = calibrate_noise(config, self.plan_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.model = DPGANModel(self.input_shape, self.classes, config.latent_dim, config.hidden,
                                    config.architecture, config.generator).to(self.device)
        self.generator, self.critic = self.model.generator, self.model.critic
        self.generator_ema = copy.deepcopy(self.generator).requires_grad_(False) if config.ema > 0 else None
        if self.generator_ema is not None:  # part of the released model (weights artifact, checkpoints)
            self.model.generator_ema = self.generator_ema
        self._bk = BookKeeper(self.critic)  # per-example clipping engine (hooks idle unless enabled)
        self._clip_critic_weights()
        opt = torch.optim.RMSprop if config.optimizer == "rmsprop" else torch.optim.Adam
        kw = {} if config.optimizer == "rmsprop" else {"betas": (0.5, 0.9)}
        self.critic_opt = opt(self.critic.parameters(), lr=config.lr_critic, **kw)
        self.generator_opt = opt(self.generator.parameters(), lr=config.lr_generator, **kw)
        # Poisson sampling and the Gaussian noise from the secret key, per critic step (docs/threat_model.md)
        self.noise_key = NoiseKey.resolve(noise_key)
        self.sample_stream = self.noise_key.step_stream("dpgan.sampling", config.seed + 1)
        self.noise_stream = self.noise_key.step_stream("dpgan.noise", config.seed + 2, self.device)
        self.sample_gen = self.sample_stream.generator   # the streams' generators (reseeded per step by at())
        self.noise_gen = self.noise_stream.generator
        self.latent_gen = torch.Generator(device=self.device).manual_seed(config.seed + 3)  # z and fake labels
        self.ledger = PrivacyLedger()
        # The fake labels' distribution: None = uniform (Alg. 1), else the released label histogram.
        self.histogram_noise = histogram_noise_multiplier(config)
        self.label_histogram: torch.Tensor | None = None
        self.fake_label_probs: torch.Tensor | None = None
        if self.histogram_noise is not None:
            hist_gen = self.noise_key.generator("dpgan.histogram", config.seed + 4)
            self.label_histogram = release_label_histogram(self._y, self.classes, self.histogram_noise, hist_gen)
            self.ledger.record(1.0, self.histogram_noise, 1)
            self.fake_label_probs = label_probabilities(self.label_histogram).to(self.device)
        self.epoch = 0
        self.critic_steps = 0
        self.generator_steps = 0
        self.clipped_examples = 0   # real examples whose gradient norm exceeded c_g (diagnostic)
        self.real_examples = 0
        self.last_clipped_norms: torch.Tensor | None = None  # per-example norms after clipping, last step
        self.last_norms: torch.Tensor | None = None          # ... and before clipping (diagnostics)
        self.last_real_sum_norm = math.nan                   # ||sum of clipped real gradients||, last step
        # Evaluation: a classifier trained on real, non-training data (dpmech.dpgan.evaluate).
        self._judge_data = judge_data
        self.judge_epochs = judge_epochs
        self.eval_samples = eval_samples
        self._judge = None
        self.canaries = None
        if canaries is not None:
            self._attach_canaries(canaries)

    def _attach_canaries(self, canaries) -> None:
        """White-box canaries (:class:`dpmech.privacy.audit.whitebox.WhiteBoxCanaries`) on the critic's
        private step: directions in the critic's parameters (``named_parameters`` order, the order of
        the clipped sums), C = c_g, q and sigma of the plan (module docstring)."""
        if not self.config.private:
            raise ValueError("canaries: white-box canaries need the critic's clipping and noise (set epsilon; the "
                             "non-private WGAN baseline has neither)")
        canaries.attach([p for _, p in self.critic.named_parameters()], max_grad_norm=self.config.clip_grad,
                        sampling_rate=self.sampling_rate, noise_multiplier=self.noise_multiplier)
        self.canaries = canaries

    # -------------------------------------------------------------- data access
    def _sample_real_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Alg. 1 line 4: a Poisson sample of the training set (each example with probability q).
        The only reader of the training examples during training."""
        self.sample_stream.at(self.critic_steps)   # sample_gen, (re)seeded for this step (secret key)
        mask = torch.rand(self.n, generator=self.sample_gen) < self.sampling_rate
        idx = mask.nonzero().squeeze(1).to(self.device)
        return self._x[idx], self._y[idx]

    def _latent(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """z ~ N(0, I) and labels y' (Alg. 1 lines 5 and 10): uniform over the classes, or drawn from
        the released label histogram (``fake_labels: dp_histogram``); never from the raw labels."""
        z = torch.randn(m, self.config.latent_dim, generator=self.latent_gen, device=self.device)
        if self.fake_label_probs is None:
            y = torch.randint(0, self.classes, (m,), generator=self.latent_gen, device=self.device)
        else:
            y = torch.multinomial(self.fake_label_probs, m, replacement=True, generator=self.latent_gen)
        return z, y

    def _fake_batch_size(self) -> int:
        return max(1, round(self.expected_batch))

    # -------------------------------------------------------------- critic
    def clipped_real_gradients(self, xb: torch.Tensor, yb: torch.Tensor):
        """Per-example gradients of the real term -f_w(x_i, y_i), each clipped to norm <= c_g.

        Returns ``(grads, scores, norms_before, norms_after)``: ``grads[name]`` is ``[B, *shape]``.
        """
        params = {k: p.detach() for k, p in self.critic.named_parameters()}
        yoh = torch.nn.functional.one_hot(yb, self.classes).to(xb.dtype)

        def neg_score(p, x, y):
            return -functional_call(self.critic, p, (x.unsqueeze(0), y.unsqueeze(0))).squeeze(0)

        grads, neg = vmap(grad_and_value(neg_score), in_dims=(None, 0, 0))(params, xb, yoh)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
        factor = (self.config.clip_grad / (norms + 1e-12)).clamp(max=1.0)
        clipped = {k: g * factor.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}
        return clipped, -neg.detach(), norms.detach(), (norms * factor).detach()

    def _clipped_sum(self, x: torch.Tensor, y: torch.Tensor, sign: float) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """sum_i min(1, c_g / ||g_i||) g_i for the per-example losses sign * f_w(x_i, y_i), by the
        book-keeping engine (:mod:`dpmech.privacy.clipping`, exact; one backward pass). Returns
        ``(sums by parameter name, scores f_w(x_i, y_i), per-example norms before clipping)``."""
        params = dict(self.critic.named_parameters())
        saved = {k: p.grad for k, p in params.items()}
        for p in params.values():
            p.grad = None
        self._bk.enabled = True
        try:
            out = self.critic(x, y)
        finally:
            self._bk.enabled = False
        norms = self._bk.clipped_sum(sign * out.sum(), self.config.clip_grad)
        sums = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for k, p in params.items()}
        for k, p in params.items():
            p.grad = saved[k]
        return sums, out.detach(), norms.detach()

    def _noisy_real_gradient(self, xb: torch.Tensor, yb: torch.Tensor):
        """Alg. 1 lines 6-7: (sum of clipped per-example gradients + N(0, (sigma c_g)^2 I)) / m."""
        c_g = self.config.clip_grad
        if xb.shape[0] > 0:
            summed, scores, before = self._clipped_sum(xb, yb, -1.0)
            self.last_clipped_norms = before * (c_g / (before + 1e-6)).clamp(max=1.0)
            self.last_norms = before
            self.clipped_examples += int((before > c_g).sum())
            self.real_examples += int(xb.shape[0])
        else:  # an empty Poisson sample still releases noise
            summed = {k: torch.zeros_like(p) for k, p in self.critic.named_parameters()}
            scores = torch.zeros(0, device=self.device)
            self.last_clipped_norms = torch.zeros(0, device=self.device)
            self.last_norms = torch.zeros(0, device=self.device)
        self.last_real_sum_norm = float(torch.sqrt(sum(g.pow(2).sum() for g in summed.values())))
        if self.canaries is not None:   # white-box canaries: their gradients join the clipped sum ...
            self.canaries.insert(list(summed.values()))
        noisy = self._add_noise(summed)
        if self.canaries is not None:   # ... and the auditor sees the noisy sum
            self.canaries.observe(list(noisy.values()))
        return {k: s / self.expected_batch for k, s in noisy.items()}, scores

    def _add_noise(self, summed: dict) -> dict:
        """Alg. 1 line 7's Gaussian mechanism: sum + N(0, (sigma c_g)^2 I), one draw per parameter
        from the trainer's noise generator (the released noisy sum, before the division by m)."""
        std = self.noise_multiplier * self.config.clip_grad
        return {k: s + std * torch.randn(s.shape, generator=self.noise_gen, device=self.device, dtype=s.dtype)
                for k, s in summed.items()}

    def _fake_gradient(self, xf: torch.Tensor, yf: torch.Tensor):
        """The fake term's gradient, d/dw mean_j f_w(G(z_j), y'_j). With ``clip_fake`` each fake
        example's gradient is clipped to c_g as well (Xie et al.'s Lemma 1 bounds the gradient of the
        whole critic loss by c_g), so the real and fake terms enter on the same scale; no noise, as it
        reads no real data (docs/dpgan.md, "Why it did not learn")."""
        params = list(self.critic.parameters())
        if self.config.clip_fake:
            sums, scores, _ = self._clipped_sum(xf, yf, 1.0)
            return [sums[k] / xf.shape[0] for k, _ in self.critic.named_parameters()], scores.mean()
        fake_mean = self.critic(xf, yf).mean()
        return list(torch.autograd.grad(fake_mean, params)), fake_mean.detach()

    def critic_step(self) -> dict[str, float]:
        """One critic step (Alg. 1 lines 4-9); returns the critic loss and Wasserstein estimate."""
        cfg = self.config
        self.noise_stream.at(self.critic_steps)   # noise_gen, (re)seeded for this step (secret key)
        xb, yb = self._sample_real_batch()
        z, yf = self._latent(self._fake_batch_size())
        with torch.no_grad():
            xf = self.generator(z, yf)
        params = list(self.critic.parameters())
        if cfg.private:
            real_grads, scores = self._noisy_real_gradient(xb, yb)
            real_grads = [real_grads[k] for k, _ in self.critic.named_parameters()]
            fake_grads, fake_mean = self._fake_gradient(xf, yf)
        else:  # the plain WGAN baseline: gradient of mean f(fake) - mean f(real)
            fake_mean = self.critic(xf, yf).mean()
            fake_grads = torch.autograd.grad(fake_mean, params)
            fake_mean = fake_mean.detach()
            if xb.shape[0] > 0:
                out = self.critic(xb, yb)
                real_grads = torch.autograd.grad(-out.mean(), params)
                scores = out.detach()
            else:
                real_grads = [torch.zeros_like(p) for p in params]
                scores = torch.zeros(0, device=self.device)
        self.critic_opt.zero_grad(set_to_none=True)
        for p, gr, gf in zip(params, real_grads, fake_grads):
            p.grad = gr + gf
        self.critic_opt.step()
        self._clip_critic_weights()
        self.ledger.record(self.sampling_rate, self.noise_multiplier, 1)
        self.critic_steps += 1
        real_mean = scores.mean().item() if scores.numel() else 0.0
        return {"critic_loss": fake_mean.item() - real_mean, "wasserstein": real_mean - fake_mean.item()}

    @torch.no_grad()
    def _clip_critic_weights(self) -> None:
        """Alg. 1 line 9: w <- clip(w, -c_p, c_p)."""
        for p in self.critic.parameters():
            p.clamp_(-self.config.clip_weight, self.config.clip_weight)

    # -------------------------------------------------------------- generator
    def generator_step(self) -> float:
        """Alg. 1 lines 10-12: G descends -mean f(G(z, y'), y'); no real data is read."""
        z, yf = self._latent(self._fake_batch_size())
        xf = self.generator(z, yf)
        loss = -self.critic(xf, yf).mean()
        if self.config.mode_seeking > 0 and z.shape[0] >= 2:
            # Mode seeking (Mao et al. 2019, Eq. 3): reward distinct images for distinct latents of the
            # same label; a term in z, y and G only (no critic, no data): post-processing.
            h = z.shape[0] // 2
            z2 = torch.randn(h, self.config.latent_dim, generator=self.latent_gen, device=self.device)
            x2 = self.generator(z2, yf[:h])
            # MSGAN's form: minimise 1 / (ratio + 1e-5), strongest when the generator collapses.
            ratio = (xf[:h] - x2).abs().mean() / (z[:h] - z2).abs().mean()
            loss = loss + self.config.mode_seeking / (ratio + 1e-5)
        self.generator_opt.zero_grad(set_to_none=True)
        loss.backward(inputs=list(self.generator.parameters()))
        self.generator_opt.step()
        self.generator_steps += 1
        if self.generator_ema is not None:
            self._update_ema()
        return loss.item()

    @torch.no_grad()
    def _update_ema(self) -> None:
        """G_ema <- d G_ema + (1 - d) G after every generator step (Polyak averaging of the generator's
        iterates, Yazici et al. 2019): a function of the generator iterates only, post-processing."""
        d = self.config.ema
        for pe, p in zip(self.generator_ema.parameters(), self.generator.parameters()):
            pe.mul_(d).add_(p, alpha=1 - d)

    # -------------------------------------------------------------- training
    def train_epoch(self, progress=None) -> dict[str, float]:
        """``steps_per_epoch`` critic steps, a generator step after every ``n_critic``-th.

        ``train_loss`` is the mean critic loss (minus the Wasserstein estimate) over the epoch. It
        reads the real batches outside the noisy mechanism: a diagnostic, not covered by epsilon.
        """
        losses, w = [], []
        for b in range(self.steps_per_epoch):
            out = self.critic_step()
            losses.append(out["critic_loss"])
            w.append(out["wasserstein"])
            if self.critic_steps % self.config.n_critic == 0:
                self.generator_step()
            if progress is not None:
                progress(b + 1, self.steps_per_epoch)
        self.epoch += 1
        return {"train_loss": sum(losses) / len(losses), "wasserstein": sum(w) / len(w)}

    # -------------------------------------------------------------- sampling and scores
    @torch.no_grad()
    def sample(self, labels: torch.Tensor, seed: int, batch_size: int = 2000) -> torch.Tensor:
        """Images G(z, y) for the given labels, z from a generator seeded by ``seed``."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        labels = labels.to(self.device)
        out = []
        for s in range(0, labels.shape[0], batch_size):
            yb = labels[s:s + batch_size]
            z = torch.randn(yb.shape[0], self.config.latent_dim, generator=gen, device=self.device)
            out.append(self.sampler(z, yb))
        return torch.cat(out) if out else torch.zeros(0, *self.input_shape, device=self.device)

    @property
    def sampler(self) -> torch.nn.Module:
        """The network that makes the released samples: the generator's EMA when ``ema`` > 0."""
        return self.generator if self.generator_ema is None else self.generator_ema

    @torch.no_grad()
    def critic_scores(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2000) -> torch.Tensor:
        """f_w(x, y) for each example (the privacy audit's membership score)."""
        return torch.cat([self.critic(x[s:s + batch_size].to(self.device), y[s:s + batch_size].to(self.device)).cpu()
                          for s in range(0, x.shape[0], batch_size)])

    # -------------------------------------------------------------- privacy
    def privacy(self) -> dict[str, float]:
        """Epsilon of what ran -- the label histogram (if released) and the critic steps actually
        taken -- from the ledger (dp-accounting), the PLD epsilon beside it, and the paper's Lemma 2
        formula for the critic steps (not a guarantee)."""
        cfg = self.config
        out = {
            "epsilon": self.ledger.epsilon(cfg.delta, "rdp"),
            "epsilon_pld": self.ledger.epsilon(cfg.delta, "pld"),
            "delta": cfg.delta,
            "epsilon_paper_lemma2": paper_lemma2_epsilon(self.noise_multiplier, self.sampling_rate,
                                                         self.critic_steps, cfg.delta),
            "noise_multiplier": self.noise_multiplier,
            "sampling_rate": self.sampling_rate,
            "critic_steps": float(self.critic_steps),
            "generator_steps": float(self.generator_steps),
            "clipped_fraction": self.clipped_examples / self.real_examples if self.real_examples else 0.0,
        }
        if self.histogram_noise is not None:
            out["histogram_noise"] = self.histogram_noise
        if not cfg.private:
            out["epsilon_pld"] = math.inf
        return out

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """A snapshot of everything needed to continue bit for bit with the same key (model,
        optimizers, the public latent generator, the ledger, the released label histogram,
        counters). With a secret key no state of the sampling and noise streams (their draws at
        critic step t follow from the key and t); in the research mode their running generators'
        states (``sample_gen``, ``noise_gen``), as before."""
        streams = {k: st for k, st in (("sample_gen", self.sample_stream.state_dict()),
                                       ("noise_gen", self.noise_stream.state_dict())) if st is not None}
        return copy.deepcopy({
            "config": self.config.to_dict(),
            "n": self.n,
            "plan_size": self.plan_size,
            "noise_multiplier": self.noise_multiplier,
            "model": self.model.state_dict(),
            "generator_ema": None if self.generator_ema is None else self.generator_ema.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "generator_opt": self.generator_opt.state_dict(),
            **streams,
            "latent_gen": self.latent_gen.get_state(),
            "ledger": self.ledger.state_dict(),
            "label_histogram": self.label_histogram,
            "epoch": self.epoch,
            "critic_steps": self.critic_steps,
            "generator_steps": self.generator_steps,
            "clipped_examples": self.clipped_examples,
            "real_examples": self.real_examples,
            **({"canaries": self.canaries.state_dict()} if self.canaries is not None else {}),
        })

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != self.config.to_dict() or int(state["n"]) != self.n:
            raise ValueError("checkpoint config does not match this trainer's config and data")
        if int(state.get("plan_size", state["n"])) != self.plan_size:
            raise ValueError(f"checkpoint plan_size {state.get('plan_size', state['n'])} does not match this "
                             f"trainer's plan_size {self.plan_size}")
        if float(state["noise_multiplier"]) != self.noise_multiplier:
            raise ValueError("checkpoint noise_multiplier does not match this trainer's calibration")
        if ("canaries" in state) != (self.canaries is not None):
            raise ValueError("checkpoint: it was saved with white-box canaries and this trainer has none, or the "
                             "other way round")
        if self.canaries is not None:
            self.canaries.load_state_dict(state["canaries"])
        self.model.load_state_dict(state["model"])
        if self.generator_ema is not None:
            self.generator_ema.load_state_dict(state["generator_ema"])
        # copies: torch keeps the checkpoint's state tensors, which the steps would update in place
        self.critic_opt.load_state_dict(copy.deepcopy(state["critic_opt"]))
        self.generator_opt.load_state_dict(copy.deepcopy(state["generator_opt"]))
        # secret key: the streams' states are not read (a checkpoint before issue 48 held them: ignored);
        # research mode: refused in one line when missing
        self.sample_stream.load_state_dict(state.get("sample_gen"), "sample_gen")
        self.noise_stream.load_state_dict(state.get("noise_gen"), "noise_gen")
        self.latent_gen.set_state(state["latent_gen"].cpu())
        self.ledger.load_state_dict(state["ledger"])
        if self.label_histogram is not None:  # the released histogram, as released (never re-drawn)
            self.label_histogram = state["label_histogram"].to(torch.float64).cpu()
            self.fake_label_probs = label_probabilities(self.label_histogram).to(self.device)
        self.epoch = int(state["epoch"])
        self.critic_steps = int(state["critic_steps"])
        self.generator_steps = int(state["generator_steps"])
        self.clipped_examples = int(state["clipped_examples"])
        self.real_examples = int(state["real_examples"])
