"""The reference protocol (dpmech.dpal.reference, ``dpal`` with ``evaluation: reference``; docs/dpal.md).

Reference protocol: not a DP guarantee, not a white-box attack, not a certificate. These tests check that it
reproduces the reference code's behaviour (issue 15), not that it is valid.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpmech.dpal.reference import (RefNet, _ae_loss_direct, _laplace, ae_loss, certificate_size, clopper_pearson_eps_r,
                                   reference_budget, shared_draw_counts, surrogate_attack)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_budget_matches_reference_scales():
    """Issue 15 point 1: fresh input noise about 16.1 per pixel at eps_t 0.2 (b_x / psi, psi 2)."""
    net = RefNet(0)
    b = reference_budget(0.2, net.spectral_norm())
    assert b.eps2 == pytest.approx(0.1)
    assert b.gamma_x == pytest.approx(4950 / 2499)
    assert b.eps2_update == pytest.approx(0.1 / (1 + 1 / b.gamma + 1 / b.gamma_x))
    assert b.b_x / 2 == pytest.approx(16.1, abs=0.5)
    assert b.b_h == pytest.approx(2 * b.b_x)
    with pytest.raises(ValueError, match="eps_t"):
        reference_budget(0.1, 1.0)


def test_ae_loss_fast_form_equals_reference_form():
    """The parity-convolution / per-bias form of decode2's cost equals the reference's upsample + broadcast form,
    value and gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 1, 28, 28, generator=g) * 2 - 1
    hn = torch.randn(1, 32, 14, 14, generator=g)
    grads = []
    for fn in (ae_loss, _ae_loss_direct):
        net = RefNet(3)
        with torch.no_grad():
            net.b1.copy_(torch.randn(32, generator=torch.Generator().manual_seed(1)) * 0.3)
        loss = fn(net, x, 0.4, hn)
        loss.backward()
        grads.append((float(loss.detach()), net.w1.grad.clone(), net.b1.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    for i in (1, 2):  # float32 sums in another order: compare relative to the gradient's norm
        assert float((grads[0][i] - grads[1][i]).norm() / grads[1][i].norm()) < 1e-4


def test_surrogate_is_per_example_and_forward_is_not():
    """The surrogate (inference_test_input) treats examples independently; the Monte Carlo network's batch
    norms use the batch's statistics, so an example's output depends on the others."""
    net = RefNet(0)
    x = torch.rand(20, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        assert torch.allclose(net.surrogate(x)[:5], net.surrogate(x[:5]), atol=1e-5)
        assert not torch.allclose(net(x)[:5], net(x[:5]), atol=1e-3)


def test_surrogate_attacks_stay_in_ball():
    net = RefNet(0)
    x = torch.rand(8, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for name in ("fgsm", "ifgsm", "mim", "pgd"):
        xa = surrogate_attack(net, x, name, 0.2, 3, 0.07, generator=torch.Generator().manual_seed(1))
        assert (xa - x).abs().max() <= 0.2 + 1e-6 and xa.abs().max() <= 1
    with pytest.raises(ValueError, match="attack"):
        surrogate_attack(net, x, "cw", 0.2, 1, 0.1)


def test_shared_draw_beats_per_example_draw():
    """Issue 15 point 2, on a small model trained around one fixed draw at eps_t 0.2's scales: votes with one fresh
    draw shared by the whole test batch (the reference) stay accurate, because the batch norms remove the shared
    offset; the same fresh noise drawn per example (the estimator the paper describes; the control) collapses."""
    from dpmech.datasets.splits import load_splits

    tr, te = load_splits("mnist", train_size=2000, test_size=300, seed=0)
    x, y = tr.tensors
    xt, yt = te.tensors
    g = torch.Generator().manual_seed(0)
    b_x, b_h = 32.5, 65.0                       # the reference's fixed scales at eps_t 0.2 (fresh: / psi = 2)
    xf, hf = _laplace((1, 1, 28, 28), b_x, g), _laplace((1, 32, 14, 14), b_h, g)
    net = RefNet(0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(3):
        perm = torch.randperm(2000, generator=g)
        for i in range(0, 2000, 250):
            idx = perm[i:i + 250]
            loss = F.cross_entropy(net(x[idx], xf, hf), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    acc = {}
    for per_example in (False, True):
        counts = shared_draw_counts(net, xt, xf, hf, b_x, b_h, 10, torch.Generator().manual_seed(1),
                                    per_example=per_example)
        assert int(counts.sum()) == 10 * len(yt)
        acc[per_example] = float((counts.argmax(1) == yt).float().mean())
    assert acc[False] >= 0.7          # measured 0.80
    assert acc[True] <= 0.45          # measured 0.29 (chance 0.1)
    assert acc[False] - acc[True] >= 0.3


def test_certificates_first_upload_inverted_head_not():
    """Issue 15 point 4: 2,000 unanimous votes give eps_r at most 2.97; the first upload's size shrinks as the
    noise grows (inverted), HEAD's grows; the first upload certifies mu 0.6 at eps_t 1 from a small eps_r."""
    counts = np.zeros((1, 10))
    counts[0, 3] = 2000
    eps_r = clopper_pearson_eps_r(counts)
    assert eps_r[0] == pytest.approx(2.97, abs=0.01)
    tie = np.zeros((1, 10))
    tie[0, :2] = 1000
    assert clopper_pearson_eps_r(tie)[0] == 0.0
    small = reference_budget(2.0, 0.53)         # less noise
    large = reference_budget(0.2, 0.53)         # more noise
    e = np.array([1.0])
    assert certificate_size(e, 0.2, large, "first_upload") < certificate_size(e, 0.2, small, "first_upload")
    assert certificate_size(e, 0.2, large, "head") > certificate_size(e, 0.2, small, "head")
    b1 = reference_budget(1.0, 0.53)
    need = 0.6 / certificate_size(np.array([1.0]), 0.6, b1, "first_upload")[0]
    assert need < 0.1                            # eps_r needed for mu 0.6: a clear majority suffices
    with pytest.raises(ValueError, match="certificate"):
        certificate_size(e, 0.2, b1, "paper")


def test_trainable_reference_mode_metric_names_and_faithful_default():
    """evaluation: reference reports ref_* metrics only (no acc_*, cert_acc_*, epsilon); the default stays faithful."""
    from dpmech.datasets.splits import load_splits
    from sweeps.spec.space import reported_metrics
    from trainables.dpal import DPALTrialConfig
    from trainables.dpal import DPALMechanism, ReferenceMechanism, _mechanism, reference_metric_names

    assert DPALTrialConfig().evaluation == "faithful"
    base = dict(dataset="mnist", eps_t=2.0, batch_size=200, epochs=1, attacks={"fgsm": [0.2], "pgd": [0.2]},
                attack_labels="predicted", attack_steps=2, train_attack_steps=1, certify_images=50, certify_n=4,
                certify_sizes=[0.05, 0.6])
    faithful_names = reported_metrics("dpal", {"trainable": "dpal", **base})
    assert "acc_pgd_0.2" in faithful_names and not any(n.startswith("ref_") for n in faithful_names)
    cfg = DPALTrialConfig(**base, evaluation="reference", ref_eval_every=1)
    tr, te = load_splits("mnist", train_size=600, test_size=80, seed=0)
    x, y = tr.tensors
    xt, yt = te.tensors
    assert isinstance(_mechanism(DPALTrialConfig(**base), x, y, torch.device("cpu")), DPALMechanism)
    mech = _mechanism(cfg, x, y, torch.device("cpu"))
    assert isinstance(mech, ReferenceMechanism)
    mech.train_epoch()
    assert mech.epoch == 1
    assert 0 <= mech.test_accuracy(xt, yt) <= 1
    metrics = mech.conventional_accuracy(xt, yt, cfg)
    metrics.update(mech.privacy())
    expected = reference_metric_names({"trainable": "dpal", **cfg.model_dump()}) - {"compute_seconds", "not_learned"}
    assert set(metrics) == expected
    assert not any(k.startswith(("acc_", "cert_acc_")) or k in ("epsilon", "delta") for k in metrics)
    assert reported_metrics("dpal", {"trainable": "dpal", **cfg.model_dump()}) == reference_metric_names(cfg.model_dump())
    assert metrics["ref_acc_attack_mean_0.2"] == pytest.approx((metrics["ref_acc_fgsm_0.2"] + metrics["ref_acc_pgd_0.2"]) / 2)
    assert math.isfinite(metrics["ref_cert_acc_0.6"])
    state = mech.state_dict()
    again = ReferenceMechanism(cfg, x, y, torch.device("cpu"))
    again.load_state_dict(state)
    assert again.epoch == 1 and again.evaluations == mech.evaluations


@pytest.mark.parametrize("override, field", [
    ({"attack_labels": "true"}, "attack_labels"),
    ({"attacks": {"apgd_ce": [0.2]}}, "attacks"),
    ({"dataset": "cifar10", "eps_t": 3.0}, "dataset"),
])
def test_reference_mode_rules(override, field):
    from pydantic import ValidationError

    from trainables.dpal import DPALTrialConfig

    base = dict(evaluation="reference", attacks={"pgd": [0.2]}, attack_labels="predicted")
    with pytest.raises((ValueError, ValidationError), match=field):
        DPALTrialConfig(**{**base, **override})


def test_report_side_by_side_labels_reference_rows():
    """The report's DPAL section puts faithful, reference-protocol and dpal_sound rows side by side, the reference
    rows labelled; a sweep with faithful DPAL only gets no such section."""
    import pandas as pd

    from sweeps.report.page import REF_PROTOCOL_LABEL, _dpal_side_by_side

    rows = []
    for ev in ("faithful", "reference"):
        for seed in (0, 1):
            r = {"trainable": "dpal", "status": "FINISHED", "param.evaluation": ev, "param.eps_t": 2.0, "param.seed": seed}
            if ev == "faithful":
                r.update({"acc_fgsm_0.2": 0.1, "acc_pgd_0.2": 0.12, "cert_acc_0.05": 0.0})
            else:
                r.update({"ref_acc_attack_mean_0.2": 0.80 + 0.02 * seed, "ref_cert_acc_0.05": 0.7})
            rows.append(r)
    rows.append({"trainable": "dpal_sound", "status": "FINISHED", "param.epsilon": 2.0, "acc_pgd_0.2": 0.6,
                 "acc_clean_smoothed": 0.9, "cert_l2_acc_0.5": 0.5, "cert_linf_acc_0.05": 0.1})
    df = pd.DataFrame(rows)
    text = "\n".join(_dpal_side_by_side(df, [{"point": "p", "metric": "acc_attack_mean_0.2", "published": 0.8959}]))
    assert f"| DPAL, {REF_PROTOCOL_LABEL} | 2 |  | 0.81 ± 0.014 | 0.7 |  |" in text
    assert "| DPAL faithful | 2 |  | 0.11 | 0 |  |" in text
    assert "| dpal_sound | 2 | 0.9 | 0.6 | 0.1 | 0.5 |" in text
    assert "acc_attack_mean_0.2 = 0.8959" in text
    faithful_only = df[(df["trainable"] == "dpal") & (df["param.evaluation"] == "faithful")]
    assert _dpal_side_by_side(faithful_only, []) == []


def test_reference_mode_runs_through_run_trial(monkeypatch):
    """The dpal trainable end to end with evaluation: reference (tune's calls recorded): per-epoch results with a
    checkpoint, one final result with the ref_* metrics and nothing named acc_* / cert_acc_* / epsilon."""
    from ray import tune

    from trainables.dpal import dpal

    reports = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: None)
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: reports.append((metrics, checkpoint)))
    config = {"evaluation": "reference", "eps_t": 2.0, "train_size": 600, "test_size": 60, "batch_size": 200,
              "epochs": 2, "ref_eval_every": 1, "train_attack_steps": 1, "attack_steps": 1, "attacks": {"pgd": [0.2]},
              "attack_labels": "predicted", "certify_images": 30, "certify_n": 3, "certify_sizes": [0.05]}
    dpal(config)
    assert [m["epoch"] for m, _ in reports] == [1, 2, 2]
    assert all(ck is not None for _, ck in reports[:2])
    final = reports[-1][0]
    assert {"ref_acc_clean", "ref_acc_pgd_0.2", "ref_acc_attack_mean_0.2", "ref_cert_acc_0.05", "ref_steps"} <= set(final)
    assert final["ref_steps"] == 6
    assert not any(k.startswith(("acc_", "cert_acc_")) or k in ("epsilon", "delta") for k in final)
