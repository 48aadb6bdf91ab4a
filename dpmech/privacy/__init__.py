"""Privacy tools shared by every mechanism: noise mechanisms and their calibration, accounting
(dp-accounting), per-example clipping engines, the cost of hyperparameter tuning, audits."""
