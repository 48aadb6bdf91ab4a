"""The ``audit`` trial key: one mapping for the privacy audit of a trial (docs/audit.md).

    audit: {mode: whitebox, canaries: 1000, estimator: [fdp, steinke, gdp], confidence: 0.95,
            direction: dirac, guess_fraction: 0.1}

* ``mode``: ``whitebox`` -- gradient canaries inside the DP-SGD engine, scored from every noisy
  update (:mod:`dpmech.privacy.audit.whitebox`; trainables built on that engine: dpsgd, dpal_sound,
  secure_sgd; and dpgan, whose critic takes the same clipped, noisy steps) -- or ``blackbox`` --
  canary images with wrong labels, scored from the final model (:mod:`dpmech.privacy.audit.one_run`; every
  trainable that protects its training examples).
* ``canaries``: m >= 1.
* ``estimator``: one name or a list of ``steinke`` (Steinke et al. 2023), ``fdp`` (Mahloujifar
  et al. 2025), ``gdp`` (an estimate); the first rigorous one (steinke or fdp) is the trial's
  ``audit_epsilon_lb``. Default ``[steinke, fdp, gdp]``.
* ``confidence``: 1 - beta of the lower bounds (default 0.95).
* ``canary`` (white-box only): ``engine`` -- canaries that are examples of the engine's training
  set, drawn by its sampler and clipped by its clipping routine, so a sampling or clipping bug
  reaches them (:class:`dpmech.privacy.audit.whitebox.EngineCanaries`; the default of dpsgd and
  secure_sgd) -- or ``inserted`` -- Dirac canaries added to the clipped sum (the default of
  dpal_sound, whose paired loss engine canaries cannot join, and of dpgan's critic): they test
  the noise and the accounting, not the clipping. The trial logs which (``audit_engine_canaries``).
* ``direction``: ``dirac`` (default) or ``random`` (white-box, inserted only); ``statistic``:
  ``llr`` (default) or ``sum`` (white-box only).
* ``guess_fraction``: fraction of the canaries guessed, half "in" (highest scores), half "out"
  (default 0.2, as ``audit_guess_fraction``).

The flat keys shipped before (``audit_canaries``, ``audit_guess_fraction``, ``audit_beta``) stay:
they are the black-box audit ``{mode: blackbox, canaries: audit_canaries, estimator: steinke,
confidence: 1 - audit_beta, guess_fraction: audit_guess_fraction}``. Giving ``audit`` together
with any of them at a value other than its default is refused (one statement of the audit, not
two to reconcile).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

FLAT_KEYS = ("audit_canaries", "audit_guess_fraction", "audit_beta")
# the trainables whose mechanism is the DP-SGD engine's own step (its per-example loss, its
# clipping): engine canaries are their default; the others that allow a white-box audit use inserted
ENGINE_CANARY_SCHEMAS = ("DPSGDTrialConfig", "SecureSGDTrialConfig")


class AuditSettings(BaseModel):
    """The fields of the ``audit`` mapping (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["whitebox", "blackbox"]
    canaries: int = Field(gt=0)
    estimator: list[Literal["steinke", "fdp", "gdp"]] = Field(default_factory=lambda: ["steinke", "fdp", "gdp"])
    confidence: float = Field(0.95, gt=0, lt=1)
    canary: Literal["engine", "inserted"] | None = None
    direction: Literal["dirac", "random"] = "dirac"
    statistic: Literal["llr", "sum"] = "llr"
    guess_fraction: float = Field(0.2, gt=0, le=1)

    @field_validator("estimator", mode="before")
    @classmethod
    def _one_or_list(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("estimator")
    @classmethod
    def _rigorous_first(cls, value):
        if not value or len(set(value)) != len(value):
            raise ValueError(f"give one or more distinct estimators, got {value}")
        if not any(e in ("steinke", "fdp") for e in value):
            raise ValueError("'gdp' is an estimate, not a lower bound: include 'steinke' or 'fdp' (the first of them "
                             "gives audit_epsilon_lb)")
        return value

    @property
    def beta(self) -> float:
        return round(1.0 - self.confidence, 12)   # 0.05 for 0.95, not 0.050000000000000044


def parse(value: dict) -> dict:
    """The ``audit`` mapping checked and completed with its defaults (a plain dict, so the trial
    config stays JSON); a one-line ValueError naming ``audit.<field>`` otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"must be a mapping such as {{mode: whitebox, canaries: 1000}}, got {value!r}")
    try:
        return AuditSettings(**value).model_dump()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or "audit"
        raise ValueError(f"{where}: {err['msg']}") from None


def settings(cfg) -> AuditSettings | None:
    """The trial's audit (None: no audit): the ``audit`` mapping, or the flat keys' black-box audit."""
    if getattr(cfg, "audit", None):
        return AuditSettings(**cfg.audit)
    if getattr(cfg, "audit_canaries", 0):
        return AuditSettings(mode="blackbox", canaries=cfg.audit_canaries, estimator=["steinke"],
                             confidence=1.0 - cfg.audit_beta, guess_fraction=cfg.audit_guess_fraction)
    return None


def check(cfg) -> None:
    """The combination rules (called by ``CommonConfig``'s validator): the mapping or the flat
    keys, not both; white-box only where the trainable runs the DP-SGD engine."""
    if not getattr(cfg, "audit", None):
        return
    # a full config (a sweep's trials carry every key) holds the flat keys at their defaults: only a
    # value other than the default states a second audit
    fields = type(cfg).model_fields
    flat = [k for k in FLAT_KEYS if getattr(cfg, k) != fields[k].default]
    if flat:
        raise ValueError(f"audit: give the audit mapping or the flat keys ({', '.join(flat)}), not both "
                         "(the flat keys are the black-box audit; docs/audit.md)")
    if cfg.audit["mode"] == "whitebox" and not getattr(type(cfg), "supports_whitebox_audit", False):
        raise ValueError("audit: mode 'whitebox' inserts gradient canaries into the DP-SGD engine; this trainable "
                         "does not train with it (dpsgd, dpal_sound, secure_sgd and dpgan's critic do); use mode "
                         "'blackbox'")
    if cfg.audit["mode"] == "whitebox" and "epsilon" in type(cfg).model_fields and cfg.epsilon is None:
        raise ValueError("audit: mode 'whitebox' needs a private trial; epsilon null is the non-private baseline "
                         "(no clipping, no noise: nothing for gradient canaries to audit)")
    if cfg.audit["mode"] != "whitebox":
        if cfg.audit.get("canary") is not None:
            raise ValueError("audit.canary: only a white-box audit has gradient canaries (mode 'whitebox')")
        return
    engine_ok = type(cfg).__name__ in ENGINE_CANARY_SCHEMAS
    if cfg.audit.get("canary") is None:        # completed here, so the trial's params say which kind ran
        cfg.audit["canary"] = "engine" if engine_ok else "inserted"
    if cfg.audit["canary"] == "engine" and not engine_ok:
        raise ValueError("audit.canary: 'engine' canaries are rows of the DP-SGD engine's own batch and loss; this "
                         "trainable computes its own per-example losses or is not that engine: use 'inserted'")
    if cfg.audit["canary"] == "engine" and cfg.audit["direction"] != "dirac":
        raise ValueError("audit.direction: engine canaries are Dirac (a coordinate of an nn.Linear weight); "
                         "'random' directions are for canary 'inserted'")


def whitebox_canaries(cfg):
    """The canaries of a trial with a white-box audit (None otherwise): ``EngineCanaries`` or
    inserted ``WhiteBoxCanaries`` (``audit.canary``), seeded from the trial's seed (a restored
    trial has the same canaries)."""
    s = settings(cfg)
    if s is None or s.mode != "whitebox":
        return None
    from dpmech.privacy.audit.whitebox import EngineCanaries, WhiteBoxCanaries

    if (s.canary or "inserted") == "engine":
        return EngineCanaries(s.canaries, seed=cfg.seed, statistic=s.statistic)
    return WhiteBoxCanaries(s.canaries, seed=cfg.seed, direction=s.direction, statistic=s.statistic)


def metric_names(audit: dict | None, audit_canaries: int = 0) -> set[str]:
    """The final metrics an audit reports (for ``search.metric`` checks), from the raw config."""
    if audit:
        names = audit.get("estimator", ["steinke", "fdp", "gdp"])
        names = [names] if isinstance(names, str) else list(names)
        out = {"audit_epsilon_lb", "audit_claim", "audit_ratio", "audit_correct", "audit_guesses", "audit_delta"}
        if audit.get("mode") == "whitebox":
            out |= {"audit_steps", "audit_engine_canaries"}
        if "steinke" in names:
            out.add("audit_epsilon_lb_steinke")
        if "fdp" in names:
            out |= {"audit_epsilon_lb_fdp", "audit_mu_lb_fdp", "audit_epsilon_gaussian_fdp"}
        if "gdp" in names:
            out |= {"audit_epsilon_est_gdp", "audit_mu_est_gdp"}
        return out
    if audit_canaries:
        return {"epsilon_lower_bound", "audit_correct", "audit_guesses", "audit_epsilon_lb",
                "audit_epsilon_lb_steinke", "audit_claim", "audit_ratio", "audit_delta"}
    return set()
