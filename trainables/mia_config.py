"""The ``mia`` trial key: a membership inference attack on the trial's own model (docs/mia.md, "In a sweep").

    mia: {attack: rmia, references: 2, candidates: 1000, num_z: 1000, confidence: 0.95}

* ``attack``: ``rmia`` (offline RMIA, Zarifzadeh et al. 2024) or ``lira`` (offline LiRA, Carlini et
  al. 2022); required.
* ``references``: reference models, 1 to 4 (default 2); trained once per (population, recipe) and
  shared through the disk cache ``$DPSWEEP_CACHE/mia`` (trainables.mia_trial).
* ``candidates``: the pool of the membership game, M >= 4 (default 1000): images of the training split
  outside the trial's training subset; each joins the training set by a fair coin from the trial's
  secret noise key.
* ``num_z``: RMIA's population comparison samples (default 1000; LiRA ignores them, they are held
  back all the same so that the two attacks share their references).
* ``confidence``: 1 - beta of the intervals and of ``mia_eps_lb`` (default 0.95).

Trainables that accept it say so with the class attribute ``supports_mia`` and a ``mia`` field
(dpsgd); on any other, the key is refused in one line (``CommonConfig._mia_elsewhere``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MIA_MAX_REFERENCES = 4


class MiaSettings(BaseModel):
    """The fields of the ``mia`` mapping (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attack: Literal["rmia", "lira"]
    references: int = Field(2, ge=1, le=MIA_MAX_REFERENCES)
    candidates: int = Field(1000, ge=4)
    num_z: int = Field(1000, gt=0)
    confidence: float = Field(0.95, gt=0, lt=1)

    @property
    def expected_members(self) -> int:
        """n // 2: the public number the DP sampling is planned from (MembershipGame.expected_members)."""
        return self.candidates // 2


def parse(value) -> dict:
    """The ``mia`` mapping checked and completed with its defaults (a plain dict, so the config stays
    JSON); a one-line ValueError naming ``mia.<field>`` and the rule otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"mia: must be a mapping such as {{attack: rmia, references: 2, candidates: 1000}}, "
                         f"got {value!r}")
    try:
        return MiaSettings(**value).model_dump()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
        return _raise(f"mia.{where}" if where else "mia", err["msg"])


def _raise(where: str, msg: str):
    raise ValueError(f"{where}: {msg}") from None


def settings(cfg) -> MiaSettings | None:
    value = getattr(cfg, "mia", None)
    return MiaSettings(**value) if value else None


def expected_members(cfg) -> int:
    """Training examples the attack's members add to the privacy plan (0 without ``mia``)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    value = get("mia")
    return MiaSettings(**value).expected_members if value else 0


def check(cfg) -> None:
    """The rules that involve other keys (called by the schema's validator): a training subset that
    leaves room for the candidates, the comparison samples and the references' population; no
    black-box audit beside it (its canaries come from the same held-out images)."""
    s = settings(cfg)
    if s is None:
        return
    from dpmech.datasets.splits import train_split_size

    audit = getattr(cfg, "audit", None) or {}
    if audit.get("mode") == "blackbox" or getattr(cfg, "audit_canaries", 0):
        raise ValueError("mia: not with a black-box audit (its canaries are drawn from the same held-out training "
                         "images as the candidates); use audit mode whitebox")
    if getattr(cfg, "selection_split", "none") == "validation":
        raise ValueError("mia: not with selection_split validation (both carve images out of the training split); "
                         "use selection_split test_half")
    total = train_split_size(cfg.dataset)
    need = s.candidates + s.num_z + s.expected_members
    if cfg.train_size is None or cfg.train_size + need > total:
        have = "all of them" if cfg.train_size is None else f"{cfg.train_size}"
        raise ValueError(f"mia: the candidates ({s.candidates}), RMIA's num_z ({s.num_z}) and the reference models' "
                         f"population ({s.expected_members}) come from the {total} training images the trial does not "
                         f"train on; train_size is {have}: set train_size <= {total - need}")


def refuse_elsewhere(data, schema_name: str):
    """A schema without a ``mia`` field: the key refused in one line that names the rule."""
    if isinstance(data, dict) and data.get("mia") is not None:
        raise ValueError("mia: the membership inference attack runs on DP-SGD trials (trainable dpsgd), which train "
                         f"their target on the candidates' members; {schema_name} has no mia key")
    return data
