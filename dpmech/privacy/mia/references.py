"""Reference models for the offline attacks (docs/mia.md, "Reference models").

Offline RMIA and offline LiRA compare the target's output on a candidate with the outputs of
*reference models* that were certainly not trained on it ("OUT" models). Here they are trained on
**population data disjoint from the candidates** (checked row by row), so every reference model is OUT
for every candidate, and none of them ever sees the game or its membership draw:

* ``population`` is split once, by the public ``seed``, into ``num_z`` comparison samples z (RMIA's
  population, used by no reference model) and a pool; reference model k trains on ``train_size``
  examples drawn from the pool by ``seed`` and k (set ``train_size`` to the target's expected training-set
  size, ``MembershipGame.expected_members``, as the papers do).
* The caller's ``train_fn(x, y, seed) -> model`` trains one (the same function, DP-SGD or not, that the
  target's recipe uses; ``seed`` is public and derived from ``seed`` and k), and returns a callable
  model (inputs -> logits).
* Each model has a cache key (:func:`reference_key`): SHA-256 of its training data's bytes, the
  architecture's and the recipe's descriptions and its seed. Two trials with the same population,
  architecture and recipe get the same keys, so a sweep can hand both the same ``cache`` (any mapping
  from key to model) and train the references once.

Why they are charged to nobody's privacy: a reference model is a function of the population data and
public seeds only. The population is the attacker's own data (in a sweep: a held-out part of the split
that no released model trains on), disjoint from the candidates and from the target's training set;
the references are never released. So no example of the target's training set (and no membership
coin) enters them, and the target's privacy ledger is unchanged by the audit; if the population were
private data of its own, its owner would have to account for it -- nothing here releases it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, MutableMapping

import numpy as np
import torch

from dpmech import _validate as v
from dpmech.privacy.mia.game import _TargetOracle


def _tensor_digest(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.numpy().tobytes())


def _canonical(name: str, value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: must be a string or a JSON-serialisable mapping ({exc})") from None


def reference_key(x: torch.Tensor, y: torch.Tensor, *, architecture, recipe, seed: int) -> str:
    """The cache key of one reference model: SHA-256 (hex) of its training data (shape, dtype and
    bytes of ``x`` and ``y``), ``architecture`` and ``recipe`` (strings, or JSON-serialisable
    mappings, canonicalised with sorted keys) and its training ``seed``. Equal keys name models
    trained on the same data by the same recipe from the same seed."""
    h = hashlib.sha256(b"dpmech.mia.reference.v1\0")
    _tensor_digest(h, x)
    _tensor_digest(h, y)
    for name, value in (("architecture", architecture), ("recipe", recipe)):
        text = _canonical(name, value)
        h.update(f"{name}:{len(text)}:{text}\0".encode())
    h.update(f"seed:{int(seed)}".encode())
    return h.hexdigest()


def _seed(seed: int, *path: int) -> int:
    return int(np.random.SeedSequence([int(seed), *path]).generate_state(1, np.uint32)[0])


def _row_words(x: torch.Tensor) -> np.ndarray:
    """The rows of ``x`` as unsigned words (its bytes, reinterpreted: equal rows, equal words)."""
    flat = np.ascontiguousarray(x.detach().cpu().contiguous().reshape(x.shape[0], -1).numpy())
    raw = flat.view(np.uint8).reshape(flat.shape[0], -1)
    return raw.view(np.uint32) if raw.shape[1] % 4 == 0 else raw


def _row_keys(words: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """A 64-bit key per row: the sum of its words times fixed odd weights, mod 2^64 (exact integer
    arithmetic, so equal rows get equal keys whatever the order of the sum); chunked to bound memory."""
    w = np.random.default_rng(52).integers(1, 2 ** 63, size=words.shape[1], dtype=np.uint64) | np.uint64(1)
    out = np.empty(words.shape[0], dtype=np.uint64)
    for i in range(0, words.shape[0], chunk):
        out[i:i + chunk] = (words[i:i + chunk].astype(np.uint64) * w).sum(axis=1, dtype=np.uint64)
    return out


def rows_in(x: torch.Tensor, other: torch.Tensor) -> np.ndarray:
    """Boolean mask over the rows of ``x``: True where the row equals some row of ``other`` byte for
    byte. Vectorised keys (``_row_keys``) find the candidates; each hit is confirmed by comparing the
    bytes, so a key collision is never taken for a duplicate."""
    a, b = _row_words(x), _row_words(other)
    if a.shape[1:] != b.shape[1:]:
        return np.zeros(a.shape[0], dtype=bool)
    ka, kb = _row_keys(a), _row_keys(b)
    hit = np.isin(ka, kb)
    if hit.any():
        index: dict[int, list[int]] = {}
        for j in np.flatnonzero(np.isin(kb, ka[hit])):
            index.setdefault(int(kb[j]), []).append(int(j))
        for i in np.flatnonzero(hit):
            hit[i] = any(np.array_equal(a[i], b[j]) for j in index.get(int(ka[i]), ()))
    return hit


class ReferenceModels:
    """``count`` reference models trained by ``train_fn`` on population data (module docstring).

    ``models()`` trains them (or takes them from ``cache``); ``logits(x)`` is [count, n, classes];
    ``z_x``, ``z_y`` are the comparison samples; ``keys`` their cache keys.
    """

    def __init__(self, train_fn: Callable, population_x: torch.Tensor, population_y: torch.Tensor, *,
                 count: int, train_size: int, num_z: int, architecture, recipe, seed: int = 0,
                 cache: MutableMapping | None = None, batch_size: int = 1024):
        if not callable(train_fn):
            raise ValueError(f"train_fn must be callable (x, y, seed) -> model, got {type(train_fn).__name__}")
        if (not torch.is_tensor(population_x) or not torch.is_tensor(population_y) or population_x.dim() < 2
                or population_y.dim() != 1 or population_x.shape[0] != population_y.shape[0]):
            raise ValueError("population: x must be a tensor [N, ...] and y a tensor [N] of labels")
        self.count = v.positive_int("references", count)
        self.train_size = v.positive_int("train_size", train_size)
        self.num_z = v.positive_int("num_z", num_z)
        seed = v.positive_int("seed", seed, minimum=0)
        total = population_x.shape[0]
        if self.num_z + self.train_size > total:
            raise ValueError(f"population: {total} examples cannot give num_z = {self.num_z} comparison samples and a "
                             f"disjoint pool of train_size = {self.train_size} for the reference models")
        if cache is not None and not isinstance(cache, MutableMapping):
            raise ValueError(f"cache must be a mapping (key -> model), got {type(cache).__name__}")
        _canonical("architecture", architecture)
        _canonical("recipe", recipe)
        self.train_fn = train_fn
        self.cache = cache
        self.batch_size = v.positive_int("batch_size", batch_size)
        self.population_x = population_x.detach()
        self.population_y = population_y.detach()
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(_seed(seed, 0)))
        self.z_x = self.population_x[perm[:self.num_z]]
        self.z_y = self.population_y[perm[:self.num_z]]
        pool = perm[self.num_z:]
        self._subsets = []
        self.seeds = []
        self.keys = []
        for k in range(self.count):
            pick = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(_seed(seed, 1, k)))
            idx = pool[pick[:self.train_size]].sort().values
            self._subsets.append(idx)
            self.seeds.append(_seed(seed, 2, k))
            self.keys.append(reference_key(self.population_x[idx], self.population_y[idx],
                                           architecture=architecture, recipe=recipe, seed=self.seeds[-1]))
        self._models = None
        self._z_logits = None

    def training_set(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference model k's training data (population examples only)."""
        idx = self._subsets[k]
        return self.population_x[idx], self.population_y[idx]

    def models(self) -> list:
        """The reference models: from ``cache`` where their key is there, else trained (and stored)."""
        if self._models is None:
            out = []
            for k in range(self.count):
                key = self.keys[k]
                if self.cache is not None and key in self.cache:
                    out.append(self.cache[key])
                    continue
                x, y = self.training_set(k)
                with torch.enable_grad():       # a caller's no_grad must not silently stop training
                    model = self.train_fn(x.clone(), y.clone(), self.seeds[k])
                if not callable(model):
                    raise ValueError(f"train_fn must return a callable model (inputs -> logits), got "
                                     f"{type(model).__name__}")
                if self.cache is not None:
                    self.cache[key] = model
                out.append(model)
            self._models = out
        return self._models

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[count, n, classes]: every reference model's logits on ``x`` (eval mode)."""
        return torch.stack([_TargetOracle(m, self.batch_size)(x) for m in self.models()])

    def z_logits(self) -> torch.Tensor:
        """[count, num_z, classes]: the reference models' logits on the comparison samples (computed once)."""
        if self._z_logits is None:
            self._z_logits = self.logits(self.z_x)
        return self._z_logits

    def check_disjoint(self, x: torch.Tensor) -> None:
        """Refuse candidates that equal a population example (byte for byte): a reference model trained
        on a candidate would not be OUT for it, and RMIA's z would not be a non-member."""
        if x.shape[1:] != self.population_x.shape[1:]:
            raise ValueError(f"population: its examples have shape {tuple(self.population_x.shape[1:])}, the "
                             f"candidates' {tuple(x.shape[1:])}")
        shared = int(rows_in(x, self.population_x).sum())
        if shared:
            raise ValueError(f"population: {shared} candidate(s) also appear in the population data; the reference "
                             "models and the comparison samples must be disjoint from the candidates")
