"""DPAL training (Alg. 1 lines 1-12), resumable epoch by epoch.

Construction (Alg. 1 lines 1-3):
  1. the budget (Theorem 4, Appendix M split, gamma from the enforced theta_1 bound) and the noise
     chi_1 / m, 2 chi_2 / m, chi_3, drawn **once** from a generator seeded by ``seed + 2``;
  2. theta initialised from ``seed``; the disjoint batches B_1 .. B_{N/m} fixed **once** from a
     permutation drawn by a generator seeded by ``seed + 1`` (the N mod m left-over examples are
     never read);
  3. the network of Appendix M (model.py).
Step t (lines 4-12), i = t mod (N/m):
  * the benign batch B_bar_i = {x + chi_1/m : x in B_i};
  * mu_t uniform in (0, 1]; the next batch B_bar_{i+1} is split into |A| parts and each part is
    crafted by one attack of the ensemble (I-FGSM, MIM, MadryEtAl), T_mu steps of mu_t / T_mu in the
    l_inf ball of radius mu_t around the perturbed example, labelled by the model's predictions
    (Eq. 8-9); the attacked model is f with the fixed training noise;
  * theta_1 descends R_bar(B_bar_i) + R_bar(B_bar_adv) (Eq. 7, Theorems 1-2), theta_2 descends the DP
    adversarial objective (Eq. 10-11) with chi_3. One Adam optimizer updates both; h_bar is
    detached before g, so theta_1 gets only the gradient of R and theta_2 only that of L (line 12).
All randomness (mu_t, MadryEtAl's random start) comes from a generator seeded by ``seed + 3``.

Those seeds are the research mode's (``NoiseKey.reproducible``); otherwise the noise and the training
randomness come from the secret key (docs/threat_model.md), per step
(:class:`dpmech.privacy.secret.StepStream`: the noise is step 0 of ``dpal.noise``, step t's mu_t and
random starts are step t of ``dpal.train``, each seeded by HMAC(key, stream, step)). A secret-key
checkpoint holds the step counter, the model, the optimizer and the fixed batches (public), and
neither those streams' states nor the noise chi_1..chi_3 (DESIGN.md, Conventions: "a checkpoint holds
the step, not a generator state"): the trainer redraws the noise from the key when it is built, so a
resume needs the owner's key, and the checkpoint's ``noise_key_check`` (a fingerprint of the key,
:meth:`~dpmech.privacy.secret.NoiseKey.fingerprint`) refuses another key, which would train on a
second draw of the noise (:func:`~dpmech.privacy.secret.once_drawn`). The research mode checkpoints
the noise and the streams' states, as before.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.secret import CHECK_FIELD, NoiseKey, once_drawn
from dpmech.robustness.attacks import ifgsm, mim, pgd
from dpmech.dpal.budget import Budget, laplace_epsilon
from dpmech.dpal.config import DPALConfig
from dpmech.dpal.model import DPALNet
from dpmech.dpal.noise import PsiNoisyScorer, TrainingNoise
from dpmech.dpal.objectives import dp_adversarial_objective, reconstruction_loss
from dpmech._validate import matching_checkpoint

# The attacks craft around perturbed inputs x_bar = x + chi_1/m, which leave [-1, 1]: they are not
# clamped to the data domain (clamping would read the clean x, not only x_bar).
_FREE_DOMAIN = (-1e6, 1e6)


class _FixedNoiseScorer(torch.nn.Module):
    """f with the training noise, on inputs that already carry chi_1 / m (the attacks' target)."""

    def __init__(self, model: DPALNet, noise_h: torch.Tensor):
        super().__init__()
        self.model = model
        self.noise_h = noise_h

    def forward(self, x_bar):
        return self.model.logits(x_bar, self.noise_h)


class DPALTrainer:
    """Trains DPAL on in-memory tensors (inputs in [-1, 1], int64 labels) epoch by epoch."""

    def __init__(self, config: DPALConfig, x_train: torch.Tensor, y_train: torch.Tensor, *,
                 device: str | torch.device = "cpu", noise_key=None):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        v.training_images(x_train, y_train, in_range=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.model = DPALNet(config.dataset, config.theta1_bound).to(self.device)
        if tuple(x_train.shape[1:]) != tuple(self.model.input_shape):
            raise ValueError(f"x_train images must have shape {self.model.input_shape}, got {tuple(x_train.shape[1:])}")
        if y_train.min().item() < 0 or y_train.max().item() >= self.model.classes:
            raise ValueError(f"y_train must hold labels in [0, {self.model.classes})")
        self.x = self.model.crop(x_train).contiguous().to(self.device)
        self.y = y_train.to(self.device)
        m = config.batch_size
        n_batches = self.x.shape[0] // m
        if n_batches < 2:
            raise ValueError(f"batch_size must leave at least 2 disjoint batches (the adversarial examples of "
                             f"step t come from the next batch); got N = {self.x.shape[0]}, batch_size = {m}")
        # Alg. 1 line 2: disjoint batches, fixed once.
        self.batch_gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
        perm = torch.randperm(self.x.shape[0], generator=self.batch_gen)
        self.batches = perm[: n_batches * m].view(n_batches, m).clone()
        # Alg. 1 line 1: the noise, once.
        self.budget: Budget = config.budget
        scales = config.noise_scales
        self.noise_key = NoiseKey.resolve(noise_key)   # the noise the accounting rests on (docs/threat_model.md)
        self.noise_stream = self.noise_key.step_stream("dpal.noise", config.seed + 2)
        self.noise_gen = self.noise_stream.at(0)        # drawn once: step 0 (research mode: the running stream)
        self.noise = TrainingNoise.draw(
            x_shape=self.model.noised_shape, h_shape=self.model.hidden_shape,
            y_shape=(self.model.h_pi, self.model.classes), scale_x=scales.x, scale_h=scales.h, scale_y=scales.y,
            generator=self.noise_gen).to(self.device)
        self.train_stream = self.noise_key.step_stream("dpal.train", config.seed + 3, self.device)
        self.train_gen = self.train_stream.generator   # reseeded per step by at() (secret key)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        self.epoch = 0
        self.steps = 0
        self.theta1_norm_max = self.model.theta1_norm()

    # ------------------------------------------------------------------ pieces
    @property
    def n_batches(self) -> int:
        return self.batches.shape[0]

    def _perturbed(self, idx: torch.Tensor) -> torch.Tensor:
        """B_bar = {x + chi_1 / m} (Alg. 1 line 2)."""
        return self.x[idx] + self.noise.x

    def _craft(self, x_bar: torch.Tensor, mu: float) -> torch.Tensor:
        """Alg. 1 lines 8-11: each attack of the ensemble crafts its share of the batch (Eq. 8-9)."""
        cfg = self.config
        target = _FixedNoiseScorer(self.model, self.noise.h)
        names = cfg.attack_names
        parts = torch.tensor_split(torch.arange(x_bar.shape[0], device=x_bar.device), len(names))
        out = []
        step = mu / cfg.attack_steps
        for name, part in zip(names, parts):
            xb = x_bar[part]
            kw = dict(eps=mu, steps=cfg.attack_steps, step_size=step, norm="linf", domain=_FREE_DOMAIN)
            if name == "ifgsm":
                adv = ifgsm(target, xb, None, **kw)
            elif name == "mim":
                adv = mim(target, xb, None, decay=1.0, **kw)
            else:
                adv = pgd(target, xb, None, generator=self.train_gen, **kw)
            out.append(adv)
        return torch.cat(out).detach()

    def _draw_mu(self) -> float:
        """mu_t uniform in (0, 1] (Alg. 1 line 7)."""
        return 1.0 - torch.rand((), generator=self.train_gen, device=self.device).item()

    # ------------------------------------------------------------------ training
    def train_epoch(self, progress=None) -> dict[str, float]:
        """One pass over the N/m fixed batches (Alg. 1 lines 4-12); returns train_loss (the mean DP
        adversarial objective, Eq. 10), recon_loss (the mean R_bar per example) and mu_mean."""
        cfg = self.config
        model = self.model
        K = model.classes
        total_l = total_r = total_mu = 0.0
        nb = self.n_batches
        for b in range(nb):
            i = self.steps % nb
            j = (i + 1) % nb
            idx, idx_adv = self.batches[i].to(self.device), self.batches[j].to(self.device)
            x_bar = self._perturbed(idx)
            self.train_stream.at(self.steps)   # train_gen for this step (mu_t, random starts)
            mu = self._draw_mu()
            model.train()
            x_adv = self._craft(self._perturbed(idx_adv), mu)
            y = F.one_hot(self.y[idx], K).float()
            y_adv = F.one_hot(self.y[idx_adv], K).float()
            # theta_1: R_bar on both batches (Eq. 7, Theorems 1 and 2)
            h = model.affine(torch.cat([x_bar, x_adv]))
            h_bar = h + self.noise.h
            r = reconstruction_loss(torch.cat([x_bar, x_adv]), h_bar, model.encoder.decode)
            # theta_2: Eq. 10 with the perturbed Eq. 11 on h_bar, which is detached (line 12)
            h_pi = model.hidden(h_bar.detach())
            m = x_bar.shape[0]
            l_obj = dp_adversarial_objective(h_pi[:m], y, h_pi[m:], y_adv, model.w_pi, self.noise.y, cfg.xi)
            loss = r / h.shape[0] + l_obj
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.steps += 1
            self.theta1_norm_max = max(self.theta1_norm_max, model.theta1_norm())
            total_l += l_obj.item()
            total_r += r.item() / h.shape[0]
            total_mu += mu
            if progress is not None:
                progress(b + 1, nb)
        self.epoch += 1
        self._recalibrate_batch_norm()
        return {"train_loss": total_l / nb, "recon_loss": total_r / nb, "mu_mean": total_mu / nb}

    @torch.no_grad()
    def _recalibrate_batch_norm(self) -> None:
        """Recompute the batch-norm statistics of g from the perturbed training batches with the current
        weights (cumulative average, "precise BN"). The fixed offsets chi_1/m and 2 chi_2/m shift
        every example alike, and inference adds them too; statistics that match the final weights
        remove them consistently (a running average over changing weights lags behind them)."""
        bns = [mod for mod in self.model.modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
        momenta = [bn.momentum for bn in bns]
        for bn in bns:
            bn.reset_running_stats()
            bn.momentum = None
        self.model.train()
        for i in range(self.n_batches):
            x_bar = self._perturbed(self.batches[i].to(self.device))
            self.model.logits(x_bar, self.noise.h)
        for bn, mom in zip(bns, momenta):
            bn.momentum = mom
        self.model.eval()

    # ------------------------------------------------------------------ evaluation
    def scorer(self, *, fresh: bool = False, generator: torch.Generator | None = None) -> PsiNoisyScorer:
        """The model as inference sees it: the training offsets, plus fresh psi-scaled noise if ``fresh``."""
        return PsiNoisyScorer(self.model, self.noise, self.config.psi, generator, fresh=fresh)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
        """Predictions of the deterministic centre f(x + chi_1/m) with h + 2 chi_2/m (Appendix L)."""
        s = self.scorer(fresh=False)
        self.model.eval()
        out = [s(x[i:i + batch_size].to(self.device)).argmax(1).cpu() for i in range(0, x.shape[0], batch_size)]
        return torch.cat(out)

    def accuracy(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
        """Accuracy of ``predict`` (the cheap per-epoch test metric; verified inference is verify.py)."""
        return float((self.predict(x, batch_size) == y.cpu()).float().mean())

    # ------------------------------------------------------------------ privacy
    def privacy(self) -> dict[str, float]:
        """Theorem 4's budget recomputed from what the code did: the Laplace scales of the noise actually
        drawn, the batch size, the enforced theta_1 bound and the sensitivities (Lemmas 2-4).

        eps_1 = Delta_R / (m b_x), eps_x = Delta_x / b_x (Lemma 3, Delta_x = 1), eps_h = Delta_h1 / b_h
        (Lemma 3), eps_2 = Delta_L2 / b_y (Theorem 3); eps_t is their sum. What these numbers mean, and
        what they do not, is in docs/dpal.md.
        """
        bud = self.budget
        n = self.noise
        m = self.config.batch_size
        eps_1 = bud.delta_R / (m * n.scale_x)            # Theorem 1: coefficients of R get Lap(Delta_R / eps_1)
        eps_x = laplace_epsilon(n.scale_x, bud.delta_x)  # Lemma 3
        eps_h = laplace_epsilon(n.scale_h, bud.delta_h1)
        eps_2 = laplace_epsilon(n.scale_y, bud.delta_L2)
        if self.theta1_norm_max > bud.delta_h1 * (1 + 1e-5):
            raise RuntimeError(f"theta_1 norm {self.theta1_norm_max} exceeded the enforced bound {bud.delta_h1}")
        return {
            "epsilon": eps_1 + eps_x + eps_h + eps_2, "delta": 0.0,
            "eps_t": eps_1 + eps_x + eps_h + eps_2, "eps_1": eps_1, "eps_x": eps_x, "eps_h": eps_h, "eps_2": eps_2,
            "eps_t_target": bud.eps_t, "gamma": bud.gamma, "gamma_x": bud.gamma_x,
            "delta_R": bud.delta_R, "delta_L2": bud.delta_L2, "delta_h1_bound": bud.delta_h1,
            "theta1_norm_max": self.theta1_norm_max, "delta_x": bud.delta_x,
            "noise_scale_x": n.scale_x, "noise_scale_h": n.scale_h, "noise_scale_y": n.scale_y,
            "batch_size": m, "n_batches": self.n_batches,
            "unused_examples": self.x.shape[0] - self.n_batches * m,
            "epochs": self.epoch, "steps": self.steps,
        }

    guarantee = privacy

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """A snapshot (deep copy) of everything needed to continue training bit for bit with the same
        key: model, optimizer, the fixed batches, the public batch generator, the counters; in the
        research mode also the fixed noise chi_1..chi_3 and the keyed streams' states (``noise``,
        ``noise_gen``, ``train_gen``). With a secret key neither (module docstring)."""
        research = {CHECK_FIELD: self.noise_key.fingerprint("dpal.noise")} if self.noise_stream.keyed else {
            "noise": self.noise.state_dict(), "noise_gen": self.noise_stream.state_dict(),
            "train_gen": self.train_stream.state_dict()}
        return copy.deepcopy({
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **research,
            "batches": self.batches.clone(),
            "batch_gen": self.batch_gen.get_state(),
            "epoch": self.epoch,
            "steps": self.steps,
            "theta1_norm_max": self.theta1_norm_max,
        })

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`: with a secret key, refused in one line when the checkpoint
        was saved with another key (the noise, drawn once, would be drawn again: a second release)."""
        matching_checkpoint(state["config"], self.config.to_dict())
        if tuple(state["batches"].shape) != tuple(self.batches.shape):
            raise ValueError("checkpoint batches do not match this trainer's training set")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))   # torch would alias its tensors
        self.noise = once_drawn(state, "noise", self.noise, self.noise_key, "dpal.noise",
                                lambda st: TrainingNoise.from_state_dict(st, self.device))
        # secret key: the streams' states are not read (a checkpoint before issue 48 held them: ignored)
        self.batches = state["batches"].clone()
        self.batch_gen.set_state(state["batch_gen"])
        self.noise_stream.load_state_dict(state.get("noise_gen"), "noise_gen")
        self.train_stream.load_state_dict(state.get("train_gen"), "train_gen")
        self.epoch = int(state["epoch"])
        self.steps = int(state["steps"])
        self.theta1_norm_max = float(state["theta1_norm_max"])
