"""SIGINT (Ctrl-C) and SIGTERM (what job schedulers send) in the sweep driver: one path for both.

Left alone, the two end a sweep differently (issue 24, point 10): Ray Tune catches the first SIGINT
inside ``tuner.fit()`` and returns as if the sweep had ended, while ``ray.init`` installs a SIGTERM
handler that exits the driver at once (``sys.exit(15)``: no parent run KILLED, no resume line).

``Interrupts`` installs one handler for both (again after ``ray.init``), with Tune's own SIGINT
handler off (``TUNE_DISABLE_SIGINT_HANDLER``), and remembers which signal came first (exit 130
for SIGINT, 143 = 128 + 15 for SIGTERM):

- while the sweep may stop gracefully (``graceful()``: from the parent run's creation until
  ``fit()`` returns) the first signal is handed to Tune's graceful stop, the SIGUSR1 handler Tune
  installs in ``fit()`` (it stops the trials and saves the experiment state for ``resume``); a
  signal that comes before Tune's handler exists waits for the first step of Tune's loop
  (``sweeps.runner.ForwardInterrupt``);
- a second signal, or a first one outside ``graceful()``, raises ``KeyboardInterrupt`` (it skips
  Tune's last snapshot; the periodic one remains);
- once the driver is recording how the sweep ended (``shield()``: the parent run and its child
  runs KILLED), signals are only remembered, so those records are always written; the second
  signal inside the shield gives up on them.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
_HANDLED = (signal.SIGINT, signal.SIGTERM)
_FORWARD = getattr(signal, "SIGUSR1", None)  # Tune's graceful stop (not on Windows)

_active: "Interrupts | None" = None


class Interrupts:
    """The driver's SIGINT/SIGTERM handler (see the module docstring); a context manager that
    restores the previous handlers on exit."""

    def __init__(self):
        self.signum: int | None = None  # the first signal that came
        self.count = 0
        self._graceful = False
        self._shielded = 0  # signals received inside shield()
        self._shield_depth = 0
        self._pending = False  # to hand to Tune's handler when it exists
        self._previous: dict[int, object] = {}
        self._tune_env: str | None = None

    # ------------------------------------------------------------------ set-up

    def __enter__(self) -> "Interrupts":
        global _active
        self._tune_env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
        for sig in (*_HANDLED, *((_FORWARD,) if _FORWARD else ())):
            self._previous[sig] = signal.getsignal(sig)
        self.install()
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if self._tune_env is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = self._tune_env
        if _active is self:
            _active = None

    def install(self) -> None:
        """(Re)install the handler for SIGINT and SIGTERM: ``ray.init`` replaces SIGTERM's."""
        for sig in _HANDLED:
            signal.signal(sig, self._handle)

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 130)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "SIGINT"

    # ------------------------------------------------------------------ modes

    def begin_graceful(self) -> None:
        """From here the sweep can stop gracefully: the first signal stops Tune's loop (now, or at
        its first step) instead of raising."""
        if _FORWARD is not None and not self._graceful:  # a handler left by an earlier fit() is stale
            signal.signal(_FORWARD, self._previous.get(_FORWARD) or signal.SIG_DFL)
        self._graceful = True

    def end_graceful(self) -> None:
        self._graceful = False
        self._pending = False

    @contextmanager
    def graceful(self):
        """``begin_graceful`` … ``end_graceful``."""
        self.begin_graceful()
        try:
            yield self
        finally:
            self.end_graceful()

    @contextmanager
    def shield(self):
        """Signals are only remembered here (the records of how the sweep ended are written);
        a second one inside raises ``KeyboardInterrupt``."""
        self._shield_depth += 1
        try:
            yield self
        finally:
            self._shield_depth -= 1

    # ------------------------------------------------------------------ the handler

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        name = signal.Signals(signum).name
        if self._shield_depth:
            self._shielded += 1
            if self._shielded >= 2:
                raise KeyboardInterrupt
            print(f"dpsweep: {name}: recording how the sweep ended in MLflow; send it again to skip that",
                  file=sys.stderr, flush=True)
            return
        if self._graceful and self.count == 1:
            print(f"dpsweep: {name}: stopping the trials (send it again to stop at once)", file=sys.stderr,
                  flush=True)
            self._pending = True
            self.forward(frame)
            return
        raise KeyboardInterrupt

    def forward(self, frame=None) -> bool:
        """Hand a pending signal to Tune's graceful stop if Tune's handler is installed."""
        if not self._pending or _FORWARD is None:
            return False
        tune_handler = signal.getsignal(_FORWARD)
        if not callable(tune_handler) or tune_handler is self._previous.get(_FORWARD):
            return False  # fit() has not installed it yet: sweeps.runner.ForwardInterrupt retries
        self._pending = False
        tune_handler(_FORWARD, frame)
        return True


def active() -> Interrupts | None:
    """The driver's ``Interrupts`` while one is installed."""
    return _active
