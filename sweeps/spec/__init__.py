"""Sweep specs: loading and validating a spec (``sweep_spec``), each trainable's parameter space
(``space``) and private hyperparameter selection (``tuning``); the public names are re-exported here."""

from sweeps.spec.space import SpecError
from sweeps.spec.sweep_spec import (MAX_TRIALS, SweepSpec, apply_overrides, expand_trials, load_spec,
                                    ray_param_space, reference_matches, spec_to_flat_params, validate_spec)

__all__ = ["MAX_TRIALS", "SpecError", "SweepSpec", "apply_overrides", "expand_trials", "load_spec",
           "ray_param_space", "reference_matches", "spec_to_flat_params", "validate_spec"]
