"""A module whose name users expect to be a function (``dpmech.certify``, ``dpmech.audit``).

``import dpmech.certify`` binds the *module* to ``dpmech.certify``; users then write
``dpmech.certify(model, x, y)`` and get ``'module' object is not callable``. ``callable_module``
makes such a module forward a call to its function of the same name; ``from dpmech.certify import
certify`` and every other name of the module are unchanged.
"""

from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rsplit(".", 1)[-1])(*args, **kwargs)


def callable_module(name: str) -> None:
    """Make module ``name`` callable: calling it calls its function of the same (last) name."""
    sys.modules[name].__class__ = _CallableModule
