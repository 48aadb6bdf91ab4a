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

**Per-step streams** (:class:`StepStream`, issue 48): a trainer that draws at every step (Poisson
sampling, gradient noise, randomized response at a stage) asks its stream for "the generator of step
t"; with a secret key that generator is seeded by ``HMAC-SHA256(key, "step", stream name, t)``
truncated to 63 bits, so each step's draws are a function of (key, step) only, and a checkpoint
needs to hold the step counter, never a generator state (DESIGN.md, Conventions: "nothing stored
beside a run may stand in for the secret (a checkpoint holds the step, not a generator state)").
A CPU generator's state holds its seed and its next draws: a checkpoint that held it let anyone
who read the checkpoint continue the run on both neighbouring datasets and decide membership (the
review of issue 48). In the research mode a stream is one running generator seeded from the public
seed, as before, and its state is checkpointed (it is public anyway; earlier figures replay).

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
CHECK_FIELD = "noise_key_check"   # a checkpoint's fingerprint of the key that drew its once-drawn noise


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

    def step_seed(self, name: str, step: int) -> int:
        """The 63-bit seed of stream ``name`` at step ``step`` (secret mode only): HMAC of the key, the
        stream's name and the step, unambiguously encoded."""
        if self._key is None:
            raise ValueError("NoiseKey: the research mode has no per-step seeds (its streams run on from the "
                             "public seed)")
        step = int(step)
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        return int.from_bytes(self._mac(f"step:{len(name)}:{name}:{step}")[:8], "big") >> 1

    def step_stream(self, name: str, public: int, device: str | torch.device = "cpu") -> "StepStream":
        """The :class:`StepStream` of ``name`` (``public``: the research mode's seed of the stream)."""
        return StepStream(self, name, public, device)

    def fingerprint(self, label: str) -> str:
        """A check value of the key for ``label`` (128 bits of ``HMAC-SHA256(key, "fingerprint:" label)``,
        hex): a checkpoint stores it so that a resume with another key is refused where drawing afresh
        would release a once-drawn noise a second time (DPAL, AdLM). A PRF output: it tells nothing
        about the key or its streams. The research mode's is ``"reproducible"``."""
        if self._key is None:
            return "reproducible"
        return self._mac("fingerprint:" + label)[:16].hex()

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


class StepStream:
    """One random stream of a trainer, asked for "the generator of step t" (module docstring).

    * Secret key: :meth:`at` reseeds the stream's generator with ``key.step_seed(name, t)`` at the
      first request for step t; later requests at the same step go on drawing from it (a step may
      draw several times). The draws of step t are a function of (key, name, t) only, so resuming
      at step t needs the step counter alone: :meth:`state_dict` is None.
    * Research mode (``NoiseKey.reproducible``): one running generator seeded with ``public`` (the
      earlier behaviour, bit for bit), whatever the step; :meth:`state_dict` is its state.

    :attr:`generator` is the one ``torch.Generator`` object, reseeded in place, so a component that
    holds it (Opacus's ``DPOptimizer``) draws step t's noise once the trainer has called ``at(t)``.
    Draws of step t must be finished before step t + 1 is asked for.
    """

    __slots__ = ("key", "name", "generator", "_step")

    def __init__(self, key: NoiseKey, name: str, public: int, device: str | torch.device = "cpu"):
        if not isinstance(key, NoiseKey):
            raise ValueError(f"noise_key must be a dpmech.privacy.secret.NoiseKey, got {type(key).__name__}")
        self.key = key
        self.name = str(name)
        # research mode: seeded from the public seed as before; secret mode: reseeded by at(t)
        self.generator = key.generator(self.name, public, device)
        self._step: int | None = None

    @property
    def keyed(self) -> bool:
        """True when the draws come from a secret key (per-step seeds, nothing to checkpoint)."""
        return not self.key.reproducible_mode

    def at(self, step: int) -> torch.Generator:
        """The generator of step ``step`` (module docstring)."""
        if self.keyed and step != self._step:
            self.generator.manual_seed(self.key.step_seed(self.name, step))
            self._step = step
        return self.generator

    def state_dict(self):
        """What a checkpoint holds of this stream: None with a secret key (the step counter the
        trainer stores suffices), the running generator's state in the research mode."""
        return None if self.keyed else self.generator.get_state()

    def load_state_dict(self, state, field: str) -> None:
        """Continue from a checkpoint's ``state`` (``field``: its name there, for the error). With a
        secret key the state is not read, whatever it holds (a checkpoint written before issue 48
        held one: the draws of the steps to come follow from the key and the step, not from it); in
        the research mode a missing state is refused in one line (the stream would replay the draws
        of the steps already taken)."""
        self._step = None
        if self.keyed:
            return
        if state is None:
            raise ValueError(f"checkpoint.{field}: missing; the checkpoint was saved by a trainer with a secret key "
                             "(its streams follow from the key and the step): resume it with that key, not in the "
                             "research mode")
        from dpmech._validate import set_generator_state

        set_generator_state(field, self.generator, state)


def once_drawn(state: dict, field: str, drawn, key: NoiseKey, stream: str, load=lambda value: value):
    """The once-drawn noise (DPAL's chi_1..chi_3, AdLM's chi_3) a resumed run must go on with.

    ``state[field]`` (through ``load``) where the checkpoint holds it: the research mode, or a secret-key
    checkpoint written before issue 48 (the noise its steps used). Else, with a secret key, ``drawn``
    (the resuming trainer's own draw from its key at step 0 of ``stream``) when the checkpoint's
    ``noise_key_check`` is this key's :meth:`NoiseKey.fingerprint` of ``stream``. Refused in one line
    otherwise: another key would train on a second draw of a noise the accounting counts once."""
    if field in state:
        return load(state[field])
    if key.reproducible_mode:
        raise ValueError(f"checkpoint.{field}: missing; the checkpoint was saved by a trainer with a secret key (the "
                         "noise follows from the key): resume it with that key, not in the research mode")
    if state.get(CHECK_FIELD) != key.fingerprint(stream):
        raise ValueError(f"checkpoint.{CHECK_FIELD}: the checkpoint was saved with another noise key; resume with the "
                         "key it was trained with (another key would draw the fixed noise a second time)")
    return drawn
