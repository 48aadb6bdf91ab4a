"""A membership inference attack inside a trial (the ``mia`` key; docs/mia.md, "In a sweep").

``run_trial`` calls :func:`mia_trial` before it builds the mechanism and, after the evaluation and
the audit, :meth:`MiaTrial.run`:

1. **The game.** The trial's held-out training images (the training split outside its ``train_size``
   subset, ``dpmech.datasets.splits.load_held_out``) are permuted by the public ``data_seed``: the
   first ``mia.candidates`` are the candidate pool, the rest the population. Each candidate's coin
   comes from the trial's own secret key (``noise_key.generator("mia.membership", seed)``, the stream
   the trial's sampling and noise come from; the research mode's public seed with ``noise_source:
   seed``), so no attacker and no published file sees the membership.
2. **The target** trains on the trial's fixed training subset plus the members; its DP sampling is
   planned from ``train_size + candidates // 2`` (``planned_train_size``: the public expected count,
   never the drawn one), and its epsilon is the ledger's, computed from what ran.
3. **Reference models** (``dpmech.privacy.mia.ReferenceModels``) train by the trial's own recipe
   (its mechanism, its epsilon, its epochs; the same plan size) on the fixed subset plus
   ``candidates // 2`` population images, from public seeds (``data_seed``; their noise from the
   research mode's public key: they are the attacker's models and are never released). They are
   cached on disk under ``$DPSWEEP_CACHE/mia`` (default ``~/.cache/dpsweep/mia``) by their cache key
   (:class:`ReferenceCache`: owner-only files, ``torch.load(weights_only=True)``, a file lock per key
   so two workers never train the same one), so every trial that matches shares them: trials that
   differ in ``seed``, ``noise_source``, the attack, the audit or the evaluation keys do.
4. **The attack** (``run_attack``) after training; the trial logs ``result.metrics()`` (``mia_auc``,
   ``mia_tpr_at_fpr_0.001``, ``mia_tpr_at_fpr_0.01``, ``mia_eps_lb``, their intervals and the settings)
   and the cost (``mia_reference_seconds``, ``mia_references_cached``, ``mia_attack_seconds``); names
   in docs/metrics.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import MutableMapping
from pathlib import Path

import torch

from trainables.mia_config import settings

# the config keys that do not change how a reference model trains (evaluation, audit, secrecy of the
# target's noise, which attack reads them): dropped from the recipe so that such trials share them
_NOT_RECIPE = ("seed", "noise_source", "diagnostics", "audit", "audit_canaries", "audit_guess_fraction", "audit_beta",
               "attacks", "attack_norm", "attack_steps", "attack_labels", "eot_samples", "n_predict", "certify_n",
               "certify_eta", "certify_bounds", "certify_images", "certify_sizes", "certifier", "smoothing_n0",
               "smoothing_alpha", "test_size", "selection_split", "selection_size", "mia")


def cache_dir() -> Path:
    """``$DPSWEEP_CACHE/mia``, default ``~/.cache/dpsweep/mia``."""
    root = os.environ.get("DPSWEEP_CACHE") or Path.home() / ".cache" / "dpsweep"
    return Path(root) / "mia"


class ReferenceCache(MutableMapping):
    """Reference models on disk, one ``<key>.pt`` (the state dict) and ``<key>.json`` (what made it)
    per cache key, in an owner-only folder. ``key in cache`` takes the key's file lock and keeps it
    when the model is absent, until ``cache[key] = model`` stores it (or :meth:`close`): a second
    worker asking for the same key waits and then loads the first one's model instead of training
    its own. A file that does not load (torn, stale) is deleted and the model trained again.

    ``load_model(state_dict) -> model`` rebuilds a model from its weights (read with
    ``torch.load(weights_only=True)``); ``describe`` is written beside each model."""

    def __init__(self, directory: Path, load_model, describe: dict | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self.load_model = load_model
        self.describe = describe or {}
        self._locks: dict[str, int] = {}
        self._loaded: dict = {}
        self.hits = 0
        self.stored = 0

    def _path(self, key: str, suffix: str) -> Path:
        if not (isinstance(key, str) and key.isalnum()):
            raise KeyError(key)
        return self.dir / f"{key}{suffix}"

    def _lock(self, key: str) -> None:
        if key in self._locks:
            return
        fd = os.open(self._path(key, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._locks[key] = fd

    def _unlock(self, key: str) -> None:
        fd = self._locks.pop(key, None)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __contains__(self, key) -> bool:
        if key in self._loaded:
            return True
        self._lock(key)
        path = self._path(key, ".pt")
        if path.exists():
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
                self._loaded[key] = self.load_model(state)
                self.hits += 1
                self._unlock(key)
                return True
            except Exception:  # noqa: BLE001 - a torn or stale file: trained again
                path.unlink(missing_ok=True)
        return False            # the lock stays until the model is stored (or close())

    def __getitem__(self, key):
        if key in self._loaded or self.__contains__(key):
            return self._loaded[key]
        self._unlock(key)
        raise KeyError(key)

    def _write(self, path: Path, write) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)

    def __setitem__(self, key, model) -> None:
        self._lock(key)
        try:
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            self._write(self._path(key, ".pt"), lambda f: torch.save(state, f))
            meta = json.dumps({"key": key, **self.describe, "stored": time.strftime("%Y-%m-%dT%H:%M:%S")},
                              sort_keys=True, default=str)
            self._write(self._path(key, ".json"), lambda f: f.write(meta.encode()))
            self._loaded[key] = model
            self.stored += 1
        finally:
            self._unlock(key)

    def __delitem__(self, key) -> None:
        self._loaded.pop(key, None)
        for suffix in (".pt", ".json"):
            self._path(key, suffix).unlink(missing_ok=True)

    def __iter__(self):
        return iter(sorted(p.stem for p in self.dir.glob("*.pt")))

    def __len__(self) -> int:
        return sum(1 for _ in self.dir.glob("*.pt"))

    def close(self) -> None:
        """Release every lock still held (a training that raised)."""
        for key in list(self._locks):
            self._unlock(key)


def _recipe(cfg) -> dict:
    dumped = cfg.model_dump(mode="json")
    recipe = {k: v for k, v in dumped.items() if k not in _NOT_RECIPE}
    recipe["mia.candidates"] = cfg.mia["candidates"]     # the plan size (train_size + candidates // 2)
    recipe["dpsweep.mia.reference"] = 1
    return recipe


class MiaTrial:
    """The trial's membership game and, after training, its attack (module docstring)."""

    def __init__(self, cfg, x, y, device, noise_key, mechanism_cls):
        from dpmech.datasets.splits import load_held_out
        from dpmech.privacy.mia.game import MembershipGame
        from dpmech.privacy.mia.references import rows_in

        self.cfg, self.device, self.mechanism_cls = cfg, device, mechanism_cls
        self.settings = s = settings(cfg)
        pool = load_held_out(cfg.dataset, train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.data_seed)
        px, py = pool.tensors
        perm = torch.randperm(px.shape[0], generator=torch.Generator().manual_seed(int(cfg.data_seed) * 7907 + 52))
        cand, rest = perm[:s.candidates].sort().values, perm[s.candidates:].sort().values
        cx, cy = px[cand], py[cand]
        # the population must be disjoint from the candidates: drop a rest image equal to a candidate (duplicates)
        keep = torch.from_numpy(~rows_in(px[rest], cx))
        self.population = (px[rest[keep]], py[rest[keep]])
        # the coins: the trial's own secret stream (never the public seed's, unless noise_source: seed)
        self.game = MembershipGame(cx, cy, generator=noise_key.generator("mia.membership", int(cfg.seed)))
        self.fixed = (x, y)

    def training_data(self):
        """The target's training set: the fixed subset, then the members."""
        mx, my = self.game.members()
        x, y = self.fixed
        return torch.cat([x, mx.to(x.device, x.dtype)]), torch.cat([y, my.to(y.device, y.dtype)])

    def _mechanism(self, x, y, seed: int):
        from dpmech.privacy.secret import NoiseKey
        from trainables.build import build_mechanism

        rcfg = self.cfg.model_copy(update={"seed": int(seed), "audit": None})
        return build_mechanism(self.mechanism_cls, rcfg, x, y, self.device, NoiseKey.reproducible(int(seed)))

    def _train_reference(self, px, py, seed):
        x, y = self.fixed
        mech = self._mechanism(torch.cat([x, px.to(x.device, x.dtype)]), torch.cat([y, py.to(y.device, y.dtype)]),
                               seed)
        while mech.epoch < self.cfg.epochs:
            mech.train_epoch()
        return mech.model

    def _load_reference(self, state: dict):
        mech = self._mechanism(*self.fixed, 0)
        mech.model.load_state_dict(state)
        return mech.model

    def run(self, mech, metrics: dict) -> dict[str, float]:
        """The attack on the trained ``mech.model``: the ``mia_*`` metrics (docs/metrics.md)."""
        from dpmech.privacy.mia.attacks import run_attack
        from dpmech.privacy.mia.references import ReferenceModels

        s, cfg = self.settings, self.cfg
        recipe = _recipe(cfg)
        refs = ReferenceModels(self._train_reference, *self.population, count=s.references,
                               train_size=self.game.expected_members, num_z=s.num_z, architecture=str(cfg.model),
                               recipe=recipe, seed=int(cfg.data_seed))
        cache = ReferenceCache(cache_dir(), self._load_reference,
                               describe={"architecture": str(cfg.model), "recipe": recipe, "trainable": "dpsgd"})
        refs.cache = cache
        t0 = time.perf_counter()
        try:
            refs.models()
        finally:
            cache.close()
        t1 = time.perf_counter()
        delta = float(metrics.get("delta", getattr(cfg, "delta", 0.0)))
        result = run_attack(self.game, mech.model, refs, attack=s.attack, delta=delta, confidence=s.confidence)
        out = {k: float(v) for k, v in result.metrics().items()}
        out.update({"mia_num_z": float(s.num_z), "mia_attack_rmia": 1.0 if s.attack == "rmia" else 0.0,
                    "mia_references_cached": float(cache.hits),
                    "mia_reference_seconds": round(t1 - t0, 3),
                    "mia_attack_seconds": round(time.perf_counter() - t1, 3)})
        return out


def mia_trial(cfg, x, y, device, noise_key, mechanism_cls) -> MiaTrial | None:
    """The trial's :class:`MiaTrial`, or None without ``mia``."""
    if settings(cfg) is None:
        return None
    return MiaTrial(cfg, x, y, device, noise_key, mechanism_cls)
