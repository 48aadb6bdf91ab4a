"""benchmarks/dpsgd_subset_tuned.py: a candidate's privacy is fixed by public numbers (not by the secret
|X1|), the final run's noise is the one the accounting charged, and a row says met or missed from the
held-out mean."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import dpsgd_subset_tuned as bench


@pytest.mark.parametrize("batch", bench.BATCHES)
@pytest.mark.parametrize("rate", [0.05, 0.1, 0.3])
def test_a_candidate_keeps_the_full_datas_sampling_rate_and_steps(batch, rate):
    b1, planned = bench.candidate_plan(batch, 20, rate)
    assert planned == round(rate * bench.N_TRAIN)             # public: not the secret |X1|
    q_full, steps_full = bench._steps(batch, 20)
    q_cand, steps_cand = bench._steps(b1, 20, planned)
    assert q_cand == pytest.approx(q_full, rel=0.01)
    assert abs(steps_cand - steps_full) <= 20                 # one step an epoch at most, from rounding


def test_the_trainer_plans_the_curve_the_accounting_uses():
    """The candidate's curve in the accounting is the one DPSGDTrainer's plan calibrates (the same q,
    steps and noise multiplier)."""
    from dpmech.dpsgd.trainer import DPSGDConfig, plan
    from dpmech.privacy.accounting import rdp_curve, subsampled_gaussian_event

    b1, planned = bench.candidate_plan(2048, 10, 0.1)
    p = plan(DPSGDConfig(epsilon=0.3, delta=bench.DELTA, batch_size=b1, epochs=10), planned)
    ours = bench.candidate_curve(2048, 10, 0.1, 0.3)
    np.testing.assert_allclose(ours, rdp_curve(subsampled_gaussian_event(p.sampling_rate, p.noise_multiplier, p.steps)))


def test_a_row_is_judged_on_the_held_out_mean():
    run = {"acc": 0.985, "acc_n": 5000, "released_config": {"lr": 4.0},
           "accounting": {"epsilon": 2.9998, "tuning_epsilon": 0.506, "final_epsilon": 2.823}}
    row = bench.row_result("eps_3", [run, dict(run, acc=0.987)])
    assert row["acc_mean"] == pytest.approx(0.986) and row["pipelines"] == 2 and row["met"]
    assert row["analysis"] == "subset_tuning" and row["epsilon_total"] <= 3.0
    assert not bench.row_result("eps_3", [run])["met"] and bench.row_result("eps_3", [run])["acc_std"] is None
