"""A user's own model and dataset, named by import path (docs/own_model.md).

An import path is ``"package.module:name"`` (``name`` may be dotted: ``module:Class.factory``), the
form of setuptools entry points. Two kinds are accepted wherever a trainable takes ``model`` or
``dataset``:

* a **model factory**: ``factory(input_shape=(C, H, W), num_classes=K)`` returns an ``nn.Module``
  mapping float ``[B, C, H, W]`` inputs in [-1, 1] to ``[B, K]`` logits;
* a **dataset loader**: ``loader()`` returns ``(x_train, y_train, x_test, y_test)``: float tensors
  ``[N, C, H, W]`` with values in [-1, 1] (the domain of attack sizes and certificates) and int64
  labels ``[N]`` in ``0 .. K-1``; K is the largest label + 1 over both splits.

:func:`resolve` imports the module (the current directory is searched after ``sys.path``, as for
``python -m``), :func:`load_dataset` calls a loader once per process and checks what it returned,
:func:`build_model` calls a factory with its parameters initialised from a seed and checks one
forward pass; :func:`source_sha256` hashes the file that defines the object (logged with every
trial). Every failure is a ``ValueError`` of one line naming the field (``model`` or ``dataset``)
and the rule. No Ray, no MLflow.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import inspect
import os
import pkgutil
import re
import sys

import torch
import torch.nn as nn

_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
PATH_RULE = "an import path 'package.module:name'"


def is_import_path(value) -> bool:
    """Whether ``value`` is written as an import path ``package.module:name``."""
    return isinstance(value, str) and _PATH.fullmatch(value) is not None


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        cwd = os.getcwd()
        if exc.name != top or cwd in sys.path or "" in sys.path:
            raise
    sys.path.append(cwd)  # the current directory, after everything else (as ``python -m`` puts it first)
    importlib.invalidate_caches()
    return importlib.import_module(module)


def resolve(path: str, field: str):
    """The object named by the import path ``path`` (a ValueError naming ``field`` otherwise)."""
    if not is_import_path(path):
        raise ValueError(f"{field}: must be {PATH_RULE}, got {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        obj = _import(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        hint = _module_hint(module_name, exc, attr)
        raise ValueError(f"{field}: cannot import module {module_name!r} of {path!r} ({_one_line(exc)}){hint}; "
                         f"put its folder on PYTHONPATH or run from the folder that holds it") from None
    done: list[str] = []
    for part in attr.split("."):
        if not hasattr(obj, part):
            owner = repr(f"{module_name}:{'.'.join(done)}") if done else f"module {module_name!r}"
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {module_name + ':' + '.'.join([*done, close[0]])!r}?)" if close else ""
            raise ValueError(f"{field}: {owner} has no attribute {part!r} ({path!r}){hint}")
        obj = getattr(obj, part)
        done.append(part)
    if not callable(obj):
        raise ValueError(f"{field}: {path!r} is a {type(obj).__name__}, not a callable")
    return obj


def _module_hint(module_name: str, exc: Exception, attr: str) -> str:
    """`` (did you mean 'pkg.close:attr'?)`` when ``module_name``'s last part is missing from a
    package that imports, and a module of that package has a close name; else ``""``."""
    parent, _, last = module_name.rpartition(".")
    if not isinstance(exc, ModuleNotFoundError) or exc.name != module_name:
        return ""
    try:
        siblings = [m.name for m in pkgutil.iter_modules(importlib.import_module(parent).__path__)] if parent \
            else [m.name for m in pkgutil.iter_modules()]
    except Exception:  # noqa: BLE001 - a hint only
        return ""
    close = difflib.get_close_matches(last, siblings, n=1)
    return f" (did you mean {(parent + '.' if parent else '') + close[0] + ':' + attr!r}?)" if close else ""


def source_file(path: str) -> str | None:
    """The file that defines the object named by ``path`` (its module's file as a fallback)."""
    obj = resolve(path, "import path")
    try:
        return inspect.getsourcefile(obj) or inspect.getfile(obj)
    except TypeError:
        module = sys.modules.get(path.partition(":")[0])
        return getattr(module, "__file__", None)


@functools.lru_cache(maxsize=64)
def _file_sha256(file: str, mtime_ns: int, size: int) -> str:
    with open(file, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def source_sha256(path: str) -> str:
    """SHA-256 (hex) of the source file that defines the object named by ``path``; "unknown"
    when it has none (a builtin or an extension module)."""
    file = source_file(path)
    if not file or not os.path.isfile(file):
        return "unknown"
    st = os.stat(file)
    return _file_sha256(file, st.st_mtime_ns, st.st_size)


# --------------------------------------------------------------------------- datasets


def _check_split(path: str, name: str, x, y_name: str, y) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"dataset: loader {path!r} returned"
    if not torch.is_tensor(x):
        raise ValueError(f"{where} {name} of type {type(x).__name__}; it must be a torch.Tensor")
    if not torch.is_tensor(y):
        raise ValueError(f"{where} {y_name} of type {type(y).__name__}; it must be a torch.Tensor")
    if not x.is_floating_point():
        raise ValueError(f"{where} {name} of dtype {x.dtype}; it must be a float tensor with values in [-1, 1]")
    if x.dim() != 4:
        raise ValueError(f"{where} {name} of shape {tuple(x.shape)}; it must be [N, C, H, W]")
    if x.shape[0] == 0:
        raise ValueError(f"{where} an empty {name}; each split needs at least one example")
    if y.dtype != torch.int64:
        raise ValueError(f"{where} {y_name} of dtype {y.dtype}; labels must be int64 (torch.long)")
    if tuple(y.shape) != (x.shape[0],):
        raise ValueError(f"{where} {y_name} of shape {tuple(y.shape)} for {x.shape[0]} images; it must be [N]")
    x = x.detach().to("cpu", torch.float32)
    y = y.detach().to("cpu")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{where} {name} with NaN or infinite values")
    lo, hi = float(x.min()), float(x.max())
    if lo < -1.0 or hi > 1.0:
        raise ValueError(f"{where} {name} with values in [{lo:g}, {hi:g}]; inputs must lie in [-1, 1] (the domain "
                         f"of attack sizes and certificates, e.g. 2 * x / 255 - 1 for 8-bit images)")
    if int(y.min()) < 0:
        raise ValueError(f"{where} {y_name} with a negative label ({int(y.min())}); labels are 0 .. K-1")
    return x.contiguous(), y.contiguous()


@functools.lru_cache(maxsize=4)
def load_dataset(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)`` from the loader ``path``, called once per process and
    checked (float [N, C, H, W] in [-1, 1], converted to float32; int64 labels [N] >= 0; both splits
    of the same image shape; at least two classes). The tensors are shared: do not modify them."""
    loader = resolve(path, "dataset")
    try:
        out = loader()
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"dataset: loader {path!r} raised {_one_line(exc)}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        what = f"a {type(out).__name__}" + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else "")
        raise ValueError(f"dataset: loader {path!r} returned {what}; it must return (x_train, y_train, x_test, y_test)")
    x, y = _check_split(path, "x_train", out[0], "y_train", out[1])
    xt, yt = _check_split(path, "x_test", out[2], "y_test", out[3])
    if x.shape[1:] != xt.shape[1:]:
        raise ValueError(f"dataset: loader {path!r} returned train images of shape {tuple(x.shape[1:])} and test "
                         f"images of shape {tuple(xt.shape[1:])}; they must match")
    if max(int(y.max()), int(yt.max())) < 1:
        raise ValueError(f"dataset: loader {path!r} returned a single class (every label 0); a classifier needs two")
    return x, y, xt, yt


def dataset_shape(path: str) -> tuple[int, int, int]:
    """``(C, H, W)`` of the loader's images."""
    return tuple(int(s) for s in load_dataset(path)[0].shape[1:])


def dataset_classes(path: str) -> int:
    """K: the largest label of either split + 1."""
    _, y, _, yt = load_dataset(path)
    return max(int(y.max()), int(yt.max())) + 1


# --------------------------------------------------------------------------- models


def build_model(path: str, input_shape: tuple[int, int, int], num_classes: int, seed: int = 0, *,
                check: bool = True) -> nn.Module:
    """``factory(input_shape=..., num_classes=...)`` of the import path ``path``, its parameters
    initialised under ``torch.manual_seed(seed)`` without touching the global RNG; with ``check``
    one forward pass of a zero image (eval mode, no gradient) must give finite ``[1, num_classes]``
    logits."""
    factory = resolve(path, "model")
    shape = tuple(int(s) for s in input_shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        try:
            model = factory(input_shape=shape, num_classes=int(num_classes))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"model: factory {path!r} raised {_one_line(exc)} when called with "
                             f"input_shape={shape}, num_classes={num_classes}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: factory {path!r} returned a {type(model).__name__}; it must return a torch.nn.Module")
    if check:
        check_forward(model, path, shape, int(num_classes))
    return model


def check_forward(model: nn.Module, path: str, input_shape: tuple[int, int, int], num_classes: int) -> None:
    """One forward pass of a zero image: finite float logits of shape ``[1, num_classes]``."""
    was_training = model.training
    param = next(model.parameters(), None)
    x = torch.zeros((1, *input_shape), device=param.device if param is not None else "cpu")
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"model: {path!r} failed a forward pass on one input of shape [1, {', '.join(map(str, input_shape))}]"
                         f" ({_one_line(exc)})") from None
    finally:
        model.train(was_training)
    if not torch.is_tensor(out) or not out.is_floating_point():
        raise ValueError(f"model: {path!r} returned {type(out).__name__} from its forward pass; it must return float "
                         f"logits [B, {num_classes}]")
    if tuple(out.shape) != (1, num_classes):
        raise ValueError(f"model: {path!r} returned logits of shape {tuple(out.shape)} for one input; they must be "
                         f"[1, {num_classes}] (num_classes = {num_classes})")
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"model: {path!r} returned NaN or infinite logits for a zero input")


def source_params(config: dict) -> dict[str, str]:
    """``<key>_sha256`` (:func:`source_sha256`) for every ``model``/``dataset`` value of ``config``
    that is an import path: logged with the trial beside the path itself, so a result can be
    traced to the exact source that produced it."""
    return {f"{key}_sha256": source_sha256(config[key]) for key in ("model", "dataset")
            if is_import_path(config.get(key))}
