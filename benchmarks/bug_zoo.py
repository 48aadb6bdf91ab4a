"""The bug zoo (issue 25 point 4, issue 32 point 5): plausible DP-SGD implementation bugs, planted as
test doubles (subclasses of :class:`dpmech.dpsgd.trainer.DPSGDTrainer`, never user options), and the
one-run white-box audit that tries to refute each (docs/audit.md, "The bug zoo"). Writes
``benchmarks/results/bug_zoo.json`` and docs/audit.md's ``bug_zoo`` table.

No double touches the auditor. The canaries are engine canaries
(:class:`dpmech.privacy.audit.whitebox.EngineCanaries`): examples of the training set, drawn by
the engine's own ``poisson_batch`` with the real examples, rows of its batch whose per-example
gradients (raw norm 100 C, exactly known) go through its clipping routine, observed in the update
the optimizer applies. A double changes the engine only (its sampler, its clipping, its noise, its
normaliser); whatever that does to the canaries, it does without telling the auditor. The auditor
(:class:`ZooCanaries`, :func:`audit`) is the same for every engine, correct or buggy, and fixed
before any run:

* m = 100,000 engine canaries on an audit block (:class:`benchmarks.audit_block.AuditBlock`:
  coordinates no real example touches), each in D by a fair coin.
* Three statistics of each canary's projections x_t (in units of C) on its coordinate, because
  some bugs show only in the per-step structure: ``llr`` (the mixture log-likelihood ratio summed
  over steps, :mod:`dpmech.privacy.audit.whitebox`), ``range`` (max_t x_t - min_t x_t: a noise
  draw reused across steps cancels in the differences, leaving the 0/1 pattern of the canary's
  sampling) and ``position`` (log of the mean over the K = steps-per-epoch positions k of
  exp(sum over epochs of (x_{e,k} - 1/2) / sigma^2): the likelihood ratio of "in the same batch
  position every epoch", the signature of fixed batches).
* Guesses: the top and bottom ``GUESS_FRACTION`` / 2 of each statistic. Bound: Mahloujifar et
  al.'s recursion against the (epsilon, delta)-DP curve itself
  (:func:`dpmech.privacy.audit.fdp.eps_delta_lower_bound`, rigorous, no assumption on the
  mechanism), at beta / 3 per statistic (Bonferroni), so the largest of the three is a 95% lower
  bound.
* Refuted: that bound exceeds the engine's own claimed epsilon (its ledger, RDP) at delta.

Settings (:data:`SETTINGS`): 256 or 512 synthetic 8 x 8 images, a linear classifier plus the
audit block. Sampling and noise use the research mode's key (``NoiseKey.reproducible(seed)``): a
zoo run is replayed draw for draw (its epsilons are claims about planted bugs, not releases).

Run: ``.venv/bin/python benchmarks/bug_zoo.py [--canaries M] [--zoo-runs 40] [--docs]``.
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.audit_block import AuditBlock  # noqa: E402
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer  # noqa: E402
from dpmech.privacy.audit.fdp import eps_delta_lower_bound  # noqa: E402
from dpmech.privacy.audit.one_run import guess_counts, guesses  # noqa: E402
from dpmech.privacy.audit.whitebox import EngineCanaries  # noqa: E402

DELTA = 1e-5
BETA = 0.05
GUESS_FRACTION = 0.01
M = 100_000
SIDE = 317                      # 317^2 = 100,489 audit coordinates >= M
STATISTICS = ("llr", "range", "position")
DOC = Path(__file__).resolve().parent.parent / "docs" / "audit.md"

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


def research_key(seed: int) -> dict:
    """The research mode's noise key (replayable draws), where the engine takes one."""
    if "noise_key" not in inspect.signature(DPSGDTrainer).parameters:
        return {}
    from dpmech.privacy.secret import NoiseKey

    return {"noise_key": NoiseKey.reproducible(seed)}


# ------------------------------------------------------------------ the auditor
class ZooCanaries(EngineCanaries):
    """Engine canaries (:class:`EngineCanaries`: examples the engine samples, forwards and clips)
    that keep the per-step statistics the zoo's auditor needs (module docstring). Nothing here
    knows which engine runs them."""

    def __init__(self, m: int = M, *, seed: int = 0):
        super().__init__(m, seed=seed, statistic="llr", placement="largest")

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

    def observe(self, noisy):
        x = noisy[self._k].detach().reshape(-1)[self._local].to("cpu", torch.float64).numpy() / self.C
        s2, k = self.sigma ** 2, self.kappa
        self.scores += np.logaddexp(math.log1p(-self.q) if self.q < 1 else -np.inf,
                                    math.log(self.q) + (k * x - k * k / 2) / s2)
        np.maximum(self.x_max, x, out=self.x_max)
        np.minimum(self.x_min, x, out=self.x_min)
        self.pos_sum[self.steps % self.positions] += x
        self.pos_count[self.steps % self.positions] += 1
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
    out = {"claim": float(claim), "canaries": m, "canary_kind": canaries.kind, "beta": beta, "delta": delta,
           "guess_fraction": guess_fraction, "statistics": {}}
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
    step, and the sum divided by ``divisor()`` instead of B. With the defaults it is the engine's
    step bit for bit (tests/test_bug_zoo.py)."""
    std = t.noise_multiplier * t.config.max_grad_norm * std_factor
    params = [p for group in t.base_optimizer.param_groups for p in group["params"] if p.requires_grad]
    sums = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if t.canaries is not None:
        t.canaries.insert(sums)         # inserted canaries add here; engine canaries came with the batch
    if std > 0:
        if reuse and getattr(t, "_reused_noise", None) is not None:
            noise = t._reused_noise
        else:
            noise = [torch.randn(p.shape, generator=t.noise_gen, device=p.device, dtype=p.dtype) for p in params]
            if reuse:
                t._reused_noise = noise
        sums = [z.mul(std).add_(g) for g, z in zip(sums, noise)]
    d = t.config.batch_size if divisor is None else divisor()
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
    In the zoo's model the last layer is the audit block, where the engine canaries' raw gradients
    (100 C) land: they pass unclipped, as any example's would."""

    unclipped = -1   # the index, in forward order, of the layer the loop skips

    def _bk_forward_backward(self, xb, yb):
        bk = self.bookkeeper
        bk.enabled = True
        try:
            logits = self.forward_train(xb)
        finally:
            bk.enabled = False
        per_example = self.per_example_loss(logits, yb)
        norms, closures = bk.per_example_norms(per_example.sum())
        c = (self.config.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        skip = self.unclipped % len(closures)
        for i, (mod, clip) in enumerate(closures):
            w, b = clip(c if i != skip else torch.ones_like(c))   # the bug
            for p, g in ((mod.weight, w), (getattr(mod, "bias", None), b)):
                if p is not None and p.requires_grad and g is not None:
                    p.grad = g.to(p.dtype) if p.grad is None else p.grad + g.to(p.dtype)
        self._add_noise_and_scale()
        return logits.detach(), per_example.detach()


class UnclippedFirstLayer(UnclippedLastLayer):
    """The same loop bug on the first layer (the zoo model's Linear(64, 10)) instead of the audit
    block (issue 48.6): every example's gradient there is raw, a real leak (removing one example
    moves the clipped sum by more than C), but the engine canaries' coordinates sit on the audit
    block, which is clipped: canaries on one layer do not see another layer left unclipped."""

    unclipped = 0


class SampledAtTwiceQ(DPSGDTrainer):
    """The accountant is told q for the configured batch (256) while the sampler draws every
    example of D at 2q (a loader built with twice the batch size)."""

    def poisson_batch(self):
        rate = min(1.0, 2 * self.plan.sampling_rate)
        mask = torch.rand(self.num_examples, generator=self.sample_gen) < rate
        return torch.nonzero(mask, as_tuple=False).squeeze(1).to(self.device)


class DividesByDrawnBatch(DPSGDTrainer):
    """The noisy sum is divided by the size of the batch actually drawn (what Opacus #420
    proposed), which depends on who is in it: the update's noise scale reveals it."""

    def _step(self, idx):
        self._drawn = int(idx.numel())
        return super()._step(idx)

    def _add_noise_and_scale(self):
        noise_step(self, divisor=lambda: max(1, self._drawn))


class NormaliserFromDatasetSize(DPSGDTrainer):
    """Opacus #571: the normaliser is the expected batch size computed from len(dataset), q |D|,
    a private quantity (|D| changes when one example is added or removed), instead of the
    planned B: the update's scale reveals |D|."""

    def _add_noise_and_scale(self):
        noise_step(self, divisor=lambda: self.plan.sampling_rate * self.num_examples)


class ReusedNoise(DPSGDTrainer):
    """One noise draw reused across steps (a generator re-seeded every step, or a cached buffer)."""

    def _add_noise_and_scale(self):
        noise_step(self, reuse=True)


class FixedBatches(DPSGDTrainer):
    """Fixed shuffled batches accounted as Poisson: D is shuffled once into ceil(N / B) batches
    and every epoch takes the same batches in the same order; the ledger records Poisson steps."""

    def poisson_batch(self):
        if not hasattr(self, "_fixed"):
            perm = torch.randperm(self.num_examples, generator=self.sample_gen)
            self._fixed = list(torch.tensor_split(perm, self.plan.steps_per_epoch))
        return self._fixed[self.steps % len(self._fixed)].to(self.device)


# name -> (double, setting, what it does)
BUGS = {
    "noise_std_halved": (NoiseHalf, "full_batch", "noise std sigma C / 2; the ledger records sigma"),
    "last_layer_unclipped": (UnclippedLastLayer, "full_batch",
                             "the clipping loop skips the last layer (off by one)"),
    "first_layer_unclipped": (UnclippedFirstLayer, "full_batch",
                              "the clipping loop skips the first layer, not the canaries' block"),
    "sampled_at_twice_q": (SampledAtTwiceQ, "half_batch", "examples drawn at 2q; the ledger records q"),
    "divides_by_drawn_batch": (DividesByDrawnBatch, "small_batch",
                               "noisy sum divided by the batch actually drawn (Opacus #420's proposal)"),
    "normaliser_from_len_dataset": (NormaliserFromDatasetSize, "small_batch",
                                    "noisy sum divided by q len(dataset) (Opacus #571)"),
    "noise_reused": (ReusedNoise, "small_batch", "one noise draw reused at every step"),
    "fixed_batches": (FixedBatches, "small_batch", "fixed shuffled batches accounted as Poisson"),
}


# ------------------------------------------------------------------ one run
def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def model(seed: int, side: int = SIDE) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AuditBlock(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), side)


def run(bug: str | None, seed: int, setting: str | None = None, m: int = M) -> dict:
    """One training run of the correct engine (``bug`` None) or a planted bug on its setting,
    audited once. Returns the audit (claim, lb, refuted, per-statistic counts)."""
    cls, default = (DPSGDTrainer, None) if bug is None else BUGS[bug][:2]
    name = setting or default
    if name is None:
        raise ValueError("setting: name one of " + ", ".join(SETTINGS) + " for the correct engine")
    s = SETTINGS[name]
    x, y = data(s["n"], seed)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=s["noise_multiplier"], delta=DELTA, max_grad_norm=1.0,
                      batch_size=s["batch_size"], epochs=s["epochs"], lr=0.1, momentum=0.0, clipping="bk", seed=seed)
    can = ZooCanaries(m, seed=seed)
    t = cls(model(seed), x, y, cfg, canaries=can, **research_key(seed))
    can.set_positions(t.plan.steps_per_epoch)
    t.fit()
    out = audit(can, t.privacy()["epsilon"])
    out.update(bug=bug, setting=name, seed=seed, steps=t.steps)
    return out


# ------------------------------------------------------------------ many runs of a tiny dataset
# Opacus #571's setting: 2 examples; one canary per run, in D by a fair coin; q = 1/2, 20 steps, sigma 8
# (claim 1.18)
TINY = dict(n=2, batch_size=1, noise_multiplier=8.0, epochs=10, side=32)


class CountingCanary(ZooCanaries):
    """One engine canary whose auditor also reads the update's scale: the audit block's other
    coordinates carry only noise, of std sigma C B / d_t for a normaliser d_t (B when correct), so
    d_t = B sigma C / their root mean square, rounded (a count). Per step it adds the
    log-likelihood ratio of (d_t, x_t) under "the canary is in D" (d_t - b ~ Binomial(n, q),
    b ~ Bernoulli(q), x_t ~ N(b, sigma^2)) against "it is not" (d_t ~ Binomial(n, q), x_t ~
    N(0, sigma^2)): the model of a normaliser that counts the examples (either bug); for a correct
    engine d_t = B always and only x_t separates."""

    def __init__(self, included: bool, *, n_real: int, batch_size: int, seed: int = 0):
        super().__init__(1, seed=seed)
        self.included = np.array([bool(included)])
        self.member_ids = np.flatnonzero(self.included)
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
    """``runs`` independent trainings on :data:`TINY`, one engine canary each (the one-run theorem
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
        t = cls(model(r, s["side"]), x, y, cfg, canaries=can, **research_key(seed * runs + r))
        t.fit()
        scores[r] = can.scores[0]
        claim = t.privacy()["epsilon"]
    k_pos, k_neg = guess_counts(runs, guess_fraction)
    g = guesses(scores, k_pos, k_neg)
    rr, v = int(np.count_nonzero(g)), int(np.count_nonzero(g * np.where(coins, 1, -1) == 1))
    lb = eps_delta_lower_bound(runs, rr, v, delta=DELTA, beta=BETA)
    return {"claim": claim, "lb": lb, "refuted": bool(lb > claim), "runs": runs, "guesses": rr, "correct": v,
            "setting": dict(s), "canary_kind": "engine"}


# ------------------------------------------------------------------ the benchmark
MULTI_RUN = ("divides_by_drawn_batch", "normaliser_from_len_dataset")


def zoo(runs: int = 40, m: int = M, multi_runs: int = 200, progress=None) -> dict:
    """Every bug in one run (seed 0), the shared-leak bugs also by ``multi_runs`` runs of
    :data:`TINY`, and the correct engine's refutations over ``runs`` seeded runs, spread over the
    settings in proportion to the bugs that use each. ``progress(out)`` after each part."""
    from benchmarks.common import log

    progress = progress or (lambda out: None)
    out = {"bugs": {}}
    for bug, (_, setting, what) in BUGS.items():
        t0 = time.perf_counter()
        r = run(bug, seed=0, m=m)
        out["bugs"][bug] = {"what": what, "claim": r["claim"], "lb": r["lb"], "refuted_in_one_run": r["refuted"],
                            "setting": setting, "statistics": r["statistics"], "canary_kind": r["canary_kind"],
                            "seconds": time.perf_counter() - t0}
        log(f"bug_zoo {bug}: claim {r['claim']:.3f} lb {r['lb']:.3f} refuted {r['refuted']} "
            f"({time.perf_counter() - t0:.0f} s)")
        progress(out)
    t0 = time.perf_counter()
    c = multi_run_audit(None, runs=multi_runs)
    out["multi_run"] = {"correct_engine": c}
    for bug in MULTI_RUN:
        r = multi_run_audit(bug, runs=multi_runs)
        out["multi_run"][bug] = r
        log(f"bug_zoo {bug}, {multi_runs} runs of 2 examples: claim {r['claim']:.3f} lb {r['lb']:.3f} "
            f"refuted {r['refuted']} (correct engine {c['lb']:.3f})")
    out["multi_run"]["seconds"] = time.perf_counter() - t0
    progress(out)
    settings = [b[1] for b in BUGS.values()]
    plan = [(s, settings.count(s)) for s in SETTINGS]
    total = sum(k for _, k in plan)
    counts = {s: round(runs * k / total) for s, k in plan}
    counts[plan[-1][0]] += runs - sum(counts.values())
    by_setting, ratios, seed = {}, [], 1000
    for s, n in counts.items():
        refuted = 0
        for _ in range(n):
            r = run(None, seed=seed, setting=s, m=m)
            seed += 1
            refuted += r["refuted"]
            ratios.append(r["lb"] / r["claim"])
        by_setting[s] = {"runs": n, "refuted": refuted, "claim": r["claim"]}
        log(f"bug_zoo correct engine, {s}: {refuted} of {n} refuted")
    n_ref = sum(v["refuted"] for v in by_setting.values())
    out["correct"] = {"runs": runs, "refuted": n_ref, "refute_rate": n_ref / runs, "by_setting": by_setting,
                      "lb_over_claim_mean": statistics.fmean(ratios), "lb_over_claim_max": max(ratios),
                      "seeds": f"1000-{999 + runs}"}
    out["auditor"] = {"canaries": m, "canary_kind": "engine", "raw_norm": EngineCanaries(1).raw_norm,
                      "guess_fraction": GUESS_FRACTION, "statistics": list(STATISTICS),
                      "bound": "dpmech.privacy.audit.fdp.eps_delta_lower_bound at beta / 3 per statistic (rigorous)",
                      "beta": BETA, "delta": DELTA, "settings": SETTINGS,
                      "noise": "research mode (NoiseKey.reproducible(seed)): replayable draws"}
    return out


def doc_table(payload: dict) -> str:
    """docs/audit.md's ``bug_zoo`` block from the results."""
    rows = ["| bug | what it does | setting | claim | lb (95%) | refuted in one run | statistic that sees it "
            "(right guesses) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for bug, e in payload["bugs"].items():
        best = max(e["statistics"].items(), key=lambda kv: kv[1]["lb"])
        rows.append(f"| {bug} | {e['what']} | {e['setting']} | {e['claim']:.2f} | {e['lb']:.2f} "
                    f"| {'yes' if e['refuted_in_one_run'] else '**no**'} | {best[0]} "
                    f"({best[1]['correct']}/{best[1]['guesses']} right) |")
    mr = payload.get("multi_run", {})
    c = mr.get("correct_engine")
    for bug in MULTI_RUN:
        r = mr.get(bug)
        if r:
            rows.append(f"| {bug}, {r['runs']} runs of 2 examples | (as above) | one canary per run "
                        f"| {r['claim']:.2f} | {r['lb']:.2f} | {'yes' if r['refuted'] else 'no'} (many runs) "
                        f"| normaliser read from the update's scale ({r['correct']}/{r['guesses']} right; "
                        f"correct engine {c['lb']:.2f}) |")
    cr = payload.get("correct")
    if cr:
        rows.append("")
        rows.append(f"Correct engine: refuted in {cr['refuted']} of {cr['runs']} seeded runs (refute rate "
                    f"{cr['refute_rate']:.3f}, target <= 0.05); " + ", ".join(
                        f"{s} {v['refuted']}/{v['runs']}" for s, v in cr["by_setting"].items())
                    + f"; its bound is on average {cr['lb_over_claim_mean']:.2f} x the claim "
                      f"(at most {cr['lb_over_claim_max']:.2f} x). {payload['auditor']['canaries']:,} engine "
                      "canaries per run; no double touches the auditor.")
    return "\n".join(rows)


def main(argv=None) -> None:
    from benchmarks.common import RESULTS, environment, log, read_result, update_doc_blocks, write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--canaries", type=int, default=M)
    ap.add_argument("--zoo-runs", type=int, default=40, help="correct-engine runs of the refute rate")
    ap.add_argument("--multi-runs", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--docs", action="store_true", help="only rewrite docs/audit.md's table from the results")
    ap.add_argument("--bugs", nargs="+", choices=list(BUGS), default=None,
                    help="run only these bugs' one-run audits (seed 0) and merge them into the results file")
    args = ap.parse_args(argv)
    path = RESULTS / "bug_zoo.json"
    if args.bugs and not args.docs:
        payload = read_result(path)
        for bug in args.bugs:
            _, setting, what = BUGS[bug]
            t0 = time.perf_counter()
            r = run(bug, seed=0, m=args.canaries)
            payload["bugs"][bug] = {"what": what, "claim": r["claim"], "lb": r["lb"], "refuted_in_one_run": r["refuted"],
                                    "setting": setting, "statistics": r["statistics"],
                                    "canary_kind": r["canary_kind"], "seconds": time.perf_counter() - t0}
            log(f"bug_zoo {bug}: claim {r['claim']:.3f} lb {r['lb']:.3f} refuted {r['refuted']}")
        payload["bugs"] = {b: payload["bugs"][b] for b in BUGS if b in payload["bugs"]}   # the zoo's order
        write_result("bug_zoo", payload, out=path)
    elif not args.docs:
        if args.threads:
            torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        head = {"benchmark": "bug_zoo", "environment": environment(torch.device("cpu"))}
        part = path.with_name("bug_zoo.partial.json")
        payload = {**head, **zoo(args.zoo_runs, args.canaries, args.multi_runs,
                                 progress=lambda out: write_result("bug_zoo", {**head, **out}, out=part))}
        part.unlink(missing_ok=True)
        payload["seconds"] = time.perf_counter() - t0
        write_result("bug_zoo", payload, out=path)
        log(f"wrote {path}")
    payload = read_result(path)
    if payload and "<!-- bug_zoo:begin" in DOC.read_text():
        update_doc_blocks({DOC: {"bug_zoo": doc_table(payload)}})
        log(f"updated {DOC}")


if __name__ == "__main__":
    main()
