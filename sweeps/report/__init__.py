"""``dpsweep report``: the page (``page``), what it reads back from MLflow (``data``), its figures
(``plots``, ``labeldp``, ``audit``, ``samples``), Pareto fronts and the best trial (``pareto``, ``best``)."""

from sweeps.report.page import make_report

__all__ = ["make_report"]
