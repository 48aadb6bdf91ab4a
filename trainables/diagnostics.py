"""Non-private diagnostics: metrics a trial computes on its training data without noise.

A trainer's ``train_epoch`` statistics (``train_loss``, ``train_acc``, ``batch_size_mean``, DPGAN's
``wasserstein``) and a few final metrics derived the same way (DPGAN's ``clipped_fraction``, the
``loss_near_chance`` hint computed from ``train_loss``) read the private training examples outside
the noisy mechanism: ``epsilon`` does not cover them (issue 25, point 5; docs/metrics.md,
"Non-private diagnostics"). They are useful while developing a recipe and must not leave a release.

* Every ``train_epoch`` statistic is a diagnostic unless the trial schema lists it in the class
  attribute ``private_epoch_metrics`` (a function of the release only, e.g. DP-MERF's ``train_loss``).
  ``test_acc`` is computed on the test set, never on the training data: not a diagnostic.
* The trial key ``diagnostics`` (default true) keeps them; ``diagnostics: false`` (for a release) drops
  them at the trial's boundary: no Ray result, checkpoint, MLflow metric or console line carries them.
* A sweep never lets a searcher or a scheduler select on one for a trainable with a privacy guarantee
  (``sweeps.spec.space.check_not_diagnostic``): the selection would then depend on the training data
  through a channel epsilon does not account for.
"""

from __future__ import annotations

# Per-epoch statistics of the trainers (each trainer's train_epoch), for validation before anything runs.
EPOCH_DIAGNOSTICS = ("train_loss", "train_acc", "batch_size_mean", "wasserstein", "recon_loss", "mu_mean")
# Final metrics computed from the training data without noise. Label DP's keep rates compare the released
# labels with the true ones (analytic_keep_prob weighs by the true labels' frequencies): the label epsilon
# does not cover them (issue 48.6).
FINAL_DIAGNOSTICS = ("clipped_fraction", "loss_near_chance", "label_keep_rate", "analytic_keep_prob")
# MLflow tag listing a run's non-private diagnostics ("none" when diagnostics: false).
TAG_DIAGNOSTICS = "dpsweep.nonprivate_diagnostics"


def private_epoch_metrics(schema) -> tuple[str, ...]:
    """The ``train_epoch`` statistics of ``schema``'s trainer that are functions of the release only."""
    return tuple(getattr(schema, "private_epoch_metrics", ()))


def diagnostic_names(schema) -> tuple[str, ...]:
    """Every metric name that is a non-private diagnostic for trials of ``schema``."""
    private = set(private_epoch_metrics(schema))
    return tuple(m for m in (*EPOCH_DIAGNOSTICS, *FINAL_DIAGNOSTICS) if m not in private)


def is_diagnostic(metric: str, schema) -> bool:
    return metric in diagnostic_names(schema)


def epoch_diagnostics(metrics: dict, schema) -> list[str]:
    """The keys of one epoch's ``train_epoch`` statistics that are non-private diagnostics (every
    key except ``test_acc`` and the schema's ``private_epoch_metrics``)."""
    private = set(private_epoch_metrics(schema)) | {"test_acc", "epoch"}
    return [k for k in metrics if k not in private]


def drop(metrics: dict, names) -> dict:
    """``metrics`` without ``names``."""
    names = set(names)
    return {k: v for k, v in metrics.items() if k not in names}
