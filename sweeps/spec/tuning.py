"""Private hyperparameter selection for a sweep (spec key ``tuning_privacy``; docs/tuning_privacy.md).

Under ``tuning_privacy: {distribution, mean, shape, delta}`` a sweep is Papernot & Steinke's
(2022) procedure, and dpsweep enforces every condition their theorem needs:

* the number of trials K is drawn from the distribution, before anything runs, independently of
  the data, from the sweep's secret (docs/threat_model.md): the bound assumes K unobserved, so K
  stays in the owner's working state (console, MLflow store, ``dpsweep.json``; owner-only files)
  and is never carried by the release bundle; the candidates' hyperparameters are drawn from the
  secret too;
* each trial draws its hyperparameters independently from the spec's distributions: random
  search over one trainable, no grid dimension (a grid is not a distribution), no adaptive
  searcher (Optuna) and no early stopping (ASHA): those make a trial depend on the others'
  results, which the guarantee does not cover;
* only the best trial (by ``search.metric``/``search.mode``) is released: the parent run records
  its score, its model and a pointer to it; the other trials are working state;
* the end-to-end (epsilon, delta) comes from the RDP curves of every configuration the search
  could draw, so privacy-relevant keys (the trainable's ``privacy_keys``) may be fixed or drawn from
  a finite ``choice`` only; it is computed under each analysis that applies
  (``dpmech.privacy.tuning_analyses``: Papernot & Steinke on the order-wise worst curve, and on
  the curve of the candidate as drawn, a mixture) and the smallest is charged (``tuning_epsilon``,
  with ``tuning_epsilon_<analysis>`` beside it).

This module checks the spec and computes the numbers; it does not import Ray or MLflow.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import TYPE_CHECKING

import numpy as np

from sweeps.spec.space import RANGES, SpecError

if TYPE_CHECKING:
    from sweeps.spec.sweep_spec import SweepSpec

MAX_PRIVACY_CONFIGS = 2000
K_STREAM = 0x7D9  # the stream of search.seed that draws K (trial draws use the plain seed)


def _sweep_key(spec: "SweepSpec"):
    """The key K and the candidates are drawn from: the sweep's secret once ``dpsweep run`` bound it
    (``SweepSpec.bind_noise_key``), else a throw-away one (validation, ``--dry-run``); the research
    mode (``common.noise_source: seed``) draws from ``search.seed`` as earlier releases did."""
    from dpmech.privacy.secret import NoiseKey

    if spec.reproducible_noise:
        return NoiseKey.reproducible(spec.search.seed)
    if spec._noise_key is None:
        spec._noise_key = NoiseKey.fresh()
    return spec._noise_key


def draw_k(spec: "SweepSpec") -> int:
    """The number of trials K of a tuning-private sweep, from the sweep's secret: Papernot & Steinke's
    bound holds with K random and unobserved (docs/tuning_privacy.md), so nothing published carries it."""
    from dpmech.privacy.tuning import draw_num_trials

    tp = spec.tuning_privacy
    rng = _sweep_key(spec).numpy_rng("tuning.k", [spec.search.seed, K_STREAM])
    return draw_num_trials(tp.distribution, tp.mean, tp.shape, rng=rng)


def draws_seed(spec: "SweepSpec") -> int:
    """The seed of the candidates' hyperparameter draws: from the sweep's secret (research mode:
    ``search.seed``)."""
    return _sweep_key(spec).entropy("tuning.draws", spec.search.seed)


def check_tuning_spec(spec: "SweepSpec") -> None:
    """The rules of Papernot & Steinke's procedure (module docstring) on the spec's sections,
    checked before the trainables' spaces are built; SpecError names the key."""
    from dpmech.privacy.tuning import tuning_shape

    tp = spec.tuning_privacy
    try:
        if tp.distribution != "truncated_negative_binomial" and tp.shape is not None:
            raise ValueError(f"tuning_privacy.shape: only the truncated negative binomial has a shape "
                             f"({tp.distribution} is fixed)")
        tuning_shape(tp.distribution, tp.shape)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    s = spec.search
    if s.algorithm == "grid":
        raise SpecError("search.algorithm: tuning_privacy needs random search: a grid runs a fixed list of "
                        "configurations, but the guarantee needs a random number of independently drawn trials")
    if s.algorithm == "optuna":
        raise SpecError("search.algorithm: tuning_privacy needs random search: an adaptive searcher (optuna) picks "
                        "each trial from earlier results, which the guarantee does not cover")
    if spec.scheduler.type != "none":
        raise SpecError(f"scheduler.type: tuning_privacy refuses {spec.scheduler.type}: early stopping (ASHA, PBT) "
                        "makes trials depend on each other's results, which the guarantee does not cover")
    if s.num_samples != 1:
        raise SpecError("search.num_samples: with tuning_privacy the number of trials is drawn from "
                        "tuning_privacy.distribution; leave num_samples at 1")
    if s.metric is None:
        raise SpecError("search.metric: required with tuning_privacy (with search.mode): it selects the one "
                        "trial that is released")
    if not private_selection_metric(s.metric):
        raise SpecError(f"search.metric: {s.metric} is computed on the private training data without noise; with "
                        "tuning_privacy the selection must use a metric computed without the training data "
                        f"({', '.join(PRIVATE_SELECTION_METRICS)}, acc_<attack>_<size>, cert_*)")
    if len(spec.trainables) != 1:
        raise SpecError(f"trainables: tuning_privacy tunes one trainable, got {len(spec.trainables)}")


# Metrics computed without touching the training data (held-out test set, or samples of a trained
# generator scored on real held-out data): only these may select the released trial under
# tuning_privacy, since Papernot & Steinke's theorem covers a selection that is a function of the
# private trials' outputs. train_loss, train_acc, loss_near_chance (a function of the noise-free
# train_loss), batch_size_mean, clipped_fraction and wasserstein read the training data without noise;
# not_learned is a flag (chance level), not a score to select by.
PRIVATE_SELECTION_METRICS = ("acc_clean", "test_acc", "tstr_acc", "sample_quality", "sample_confidence",
                             "classifier_score")


def private_selection_metric(metric: str) -> bool:
    """Whether ``metric`` is computed without the private training data (see PRIVATE_SELECTION_METRICS)."""
    return metric in PRIVATE_SELECTION_METRICS or metric.startswith(("acc_", "cert_"))


def check_tuning_space(spec: "SweepSpec") -> None:
    """The rules on the trainable and its search space (after the space is validated)."""
    from trainables.registry import get_trainable

    name = spec.trainables[0].name
    entry = get_trainable(name)
    if entry.privacy_event is None:
        raise SpecError(f"trainables[0].name: {name} has no per-trial privacy guarantee for its training examples "
                        f"that tuning_privacy could compose; trainables that have one: {', '.join(_eligible())}")
    for dim in spec.spaces[0].dims:
        if dim.kind == "grid":
            raise SpecError(f"{dim.path}: a grid is not allowed with tuning_privacy (each trial draws its values "
                            "independently); write {choice: [...]} instead")
        if dim.kind in RANGES and dim.key in entry.privacy_keys:
            raise SpecError(f"{dim.path}: {dim.key} changes the per-trial privacy guarantee; with tuning_privacy "
                            "draw it from a finite {choice: [...]} so the worst case over the search space is exact")


def _eligible() -> list[str]:
    from trainables.registry import REGISTRY

    return [n for n, e in REGISTRY.items() if e.privacy_event is not None] or ["(none registered)"]


def privacy_configs(spec: "SweepSpec") -> list[dict]:
    """Every configuration of the search space that differs in a privacy-relevant key (the
    product of their choices; other keys at their first value), validated by the schema."""
    from trainables.registry import get_trainable

    space = spec.spaces[0]
    keys = get_trainable(space.name).privacy_keys
    base = {d.key: d.values[0] for d in space.dims}
    varying = [d for d in space.dims if d.kind == "choice" and d.key in keys]
    combos = list(itertools.islice(itertools.product(*(d.values for d in varying)), MAX_PRIVACY_CONFIGS + 1))
    if len(combos) > MAX_PRIVACY_CONFIGS:
        raise SpecError(f"trainables[0].search: more than {MAX_PRIVACY_CONFIGS} privacy-relevant combinations "
                        f"({', '.join(d.key for d in varying)}); narrow the choices")
    return [space.config({**base, **{d.key: v for d, v in zip(varying, combo)}}, "privacy configuration")
            for combo in combos]


def tuning_summary(spec: "SweepSpec", ran_epsilon: float | None = None) -> dict[str, float]:
    """The numbers the parent run records: E[K], the worst per-trial epsilon and the end-to-end
    epsilon at ``tuning_privacy.delta`` (default: the largest per-trial delta in the space). Not K:
    the guarantee assumes it unobserved (docs/tuning_privacy.md).

    ``ran_epsilon``: with ``target_epsilon``, the per-trial epsilon the candidates were configured
    with (``ran_trial_epsilon``): the summary is then of what ran, not of a calibration made again
    (a resume re-validates the spec, and a calibration of today's code may land elsewhere)."""
    from trainables.registry import get_trainable

    tp = spec.tuning_privacy
    configs = privacy_configs(spec)
    if ran_epsilon is not None:
        configs = [{**c, "epsilon": float(ran_epsilon)} for c in configs]
    delta = tuning_delta(spec, configs)
    # the same spec validated again (a resume, --dry-run then run, a test's many secrets) reuses it:
    # the summary is a function of the trainable, its privacy configurations and the tuning section
    entry = get_trainable(spec.trainables[0].name)
    memo = json.dumps([entry.name, repr(entry.privacy_event_fn), configs, tp.model_dump(), delta], sort_keys=True,
                      default=str)
    if memo not in _SUMMARIES:
        _SUMMARIES[memo] = _summary(spec, configs, delta)
    return dict(_SUMMARIES[memo])


_SUMMARIES: dict[str, dict[str, float]] = {}


def _summary(spec: "SweepSpec", configs: list[dict], delta: float) -> dict[str, float]:
    from dpmech.privacy.accounting import rdp_curve, rdp_epsilon
    from dpmech.privacy.tuning_analyses import charged_analysis, epsilon_total_by_analysis

    tp = spec.tuning_privacy
    curves = np.stack([rdp_curve(e) for e in _trial_events(spec, configs)])
    by = epsilon_total_by_analysis(curves, delta, tp.distribution, tp.mean, tp.shape)
    _, charged = charged_analysis(by)
    return {
        "tuning_mean": float(tp.mean),
        "tuning_delta": float(delta),
        "trial_epsilon_worst": rdp_epsilon(curves.max(axis=0), delta),
        # the charged guarantee: the smallest end-to-end epsilon among the sound analyses that apply
        "tuning_epsilon": charged,
        **{f"{ANALYSIS_PREFIX}{name}": float(eps) for name, eps in by.items()},
        "tuning_configs": float(len(configs)),
        **({"tuning_target_epsilon": float(tp.target_epsilon), "trial_epsilon_calibrated": float(configs[0]["epsilon"])}
           if tp.target_epsilon is not None else {}),
    }


# the summary's (and the parent run's metrics') key of the end-to-end epsilon under one analysis
ANALYSIS_PREFIX = "tuning_epsilon_"


def epsilon_total_by_analysis(summary: dict) -> dict[str, float]:
    """``{analysis: end-to-end epsilon}`` of a tuning summary or of a parent run's metrics (the
    ``tuning_epsilon_<analysis>`` keys); a sweep recorded before issue 54 has only
    ``tuning_epsilon``, Papernot & Steinke's."""
    from dpmech.privacy.tuning_analyses import ANALYSES, PAPERNOT_STEINKE

    by = {a: float(summary[ANALYSIS_PREFIX + a]) for a in ANALYSES if ANALYSIS_PREFIX + a in summary}
    if not by and "tuning_epsilon" in summary:
        by = {PAPERNOT_STEINKE: float(summary["tuning_epsilon"])}
    return by


def describe_analyses(summary: dict) -> str:
    """One line: the end-to-end epsilon under each analysis that applies, and the one charged."""
    by = epsilon_total_by_analysis(summary)
    each = ", ".join(f"{name} {eps:.4g}" for name, eps in by.items())
    return (f"end-to-end epsilon by analysis at delta {summary.get('tuning_delta', math.nan):.3g}: {each}; "
            f"charged: {charged_analysis_name(summary)} (the smallest; docs/tuning_privacy.md)")


def charged_analysis_name(summary: dict) -> str:
    """The analysis a summary's (or a parent run's) ``tuning_epsilon`` is charged under."""
    from dpmech.privacy.tuning_analyses import charged_analysis

    return charged_analysis(epsilon_total_by_analysis(summary))[0]


def check_tuning_guarantee(spec: "SweepSpec") -> dict[str, float]:
    """The tuning summary of the validated spec (kept on the spec for ``dpsweep run``), or SpecError
    when its end-to-end epsilon is no guarantee: not finite, or above ``target_epsilon`` (issue 48.2:
    an infinite epsilon was once run and released with exit 0)."""
    summary = tuning_summary(spec)
    refuse_guarantee(summary, spec.tuning_privacy.target_epsilon)
    spec._tuning_summary = summary
    return summary


def refuse_guarantee(summary: dict, target: float | None, rtol: float = 1e-6) -> None:
    """SpecError naming the rule when ``summary``'s end-to-end epsilon (the charged one, the smallest
    among the analyses that apply) is not finite or exceeds ``target`` (by more than ``rtol``, the
    calibration's rounding)."""
    eps = summary.get("tuning_epsilon")
    where = "tuning_privacy"
    if not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise SpecError(f"{where}: the end-to-end epsilon is not finite ({eps}): the per-trial privacy curve is "
                        "infinite at every order the accountant converges on; add noise (a smaller epsilon, a larger "
                        "training set or fewer steps) or a smaller tuning_privacy.mean")
    if target is not None and eps > target * (1 + rtol):
        raise SpecError(f"{where}.target_epsilon: the end-to-end epsilon {eps:.6g} is above the target {target:g} "
                        f"(charged under {charged_analysis_name(summary)}, the smallest of the analyses that apply)")


def ran_trial_epsilon(spec: "SweepSpec", rows: list[dict]) -> float | None:
    """The per-trial epsilon the candidates of a ``target_epsilon`` sweep were configured with (None
    without ``target_epsilon``, or when no candidate reports it); a ValueError when they differ."""
    if spec.tuning_privacy is None or spec.tuning_privacy.target_epsilon is None:
        return None
    ran = {float(r["cfg.epsilon"]) for r in rows if isinstance(r.get("cfg.epsilon"), (int, float))}
    if len(ran) > 1:
        raise ValueError(f"tuning_privacy: the candidates ran at different per-trial epsilons {sorted(ran)}; the "
                         "end-to-end guarantee assumes one")
    return ran.pop() if ran else None


def candidates_beyond_guarantee(rows: list[dict], summary: dict[str, float], rtol: float = 1e-9) -> list[str]:
    """The candidates whose logged epsilon (their ledger's, at their delta) exceeds the per-trial
    epsilon the end-to-end guarantee assumed (``trial_epsilon_worst``): each one a line. The ledger
    may stop short of the plan (an empty list is the expected outcome)."""
    assumed = summary["trial_epsilon_worst"]
    return [f"trial {r.get('trial_id', '?')}: logged epsilon {r['epsilon']:.6g} > {assumed:.6g} assumed by the "
            "end-to-end guarantee" for r in rows
            if isinstance(r.get("epsilon"), (int, float)) and r["epsilon"] > assumed * (1 + rtol)]


def tuning_delta(spec: "SweepSpec", configs: list[dict]) -> float:
    """delta of the end-to-end guarantee: ``tuning_privacy.delta``, else the largest per-trial delta."""
    deltas = [float(c["delta"]) for c in configs if "delta" in c]
    return spec.tuning_privacy.delta if spec.tuning_privacy.delta is not None else (max(deltas) if deltas else 1e-5)


def _trial_events(spec: "SweepSpec", configs: list[dict], epsilon: float | None = None) -> list:
    """The per-trial privacy event of each configuration (with its epsilon replaced by ``epsilon``)."""
    from trainables.registry import get_trainable

    entry = get_trainable(spec.trainables[0].name)
    override = {} if epsilon is None else {"epsilon": epsilon}
    return [entry.privacy_event_fn(entry.config_model(**{**{k: v for k, v in c.items() if k != "trainable"},
                                                         **override}))
            for c in configs]


def end_to_end_epsilon(spec: "SweepSpec", trial_epsilon: float) -> float:
    """End-to-end epsilon of the spec's tuning when every trial runs at ``trial_epsilon`` (e.g. the
    epsilon its trials logged): the charged one (the smallest among the analyses that apply,
    ``dpmech.privacy.tuning_analyses``) over the search space's privacy configurations."""
    configs = privacy_configs(spec)
    return _tuning_epsilon_at(spec, configs, trial_epsilon, tuning_delta(spec, configs))


def epsilon_by_analysis_at(spec: "SweepSpec", trial_epsilon: float, fast: bool = False) -> dict[str, float]:
    """``{analysis: end-to-end epsilon}`` of the spec's tuning when every trial runs at
    ``trial_epsilon`` (accounting only: what each analysis charges for the same release)."""
    from dpmech.privacy.accounting import rdp_curve
    from dpmech.privacy.tuning_analyses import epsilon_total_by_analysis as by_analysis

    tp = spec.tuning_privacy
    configs = privacy_configs(spec)
    curves = np.stack([rdp_curve(e, fast=fast) for e in _trial_events(spec, configs, trial_epsilon)])
    return by_analysis(curves, tuning_delta(spec, configs), tp.distribution, tp.mean, tp.shape)


def _tuning_epsilon_at(spec: "SweepSpec", configs: list[dict], trial_epsilon: float, delta: float,
                       fast: bool = False) -> float:
    """Charged end-to-end epsilon (the smallest sound analysis) when every configuration of
    ``configs`` targets ``trial_epsilon``
    (``fast``: the trials' RDP curves vectorised, for the calibration's search; its answer is checked
    with the exact ones)."""
    from dpmech.privacy.accounting import rdp_curve
    from dpmech.privacy.tuning_analyses import charged_analysis, epsilon_total_by_analysis

    tp = spec.tuning_privacy
    curves = np.stack([rdp_curve(e, fast=fast) for e in _trial_events(spec, configs, trial_epsilon)])
    return charged_analysis(epsilon_total_by_analysis(curves, delta, tp.distribution, tp.mean, tp.shape))[1]


_CALIBRATED: dict[str, float] = {}   # one calibration per spec and process (validation runs it again on resume)


def calibration_cache_dir():
    """Where calibrations are kept between processes (``--dry-run`` then ``run``, ``resume``):
    ``$DPSWEEP_CACHE/calibration``, default ``~/.cache/dpsweep/calibration``. A file holds only the
    per-trial epsilon computed from the spec's public tuning section and search space (nothing of
    the data or the sweep's secret)."""
    import os
    from pathlib import Path

    root = os.environ.get("DPSWEEP_CACHE") or Path.home() / ".cache" / "dpsweep"
    return Path(root) / "calibration"


def _say(msg: str) -> None:
    """Calibration progress on stderr (tens of seconds for a large search space)."""
    import sys

    print(f"dpsweep: {msg}", file=sys.stderr, flush=True)


def _cached(key: str):
    """(path, cached per-trial epsilon or None) of a calibration key."""
    import hashlib

    path = calibration_cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        data = json.loads(path.read_text())
        return path, (float(data["trial_epsilon"]) if data.get("key") == key else None)
    except (OSError, ValueError, KeyError, TypeError):
        return path, None


def _store(path, key: str, e: float) -> None:
    import os

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "trial_epsilon": e}))
        os.replace(tmp, path)
    except OSError:  # a read-only home: the next run calibrates again, nothing else changes
        pass


def _solve_trial_epsilon(spec: "SweepSpec", configs: list[dict], delta: float, rtol: float) -> float:
    """Brent's method on log e for end-to-end(e) = target, then small steps down until the
    end-to-end epsilon is <= the target: the returned e is within ``rtol`` of the root. The search
    evaluates the trials' RDP curves vectorised; the e it lands on is checked on dp-accounting's
    curves (a step or two down); were the two ever to disagree beyond that, the search runs again
    on dp-accounting's curves alone. Each evaluation is reported on stderr (``_say``)."""
    from scipy.optimize import brentq

    target = spec.tuning_privacy.target_epsilon
    steps = [0]

    def gap(log_e: float, fast: bool) -> float:
        end = _tuning_epsilon_at(spec, configs, math.exp(log_e), delta, fast=fast)
        steps[0] += 1
        _say(f"calibrating: step {steps[0]}: per-trial epsilon {math.exp(log_e):.5g} -> end-to-end {end:.5g} "
             f"(target {target:g}{'' if fast else ', checked'})")
        return end - target

    def root(fast: bool) -> float:
        hi = target                      # releasing the best of K >= 1 trials costs at least one trial
        lo = target / 8                  # usual: tuning costs less than 8x (a narrower bracket, fewer steps)
        if gap(math.log(lo), fast) > 0:
            lo = 1e-4 * target
            if gap(math.log(lo), fast) > 0:
                raise SpecError(f"tuning_privacy.target_epsilon: {target:g} is below what E[K] = "
                                f"{spec.tuning_privacy.mean:g} trials cost even at a per-trial epsilon of "
                                f"{lo:.2g}; raise the target or lower tuning_privacy.mean")
        if gap(math.log(hi), fast) <= 0:
            return hi
        return math.exp(brentq(gap, math.log(lo), math.log(hi), args=(fast,), xtol=rtol / 20))

    e = root(fast=True)
    for _ in range(4):                   # land on the safe side of the target, exactly
        if gap(math.log(e), fast=False) <= 0:
            return e
        e *= 1 - rtol / 10
    e = root(fast=False)
    while gap(math.log(e), fast=False) > 0:
        e *= 1 - rtol / 10
    return e


def calibrate_to_target(spec: "SweepSpec", rtol: float = 1e-3) -> float:
    """``tuning_privacy.target_epsilon``: the largest per-trial epsilon e (to ``rtol``) whose
    charged end-to-end epsilon (the smallest of the sound analyses that apply, over the search
    space's privacy configurations: ``tuning_summary``'s ``tuning_epsilon``) is at most
    the target; the trainable's ``epsilon`` is set to e (a fixed value, so every trial calibrates its
    noise to it; the caller, ``sweeps.spec``, rebuilds the spaces). The end-to-end epsilon grows with e (each configuration's
    noise falls, its RDP curve rises order-wise, so do their maximum and their mixture, Papernot &
    Steinke's bound is monotone in the curve, and so is the smaller of two such bounds, in the
    curve), so a root finder on log e finds it. Returns e."""
    from dpmech.privacy.tuning_analyses import ANALYSES
    from trainables.registry import get_trainable

    tp = spec.tuning_privacy
    t = spec.trainables[0]
    entry = get_trainable(t.name)
    if "epsilon" not in entry.config_model.model_fields or "epsilon" not in entry.privacy_keys:
        raise SpecError(f"tuning_privacy.target_epsilon: {t.name} has no per-trial target epsilon to calibrate")
    if "epsilon" in t.search:
        raise SpecError("trainables[0].search.epsilon: with tuning_privacy.target_epsilon the per-trial epsilon is "
                        "calibrated from the target; leave it unset")
    configs = privacy_configs(spec)
    delta = tuning_delta(spec, configs)
    # the analyses charged are part of the key: a value calibrated under fewer is sound but not the largest
    key = json.dumps([t.name, configs, tp.model_dump(), delta, rtol, {"charged": list(ANALYSES)}], sort_keys=True,
                     default=str)
    if key not in _CALIBRATED:
        path, e = _cached(key)
        # a cached value is checked once (one evaluation): it must still land at or below the target
        if e is not None and _tuning_epsilon_at(spec, configs, e, delta) <= tp.target_epsilon:
            _say(f"tuning_privacy: per-trial epsilon {e:.6g} for end-to-end {tp.target_epsilon:g} reused from "
                 f"{path} (checked)")
        else:
            _say(f"tuning_privacy: calibrating the per-trial epsilon so that releasing the best of K ~ "
                 f"{tp.distribution}(mean {tp.mean:g}) costs {tp.target_epsilon:g} end to end, over "
                 f"{len(configs)} privacy configuration(s); about 10 to 20 steps (kept in {path} for the next run)")
            e = _solve_trial_epsilon(spec, configs, delta, rtol)
            _store(path, key, e)
        _CALIBRATED[key] = e
    e = _CALIBRATED[key]
    t.search["epsilon"] = e
    return e


def best_row(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The trial released by a tuning-private sweep: the best finished trial by the metric."""
    done = [r for r in rows if r.get("status") == "DONE" and isinstance(r.get(metric), (int, float))
            and math.isfinite(r[metric])]
    if not done:
        return None
    return (max if mode == "max" else min)(done, key=lambda r: r[metric])
