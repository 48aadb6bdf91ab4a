"""Only layers that treat each example alone: a functional check of a model's training forward pass.

DP-SGD's guarantee (Abadi et al. 2016, Alg. 1) rests on one property of the model that no clipping
engine checks: the loss l_i of example i, hence its gradient g_i, is a function of example i alone.
Clipping (Alg. 1, "clip gradient": g_i <- g_i / max(1, ||g_i|| / C)) then bounds each summand, and
adding or removing one example moves sum_i g_i by at most C, the sensitivity the noise
N(0, sigma^2 C^2 I) is calibrated to. A layer that mixes the examples of a batch (BatchNorm in
training mode, with or without affine parameters; a hand-written ``x - x.mean(0)``) breaks this:
one example moves every other example's loss, so the clipped sum moves by up to B C. A buffer
updated from the batch (BatchNorm's or InstanceNorm's ``running_mean``) is released with the model
without any noise. Opacus's ``ModuleValidator`` and book-keeping's ``check_model`` look only at
modules with trainable parameters, so a parameter-free BatchNorm passes both; hence this check is
functional, on what the forward pass does, not on a list of layer types.

:func:`per_example_problem` runs the model (a copy, in training mode, under a fixed seed) on a
batch of ``BATCH`` random inputs shaped like the given examples, then

1. **changed**: the same batch with example 0 replaced by another random input (the same seed, so
   random layers such as Dropout or PixelDP's noise layer draw the same numbers): no other
   example's output may move, at any module (forward hooks on every module);
2. **removed**: the batch without its last example, when the forward pass is deterministic (two
   passes under different seeds agree): no remaining example's output may move. A random forward
   pass draws a different number of values for a smaller batch, so the removal test is skipped
   for it and the change test alone applies;
3. **buffers**: no buffer may change during a training forward pass. This includes counters that
   do not depend on the batch's values (BatchNorm's ``num_batches_tracked``, a step counter): the
   trainer takes no forward pass on an empty Poisson batch, so the number of forward passes
   depends on the data, and a counter released with the model would reveal it outside the
   accounting; nor can two or three forward passes tell a counter from a statistic of the batch in
   general. A model with such a buffer is refused; keep the count outside the model.

"Moved" means a difference above ``RTOL`` times the largest magnitude of that output (rounding of
a different batch size stays orders of magnitude below; a mixing layer moves outputs by about the
change divided by the batch size). The first module (in the order their forward passes finish)
whose output moved although its input did not is named; where every module's output that moved
had an input that moved already, the mixing happened in a parent's own forward code between its
submodules, and that parent is named. A model whose forward pass fails on the check's inputs is
reported with the error. This is a test of the model on random inputs, not a proof: a layer that
mixes examples only for some inputs (e.g. above a threshold) can pass it.

Float inputs are drawn uniformly from [-1, 1] (the project's input domain) with the examples'
shape and dtype, on the model's device; integer inputs uniformly between the examples' smallest and
largest value. Only
the examples' shapes (and, for integers, their range) are used, so the outcome of the check does
not depend on the training data. No Ray, no MLflow.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

BATCH = 8       # examples in the check's batch
RTOL = 1e-4     # an output "moved" when it changed by more than RTOL x its largest magnitude
SEED = 0        # the check's seed (inputs and the forward passes' random draws)


def check_per_example(model: nn.Module, *examples: torch.Tensor) -> None:
    """A ValueError of one line naming the first module of ``model`` whose training forward pass
    mixes examples or updates a buffer (:func:`per_example_problem`); nothing otherwise."""
    problem = per_example_problem(model, *examples)
    if problem:
        raise ValueError(problem)


def per_example_problem(model: nn.Module, *examples: torch.Tensor) -> str | None:
    """Why ``model``'s training forward pass does not treat each example alone (one line starting
    with ``model: ``), or None. ``examples``: one batch-first tensor per positional input of the
    model (e.g. images ``[n, C, H, W]``; a DPGAN critic's images and labels); only their shapes,
    dtypes and devices (and the range of integer inputs) are used."""
    if not examples or not all(torch.is_tensor(e) and e.dim() >= 1 for e in examples):
        raise ValueError("examples: one batch-first tensor [n, ...] per input of the model is needed")
    gen = torch.Generator().manual_seed(SEED)
    first = next(model.parameters(), None)
    first = first if first is not None else next(model.buffers(), None)
    device = first.device if first is not None else examples[0].device     # the inputs go where the model is
    full = [_draw(e, BATCH + 1, gen).to(device) for e in examples]
    base_x = [x[:BATCH] for x in full]
    changed_x = [torch.cat([x[BATCH:], x[1:BATCH]]) for x in full]       # example 0 replaced
    removed_x = [x[:BATCH - 1] for x in full]                             # the last example removed

    base, again = _run(model, base_x, SEED, repeat_seed=SEED + 1)
    if isinstance(base, str):
        return base
    runs = [(_run(model, changed_x, SEED)[0], range(1, BATCH), "changing one example")]
    if _same(base.out, again):          # deterministic: the removal test applies too
        runs.append((_run(model, removed_x, SEED)[0], range(BATCH - 1), "removing one example"))
    problems: dict[str, list[str]] = {}
    for run, rows, what in runs:
        if isinstance(run, str):
            return run
        culprit, by = _first_mixing(base, run, list(rows))
        if culprit is not None and culprit not in problems:
            where = "" if by is None else f" in its own forward code (before its submodule {by!r})"
            problems[culprit] = [f"mixes the examples of a batch{where} ({what} moved another example's output)"]
    for name, buffers in base.buffers.items():
        problems.setdefault(name, []).append(
            f"updates its buffer{'s' if len(buffers) > 1 else ''} {', '.join(map(repr, buffers))} in a training "
            f"forward pass (released with the model, outside the clipping and the noise)")
    if not problems:
        return None
    name = min(problems, key=lambda n: base.order.get(n, len(base.order)))
    module = dict(model.named_modules())[name]
    label = f"module {name!r} ({type(module).__name__})" if name else f"the model itself ({type(module).__name__})"
    return (f"model: {label} {' and '.join(problems[name])}; DP-SGD bounds one example's influence only when each "
            f"example's output depends on that example alone and no buffer changes in training: use a per-example "
            f"layer instead (GroupNorm, LayerNorm; docs/own_model.md)")


# ----------------------------------------------------------------------------- internals


def _draw(example: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    shape = (n, *example.shape[1:])
    if example.is_floating_point():
        x = torch.rand(shape, generator=gen, dtype=torch.float64).mul_(2).sub_(1).to(example.dtype)
    elif example.dtype == torch.bool:
        x = torch.rand(shape, generator=gen) < 0.5
    else:
        lo, hi = (int(v) for v in (example.min(), example.max())) if example.numel() else (0, 0)
        x = torch.randint(lo, hi + 1, shape, generator=gen).to(example.dtype)
    return x


def _rows(value, n: int) -> list[torch.Tensor]:
    """The batch-first tensors (first dimension n) in a module's inputs or outputs, detached copies."""
    if torch.is_tensor(value):
        return [value.detach().clone()] if value.dim() >= 1 and value.shape[0] == n else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _rows(v, n)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _rows(v, n)]
    return []


class _Record:
    """One forward pass: per module call (name, index of the call), its batch-first inputs and
    outputs, in the order the calls finished; the buffers each module changed."""

    def __init__(self):
        self.calls: dict[tuple[str, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.order: dict[str, int] = {}                 # module name -> position of its first finished call
        self.buffers: dict[str, list[str]] = {}         # module name -> buffers it changed
        self.out: list[torch.Tensor] = []


def _run(model: nn.Module, xs: list[torch.Tensor], seed: int, repeat_seed: int | None = None):
    """Forward passes of a fresh copy of ``model`` in training mode on ``xs`` under ``seed``, with
    hooks recording every module call: a :class:`_Record` (or a one-line problem when the forward
    pass fails); with ``repeat_seed``, also the model's outputs of a second pass of the same copy
    under that seed (to tell a random forward pass from a deterministic one)."""
    try:
        net = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - an attribute that cannot be copied: run the model itself, restored after
        net = None
    target = model if net is None else net
    saved = None if net is not None else ({k: b.detach().clone() for k, b in model.named_buffers()}, model.training)
    n = xs[0].shape[0]
    rec = _Record()
    names = {m: name for name, m in target.named_modules()}
    counts: dict[str, int] = {}
    before: dict[nn.Module, list[torch.Tensor]] = {}

    def pre(module, args):
        before[module] = [b.detach().clone() for b in module.buffers(recurse=False)]

    def post(module, args, kwargs, output):
        name = names[module]
        k = counts.get(name, 0)
        counts[name] = k + 1
        rec.calls[(name, k)] = (_rows((args, kwargs), n), _rows(output, n))
        rec.order.setdefault(name, len(rec.order))
        changed = [bn for (bn, b), old in zip(module.named_buffers(recurse=False), before.pop(module, []))
                   if not _equal(b, old)]
        if changed:
            rec.buffers.setdefault(name, [])
            rec.buffers[name] += [b for b in changed if b not in rec.buffers[name]]

    handles = []
    try:
        initial = {k: b.detach().clone() for k, b in target.named_buffers()}
        for m in target.modules():
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        target.train()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=_devices(xs)):
                torch.manual_seed(seed)
                rec.out = _rows(target(*[x.clone() for x in xs]), n)     # a copy: a model may change its input
        except Exception as exc:  # noqa: BLE001
            return (f"model: its training forward pass failed on the per-example check's batch of {n} inputs "
                    f"of shape {list(xs[0].shape[1:])} ({type(exc).__name__}: {' '.join(str(exc).split())})"), None
        for key, b in target.named_buffers():      # buffers changed outside their own module's forward
            if key in initial and not _equal(b, initial[key]):
                owner, _, leaf = key.rpartition(".")
                if leaf not in rec.buffers.get(owner, []):
                    rec.buffers.setdefault(owner, []).append(leaf)
                    rec.order.setdefault(owner, len(rec.order))
        again = None
        if repeat_seed is not None:
            for h in handles:
                h.remove()
            handles = []
            with torch.no_grad(), torch.random.fork_rng(devices=_devices(xs)):
                torch.manual_seed(repeat_seed)
                again = _rows(target(*[x.clone() for x in xs]), n)
        return rec, again
    finally:
        for h in handles:
            h.remove()
        if saved is not None:
            state, training = saved
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(state[k])
            model.train(training)


def _devices(xs: list[torch.Tensor]) -> list[int]:
    return sorted({x.device.index or 0 for x in xs if x.device.type == "cuda"})


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
        a, b, rtol=0, atol=0, equal_nan=True)))


def _moved(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` differs from ``a`` beyond rounding (RTOL x the largest finite magnitude of ``a``;
    a non-finite entry must be the same non-finite value)."""
    if a.shape != b.shape:
        return True
    if torch.equal(a, b):
        return False
    if not a.is_floating_point():
        return True
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(), b[~fb].nan_to_num()):
        return True
    a, b = a[fa].double(), b[fb].double()
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool(((a - b).abs() > RTOL * scale).any())


def _same(xs: list[torch.Tensor], ys: list[torch.Tensor] | None) -> bool:
    return ys is not None and len(xs) == len(ys) and all(not _moved(x, y) for x, y in zip(xs, ys))


def _first_mixing(base: _Record, run: _Record, rows: list[int]) -> tuple[str | None, str | None]:
    """The module whose output ``rows`` (the untouched examples, at the same positions in both
    passes) moved first although its input rows did not, else the nearest parent whose input rows
    did not move (with the submodule whose input had); (None, None) when no output moved."""
    def moved(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        if len(a) != len(b):
            return True
        return any(_moved(x[rows], y[rows]) for x, y in zip(a, b))

    first = None
    for key, (ins, outs) in base.calls.items():
        other = run.calls.get(key)
        if other is None or moved(outs, other[1]):
            first = key
            break
    if first is None:
        return None, None
    name = first[0]
    other = run.calls.get(first)
    if other is not None and not moved(base.calls[first][0], other[0]):
        return name, None
    parts = name.split(".") if name else []
    for i in range(len(parts) - 1, -1, -1):           # the nearest parent whose input did not move
        parent = ".".join(parts[:i])
        calls = [(k, v) for k, v in base.calls.items() if k[0] == parent]
        if not calls:
            continue
        key, (ins, _) = calls[0]
        other = run.calls.get(key)
        if other is not None and not moved(ins, other[0]):
            return parent, name
    return name, None
