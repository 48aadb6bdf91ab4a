"""dpmech: the science of dpsweep, usable without Ray or MLflow.

Mechanisms and their calibration (``mechanisms``), datasets in [-1, 1] (``data``), attacks
(``attacks``), PixelDP's noise layer, networks and trainer (``noise_layer``, ``models``,
``pixeldp``), the PixelDP certifier (``certify``) and evaluation helpers (``evaluation``).
"""

__version__ = "0.1.0"
