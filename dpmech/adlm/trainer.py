"""AdLM training (Algorithm 1 of Phan, Wu, Hu & Dou, ICDM 2017), resumable epoch by epoch.

Construction (every noise drawn ONCE, from a generator seeded by ``seed + 2``, in this order):
  1. lines 1-7: a ``RelevanceNet`` trained without privacy on the relevance data (public, or the
     training set: ``relevance_source``; generator ``seed + 3``); the average relevance R(D) of the
     training set by LRP-epsilon, each example's map normalised; R_bar = R(D) + Lap(Delta_R / eps_1);
  2. lines 8-14: beta = d R_bar / sum R_bar (floored at ``beta_min``); per-feature Laplace scales
     b_j = s_j d / (beta_j eps_2) of the batch coefficients sum_{x_i in L} x_ij; chi ~ Lap(b); every
     training input becomes x_bar = clip(x + chi / |L|, -input_clip, input_clip) (x_bar's batch sum
     carries chi; the clip is the reference's post-processing);
  3. lines 16-19: chi_3 ~ Lap(2 |h_pi| / eps_3) on the [|h_pi|, K] label coefficients of the
     second-order Taylor expansion of the per-class logistic loss (``dpmech.dpal.objectives``);
  4. line 15: the network (``dpmech.dpal.model.DPALNet``, first layer unconstrained: AdLM needs no
     bound on it) reads x_bar; h_pi = tanh(...) is in [-1, 1]; the output layer has no bias.
Step t (lines 20-30): a batch of |L| examples from a permutation drawn each epoch (generator
``seed + 1``; the remainder of each permutation is skipped so every batch has exactly |L|), Adam
on the perturbed objective (1/|L|) [sum_i L_1(z_i) - <sum_i h_pi,i y_i^T + chi_3, W_pi>]. After
every epoch the batch-norm statistics are recomputed from the perturbed training inputs with the
current weights (as in DPAL, docs/dpal.md decision 7).
Inference: ``model`` (an ``AdLMClassifier``) reads clip(x + chi / |L|): the fixed offset is part of
the released model, as DPAL's deterministic centre.

Those seeds are the research mode's (``NoiseKey.reproducible``); otherwise the noise and the relevance
network's randomness come from the secret key (docs/threat_model.md), as step 0 of the streams
``adlm.noise`` and ``adlm.relevance`` (:class:`dpmech.privacy.secret.StepStream`, seeded by
HMAC(key, stream, 0)). A secret-key checkpoint holds neither those streams' states nor chi_3 (used in
training only, never released; DESIGN.md, Conventions: "a checkpoint holds the step, not a generator
state"): the trainer redraws them from the key when it is built, so a resume needs the owner's key,
and the checkpoint's ``noise_key_check`` (:meth:`~dpmech.privacy.secret.NoiseKey.fingerprint`) refuses
another key, which would train on a second draw of chi_3 (:func:`~dpmech.privacy.secret.once_drawn`).
The released R_bar and the model's offset chi / |L| stay in it. The research mode checkpoints all, as
before.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.secret import CHECK_FIELD, NoiseKey, once_drawn
from dpmech.adlm.budget import (AdLMBudget, feature_copies, feature_scales, feature_sensitivity, features_epsilon,
                                laplace_epsilon, loss_sensitivity, redistribute, relevance_sensitivity,
                                split_budget)
from dpmech.adlm.config import AdLMConfig
from dpmech.adlm.relevance import average_relevance, train_relevance_net
from dpmech.dpal.model import ARCHITECTURES, DPALNet
from dpmech.dpal.objectives import dp_taylor_loss
from dpmech.privacy.mechanisms import laplace_noise
from dpmech._validate import matching_checkpoint


class AdLMClassifier(nn.Module):
    """The released classifier: logits of the network on clip(x + offset, -clip, clip), where
    ``offset`` = chi / |L| is the fixed per-feature noise of Algorithm 1 lines 8-14."""

    def __init__(self, net: DPALNet, offset: torch.Tensor, clip: float):
        super().__init__()
        self.net = net
        self.register_buffer("offset", offset.to(torch.float32))
        self.clip = float(clip)

    def perturb(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x + self.offset, -self.clip, self.clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.logits(self.perturb(x))


class AdLMTrainer:
    """Trains AdLM on in-memory tensors (inputs in [-1, 1], int64 labels) epoch by epoch.

    ``relevance_data`` = (x, y) the LRP network is trained on; required for ``relevance_source =
    'public'`` (it must not contain training examples: the caller's responsibility), refused for
    ``'training'`` (the training set itself is used)."""

    def __init__(self, config: AdLMConfig, x_train: torch.Tensor, y_train: torch.Tensor, *,
                 relevance_data: tuple[torch.Tensor, torch.Tensor] | None = None,
                 device: str | torch.device = "cpu", noise_key=None):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        v.training_images(x_train, y_train, in_range=True)
        arch = ARCHITECTURES["mnist"]
        if tuple(x_train.shape[1:]) != tuple(arch["input"]):
            raise ValueError(f"x_train images must have shape {arch['input']}, got {tuple(x_train.shape[1:])}")
        if y_train.min().item() < 0 or y_train.max().item() >= arch["classes"]:
            raise ValueError(f"y_train must hold labels in [0, {arch['classes']})")
        if x_train.shape[0] < config.batch_size:
            raise ValueError(f"batch_size must be <= the number of training examples ({x_train.shape[0]}), "
                             f"got {config.batch_size}")
        if config.relevance_source == "public":
            if relevance_data is None:
                raise ValueError("relevance_data: relevance_source 'public' needs (x, y) disjoint from the training set")
            rx, ry = relevance_data
        else:
            if relevance_data is not None:
                raise ValueError("relevance_data must be None for relevance_source 'training' (the training set is used)")
            rx, ry = x_train, y_train
        self.x = x_train.to(self.device)
        self.y = y_train.to(self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            net = DPALNet("mnist").to(self.device)
        net.encoder.enforce = False   # AdLM puts no bound on the first layer (no gamma as in DPAL)
        self.budget: AdLMBudget = split_budget(config.epsilon, config.budget_split)
        self.batch_gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
        # the noise the guarantee rests on, from the secret key (docs/threat_model.md)
        self.noise_key = NoiseKey.resolve(noise_key)
        self.noise_stream = self.noise_key.step_stream("adlm.noise", config.seed + 2)
        self.relevance_stream = self.noise_key.step_stream("adlm.relevance", config.seed + 3)
        self.noise_gen = self.noise_stream.at(0)          # drawn once: step 0 (research mode: the running streams)
        self.relevance_gen = self.relevance_stream.at(0)
        self._draw_noise(net, rx.to(self.device), ry.to(self.device))
        self.optimizer = torch.optim.Adam(net.parameters(), lr=config.lr)
        self.epoch = 0
        self.steps = 0

    # ------------------------------------------------------------------ Algorithm 1, lines 1-19
    def _draw_noise(self, net: DPALNet, rx: torch.Tensor, ry: torch.Tensor) -> None:
        cfg = self.config
        n = self.x.shape[0]
        m = cfg.batch_size
        d = self.x[0].numel()
        shape = tuple(self.x.shape[1:])
        # lines 1-7: relevance network, average relevance of the training set, Lap(Delta_R / eps_1)
        rel_net = train_relevance_net(rx, ry, epochs=cfg.relevance_epochs, generator=self.relevance_gen,
                                      classes=net.classes)
        avg = average_relevance(rel_net, self.x, norm=cfg.relevance_norm, lrp_eps=cfg.lrp_epsilon).cpu()
        self.sensitivity_relevance = relevance_sensitivity(d, n, cfg.relevance_norm)
        self.scale_relevance = self.sensitivity_relevance / self.budget.eps_relevance
        self.relevance = avg + self._laplace(shape, self.scale_relevance)          # R_bar (released)
        # lines 8-14: redistribution and the per-feature noise on the batch coefficients
        self.beta = redistribute(self.relevance, cfg.beta_min)
        enc = net.encoder
        self.copies = feature_copies(shape, enc.weight.shape[-1], enc.stride, enc.padding)
        self.sensitivity_features = feature_sensitivity(self.copies)
        self.scales_features = feature_scales(self.beta, self.sensitivity_features, self.budget.eps_features)
        chi = self._laplace(shape, 1.0) * self.scales_features
        # lines 16-19: the label coefficients of the Taylor-expanded loss
        self.sensitivity_loss = loss_sensitivity(net.h_pi, net.classes, cfg.loss_sensitivity)
        self.scale_loss = self.sensitivity_loss / self.budget.eps_loss
        self.chi3 = (self._laplace((net.h_pi, net.classes), self.scale_loss)).to(torch.float32).to(self.device)
        self.model = AdLMClassifier(net, (chi / m).to(torch.float32), cfg.input_clip).to(self.device)
        self.model.eval()

    def _laplace(self, shape, scale: float) -> torch.Tensor:
        return laplace_noise(torch.empty(tuple(shape), dtype=torch.float64), scale, self.noise_gen)

    @property
    def net(self) -> DPALNet:
        return self.model.net

    # ------------------------------------------------------------------ training, lines 20-30
    def _batches(self) -> torch.Tensor:
        """This epoch's batches: a permutation split into floor(N / |L|) batches of exactly |L|."""
        m = self.config.batch_size
        perm = torch.randperm(self.x.shape[0], generator=self.batch_gen)
        k = self.x.shape[0] // m
        return perm[:k * m].view(k, m)

    def train_epoch(self, progress=None) -> dict[str, float]:
        """One epoch of Adam steps on the perturbed objective; returns train_loss (its mean per example)."""
        net = self.net
        batches = self._batches()
        total = 0.0
        for b, idx in enumerate(batches):
            idx = idx.to(self.device)
            net.train()
            x_bar = self.model.perturb(self.x[idx])
            h_pi = net.hidden(net.affine(x_bar))
            y = F.one_hot(self.y[idx], net.classes).to(h_pi.dtype)
            loss = dp_taylor_loss(h_pi, y, net.w_pi, self.chi3) / idx.shape[0]
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.steps += 1
            total += loss.item()
            if progress is not None:
                progress(b + 1, batches.shape[0])
        self.epoch += 1
        self._recalibrate_batch_norm()
        return {"train_loss": total / batches.shape[0]}

    @torch.no_grad()
    def _recalibrate_batch_norm(self) -> None:
        """Batch-norm statistics recomputed from the perturbed training inputs with the current weights
        (cumulative average over batches of |L|; DPAL's "precise BN", docs/dpal.md decision 7)."""
        bns = [mod for mod in self.net.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
        momenta = [bn.momentum for bn in bns]
        for bn in bns:
            bn.reset_running_stats()
            bn.momentum = None
        self.net.train()
        m = self.config.batch_size
        for s in range(0, (self.x.shape[0] // m) * m, m):
            self.net.logits(self.model.perturb(self.x[s:s + m]))
        for bn, mom in zip(bns, momenta):
            bn.momentum = mom
        self.model.eval()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def predict(self, x: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
        self.model.eval()
        out = [self.model(x[i:i + batch_size].to(self.device)).argmax(1).cpu() for i in range(0, x.shape[0], batch_size)]
        return torch.cat(out)

    def accuracy(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
        return float((self.predict(x, batch_size) == y.cpu()).float().mean())

    # ------------------------------------------------------------------ privacy
    def privacy(self) -> dict[str, float]:
        """The Theorem's total eps_1 + eps_2 + eps_3, every component recomputed from the Laplace scales of
        the noise actually drawn and the sensitivities (docs/adlm.md: the paper's accounting, not an
        example-level guarantee)."""
        eps_rel = laplace_epsilon(self.scale_relevance, self.sensitivity_relevance)
        eps_feat = features_epsilon(self.scales_features, self.sensitivity_features)
        eps_loss = laplace_epsilon(self.scale_loss, self.sensitivity_loss)
        m = self.config.batch_size
        offsets = self.scales_features / m
        dead = (self.model.offset.abs() >= self.config.input_clip + 1.0).float().mean().item()
        return {
            "epsilon": eps_rel + eps_feat + eps_loss, "delta": 0.0,
            "adlm_eps_relevance": eps_rel, "adlm_eps_features": eps_feat, "adlm_eps_loss": eps_loss,
            "adlm_eps_target": self.budget.epsilon,
            "adlm_sensitivity_relevance": self.sensitivity_relevance,
            "adlm_sensitivity_features": float(self.sensitivity_features.sum()),
            "adlm_sensitivity_loss": self.sensitivity_loss,
            "adlm_noise_scale_relevance": self.scale_relevance,
            "adlm_noise_scale_features_min": float(offsets.min()),
            "adlm_noise_scale_features_max": float(offsets.max()),
            "adlm_noise_scale_loss": self.scale_loss,
            "adlm_beta_min": float(self.beta.min()), "adlm_beta_max": float(self.beta.max()),
            "adlm_features_saturated": dead,
            "adlm_relevance_public": 1.0 if self.config.relevance_source == "public" else 0.0,
            "batch_size": float(m), "epochs": float(self.epoch), "steps": float(self.steps),
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """A snapshot (deep copy) of everything needed to continue bit for bit with the same key: the
        model (with the fixed input offset), the optimizer, the released relevance, beta, the noise
        scales, the public batch generator and the counters; in the research mode also chi_3 and the
        keyed streams' states (with a secret key they follow from the key: module docstring)."""
        research = {CHECK_FIELD: self.noise_key.fingerprint("adlm.noise")} if self.noise_stream.keyed else {
            "chi3": self.chi3.detach().cpu().clone(), "noise_gen": self.noise_stream.state_dict(),
            "relevance_gen": self.relevance_stream.state_dict()}
        return copy.deepcopy({
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "relevance": self.relevance.clone(),
            "beta": self.beta.clone(),
            "scales_features": self.scales_features.clone(),
            "scale_relevance": self.scale_relevance,
            "scale_loss": self.scale_loss,
            **research,
            "batch_gen": self.batch_gen.get_state(),
            "epoch": self.epoch,
            "steps": self.steps,
        })

    def load_state_dict(self, state: dict) -> None:
        matching_checkpoint(state["config"], self.config.to_dict())
        if tuple(state["relevance"].shape) != tuple(self.relevance.shape):
            raise ValueError("checkpoint relevance does not match this trainer's input shape")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))   # torch would alias its tensors
        self.relevance = state["relevance"].clone()
        self.beta = state["beta"].clone()
        self.scales_features = state["scales_features"].clone()
        self.scale_relevance = float(state["scale_relevance"])
        self.scale_loss = float(state["scale_loss"])
        # chi_3: the checkpoint's (research mode, or before issue 48), else this trainer's draw from the same key
        self.chi3 = once_drawn(state, "chi3", self.chi3, self.noise_key, "adlm.noise",
                               lambda t: t.clone().to(self.device))
        # secret key: the streams' states are not read (a checkpoint before issue 48 held them: ignored)
        self.batch_gen.set_state(state["batch_gen"])
        self.noise_stream.load_state_dict(state.get("noise_gen"), "noise_gen")
        self.relevance_stream.load_state_dict(state.get("relevance_gen"), "relevance_gen")
        self.epoch = int(state["epoch"])
        self.steps = int(state["steps"])
