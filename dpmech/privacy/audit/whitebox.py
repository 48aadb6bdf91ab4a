"""White-box gradient canaries inside the DP-SGD engine, and their one-run audit.

The black-box audit (:mod:`dpmech.privacy.audit.one_run`) scores canary *images* from the final model; it sees a
tiny fraction of what the privacy analysis covers. The analysis of DP-SGD (Abadi et al. 2016)
holds for an adversary who chooses every example's clipped gradient and sees every noisy update;
Steinke, Nasr & Jagielski (NeurIPS 2023, Sec. 6, "white-box" Dirac canaries) and Nasr et al.
(USENIX Security 2023) audit against that adversary. This module is that adversary:

* **Canaries are examples.** Each of m canaries is an example whose clipped per-example gradient
  is a fixed vector of norm C (``max_grad_norm``): C e_c for a coordinate c of the flattened
  trainable parameters (``direction="dirac"``; m distinct coordinates, drawn by a seeded
  generator), or C u for a random unit vector u (``direction="random"``). Canary j joins the
  training set D by a fair coin (the secret S_j, ``included``), and at every step each canary in
  D joins the Poisson batch independently with the *same* q as every real example. Its gradient
  enters the clipped sum before the noise. The accountant sees nothing special: D = real data +
  included canaries, q = batch_size / N_planned (the trial's configured size), and the ledger
  records (q, sigma) per step as always (docs/audit.md, "white-box").
* **The auditor sees every noisy update** sum_i clip(g_i) + N(0, sigma^2 C^2 I) (before the
  division by B and the optimizer), and keeps one statistic per canary and step: x_t = the
  update's projection on the canary's direction, in units of C. Under the Gaussian model
  x_t ~ N(b_t, sigma^2) (b_t = 1 when the canary was in the batch, probability q if it is in D),
  so the Neyman-Pearson statistic of one step is the log-likelihood ratio of the mixture
  (1 - q) N(0, sigma^2) + q N(1, sigma^2) against N(0, sigma^2):

      llr_t = log(1 - q + q exp((x_t - 1/2) / sigma^2)),

  and the score of a canary is the sum over steps (``statistic="llr"``, the default; the steps'
  noise is independent, so this is the likelihood ratio of the whole run under the model).
  ``statistic="sum"`` scores sum_t x_t (Steinke et al.'s statistic).
* **The audit** guesses the top and bottom ``guess_fraction`` / 2 of the scores (as
  :func:`dpmech.privacy.audit.one_run.audit`) and runs :func:`dpmech.privacy.audit.estimators.run_estimators`: Steinke et al.'s
  bound, Mahloujifar et al.'s f-DP bound and a GDP estimate (which is which: docs/audit.md).

Coordinates (``placement``): real examples' clipped gradients also land on a canary's
coordinate and blur its score, and they are smallest, per coordinate, in the largest parameter
tensor (C spread over the most coordinates; a bias or the last layer's weights carry large,
correlated per-coordinate gradients). ``"largest"`` (default) draws the m coordinates from the
largest trainable tensor, ``"all"`` uniformly from every trainable coordinate.

Memory: Dirac canaries are indices (m integers, never an m x P matrix); random directions are an
m x P matrix, refused above :data:`RANDOM_MAX` floats.

Usage (any DP-SGD-engine trainer: ``DPSGDTrainer``, ``DPALSoundTrainer``, ``SecureSGDTrainer``; and
``DPGANTrainer``, on its critic's private step)::

    canaries = WhiteBoxCanaries(1000, seed=0)                 # Dirac, llr, largest tensor
    trainer = DPSGDTrainer(model, x, y, cfg, canaries=canaries)
    trainer.fit()
    canaries.audit(delta=cfg.delta, estimators=("steinke", "fdp", "gdp"), beta=0.05)
    # {"audit_epsilon_lb_steinke": ..., "audit_epsilon_lb_fdp": ..., "audit_epsilon_est_gdp": ..., ...}
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpmech import _validate as v

DIRECTIONS = ("dirac", "random")
STATISTICS = ("llr", "sum")
PLACEMENTS = ("largest", "all")
RANDOM_MAX = 1 << 26          # m x P floats of random directions (256 MB)
_CANARY_STREAM = 0xCA7A       # the canaries' own seed streams: the trainer's streams are untouched


class WhiteBoxCanaries:
    """m gradient canaries: inserted into the clipped sum, scored from every noisy update (module
    docstring). The engine calls :meth:`attach` once, then :meth:`insert` and :meth:`observe`
    around the noise of every step; nothing else of the trainer changes."""

    def __init__(self, m: int, *, seed: int = 0, direction: str = "dirac", statistic: str = "llr",
                 placement: str = "largest"):
        self.m = v.positive_int("canaries", m, minimum=0)
        self.seed = v.positive_int("seed", seed, minimum=0)
        self.direction = v.choice("direction", direction, DIRECTIONS)
        self.statistic = v.choice("statistic", statistic, STATISTICS)
        self.placement = v.choice("placement", placement, PLACEMENTS)
        gen = np.random.default_rng(np.random.SeedSequence([self.seed, _CANARY_STREAM, 0]))
        self.included = gen.random(self.m) < 0.5          # the secret bits S_j
        self._coord_seed = int(gen.integers(2 ** 62))
        self.sample_gen = torch.Generator().manual_seed(int(gen.integers(2 ** 62)))
        self.scores = np.zeros(self.m)
        self.sampled = np.zeros(self.m, dtype=np.int64)   # steps in which each canary was in the batch
        self.steps = 0
        self.last_batch = np.zeros(self.m, dtype=bool)    # canaries in the last step's batch (tests)
        self.attached = False

    # ------------------------------------------------------------------ setup
    def attach(self, params: list[torch.Tensor], *, max_grad_norm: float, sampling_rate: float,
               noise_multiplier: float) -> None:
        """Fix the canaries' directions in the flattened ``params`` (the trainer's trainable
        parameters, in its optimizer's order) and the step's C, q and sigma."""
        if self.attached:
            raise ValueError("canaries: these canaries are attached to a trainer already; make new ones per trainer")
        self.C = v.positive("max_grad_norm", max_grad_norm)
        self.q = v.unit_interval("sampling_rate", sampling_rate, low_open=True)
        self.sigma = v.non_negative("noise_multiplier", noise_multiplier)
        if self.statistic == "llr" and self.sigma == 0:
            raise ValueError("statistic: 'llr' needs noise (noise_multiplier > 0); use 'sum' without noise")
        sizes = np.array([p.numel() for p in params], dtype=np.int64)
        total = int(sizes.sum())
        gen = np.random.default_rng(self._coord_seed)
        self._device = params[0].device if params else torch.device("cpu")
        self._sizes = sizes
        if self.direction == "dirac":
            if self.placement == "largest":
                k = int(np.argmax(sizes)) if len(sizes) else 0
                if self.m > (sizes[k] if len(sizes) else 0):
                    raise ValueError(f"canaries: {self.m} Dirac canaries need {self.m} distinct coordinates; the "
                                     f"largest parameter tensor has {int(sizes[k]) if len(sizes) else 0} (use placement 'all')")
                flat = int(sizes[:k].sum()) + gen.choice(int(sizes[k]), size=self.m, replace=False)
            else:
                if self.m > total:
                    raise ValueError(f"canaries: {self.m} Dirac canaries need {self.m} distinct coordinates; the "
                                     f"model has {total} trainable parameters")
                flat = gen.choice(total, size=self.m, replace=False)
            self.coordinates = np.asarray(flat, dtype=np.int64)   # flat index of canary j's coordinate
            starts = np.concatenate([[0], np.cumsum(sizes)])
            which = np.searchsorted(starts, self.coordinates, side="right") - 1
            self._per_param = []                            # (param index, canary indices, local indices)
            for k in np.unique(which):
                js = np.flatnonzero(which == k)
                self._per_param.append((int(k), torch.from_numpy(js),
                                        torch.from_numpy(self.coordinates[js] - starts[k]).to(self._device)))
        else:
            if self.m * total > RANDOM_MAX:
                raise ValueError(f"canaries: {self.m} random directions x {total} parameters exceed {RANDOM_MAX} "
                                 "floats; use fewer canaries or direction 'dirac'")
            tgen = torch.Generator(device=self._device).manual_seed(self._coord_seed)
            u = torch.randn(self.m, total, generator=tgen, device=self._device)
            self.directions = u / torch.linalg.vector_norm(u, dim=1, keepdim=True).clamp_min(1e-12)
        self._included_t = torch.from_numpy(self.included)
        self.attached = True

    # ------------------------------------------------------------------ one step
    def insert(self, sums: list[torch.Tensor]) -> None:
        """Poisson-sample the canaries in D (probability q each) and add C times each sampled
        canary's direction to the clipped sums ``sums`` (one tensor per parameter, in place)."""
        batch = (torch.rand(self.m, generator=self.sample_gen) < self.q) & self._included_t
        self.last_batch = batch.numpy().copy()
        self.sampled += self.last_batch
        if not bool(batch.any()):
            return
        if self.direction == "dirac":
            for k, js, local in self._per_param:
                sel = batch[js].to(local.device)
                if bool(sel.any()):
                    flat = sums[k].view(-1)
                    flat[local[sel]] += self.C
        else:
            vec = self.C * (batch.to(self.directions.device, self.directions.dtype) @ self.directions)
            start = 0
            for s in sums:
                n = s.numel()
                s.view(-1).add_(vec[start:start + n].to(s.dtype))
                start += n

    def observe(self, noisy: list[torch.Tensor]) -> None:
        """Score the step: each canary's projection x_t of the noisy sums (in units of C), through
        the statistic (module docstring), added to its running score."""
        x = self.projections(noisy)
        if self.statistic == "llr":
            s2 = self.sigma ** 2
            stat = np.logaddexp(math.log1p(-self.q) if self.q < 1 else -np.inf,
                                math.log(self.q) + (x - 0.5) / s2)
        else:
            stat = x
        self.scores += stat
        self.steps += 1

    def projections(self, noisy: list[torch.Tensor]) -> np.ndarray:
        """<noisy update, direction_j> / C for every canary j."""
        if self.m == 0:
            return np.zeros(0)
        if self.direction == "dirac":
            x = torch.empty(self.m, dtype=torch.float64)
            for k, js, local in self._per_param:
                x[js] = noisy[k].reshape(-1)[local].detach().to("cpu", torch.float64)
        else:
            flat = torch.cat([g.detach().reshape(-1) for g in noisy]).to(self.directions.dtype)
            x = (self.directions @ flat).to("cpu", torch.float64)
        return x.numpy() / self.C

    # ------------------------------------------------------------------ the audit
    def audit(self, *, delta: float, estimators=("steinke", "fdp", "gdp"), beta: float = 0.05,
              guess_fraction: float = 0.2) -> dict[str, float]:
        """The estimators on this run's scores (:func:`dpmech.privacy.audit.estimators.run_estimators`)."""
        from dpmech.privacy.audit.estimators import run_estimators

        if self.steps == 0:
            raise ValueError("canaries: no step observed yet; train first")
        out = run_estimators(self.scores, self.included, estimators=estimators, beta=beta, delta=delta,
                             guess_fraction=guess_fraction)
        out["audit_steps"] = float(self.steps)
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"m": self.m, "seed": self.seed, "direction": self.direction, "statistic": self.statistic,
                "placement": self.placement, "scores": torch.from_numpy(self.scores.copy()),
                "sampled": torch.from_numpy(self.sampled.copy()), "steps": self.steps,
                "sample_gen": self.sample_gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        mine = (self.m, self.seed, self.direction, self.statistic, self.placement)
        theirs = (state["m"], state["seed"], state["direction"], state["statistic"], state["placement"])
        if mine != theirs:
            raise ValueError(f"canaries: the checkpoint's canaries {theirs} are not these {mine}")
        self.scores = state["scores"].cpu().numpy().astype(np.float64).copy()
        self.sampled = state["sampled"].cpu().numpy().astype(np.int64).copy()
        self.steps = int(state["steps"])
        self.sample_gen.set_state(state["sample_gen"].cpu())
