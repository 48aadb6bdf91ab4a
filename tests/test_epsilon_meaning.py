"""``epsilon`` means a guarantee about training data (or labels, stated) (issue 13 point 2):
PixelDP logs its robustness parameters under their own names, configured and recomputed, and no
``epsilon``/``delta``; the sweep summary and the registry say what each trainable's epsilon protects."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from sweeps.spec.space import reported_metrics
from trainables.pixeldp import PixelDPTrialConfig
from trainables.registry import REGISTRY


def test_pixeldp_logs_robustness_parameters_under_their_own_names(one_thread):
    from trainables.pixeldp import PixelDPMechanism

    cfg = PixelDPTrialConfig(epsilon=0.5, delta=0.05, attack_bound=0.1, train_size=64, test_size=16, epochs=1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (64,), generator=g)
    metrics = PixelDPMechanism(cfg, x, y, torch.device("cpu")).privacy()
    assert "epsilon" not in metrics and "delta" not in metrics
    assert metrics["robustness_epsilon_config"] == 0.5
    assert 0 < metrics["robustness_epsilon"] <= 0.5 + 1e-9  # recomputed from the noise actually used
    assert metrics["robustness_delta"] == 0.05 and metrics["attack_bound"] == 0.1
    assert set(metrics) <= reported_metrics("pixeldp", cfg.model_dump())


def test_validation_knows_pixeldp_reports_no_epsilon():
    names = reported_metrics("pixeldp", PixelDPTrialConfig().model_dump())
    assert "epsilon" not in names and "delta" not in names
    assert {"robustness_epsilon", "robustness_epsilon_config", "robustness_delta"} <= names
    assert "epsilon" in reported_metrics("dpsgd", REGISTRY["dpsgd"].config_model().model_dump())


def test_every_trainable_says_what_its_epsilon_protects():
    for name, entry in REGISTRY.items():
        assert entry.epsilon_protects, name
    assert not REGISTRY["pixeldp"].privacy_epsilon and REGISTRY["pixeldp"].epsilon_protects.startswith("nothing")
    assert REGISTRY["label_dp"].privacy_epsilon and "labels only" in REGISTRY["label_dp"].epsilon_protects
    assert all(REGISTRY[n].privacy_epsilon for n in ("dpsgd", "secure_sgd", "dpal", "adlm", "dpgan"))


def _result(trainable, metrics, epsilon_cfg):
    return SimpleNamespace(config={"trial": {"trainable": trainable, "epsilon": epsilon_cfg}},
                           metrics={"evaluated": 1, **metrics}, error=None)


def test_sweep_summary_uses_privacy_epsilons_only():
    from sweeps.runner import summarize

    grid = [_result("dpsgd", {"epsilon": 2.0, "acc_clean": 0.9}, 2.0),
            _result("dpsgd", {"epsilon": 1.0, "acc_clean": 0.8}, 1.0),
            # a run logged before the rename still carries pixeldp's robustness epsilon as "epsilon"
            _result("pixeldp", {"epsilon": 0.04, "acc_clean": 0.95}, 0.5),
            _result("pixeldp", {"robustness_epsilon": 0.2, "acc_clean": 0.95}, 1.0)]
    _, summary, _ = summarize(grid)
    assert summary["epsilon_min_trial"] == 1.0 and summary["epsilon_max_trial"] == 2.0
    _, summary, _ = summarize(grid[2:])
    assert "epsilon_min_trial" not in summary and not math.isnan(summary["trials"])


def test_mechanisms_says_what_each_epsilon_protects(capsys):
    from sweeps.cli import main

    assert main(["mechanisms"]) == 0
    out = capsys.readouterr().out
    assert out.count("epsilon protects: ") == len(REGISTRY)
    assert "epsilon protects: nothing: no epsilon metric" in out
    assert main(["mechanisms", "label_dp"]) == 0
    assert "epsilon protects: training labels only" in capsys.readouterr().out
