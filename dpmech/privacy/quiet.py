"""dp-accounting's ``_compute_log_a_frac failed to converge`` warnings, dropped (issue 24.12, 34.12).

dp-accounting's RDP accountant (``rdp_privacy_accountant._compute_log_a_frac``: the sampled Gaussian
mechanism's RDP at a fractional order, Mironov, Talwar & Zhang 2019) logs one warning on the ``absl``
logger for each fractional order whose series it cannot sum; it leaves that order out and still
returns a valid epsilon (the conversion of Mironov 2017, Prop. 3, minimised over the other orders). The lines say nothing a user can act on:
a notebook computing a few epsilons printed dozens. :func:`quiet_accounting_logs` installs a filter
on the ``absl`` logger that drops that one message and keeps every other record; it is light (no
dp-accounting, no torch) so that ``trainables`` can install it when imported. Every dpmech module
that accounts imports :mod:`dpmech.privacy.accounting`, which calls it once when it is imported.
"""

from __future__ import annotations

import logging


class _AccountingNoiseFilter(logging.Filter):
    """Drops dp-accounting's per-order convergence warnings (absl logger); keeps every other record."""

    MESSAGES = ("_compute_log_a_frac failed to converge",)

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str):
            return True
        return not any(m in record.msg for m in self.MESSAGES)


def quiet_accounting_logs() -> None:
    """Install ``_AccountingNoiseFilter`` on the ``absl`` logger (once per process)."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _AccountingNoiseFilter) for f in logger.filters):
        logger.addFilter(_AccountingNoiseFilter())
