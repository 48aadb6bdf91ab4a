"""``dpsweep release EXPERIMENT --out DIR``: exactly what a tuning-private sweep's guarantee covers
(issue 32.2; docs/threat_model.md, docs/tuning_privacy.md).

Papernot & Steinke's (2022) bound covers releasing the best of K candidates with K random and
unobserved. The bundle holds that and nothing else:

* ``model/weights.pt``: the released candidate's weights;
* ``hyperparameters.json``: its configuration, without seeds;
* ``guarantee.json``: the end-to-end (epsilon, delta), what it protects and the accounting that
  produced it (the tuning distribution, the worst per-candidate epsilon, the accountant), and the
  released candidate's selection score (and, with a selection split, its held-out score);
* ``THREAT_MODEL.md``: who must not learn what, in one paragraph;
* ``MANIFEST.json``: each file with its SHA-256, and what was left out on purpose (K, the other
  candidates, the non-private diagnostics, the seeds, the sweep's secret, the checkpoints).

It refuses (``ReleaseRefused``: one line, exit 2) a sweep whose selection no guarantee covers
(no ``tuning_privacy``), one that released nothing, one whose released candidate drew its noise
from the public seed (``noise_source: seed``) or logged non-private diagnostics. The bundle is
written to an owner-only temporary folder beside ``DIR`` (``.DIR.release-partial-<pid>.*``) and renamed
into place: never half-written; a release killed while writing leaves that folder, and the next
release into ``DIR`` removes it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

THREAT_MODEL = (
    "The guarantee is (epsilon, delta)-differential privacy of this bundle for the {protects}: the addition or "
    "removal of one of them changes the bundle's distribution by at most (epsilon, delta), against an adversary who knows everything else: the code, the search "
    "space, the public seeds, every other training example, and this bundle. It assumes the adversary does not learn "
    "the sweep's secret key (from which the candidates' sampling and noise, the number of candidates K and their "
    "hyperparameters were drawn), K, the other candidates, or any metric computed on the training data without noise; "
    "those stay with the sweep's owner. Not covered: side channels (timing, memory), floating-point attacks on the "
    "noise samplers, and anything published besides this bundle (a second release composes with this one).\n")

LEFT_OUT = {
    "K": "the number of candidates: the bound assumes it random and unobserved (revealing it can raise epsilon many fold)",
    "other candidates": "their models, hyperparameters and scores: only the best one is covered",
    "non-private diagnostics": "statistics of the training data computed without noise (docs/metrics.md)",
    "seeds": "seed and data_seed: public and data-independent, but not needed to use the model",
    "sweep secret": "the key the noise was drawn from: whoever holds it can replay the noise",
    "checkpoints": "they hold the generators' states (the noise) and the optimizer's",
}

DROPPED_KEYS = {"seed", "data_seed", "repeat", "_mlflow", "trainable", "noise_source"}


class ReleaseRefused(ValueError):
    """The sweep cannot be released under its guarantee (one line: what and why)."""


def _parent_run(client, experiment: str, run_id: str | None):
    if run_id:
        run = client.get_run(run_id)
        if run.data.tags.get("dpsweep.kind") != "sweep":
            raise ReleaseRefused(f"--run {run_id}: not a dpsweep sweep's parent run")
        return run
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ReleaseRefused(f"experiment {experiment!r}: not found in the tracking store")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`dpsweep.kind` = 'sweep'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise ReleaseRefused(f"experiment {experiment!r}: no dpsweep sweep in it")
    return runs[0]


def _spec_of(client, parent) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(parent.info.run_id, "spec.yaml", tmp)
        return yaml.safe_load(Path(path).read_text())


def _value(text: str):
    """A logged param back to its value (MLflow stores strings): JSON, else YAML, else a number, else the text."""
    if text == "None":   # MLflow writes a None param as its str()
        return None
    for parse in (json.loads, yaml.safe_load, float):
        try:
            value = parse(text)
        except (ValueError, yaml.YAMLError):
            continue
        if not isinstance(value, str):
            return value
    return text


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_releasable(client, parent) -> tuple[dict, object]:
    """(spec, released child run), or ReleaseRefused naming what stops the release."""
    from trainables.diagnostics import EPOCH_DIAGNOSTICS, FINAL_DIAGNOSTICS, TAG_DIAGNOSTICS, diagnostic_names
    from trainables.registry import REGISTRY

    name = parent.data.tags.get("mlflow.runName", parent.info.run_id)
    spec = _spec_of(client, parent)
    if not spec.get("tuning_privacy"):
        raise ReleaseRefused(f"sweep {name}: no tuning_privacy, so choosing its best trial is covered by no guarantee; "
                             "there is nothing to release (docs/tuning_privacy.md)")
    if parent.info.status != "FINISHED":
        raise ReleaseRefused(f"sweep {name}: its parent run is {parent.info.status}, not FINISHED (resume it first)")
    eps = parent.data.metrics.get("tuning_epsilon")
    # MLflow stores an infinite metric as the largest float
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps >= sys.float_info.max:
        raise ReleaseRefused(f"sweep {name}: its end-to-end epsilon is not finite ({eps}): no guarantee to release")
    from sweeps.spec.tuning import epsilon_total_by_analysis

    by = {k: v for k, v in epsilon_total_by_analysis(parent.data.metrics).items() if math.isfinite(v)}
    if by and not math.isclose(eps, min(by.values()), rel_tol=1e-9):
        raise ReleaseRefused(f"sweep {name}: its end-to-end epsilon {eps:.6g} is not the smallest of its analyses' "
                             f"figures ({', '.join(f'{k} {v:.6g}' for k, v in by.items())}): no guarantee to release")
    target = (spec.get("tuning_privacy") or {}).get("target_epsilon")
    if isinstance(target, (int, float)) and eps > target * (1 + 1e-6):
        raise ReleaseRefused(f"sweep {name}: its end-to-end epsilon {eps:.6g} is above the spec's target_epsilon {target:g}")
    child_id = parent.data.tags.get("dpsweep.released_run_id")
    if not child_id:
        raise ReleaseRefused(f"sweep {name}: no candidate was released (none finished, or none was drawn)")
    child = client.get_run(child_id)
    noise = child.data.tags.get("dpsweep.noise", "")
    if noise != "secret":
        raise ReleaseRefused(f"sweep {name}: the released candidate drew its noise from the public seed "
                             f"(noise_source: seed, {noise or 'untagged'}): its epsilon is no guarantee for a release")
    # what the trial says it logged (its TAG_DIAGNOSTICS, "none" with diagnostics: false) and what it did log
    logged = child.data.tags.get(TAG_DIAGNOSTICS, "untagged")
    entry = REGISTRY.get(child.data.params.get("trainable", ""))
    # the trainable's own diagnostics (DP-MERF's train_loss is a function of its release, not one)
    names = diagnostic_names(entry.config_model) if entry is not None else (*EPOCH_DIAGNOSTICS, *FINAL_DIAGNOSTICS)
    leaked = sorted(set(child.data.metrics) & set(names))
    if logged != "none" or leaked:
        what = ", ".join(leaked) or logged
        raise ReleaseRefused(f"sweep {name}: the released candidate logged non-private diagnostics ({what}), computed on "
                             "the training data without noise; rerun with common.diagnostics: false")
    return spec, child


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.release-partial-"


def _clean_partial(out: Path) -> list[Path]:
    """Remove the folders a release into ``out`` left half-written when it was killed (named
    ``.<out>.release-partial-<pid>.*``, owner-only): those whose process is gone. They hold the
    released weights before the bundle is complete; the next release into ``out`` removes them."""
    removed = []
    prefix = _partial_prefix(out)
    for path in out.parent.glob(prefix + "*"):
        pid = path.name[len(prefix):].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != 0


def make_release(experiment: str, out: str | Path, tracking_uri: str, run_id: str | None = None) -> Path:
    """Write the release bundle of ``experiment``'s latest sweep (or parent ``run_id``) to ``out``."""
    from mlflow.tracking import MlflowClient

    from trainables.registry import get_trainable

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReleaseRefused(f"--out {out}: exists and is not an empty folder")
    client = MlflowClient(tracking_uri)
    parent = _parent_run(client, experiment, run_id)
    spec, child = check_releasable(client, parent)
    pm = parent.data.metrics
    trainable = child.data.params.get("trainable", "")
    entry = get_trainable(trainable) if trainable else None
    metric = (spec.get("search") or {}).get("metric")
    tp = spec["tuning_privacy"]

    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _clean_partial(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_partial_prefix(out)}{os.getpid()}.", dir=out.parent))  # mode 0700
    try:
        (tmp / "model").mkdir()
        try:
            path = client.download_artifacts(child.info.run_id, "model/weights.pt", str(tmp / "model"))
        except Exception:  # noqa: BLE001
            raise ReleaseRefused(f"released run {child.info.run_id}: has no model/weights.pt artifact") from None
        if Path(path) != tmp / "model" / "weights.pt":
            shutil.move(path, tmp / "model" / "weights.pt")
        # the candidate's own target epsilon is named for what it is (issue 51.7): guarantee.json's
        # end-to-end epsilon is the guarantee, not this per-candidate one
        renamed = {"epsilon": "candidate_epsilon", "delta": "candidate_delta"}
        hyper = {"trainable": trainable,
                 **{renamed.get(k, k): _value(v) for k, v in sorted(child.data.params.items())
                    if k not in DROPPED_KEYS and not k.startswith(("audit", "source_"))}}
        if "candidate_epsilon" in hyper:
            hyper["candidate_epsilon_note"] = ("the released candidate's own target epsilon: not the guarantee; "
                                               "quote guarantee.json's end-to-end epsilon")
        (tmp / "hyperparameters.json").write_text(json.dumps(hyper, indent=2, default=str) + "\n")
        from sweeps.spec.tuning import charged_analysis_name, epsilon_total_by_analysis

        analysis = charged_analysis_name(pm)
        guarantee = {
            "epsilon": pm.get("tuning_epsilon"),
            "delta": pm.get("tuning_delta"),
            # the analysis the epsilon is charged under: the smallest of the sound ones that apply
            # (docs/tuning_privacy.md), each one's figure beside it
            "analysis": analysis,
            "epsilon_total_by_analysis": epsilon_total_by_analysis(pm),
            "protects": entry.epsilon_protects if entry else "training examples",
            "accounting": {
                "method": "private hyperparameter selection (Papernot & Steinke 2022, Thms. 2 and 6): the best of K "
                          "candidates, K random and unobserved; per-candidate RDP curves "
                          + ("of the candidate as drawn (a mixture over the search space's privacy configurations)"
                             if analysis == "papernot_steinke_mixture" else "worst case over the search space")
                          + " (dp-accounting)",
                "distribution": tp.get("distribution"), "mean": tp.get("mean"), "shape": tp.get("shape"),
                "candidate_epsilon_worst": pm.get("trial_epsilon_worst"),
                "candidate_delta": _value(child.data.params.get("delta", "null")),
                **({"target_epsilon": tp["target_epsilon"]} if tp.get("target_epsilon") is not None else {}),
            },
            "selection": {"metric": metric, "mode": (spec.get("search") or {}).get("mode"),
                          "score": child.data.metrics.get(metric) if metric else None,
                          # a selection split: the score on test images the selection never read (issue 34.2)
                          **({"held_out_score": child.data.metrics[f"heldout_{metric}"]}
                             if metric and f"heldout_{metric}" in child.data.metrics else {})},
        }
        (tmp / "guarantee.json").write_text(json.dumps(guarantee, indent=2) + "\n")
        (tmp / "THREAT_MODEL.md").write_text("# Threat model\n\n" + THREAT_MODEL.format(protects=guarantee["protects"]))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"files": {str(p.relative_to(tmp)): _sha256(p) for p in files}, "left_out": LEFT_OUT}
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
