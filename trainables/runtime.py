"""The life of one trial, shared by every mechanism's trainable.

``run_trial(config, schema, mechanism_cls)``:

1. validate the flat config with the mechanism's pydantic schema (an invalid key fails the trial
   at once, naming the key);
2. restore from ``ray.tune.get_checkpoint()`` if Ray hands one over (a retried or restored
   trial continues; it never starts over), otherwise build fresh;
3. open the trial's MLflow child run (the same run on every attempt: trainables.tracking);
4. train epoch by epoch, reporting ``train_loss``/``test_acc`` with ``ray.tune.report`` (the
   non-private diagnostics among them dropped with ``diagnostics: false``, trainables.diagnostics) and a
   checkpoint of everything needed to continue (model, optimizer, RNG states, privacy ledger,
   MLflow run id) after every epoch;
5. evaluate: each attack at each size, then certification (the mechanism's own, randomized
   smoothing, or both: ``certifier``); report and log the final metrics (names in
   docs/metrics.md) and the artifacts (weights, per-example Parquet tables, plots).

A mechanism is a small class (see ``Mechanism``) around a dpmech trainer.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import ValidationError

from trainables.build import build_mechanism
from trainables.config import CommonConfig, selection_images, trial_config

HIDDEN_KEYS = ("_mlflow", "trainable", "repeat")  # repeat: index of a search.num_samples repeat (logged as a param)


class Mechanism(Protocol):
    """What ``run_trial`` needs from a mechanism's trainer adapter."""

    epoch: int
    model: torch.nn.Module

    def train_epoch(self) -> dict[str, float]: ...
    def test_accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def privacy(self) -> dict[str, float]: ...
    def certify(self, x: torch.Tensor, y: torch.Tensor, cfg: CommonConfig): ...


class TrainerMechanism:
    """Base of the mechanism adapters: delegates the training loop's needs to ``self.trainer``
    (a dpmech trainer with ``model``, ``epoch``, ``train_epoch``, ``accuracy`` and state dicts)."""

    trainer: Any

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def epoch(self) -> int:
        return self.trainer.epoch

    def train_epoch(self) -> dict[str, float]:
        return self.trainer.train_epoch()

    def test_accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.trainer.accuracy(x, y)

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)

    def privacy(self) -> dict[str, float]:
        """The trainer's guarantee, recomputed from what it did (names: docs/metrics.md)."""
        return {k: float(v) for k, v in self.trainer.privacy().items()}

    def certify(self, x: torch.Tensor, y: torch.Tensor, cfg: CommonConfig):
        """The mechanism's own certificate; None: it has none (``certifier: smoothing`` may still apply)."""
        return None

    def smoothing_classifier(self) -> tuple[torch.nn.Module, float] | None:
        """(base classifier, sigma) when the model is a randomized-smoothing classifier; None otherwise."""
        return None


def validate_config(config: dict, schema: type[CommonConfig]) -> CommonConfig:
    """Validate a flat trial config; one-line ValueError naming the key on failure."""
    config = trial_config(config)
    clean = {k: v for k, v in config.items() if k not in HIDDEN_KEYS}
    try:
        return schema(**clean)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "config"
        raise ValueError(f"config.{key}: {err['msg']}") from None


def mlflow_info(config: dict) -> dict | None:
    return trial_config(config).get("_mlflow")


def _device() -> torch.device:
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned to this trial (none: empty).
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    """What the trial ran on, for the ``dpsweep.device`` tag: ``cpu`` or ``cuda:0 (<GPU name>)``."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def _save_checkpoint(directory: Path, mech: Mechanism, meta: dict) -> None:
    torch.save(mech.state_dict(), directory / "state.pt")
    digest = hashlib.sha256((directory / "state.pt").read_bytes()).hexdigest()
    (directory / "meta.json").write_text(json.dumps({**meta, "state_sha256": digest}))


def _load_checkpoint(directory: Path, device: torch.device) -> tuple[dict, dict]:
    """A checkpoint's (state, meta); a ValueError naming the file when it is torn or corrupt (a
    missing or unreadable file, a SHA-256 that differs from the one saved beside it)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        data = (directory / "state.pt").read_bytes()
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory.name}: {type(exc).__name__}: {exc}") from None
    want = meta.pop("state_sha256", None)
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise ValueError(f"state.pt holds {len(data)} bytes that do not match the SHA-256 saved with it")
    try:
        state = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds on a truncated file
        raise ValueError(f"state.pt unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    return state, meta


def restore_checkpoint(ckpt, device: torch.device) -> tuple[dict | None, dict | None, str | None]:
    """The newest readable checkpoint of a trial (issue 33, point 4): Tune's latest (``ckpt``), else
    the one before it (the trial keeps two while it runs: ``CheckpointConfig(num_to_keep=2)``).
    Returns ``(state, meta, note)``; ``note`` says what was unreadable and what was used instead;
    ``(None, None, note)`` when no checkpoint is readable: the trial starts afresh (in the same
    child run, found by its trial key), never retrying the same corrupt file until its retries
    run out."""
    from pyarrow import fs as pafs
    from ray import tune

    candidates = [ckpt]
    try:
        parent = ckpt.path.rstrip("/").rsplit("/", 1)[0]
        listing = ckpt.filesystem.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
        older = sorted((e.path for e in listing if e.type == pafs.FileType.Directory
                        and e.base_name.startswith("checkpoint_") and e.path.rstrip("/") < ckpt.path.rstrip("/")),
                       reverse=True)
        candidates += [tune.Checkpoint(path=p, filesystem=ckpt.filesystem) for p in older]
    except Exception:  # noqa: BLE001 - listing is best effort: the latest alone still works
        pass
    problems = []
    for c in candidates:
        try:
            with c.as_directory() as d:
                state, meta = _load_checkpoint(Path(d), device)
        except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint: try the next
            problems.append(f"{c.path.rstrip('/').rsplit('/', 1)[-1]}: {exc}")
            continue
        note = None if not problems else (f"{'; '.join(problems)}: resumed from "
                                         f"{c.path.rstrip('/').rsplit('/', 1)[-1]} (epoch {len(meta.get('history', []))})")
        return state, meta, note
    return None, None, f"{'; '.join(problems)}: no readable checkpoint, the trial starts afresh"


def finished_run_metrics(info: dict, trial_id: str, key: str | None = None) -> dict[str, float] | None:
    """The metrics of the trial's child run (the latest value of each: the final metrics and the
    last epoch's) if MLflow already has the run FINISHED, else None.

    A trial closes its child run FINISHED just before it reports its final result to Ray; an
    interrupt or a crash in between leaves Ray without that result, and ``dpsweep resume`` (or a
    retry) would train and evaluate the trial again. ``run_trial`` reports these metrics as the
    final result instead and leaves the run as it is: MLflow's FINISHED is what finished
    (issue 24, point 11)."""
    from mlflow.tracking import MlflowClient

    from trainables.tracking import find_trial_run

    client = MlflowClient(info["tracking_uri"])
    run = find_trial_run(client, str(info["experiment_id"]), info.get("parent_run_id"), trial_id, key,
                         driver_session())
    if run is None or run.info.status != "FINISHED":
        return None
    return dict(run.data.metrics)


def driver_session() -> str | None:
    """The dpsweep driver (``dpsweep run`` or ``resume``) this trial runs under: set by
    ``sweeps.runner.ray_init`` for Ray's workers; None under a user's own Tuner."""
    from trainables.tracking import SESSION_ENV

    return os.environ.get(SESSION_ENV) or None


def run_trial(config: dict, schema: type[CommonConfig], mechanism_cls, trainable: str, *, noise_key=None) -> None:
    """Run one trial under Ray Tune (see the module docstring); results go to ``tune.report``.

    ``noise_key``: the sweep's secret (``dpmech.privacy.secret.NoiseKey``, handed over by
    ``tune.with_parameters``); the trial draws from its own key derived from it (``trial_noise_key``).
    What the trial writes (checkpoints, local MLflow artifacts) is the owner's only: it runs under
    the owner's umask (trainables.owner_files), and the process's own is given back after it.

    Returns nothing: Ray would report a returned dict as one more result, after the final one.
    """
    from trainables.owner_files import OWNER_UMASK, owner_umask

    try:
        mask = owner_umask()
    except ValueError:
        mask = OWNER_UMASK
    before = os.umask(mask)
    try:
        _run_trial(config, schema, mechanism_cls, trainable, noise_key=noise_key)
    finally:
        os.umask(before)


def _run_trial(config: dict, schema: type[CommonConfig], mechanism_cls, trainable: str, *, noise_key=None) -> None:
    from ray import tune

    from dpmech.datasets.splits import load_splits
    from trainables.artifacts import log_final_artifacts
    from trainables.diagnostics import FINAL_DIAGNOSTICS, TAG_DIAGNOSTICS, diagnostic_names, drop, epoch_diagnostics
    from trainables.tracking import TAG_DEVICE, TAG_NOISE, TrialTracker, run_name

    cfg = validate_config(config, schema)
    info = mlflow_info(config)
    key = trial_key(cfg, trainable, config)
    done = finished_run_metrics(info, tune.get_context().get_trial_id(), key) if info else None
    if done is not None:  # it finished, but Ray never had its final result: report it, run nothing
        tune.report({**done, "epoch": cfg.epochs, "evaluated": 1.0})
        return
    device = _device()
    train, test = load_splits(cfg.dataset, train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.data_seed)
    x, y = (t.to(device) for t in train.tensors)
    xt, yt = (t.to(device) for t in test.tensors)
    # a selection split (issue 34, point 2): xt/yt become the images selection reads; xh/yh the held-out ones
    x, y, xt, yt, xh, yh = selection_images(x, y, xt, yt, cfg)
    canaries = audit_canaries(cfg, device)
    if canaries is not None:  # the included canaries join the training set (docs/audit.md)
        cx, cy = canaries.members()
        x, y = torch.cat([x, cx]), torch.cat([y, cy])
    tkey = trial_noise_key(cfg, trainable, config, noise_key)
    from trainables.mia_trial import mia_trial  # the mia key: the members join the training set (docs/mia.md)

    mia = mia_trial(cfg, x, y, device, tkey, mechanism_cls)
    if mia is not None:
        x, y = mia.training_data()
    from trainables.label_attack import label_attack_trial  # label_dp: audited labels drawn (docs/mia.md)

    label_attack = label_attack_trial(cfg, x, y, tkey)
    if label_attack is not None:
        y = label_attack.training_labels(y)
    mech = build_mechanism(mechanism_cls, cfg, x, y, device, tkey)
    if cfg.certifier != "default":  # refuse before any training or MLflow run
        smoothing_classifier(mech, cfg, trainable)

    meta: dict[str, Any] = {"mlflow_run_id": None, "history": [], "compute_seconds": 0.0}
    ckpt = tune.get_checkpoint()
    fallback = None
    if ckpt is not None:
        state, restored, fallback = restore_checkpoint(ckpt, device)
        if state is not None:
            mech.load_state_dict(state)
            meta = restored

    ctx = tune.get_context()
    tracker = None
    if info:
        dumped = cfg.model_dump()
        name = run_name(trainable, dumped, (info.get("swept") or {}).get(trainable, ()))
        tracker = TrialTracker.open(info, trial_id=ctx.get_trial_id(), trial_name=name,
                                    trainable=trainable, run_id=meta.get("mlflow_run_id"), key=key,
                                    session=driver_session())
        meta["mlflow_run_id"] = tracker.run_id
        from dpmech.datasets.user_code import (
            source_params,  # a user's model/dataset: its source's hash (this attempt's: tags)
        )

        digests = source_params(dumped)
        logged = [m for m in ("train_loss", *FINAL_DIAGNOSTICS) if m in diagnostic_names(schema)]
        # params once per run (a retry keeps the first attempt's); tags per attempt: a retry may run
        # on another node, with another copy of the user's code
        # model_converted: what the DP-SGD engine replaced in the model (BatchNorm -> GroupNorm), "none"
        converted = getattr(getattr(mech, "trainer", None), "model_converted", None)
        tracker.log_params({"trainable": trainable, **dumped, **digests,
                            **({"repeat": config["repeat"]} if "repeat" in config else {}),
                            **({"model_converted": converted} if isinstance(converted, str) else {})},
                           tags={**{f"dpsweep.{k}": d for k, d in digests.items()},
                                 TAG_DEVICE: device_name(device), TAG_NOISE: noise_tag(cfg),
                                 TAG_DIAGNOSTICS: ", ".join(logged) if cfg.diagnostics else "none"})
        if fallback:
            tracker.set_tag(TAG_CHECKPOINT_FALLBACK, fallback[:5000])
    finished = False
    try:
        diverged = meta.get("diverged")
        while mech.epoch < cfg.epochs and not diverged:
            t0 = time.perf_counter()
            metrics = mech.train_epoch()
            if not cfg.diagnostics:  # a release: the noise-free training-data statistics go nowhere
                metrics = drop(metrics, epoch_diagnostics(metrics, schema))
            metrics["test_acc"] = mech.test_accuracy(xt, yt)
            meta["compute_seconds"] = meta.get("compute_seconds", 0.0) + time.perf_counter() - t0
            epoch = mech.epoch
            meta["history"].append({"epoch": epoch, **metrics})
            diverged = meta["diverged"] = diverged_after(mech, epoch)
            if tracker:
                tracker.log_metrics({k: metrics[k] for k in ("train_loss", "test_acc") if k in metrics}, step=epoch)
            with tempfile.TemporaryDirectory() as tmp:
                _save_checkpoint(Path(tmp), mech, meta)
                note = {"checkpoint_fallback": fallback} if fallback else {}
                fallback = None   # said once, in the first result after the restore
                tune.report({**metrics, "epoch": epoch, **note}, checkpoint=tune.Checkpoint.from_directory(tmp))

        t0 = time.perf_counter()
        last_loss = meta["history"][-1].get("train_loss") if meta["history"] else None
        if diverged:   # nothing to evaluate: a status, not a score (no retry: it would diverge again)
            final = {"metrics": {"diverged": 1.0, **mech.privacy()}, "certification": None, "smoothing": None}
        else:
            final = evaluate(mech, cfg, xt, yt, train_loss=last_loss)
            if xh is not None:   # the same evaluation on images selection never saw: heldout_<metric>
                final["metrics"].update(held_out_metrics(mech, cfg, xh, yh))
        if not cfg.diagnostics:
            final["metrics"] = drop(final["metrics"], diagnostic_names(schema))
        if audit_settings(cfg) is not None and not diverged:  # black-box canaries, or the engine's white-box ones
            final["metrics"].update(run_audit(mech, canaries, cfg, final["metrics"].get("delta", 0.0),
                                              claim=calibrated_epsilon(cfg, final["metrics"])))
        if mia is not None and not diverged:  # the membership attack on the trained model (trainables.mia_trial)
            final["metrics"].update(mia.run(mech, final["metrics"]))
        if label_attack is not None and not diverged:  # label inference on the trained model (trainables.label_attack)
            final["metrics"].update(label_attack.run(mech, final["metrics"]))
        # time spent training and evaluating, without logging and checkpointing (all attempts)
        final["metrics"]["compute_seconds"] = meta.get("compute_seconds", 0.0) + time.perf_counter() - t0
        if tracker:
            tracker.log_metrics(final["metrics"], step=cfg.epochs)
            log_final_artifacts(tracker, mech, final, cfg)
            if diverged:
                tracker.set_tag(TAG_DIVERGED, diverged)
            clear_failure(tracker)   # an earlier attempt's error: its traceback stays under error/
            tracker.finish()
            finished = True
        # the final result also carries the last epoch's metrics: a searcher or scheduler reads
        # whichever it optimises from the last result (not logged again)
        last = {k: v for k, v in (meta["history"][-1] if meta["history"] else {}).items() if k != "epoch"}
        tune.report({**last, **final["metrics"], "epoch": cfg.epochs, "evaluated": 1.0})
    except BaseException as exc:
        # Ray stops a trial (a scheduler's early stop, the end of the sweep) with BaseExceptions of
        # its own: the run is KILLED, not FAILED, and a run already FINISHED stays so.
        if tracker and not finished:
            close_after_failure(tracker, exc)
        raise


def close_after_failure(tracker, exc: BaseException) -> None:
    """Record ``exc`` on the trial's run and close it (FAILED; KILLED for Ray's own stops), keeping
    the original error whatever the store says. When the tracking store itself is what failed
    (``TrackingDown``: a call just failed through all its attempts) each record gets one attempt,
    and none after the first refused: the sweep stops on that error (``sweeps.runner.TrackingWatch``)
    and ``dpsweep resume`` closes the run the store would not take (issue 49, point 1)."""
    import contextlib

    from trainables.tracking import TrackingDown, single_attempt

    down = isinstance(exc, TrackingDown)
    with single_attempt() if down else contextlib.nullcontext():
        if isinstance(exc, Exception):
            try:
                record_failure(tracker, exc)
            except Exception:  # noqa: BLE001 - keep the original error
                if down:
                    return
        try:
            tracker.finish("FAILED" if isinstance(exc, Exception) else "KILLED")
        except Exception:  # noqa: BLE001 - keep the original error
            pass


HELD_OUT = "heldout_"  # prefix of the metrics measured on the held-out images of a selection split


def held_out_metrics(mech, cfg: CommonConfig, xh: torch.Tensor, yh: torch.Tensor) -> dict[str, float]:
    """Every evaluation metric again on the held-out images of a selection split, as
    ``heldout_<metric>`` (``heldout_acc_clean``, ``heldout_acc_pgd_0.2``, ``heldout_cert_acc_0.1``, ...;
    docs/metrics.md): the score a reader may quote for the chosen configuration, since selection
    never read these images. The privacy figures and the training-loss hint are not evaluations and
    are not repeated."""
    out = evaluate(mech, cfg, xh, yh)["metrics"]
    skip = set(mech.privacy()) | {"loss_near_chance"}
    return {f"{HELD_OUT}{k}": float(v) for k, v in out.items() if k not in skip}


TAG_ERROR = "dpsweep.error"
TAG_CHECKPOINT_FALLBACK = "dpsweep.checkpoint_fallback"
TAG_DIVERGED = "dpsweep.diverged"


def diverged_after(mech, epoch: int) -> str | None:
    """A description when the model's parameters are no longer finite after ``epoch`` (the trial
    diverged: issue 33, point 8), else None. A function of the released parameters only, so the
    check is post-processing and costs no privacy (the training loss, computed on the training
    data without noise, is not used)."""
    bad = [name for name, p in mech.model.named_parameters() if not torch.isfinite(p).all()]
    if not bad:
        return None
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return f"non-finite parameters after epoch {epoch} ({bad[0]}{more}): lower lr or max_grad_norm"


def clear_failure(tracker) -> None:
    """A retry that finished: the run's ``dpsweep.error`` tag (an earlier attempt's) becomes
    ``dpsweep.error_retried`` (the run is FINISHED; the traceback stays in ``error/``)."""
    from trainables.tracking import retry

    tags = retry(lambda: tracker.client.get_run(tracker.run_id), what="get_run").data.tags
    if TAG_ERROR in tags:
        tracker.set_tag("dpsweep.error_retried", tags[TAG_ERROR])
        retry(lambda: tracker.client.delete_tag(tracker.run_id, TAG_ERROR), what="delete_tag(error)")


def record_failure(tracker, exc: BaseException) -> None:
    """A failed trial's run says why (issue 33, point 7): the exception's last line as the tag
    ``dpsweep.error`` and the whole traceback as the artifact ``error/traceback.txt``."""
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    last = f"{type(exc).__name__}: {exc}".strip().splitlines()
    tracker.set_tag(TAG_ERROR, (last[-1] if last else type(exc).__name__)[:5000])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "traceback.txt"
        path.write_text(text)
        tracker.log_artifact(str(path), "error")


def trial_noise_key(cfg: CommonConfig, trainable: str, config: dict, sweep_key=None):
    """The key the trial's privacy-critical draws come from (docs/threat_model.md).

    ``noise_source: seed`` (research mode): the public seed's streams. Otherwise the sweep's secret
    ``sweep_key`` derived for this trial's identity (its trainable, its validated config and its
    repeat: what survives a restart), so the trials' noises are independent and an owner's resume
    draws the same; without a sweep key (a trial run outside ``dpsweep run``) a fresh secret."""
    from dpmech.privacy.secret import NoiseKey

    if cfg.noise_source == "seed":
        return NoiseKey.reproducible(cfg.seed)
    return NoiseKey.resolve(sweep_key).derive(_identity_json(cfg, trainable, config))


def _identity_json(cfg: CommonConfig, trainable: str, config: dict) -> str:
    return json.dumps({"trainable": trainable, "config": cfg.model_dump(mode="json"),
                       "repeat": trial_config(config).get("repeat")}, sort_keys=True, default=str)


def trial_key(cfg: CommonConfig, trainable: str, config: dict) -> str:
    """What identifies a trial across restarts (issue 33, points 1 and 2): a hash of its trainable,
    its validated config and its repeat (and any key of its config beyond the schema), not Ray
    Tune's trial id alone (``dpsweep resume`` restarts an errored trial under a new id). Its child
    run carries it as the tag ``dpsweep.trial_key``: a restarted trial whose run an earlier attempt
    left FAILED or KILLED logs into that run again (``trainables.tracking.find_trial_run``). A
    FINISHED or RUNNING run is found by the Ray trial id only, so two trials of the same config (a
    user's own Tuner may run them) never share a run (docs/faults.md)."""
    extra = {k: v for k, v in config.items() if k != "_mlflow"}
    text = json.dumps({"identity": _identity_json(cfg, trainable, config), "config": extra}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def noise_tag(cfg: CommonConfig) -> str:
    """The ``dpsweep.noise`` tag of a trial: what its epsilon means given where its noise came from."""
    from dpmech.privacy.secret import REPRODUCIBLE_LABEL

    return REPRODUCIBLE_LABEL if cfg.noise_source == "seed" else "secret"


def smoothing_classifier(mech: Mechanism, cfg: CommonConfig, trainable: str = "") -> tuple[torch.nn.Module, float]:
    """The mechanism's ``(base_model, sigma)`` for randomized smoothing; a ValueError naming the
    ``certifier`` key when it has none (no ``smoothing_classifier()``, or it returned None)."""
    fn = getattr(mech, "smoothing_classifier", None)
    out = fn() if fn is not None else None
    if out is None:
        who = f"trainable {trainable!r}" if trainable else type(mech).__name__
        raise ValueError(f"config.certifier: {cfg.certifier!r} needs a model with Gaussian noise on its input, and "
                         f"{who} provides none with this config (no smoothing_classifier()); use certifier: default")
    return out


def evaluate_smoothing(mech: Mechanism, cfg: CommonConfig, x: torch.Tensor, y: torch.Tensor):
    """Randomized smoothing (docs/smoothing.md): CERTIFY with ``smoothing_n0`` selection and
    ``certify_n`` estimation draws at ``smoothing_alpha``, and PREDICT with ``certify_n`` draws, on
    the same images; each from its own generator seeded from the trial's seed. Returns the
    ``SmoothingResult`` (PREDICT's answers in ``smoothed_prediction``) and its metrics."""
    from dpmech.robustness import smoothing

    base, sigma = smoothing_classifier(mech, cfg)
    param = next(base.parameters(), None)
    device = param.device if param is not None else x.device
    gens = [torch.Generator(device=device).manual_seed(cfg.seed * 2 + 1_000_003 + i) for i in range(2)]
    result = smoothing.certify(base, sigma, x, y, n0=cfg.smoothing_n0, n=cfg.certify_n, alpha=cfg.smoothing_alpha,
                               generator=gens[0])
    result.smoothed_prediction = smoothing.predict(base, sigma, x, n=cfg.certify_n, alpha=cfg.smoothing_alpha,
                                                   generator=gens[1])
    return result, smoothing.smoothing_metrics(result, cfg.certify_sizes)


def evaluate(mech: Mechanism, cfg: CommonConfig, xt: torch.Tensor, yt: torch.Tensor, *,
             train_loss: float | None = None) -> dict:
    """Conventional accuracy (clean and each attack at each size), the did-not-learn flag, then
    certification.

    A mechanism whose predictions are not its model's plain forward pass (DPAL's verified
    inference) provides ``conventional_accuracy(x, y, cfg)``; the others use
    ``dpmech.robustness.evaluation.conventional_accuracy`` on ``mech.model``. Both attack the labels
    ``cfg.attack_labels`` names (true by default). ``not_learned`` (docs/metrics.md) comes from
    ``acc_clean`` (or ``mse``); ``loss_near_chance``, a hint only, from ``train_loss``, the last
    epoch's training loss. ``cfg.certifier``
    selects the mechanism's own certifier (``final["certification"]``, ``cert_acc_<size>``),
    randomized smoothing (``final["smoothing"]``, ``smooth_*`` metrics) or both.
    """
    from dpmech.datasets.splits import num_classes
    from dpmech.robustness.evaluation import (
        certified_accuracy_curve,
        conventional_accuracy,
        did_not_learn,
        loss_near_chance,
    )

    if hasattr(mech, "conventional_accuracy"):
        metrics = mech.conventional_accuracy(xt, yt, cfg)
    else:
        metrics = conventional_accuracy(
            mech.model, xt, yt, attacks=cfg.attacks, norm=cfg.attack_norm, n_predict=cfg.n_predict,
            eot_samples=cfg.eot_samples, steps=cfg.attack_steps, seed=cfg.seed, attack_labels=cfg.attack_labels)
    if "mse" in metrics:  # regression (label_dp task regression): the MSE rule
        metrics["not_learned"] = did_not_learn(num_classes=num_classes(cfg.dataset), mse=metrics["mse"], y_values=yt)
    else:
        metrics["not_learned"] = did_not_learn(
            num_classes=num_classes(cfg.dataset), acc_clean=metrics.get("acc_clean"), n_test=int(xt.shape[0]), y=yt)
        hint = loss_near_chance(num_classes=num_classes(cfg.dataset), train_loss=train_loss,
                                loss_is_cross_entropy=type(cfg).loss_is_cross_entropy)
        if hint is not None:  # a hint beside not_learned, never a verdict (docs/metrics.md)
            metrics["loss_near_chance"] = hint
    result = smooth = None
    if cfg.certify_images > 0:
        k = min(cfg.certify_images, xt.shape[0])
        # the images certified: certify_images, or fewer when the evaluation split is smaller (the
        # default 500 on a small test_size; an explicit oversize value is refused at validation)
        metrics["certified_images"] = int(k)
        if cfg.certifier in ("default", "both"):
            result = mech.certify(xt[:k], yt[:k], cfg)
            if result is not None:
                metrics.update(certified_accuracy_curve(result, cfg.certify_sizes))
                metrics["acc_clean_expected"] = result.accuracy()
        if cfg.certifier in ("smoothing", "both"):
            smooth, smooth_metrics = evaluate_smoothing(mech, cfg, xt[:k], yt[:k])
            metrics.update(smooth_metrics)
    metrics.update(mech.privacy())
    return {"metrics": metrics, "certification": result, "smoothing": smooth}


def audit_canaries(cfg: CommonConfig, device: torch.device):
    """The canaries of the privacy audit (None without ``audit_canaries``): drawn from examples in
    neither the training nor the evaluation set, the same on every attempt of the trial."""
    s = audit_settings(cfg)
    if s is None or s.mode != "blackbox":   # white-box canaries live in the engine (trainables.audit_config)
        return None
    from dpmech.datasets.splits import load_held_out, num_classes
    from dpmech.privacy.audit.one_run import make_canaries

    pool = load_held_out(cfg.dataset, train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.data_seed)
    x, y = pool.tensors
    c = make_canaries(x, y, s.canaries, num_classes(cfg.dataset), cfg.seed)
    c.x, c.y = c.x.to(device), c.y.to(device)
    return c


def audit_settings(cfg: CommonConfig):
    """The trial's audit settings, or None (trainables.audit_config.settings)."""
    from trainables.audit_config import settings

    return settings(cfg)


def calibrated_epsilon(cfg: CommonConfig, metrics: dict) -> float | None:
    """The epsilon the trial was calibrated to, the claim its audit tests: the ledger's figure by
    the trial's ``accountant`` (``epsilon_pld`` for ``accountant: pld``, whose RDP ``epsilon`` is
    looser: 3.312 for a PLD target of 3.000), else ``epsilon``."""
    if getattr(cfg, "accountant", "rdp") == "pld" and metrics.get("epsilon_pld") is not None:
        return float(metrics["epsilon_pld"])
    return metrics.get("epsilon")


def gaussian_mu(trainer) -> float | None:
    """mu of the white-box audit's mechanism where it is exactly Gaussian: the DP-SGD engine at
    q = 1 (every example in every step: T Gaussian steps of sensitivity C, mu = sqrt(T) / sigma);
    None otherwise (a subsampled Gaussian is not mu-GDP for any mu that its epsilon matches)."""
    from dpmech.dpsgd.trainer import DPSGDTrainer

    if not isinstance(trainer, DPSGDTrainer) or trainer.plan.sampling_rate != 1.0 or trainer.noise_multiplier <= 0:
        return None
    return math.sqrt(trainer.ledger.steps) / trainer.noise_multiplier


def run_audit(mech, canaries, cfg: CommonConfig, delta: float, claim: float | None = None) -> dict[str, float]:
    """The audit's metrics (docs/metrics.md): ``audit_epsilon_lb`` and one per estimator, the
    counts, ``audit_beta`` and ``audit_delta`` (the configured level and the trial's delta: every
    bound is recomputable from the logged counts), ``audit_claim`` (``claim``: the epsilon the
    trial was calibrated to, :func:`calibrated_epsilon`) and ``audit_ratio``. White-box: the
    engine's canaries (``mech.trainer.canaries``) scored from every update, ``audit_steps`` and
    ``audit_engine_canaries`` (1: engine canaries, sampled and clipped by the engine; 0: inserted
    Dirac canaries); ``audit_mu_claim`` where the mechanism is exactly Gaussian
    (:func:`gaussian_mu`). Black-box: the mechanism's ``membership_scores`` (its own notion of
    fit, e.g. a GAN critic's score) or the negative loss of its classifier; the flat
    ``audit_canaries`` keys also report ``epsilon_lower_bound``."""
    from dpmech.privacy.audit.estimators import run_estimators
    from dpmech.privacy.audit.one_run import loss_scores

    s = audit_settings(cfg)
    opts = dict(estimators=s.estimator, beta=s.beta, delta=float(delta), guess_fraction=s.guess_fraction, claim=claim)
    if s.mode == "whitebox":
        wb = mech.trainer.canaries
        out = run_estimators(wb.scores, wb.included, gaussian_mu=gaussian_mu(mech.trainer), **opts)
        out["audit_steps"] = float(wb.steps)
        out["audit_engine_canaries"] = 1.0 if getattr(wb, "kind", "inserted") == "engine" else 0.0
        return out
    if hasattr(mech, "membership_scores"):
        scores = mech.membership_scores(canaries.x, canaries.y)
    else:
        scores = loss_scores(mech.model, canaries.x, canaries.y)
    out = run_estimators(scores, canaries.included, **opts)
    if not cfg.audit:   # the flat keys: today's metric name as well
        out["epsilon_lower_bound"] = out["audit_epsilon_lb_steinke"]
    return out

