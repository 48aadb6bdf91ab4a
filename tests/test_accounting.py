"""dpmech.privacy.accounting: the ledger's epsilon against two independent accountants (Opacus, dp-accounting)."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant

from dpmech.privacy.accounting import PrivacyLedger, epsilon, noise_multiplier_for, subsampled_gaussian_event


def test_ledger_rdp_epsilon_agrees_with_opacus_and_dp_accounting():
    from opacus.accountants import RDPAccountant

    ledger = PrivacyLedger()
    for _ in range(3):  # recorded in pieces, merged into one phase
        ledger.record(0.04, 1.5, 750)
    assert len(ledger.entries) == 1 and ledger.steps == 2250
    ours = ledger.epsilon(1e-5, "rdp")

    opacus_acc = RDPAccountant()
    opacus_acc.history = [(1.5, 0.04, 2250)]
    theirs_opacus = opacus_acc.get_epsilon(delta=1e-5)
    dpa = rdp_privacy_accountant.RdpAccountant()  # dp-accounting's own default orders
    dpa.compose(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.04, dpe.GaussianDpEvent(1.5)), 2250))
    theirs_dpa = dpa.get_epsilon(1e-5)

    assert ours == pytest.approx(7.329, abs=0.01)
    assert abs(ours - theirs_opacus) < 0.01 and abs(ours - theirs_dpa) < 0.01
    pld = ledger.epsilon(1e-5, "pld")
    assert pld < ours and pld == pytest.approx(6.769, abs=0.01)


def test_ledger_phases_compose_and_round_trip():
    a = PrivacyLedger()
    a.record(0.01, 1.0, 100)
    a.record(0.02, 1.0, 50)
    b = PrivacyLedger()
    b.load_state_dict(a.state_dict())
    assert a == b and len(a.entries) == 2
    one_phase = PrivacyLedger()
    one_phase.record(0.01, 1.0, 100)
    assert a.epsilon(1e-5) > one_phase.epsilon(1e-5)  # more steps cost more


def test_no_noise_is_infinite_and_empty_ledger_is_free():
    ledger = PrivacyLedger()
    assert ledger.epsilon(1e-5) == 0.0
    ledger.record(0.1, 0.0, 10)
    assert math.isinf(ledger.epsilon(1e-5))


def test_noise_multiplier_calibration_meets_the_target():
    from opacus.accountants.utils import get_noise_multiplier

    sigma = noise_multiplier_for(2.0, 1e-5, 256 / 60000, 2000)
    eps = epsilon(subsampled_gaussian_event(256 / 60000, sigma, 2000), 1e-5)
    assert eps <= 2.0 and eps > 1.98
    theirs = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=256 / 60000, steps=2000,
                                  accountant="rdp", epsilon_tolerance=0.001)
    assert sigma == pytest.approx(theirs, rel=0.01)


@pytest.mark.parametrize("bad, match", [
    (dict(sampling_rate=0.0, noise_multiplier=1.0), "sampling_rate"),
    (dict(sampling_rate=1.5, noise_multiplier=1.0), "sampling_rate"),
    (dict(sampling_rate=0.1, noise_multiplier=-1.0), "noise_multiplier"),
])
def test_ledger_refuses_bad_entries(bad, match):
    with pytest.raises(ValueError, match=match):
        PrivacyLedger().record(**bad)


def test_noise_multiplier_for_a_composition_after_a_fixed_release():
    """``before``: the steps' sigma is calibrated for the composition (fixed release, then the steps):
    its epsilon is at most the target and a slightly smaller sigma would exceed it."""
    before = dpe.GaussianDpEvent(20.0)
    q, steps = 0.02, 500
    sigma = noise_multiplier_for(1.0, 1e-5, q, steps, before=before)

    def composed(s):
        return epsilon(dpe.ComposedDpEvent([before, subsampled_gaussian_event(q, s, steps)]), 1e-5)

    assert composed(sigma) <= 1.0 < composed(sigma * 0.998)
    assert sigma > noise_multiplier_for(1.0, 1e-5, q, steps)       # the fixed release takes a share
    with pytest.raises(ValueError, match="epsilon: 0.1 is unreachable .* alone costs"):
        noise_multiplier_for(0.1, 1e-5, q, steps, before=dpe.GaussianDpEvent(20.0))


def test_epsilon_memo_is_exact_per_event():
    """The per-process memo of epsilon and of the calibration returns what a fresh computation
    gives, and never one event's value for another (the key is the event itself)."""
    from dpmech.privacy import accounting as acc

    a = acc.subsampled_gaussian_event(0.01, 1.1, 100)
    b = acc.subsampled_gaussian_event(0.01, 1.1, 101)
    for kind in ("rdp", "pld"):
        first = acc.epsilon(a, 1e-5, kind)
        assert acc.epsilon(a, 1e-5, kind) == first == acc._compute_epsilon(a, 1e-5, kind)
        assert acc.epsilon(b, 1e-5, kind) == acc._compute_epsilon(b, 1e-5, kind) > first
        assert acc.epsilon(a, 1e-6, kind) > first
    sigma = acc.noise_multiplier_for(2.0, 1e-5, 0.01, 100)
    assert acc.noise_multiplier_for(2.0, 1e-5, 0.01, 100) == sigma
    assert acc.noise_multiplier_for(2.0, 1e-5, 0.01, 200) > sigma
