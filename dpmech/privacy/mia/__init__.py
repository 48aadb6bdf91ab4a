"""Membership inference attacks as a privacy measurement (docs/mia.md).

* :mod:`~dpmech.privacy.mia.game`: the membership game (:class:`MembershipGame`, :class:`AttackView`);
* :mod:`~dpmech.privacy.mia.references`: OUT reference models on population data (:class:`ReferenceModels`);
* :mod:`~dpmech.privacy.mia.attacks`: offline RMIA and offline LiRA (:func:`run_attack`);
* :mod:`~dpmech.privacy.mia.labels`: label inference against label DP (:func:`label_inference`);
* :mod:`~dpmech.privacy.mia.metrics`: AUC, TPR at low FPR and the epsilon lower bounds, with their
  uncertainty (:class:`MiaResult`).

An attack's figures are lower bounds on what leaks; a model's epsilon is an upper bound. Neither
stands in for the other.
"""

from dpmech.privacy.mia.attacks import ATTACKS, RMIA_DEFAULTS, lira_offline, random_guess, rmia_offline, run_attack
from dpmech.privacy.mia.game import AttackView, MembershipGame, MembershipHidden
from dpmech.privacy.mia.labels import LabelInferenceResult, label_epsilon_lower_bound, label_inference
from dpmech.privacy.mia.metrics import (FPR_LEVELS, GUESS_FRACTIONS, MiaResult, RateAtFPR, auc_with_interval,
                                        epsilon_lower_bounds, evaluate_scores, tpr_at_fpr)
from dpmech.privacy.mia.references import ReferenceModels, reference_key

__all__ = ["ATTACKS", "RMIA_DEFAULTS", "AttackView", "FPR_LEVELS", "GUESS_FRACTIONS", "LabelInferenceResult",
           "MembershipGame", "label_epsilon_lower_bound", "label_inference",
           "MembershipHidden", "MiaResult", "RateAtFPR", "ReferenceModels", "auc_with_interval",
           "epsilon_lower_bounds", "evaluate_scores", "lira_offline", "random_guess", "reference_key",
           "rmia_offline", "run_attack", "tpr_at_fpr"]
