"""Issue 38: label DP at high privacy. cluster_rr's ledger (noisy per-cluster histograms + RR-with-prior,
pure) against an independent computation; the image-only prior costs nothing while a prior that reads
the labels is refused (the negative control); the exact posterior; LabelDP-Pro's calibration and
projection; the trial keys' one-line errors; the shipped spec at a --set subset; the benchmark's JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dpmech.label_dp import cluster_prior as cp
from dpmech.label_dp.labeldp_pro import (LabelDPProConfig, LabelDPProRun, _xhat, gaussian_epsilon,
                                         project_linear_span)
from dpmech.label_dp.rr_prior import matrix_epsilon, rr_prior_choose_k, rr_top_k_matrix
from dpmech.privacy.mechanisms import gaussian_delta
from dpmech.privacy.secret import NoiseKey

ROOT = Path(__file__).resolve().parent.parent


def _blobs(n=240, k=4, d=6, seed=0):
    """Images-as-features in k well separated blobs; labels = blob, 10% of them changed."""
    g = torch.Generator().manual_seed(seed)
    blob = torch.randint(0, k, (n,), generator=g)
    centres = torch.randn(k, d, generator=g) * 6
    x = centres[blob] + torch.randn(n, d, generator=g)
    y = torch.where(torch.rand(n, generator=g) < 0.1, torch.randint(0, k, (n,), generator=g), blob)
    return x, y


# --------------------------------------------------------------------------- the ledger


def test_ledger_matches_an_independent_computation(monkeypatch):
    """epsilon = eps_hist + eps_rr, recomputed per label from what was released: the histogram's noise
    scale (fitted to the noise actually drawn) and each example's exact RR-Top-k output matrix."""
    x, y = _blobs()
    n, k = len(y), 4
    cfg = cp.ClusterRRConfig(n_clusters=4, hist_share=0.3, stages=2, pca_dim=3,
                             linear=cp.LinearConfig(epochs=2, batch_size=64))
    seen = {"rr": [], "hist": []}
    real_rr, real_hist = cp.rr_release, cp.noisy_cluster_histograms

    def spy_rr(ledger, index, prior, epsilon, generator, name):
        out = real_rr(ledger, index, prior, epsilon, generator, name)
        seen["rr"].append((index.clone(), out[1].clone(), out[2].clone(), epsilon))
        return out

    def spy_hist(ledger, assignment, n_clusters, epsilon, generator, name="cluster_histograms"):
        h = real_hist(ledger, assignment, n_clusters, epsilon, generator, name)
        counts = torch.zeros(n_clusters, k, dtype=torch.float64).index_put_(
            (assignment, y), torch.ones(n, dtype=torch.float64), accumulate=True)
        seen["hist"].append((h - counts, epsilon))
        return h

    monkeypatch.setattr(cp, "rr_release", spy_rr)
    monkeypatch.setattr(cp, "noisy_cluster_histograms", spy_hist)
    ledger, info = cp.release_cluster_rr(x, cp.PrivateLabels(y, k), 0.8, cfg, seed=0,
                                         noise_key=NoiseKey.reproducible(3))
    assert len(seen["hist"]) == 1 and len(seen["rr"]) == 2
    per_label = np.zeros(n)
    noise, eps_h = seen["hist"][0]
    # the histogram's epsilon from its sensitivity (2) and the scale of the release; the scale the
    # ledger claims (2 / eps_h) must match the noise drawn: E|Lap(b)| = b, checked with many draws below
    per_label += 2.0 / (cp.HISTOGRAM_SENSITIVITY / eps_h)
    covered = np.zeros(n, dtype=bool)
    for index, kstar, order, eps in seen["rr"]:
        for row, i in enumerate(index.tolist()):
            m = rr_top_k_matrix(order[row].tolist(), int(kstar[row]), eps)
            per_label[i] += matrix_epsilon(m)
            assert not covered[i]                           # each label in one RR stage only
            covered[i] = True
    assert covered.all()
    assert ledger.epsilon() == pytest.approx(per_label.max(), rel=1e-12)
    assert ledger.epsilon() == pytest.approx(0.8, rel=1e-12) and ledger.delta() == 0.0
    assert ledger.guarantee() == "pure"
    assert [e["name"] for e in ledger.to_dict()["entries"]] == ["cluster_histograms", "rr_stage1", "rr_stage2"]


def test_histogram_noise_has_the_scale_the_ledger_charges_for():
    """Many releases on fixed labels: the fitted Laplace scale (mean |noise|) gives 2 / b = eps_hist
    within 3%; negative control: noise at half the scale would be read as twice the epsilon."""
    x, y = _blobs(n=200)
    a = torch.arange(200) % 20
    counts = torch.zeros(20, 4, dtype=torch.float64).index_put_((a, y), torch.ones(200, dtype=torch.float64),
                                                                 accumulate=True)
    g = torch.Generator().manual_seed(5)
    noise = []
    for _ in range(50):
        led = cp.LabelLedger(cp.PrivateLabels(y, 4))
        noise.append(cp.noisy_cluster_histograms(led, a, 20, 0.1, g) - counts)
        assert led.epsilon() == pytest.approx(0.1)
    b_hat = float(torch.stack(noise).abs().mean())
    assert 2.0 / b_hat == pytest.approx(0.1, rel=0.03)
    from dpmech.privacy.mechanisms import laplace_noise

    half = laplace_noise(torch.zeros(50 * 80, dtype=torch.float64), 10.0, torch.Generator().manual_seed(6))
    assert 2.0 / float(half.abs().mean()) == pytest.approx(0.2, rel=0.05)   # would not pass as 0.1


# --------------------------------------------------------------------------- image-only prior vs labels


def test_a_prior_that_reads_the_labels_is_refused_and_charges_nothing():
    x, y = _blobs()
    labels = cp.PrivateLabels(y, 4)
    ledger = cp.LabelLedger(labels)

    def leaky_prior(feats):
        return torch.nn.functional.one_hot(labels.reveal(None), 4).double() + 0.1

    def leaky_prior_via_release(feats):
        with ledger.release("sneaky", 1.0) as tok:
            return labels.reveal(tok)

    with pytest.raises(cp.LabelLeakError, match="prior must be computed from the images alone"):
        ledger.public_prior(leaky_prior, x)
    with pytest.raises(cp.LabelLeakError, match="inside a public computation"):
        ledger.public_prior(leaky_prior_via_release, x)
    assert ledger.entries == [] and ledger.epsilon() == 0.0
    with pytest.raises(cp.LabelLeakError):
        labels.reveal(object())                              # a token of no release
    # the image-only prior runs and is the same whatever the labels are
    cfg = cp.ClusterRRConfig(n_clusters=4, pca_dim=3)
    assign = ledger.public_prior(cp.cluster_assignment, x, cfg, 0)
    assert ledger.entries == []
    image_only = lambda feats, lab: cp.cluster_assignment(feats, cfg, 0).double()   # noqa: E731
    reads_labels = lambda feats, lab: lab.double()                                    # noqa: E731
    y2 = (y + 1) % 4
    assert cp.prior_label_dependence(image_only, x, y, y2) == 0.0
    assert cp.prior_label_dependence(reads_labels, x, y, y2) > 0.0
    assert torch.equal(assign, cp.cluster_assignment(x, cfg, 0))


def test_rr_with_an_image_only_prior_costs_eps_and_with_a_label_prior_is_not_private():
    """The mechanism y -> RRWithPrior(prior) of one example: with a prior fixed by the images its exact
    output matrix has epsilon eps (no more); with a prior computed from y (one-hot of y, smoothed) the
    released label reveals y: infinite epsilon (the cost a label-reading prior would hide)."""
    eps, k = 0.5, 5
    image_prior = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
    kstar, order = rr_prior_choose_k(torch.tensor(image_prior)[None], eps)
    assert int(kstar[0]) >= 2
    m_image = rr_top_k_matrix(order[0].tolist(), int(kstar[0]), eps)
    assert matrix_epsilon(m_image) == pytest.approx(eps)
    rows = []
    for yy in range(k):
        p = np.full(k, 0.01)
        p[yy] = 1.0
        ks, od = rr_prior_choose_k(torch.tensor(p)[None], eps)
        rows.append(rr_top_k_matrix(od[0].tolist(), int(ks[0]), eps)[yy])
    assert matrix_epsilon(np.array(rows)) == math.inf


def test_posterior_is_bayes_rule_on_the_exact_channel():
    g = torch.Generator().manual_seed(1)
    prior = torch.rand(30, 5, generator=g, dtype=torch.float64) ** 3 + 1e-3
    eps = 0.7
    kstar, order = rr_prior_choose_k(prior, eps)
    released = torch.stack([order[i, torch.randint(int(kstar[i]), (1,), generator=g)] for i in range(30)]).squeeze(1)
    q = cp.rr_posterior(prior, released, kstar, order, eps)
    for i in range(30):
        m = rr_top_k_matrix(order[i].tolist(), int(kstar[i]), eps)
        p = (prior[i] / prior[i].sum()).numpy()
        want = p * m[:, int(released[i])]
        assert np.allclose(q[i].numpy(), want / want.sum(), atol=1e-12)


def test_cluster_rr_learns_the_blobs_at_small_epsilon():
    x, y = _blobs(n=400)
    cfg = cp.ClusterRRConfig(n_clusters=4, hist_share=1.0, stages=1, pca_dim=3,
                             linear=cp.LinearConfig(epochs=10, batch_size=64, lr=0.05))
    model, ledger, _ = cp.train_cluster_rr(x, cp.PrivateLabels(y, 4), 0.5, cfg, seed=0, noise_key=NoiseKey.reproducible(0))
    blob_acc = float((cp.softmax_of(model, x).argmax(1) == y).float().mean())
    assert blob_acc > 0.85 and ledger.epsilon() == pytest.approx(0.5)


# --------------------------------------------------------------------------- LabelDP-Pro


def test_labeldp_pro_calibration_and_ledger():
    x, y = _blobs(n=300)
    cfg = LabelDPProConfig(epochs=3, batch_size=100, lr=0.5, proj_images=16, delta=1e-5)
    run = LabelDPProRun(x, cp.PrivateLabels(y, 4), 0.5, cfg, seed=0, noise_key=NoiseKey.reproducible(0))
    sens = math.sqrt(2 * 3) * cfg.clip
    assert gaussian_delta(run.sigma, 0.5, sens) <= 1e-5 < gaussian_delta(run.sigma * 0.99, 0.5, sens)
    assert run.ledger.epsilon() == pytest.approx(0.5, rel=1e-6) and run.ledger.delta() == 1e-5
    assert run.ledger.guarantee() == "approximate"
    assert gaussian_epsilon(run.sigma, 1e-5, sens) == pytest.approx(0.5, rel=1e-6)
    for _ in range(3):
        run.train_epoch()
    with pytest.raises(ValueError, match="epochs"):
        run.train_epoch()                                    # no pass beyond those charged


def test_projection_keeps_the_true_gradient_when_spanned_by_the_batch():
    """The span of the batch's per-label gradients contains the batch's true gradient (autograd),
    so projecting it changes nothing; a random matrix loses its part outside the span and column sums."""
    x, y = _blobs(n=50, d=12)
    xh = _xhat(x, 1.0).double()
    w = torch.randn(4, xh.shape[1], dtype=torch.float64, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(xh @ w.T, y, reduction="sum")
    (g,) = torch.autograd.grad(loss, w)
    sub = xh[:8]
    sub_loss = torch.nn.functional.cross_entropy(sub @ w.T, y[:8], reduction="sum")
    (g_sub,) = torch.autograd.grad(sub_loss, w)
    assert torch.allclose(project_linear_span(g_sub, sub), g_sub, atol=1e-10)
    r = torch.randn(4, xh.shape[1], dtype=torch.float64)
    pr = project_linear_span(r, sub)
    assert torch.allclose(pr.sum(0), torch.zeros(xh.shape[1], dtype=torch.float64), atol=1e-10)
    assert pr.norm() < r.norm()
    assert torch.allclose(project_linear_span(pr, sub), pr, atol=1e-10)       # a projection
    assert not torch.allclose(project_linear_span(g, sub), g, atol=1e-6)        # the full gradient is not in it


# --------------------------------------------------------------------------- trial keys and the spec


@pytest.mark.parametrize("extra, message", [
    ({"mechanism": "lp2st", "n_clusters": 50}, "n_clusters: applies to mechanism cluster_rr only"),
    ({"mechanism": "cluster_rr", "pro_lr": 0.1}, "pro_lr: applies to mechanism labeldp_pro only"),
    ({"mechanism": "cluster_rr", "epsilon": None}, "epsilon: mechanism cluster_rr needs a finite epsilon"),
    ({"mechanism": "labeldp_pro", "task": "regression"}, "task: mechanism labeldp_pro applies to task 'classification'"),
    ({"mechanism": "cluster_rr", "rr_stages": 2}, "rr_stages: must be 1 when hist_share is 1"),
    ({"mechanism": "cluster_rr", "hist_share": 0.0}, "hist_share"),
    ({"mechanism": "cluster_rr", "train_size": 100, "n_clusters": 200}, "n_clusters: must be <= train_size"),
])
def test_trial_keys_refuse_bad_input_in_one_line(extra, message):
    from trainables.label_dp import LabelDPTrialConfig
    from trainables.runtime import validate_config

    with pytest.raises(ValueError, match=message) as exc:
        validate_config({"dataset": "mnist", **extra}, LabelDPTrialConfig)
    assert "\n" not in str(exc.value)


def test_shipped_spec_at_a_set_subset_builds_and_trains_each_method():
    from sweeps.spec import expand_trials, load_spec
    from trainables.label_dp import LabelDPMechanism, LabelDPTrialConfig, final_metrics
    from trainables.runtime import validate_config

    spec = load_spec(ROOT / "sweeps" / "label_dp_mnist_high_privacy.yaml",
                     ["common.train_size=64", "common.test_size=32", "common.epochs=2",
                      *(f"trainables.{i}.search.n_clusters=5" for i in range(8)),
                      "trainables.8.search.pro_batch_size=32"])
    trials = expand_trials(spec)
    assert len(trials) == 60
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 28, 28, generator=g) * 2 - 1
    y = torch.arange(64) % 10
    for mech, eps, head in (("cluster_rr", 0.5, "linear"), ("labeldp_pro", 0.5, "linear"), ("cluster_rr", 4.0, "cnn")):
        t = next(t for t in trials if t["mechanism"] == mech and t["epsilon"] == eps and t.get("head", "linear") == head)
        cfg = validate_config({k: v for k, v in t.items() if k != "trainable"}, LabelDPTrialConfig)
        m = LabelDPMechanism(cfg, x, y, torch.device("cpu"), noise_key=NoiseKey.reproducible(0))
        for _ in range(cfg.epochs):
            m.train_epoch()
        acc = m.test_accuracy(x[:32], y[:32])
        assert 0.0 <= acc <= 1.0
        p = m.privacy()
        assert p["epsilon"] == pytest.approx(eps, rel=1e-6)
        assert p["delta"] == (0.0 if mech == "cluster_rr" else 1e-5)
        assert (("label_keep_rate" in p) == (mech == "cluster_rr")
                == ("label_keep_rate" in final_metrics(t, {"label_keep_rate", "acc_clean"})))
        state = m.state_dict()
        m2 = LabelDPMechanism(cfg, x, y, torch.device("cpu"), noise_key=NoiseKey.reproducible(0))
        m2.load_state_dict(state)
        assert m2.test_accuracy(x[:32], y[:32]) == acc


def test_a_cnn_head_trial_is_the_benchmarks_cluster_rr_cnn_unit():
    """The trainable's ``head: cnn`` (epoch by epoch, resumed from a checkpoint halfway) trains the benchmark's
    cluster_rr_cnn head on the same release: same ledger, same test predictions. The CNN reads no label
    (post-processing): its epsilon is the release's, the linear head's trial's."""
    from types import SimpleNamespace

    from benchmarks import labeldp_high_privacy as bench
    from dpmech.label_dp.feature_trainer import FeatureCNN, FeatureLabelDPConfig, FeatureLabelDPTrainer
    from dpmech.networks.scatternet import scatter_features

    g = torch.Generator().manual_seed(1)
    y = torch.arange(240) % 10
    x = (torch.rand(240, 1, 28, 28, generator=g) * 0.5 + torch.linspace(-1, 0.5, 10)[y].view(-1, 1, 1, 1)).clamp(-1, 1)
    xt, yt = x[200:], y[200:]
    x, y = x[:200], y[:200]
    h = (8, 0.25, 2, 1.0)
    cfg = FeatureLabelDPConfig(mechanism="cluster_rr", epsilon=4.0, epochs=3, seed=2, n_clusters=8, hist_share=0.25,
                               rr_stages=2, head="cnn", head_width=8, head_hidden=16, head_dropout=0.3,
                               head_mixup_alpha=1.0)
    key = NoiseKey.reproducible(5)
    a = FeatureLabelDPTrainer(cfg, x, y, noise_key=key)
    assert isinstance(a.model, FeatureCNN)
    a.train_epoch()
    b = FeatureLabelDPTrainer(cfg, x, y, noise_key=key)
    b.load_state_dict(a.state_dict())
    for _ in range(2):
        b.train_epoch()
    with torch.no_grad():
        pred = b.model(xt).argmax(1)
    # the benchmark's unit on the same images, at the same settings
    ftr, fte = cp.standardise(scatter_features(x, dataset="label_dp"), scatter_features(xt, dataset="label_dp"))
    data = SimpleNamespace(x=ftr, xt=fte, y=y, yt=yt, assignment=lambda c, s: cp.cluster_assignment(ftr, c, s))
    head = {"epochs": 3, "batch_size": cfg.batch_size, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "width": 8,
            "hidden": 16, "dropout": 0.3}
    linear = {"epochs": 3, "batch_size": cfg.batch_size, "lr": cfg.lr, "weight_decay": cfg.weight_decay}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench.HPARAMS, 4.0, h)
        mp.setattr(bench, "SOFT_CNN", head)
        mp.setattr(bench, "LINEAR", linear)
        mp.setitem(bench.SOFT_CNN_MIXUP, 4.0, 1.0)
        unit = bench.run_unit(data, "cluster_rr_cnn", 4.0, 2, noise_key=key)
    assert unit["ledger"] == a.ledger.to_dict() and b.privacy()["epsilon"] == pytest.approx(4.0)
    assert unit["acc"] == float((pred == yt).float().mean())
    # control: another head seed trains other weights (the equality above is not vacuous)
    other = FeatureLabelDPTrainer(FeatureLabelDPConfig(**{**cfg.to_dict(), "seed": 3}), x, y, noise_key=key)
    assert not torch.equal(other.model.cnn.net[0].weight, a.model.cnn.net[0].weight)


@pytest.mark.parametrize("extra, message", [
    ({"mechanism": "labeldp_pro", "head": "cnn"}, "head: applies to mechanism cluster_rr only"),
    ({"mechanism": "cluster_rr", "head_width": 8}, "head_width: applies to head cnn only"),
    ({"mechanism": "cluster_rr", "head_mixup_alpha": 1.0}, "head_mixup_alpha: applies to head cnn only"),
    ({"mechanism": "cluster_rr", "head": "cnn", "head_mixup_alpha": -1.0}, "head_mixup_alpha"),
    ({"mechanism": "cluster_rr", "head": "cnn", "head_dropout": 1.0}, "head_dropout"),
])
def test_head_keys_refuse_bad_input_in_one_line(extra, message):
    from trainables.label_dp import LabelDPTrialConfig
    from trainables.runtime import validate_config

    with pytest.raises(ValueError, match=message) as exc:
        validate_config({"dataset": "mnist", **extra}, LabelDPTrialConfig)
    assert "\n" not in str(exc.value)


# --------------------------------------------------------------------------- the benchmark


def test_benchmark_writes_the_issue_layout_and_resumes(tmp_path, capsys):
    from benchmarks import labeldp_high_privacy as bench

    out = tmp_path / "hp.json"
    bench.main(["--out", str(out), "--epsilons", "0.1", "--seeds", "0", "--train-size", "600", "--test-size", "200",
                "--methods", "cluster_rr", "labeldp_pro"])
    res = json.loads(out.read_text())
    for m in ("cluster_rr", "labeldp_pro"):
        s = res[m]["eps_0.1"]
        assert set(s) >= {"mean", "std", "seeds"} and len(s["seeds"]) == 1 and 0 <= s["mean"] <= 1
    assert res["runs"]["cluster_rr/eps_0.1/seed0"]["delta"] == 0.0
    assert res["runs"]["labeldp_pro/eps_0.1/seed0"]["guarantee"] == "approximate"
    assert {"device", "versions", "date"} <= set(res)
    capsys.readouterr()
    bench.main(["--out", str(out), "--epsilons", "0.1", "--seeds", "0", "--train-size", "600", "--test-size", "200"])
    assert "2 units done, 0 to run" in capsys.readouterr().out
    doc = tmp_path / "label_dp.md"
    doc.write_text("x\n<!-- labeldp-high-privacy:begin -->\nold\n<!-- labeldp-high-privacy:end -->\n")
    bench.main(["--out", str(out), "--docs", "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and "LabelDP-Pro (published, Table 5a)" in text and "n = 1" in text


def test_a_unit_recorded_with_other_hyperparameters_runs_again_and_is_kept_aside(tmp_path, capsys, monkeypatch):
    """A choice changed on the validation split: the recorded unit no longer describes today's configuration, so it
    runs again, its old record is kept under ``superseded`` and no summary counts it (control: unchanged units are
    not rerun)."""
    from benchmarks import labeldp_high_privacy as bench

    out = tmp_path / "hp.json"
    args = ["--out", str(out), "--epsilons", "0.1", "--seeds", "0", "--train-size", "600", "--test-size", "200",
            "--methods", "cluster_rr", "labeldp_pro"]
    bench.main(args)
    before = json.loads(out.read_text())["runs"]
    capsys.readouterr()
    monkeypatch.setitem(bench.HPARAMS, 0.1, (12, 0.5, 1, 1.0))
    bench.main(args)
    log = capsys.readouterr().out
    assert "[cluster_rr/eps_0.1/seed0] recorded with other hyperparameters" in log and "1 units done, 1 to run" in log
    res = json.loads(out.read_text())
    assert res["runs"]["cluster_rr/eps_0.1/seed0"]["hyperparameters"]["hist_share"] == 0.5
    assert res["superseded"]["cluster_rr/eps_0.1/seed0"] == [before["cluster_rr/eps_0.1/seed0"]]
    assert res["runs"]["labeldp_pro/eps_0.1/seed0"] == before["labeldp_pro/eps_0.1/seed0"]      # the control
    assert res["cluster_rr"]["eps_0.1"]["seeds"] == [res["runs"]["cluster_rr/eps_0.1/seed0"]["acc"]]


def test_benchmark_refuses_an_epsilon_without_chosen_hyperparameters(tmp_path, capsys):
    from benchmarks import labeldp_high_privacy as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "x.json"), "--epsilons", "0.3"])
    assert exc.value.code == 2 and not (tmp_path / "x.json").exists()
    assert "--epsilons: 0.3" in capsys.readouterr().err


# --------------------------------------------------------------------------- the chosen hyperparameters (issue 54.1)


def test_the_shipped_spec_runs_the_benchmarks_chosen_settings():
    """Every cluster_rr trial of the shipped spec uses the settings the validation split chose for its epsilon
    (the benchmark's HPARAMS), its head's settings and the CNN head where the benchmark runs it, every unit of the
    benchmark is a trial, and its target points are the benchmark's targets: the two cannot drift apart."""
    from benchmarks import labeldp_high_privacy as bench
    from sweeps.spec import expand_trials, load_spec
    from trainables.label_dp import LabelDPTrialConfig

    spec = load_spec(ROOT / "sweeps" / "label_dp_mnist_high_privacy.yaml", [])
    trials = [t for t in expand_trials(spec) if t["mechanism"] == "cluster_rr"]
    assert {t["epsilon"] for t in trials} == set(bench.EPSILONS)
    for t in trials:
        assert (t["n_clusters"], t["hist_share"], t["rr_stages"], t.get("prior_temperature", 1.0)) == \
            bench.HPARAMS[t["epsilon"]], t["epsilon"]
        head = bench.SOFT_CNN if t.get("head") == "cnn" else bench.LINEAR
        assert {k: t.get(k, spec.common.get(k)) for k in ("epochs", "batch_size", "lr", "weight_decay")} == \
            {k: head[k] for k in ("epochs", "batch_size", "lr", "weight_decay")}, t
        if t.get("head") == "cnn":    # the trial keys' defaults are the benchmark's head
            fields = LabelDPTrialConfig.model_fields
            assert {k: fields[f"head_{k}"].default for k in ("width", "hidden", "dropout")} == \
                {k: bench.SOFT_CNN[k] for k in ("width", "hidden", "dropout")}
            assert t["head_mixup_alpha"] == bench.SOFT_CNN_MIXUP[t["epsilon"]], t
    cnn = {(t["epsilon"], t["seed"]) for t in trials if t.get("head") == "cnn"}
    assert cnn == {(e, s) for e in bench.METHOD_EPSILONS["cluster_rr_cnn"] for s in bench.SEEDS}
    pro = {(t["epsilon"], t["seed"]) for t in expand_trials(spec) if t["mechanism"] == "labeldp_pro"}
    assert pro == {(e, s) for e in bench.EPSILONS for s in bench.SEEDS}
    targets = {p.where["epsilon"]: p.metrics["acc_clean"] for p in spec.reference.points
               if p.where.get("mechanism") == "cluster_rr"}
    assert targets == {e: bench.TARGETS[e] for e in targets}


def test_every_benchmark_epsilon_has_hyperparameters_and_a_target():
    from benchmarks import labeldp_high_privacy as bench

    assert {0.01, 0.02, 4.0} <= set(bench.EPSILONS)
    assert set(bench.HPARAMS) == set(bench.EPSILONS) == set(bench.TARGETS)
    for e, (c, share, stages, temp) in bench.HPARAMS.items():
        cp.ClusterRRConfig(n_clusters=c, hist_share=share, stages=stages, temperature=temp)   # valid entries


def test_new_hyperparameters_are_the_validation_splits_choice():
    """HPARAMS at 0.01 / 0.02 / 2 / 4 are the best of their validation grid (ties: the earlier entry), read from the
    committed validation JSON; the rule picks something else when the figures say so (negative control)."""
    from benchmarks import labeldp_high_privacy as bench
    from benchmarks import labeldp_high_privacy_validation as val

    res = json.loads(bench.VALIDATION.read_text())
    for e in (0.01, 0.02, 2.0, 4.0):
        ek = f"eps_{e:g}"
        per = res[ek]
        assert set(per) == {val.ckey(h) for h in val.GRID[e]}, f"{ek}: validation grid incomplete"
        chosen = val.choose(per, e)
        assert res["chosen"][ek] == chosen == val.ckey(bench.HPARAMS[e])
        assert per[chosen] == max(per.values())
        other = next(k for k in per if k != chosen)
        assert val.choose({**per, other: per[chosen] + 0.01}, e) == other       # the control: a better entry wins
    first, second = (val.ckey(h) for h in val.GRID[0.01][:2])
    tie = {val.ckey(h): 0.5 for h in val.GRID[0.01]}
    assert val.choose(tie, 0.01) == first and val.choose({**tie, second: 0.6}, 0.01) == second
    assert val.choose({first: 0.9}, 0.01) is None                                # an incomplete grid chooses nothing


# --------------------------------------------------------------------------- the CNN head (issue 54.1's stretch)


def test_the_cnn_heads_mixup_is_the_validation_splits_choice():
    """SOFT_CNN_MIXUP at each epsilon where the CNN head runs is the best alpha of the validation grid on the release
    HPARAMS chooses (ties: the smaller alpha), read from the committed validation JSON; the rule picks another
    alpha when the figures say so (negative control), and nothing on an incomplete grid."""
    from benchmarks import labeldp_high_privacy as bench
    from benchmarks import labeldp_high_privacy_validation as val

    mx = json.loads(bench.VALIDATION.read_text())["soft_cnn_mixup"]
    assert mx["grid"] == [f"{a:g}" for a in val.MIXUP_GRID]
    assert set(bench.SOFT_CNN_MIXUP) == set(bench.METHOD_EPSILONS["cluster_rr_cnn"])
    for e, alpha in bench.SOFT_CNN_MIXUP.items():
        r = mx[f"eps_{e:g}"]
        assert r["config"] == val.ckey(bench.HPARAMS[e])
        assert val.choose_mixup(r["acc"]) == r["chosen"] == alpha
        other = next(k for k in r["acc"] if float(k) != alpha)
        assert val.choose_mixup({**r["acc"], other: max(r["acc"].values()) + 0.01}) == float(other)
        assert bench.soft_cnn_config(e).mixup_alpha == alpha
    tie = {f"{a:g}": 0.5 for a in val.MIXUP_GRID}
    assert val.choose_mixup(tie) == val.MIXUP_GRID[0] and val.choose_mixup({"0": 0.9}) is None


def test_soft_cnn_learns_soft_labels_deterministically_and_refuses_bad_input():
    from dpmech.label_dp.soft_cnn import SoftCNNConfig, SoftCNNRun, predict_soft_cnn, train_soft_cnn

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (300,), generator=g)
    centres = torch.randn(3, 4 * 7 * 7, generator=g)
    x = centres[y] + torch.randn(300, 4 * 7 * 7, generator=g)
    soft = torch.full((300, 3), 0.1).scatter_(1, y[:, None], 0.8)       # soft labels, mass 0.8 on the truth
    cfg = SoftCNNConfig(epochs=6, batch_size=32, lr=5e-3, width=4, hidden=16, dropout=0.1)
    state = torch.random.get_rng_state()
    m1 = train_soft_cnn(x, soft, cfg, seed=3, feature_shape=(4, 7, 7))
    assert torch.equal(torch.random.get_rng_state(), state)             # the global RNG is untouched
    m2 = train_soft_cnn(x, soft, cfg, seed=3, feature_shape=(4, 7, 7))
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert float((predict_soft_cnn(m1, x) == y).float().mean()) > 0.9
    # control: labels that carry nothing (uniform) leave it at chance
    m0 = train_soft_cnn(x, torch.full((300, 3), 1 / 3), cfg, seed=3, feature_shape=(4, 7, 7))
    assert float((predict_soft_cnn(m0, x) == y).float().mean()) < 0.6
    # mixup: other weights than without it, the same ones again, and epoch by epoch with a resume halfway
    mix = SoftCNNConfig(**{**cfg.to_dict(), "mixup_alpha": 1.0})
    m3 = train_soft_cnn(x, soft, mix, seed=3, feature_shape=(4, 7, 7))
    assert not torch.equal(m3.net[0].weight, m1.net[0].weight)
    assert float((predict_soft_cnn(m3, x) == y).float().mean()) > 0.9
    run = SoftCNNRun(x, soft, mix, 3, (4, 7, 7))
    for _ in range(3):
        run.train_epoch()
    resumed = SoftCNNRun(x, soft, mix, 3, (4, 7, 7))
    resumed.load_state_dict(run.state_dict())
    for _ in range(3):
        resumed.train_epoch()
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.state_dict().values(), m3.state_dict().values()))
    with pytest.raises(ValueError, match="mixup_alpha"):
        SoftCNNConfig(mixup_alpha=-0.5)
    with pytest.raises(ValueError, match=r"^feats must be \[N, 196\]"):
        train_soft_cnn(x[:, :10], soft, cfg, seed=0, feature_shape=(4, 7, 7))
    with pytest.raises(ValueError, match="dropout"):
        SoftCNNConfig(dropout=1.0)


def test_cluster_rr_cnn_is_cluster_rrs_release_with_another_head(tmp_path, monkeypatch):
    """Same seed, same noise: the two units' ledgers are the same release; only the head differs. The CNN is
    run only where the validation split showed a gain (the figures in the committed validation JSON)."""
    from benchmarks import labeldp_high_privacy as bench
    from benchmarks import labeldp_high_privacy_validation as val

    validation = json.loads(bench.VALIDATION.read_text())
    res = validation["soft_cnn"]
    assert res["settings"] == bench.SOFT_CNN
    for k, r in res.items():      # each head pair was measured on the release HPARAMS chooses today
        if k.startswith("eps_") and "@" not in k:
            assert r["config"] == val.ckey(bench.HPARAMS[float(k[4:])]), k
    gains = tuple(float(k[4:]) for k, r in res.items()
                  if k.startswith("eps_") and "@" not in k and r["cnn"] > r["linear"])
    assert gains == bench.METHOD_EPSILONS["cluster_rr_cnn"] == (2.0, 4.0)
    assert res["true_labels"]["cnn"] > validation["true_labels"]          # a stronger head than the linear one
    assert val.ckey(bench.HPARAMS[4.0]) == validation["chosen"]["eps_4"]
    monkeypatch.setitem(bench.HPARAMS, 4.0, (12, 0.25, 2, 1.0))
    monkeypatch.setitem(bench.SOFT_CNN, "epochs", 2)
    out = tmp_path / "hp.json"
    bench.main(["--out", str(out), "--epsilons", "4", "--seeds", "0", "--train-size", "600", "--test-size", "200",
                "--methods", "cluster_rr", "cluster_rr_cnn"])
    runs = json.loads(out.read_text())["runs"]
    a, b = runs["cluster_rr/eps_4/seed0"], runs["cluster_rr_cnn/eps_4/seed0"]
    assert a["ledger"] == b["ledger"] and b["epsilon_reported"] == 4.0 and b["delta"] == 0.0
    assert b["hyperparameters"]["head"]["epochs"] == 2 and "head" not in a["hyperparameters"]
    assert ("cluster_rr_cnn", 1.0, 0) not in bench.units()                 # not where it was not measured
