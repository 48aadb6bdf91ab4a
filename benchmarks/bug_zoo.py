"""The bug zoo (issue 25, point 4): plausible DP-SGD implementation bugs, planted as test doubles
(subclasses of :class:`dpmech.dpsgd.trainer.DPSGDTrainer`, never user options), and the one-run
white-box audit that must refute each (docs/audit.md, "The bug zoo").

The auditor (:class:`ZooCanaries`, :func:`audit`) is the same for every engine, correct or
buggy, and fixed before any run:

* m = 100,000 Dirac canaries on an audit block (:class:`benchmarks.audit_block.AuditBlock`:
  coordinates no real example touches), each an example included in D by a fair coin and
  sampled by the engine like every example; a canary's raw gradient has norm ``RAW_NORM`` x C
  (the engine clips it to C; an engine that does not clip passes it through).
* Three statistics of each canary's projections x_t (in units of C) on its coordinate, because
  some bugs show only in the per-step structure: ``llr`` (the engine's mixture log-likelihood
  ratio summed over steps, :mod:`dpmech.privacy.audit.whitebox`), ``range`` (max_t x_t - min_t x_t: a
  noise draw reused across steps cancels in the differences, leaving the 0/1 pattern of the
  canary's sampling) and ``position`` (log of the mean over the K = steps-per-epoch positions k of
  exp(sum over epochs of (x_{e,k} - 1/2) / sigma^2): the likelihood ratio of "in the same batch
  position every epoch", the signature of fixed batches).
* Guesses: the top and bottom ``GUESS_FRACTION`` / 2 of each statistic. Bound: Mahloujifar et
  al.'s recursion against the (epsilon, delta)-DP curve itself
  (:func:`dpmech.privacy.audit.fdp.eps_delta_lower_bound`, rigorous, no assumption on the mechanism), at
  beta / 3 per statistic (Bonferroni), so the largest of the three is a 95% lower bound.
* Refuted: that bound exceeds the engine's own claimed epsilon (its ledger, RDP) at delta.

Settings (:data:`SETTINGS`): 256 or 512 synthetic 8 x 8 images, a linear classifier plus the
audit block, seconds per run on one CPU thread. Each bug runs on the setting where the correct
engine's audit stays well below its claim and the bug's leak exceeds it (figures: docs/audit.md).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.audit_block import AuditBlock
from dpmech.privacy.audit.one_run import guess_counts, guesses
from dpmech.privacy.audit.fdp import eps_delta_lower_bound
from dpmech.privacy.audit.whitebox import WhiteBoxCanaries
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer

DELTA = 1e-5
BETA = 0.05
GUESS_FRACTION = 0.01
M = 100_000
SIDE = 317                      # 317^2 = 100,489 audit coordinates >= M
RAW_NORM = 100.0                # a canary's unclipped gradient norm, in units of C
STATISTICS = ("llr", "range", "position")

# q = batch_size / n; steps = ceil(n / batch_size) x epochs; claims at delta 1e-5 (RDP); mu is the
# Gaussian-DP parameter of an example in every step: sqrt(steps) / sigma
SETTINGS = {
    # q = 1, 4 steps, sigma 4: a Gaussian mechanism, mu = 0.5 (claim 2.17); noise x 0.5 gives mu = 1
    "full_batch": dict(n=256, batch_size=256, noise_multiplier=4.0, epochs=4),
    # q = 1/2, 100 steps, sigma 10 (claim 2.19); sampling at 2q = 1 gives mu = 1
    "half_batch": dict(n=512, batch_size=256, noise_multiplier=10.0, epochs=50),
    # q = 1/32, 512 steps, sigma 2 (claim 1.67); 16 fixed participations give mu = 2
    "small_batch": dict(n=256, batch_size=8, noise_multiplier=2.0, epochs=16),
}


# ------------------------------------------------------------------ the auditor
class ZooCanaries(WhiteBoxCanaries):
    """White-box Dirac canaries (:class:`WhiteBoxCanaries`) that keep the per-step statistics the
    zoo's auditor needs (module docstring). Which canaries are in a step's batch is the engine's
    business: Poisson at the plan's q (as the engine samples every example) unless a double
    replaces ``sample_rate`` or ``schedule``; ``raw`` is what an included canary adds, in units of
    C (1: clipped; a double that does not clip its layer sets ``RAW_NORM``)."""

    def __init__(self, m: int = M, *, seed: int = 0):
        super().__init__(m, seed=seed, direction="dirac", statistic="llr", placement="largest")
        self.raw = 1.0
        self.sample_rate = None         # None: the plan's q
        self.schedule = None            # None: Poisson; else step -> bool mask of canaries in the batch

    def attach(self, params, **kw):
        super().attach(params, **kw)
        (self._k, _, self._local), = self._per_param     # 'largest': one tensor, canary j at _local[j]
        self.positions = 1
        self.x_max = np.full(self.m, -np.inf)
        self.x_min = np.full(self.m, np.inf)
        self.pos_sum = np.zeros((1, self.m))
        self.pos_count = np.zeros(1)

    def set_positions(self, k: int) -> None:
        """K = the engine's steps per epoch (public: the plan)."""
        self.positions = int(k)
        self.pos_sum = np.zeros((self.positions, self.m))
        self.pos_count = np.zeros(self.positions)

    def insert(self, sums):
        if self.schedule is not None:
            batch = torch.from_numpy(self.schedule(self.steps)) & self._included_t
        else:
            q = self.q if self.sample_rate is None else self.sample_rate
            batch = (torch.rand(self.m, generator=self.sample_gen) < q) & self._included_t
        self.last_batch = batch.numpy()
        self.sampled += self.last_batch
        sums[self._k].view(-1)[self._local[batch]] += self.C * self.raw

    def observe(self, noisy):
        x = noisy[self._k].detach().reshape(-1)[self._local].to("cpu", torch.float64).numpy() / self.C
        s2 = self.sigma ** 2
        self.scores += np.logaddexp(math.log1p(-self.q) if self.q < 1 else -np.inf, math.log(self.q) + (x - 0.5) / s2)
        np.maximum(self.x_max, x, out=self.x_max)
        np.minimum(self.x_min, x, out=self.x_min)
        k = self.steps % self.positions
        self.pos_sum[k] += x
        self.pos_count[k] += 1
        self.steps += 1

    def statistic_scores(self, name: str) -> np.ndarray:
        if name == "llr":
            return self.scores.copy()
        if name == "range":
            return self.x_max - self.x_min
        if name == "position":
            s2 = self.sigma ** 2
            per = (self.pos_sum - self.pos_count[:, None] / 2) / s2
            top = per.max(0)
            return top + np.log(np.exp(per - top).mean(0))
        raise ValueError(f"statistic: one of {', '.join(STATISTICS)}, got {name!r}")


def audit(canaries: ZooCanaries, claim: float, *, beta: float = BETA, delta: float = DELTA,
          guess_fraction: float = GUESS_FRACTION) -> dict:
    """The zoo's auditor (module docstring): per statistic the (epsilon, delta)-curve bound at
    beta / 3; ``lb`` their maximum, a (1 - beta) lower bound; ``refuted`` = lb > claim."""
    m = canaries.m
    k_pos, k_neg = guess_counts(m, guess_fraction)
    sign = np.where(canaries.included, 1, -1)
    out = {"claim": float(claim), "canaries": m, "beta": beta, "delta": delta, "guess_fraction": guess_fraction,
           "statistics": {}}
    for name in STATISTICS:
        g = guesses(canaries.statistic_scores(name), k_pos, k_neg)
        r, v = int(np.count_nonzero(g)), int(np.count_nonzero(g * sign == 1))
        lb = eps_delta_lower_bound(m, r, v, delta=delta, beta=beta / len(STATISTICS))
        out["statistics"][name] = {"lb": lb, "guesses": r, "correct": v}
    out["lb"] = max(s["lb"] for s in out["statistics"].values())
    out["refuted"] = bool(out["lb"] > claim)
    return out


# ------------------------------------------------------------------ the engine's noise step, with knobs
def noise_step(t: DPSGDTrainer, *, std_factor: float = 1.0, reuse: bool = False, divisor=None) -> None:
    """:meth:`DPSGDTrainer._add_noise_and_scale` (book-keeping engine) written out, with the knobs
    the doubles turn: the noise's std times ``std_factor``, one noise draw ``reuse``d for every
    step, and the sum divided by ``divisor()`` (read after the canaries are drawn: the batch
    actually drawn) instead of B. With the
    defaults it is the engine's step bit for bit (tests/test_bug_zoo.py). The auditor observes
    the update the optimizer applies, times B."""
    std = t.noise_multiplier * t.config.max_grad_norm * std_factor
    params = [p for group in t.base_optimizer.param_groups for p in group["params"] if p.requires_grad]
    sums = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if t.canaries is not None:
        t.canaries.insert(sums)
    if std > 0:
        if reuse and getattr(t, "_reused_noise", None) is not None:
            noise = t._reused_noise
        else:
            noise = [torch.randn(p.shape, generator=t.noise_gen, device=p.device, dtype=p.dtype) for p in params]
            if reuse:
                t._reused_noise = noise
        sums = [g + std * z for g, z in zip(sums, noise)]
    d = t.config.batch_size if divisor is None else divisor()
    if t.canaries is not None:
        t.canaries.observe([g * (t.config.batch_size / d) for g in sums])
    for p, g in zip(params, sums):
        p.grad = g / d


# ------------------------------------------------------------------ the planted bugs
class NoiseHalf(DPSGDTrainer):
    """Noise std x 0.5 (e.g. sigma C / 2 for a two-sided draw); the ledger still records sigma."""

    def _add_noise_and_scale(self):
        noise_step(self, std_factor=0.5)


class UnclippedLastLayer(DPSGDTrainer):
    """The clipping loop skips the last layer (an off-by-one over the layers in forward order):
    that layer receives every example's raw gradient; the norms, and the ledger, are as before.
    In the zoo's model the last layer is the audit block, so the canaries' raw gradients pass."""

    def _bk_forward_backward(self, xb, yb):
        bk = self.bookkeeper
        bk.enabled = True
        try:
            logits = self.forward_train(xb)
        finally:
            bk.enabled = False
        per_example = F.cross_entropy(logits, yb, reduction="none")
        norms, closures = bk.per_example_norms(per_example.sum())
        c = (self.config.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        for i, (mod, clip) in enumerate(closures):
            w, b = clip(c if i < len(closures) - 1 else torch.ones_like(c))   # the bug
            for p, g in ((mod.weight, w), (getattr(mod, "bias", None), b)):
                if p is not None and p.requires_grad and g is not None:
                    p.grad = g.to(p.dtype) if p.grad is None else p.grad + g.to(p.dtype)
        if self.canaries is not None:
            self.canaries.raw = RAW_NORM                                       # unclipped too
        self._add_noise_and_scale()
        return logits.detach(), per_example.detach()


class SampleTwice(DPSGDTrainer):
    """The accountant is told q for the configured batch (256) while the loader samples twice as
    many (512): every example, canaries included, is drawn at 2q."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.true_rate = min(1.0, 2 * self.plan.sampling_rate)
        if self.canaries is not None:
            self.canaries.sample_rate = self.true_rate

    def poisson_batch(self):
        mask = torch.rand(self.num_examples, generator=self.sample_gen) < self.true_rate
        return torch.nonzero(mask, as_tuple=False).squeeze(1).to(self.device)


class ActualBatchNorm(DPSGDTrainer):
    """Opacus #571: the noisy sum is divided by the size of the batch actually drawn, which
    depends on who is in it (the noise's scale in the update reveals it)."""

    def _step(self, idx):
        self._drawn = int(idx.numel())
        return super()._step(idx)

    def _add_noise_and_scale(self):
        in_batch = (lambda: int(self.canaries.last_batch.sum())) if self.canaries is not None else (lambda: 0)
        noise_step(self, divisor=lambda: max(1, self._drawn + in_batch()))


class ReusedNoise(DPSGDTrainer):
    """One noise draw reused across steps (a generator re-seeded every step, or a cached buffer)."""

    def _add_noise_and_scale(self):
        noise_step(self, reuse=True)


class FixedBatches(DPSGDTrainer):
    """Fixed shuffled batches accounted as Poisson: D is shuffled once into ceil(N / B) batches
    and every epoch takes the same batches in the same order; the ledger records Poisson steps."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        k = self.plan.steps_per_epoch
        perm = torch.randperm(self.num_examples, generator=self.sample_gen)
        self.fixed = list(torch.tensor_split(perm, k))
        if self.canaries is not None:
            pos = torch.randint(k, (self.canaries.m,), generator=self.sample_gen).numpy()
            self.canaries.schedule = lambda step: pos == step % k

    def poisson_batch(self):
        return self.fixed[self.steps % len(self.fixed)].to(self.device)


BUGS = {
    "noise_half": (NoiseHalf, "full_batch"),
    "unclipped_layer": (UnclippedLastLayer, "full_batch"),
    "q_mismatch": (SampleTwice, "half_batch"),
    "actual_batch_norm": (ActualBatchNorm, "small_batch"),
    "reused_noise": (ReusedNoise, "small_batch"),
    "fixed_batches": (FixedBatches, "small_batch"),
}


# ------------------------------------------------------------------ one run
def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def model(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AuditBlock(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), SIDE)


def run(bug: str | None, seed: int, setting: str | None = None, m: int = M) -> dict:
    """One training run of the correct engine (``bug`` None) or a planted bug on its setting,
    audited once. Returns the audit (claim, lb, refuted, per-statistic counts)."""
    cls, default = (DPSGDTrainer, None) if bug is None else BUGS[bug]
    name = setting or default
    if name is None:
        raise ValueError("setting: name one of " + ", ".join(SETTINGS) + " for the correct engine")
    s = SETTINGS[name]
    x, y = data(s["n"], seed)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=s["noise_multiplier"], delta=DELTA, max_grad_norm=1.0,
                      batch_size=s["batch_size"], epochs=s["epochs"], lr=0.1, momentum=0.0, clipping="bk", seed=seed)
    can = ZooCanaries(m, seed=seed)
    t = cls(model(seed), x, y, cfg, canaries=can)
    can.set_positions(t.plan.steps_per_epoch)
    t.fit()
    out = audit(can, t.privacy()["epsilon"])
    out.update(bug=bug, setting=name, seed=seed, steps=t.steps)
    return out


# ------------------------------------------------------------------ #571 with many runs
# Opacus #571's setting: 2 examples; one canary per run, in D by a fair coin; q = 1/2, 20 steps, sigma 8
# (claim 1.18)
TINY = dict(n=2, batch_size=1, noise_multiplier=8.0, epochs=10, side=32)


class CountingCanary(ZooCanaries):
    """One canary that also reads the batch size drawn from the update: the auditor sees the
    whole audit block, whose other coordinates carry only noise of std sigma C B / |B_t| (the
    engine scales the noisy sum by 1 / |B_t| where it should by 1 / B), so |B_t| = B sigma C /
    their root mean square, rounded. Per step it adds the log-likelihood ratio of (|B_t|, x_t)
    under "the canary is in D" (|B_t| - b ~ Binomial(n, q), b ~ Bernoulli(q), x_t ~ N(b, sigma^2))
    against "it is not" (|B_t| ~ Binomial(n, q), x_t ~ N(0, sigma^2))."""

    def __init__(self, included: bool, *, n_real: int, batch_size: int, seed: int = 0):
        super().__init__(1, seed=seed)
        self.included = np.array([bool(included)])
        self.n_real, self.B = n_real, batch_size
        self.counts = []

    def observe(self, noisy):
        from scipy.stats import binom

        block = noisy[self._k].detach().reshape(-1).to("cpu", torch.float64)
        c = int(self._local[0])
        others = torch.cat([block[:c], block[c + 1:]])
        rms = float(others.square().mean().sqrt()) / (self.sigma * self.C)
        drawn = max(0, round(self.B / rms)) if rms > 0 else 0
        self.counts.append(drawn)
        x = float(block[c]) * (drawn / self.B if drawn else 1.0) / self.C
        s2, q = self.sigma ** 2, self.q
        lx0, lx1 = -x * x / (2 * s2), -(x - 1) ** 2 / (2 * s2)
        p0 = binom.pmf(drawn, self.n_real, q)
        p1 = (1 - q) * p0 * math.exp(lx0) + q * binom.pmf(drawn - 1, self.n_real, q) * math.exp(lx1)
        self.scores[0] += 50.0 if p0 == 0 else math.log(max(p1, 1e-300) / (p0 * math.exp(lx0)))
        self.steps += 1


def multi_run_audit(bug: str | None, runs: int = 200, seed: int = 0, guess_fraction: float = 0.5) -> dict:
    """``runs`` independent trainings on :data:`TINY`, one canary each (the one-run theorem
    applies to them as to m canaries of one run: the inclusions are independent fair coins); the
    (epsilon, delta)-curve bound at 95% on the count-and-coordinate LLR scores."""
    cls = DPSGDTrainer if bug is None else BUGS[bug][0]
    s = TINY
    coins = np.random.default_rng(np.random.SeedSequence([seed, 571])).random(runs) < 0.5
    scores = np.zeros(runs)
    claim = None
    for r in range(runs):
        x, y = data(s["n"], seed * runs + r)
        cfg = DPSGDConfig(epsilon=None, noise_multiplier=s["noise_multiplier"], delta=DELTA, max_grad_norm=1.0,
                          batch_size=s["batch_size"], epochs=s["epochs"], lr=0.1, momentum=0.0, clipping="bk",
                          seed=seed * runs + r)
        can = CountingCanary(coins[r], n_real=s["n"], batch_size=s["batch_size"], seed=seed * runs + r)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(r)
            net = AuditBlock(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), s["side"])
        t = cls(net, x, y, cfg, canaries=can)
        t.fit()
        scores[r] = can.scores[0]
        claim = t.privacy()["epsilon"]
    k_pos, k_neg = guess_counts(runs, guess_fraction)
    g = guesses(scores, k_pos, k_neg)
    rr, v = int(np.count_nonzero(g)), int(np.count_nonzero(g * np.where(coins, 1, -1) == 1))
    lb = eps_delta_lower_bound(runs, rr, v, delta=DELTA, beta=BETA)
    return {"claim": claim, "lb": lb, "refuted": bool(lb > claim), "runs": runs, "guesses": rr, "correct": v,
            "setting": dict(s)}
