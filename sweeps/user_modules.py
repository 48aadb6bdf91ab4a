"""Ship a user's model and dataset code to the Ray workers (docs/own_model.md).

A spec may name a network or a dataset by import path (``model: mypkg.nets:small_cnn``,
``dataset: mypkg.data:load``). The driver imports them while validating; the trials import them
again in Ray's worker processes, possibly on other machines. :func:`runtime_env` lists the
top-level package (a folder) or module (a ``.py`` file) of every such path as Ray's
``py_modules``: Ray packs them at ``ray.init`` and puts them on every worker's ``sys.path``,
on one machine or a cluster alike. Modules installed in the Python environment (site-packages,
the standard library) and dpsweep's own packages are left out: a cluster's nodes have the
environment already (cluster.yaml installs it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from dpmech.datasets.user_code import is_import_path, resolve

_KEYS = ("model", "dataset")
_OWN = ("dpmech", "trainables", "sweeps")


def import_paths(spec) -> list[str]:
    """Every import path written as a ``model`` or ``dataset`` value anywhere in ``spec`` (a
    SweepSpec or its dict: common, search values, grids and choices)."""
    data = spec.model_dump() if hasattr(spec, "model_dump") else spec
    found: list[str] = []

    def walk(node, under_key: bool) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, under_key or k in _KEYS)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, under_key)
        elif under_key and is_import_path(node) and node not in found:
            found.append(node)

    walk(data, False)
    return found


def _installed_roots() -> list[Path]:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return [Path(r).resolve() for r in roots if r]


def module_location(top: str) -> Path | None:
    """The folder of package ``top`` or the file of module ``top``; None when it is installed
    (site-packages, standard library), built in, or one of dpsweep's own packages."""
    if top in _OWN or top in sys.builtin_module_names:
        return None
    spec = importlib.util.find_spec(top)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        if len(locations) != 1:   # a namespace package spread over folders: ship none, say so
            raise ValueError(f"{top!r} is a namespace package over {len(locations)} folders; give it an "
                             f"__init__.py so it can be shipped to the Ray workers")
        path = Path(locations[0]).resolve()
    elif spec.origin and os.path.isfile(spec.origin):
        path = Path(spec.origin).resolve()
    else:
        return None
    if any(path.is_relative_to(root) for root in _installed_roots()):
        return None
    return path


def runtime_env(spec) -> dict | None:
    """Ray's ``runtime_env`` for the spec's import paths (``{"py_modules": [...]}``), or None when
    the spec names none outside the installed environment. Each path is resolved first (so the
    current directory is searched as in validation)."""
    modules: list[str] = []
    for path in import_paths(spec):
        resolve(path, "import path")
        location = module_location(path.split(":")[0].split(".")[0])
        if location is not None and str(location) not in modules:
            modules.append(str(location))
    return {"py_modules": modules} if modules else None
