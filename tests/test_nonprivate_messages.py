"""A non-private trial's epsilon (inf, docs/metrics.md) printed `WARNING:NaN or Inf found in input
tensor.` twice through Ray's TensorBoard logger (issue 51.5): dpsweep's console keeps it off."""

from __future__ import annotations

import logging

import numpy as np


def test_tensorboardx_does_not_warn_about_a_non_private_epsilon(caplog):
    from tensorboardX.x2num import make_np

    from sweeps.runner import _RayHintFilter, quiet_ray

    tbx = logging.getLogger("tensorboardX.x2num")
    before = list(tbx.filters)
    try:
        for f in [f for f in tbx.filters if isinstance(f, _RayHintFilter)]:
            tbx.removeFilter(f)
        with caplog.at_level(logging.WARNING, logger="tensorboardX.x2num"):
            make_np(np.array([np.inf]))
        assert "NaN or Inf found in input tensor" in caplog.text   # the negative control: what users saw
        caplog.clear()
        quiet_ray()
        with caplog.at_level(logging.WARNING, logger="tensorboardX.x2num"):
            make_np(np.array([np.inf]))
        assert "NaN or Inf" not in caplog.text
    finally:
        tbx.filters[:] = before
