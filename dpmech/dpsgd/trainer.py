"""DP-SGD (Abadi et al., CCS 2016, Algorithm 1) through Opacus 1.6: a reusable engine.

One step t of Algorithm 1, as implemented by :meth:`DPSGDTrainer.train_step`:

* **Sampling** (Alg. 1 line "take a random sample L_t with sampling probability q"): every one of
  the N training examples joins the batch independently with probability q = batch_size / N
  (Poisson sampling, drawn from the trainer's sampling stream at step t), so the batch size varies
  (mean N q, variance N q (1 - q)); the privacy analysis (the moments accountant, Abadi et al.
  Thm. 1; subsampled RDP, Mironov, Talwar & Zhang 2019) assumes exactly this sampling.
* **Per-example gradients and clipping** (lines "compute gradient" and "clip gradient"):
  g_i <- g_i / max(1, ||g_i||_2 / C) over the flat vector of all parameters: ``clipping="bk"``
  (default; book-keeping, Bu et al. 2023, :mod:`dpmech.privacy.clipping`: one backward pass to the layer
  outputs, per-example norms by ghost norms or instantiation per layer, the clipped sum as the
  weight gradient of the re-weighted output gradients), ``"ghost"`` (Opacus ghost clipping, Li et
  al. 2022: norms in a first backward, then a second backward of sum_i c_i loss_i with
  c_i = min(1, C / ||g_i||)) or ``"flat"`` (Opacus hooks compute every g_i). All three give the
  same clipped sum (tested); bk is the fastest (docs/dpsgd.md, speed table).
* **Noise** (line "add noise"): g_bar = (sum_i g_i + N(0, sigma^2 C^2 I)) / B with B the
  *expected* batch size (Opacus's ``loss_reduction="mean"`` with Poisson sampling), noise drawn
  from the trainer's noise stream at step t (by the trainer in bk mode, by the Opacus
  ``DPOptimizer`` in ghost and flat modes, which holds the stream's generator).
* **Descent** (line "descent"): the wrapped torch optimizer (SGD with momentum, or Adam; both are
  post-processing of g_bar).
* **Accounting**: after every step actually taken, ``(q, sigma, 1)`` goes into the
  :class:`~dpmech.privacy.accounting.PrivacyLedger`; epsilon is computed from the ledger (RDP and PLD with
  dp-accounting), never copied from the configuration. An empty Poisson batch is still a step (the
  noise alone is applied) and is recorded.

Randomness and checkpoints (docs/threat_model.md; DESIGN.md, Conventions: "a checkpoint holds the
step, not a generator state"): the sampling and the noise of step t come from per-step streams of
the secret key (:class:`~dpmech.privacy.secret.StepStream`, seeded by HMAC(key, stream, t)), so
they are a function of (key, t) only; a checkpoint holds the step counter, the model, the optimizer
and the ledger, and no state of those two streams (with the research mode's public seed, their
running generators' states, as before). Resuming with the owner's key continues bit for bit; a
checkpoint read without the key lets no one replay the steps to come.

Noise calibration: with a target (epsilon, delta), sigma is the smallest noise multiplier whose
RDP epsilon after the **planned** number of steps ``epochs * ceil(N / batch_size)`` at sampling
rate q is <= epsilon (:func:`dpmech.privacy.accounting.noise_multiplier_for`); so the ledger of a
completed run gives epsilon <= target.

Engine API (for DP-SGD itself and for mechanisms built on it, e.g. SecureSGD)::

    cfg = DPSGDConfig(epsilon=8.0, delta=1e-5, max_grad_norm=1.0, batch_size=256, epochs=5,
                      lr=0.1, optimizer="sgd", momentum=0.9, clipping="ghost", seed=0)
    trainer = DPSGDTrainer(model, x_train, y_train, cfg, device="cpu")   # any nn.Module classifier
    trainer = DPSGDTrainer(model, dataset, config=cfg)   # or a map-style Dataset / DataLoader (below)
    # (optional noise_key=NoiseKey: the secret the sampling and the noise are drawn from; default a
    #  fresh one from the OS's entropy; NoiseKey.reproducible(seed) is the labelled research mode)
    # (optional plan_size=n: plan q = batch_size / n and the steps from n instead of len(x_train))
    # (optional canaries=EngineCanaries(m) or WhiteBoxCanaries(m): white-box audit canaries, examples of D
    #  drawn by poisson_batch with the real ones; engine canaries are also clipped by this engine;
    #  dpmech.privacy.audit.whitebox)
    trainer.train_epoch()            # -> {"train_loss", "train_acc", "batch_size_mean"}
    trainer.train_step()             # one Poisson-sampled clipped noisy step -> (batch size, loss sum, correct)
    trainer.privacy()                # epsilon (RDP), epsilon_pld, delta, noise_multiplier, sampling_rate, steps
    trainer.ledger                   # PrivacyLedger of the steps actually taken
    trainer.model                    # the plain nn.Module being trained (after ModuleValidator.fix)
    state = trainer.state_dict(); fresh.load_state_dict(state)   # bit-for-bit continuation (same key)

``DPSGDConfig`` modes: ``epsilon`` set -> sigma calibrated; ``noise_multiplier`` set (epsilon
None) -> that sigma is used as is (0 allowed: clipping without noise, epsilon inf); both None ->
the **non-private baseline**: the same model, sampling, loss scaling and optimizer, but no
clipping and no noise (ledger records sigma 0, so epsilon is reported as inf).

``noise_augmentation_sigma`` > 0 adds N(0, s^2) noise to every training input (Cohen et al. 2019's
training for randomized smoothing), drawn from a third explicit generator. Inputs are seen by the
model only through the loss, so the DP guarantee is unchanged (post-processing of the sample).

Training data: in-memory tensors ``x_train [N, ...]``, ``y_train [N]`` (the fast path: a batch is
one indexing), or a **map-style dataset** in place of ``x_train`` (``y_train`` omitted): anything
with ``len`` and ``__getitem__(i) -> (x_i, y_i)``, e.g. a ``torch.utils.data.Dataset`` that reads
images from disk; a ``DataLoader`` stands for its ``dataset`` and ``collate_fn`` (its sampler,
shuffling and batch size are not used; a ``LoaderSettingsIgnored`` warning says so, once per
process). The privacy reading is the same: N = ``len(dataset)``,
and each step draws its Poisson sample over the indices 0 .. N-1 (each independently with
probability q) and fetches exactly those examples, collated by ``default_collate``. An iterable
dataset has no random access and is refused: Poisson sampling cannot be done on a stream.

Subclasses (SecureSGD) may override :meth:`forward_train` (the logits used in the loss) and extend
:meth:`state_dict`/:meth:`load_state_dict` with their own state (call ``super()``).
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.accounting import PrivacyLedger, noise_multiplier_for, subsampled_gaussian_event
from dpmech.privacy.secret import NoiseKey
from dpmech._validate import matching_checkpoint

CLIPPING_MODES = ("bk", "ghost", "flat")
OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("constant", "cosine", "step")
ACCOUNTANTS = ("rdp", "pld")

# Independent streams of the trial seed: Poisson sampling, gradient noise, input augmentation.
_SAMPLING, _NOISE, _AUGMENT = 1, 2, 3


def stream_seed(seed: int, stream: int) -> int:
    """A 63-bit seed for ``stream`` of ``seed`` (numpy SeedSequence: streams are independent)."""
    return int(np.random.SeedSequence([int(seed), int(stream)]).generate_state(2, np.uint64)[0] >> np.uint64(1))


@dataclass
class DPSGDConfig:
    """Hyperparameters of one DP-SGD run (see the module docstring for the three modes)."""

    epsilon: float | None = 8.0         # target epsilon (None: noise_multiplier, or non-private)
    delta: float = 1e-5
    noise_multiplier: float | None = None  # explicit sigma instead of a target epsilon
    max_grad_norm: float = 1.0          # C
    batch_size: int = 256               # expected batch size; q = batch_size / N
    epochs: int = 5
    lr: float = 0.1
    lr_schedule: str = "constant"       # constant | cosine (to 0 over the planned steps) | step (x0.1 at 1/2 and 3/4)
    optimizer: str = "sgd"
    momentum: float = 0.9               # sgd only
    weight_decay: float = 0.0
    clipping: str = "bk"                # bk (book-keeping, dpmech.privacy.clipping) | ghost | flat (Opacus)
    noise_augmentation_sigma: float = 0.0
    accountant: str = "rdp"             # accountant of the calibration (both are reported)
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        v.epsilon_or_noise(self.epsilon, self.noise_multiplier)
        v.open_unit("delta", self.delta)
        v.positive("max_grad_norm", self.max_grad_norm)
        v.positive_int("batch_size", self.batch_size)
        v.positive_int("epochs", self.epochs)
        v.positive("lr", self.lr)
        v.choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        v.choice("optimizer", self.optimizer, OPTIMIZERS)
        v.unit_interval("momentum", self.momentum, high_open=True)
        v.non_negative("weight_decay", self.weight_decay)
        v.choice("clipping", self.clipping, CLIPPING_MODES)
        v.non_negative("noise_augmentation_sigma", self.noise_augmentation_sigma)
        v.choice("accountant", self.accountant, ACCOUNTANTS)
        v.positive_int("seed", self.seed, minimum=0)

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate of step ``step`` (0-based) of ``total_steps``: constant; cosine (Loshchilov &
        Hutter 2017, no restarts, from lr to 0); step (x0.1 after half and after three quarters)."""
        frac = min(max(step / max(total_steps, 1), 0.0), 1.0)
        if self.lr_schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * frac))
        if self.lr_schedule == "step":
            return self.lr * (0.1 if frac >= 0.5 else 1.0) * (0.1 if frac >= 0.75 else 1.0)
        return self.lr

    @property
    def private(self) -> bool:
        """False for the non-private baseline (no clipping, no noise)."""
        return self.epsilon is not None or self.noise_multiplier is not None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """What a run of ``config`` on N examples will do: q, steps, sigma (None: non-private)."""

    n: int
    sampling_rate: float
    steps_per_epoch: int
    steps: int
    noise_multiplier: float | None

    def dp_event(self):
        """The dp-accounting event of the planned run (``NonPrivateDpEvent`` for the baseline)."""
        return subsampled_gaussian_event(self.sampling_rate, self.noise_multiplier or 0.0, self.steps)


def plan(config: DPSGDConfig, n: int) -> Plan:
    """Sampling rate q = batch_size / n, ceil(n / batch_size) steps per epoch, and the noise
    multiplier: the config's, or calibrated to (epsilon, delta) over the planned steps."""
    config.validate()
    n = v.positive_int("train_size", n)
    if config.batch_size > n:
        raise ValueError(f"batch_size: {config.batch_size} exceeds the {n} training examples "
                         "(the sampling rate batch_size / N must be <= 1)")
    q = config.batch_size / n
    per_epoch = -(-n // config.batch_size)
    steps = per_epoch * config.epochs
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    elif config.epsilon is not None:
        sigma = calibrated_noise_multiplier(float(config.epsilon), float(config.delta), q, steps, config.accountant)
    else:
        sigma = None
    return Plan(n, q, per_epoch, steps, sigma)


@functools.lru_cache(maxsize=256)
def calibrated_noise_multiplier(epsilon: float, delta: float, sampling_rate: float, steps: int,
                                accountant: str = "rdp") -> float:
    """Cached :func:`dpmech.privacy.accounting.noise_multiplier_for` (planning a sweep asks many times)."""
    return noise_multiplier_for(epsilon, delta, sampling_rate, steps, accountant=accountant)


CONVERTED = "_dpsweep_converted"   # attribute of a model: what make_private_compatible replaced in it


def make_private_compatible(model: nn.Module, examples: tuple[torch.Tensor, ...] | None = None,
                            batch_size: int | None = None) -> nn.Module:
    """The model checked by Opacus's ``ModuleValidator``; incompatible layers (BatchNorm with affine
    parameters) are replaced by ``ModuleValidator.fix`` (BatchNorm -> GroupNorm), then validated
    strictly. The model trained is then not the one written: what was replaced is kept on the
    returned model (:func:`model_conversion`: the trainer's ``model_converted``, a trial's
    ``model_converted`` param).

    With ``examples`` (one batch-first tensor per input of the model, only their shapes and dtypes
    used), the training forward pass must treat each example alone and change no buffer
    (:func:`dpmech.privacy.per_example.check_per_example`, at the training ``batch_size`` too):
    Opacus's validator looks only at modules with trainable parameters, so a parameter-free
    BatchNorm, an InstanceNorm tracking running statistics or a hand-written ``x - x.mean(0)`` would
    pass it; a ValueError of one line names the module.

    In-place activations are made out-of-place: Opacus's full backward hooks on a layer refuse
    an in-place change of that layer's output (the function computed is the same).
    """
    from opacus.validators import ModuleValidator

    converted = list(getattr(model, CONVERTED, ()))
    if not ModuleValidator.is_valid(model):
        before = {name: type(m).__name__ for name, m in model.named_modules()}
        model = ModuleValidator.fix(model)
        converted += [f"{name}: {before[name]} -> {m}" for name, m in model.named_modules()
                      if name in before and before[name] != type(m).__name__]
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ValueError(f"model: not trainable with per-example gradients after ModuleValidator.fix: {errors[0]}")
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
    setattr(model, CONVERTED, tuple(converted))
    if examples is not None:
        from dpmech.privacy.per_example import check_per_example

        check_per_example(model, *examples, batch_size=batch_size)
    return model


def model_conversion(model: nn.Module) -> str:
    """What :func:`make_private_compatible` replaced in ``model``, in one line ("none": nothing),
    e.g. "bn: BatchNorm2d -> GroupNorm(16, 16, eps=1e-05, affine=True, bias=True)"; at most 20 layers
    named."""
    done = list(getattr(model, CONVERTED, ()))
    if not done:
        return "none"
    shown = "; ".join(done[:20])
    return shown if len(done) <= 20 else f"{shown}; and {len(done) - 20} more ({len(done)} layers)"


_LOADER_WARNED = False


class LoaderSettingsIgnored(UserWarning):
    """A DataLoader's batch size, shuffling and sampler do not steer DP-SGD (Poisson sampling does)."""


def _warn_loader_settings(loader) -> None:
    """Warn once per process that a DataLoader's ``batch_size``, ``shuffle`` and sampler are not used:
    each step is a Poisson sample of the loader's dataset with q = ``config.batch_size`` / N (the
    sampling the privacy analysis assumes, Abadi et al. 2016, Algorithm 1 with Poisson lots)."""
    global _LOADER_WARNED
    if _LOADER_WARNED:
        return
    _LOADER_WARNED = True
    from torch.utils.data import RandomSampler

    shuffle = isinstance(getattr(loader, "sampler", None), RandomSampler)
    warnings.warn(f"DPSGDTrainer: the DataLoader's batch_size ({loader.batch_size}) and shuffle ({shuffle}) are not "
                  f"used; each step draws a Poisson sample of its dataset with q = config.batch_size / N, the "
                  f"sampling the guarantee rests on (pass the dataset itself to silence this; warned once)",
                  LoaderSettingsIgnored, stacklevel=4)


def _map_style(source):
    """(dataset, collate_fn) of a map-style dataset or a DataLoader over one; a ValueError otherwise."""
    from torch.utils.data import DataLoader, IterableDataset, default_collate

    collate = default_collate
    if isinstance(source, DataLoader):
        _warn_loader_settings(source)
        collate = source.collate_fn or default_collate
        source = source.dataset
    if isinstance(source, IterableDataset) or not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise ValueError(f"x_train must be a tensor [N, ...] or a map-style dataset (len and __getitem__: Poisson "
                         f"sampling picks examples by index), got {type(source).__name__}")
    if len(source) == 0:
        raise ValueError("x_train: the dataset is empty")
    return source, collate


class ModelReplaced(UserWarning):
    """The model given to :class:`DPSGDTrainer` had layers that per-example gradients cannot train
    (BatchNorm with affine parameters): a copy with them replaced is trained, ``trainer.model``."""


class DPSGDTrainer:
    """DP-SGD on in-memory tensors or a map-style dataset (any ``nn.Module`` classifier; see the
    module docstring).

    The model trained is ``trainer.model``: the model given, or, when it has layers that
    per-example gradients cannot train (BatchNorm with affine parameters), a copy of it with them
    replaced (BatchNorm -> GroupNorm, ``ModuleValidator.fix``; ``model_converted`` names them). The
    object given then stays untrained, and a :class:`ModelReplaced` warning says so, once per trainer.
    """

    def __init__(self, model: nn.Module, x_train, y_train: torch.Tensor | None = None,
                 config: DPSGDConfig | None = None, *, device: str | torch.device = "cpu",
                 plan_size: int | None = None, canaries=None, noise_key=None):
        if not isinstance(config, DPSGDConfig):
            raise ValueError(f"config must be a DPSGDConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.dataset = self.collate = None
        if torch.is_tensor(x_train):
            if not torch.is_tensor(y_train) or x_train.dim() < 2 or x_train.shape[0] != y_train.shape[0]:
                raise ValueError(f"x_train must be [N, ...] with N labels, got {tuple(x_train.shape)} and "
                                 f"{tuple(y_train.shape) if torch.is_tensor(y_train) else type(y_train).__name__}")
            self.x = x_train.to(self.device)
            self.y = y_train.to(self.device)
            n = x_train.shape[0]
        else:
            if y_train is not None:
                raise ValueError("y_train: omit it when x_train is a dataset (its items are (x, y) pairs)")
            self.dataset, self.collate = _map_style(x_train)
            self.x = self.y = None
            n = len(self.dataset)
        # q = batch_size / plan_size and the steps are planned from plan_size (default: the N examples
        # given). A trial whose audit adds canaries plans from its configured train_size, so its
        # ledger equals the event planned from the config; the extra examples are sampled at the same q.
        self.plan = plan(config, int(plan_size if plan_size is not None else n))
        # the model trained (BatchNorm with affine parameters replaced: model_converted); a private run's
        # forward pass must treat each example alone (dpmech.privacy.per_example, checked on random inputs
        # shaped like one training example)
        self.model = make_private_compatible(model, (self.x[:1] if self.x is not None else self.collate(
            [self.dataset[0]])[0],) if config.private else None, batch_size=config.batch_size).to(self.device)
        self.model_converted = model_conversion(self.model)
        if self.model is not model:   # ModuleValidator.fix trained a copy: the user's object stays untrained
            warnings.warn(f"DPSGDTrainer: the model's layers were replaced by Opacus's ModuleValidator.fix "
                          f"({self.model_converted}): per-example gradients cannot train them, so a copy is trained; "
                          f"the trained model is trainer.model, and the model you passed stays untrained (evaluate, "
                          f"certify and save trainer.model)", ModelReplaced, stacklevel=2)
        self.ledger = PrivacyLedger()
        self.epoch = 0
        self.steps = 0

        params = [p for p in self.model.parameters() if p.requires_grad]
        if config.optimizer == "adam":
            base = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
        else:
            base = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)

        # Sampling and noise (the draws the guarantee rests on) from the secret key, per step
        # (docs/threat_model.md): the generator of step t is seeded by HMAC(key, stream, t), so a
        # checkpoint holds no state of them; the research mode's key replays the public seed's running
        # streams. Augmentation is per example and data-independent: it follows the public seed.
        self.noise_key = NoiseKey.resolve(noise_key)
        self.sample_stream = self.noise_key.step_stream("dpsgd.sampling", stream_seed(config.seed, _SAMPLING))
        self.noise_stream = self.noise_key.step_stream("dpsgd.noise", stream_seed(config.seed, _NOISE), self.device)
        self.sample_gen = self.sample_stream.generator   # the streams' generators (reseeded per step by at())
        self.noise_gen = self.noise_stream.generator
        self.augment_gen = torch.Generator(device=self.device).manual_seed(stream_seed(config.seed, _AUGMENT))

        self.gsm = None
        self.criterion = None
        self.bookkeeper = None
        if config.private:
            self._make_private(base)
        else:
            self.optimizer = base
        self.canaries = None
        if canaries is not None:
            self._attach_canaries(canaries, params)

    # -------------------------------------------------------------- construction
    def _make_private(self, base: torch.optim.Optimizer) -> None:
        """Opacus's pieces, assembled as ``PrivacyEngine.make_private`` does, but with our own
        Poisson sampler on tensors and our own ledger (no DataLoader, no Opacus accountant)."""
        from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        cfg, sigma = self.config, float(self.plan.noise_multiplier)
        if hasattr(self.model, "autograd_grad_sample_hooks") or getattr(self.model, "_dpsweep_bookkeeper", None):
            raise ValueError("model: already has Opacus hooks (another DP-SGD trainer trains it); pass a fresh "
                             "model or call that trainer's close() first")
        common = dict(noise_multiplier=sigma, max_grad_norm=cfg.max_grad_norm, expected_batch_size=cfg.batch_size,
                      loss_reduction="mean", generator=self.noise_gen)
        if cfg.clipping == "bk":
            from dpmech.privacy.clipping import BookKeeper

            self.bookkeeper = BookKeeper(self.model)
            self.model._dpsweep_bookkeeper = True
            self.optimizer = base            # the noisy clipped gradient is written into p.grad
            return
        if cfg.clipping == "ghost":
            self.gsm = GradSampleModuleFastGradientClipping(
                self.model, batch_first=True, loss_reduction="mean", max_grad_norm=cfg.max_grad_norm,
                use_ghost_clipping=True)
            self.optimizer = DPOptimizerFastGradientClipping(base, **common)
            self.criterion = DPLossFastGradientClipping(self.gsm, self.optimizer, nn.CrossEntropyLoss(), "mean")
        else:
            self.gsm = GradSampleModule(self.model, batch_first=True, loss_reduction="mean")
            self.optimizer = DPOptimizer(base, **common)
        self.gsm.disable_hooks()  # only on inside train_step: evaluation and attacks see a plain model

    def _attach_canaries(self, canaries, params: list) -> None:
        """White-box canaries (:mod:`dpmech.privacy.audit.whitebox`). Both kinds are examples of D:
        the included ones are rows N .. N + |included| - 1 of :meth:`poisson_batch` (one sampling
        plan with the real examples; :meth:`_step` tells the canaries the engine's draw).
        ``EngineCanaries`` are rows of the batch whose per-example losses (:meth:`per_example_loss`)
        go through this engine's clipping on every route; ``WhiteBoxCanaries`` (inserted) add their
        clipped gradient to the clipped sum before the noise (bk: :meth:`_add_noise_and_scale`;
        ghost and flat: the Opacus optimizer's ``add_noise``, wrapped). The auditor observes the
        update the optimizer applies (B times each gradient, a step pre-hook on the optimizer),
        whatever the engine did to produce it."""
        if not self.config.private:
            raise ValueError("canaries: white-box canaries need DP-SGD's clipping and noise (set epsilon or "
                             "noise_multiplier; the non-private baseline has neither)")
        engine = getattr(canaries, "kind", "inserted") == "engine"
        if engine and type(self).forward_backward is not DPSGDTrainer.forward_backward:
            raise ValueError(f"canaries: {type(self).__name__} computes its own per-example losses, which engine "
                             "canaries cannot join; use inserted canaries (kind 'inserted')")
        kw = {}
        if engine:
            kw["model"] = self.model
            if self.gsm is not None:      # Opacus reads per-example gradients from its hooks while they record
                gsm = self.gsm
                kw["capture"] = lambda: gsm.hooks_enabled
        canaries.attach(params, max_grad_norm=self.config.max_grad_norm, sampling_rate=self.plan.sampling_rate,
                        noise_multiplier=self.noise_multiplier, **kw)
        self.canaries = canaries
        self._canaries_engine = engine
        if self.bookkeeper is None and not engine:
            opt, add_noise = self.optimizer, self.optimizer.add_noise

            def noise_with_canaries():
                canaries.insert([p.summed_grad for p in opt.params])
                add_noise()
            opt.add_noise = noise_with_canaries
        update_params = [p for group in self.base_optimizer.param_groups for p in group["params"] if p.requires_grad]
        B = float(self.config.batch_size)

        def observe(optimizer, args, kwargs):   # the update the step applies, times the public B
            canaries.observe([(p.grad if p.grad is not None else torch.zeros_like(p)).detach() * B
                              for p in update_params])
        self._canary_observer = self.base_optimizer.register_step_pre_hook(observe)

    def _split_canaries(self, idx: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """(real example indices, canary numbers) of a draw of :meth:`poisson_batch`: rows at or
        past N are the included canaries, in order; the canaries are told the engine's draw."""
        if self.canaries is None:
            return idx, np.zeros(0, dtype=np.int64)
        n = self.num_real_examples
        is_canary = idx >= n
        ids = self.canaries.member_ids[(idx[is_canary] - n).cpu().numpy()]
        self.canaries.set_batch(ids)
        return idx[~is_canary], ids

    def _canary_rows(self, xb: torch.Tensor, yb: torch.Tensor, ids: np.ndarray):
        """The batch with one row per engine canary of ``ids`` appended (zeros: the canary's input
        is planted at its layer by :meth:`EngineCanaries.begin`'s hooks)."""
        xc = xb.new_zeros((len(ids),) + tuple(xb.shape[1:]))
        return torch.cat([xb, xc]), torch.cat([yb, yb.new_zeros(len(ids))])

    def per_example_loss(self, logits: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """The per-example losses the engine clips: cross-entropy, with the engine canaries' rows
        (if any in the batch) holding their planted loss (:meth:`EngineCanaries.losses`)."""
        per_example = F.cross_entropy(logits, yb, reduction="none")
        if self.canaries is not None and self._canaries_engine:
            per_example = self.canaries.losses(per_example)
        return per_example

    def close(self) -> None:
        """Remove the Opacus hooks from the model (it can then be trained by another trainer)."""
        if self.bookkeeper is not None:
            self.bookkeeper.remove()
            self.model._dpsweep_bookkeeper = False
            self.bookkeeper = None
        if self.gsm is not None:
            self.gsm.remove_hooks()
            self.gsm = None
        if self.canaries is not None and hasattr(self.canaries, "remove"):
            self.canaries.remove()

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "original_optimizer", self.optimizer)

    @property
    def noise_multiplier(self) -> float:
        return float(self.plan.noise_multiplier or 0.0)

    # -------------------------------------------------------------- one step
    def poisson_batch(self) -> torch.Tensor:
        """Indices of one Poisson sample: each example independently with probability q (drawn from
        the sampling stream's generator of the step about to be taken)."""
        self.sample_stream.at(self.steps)   # sample_gen, (re)seeded for this step (secret key)
        mask = torch.rand(self.num_examples, generator=self.sample_gen) < self.plan.sampling_rate
        return torch.nonzero(mask, as_tuple=False).squeeze(1).to(self.device)

    @property
    def num_examples(self) -> int:
        """|D|: the examples Poisson sampling draws from: the N training examples (tensor rows, or
        ``len(dataset)``), then the included white-box canaries (rows N, N + 1, ...)."""
        return self.num_real_examples + (self.canaries.members if self.canaries is not None else 0)

    @property
    def num_real_examples(self) -> int:
        """N: the training examples given (tensor rows, or ``len(dataset)``)."""
        return int(self.x.shape[0]) if self.dataset is None else len(self.dataset)

    def _no_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An empty batch of the training examples' shape (a step whose draw holds only canaries)."""
        if self.dataset is None:
            return self.x[:0], self.y[:0]
        xb, yb = self.batch(torch.zeros(1, dtype=torch.int64))
        return xb[:0], yb[:0]

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples ``idx`` as (images, labels) on the device: an indexing of the tensors, or the
        dataset's items fetched one by one and collated."""
        if self.dataset is None:
            return self.x[idx], self.y[idx]
        xb, yb = self.collate([self.dataset[i] for i in idx.tolist()])[:2]
        return xb.to(self.device, non_blocking=True), torch.as_tensor(yb, dtype=torch.int64).to(self.device)

    def augment(self, xb: torch.Tensor) -> torch.Tensor:
        s = self.config.noise_augmentation_sigma
        if s <= 0:
            return xb
        return xb + s * torch.randn(xb.shape, generator=self.augment_gen, device=xb.device, dtype=xb.dtype)

    def forward_train(self, xb: torch.Tensor) -> torch.Tensor:
        """Logits of a training batch (through the Opacus wrapper when private)."""
        return (self.gsm if self.gsm is not None else self.model)(xb)

    def forward_backward(self, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one batch: afterwards the optimizer holds what it needs (per-example
        gradients in flat mode, the clipped sum in ghost mode, the plain gradient in the baseline).
        Returns (logits, per-example losses), detached."""
        cfg = self.config
        if self.bookkeeper is not None:
            return self._bk_forward_backward(xb, yb)
        logits = self.forward_train(xb)
        if cfg.private and cfg.clipping == "ghost":
            loss = self.criterion(logits, yb)          # packs both backward passes of ghost clipping
            if self.canaries is not None and self._canaries_engine:
                loss.loss_per_sample = self.canaries.losses(loss.loss_per_sample)
            per_example = loss.loss_per_sample
        else:
            per_example = self.per_example_loss(logits, yb)
            # flat: Opacus rescales the per-example gradients of the mean by the batch length;
            # baseline: the same 1/B scaling as DP-SGD (B the expected batch size), no clipping or noise
            loss = per_example.mean() if cfg.private else per_example.sum() / cfg.batch_size
        loss.backward()
        return logits.detach(), per_example.detach()

    def _bk_forward_backward(self, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Book-keeping clipping (:mod:`dpmech.privacy.clipping`): one backward pass gives the clipped sum
        sum_i min(1, C/||g_i||) g_i in ``p.grad``; then Alg. 1's noise N(0, sigma^2 C^2 I) is added
        and the sum divided by the expected batch size B (as Opacus's DPOptimizer does)."""
        bk = self.bookkeeper
        bk.enabled = True
        try:
            logits = self.forward_train(xb)
        finally:
            bk.enabled = False
        per_example = self.per_example_loss(logits, yb)
        bk.clipped_sum(per_example.sum(), self.config.max_grad_norm)
        self._add_noise_and_scale()
        return logits.detach(), per_example.detach()

    def _add_noise_and_scale(self) -> None:
        """p.grad <- (p.grad + N(0, (sigma C)^2 I)) / B for every trainable parameter (book-keeping
        mode; p.grad None counts as the zero clipped sum), noise from the trainer's noise generator."""
        std = self.noise_multiplier * self.config.max_grad_norm
        params = [p for group in self.base_optimizer.param_groups for p in group["params"] if p.requires_grad]
        sums = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.canaries is not None:   # inserted canaries: their clipped gradients join the clipped sum
            self.canaries.insert(sums)
        if std > 0:   # (std z) + g built in z's buffer: the same numbers as g + std z, two passes fewer
            sums = [torch.randn(p.shape, generator=self.noise_gen, device=p.device, dtype=p.dtype).mul_(std).add_(g)
                    for p, g in zip(params, sums)]
        for p, g in zip(params, sums):
            p.grad = g.div_(self.config.batch_size) if std > 0 else g / self.config.batch_size

    def train_step(self) -> tuple[int, float, int]:
        """One step of Alg. 1 on a fresh Poisson sample; returns (batch size, summed loss, correct)."""
        return self._step(self.poisson_batch())

    def _step(self, idx: torch.Tensor) -> tuple[int, float, int]:
        """The step on the examples ``idx`` (recorded in the ledger as a Poisson step: only
        :meth:`train_step` makes that true; tests call this directly to fix a batch)."""
        self.model.train()
        cfg = self.config
        self.noise_stream.at(self.steps)   # this step's noise generator (bk: noise_gen; Opacus holds the same)
        idx, canary_ids = self._split_canaries(idx)      # white-box canaries drawn with the examples
        rows = canary_ids if self.canaries is not None and self._canaries_engine else canary_ids[:0]
        if idx.numel() == 0 and len(rows) == 0:
            self._empty_step()
            loss_sum, correct = 0.0, 0
        else:
            self._set_lr()
            xb, yb = self.batch(idx) if idx.numel() else self._no_rows()
            xb = self.augment(xb)
            n_real = int(xb.shape[0])
            if len(rows):        # engine canaries: rows of the batch, clipped with the examples
                xb, yb = self._canary_rows(xb, yb, rows)
                self.canaries.begin(n_real, rows)
            self.optimizer.zero_grad(set_to_none=True)
            if self.gsm is not None:
                self.gsm.enable_hooks()
            try:
                with warnings.catch_warnings():
                    # Opacus's hooks fire on module outputs when the input needs no gradient (expected)
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    logits, per_example = self.forward_backward(xb, yb)
            finally:
                if self.gsm is not None:
                    self.gsm.disable_hooks()
                if len(rows):
                    self.canaries.end()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # frees the per-example gradients
            loss_sum = float(per_example[:n_real].detach().sum())
            correct = int((logits[:n_real].detach().argmax(1) == yb[:n_real]).sum())
        self.steps += 1
        self.ledger.record(self.plan.sampling_rate, self.noise_multiplier if cfg.private else 0.0, 1)
        return int(idx.numel()), loss_sum, correct

    def _empty_step(self) -> None:
        """An empty Poisson batch: the clipped sum is zero, the noise is still added and the step taken."""
        opt = self.optimizer
        self._set_lr()
        self.base_optimizer.zero_grad(set_to_none=True)
        if self.bookkeeper is not None:
            self._add_noise_and_scale()
        elif self.config.private:
            for p in opt.params:
                p.summed_grad = torch.zeros_like(p)
            opt.add_noise()
            for p in opt.params:  # / B, as scale_grad() does (it reads p.grad_sample, absent here: flat crashed)
                p.grad /= opt.expected_batch_size
                p.summed_grad = None
        else:
            for group in self.base_optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
        self.base_optimizer.step()
        self.base_optimizer.zero_grad(set_to_none=True)

    def _set_lr(self) -> None:
        """The schedule's learning rate for the step about to be taken (a function of the step
        counter, so a restored checkpoint continues the schedule exactly)."""
        if self.config.lr_schedule == "constant":
            return
        lr = self.config.lr_at(self.steps, self.plan.steps)
        for group in self.base_optimizer.param_groups:
            group["lr"] = lr

    # -------------------------------------------------------------- epochs
    def train_epoch(self, progress=None) -> dict[str, float]:
        """``ceil(N / batch_size)`` Poisson steps; mean per-example loss and accuracy of the batches."""
        total, loss_sum, correct = 0, 0.0, 0
        k = self.plan.steps_per_epoch
        for b in range(k):
            n_b, l_b, c_b = self.train_step()
            total, loss_sum, correct = total + n_b, loss_sum + l_b, correct + c_b
            if progress is not None:
                progress(b + 1, k)
        self.epoch += 1
        return {"train_loss": loss_sum / max(total, 1), "train_acc": correct / max(total, 1),
                "batch_size_mean": total / k}

    def fit(self) -> "DPSGDTrainer":
        while self.epoch < self.config.epochs:
            self.train_epoch()
        return self

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
        self.model.eval()
        correct = 0
        for s in range(0, x.shape[0], batch_size):
            correct += int((self.model(x[s:s + batch_size].to(self.device)).argmax(1).cpu()
                            == y[s:s + batch_size].cpu()).sum())
        return correct / x.shape[0]

    # -------------------------------------------------------------- guarantee
    def privacy(self) -> dict[str, float]:
        """The (epsilon, delta) of the steps actually taken (RDP and PLD), with q, sigma and steps."""
        d = float(self.config.delta)
        return {"epsilon": self.ledger.epsilon(d, "rdp"), "epsilon_pld": self.ledger.epsilon(d, "pld"),
                "delta": d, "noise_multiplier": self.noise_multiplier if self.config.private else 0.0,
                "sampling_rate": float(self.plan.sampling_rate), "steps": float(self.ledger.steps)}

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """A deep copy of everything needed to continue bit for bit with the same key: model,
        optimizer, the ledger, epoch and step counters, the public augmentation generator. With a
        secret key, no state of the sampling and noise streams (their draws at step t follow from the
        key and t: a checkpoint must not stand in for the secret); in the research mode their
        running generators' states (``sample_gen``, ``noise_gen``), as before."""
        streams = {k: st for k, st in (("sample_gen", self.sample_stream.state_dict()),
                                       ("noise_gen", self.noise_stream.state_dict())) if st is not None}
        return copy.deepcopy({
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.base_optimizer.state_dict(),
            **streams,
            "augment_gen": self.augment_gen.get_state(),
            "ledger": self.ledger.state_dict(),
            "epoch": self.epoch,
            "steps": self.steps,
            **({"canaries": self.canaries.state_dict()} if self.canaries is not None else {}),
            # bk: the routes the engine took (dpmech.privacy.clipping; "measured" times them per process), so
            # that a resumed run takes the same arithmetic
            **({"bk_routes": dict(self.bookkeeper.routes)} if self.bookkeeper is not None else {}),
        })

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`. With a secret key the sampling and noise streams are not
        read from the checkpoint (one written before issue 48 holds their states: ignored; the steps
        to come draw from the key and the step); in the research mode a checkpoint without them is
        refused in one line naming the field."""
        matching_checkpoint(state["config"], self.config.to_dict())
        self.model.load_state_dict(state["model"])
        # a copy: torch's load_state_dict keeps the checkpoint's tensors (momentum buffers) and the steps
        # would then update the caller's checkpoint in place
        self.base_optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        # generator states are CPU byte tensors (a checkpoint loaded with map_location may have moved them)
        self.sample_stream.load_state_dict(state.get("sample_gen"), "sample_gen")
        self.noise_stream.load_state_dict(state.get("noise_gen"), "noise_gen")
        v.set_generator_state("augment_gen", self.augment_gen, state["augment_gen"])
        self.ledger.load_state_dict(state["ledger"])
        self.epoch = int(state["epoch"])
        self.steps = int(state["steps"])
        if ("canaries" in state) != (self.canaries is not None):
            raise ValueError("checkpoint: it was saved with white-box canaries and this trainer has none, or the "
                             "other way round")
        if self.canaries is not None:
            self.canaries.load_state_dict(state["canaries"])
        if self.bookkeeper is not None and state.get("bk_routes"):
            self.bookkeeper.pin(state["bk_routes"])


def build_dpsgd_model(dataset: str, seed: int = 0, model: str = "pixeldp_cnn", input_range: str = "pm1") -> nn.Module:
    """The network ``model`` of :mod:`dpmech.networks.dpsgd_models` for ``dataset`` (a name or a loader's import
    path), or a user's ``"package.module:factory"`` (docs/own_model.md): ``pixeldp_cnn`` (default:
    the PixelDP networks without their noise layer, so DP-SGD is compared on the same architecture;
    for CIFAR-10 the wide ResNet with BatchNorm replaced by GroupNorm, ``ModuleValidator.fix``),
    ``tb_cnn`` (Tramer & Boneh 2021's tanh CNN) or ``tb_cnn_gn`` (with GroupNorm); ``input_range``
    "unit" feeds it [0, 1] inputs (T&B's) through a fixed map. Parameters initialised from ``seed``
    without touching the global RNG."""
    from dpmech.networks.dpsgd_models import build_dp_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make_private_compatible(build_dp_model(model, dataset, seed, input_range))
