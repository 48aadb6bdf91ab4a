"""The report's certified-radius figure and table (issue 36, part 3; sweeps/report/certified.py):
certified accuracy against the l2 radius of randomized smoothing in the [0, 1] pixel domain (the
[-1, 1] radius on a second axis), a curve per configuration, the envelope over sigma per epsilon,
the published anchors, what each epsilon protects, N and the number of certified images; a table
at the [0, 1] radii 0.5 / 1.0 / 1.5 / 2.0 beside the anchors. Trial rows and per-example tables are
built by hand, so every number below is counted from them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

COUNTS = {"param.certify_n": 1000, "param.smoothing_n0": 100, "param.smoothing_alpha": 0.001}


def _table(radii, wrong=()):
    """A smoothing table of 10 images (label 0): ``radii`` in the [-1, 1] domain (0 = not
    certified), the images in ``wrong`` predicted 1."""
    radii = list(radii) + [0.0] * (10 - len(radii))
    pred = [1 if i in wrong else 0 for i in range(10)]
    return pd.DataFrame({"label": [0] * 10, "prediction": pred, "abstained": [r == 0 for r in radii],
                         "radius": radii})


def _sweep():
    from sweeps.report.data import Sweep

    rows, tables = [], {}

    def add(rid, trainable, radii, wrong=(), **params):
        rows.append({"run_id": rid, "run": rid, "trainable": trainable, "status": "FINISHED", **COUNTS,
                     **{f"param.{k}": v for k, v in params.items()},
                     "epsilon": params.get("epsilon") if trainable != "pixeldp" and params.get("epsilon") else np.inf})
        tables[(rid, "smoothing")] = _table(radii, wrong)

    # dpsgd at epsilon 3: sigma 0.5 (two seeds) and sigma 1.0; non-private sigma 0.5 (one wrong prediction)
    add("a0", "dpsgd", [0.5, 1.0, 1.5, 2.0, 2.5], epsilon=3.0, noise_augmentation_sigma=0.5, seed=0)
    add("a1", "dpsgd", [1.0, 2.0, 3.0, 4.0, 5.0], epsilon=3.0, noise_augmentation_sigma=0.5, seed=1)
    add("b0", "dpsgd", [4.5] * 3, epsilon=3.0, noise_augmentation_sigma=1.0, seed=0)
    add("c0", "dpsgd", [3.0] * 8, wrong=(0,), epsilon=None, noise_augmentation_sigma=0.5, seed=0)
    add("p0", "pixeldp", [1.0] * 5, epsilon=1.0, seed=0, noise_after=0)
    add("s0", "secure_sgd", [2.0] * 6, epsilon=2.0, seed=0, noise_after=0)
    rows[-2]["noise_scale"], rows[-1]["noise_scale"] = 1.0, 2.0     # the noise layers' std ([-1, 1] domain)
    return Sweep(None, "e", "sqlite://", None, pd.DataFrame(rows), tables)


REFS = [{"point": "DP-CERT", "metric": "smooth_cert_acc_1", "published": 0.933,
         "_where": {"trainable": "dpsgd", "epsilon": 3.0}},
        {"point": "DP-CERT", "metric": "smooth_cert_acc_2", "published": 0.813,
         "_where": {"trainable": "dpsgd", "epsilon": 3.0}},
        {"point": "elsewhere", "metric": "smooth_cert_acc_1", "published": 0.5,   # matches no trial: not drawn
         "_where": {"trainable": "dpsgd", "epsilon": 8.0}}]


@pytest.fixture
def drawn(tmp_path, monkeypatch):
    """Run the section; keep the figure object that was saved."""
    from sweeps.report import plots as rp
    from sweeps.report.certified import certified_radius_section
    from sweeps.report.page import _md_table

    figs = {}
    real = rp._save

    def save(fig, axes, path, **kw):
        real(fig, axes, path, **kw)
        figs[path.name] = fig

    monkeypatch.setattr(rp, "_save", save)
    sweep = _sweep()
    lines, files = certified_radius_section(sweep, REFS, tmp_path, None, _md_table)
    return sweep, lines, files, figs["certified_radius.png"]


def _lines(fig):
    return {line.get_label().lstrip("_"): line for line in fig.axes[0].get_lines()}


def test_the_figure_draws_a_curve_per_configuration_the_envelope_and_the_anchors(drawn):
    _, _, files, fig = drawn
    ax = fig.axes[0]
    lines = _lines(fig)
    configs = [k for k in lines if not k.startswith("published") and "envelope" not in k]
    assert len(configs) == 5  # dpsgd eps 3 x 2 sigmas, dpsgd non-private, pixeldp, secure_sgd
    eps3 = [k for k in configs if k.startswith("dpsgd eps 3 (DP: training examples): noise_augmentation_sigma=")]
    assert len(eps3) == 2 and any("n=2" in k for k in eps3)
    (env,) = [k for k in lines if "envelope" in k]
    assert env == "dpsgd eps 3 (DP: training examples): envelope over noise_augmentation_sigma"
    members = np.array([lines[k].get_ydata() for k in eps3])
    assert np.array_equal(lines[env].get_ydata(), members.max(axis=0))
    assert not np.allclose(lines[env].get_ydata(), members.mean(axis=0))   # control: not the mean of the curves
    # one configuration at an epsilon: no envelope, its curve drawn thick
    assert lines["dpsgd non-private: noise_augmentation_sigma=0.5"].get_linewidth() > 2
    # what each epsilon protects
    assert "pixeldp robustness eps 1 (not DP: a robustness parameter, protects no training data): pixeldp" in lines
    assert "secure_sgd eps 2 (DP: training examples): secure_sgd" in lines
    # the anchors at the [0, 1] radius (our [-1, 1] radius / 2); a point no trial matches is left out
    pub = lines["published: DP-CERT"]
    assert list(pub.get_xdata()) == [0.5, 1.0] and list(pub.get_ydata()) == [0.933, 0.813]
    assert not any("elsewhere" in k for k in lines)
    # both domains, N and the certified images
    assert ax.get_xlabel().startswith("certified l2 radius, [0, 1] pixel domain")
    (top,) = ax.child_axes
    assert "[-1, 1] domain" in top.get_xlabel()
    assert top.get_xlim()[1] == pytest.approx(2 * ax.get_xlim()[1])
    assert "CERTIFY N 1,000 (n0 100, alpha 0.001); 10 certified images per model" in ax.get_title()
    # y fitted to the curves and stars (max 0.933), not fixed at 0..1
    lo, hi = ax.get_ylim()
    assert -0.021 <= lo < 0 and 0.933 < hi < 1.02
    assert all(f.exists() for f in files) and files[1].read_bytes()[:5] == b"%PDF-"


def test_the_table_at_the_literature_radii_beside_the_anchors(drawn):
    from sweeps.report.certified import radius_table

    sweep, lines, _, _ = drawn
    rows = {r["configuration"]: r for r in radius_table(sweep, [dict(r, _matched=i < 2) for i, r in enumerate(REFS)])}
    cols = ["r_[0,1] 0.5 (r_[-1,1] 1)", "r_[0,1] 1 (r_[-1,1] 2)", "r_[0,1] 1.5 (r_[-1,1] 3)", "r_[0,1] 2 (r_[-1,1] 4)"]
    a = rows["dpsgd eps 3: noise_augmentation_sigma=0.5"]
    # seed 0 certifies 4 / 2 / 0 / 0 of 10 at [-1, 1] radii 1 / 2 / 3 / 4, seed 1 5 / 4 / 3 / 2
    assert [a[c] for c in cols] == ["45.0 ± 7.1", "30.0 ± 14.1", "15.0 ± 21.2", "10.0 ± 14.1"]
    assert a["n"] == 2 and a["sigma_[0,1] (sigma_[-1,1])"] == "0.25 (0.5)" and a["epsilon (measured)"] == "3"
    assert a["N, images"] == "N 1,000 (n0 100, alpha 0.001); 10 certified images per model"
    # a wrong prediction is never certified, whatever its radius
    c = rows["dpsgd non-private: noise_augmentation_sigma=0.5"]
    # and a 0 beyond CERTIFY's reach (sigma_01 0.25 at N 1,000: r_01 <= 0.62) says so; the synthetic table's
    # 70.0 beyond it stays what was measured (a reach is never put in place of data)
    assert [c[k] for k in cols] == ["70.0", "70.0", "70.0", "0.0 (beyond reach: r_[0,1] <= 0.62 at N 1,000)"]
    assert c["epsilon protects"] == "non-private"
    env = rows["dpsgd eps 3: envelope over noise_augmentation_sigma (best per radius: a tuning choice)"]
    assert [env[k].split(" (")[0] for k in cols] == ["45.0", "30.0", "30.0", "30.0"]
    assert env[cols[0]].endswith("(noise_augmentation_sigma=0.5)") and env[cols[3]].endswith("(noise_augmentation_sigma=1)")
    p = rows["pixeldp robustness eps 1: pixeldp"]
    assert p["epsilon protects"].startswith("not DP")
    # a noise layer on the input is the smoothing noise: its std is the sigma; after a layer it is none
    assert p["sigma_[0,1] (sigma_[-1,1])"] == "0.5 (1)"
    assert rows["secure_sgd eps 2: secure_sgd"]["sigma_[0,1] (sigma_[-1,1])"] == "1 (2)"
    from sweeps.report.certified import _sigma01     # noise after a layer is not the smoothing noise: no sigma
    assert np.isnan(_sigma01({"param.noise_after": "1", "noise_scale": 2.0}))
    pub = rows["published: DP-CERT"]
    assert [pub[k] for k in cols] == ["93.3", "81.3", "", ""]
    assert "published: elsewhere" not in rows
    text = "\n".join(lines)
    assert "## Certified accuracy against l2 radius (randomized smoothing)" in text
    assert "| " + " | ".join(cols) + " |" in text and "![certified accuracy against l2 radius](certified_radius.png)" in text
    assert "tuning choice" in text and "protects no training data" in text and "docs/secure_sgd.md" in text


def test_a_curve_is_named_by_what_tells_it_from_its_family_not_by_other_trainables_keys(tmp_path, monkeypatch):
    """A key only the trainables differ in (lr 0.5 for DP-SGD, 0.05 for PixelDP) names no curve: a curve's
    label is what varies within its family (or, alone there, among its trainable's configurations); the
    x axis reaches the published points when the sweep's models certify smaller radii."""
    from sweeps.report import plots as rp
    from sweeps.report.certified import certified_radius_section, smoothing_groups
    from sweeps.report.data import Sweep

    sweep = _sweep()
    trials = sweep.trials.copy()
    trials["param.lr"] = [0.05 if t == "pixeldp" else 0.5 for t in trials["trainable"]]
    trials["param.attack_norm"] = ["linf" if t == "pixeldp" else "l2" for t in trials["trainable"]]
    sweep = Sweep(None, "e", "sqlite://", None, trials, sweep.tables)
    labels = {(g["family"], g["label"]) for g in smoothing_groups(sweep)}
    assert labels == {("dpsgd eps 3", "noise_augmentation_sigma=0.5"), ("dpsgd eps 3", "noise_augmentation_sigma=1"),
                      ("dpsgd non-private", "noise_augmentation_sigma=0.5"),
                      ("pixeldp robustness eps 1", "pixeldp"), ("secure_sgd eps 2", "secure_sgd")}
    assert all("lr" in g["config"] for g in smoothing_groups(sweep))      # the table still has the sweep's keys
    figs = {}
    real = rp._save
    monkeypatch.setattr(rp, "_save", lambda fig, axes, path, **kw: (figs.setdefault(path.name, fig),
                                                                    real(fig, axes, path, **kw)))
    refs = [{"point": "far", "metric": "smooth_cert_acc_4", "published": 0.3,
             "_where": {"trainable": "dpsgd", "epsilon": 3.0}}]
    certified_radius_section(sweep, refs, tmp_path)
    ax = figs["certified_radius.png"].axes[0]
    assert ax.get_xlim()[1] >= 2.0           # the point at the [0, 1] radius 2.0 is on the chart


def test_no_smoothing_table_no_section(tmp_path):
    from sweeps.report.certified import certified_radius_section
    from sweeps.report.data import Sweep

    sweep = _sweep()
    sweep = Sweep(None, "e", "sqlite://", None, sweep.trials, {k: v for k, v in sweep.tables.items() if k[1] != "smoothing"})
    assert certified_radius_section(sweep, REFS, tmp_path) == ([], [])
    assert not (tmp_path / "certified_radius.png").exists()


def test_the_report_page_carries_the_section(tmp_path):
    """make_report on a store: the section and its files are on the page, and the older [-1, 1]
    smoothing-curve figure (the same curves) is not drawn beside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from sweeps.report import make_report
    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("cert", artifact_location=str(tmp_path / "art"))
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}, run_name="s").info.run_id
    client.log_batch(parent, params=[Param("search.metric", "smooth_cert_acc_2"), Param("search.mode", "max"),
                                     Param("reference.citation", "DP-CERT"),
                                     Param("reference.points.0.label", "DP-CERT"),
                                     Param("reference.points.0.where.epsilon", "3.0"),
                                     Param("reference.points.0.metrics.smooth_cert_acc_1", "0.933")])
    for i, (sigma, radii) in enumerate(((0.5, [1.0, 2.0]), (1.0, [3.0, 3.0, 3.0]))):
        run = client.create_run(exp, run_name=f"t{i}", tags={TAG_PARENT: parent, TAG_TRAINABLE: "dpsgd"}).info.run_id
        client.log_batch(run, params=[Param("epsilon", "3.0"), Param("noise_augmentation_sigma", str(sigma)),
                                      Param("certify_n", "1000"), Param("seed", "0")],
                         metrics=[Metric("acc_clean", 0.9, 0, 0), Metric("epsilon", 3.0, 0, 0),
                                  Metric("smooth_cert_acc_2", len(radii) / 10, 0, 0)])
        path = tmp_path / f"smoothing{i}" / "smoothing.parquet"
        path.parent.mkdir()
        pq.write_table(pa.Table.from_pandas(_table(radii), preserve_index=False), path)
        client.log_artifact(run, str(path), "certification")
        client.set_terminated(run, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    out = tmp_path / "r"
    text = make_report("cert", uri, out).read_text()
    section = text[text.index("## Certified accuracy against l2 radius"):].split("\n## ")[0]
    assert "N 1,000; 10 certified images per model" in section and "| published: DP-CERT |" in section
    row = next(line for line in section.splitlines() if line.startswith("| dpsgd eps 3: noise_augmentation_sigma=1 "))
    # the columns: the radius the trials certified at (smooth_cert_acc_2: r_[0,1] 1) and the published point's 0.5
    assert "| r_[0,1] 0.5 (r_[-1,1] 1) | r_[0,1] 1 (r_[-1,1] 2) |" in section
    assert row.endswith("| 30.0 | 30.0 |") and "[best]" in row   # best by smooth_cert_acc_2
    assert (out / "certified_radius.png").exists() and (out / "certified_radius.csv").exists()
    assert not (out / "smooth_cert_acc_vs_size.png").exists()


def test_the_legend_stays_clear_of_the_x_label_under_a_long_title(tmp_path, monkeypatch):
    """The legend hangs below the axes; a title of several lines (N and images per family) leaves the
    axes short. In the saved figure the legend's box lies wholly below the x label's. Control: the
    former anchor, a fixed fraction of the axes' height (-0.13), overlaps the label in the same figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    from sweeps.report import plots as rp
    from sweeps.report.certified import draw_radius_figure, radius_curves

    figs = {}
    real = rp._save
    monkeypatch.setattr(rp, "_save", lambda fig, axes, path, **kw: (real(fig, axes, path, **kw),
                                                                    figs.setdefault(path.name, fig)))
    curves, _ = radius_curves(_sweep())
    note = "; ".join(f"family {i}: N 100,000, 500 images" for i in range(30))    # about twelve lines
    assert draw_radius_figure(curves, tmp_path / "r.png", note=note, title="a title")
    fig = figs["r.png"]
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)           # the saved figure was closed: draw it again as saved
    canvas.draw()
    renderer = canvas.get_renderer()
    label = ax.xaxis.label.get_window_extent(renderer)
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.y1 < label.y0 and legend.y0 >= 0          # below the label, inside the saved figure
    old = ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    assert Bbox.intersection(old.get_window_extent(renderer), label) is not None      # control


def _numbers_sweep(split_rows=()):
    """Two dpsgd configurations at epsilon 3 (sigma 0.25, two seeds; sigma 0.5, one seed that never learned)
    that certified at the [-1, 1] sizes 0.25 and 0.5 (certify_sizes), nothing at the literature's radii."""
    from sweeps.report.data import Sweep

    rows, tables = [], {}
    for rid, sigma, seed, radii, bad in (("a0", 0.25, 0, [0.3, 0.6, 0.6], 0.0), ("a1", 0.25, 1, [0.6] * 5, 0.0),
                                          ("b0", 0.5, 0, [0.3], 1.0)):
        rows.append({"run_id": rid, "run": rid, "trainable": "dpsgd", "status": "FINISHED", **COUNTS,
                     "param.epsilon": 3.0, "param.noise_augmentation_sigma": sigma, "param.seed": seed,
                     "epsilon": 3.0, "not_learned": bad, "smooth_cert_acc_0.25": 0.3, "smooth_cert_acc_0.5": 0.2})
        tables[(rid, "smoothing")] = _table(radii)
    return Sweep(None, "e", "sqlite://", None, pd.DataFrame(rows), tables)


def test_the_table_uses_the_trials_radii_numbers_in_csv_columns_and_flags_a_model_at_chance(tmp_path, monkeypatch):
    """Issue 51.4: the table's radii are the trials' certify_sizes (not the literature's 0.5 to 2.0, all beyond
    a sigma_01 0.125 model's reach), the CSV holds numbers in columns (mean, sd, n per radius; not "x ± y" text),
    a configuration whose model stayed at chance is flagged in the table, the CSV and the figure, and the
    figure says which images its curves are on under a selection split."""
    import csv

    from sweeps.report import plots as rp
    from sweeps.report.certified import certified_radius_section, table_radii01
    from sweeps.report.page import _md_table

    sweep = _numbers_sweep()
    assert table_radii01(sweep) == (0.125, 0.25)
    figs = {}
    real = rp._save
    monkeypatch.setattr(rp, "_save", lambda fig, axes, path, **kw: (figs.update({path.name: fig}),
                                                                    real(fig, axes, path, **kw)))
    lines, files = certified_radius_section(sweep, [], tmp_path, None, _md_table, split="test_half")
    text = "\n".join(lines)
    assert "| r_[0,1] 0.125 (r_[-1,1] 0.25) | r_[0,1] 0.25 (r_[-1,1] 0.5) |" in text
    assert "r_[0,1] 0.5 " not in text and "beyond reach" not in text
    # seed 0 certifies 3 of 10 at 0.25 and 2 at 0.5 ([-1, 1]); seed 1 5 and 5
    a = next(line for line in lines if line.startswith("| dpsgd eps 3: noise_augmentation_sigma=0.25 "))
    assert "| 40.0 ± 14.1 | 35.0 ± 21.2 |" in a
    b = next(line for line in lines if line.startswith("| dpsgd eps 3: noise_augmentation_sigma=0.5 "))
    assert "did not learn: 1/1 at chance" in b
    assert "selection half" in text and "heldout_smooth_cert_acc" in text
    with open(tmp_path / "certified_radius.csv") as fh:
        rows = {r["configuration"]: r for r in csv.DictReader(fh)}
    c = rows["dpsgd eps 3: noise_augmentation_sigma=0.25"]
    assert float(c["r01_0.125_mean"]) == 40.0 and abs(float(c["r01_0.125_sd"]) - 14.1421) < 1e-3
    assert c["r01_0.125_n"] == "2" and c["did_not_learn"] == "0" and c["kind"] == "configuration"
    assert all("±" not in v for r in rows.values() for v in r.values())       # numbers, not text
    assert rows["dpsgd eps 3: noise_augmentation_sigma=0.5"]["did_not_learn"] == "1"
    env = next(r for r in rows.values() if r["kind"] == "envelope")
    assert float(env["r01_0.125_mean"]) == 40.0 and env["r01_0.125_chosen"] == "noise_augmentation_sigma=0.25"
    fig = figs["certified_radius.png"]
    chance = [ln for ln in fig.axes[0].get_lines() if "did not learn" in ln.get_label()]
    assert len(chance) == 1 and chance[0].get_linestyle() == ":" and chance[0].get_color() == "grey"
    assert not chance[0].get_label().startswith("_")            # named in the legend
    assert "selection half" in fig.axes[0].get_title()
    # control: without the flag the same configuration is drawn as a result
    sweep.trials["not_learned"] = 0.0
    certified_radius_section(sweep, [], tmp_path, None, _md_table)
    assert figs["certified_radius.png"] is not fig
    assert not any("did not learn" in ln.get_label() for ln in figs["certified_radius.png"].axes[0].get_lines())
