"""``dpsweep report``: the trade-offs of a sweep, read back from MLflow.

Writes to ``--out`` (and logs to the sweep's parent run under ``report/``):

* ``trials.csv`` and a Markdown table of every trial's configuration and final metrics;
* ``accuracy_vs_epsilon.png``: conventional accuracy (clean and under each attack) against the
  trial's epsilon, one marker per mechanism;
* ``cert_acc_vs_size.png``: certified accuracy against attack size, one curve per trial,
  coloured by mechanism;
* ``report.md`` tying them together.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from trainables.tracking import TAG_PARENT, TAG_TRAINABLE, retry

_CERT = re.compile(r"^cert_acc_([0-9.eE+-]+)$")


def _latest_sweep(client, exp_id: str):
    runs = retry(lambda: client.search_runs([exp_id], filter_string="tags.`dpsweep.kind` = 'sweep'",
                                            order_by=["attributes.start_time DESC"], max_results=1),
                 what="search_runs")
    return runs[0] if runs else None


def load_trials(experiment: str, tracking_uri: str):
    """(parent run, list of child runs) of the latest sweep in ``experiment``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = retry(lambda: client.get_experiment_by_name(experiment), what="get_experiment_by_name")
    if exp is None:
        raise ValueError(f"experiment: no MLflow experiment named {experiment!r} at {tracking_uri}")
    parent = _latest_sweep(client, exp.experiment_id)
    if parent is None:
        raise ValueError(f"experiment: {experiment!r} holds no dpsweep sweep run")
    flt = f"tags.`{TAG_PARENT}` = '{parent.info.run_id}'"
    children = retry(lambda: client.search_runs([exp.experiment_id], filter_string=flt, max_results=10000),
                     what="search_runs")
    return client, parent, children


def _rows(children) -> list[dict]:
    rows = []
    for run in sorted(children, key=lambda r: r.info.start_time or 0):
        p, m = run.data.params, run.data.metrics
        row = {"run": run.info.run_name or run.info.run_id[:8], "trainable": run.data.tags.get(TAG_TRAINABLE, ""),
               "status": run.info.status}
        for k in ("epsilon", "delta", "attack_bound", "psi", "norm", "seed"):
            if k in p:
                row[f"param.{k}"] = p[k]
        for k in sorted(m):
            if k in ("epsilon", "delta") or k.startswith("acc_") or k.startswith("cert_acc_"):
                row[k] = m[k]
        rows.append(row)
    return rows


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return cols


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _plot_accuracy_vs_epsilon(children, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for run in children:
        m = run.data.metrics
        if "epsilon" not in m:
            continue
        mech = run.data.tags.get(TAG_TRAINABLE, "?")
        for k, val in m.items():
            if k.startswith("acc_") and k != "acc_clean_expected":
                series.setdefault((mech, k), []).append((m["epsilon"], val))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    markers = "osD^v<>PX*"
    mechs = sorted({m for m, _ in series})
    metrics = sorted({k for _, k in series}, key=lambda k: (k != "acc_clean", k))
    for (mech, metric), pts in sorted(series.items()):
        # points, not lines: trials at one epsilon can differ in every other parameter
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[mechs.index(mech) % len(markers)],
                   color=plt.cm.tab10(metrics.index(metric) % 10), label=f"{mech}: {metric}", alpha=0.85)
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (reported by the trial)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _plot_cert_curves(children, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mechs = sorted({r.data.tags.get(TAG_TRAINABLE, "?") for r in children})
    styles = {m: ("-", "--", ":", "-.")[i % 4] for i, m in enumerate(mechs)}
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    drawn = False
    for i, run in enumerate(children):
        pts = sorted((float(mt.group(1)), val) for k, val in run.data.metrics.items() if (mt := _CERT.match(k)))
        if not pts:
            continue
        mech = run.data.tags.get(TAG_TRAINABLE, "?")
        p = run.data.params
        label = f"{mech} " + " ".join(f"{k}={p[k]}" for k in ("epsilon", "attack_bound", "psi") if k in p)
        ax.plot([q[0] for q in pts], [q[1] for q in pts], marker=".", ls=styles[mech], color=plt.cm.tab10(i % 10),
                label=label, alpha=0.85)
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("attack size ([-1, 1] input domain)")
    ax.set_ylabel("certified accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def make_report(experiment: str, tracking_uri: str, out: Path) -> Path:
    """Write the report of the latest sweep in ``experiment`` to ``out``; returns report.md."""
    client, parent, children = load_trials(experiment, tracking_uri)
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows(children)
    cols = _columns(rows)
    with open(out / "trials.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    figures = []
    if _plot_accuracy_vs_epsilon(children, out / "accuracy_vs_epsilon.png"):
        figures.append(("Accuracy against epsilon", "accuracy_vs_epsilon.png"))
    if _plot_cert_curves(children, out / "cert_acc_vs_size.png"):
        figures.append(("Certified accuracy against attack size", "cert_acc_vs_size.png"))
    eps = [r["epsilon"] for r in rows if isinstance(r.get("epsilon"), float) and math.isfinite(r["epsilon"])]
    lines = [f"# Sweep report: {experiment}", "",
             f"Parent run `{parent.info.run_id}` ({parent.info.run_name}), {len(rows)} trials, tracking URI "
             f"`{tracking_uri}`.", ""]
    if eps:
        lines += [f"Per-trial epsilon ranges from {min(eps):.4g} to {max(eps):.4g}. Where epsilon protects the "
                  "training data, choosing the best of these trials on the same private data is itself a use of "
                  "that data: the selection among trials is not covered by any privacy guarantee reported here.", ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    for title, fname in figures:
        lines += ["", f"## {title}", "", f"![{title}]({fname})"]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    for f in [report, out / "trials.csv", *(out / fname for _, fname in figures)]:
        retry(lambda f=f: client.log_artifact(parent.info.run_id, str(f), "report"), what="log_artifact(report)")
    return report
