"""The secret that a run's privacy-critical randomness is drawn from (docs/threat_model.md).

A DP guarantee is a statement about the distribution of the noise: it holds against an adversary
who does not know the noise that was drawn. dpsweep publishes every trial's ``seed`` (it is an
MLflow param, it is in the specs, the benchmark files quote it), so noise derived from that seed
is known to anyone who reads a release: retraining both neighbouring datasets with the same
draws and comparing with the released weights decides membership with certainty.

So the draws a guarantee rests on (Poisson sampling, Gaussian and Laplace noise, randomized
response, the tuning's number of candidates) come from a :class:`NoiseKey`: 256 bits from the
operating system's entropy (``secrets.token_bytes``), which nothing published carries. Each
random stream of a run is seeded by ``HMAC-SHA256(key, stream name)`` truncated to 63 bits (the
seed width of ``torch.Generator``); a sweep derives one key per trial from its own key and the
trial's identity (``derive``), so the trials' noises are independent and the owner, who keeps
the sweep's key, can reproduce or resume any trial.

``NoiseKey.reproducible(seed)`` is the research mode: every stream is seeded by the public
derivation the caller names (the project's earlier behaviour, so earlier figures replay bit for
bit). Its epsilons are labelled: there is no guarantee against anyone who knows the seed.

What is not covered (docs/threat_model.md): ``torch.Generator`` is Mersenne Twister on the CPU
and Philox on CUDA, not a cryptographically secure generator; an adversary who observed raw
draws could predict others (a release holds none, only the trained weights). Floating-point
attacks on the Gaussian and Laplace samplers (Mironov 2012; Jin et al. 2022) are not mitigated.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import numpy as np
import torch

KEY_BYTES = 32
REPRODUCIBLE_LABEL = "reproducible noise: no guarantee against anyone who knows the seed"


class NoiseKey:
    """A secret key (or, in the research mode, a public seed) for the draws a guarantee rests on.

    ``stream_seed(name, public)`` gives the 63-bit seed of one stream: from the key
    (``HMAC-SHA256(key, name)``), or ``public`` in the research mode. Never printed: ``repr``
    shows no key material; ``hex()`` is the one explicit way for the owner to keep it.
    """

    __slots__ = ("_key", "_public_seed")

    def __init__(self, key: bytes | None = None, *, public_seed: int | None = None):
        if (key is None) == (public_seed is None):
            raise ValueError("NoiseKey: give a secret key (bytes) or, for the research mode, a public seed")
        if key is not None and (not isinstance(key, bytes) or len(key) < 16):
            raise ValueError(f"NoiseKey: the key must be at least 16 bytes, got {type(key).__name__}")
        self._key = key
        self._public_seed = None if public_seed is None else int(public_seed)

    # ------------------------------------------------------------------ construction
    @classmethod
    def fresh(cls) -> "NoiseKey":
        """256 bits from the operating system's entropy."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> "NoiseKey":
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError("NoiseKey: the key file holds no hex key") from None
        return cls(key)

    @classmethod
    def reproducible(cls, seed: int) -> "NoiseKey":
        """The research mode: every stream seeded by its public derivation from ``seed``."""
        return cls(public_seed=seed)

    @classmethod
    def resolve(cls, key: "NoiseKey | None") -> "NoiseKey":
        """``key``, or a fresh secret key when None (a library call without a key is private)."""
        if key is None:
            return cls.fresh()
        if not isinstance(key, cls):
            raise ValueError(f"noise_key must be a dpmech.privacy.secret.NoiseKey, got {type(key).__name__}")
        return key

    # ------------------------------------------------------------------ use
    @property
    def reproducible_mode(self) -> bool:
        """True when the draws follow from a public seed (no guarantee against who knows it)."""
        return self._key is None

    def hex(self) -> str:
        if self._key is None:
            raise ValueError("NoiseKey: a reproducible key has no secret to export")
        return self._key.hex()

    def _mac(self, label: str) -> bytes:
        return hmac.new(self._key, label.encode(), hashlib.sha256).digest()

    def derive(self, label: str) -> "NoiseKey":
        """An independent child key (a trial's key from the sweep's key and the trial's identity)."""
        if self._key is None:
            return self
        return NoiseKey(self._mac("derive:" + label))

    def stream_seed(self, name: str, public: int) -> int:
        """The 63-bit seed of stream ``name``: HMAC of the key, or ``public`` in the research mode."""
        if self._key is None:
            return int(public)
        return int.from_bytes(self._mac("stream:" + name)[:8], "big") >> 1

    def generator(self, name: str, public: int, device: str | torch.device = "cpu") -> torch.Generator:
        """A ``torch.Generator`` on ``device`` seeded with ``stream_seed(name, public)``."""
        return torch.Generator(device=device).manual_seed(self.stream_seed(name, public))

    def numpy_rng(self, name: str, public) -> np.random.Generator:
        """A numpy Generator for stream ``name`` (``public``: the research mode's seed or seed list)."""
        if self._key is None:
            return np.random.default_rng(public)
        return np.random.default_rng(self.entropy(name, 0))

    def entropy(self, name: str, public: int) -> int:
        """A 256-bit integer for stream ``name`` (a numpy seed; ``public`` in the research mode)."""
        if self._key is None:
            return int(public)
        return int.from_bytes(self._mac("stream:" + name), "big")

    def label(self) -> str:
        """What an epsilon computed with this key's draws means ("" when it is a guarantee)."""
        return REPRODUCIBLE_LABEL if self._key is None else ""

    def __repr__(self) -> str:
        if self._key is None:
            return f"NoiseKey(reproducible from public seed {self._public_seed})"
        return "NoiseKey(<secret>)"

    def __eq__(self, other) -> bool:
        return (isinstance(other, NoiseKey) and self._public_seed == other._public_seed
                and hmac.compare_digest(self._key or b"", other._key or b""))

    def __hash__(self) -> int:
        return hash((self._public_seed, self._mac("hash") if self._key else None))
