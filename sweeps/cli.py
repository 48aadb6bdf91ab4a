"""The ``dpsweep`` command line: run, resume, validate, mechanisms, report.

Exit codes: 0 success; 2 invalid input (reported before Ray starts or any MLflow run exists);
1 trials that still failed after their retries, or a runtime failure (the parent run FAILED);
130 interrupted (Ctrl-C / SIGINT: the parent run KILLED, ``dpsweep resume`` finishes it); 143 the
same for SIGTERM (``sweeps.signals``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


def _tool(name: str) -> str:
    """How the user can call ``name`` (dpsweep, mlflow): bare if it is on PATH, else the
    script next to this Python (e.g. .venv/bin/dpsweep when the venv is not activated)."""
    import shutil

    here = Path(sys.executable).parent / name
    found = shutil.which(name)
    if found and Path(found).resolve() == here.resolve():
        return name
    if here.exists():
        try:
            return str(here.relative_to(Path.cwd()))
        except ValueError:
            return str(here)
    return name


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: comma-separated numbers, got {text!r}") from None
    if not sizes or any(not (0 <= s < float("inf")) for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes: finite sizes >= 0, got {text!r}")
    return sizes


def _err(msg: str) -> None:
    print(f"dpsweep: error: {msg}", file=sys.stderr, flush=True)


def _warn_spec(spec) -> None:
    for line in getattr(spec, "warnings", None) or ():
        print(f"dpsweep: warning: {line}", file=sys.stderr, flush=True)


def _storage_path(cli: str | None, spec_storage: str | None) -> str:
    # DPSWEEP_STORAGE: the cluster's shared storage (set on the head by cluster.yaml)
    s = cli or os.environ.get("DPSWEEP_STORAGE") or spec_storage or "./ray_results"
    return s if "://" in s else str(Path(s).expanduser().resolve())


def _datasets(trials: list[dict], spec) -> set[str]:
    names = {t.get("dataset") for t in trials if t.get("dataset")}
    if not names:
        names = {(spec.common or {}).get("dataset", "mnist")}
    return names


def cmd_validate(args) -> int:
    from sweeps.spec import SpecError, expand_trials, load_spec

    try:
        spec = load_spec(args.spec, args.set, getattr(args, "only", None))
        n = len(expand_trials(spec)) if spec.search.algorithm != "optuna" else spec.search.num_samples
    except SpecError as exc:
        _err(str(exc))
        return EXIT_INVALID
    _warn_spec(spec)
    from sweeps.words import counted

    count = "K candidate trials, drawn at run time" if spec.tuning_privacy is not None else counted(n, "trial")
    print(f"{args.spec}: valid ({count}, trainables: {', '.join(t.name for t in spec.trainables)})")
    if spec.tuning_privacy is not None and spec._tuning_summary is not None:
        from sweeps.spec.tuning import describe_analyses

        print(describe_analyses(spec._tuning_summary))
    return EXIT_OK


def _allowed(field) -> str:
    """The values a config field takes, in words: Literal options, numeric bounds, the type."""
    import types
    import typing

    def describe(tp) -> list[str]:
        origin = typing.get_origin(tp)
        if origin is typing.Literal:
            return [" | ".join(repr(a) for a in typing.get_args(tp))]
        if origin in (typing.Union, types.UnionType):
            return [p for a in typing.get_args(tp) for p in describe(a)]
        if origin is typing.Annotated:  # Annotated[int, Field(gt=0)]: the type with its own bounds
            inner, *meta = typing.get_args(tp)
            own = [b for m in meta for b in _bounds(getattr(m, "metadata", None) or [m])]
            return [f"{d} ({', '.join(own)})" if own else d for d in describe(inner)]
        if tp is type(None):
            return ["null"]
        if typing.get_origin(tp) is not None:  # dict[str, list[float]]
            return [str(tp).replace("typing.", "")]
        return [getattr(tp, "__name__", None) or str(tp).replace("typing.", "")]

    parts = describe(field.annotation)
    bounds = _bounds(field.metadata)
    text = " | ".join(parts)
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _bounds(metadata) -> list[str]:
    """Numeric bounds and length rules of pydantic field metadata, in words (``> 0``)."""
    bounds = []
    for m in metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{sym} {getattr(m, attr)}")
        if getattr(m, "min_length", None):
            bounds.append(f"at least {m.min_length} item(s)")
    return bounds


def cmd_mechanisms(args) -> int:
    from sweeps.spec.space import did_you_mean
    from trainables.registry import REGISTRY

    names = getattr(args, "name", None)
    if names:
        unknown = [n for n in names if n not in REGISTRY]
        if unknown:
            _err(f"mechanisms: unknown trainable {unknown[0]!r}{did_you_mean(unknown[0], REGISTRY)}; "
                 f"known: {', '.join(REGISTRY)}")
            return EXIT_INVALID
        for name in names:
            entry = REGISTRY[name]
            print(f"{entry.name}: {entry.description}")
            print(f"epsilon protects: {entry.epsilon_protects}")
            print()
            rows = [(key, repr(field.get_default(call_default_factory=True)), _allowed(field), field.description or "")
                    for key, field in entry.config_model.model_fields.items()]
            widths = [max(len(r[i]) for r in rows + [("key", "default", "allowed", "")]) for i in range(3)]
            head = ("key", "default", "allowed")
            print("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  meaning")
            for r in rows:
                print("  ".join(v.ljust(w) for v, w in zip(r[:3], widths)) + "  " + r[3])
            print()
        return EXIT_OK
    for entry in REGISTRY.values():
        print(f"{entry.name}: {entry.description}")
        print(f"  epsilon protects: {entry.epsilon_protects}")
        for key, field in entry.config_model.model_fields.items():
            default = field.get_default(call_default_factory=True)
            print(f"    {key:<20} default {default!r:<12} {field.description or ''}")
        print()
    print(f"one trainable with the allowed values of each key: {_tool('dpsweep')} mechanisms NAME")
    return EXIT_OK


def cmd_run(args) -> int:
    """``dpsweep run`` under ``sweeps.signals.Interrupts``: SIGINT or SIGTERM at any moment exits
    130 or 143 (issue 24, point 10). Before the parent run exists nothing is recorded; from then
    on the sweep stops through ``_interrupted``: the parent run and its RUNNING child runs KILLED,
    the resume command printed."""
    return _under_interrupts(_run, args, "before the sweep started: no MLflow run was created, nothing to resume")


def _under_interrupts(body, args, before: str) -> int:
    """``body(args, interrupts, sweep)`` under the driver's SIGINT/SIGTERM handling; ``sweep`` fills in
    with the parent run's info, the experiment directory and the trial count once they exist, and an
    interrupt before that says ``before``."""
    from sweeps.signals import Interrupts

    sweep: dict = {}
    with Interrupts() as interrupts:
        try:
            return body(args, interrupts, sweep)
        except KeyboardInterrupt:
            if "info" in sweep:
                return _interrupted(sweep["info"], sweep["exp_dir"], None, sweep["total"], interrupts)
            print(f"dpsweep: interrupted ({interrupts.name}) {before}", file=sys.stderr, flush=True)
            return interrupts.exit_code
        finally:
            if sweep.get("lock") is not None:   # the experiment's driver lock (sweeps.driver_lock)
                sweep["lock"].release()


def _cell(value) -> str:
    """One value of the --dry-run table: mappings and lists as compact JSON, at most 40 characters."""
    if isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(",", ":"), default=str)
        return text if len(text) <= 40 else text[:39] + "…"
    return value


def dry_run_listing(trials: list[dict], *, show_all: bool = False) -> str:
    """``--dry-run``'s table: ``trainable``, then the keys whose value differs between the trials (the
    swept keys, seeds of repeats included), then the keys a spec sets away from their trainable's
    default; the keys every trial leaves at its default are counted, not shown, unless ``show_all``
    (``--all``). A line above the table names the three groups."""
    from sweeps.runner import format_table
    from trainables.registry import REGISTRY

    def default(name, k):
        entry = REGISTRY.get(name)
        field = entry.config_model.model_fields.get(k) if entry is not None else None
        return field.get_default(call_default_factory=True) if field is not None else None

    from sweeps.report.best import varying_within

    keys = [k for k in dict.fromkeys(k for t in trials for k in t) if k != "trainable"]
    # swept: two or more values within one trainable's trials; a key whose values only tell trainables apart
    # (their defaults) is not swept (issue 51.5), and shows under "set" only where a spec moved it
    swept = varying_within(trials, keys)
    changed = [k for k in keys if k not in swept and any(k in t and t[k] != default(t.get("trainable"), k)
                                                         for t in trials)]
    hidden = [k for k in keys if k not in swept and k not in changed]
    cols = ["trainable", *swept, *changed, *(hidden if show_all else [])]
    rows = [{c: _cell(t.get(c, "")) for c in cols} for t in trials]
    parts = [f"swept: {', '.join(swept) or 'nothing'}", f"set: {', '.join(changed) or 'nothing'}"]
    if hidden:
        parts.append(f"{len(hidden)} keys at their defaults " + ("(shown last)" if show_all else "not shown (--all shows them)"))
    return "; ".join(parts) + "\n" + format_table(rows)


def _run(args, interrupts, sweep: dict) -> int:
    from sweeps.spec import SpecError, expand_trials, load_spec, ray_param_space, spec_to_flat_params

    try:
        overrides = list(args.set)
        if args.name:  # names the sweep (its directory, the parent run) and the MLflow experiment
            overrides += [f"name={json.dumps(args.name)}", f"mlflow.experiment={json.dumps(args.name)}"]
        spec = load_spec(args.spec, overrides, getattr(args, "only", None))
        noise_key = None
        if not args.dry_run:  # the sweep's secret: K, the candidates and every trial's noise (docs/threat_model.md)
            from dpmech.privacy.secret import NoiseKey

            noise_key = NoiseKey.fresh()
            spec.bind_noise_key(noise_key)
        trials = expand_trials(spec) if spec.search.algorithm != "optuna" else []
        param_space = ray_param_space(spec)
    except SpecError as exc:
        _err(str(exc))
        return EXIT_INVALID
    from sweeps.tracking import resolve_tracking_uri

    _warn_spec(spec)
    tracking_uri = resolve_tracking_uri(args.tracking_uri, spec.mlflow.tracking_uri)
    storage = _storage_path(args.storage, spec.storage)
    total = len(trials) if spec.search.algorithm != "optuna" else spec.search.num_samples
    tuning = None
    if spec.tuning_privacy is not None:
        from sweeps.spec.tuning import describe_analyses, tuning_summary

        try:
            tuning = spec._tuning_summary or tuning_summary(spec)
        except (SpecError, ValueError) as exc:
            _err(str(exc))
            return EXIT_INVALID
        tp = spec.tuning_privacy
        print(f"tuning privacy: K candidates drawn from the sweep's secret ({tp.distribution}, mean {tp.mean:g}; K "
              f"stays in the owner's working state, never in the release: the guarantee assumes it unobserved); "
              f"only the best by {spec.search.metric} is "
              f"released; end-to-end epsilon {tuning['tuning_epsilon']:.4g} at delta {tuning['tuning_delta']:.3g} "
              f"(one trial: at most {tuning['trial_epsilon_worst']:.4g})", flush=True)
        print(describe_analyses(tuning), flush=True)
    from sweeps.words import counted

    count = "K candidate trials" if spec.tuning_privacy is not None else counted(total, "trial")
    print(f"sweep {spec.name}: {count} of {', '.join(t.name for t in spec.trainables)}; "
          f"storage {storage}; MLflow {tracking_uri} (experiment {spec.mlflow.experiment})", flush=True)
    if spec.reproducible_noise:
        from dpmech.privacy.secret import REPRODUCIBLE_LABEL

        print(f"noise_source: seed (research mode): {REPRODUCIBLE_LABEL}", flush=True)
    if args.dry_run:
        if spec.tuning_privacy is not None:
            print("(K and the candidates are drawn from the sweep's secret when it starts; none is shown)")
            return EXIT_OK
        print(dry_run_listing(trials, show_all=args.all) if trials
              else "(trials are proposed by Optuna while the sweep runs)")
        return EXIT_OK
    if not _tracking_ok(tracking_uri):  # a few seconds at most, before Ray starts or any MLflow run
        return EXIT_INVALID
    if not _space_ok(storage, tracking_uri):
        return EXIT_INVALID

    from dpmech.datasets.splits import ensure_available

    for name in sorted(_datasets(trials, spec)):
        print(f"preparing dataset {name} ...", flush=True)
        try:
            ensure_available(name)
        except Exception as exc:  # noqa: BLE001
            _err(f"dataset {name!r} is not available: {exc}")
            return EXIT_FAILED

    from sweeps.runner import RayUnreachable, build_tuner, ray_init, save_state, swept_keys, unique_run_name
    from sweeps.tracking import start_parent_run

    fresh = _fresh_paths(tracking_uri, storage)
    try:
        print(ray_init(spec), flush=True)
    except RayUnreachable as exc:   # nothing of this run stays behind (issue 49, point 6)
        _remove_fresh(fresh)
        _err(str(exc))
        return EXIT_INVALID
    interrupts.install()  # ray.init replaced the SIGTERM handler with one that exits at once
    from sweeps.cluster_checks import artifact_warning

    # on a cluster: shared storage, a tracking server (docs/cluster.md); before any MLflow run
    gpu = _checked_cluster(spec, storage, tracking_uri)
    if gpu is None:
        return EXIT_INVALID
    interrupts.begin_graceful()  # from the parent run on, a first signal stops the sweep through Tune
    run_name = unique_run_name(spec.name, storage)  # <name>-<timestamp>-<random>: its own directory
    exp_dir = f"{storage.rstrip('/')}/{run_name}"
    if "://" not in exp_dir:   # one driver per sweep, for this process's lifetime (issue 49.3)
        from sweeps.driver_lock import DriverLock

        sweep["lock"] = DriverLock(exp_dir).acquire("run")
    from sweeps.secret_store import save_secret

    secret_path = save_secret(exp_dir, run_name, noise_key)  # owner-only, before anything can draw from it
    from sweeps.tracking import TrackingFailed

    try:
        info = start_parent_run(tracking_uri, spec.mlflow.experiment or spec.name, run_name, spec.raw,
                                spec_to_flat_params(spec), planned=total)
    except TrackingFailed as exc:   # nothing ran: the experiment directory (the secret only) goes too
        if secret_path and "://" not in exp_dir:
            import shutil

            shutil.rmtree(exp_dir, ignore_errors=True)
        _err(str(exc))
        return EXIT_FAILED
    sweep.update(info=info, exp_dir=exp_dir, total=total)
    info["swept"] = swept_keys(spec, trials)  # names the child runs
    info["candidates"] = spec.tuning_privacy is not None  # the console calls them candidates, not repeats
    if spec.failure.trial_timeout:   # each attempt's time limit, kept inside the trial (trainables.watchdog)
        info["trial_timeout"] = float(spec.failure.trial_timeout)
    artifact_warning(info)
    if "://" not in storage:
        from sweeps.secret_store import fingerprint

        save_state(Path(exp_dir), {"spec": spec.raw, "mlflow": info, "run_name": run_name, "total": total,
                                   "gpu": gpu, "secret_fingerprint": fingerprint(noise_key)})
    print(f"experiment {exp_dir}; MLflow parent run {info['parent_run_id']}", flush=True)
    print(f"secret:   {secret_path} (the sweep's noise key: owner only, never logged; resume and reproduction need it)",
          flush=True)
    _say_where(spec, info, exp_dir)
    if total == 0:  # tuning_privacy drew K = 0 (Poisson): nothing runs, nothing is released
        from sweeps.tracking import finish_parent_run, record_selection

        record_selection(info, spec, [], tuning)
        finish_parent_run(info, {"trials": 0.0, "trials_failed": 0.0}, "FINISHED")
        print("K = 0 trials drawn: nothing ran and nothing is released (the guarantee holds trivially)")
        return EXIT_OK
    tuner = build_tuner(spec, storage=storage, run_name=run_name, mlflow_info=info, param_space=param_space,
                        total=total, gpu=gpu, noise_key=noise_key)
    return _fit_and_finish(tuner, info, exp_dir, tracking_uri, spec, total, interrupts)


def _fresh_paths(tracking_uri: str, storage: str) -> list[Path]:
    """The local SQLite store and the storage folder, where they do not exist yet: what a run that
    fails before its sweep starts must not leave behind (``_remove_fresh``)."""
    paths = []
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        paths += [db, db.with_name(db.name + "-journal"), db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    if "://" not in storage:
        paths.append(Path(storage))
    return [p for p in paths if not p.exists()]


def _remove_fresh(paths: list[Path]) -> None:
    import shutil

    for path in paths:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        except OSError:
            pass


def _checked_cluster(spec, storage: str, tracking_uri: str) -> float | None:
    """The storage and tracking preflight, then ``_trial_gpu``; None: refused (reported)."""
    from sweeps.cluster_checks import StorageRefused, preflight

    try:
        preflight(storage, tracking_uri)
    except StorageRefused as exc:
        _err(str(exc))
        return None
    return _trial_gpu(spec)


def _trial_gpu(spec) -> float | None:
    """``resources.gpu`` resolved against the running Ray cluster (None: refused, reported)."""
    import ray

    from sweeps.cluster_checks import ResourcesRefused, trial_gpu

    try:
        gpu = trial_gpu(spec.resources.gpu, spec.max_concurrent_trials)
    except ResourcesRefused as exc:
        _err(str(exc))
        return None
    have = ray.cluster_resources().get("GPU", 0.0)
    note = f" (auto; the cluster has {have:g} GPU(s))" if spec.resources.gpu == "auto" else ""
    print(f"resources per trial: cpu {spec.resources.cpu:g}, gpu {gpu:g}{note}", flush=True)
    return gpu


def _say_where(spec, info: dict, exp_dir: str) -> None:
    """Where the sweep's data goes (checkpoints, MLflow runs and artifacts)."""
    from mlflow.tracking import MlflowClient

    from trainables.tracking import retry

    kept = ("kept (keep_checkpoints: true)" if spec.keep_checkpoints
            else "deleted once the trial's results are in MLflow (keep_checkpoints: true keeps them)")
    print(f"data:     checkpoints under {exp_dir}, the latest per trial, {kept}", flush=True)
    try:
        exp = retry(lambda: MlflowClient(info["tracking_uri"]).get_experiment(str(info["experiment_id"])),
                    what="get_experiment", attempts=2)
        where = f", artifacts under {exp.artifact_location}"
    except RuntimeError:
        where = ""
    print(f"          MLflow runs in {info['tracking_uri']} (experiment {spec.mlflow.experiment}, id "
          f"{info['experiment_id']}){where}", flush=True)


def mlflow_ui_hint(tracking_uri: str, experiment_id) -> str:
    """How to look at the sweep in the MLflow UI. The page address names the training view
    (``workflowType=machine_learning``): MLflow 3.17's UI otherwise opens every experiment in its
    GenAI view, whatever the experiment's ``mlflow.experimentKind`` tag says (checked in headless
    Chromium)."""
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/{page}"
    return f"{_tool('mlflow')} ui --backend-store-uri {tracking_uri} --port 5000, then open http://127.0.0.1:5000/{page}"


def _unfinished(results, total: int | None, *, interrupted: bool = False, early_stops: bool = False,
                finished_ids=frozenset()) -> tuple[int, int]:
    """(trials the sweep has not finished, trials finished): one definition for the interrupt line,
    the console's ``[k/N]`` and ``resume`` (issue 24, point 11). A trial finished when Ray has its
    final result (``sweeps.runner.finished``) or its MLflow child run is FINISHED (``finished_ids``:
    it finished, but the sweep stopped before Ray had that result; ``resume`` reports it from MLflow
    without running it again). Errored trials are failures, not unfinished. Ray's TERMINATED does
    not mean finished: Ray's clean-up after an interrupt marks the running trials TERMINATED; only
    a scheduler (``early_stops``, and no interrupt) stops a trial for good before its evaluation.
    Trials never created (``total`` minus the trials Ray has) are unfinished."""
    from sweeps.runner import finished

    trials = list(getattr(results, "_experiment_analysis").trials)
    done = closed = 0
    for t in trials:
        if finished(t) or t.trial_id in finished_ids:
            done += 1
        elif t.status == "ERROR" or (t.status == "TERMINATED" and early_stops and not interrupted):
            closed += 1
    return len(trials) - done - closed + max(0, (total or 0) - len(trials)), done


def _trial_errors(results) -> dict[str, str]:
    """Ray trial id -> the last line of the error Ray recorded for each errored trial (its last
    attempt's: ``sweeps.runner.last_failure_cause``)."""
    return {trial_id: why for trial_id, _config, why in _errored_trials(results)}


def _errored_trials(results) -> list[tuple[str, dict, str]]:
    """(Ray trial id, config, the last attempt's cause) of each trial that failed for good."""
    from sweeps.runner import last_failure_cause

    out = []
    for t in getattr(getattr(results, "_experiment_analysis", None), "trials", []) or []:
        try:
            if t.status == "ERROR":
                out.append((t.trial_id, dict(t.config or {}), (last_failure_cause(t) or "error")[:1000]))
        except Exception:  # noqa: BLE001 - a tag's text only
            continue
    return out


def _finished_in_mlflow(info: dict, strict: bool = False) -> set[str]:
    """The trial ids whose child run under the parent is FINISHED (empty if MLflow cannot say;
    ``strict``: a store that keeps failing, ``TrackingDown``, is raised)."""
    from sweeps.tracking import child_statuses
    from trainables.tracking import TrackingDown

    try:
        return {trial for trial, status in child_statuses(info).items() if status == "FINISHED"}
    except TrackingDown:
        if strict:
            raise
        return set()
    except Exception:  # noqa: BLE001 - the count is a courtesy; Ray's results still decide
        return set()


def _stop_ray() -> None:
    """Shut Ray down (its trial processes with it), so none is left to write to its child run."""
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - the records and the resume line matter more
        pass


def _interrupted(info: dict, exp_dir: str, done: int | None, total: int | None, interrupts=None) -> int:
    """An interrupted sweep (SIGINT, SIGTERM, a second one; at any moment once the parent run
    exists): Ray is shut down first, so no trial process is left to touch its child run (one killed
    while logging would leave it RUNNING, or set it RUNNING again); then the parent run and every
    child run still RUNNING are KILLED, shielded from further signals (``sweeps.signals``), and the
    resume command is printed. Exit 130 (SIGINT) or 143 (SIGTERM)."""
    import contextlib

    from sweeps.tracking import stop_parent_run

    resume = f"{_tool('dpsweep')} resume {exp_dir}"
    with interrupts.shield() if interrupts is not None else contextlib.nullcontext():
        _stop_ray()
        try:
            stop_parent_run(info, "KILLED", f"interrupted; resume with: {resume}")
        except Exception as exc:  # noqa: BLE001 - the resume line matters more
            _err(f"could not mark the MLflow parent run KILLED: {exc}")
        if done is None:
            done = len(_finished_in_mlflow(info))
        left = f"{done} of {total} trials finished; " if total else ""
        signalled = interrupts is not None and interrupts.interrupted
        what = f"interrupted ({interrupts.name})" if signalled else "stopped before every trial finished"
        print(f"dpsweep: {what}: {left}MLflow parent run {info['parent_run_id']} KILLED; "
              f"continue with: {resume}", file=sys.stderr, flush=True)
    if interrupts is not None and not signalled:   # no signal: Tune stopped (issue 33, point 5)
        return EXIT_FAILED
    return interrupts.exit_code if interrupts is not None else EXIT_INTERRUPTED


def _cause(exc: BaseException, kind: type) -> BaseException | None:
    """``exc`` or the first exception of type ``kind`` in its chain (Ray Tune wraps what it raises)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _close_parent(info: dict, status: str, note: str) -> str:
    """Set the parent run ``status``; returns what the console may say of it: the status, or that
    the store refused the write and the run still shows RUNNING (never a status MLflow lacks)."""
    from sweeps.tracking import stop_parent_run

    try:
        stop_parent_run(info, status, note)
        return status
    except Exception as exc:  # noqa: BLE001
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        return f"still shows RUNNING (the tracking store refused the update: {last})"


def _fit_and_finish(tuner, info: dict, exp_dir: str, tracking_uri: str, spec, total: int | None = None,
                    interrupts=None) -> int:
    """``tuner.fit()`` and the sweep's closing (``_after_fit``) with the objects that exist before it
    (the imports: torch, Ray, MLflow, hundreds of thousands) out of the garbage collector's way
    (``gc.freeze``): a full collection walks them all, and the driver triggers one every few
    thousand new objects (Tune's trials and results, MLflow's search results), and the
    interpreter's exit walks them again (issue 49.8: seconds at 1,000 trials). Unfrozen on return;
    at exit, frozen again (``_freeze_at_exit``)."""
    import gc

    _freeze_at_exit()
    gc.freeze()
    try:
        return _fit_and_close(tuner, info, exp_dir, tracking_uri, spec, total, interrupts)
    finally:
        gc.unfreeze()


_FREEZE_AT_EXIT: list[bool] = []


def _freeze_at_exit() -> None:
    """Once per process: an exit handler that takes every object out of the collections the
    interpreter's shutdown makes (nothing needs collecting when the process ends; they cost seconds
    on a driver that held a big sweep's results)."""
    if not _FREEZE_AT_EXIT:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _FREEZE_AT_EXIT.append(True)


def _fit_and_close(tuner, info: dict, exp_dir: str, tracking_uri: str, spec, total: int | None = None,
                   interrupts=None) -> int:
    import contextlib

    from trainables.tracking import TrackingDown

    try:
        # the first SIGINT/SIGTERM stops Tune gracefully (it stops the trials, saves the experiment
        # state and returns; sweeps/signals.py); a second one raises KeyboardInterrupt here
        from sweeps.runner import results_without_histories

        with interrupts.graceful() if interrupts is not None else contextlib.nullcontext(), \
                results_without_histories():
            results = tuner.fit()
    except KeyboardInterrupt:
        return _interrupted(info, exp_dir, None, total, interrupts)
    except Exception as exc:  # noqa: BLE001 - a crashed sweep must not leave its parent RUNNING
        from sweeps.disk import StorageFull

        down = _cause(exc, TrackingDown)
        if down is not None:   # stopped on purpose (sweeps.runner.TrackingWatch), resumable once the store answers
            return _tracking_down(info, exp_dir, tracking_uri, str(down))
        full = _cause(exc, StorageFull)
        if full is not None:   # stopped on purpose, resumable once space is freed
            _stop_ray()
            resume = f"{_tool('dpsweep')} resume {exp_dir}"
            state = _close_parent(info, "KILLED", f"{full}; free space, then: {resume}")
            _err(f"{full}: the sweep stopped; MLflow parent run {info['parent_run_id']} {state}; free space, then "
                 f"continue with: {resume}")
            return EXIT_FAILED
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        state = _close_parent(info, "FAILED", f"{type(exc).__name__}: {first}")
        _err(f"the sweep crashed ({type(exc).__name__}: {first}); MLflow parent run {info['parent_run_id']} "
             f"{state}; logs under {exp_dir}")
        return EXIT_FAILED
    try:   # the driver's own records: a store that keeps failing stops here in one line too (issue 49.1)
        return _after_fit(results, info, exp_dir, tracking_uri, spec, total, interrupts)
    except TrackingDown as exc:
        return _tracking_down(info, exp_dir, tracking_uri, f"the driver: {exc}")


def _tracking_down(info: dict, exp_dir: str, tracking_uri: str, why: str) -> int:
    """The tracking store kept failing through an MLflow call's retries (``TrackingDown``; issue 49,
    point 1): Ray is shut down, the parent run and the RUNNING child runs are set KILLED if the store
    takes it now (one attempt each, ``single_attempt``), and one line names the store, what failed,
    what MLflow shows and ``dpsweep resume``, which closes what the store refused (it sets the
    child runs an earlier driver left RUNNING KILLED, ``reopen_parent_run``) and continues. Exit 1."""
    from sweeps.tracking import stop_parent_run
    from trainables.tracking import single_attempt

    _stop_ray()
    resume = f"{_tool('dpsweep')} resume {exp_dir}"
    what = "tracking server" if tracking_uri.startswith(("http://", "https://")) else "tracking store"
    try:
        with single_attempt():
            stop_parent_run(info, "KILLED", f"the MLflow {what} kept failing ({why}); once it answers: {resume}")
        runs = f"MLflow parent run {info['parent_run_id']} and its running trials' runs KILLED"
    except Exception:  # noqa: BLE001 - it is still down: say what MLflow shows
        runs = (f"MLflow parent run {info['parent_run_id']} and its running trials' runs still show RUNNING (the "
                f"store takes no writes)")
    _err(f"the MLflow {what} at {tracking_uri} keeps failing ({why[:600]}): the sweep stopped; {runs}; once it "
         f"answers, continue with: {resume} (it closes them)")
    return EXIT_FAILED


def _after_fit(results, info: dict, exp_dir: str, tracking_uri: str, spec, total: int | None, interrupts) -> int:
    """``_fit_and_finish`` once ``tuner.fit()`` returned: an unfinished sweep's resume line, or the
    sweep's selection, best trial, closing records and console summary."""
    from sweeps.runner import NOT_LEARNED_LEGEND, format_table, summarize
    from sweeps.tracking import finish_parent_run, record_selection

    experiment = spec.mlflow.experiment or spec.name
    interrupted = interrupts is not None and interrupts.interrupted
    early_stops = spec.scheduler.type != "none"
    unfinished, done = _unfinished(results, total, interrupted=interrupted, early_stops=early_stops)
    if interrupted or unfinished:   # MLflow may have finished what Ray lacks the result of: one search of the
        # children, only then (a finished sweep skips it: a full search costs seconds at 1,000 trials, issue 49.8)
        unfinished, done = _unfinished(results, total, interrupted=interrupted, early_stops=early_stops,
                                       finished_ids=_finished_in_mlflow(info, strict=True))
    if interrupted or unfinished:
        return _interrupted(info, exp_dir, done, total, interrupts)
    from sweeps.report.best import closing_lines, console_metrics, describe_released, label_candidates

    rows, summary, failed = summarize(results, extra_metrics=console_metrics(spec))
    tuning = None
    if spec.tuning_privacy is not None:
        from sweeps.spec.tuning import candidates_beyond_guarantee, ran_trial_epsilon, refuse_guarantee, tuning_summary

        try:   # the guarantee of what ran: the candidates' own per-trial epsilon, checked against their ledgers
            tuning = tuning_summary(spec, ran_trial_epsilon(spec, [r for r in rows if r.get("status") == "DONE"]))
            refuse_guarantee(tuning, spec.tuning_privacy.target_epsilon)
            beyond = candidates_beyond_guarantee(rows, tuning)
        except ValueError as exc:
            beyond = [str(exc)]
        if beyond:
            for line in beyond:
                _err(f"tuning_privacy: {line}")
            _err("nothing is released: the end-to-end guarantee does not cover these candidates")
            from sweeps.tracking import stop_parent_run

            stop_parent_run(info, "FAILED", "tuning_privacy: a candidate ran beyond the end-to-end guarantee")
            return EXIT_FAILED
    released = record_selection(info, spec, rows, tuning)
    if released is not None:
        print(describe_released(spec, released))
    from sweeps.report.best import describe_best, record_best, varying_within
    from sweeps.words import all_of

    from trainables.tracking import TrackingDown

    try:  # the best trial and the compare view, tagged on the parent run (docs/metrics.md)
        best = record_best(info, spec, rows)
    except TrackingDown:
        raise
    except Exception as exc:  # noqa: BLE001 - the trials' results are safe in MLflow; say what is missing
        best = None
        _err(f"could not tag the best trial and the compare view on the parent run: {exc}")
    from sweeps.tracking import record_runless_failures

    record_runless_failures(info, _errored_trials(results))   # every trial has a run that says why (issue 49.5)
    finish_parent_run(info, summary, "FAILED" if failed else "FINISHED", _trial_errors(results))
    print()
    print(format_table(label_candidates(rows, spec)))
    if any(r.get("!") for r in rows):
        print(NOT_LEARNED_LEGEND)
    print()
    if failed:
        print(f"{failed} trial(s) failed after their retries; logs under {exp_dir}")
    if best is not None:
        cfg_keys = dict.fromkeys(k for r in rows for k in r if k.startswith("cfg."))
        print(describe_best(best, varying_within(rows, cfg_keys), len(rows)))
    print(f"report:   {_tool('dpsweep')} report {experiment} --tracking-uri {tracking_uri} --out report/")
    print(f"MLflow:   {mlflow_ui_hint(tracking_uri, info['experiment_id'])}")
    if best is not None and best.compare_url:
        print(f"compare:  {best.compare_url} ({all_of(best.n_runs, 'trial')}: parallel coordinates of the swept keys "
              "against a metric)")
    for line in closing_lines(spec, tuning, best, tracking_uri, experiment):
        print(line)
    print(f"resume:   {_tool('dpsweep')} resume {exp_dir}")
    return EXIT_FAILED if failed else EXIT_OK


def cmd_resume(args) -> int:
    """``dpsweep resume EXPERIMENT_PATH``: finish an interrupted sweep, under the same signal
    handling as ``run`` (``cmd_run``): interrupted again, it exits 130/143 with the parent run
    KILLED and the same resume command."""
    return _under_interrupts(_resume, args, "before the sweep resumed: nothing changed")


def _resume(args, interrupts, sweep: dict) -> int:
    from ray import tune

    from sweeps.runner import load_state, ray_init
    from sweeps.secret_store import check_fingerprint, load_secret, secret_path
    from sweeps.spec import SpecError, validate_spec

    exp_dir = Path(args.experiment_path).expanduser().resolve()
    from sweeps.driver_lock import DriverLock, SweepLocked

    try:
        state = load_state(exp_dir)
        sweep["lock"] = DriverLock(exp_dir).acquire("resume")   # a second driver is refused (issue 49.3)
        spec = validate_spec(state["spec"])
        run_name = state.get("run_name") or exp_dir.name
        noise_key = None if spec.reproducible_noise else load_secret(str(exp_dir), run_name)
        check_fingerprint(noise_key, state.get("secret_fingerprint"), str(secret_path(str(exp_dir), run_name)))
        spec.bind_noise_key(noise_key)
    except (FileNotFoundError, SpecError, ValueError, SweepLocked) as exc:
        _err(str(exc))
        return EXIT_INVALID
    # the experiment folder itself must be writable (a read-only one was found only after Ray started)
    if not _tracking_ok(state["mlflow"]["tracking_uri"]) or not _space_ok(str(exp_dir),
                                                                          state["mlflow"]["tracking_uri"]):
        return EXIT_INVALID
    from sweeps.runner import RayUnreachable

    try:
        print(ray_init(spec), flush=True)
    except RayUnreachable as exc:
        _err(str(exc))
        return EXIT_INVALID
    interrupts.install()  # ray.init replaced the SIGTERM handler with one that exits at once
    from sweeps.runner import build_tuner, sweep_trainable
    from sweeps.spec import ray_param_space
    from sweeps.tracking import reopen_parent_run

    gpu = _checked_cluster(spec, str(exp_dir.parent), state["mlflow"]["tracking_uri"])
    if gpu is None:
        return EXIT_INVALID
    info = state["mlflow"]
    total = state.get("total")
    if tune.Tuner.can_restore(str(exp_dir)):
        trainable = sweep_trainable(spec, state.get("gpu", gpu), noise_key)
        # Ray restores the experiment's callbacks (progress lines, checkpoint clean-up) with it
        tuner = tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True, restart_errored=True)
    else:  # interrupted before Tune saved any experiment state: the trials start under the same parent run
        tuner = build_tuner(spec, storage=str(exp_dir.parent), run_name=state.get("run_name") or exp_dir.name,
                            mlflow_info=info, param_space=ray_param_space(spec), total=total,
                            gpu=state.get("gpu", gpu), noise_key=noise_key)
    interrupts.begin_graceful()
    stale = reopen_parent_run(info)
    sweep.update(info=info, exp_dir=str(exp_dir), total=total)
    closed = (f" ({stale} child run{'s' if stale != 1 else ''} an earlier driver left RUNNING set KILLED; each "
              "trial logs into its own again)") if stale else ""
    print(f"resuming {exp_dir}; MLflow parent run {info['parent_run_id']}{closed}", flush=True)
    _say_where(spec, info, str(exp_dir))
    return _fit_and_finish(tuner, info, str(exp_dir), info["tracking_uri"], spec, total, interrupts)


def cmd_release(args) -> int:
    """``dpsweep release EXPERIMENT --out DIR`` (sweeps.release): exit 2 with one line when the sweep
    cannot be released under its guarantee, nothing written."""
    from sweeps.release import ReleaseRefused, make_release
    from sweeps.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri, None)
    if not _tracking_ok(uri):
        return EXIT_INVALID
    try:
        out = make_release(args.experiment, args.out, uri, args.run)
    except ReleaseRefused as exc:
        _err(str(exc))
        return EXIT_INVALID
    print(f"release bundle: {out} (model/weights.pt, hyperparameters.json, guarantee.json, THREAT_MODEL.md, "
          "MANIFEST.json); publish this folder and nothing else of the sweep")
    return EXIT_OK


def cmd_report(args) -> int:
    from sweeps.report import make_report
    from sweeps.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri, None)
    if not _tracking_ok(uri):
        return EXIT_INVALID
    try:
        out = make_report(args.experiment, uri, Path(args.out), sizes=args.sizes, parent_run_id=args.run)
    except ValueError as exc:
        _err(str(exc))
        return EXIT_INVALID
    print(f"report written to {out}")
    return EXIT_OK


def _space_ok(storage: str, tracking_uri: str) -> bool:
    """Whether the local storage and store have room and are writable (``sweeps.disk``); if not,
    one ``dpsweep: error:`` line naming the path and its free space."""
    from sweeps.disk import storage_problems

    problems = storage_problems(storage, tracking_uri)
    if problems:
        _err("; ".join(problems))
    return not problems


def _tracking_ok(uri: str) -> bool:
    """Whether the MLflow tracking store answers (``sweeps.tracking.check_tracking_store``); if
    not, one ``dpsweep: error:`` line."""
    from sweeps.tracking import TrackingUnreachable, check_tracking_store

    try:
        check_tracking_store(uri)
    except TrackingUnreachable as exc:
        _err(str(exc))
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dpsweep", description="Sweeps of DP and certifiably robust training.")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a sweep spec")
    run.add_argument("spec")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value (repeatable)")
    run.add_argument("--only", action="append", default=[], metavar="TRAINABLE",
                     help="run only this trainable of a multi-trainable spec (repeatable, or A,B)")
    run.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    run.add_argument("--storage", default=None, help="Ray storage path (local dir, NFS mount or s3://)")
    run.add_argument("--name", default=None, help="experiment name (default: the spec's)")
    run.add_argument("--dry-run", action="store_true", help="validate and list the trials, run nothing: the swept keys "
                     "first, then the keys set away from their defaults")
    run.add_argument("--all", action="store_true", help="with --dry-run: every key, the defaults too")
    run.set_defaults(fn=cmd_run)

    res = sub.add_parser("resume", help="finish an interrupted sweep")
    res.add_argument("experiment_path")
    res.set_defaults(fn=cmd_resume)

    val = sub.add_parser("validate", help="check a spec")
    val.add_argument("spec")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    val.add_argument("--only", action="append", default=[], metavar="TRAINABLE",
                     help="validate only this trainable of a multi-trainable spec (repeatable, or A,B)")
    val.set_defaults(fn=cmd_validate)

    mech = sub.add_parser("mechanisms", help="list trainables with their parameters")
    mech.add_argument("name", nargs="*", help="show these trainables with each key's default, allowed values and meaning")
    mech.set_defaults(fn=cmd_mechanisms)

    rep = sub.add_parser("report", help="tables and plots of a sweep from MLflow")
    rep.add_argument("experiment", help="MLflow experiment name")
    rep.add_argument("--tracking-uri", default=None)
    rep.add_argument("--out", default="report")
    rep.add_argument("--sizes", type=_sizes, default=None,
                     help="attack sizes for the certified-accuracy table, e.g. 0.05,0.3 (from the per-example tables)")
    rep.add_argument("--run", action="append", default=None, metavar="ID[,ID...]",
                     help="a sweep's parent run id (default: the latest sweep); repeat it, or give A,B, to compare "
                          "several sweeps in one report")
    rep.set_defaults(fn=cmd_report)

    rel = sub.add_parser("release", help="the bundle a tuning-private sweep's guarantee covers, and nothing else")
    rel.add_argument("experiment", help="MLflow experiment name")
    rel.add_argument("--out", required=True, help="folder to write (new or empty)")
    rel.add_argument("--tracking-uri", default=None)
    rel.add_argument("--run", default=None, metavar="ID", help="the sweep's parent run id (default: the latest sweep)")
    rel.set_defaults(fn=cmd_release)
    return ap


def main(argv: list[str] | None = None) -> int:
    from trainables import quiet_accounting_logs

    quiet_accounting_logs()  # dp-accounting's per-order convergence warnings (trainables/__init__.py)
    from sweeps.tracking import bound_mlflow_http

    bound_mlflow_http()  # a failing tracking server ends a call in minutes, not tens of minutes (docs/faults.md)
    args = build_parser().parse_args(argv)
    from trainables.owner_files import owner_umask

    try:
        mask = owner_umask()
    except ValueError as exc:
        _err(str(exc))
        return EXIT_INVALID
    # the owner's working state (experiment folder, checkpoints, local MLflow store, report) is
    # created owner-only; Ray's local workers inherit the mask (docs/threat_model.md)
    old = os.umask(mask)
    try:
        return args.fn(args)
    finally:
        os.umask(old)


if __name__ == "__main__":
    sys.exit(main())
