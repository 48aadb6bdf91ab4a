"""Only layers that treat each example alone: a functional check of a model's training pass.

DP-SGD's guarantee (Abadi et al. 2016, Alg. 1) rests on one property of the model that no clipping
engine checks: the loss l_i of example i, hence its gradient g_i, is a function of example i alone.
Clipping (Alg. 1, "clip gradient": g_i <- g_i / max(1, ||g_i|| / C)) then bounds each summand, and
adding or removing one example moves sum_i g_i by at most C, the sensitivity the noise
N(0, sigma^2 C^2 I) is calibrated to. A layer that mixes the examples of a batch (BatchNorm in
training mode, with or without affine parameters; a hand-written ``x - x.mean(0)``; a custom
``torch.autograd.Function`` whose backward pass mixes the rows of the gradient) breaks this: one
example moves every other example's gradient, so the clipped sum moves by up to B C. A buffer or
a frozen parameter updated from the batch (BatchNorm's ``running_mean``) is released with the model
without any noise. Opacus's ``ModuleValidator`` and book-keeping's ``check_model`` look only at
modules with trainable parameters, so a parameter-free BatchNorm passes both; hence this check is
functional, on what the model does, not on a list of layer types.

**It runs the model the way training does** (issue 48: a model can tell a check from training):
a copy of the model in training mode, with gradients enabled, through forward *and* backward
passes, at the training batch size, and over several calls of one copy. :func:`per_example_problem`
makes two *probes*: the first on a batch of ``BATCH`` random inputs shaped like the given examples;
then ``AGE`` more forward passes of the same copy (a model that counts its calls in a Python
attribute and starts mixing later is then past its count); then the second probe, on that aged copy,
at the trainer's expected batch size (``batch_size``, capped at ``MAX_BATCH``). Each comparison call
of a probe gets its own copy of the copy's Python state (the same counters, a noise layer's own
generators in the same state) sharing its parameters and buffers, and runs under the same seed
(Dropout and PixelDP's noise layer draw the same numbers). A probe compares, at every module
(forward hooks), with n the probe's batch size:

1. **changed**: the batch with example 0 replaced by another random input: no other example's
   output may move;
2. **removed**: the batch without its last example, when the forward pass is deterministic (two
   passes under different seeds agree; a random forward pass draws a different number of values
   for a smaller batch, so the removal test is skipped for it): no remaining example's output may
   move. A layer whose output depends on the batch size is caught here;
3. **gradients**: a per-example loss surrogate l_i = <r_i, y_i> + ||y_i||^2 / 2 on the model's
   outputs y_i (r_i fixed random directions; nonlinear, so a shift of an output moves its
   gradient), and two backward passes of L(w) = sum_i w_i l_i from the same forward pass, with all
   weights 1 and with random weights w in [0.5, 1.5] (0 for examples 0 and n - 1). Backward passes
   are linear in the output gradient, so in a model whose row i depends on example i alone, the
   gradient of L(w) at row i of any module's input or output is w_i times the gradient of L(1)
   there: it carries l_i's gradient only. If row i also carries l_j's (j != i: a forward pass that
   mixes, or a backward pass that does with an identity forward pass), the two differ by
   sum_{j != i} (w_j - w_i) dl_j / dz_i, which random weights leave nonzero. This checks every
   example of the batch at every module with two backward passes, whatever n (instead of one
   per-example gradient per example). The module named is the deepest whose own backward pass
   (the vector-Jacobian product from its outputs to its inputs) breaks the rule;
4. **parameter gradients** (first probe): the gradient of L(w) w.r.t. every trainable parameter,
   what the clipping engines see in the end, may not move when example 0 is changed or the last
   removed (their weights are 0): this catches mixing that no module boundary shows (inside the
   first layer, or on a parameter itself);
5. **parameter uses** (first probe, issue 48 §5): during each module's forward pass its own
   parameters are shadowed by views of themselves (an entry in the module's ``__dict__``), so
   autograd gives the gradient of the uses inside the module apart from the others. The engines
   compute per-example gradients from hooks on the module that owns a parameter, so a parameter
   also used elsewhere (a tied autoencoder's ``F.linear(h, self.enc.weight.t())`` in its root's
   forward) is clipped wrongly on every route: 'bk' and Opacus's 'flat' drop the other use's
   gradient (the model trained is not the model written), Opacus's 'ghost' clips the norms of the
   hooked uses and then back-propagates through every use (an unclipped contribution). Such a
   parameter, whose gradient is not the sum of its uses inside its module, is refused on every
   route, naming it. A parameter shared by two modules (each use inside a module) passes: bk and
   flat clip it exactly;
6. **state**: no parameter (frozen ones included), buffer or other ``state_dict`` entry may change
   in a training pass (each call's version counters; every value at the end of each probe and of
   the aging, so a change through ``.data`` is seen too). This includes counters that do not
   depend on the batch's values (BatchNorm's ``num_batches_tracked``, a step counter): the trainer
   takes no forward pass on an empty Poisson batch, so the number of forward passes depends on the
   data, and a counter released with the model would reveal it outside the accounting. A model
   with such state is refused; keep the count outside the model.

"Moved" means a difference above ``RTOL`` times the largest magnitude of that value (rounding of
a different batch size or of other loss weights stays orders of magnitude below; a mixing layer
moves outputs by about the change divided by the batch size: a layer adding 0.005 times the batch
mean is caught, tests/test_per_example_mixers.py). The first module (in the order their forward
passes finish) whose output moved although its input did not is named; where every module's output
that moved had an input that moved already, the mixing happened in a parent's own forward code
between its submodules, and that parent is named. A model whose forward or backward pass fails on
the check's inputs is reported with the error.

**Limits.** This is a test of the model on random inputs, not a proof. Data-dependent mixing, a
layer that mixes examples only for some input values (above a threshold, for one label, for an
input no random draw comes near), stays out of reach of any test on random inputs, this one
included. So does a model that starts mixing later than its ``AGE`` + 1-th forward pass (the
second probe's calls are a copy's fifth), or only in batches larger than the one checked (``MAX_BATCH``; Poisson batches vary around the
expected size), or that tells the check from training otherwise (e.g. by its inputs' values).

Cost (the trainer runs the check once per private run): the first probe takes 4 forward and 4
backward passes at ``BATCH``, the aging 4 forward passes at ``BATCH``, the second probe 3 forward
and 2 backward passes at the training batch size. CPU time, one thread, the best of 5 (a shared
2-core machine: runs varied by up to a third), side by side with the check before issue 48 (4
forward passes under ``no_grad`` at 8 and 7): the PixelDP MNIST CNN 0.08-0.12 s with no batch size,
0.24-0.30 s at batch 256, 0.9 s at 1024 (before: 14-24 ms at any); the T&B CNN 25 ms, 85-105 ms and
0.3 s (before: 7-11 ms).

Float inputs are drawn uniformly from [-1, 1] (the project's input domain) with the examples'
shape and dtype, on the model's device; integer inputs uniformly between the examples' smallest and
largest value. Only the examples' shapes (and, for integers, their range) are used, so the outcome
of the check does not depend on the training data. No Ray, no MLflow.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

BATCH = 8         # examples in the first probe's batch (and in the calls that age the copy)
MAX_BATCH = 1024  # the second probe's batch: the training batch size, capped at this
AGE = 4           # training forward passes of the model copy between the two probes
RTOL = 1e-4       # a value "moved" when it changed by more than RTOL x its largest magnitude
SEED = 0          # the check's seed (inputs, weights and the forward passes' random draws)
ROWS = 16         # rows of each module's inputs and outputs kept for the forward comparisons


def check_per_example(model: nn.Module, *examples: torch.Tensor, batch_size: int | None = None) -> None:
    """A ValueError of one line naming the first module of ``model`` whose training pass mixes
    examples, updates its state or uses a parameter outside the module (:func:`per_example_problem`);
    nothing otherwise."""
    problem = per_example_problem(model, *examples, batch_size=batch_size)
    if problem:
        raise ValueError(problem)


def per_example_problem(model: nn.Module, *examples: torch.Tensor, batch_size: int | None = None) -> str | None:
    """Why ``model``'s training pass does not treat each example alone (one line starting with
    ``model: ``), or None. ``examples``: one batch-first tensor per positional input of the model
    (e.g. images ``[n, C, H, W]``; a DPGAN critic's images and labels); only their shapes, dtypes
    and devices (and the range of integer inputs) are used. ``batch_size``: the batch size training
    uses (the second probe runs at it, at most ``MAX_BATCH``; None: ``BATCH``)."""
    if not examples or not all(torch.is_tensor(e) and e.dim() >= 1 for e in examples):
        raise ValueError("examples: one batch-first tensor [n, ...] per input of the model is needed")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size: the training batch size, a positive integer (or None), got {batch_size!r}")
    gen = torch.Generator().manual_seed(SEED)
    first = next(model.parameters(), None)
    first = first if first is not None else next(model.buffers(), None)
    device = first.device if first is not None else examples[0].device     # the inputs go where the model is
    copies = _Copies(model)
    try:
        found = _Found()
        problem = _probe(copies, examples, BATCH, gen, device, found, first=True)
        if problem is None and not found:
            problem = _age(copies, examples, gen, device, found)
        if problem is None and not found:
            n = min(max(batch_size or BATCH, BATCH), MAX_BATCH)
            problem = _probe(copies, examples, n, gen, device, found, first=False)
        return problem or found.message(copies.root)
    finally:
        copies.close()


# ----------------------------------------------------------------------------- the probes


def _probe(copies: _Copies, examples, n: int, gen: torch.Generator, device, found: _Found, first: bool) -> str | None:
    """The comparisons on a batch of ``n`` (module docstring), each call on its own copy of
    ``copies.root``; what is found goes into ``found``; a one-line problem when a pass fails. The
    ``first`` probe also compares the parameters' gradients (after changing and removing an
    example) and traces each parameter's uses."""
    full = [_draw(e, n + 1, gen).to(device) for e in examples]
    base_x = [x[:n] for x in full]
    changed_x = [torch.cat([x[n:], x[1:n]]) for x in full]       # example 0 replaced
    removed_x = [x[:n - 1] for x in full]                         # the last example removed
    ones = torch.ones(n, dtype=torch.float64)
    w = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5  # the weights of the examples' losses
    w[0] = w[n - 1] = 0.0                                         # the changed and the removed example: none

    net = copies.fresh()
    base = _call(net, base_x, SEED, (ones, w), gen=gen, params=first)
    if isinstance(base, str):
        return base
    if first:           # a second pass under another seed: is the forward pass random?
        again = _call(net, base_x, SEED + 1)
        if isinstance(again, str):
            return again
        copies.deterministic = _same(base.out, again.out)
        copies.settle(net, found, base, again)
    else:
        copies.settle(net, found, base)
    runs = [("changing one example", changed_x, w, base.r, list(range(1, min(n, ROWS))))]
    if copies.deterministic:      # the removal test applies too
        runs.append(("removing one example", removed_x, w[:n - 1], [t[:n - 1] for t in base.r],
                     list(range(min(n - 1, ROWS)))))
    moved_grad = None
    for i, (what, xs, weights, r, rows) in enumerate(runs):
        net = copies.fresh()
        run = _call(net, xs, SEED, (weights,) if first else (), r=r, gen=gen, params=first)
        if isinstance(run, str):
            return run
        copies.settle(net, found, run, full=i == len(runs) - 1)
        culprit, by = _first_mixing(base, run, rows)
        if culprit is not None and "mix" not in found.kinds.get(culprit, ()):
            where = "" if by is None else f" in its own forward code (before its submodule {by!r})"
            found.add(culprit, f"mixes the examples of a batch{where} ({what} moved another example's output)",
                      "mix", base.order)
        elif moved_grad is None:
            moved_grad = next(((what, k) for k, g in base.grads.items() if k in run.grads and _moved(g, run.grads[k])),
                              None)
    if base.grad_culprit is not None:
        name, own = base.grad_culprit
        if "mix" not in found.kinds.get(name, ()):
            where = " in its own forward code" if own else ""
            found.add(name, f"mixes the examples' gradients{where} (in the backward pass, one example's loss moved "
                            f"another example's gradient)", "mix", base.order)
    if moved_grad is not None and not any("mix" in k for k in found.kinds.values()):
        what, key = moved_grad
        owner, _, leaf = key.rpartition(".")
        found.add(owner, f"mixes the examples of a batch ({what} moved the other examples' gradient of its "
                         f"parameter {leaf!r})", "mix", base.order)
    for key in base.outside:
        owner = key.rpartition(".")[0]
        found.add(owner, f"has its parameter {key!r} used outside its forward pass (the parameter's gradient is "
                         f"not all in what the per-example clipping sees)", "outside", base.order)
    return None


def _age(copies: _Copies, examples, gen: torch.Generator, device, found: _Found) -> str | None:
    """``AGE`` training forward passes of ``copies.root`` itself on random batches, so that the
    second probe's copies are of a model that has been called before."""
    net = copies.root
    for i in range(AGE):
        xs = [_draw(e, BATCH, gen).to(device) for e in examples]
        run = _call(net, xs, SEED + 2 + i)
        if isinstance(run, str):
            return run
        copies.settle(net, found, run, full=i == AGE - 1)
    return None


# ----------------------------------------------------------------------------- what was found


class _Found:
    """The problems found, per module name (its phrases and kinds: "mix", "state", "outside")."""

    def __init__(self):
        self.phrases: dict[str, list[str]] = {}
        self.kinds: dict[str, set[str]] = {}
        self.state: dict[str, dict[str, list[str]]] = {}     # module -> kind of state -> leaf names
        self.frozen: set[str] = set()                        # frozen parameters among them (full names)
        self.order: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def add(self, name: str, phrase: str, kind: str, order: dict[str, int] | None = None) -> None:
        if phrase not in self.phrases.setdefault(name, []):
            self.phrases[name].append(phrase)
        self.kinds.setdefault(name, set()).add(kind)
        if order:
            for k, v in order.items():
                self.order.setdefault(k, v)

    def note_state(self, changed: list[tuple[str, str, str, bool]], records) -> None:
        """State that calls changed: (module name, kind, leaf, frozen) and the buffers each module
        changed in its own forward pass (``records``)."""
        changed = [(name, "buffer", leaf, False) for rec in records for name, leaves in rec.buffers.items()
                   for leaf in leaves] + list(changed)
        for name, kind, leaf, frozen in changed:
            leaves = self.state.setdefault(name, {}).setdefault(kind, [])
            if leaf not in leaves:
                leaves.append(leaf)
            if frozen:
                self.frozen.add(f"{name}.{leaf}" if name else leaf)
            self.kinds.setdefault(name, set()).add("state")
            self.phrases.setdefault(name, [])
        for rec in records:
            for k, v in rec.order.items():
                self.order.setdefault(k, v)

    def _state_phrase(self, name: str) -> str:
        parts = []
        for kind, one, many in (("buffer", "buffer", "buffers"), ("parameter", "parameter", "parameters"),
                                ("entry", "state-dict entry", "state-dict entries")):
            leaves = self.state[name].get(kind, [])
            if leaves:
                frozen = [leaf for leaf in leaves if (f"{name}.{leaf}" if name else leaf) in self.frozen]
                note = f" (requires_grad False)" if kind == "parameter" and frozen == leaves else ""
                parts.append(f"{one if len(leaves) == 1 else many} {', '.join(map(repr, leaves))}{note}")
        return (f"updates its {' and its '.join(parts)} in a training forward pass (released with the model, outside "
                f"the clipping and the noise)")

    def message(self, net: nn.Module) -> str | None:
        if not self.kinds:
            return None
        name = min(self.kinds, key=lambda n: self.order.get(n, len(self.order)))
        phrases = list(self.phrases[name]) + ([self._state_phrase(name)] if name in self.state else [])
        modules = dict(net.named_modules())
        kind = type(modules[name]).__name__ if name in modules else "?"
        label = f"module {name!r} ({kind})" if name else f"the model itself ({kind})"
        tails = []
        if self.kinds[name] - {"outside"}:
            tails.append("DP-SGD bounds one example's influence only when each example's output and gradient depend "
                         "on that example alone and no buffer or parameter changes in training: use a per-example "
                         "layer instead (GroupNorm, LayerNorm; docs/own_model.md)")
        if "outside" in self.kinds[name]:
            tails.append("the clipping engines see a parameter's uses inside its module only ('bk' and 'flat' would "
                         "drop the other uses' gradient, 'ghost' would leave it unclipped): use each parameter inside "
                         "its module's forward pass (to tie a weight, give it to a second module; docs/own_model.md)")
        return f"model: {label} {' and '.join(phrases)}; {'; '.join(tails)}"


# ----------------------------------------------------------------------------- copies and state


class _Copies:
    """The model copy the check runs: ``root``, a deep copy of the model (aged by :func:`_age`).
    :meth:`fresh` gives one call its own copy of ``root``'s Python state (so that every comparison
    starts from the same one, e.g. a noise layer's own generators), sharing ``root``'s parameters
    and buffers; :meth:`settle` notes what a call changed in them and restores it. A model that
    cannot be deep-copied is run itself (restored after each call and at the end)."""

    def __init__(self, model: nn.Module):
        self.model, self.training = model, model.training
        try:
            self.root, self.own = copy.deepcopy(model), False
        except Exception:  # noqa: BLE001 - an attribute that cannot be copied: run the model itself, restored
            self.root, self.own = model, True
        self.reference = _snapshot(self.root)       # the state every call starts from
        self.versions = _versions(self.root)
        self.deterministic = True                   # the first probe's finding: two seeds, the same outputs

    def fresh(self) -> nn.Module:
        if self.own:
            return self.root
        shared = {id(t): t for t in (*self.root.parameters(), *self.root.buffers())}
        return copy.deepcopy(self.root, shared)

    def settle(self, net: nn.Module, found: _Found, *records: _Record, full: bool = False) -> None:
        """Note in ``found`` the parameters, buffers and state-dict entries of ``net`` that its calls
        changed (those whose version counter moved; with ``full``, every one compared by value: a
        change through ``.data`` moves no counter) and the buffers each module changed in its own
        forward pass; restore the changed ones."""
        changed = _changed(self.reference, net, None if full else self.versions)
        found.note_state([(key.rpartition(".")[0], kind, key.rpartition(".")[2], frozen)
                          for key, kind, frozen in changed], records)
        if changed:
            _restore(net, self.reference, {key for key, _, _ in changed})
            self.versions = _versions(self.root)

    def close(self) -> None:
        if self.own:
            _restore(self.model, self.reference)
        self.model.train(self.training)


def _state(net: nn.Module) -> dict[str, tuple[str, bool, object]]:
    """Every parameter (frozen ones too), buffer and other state-dict entry: name -> (kind, frozen, value)."""
    state = {k: ("parameter", not p.requires_grad, p) for k, p in net.named_parameters()}
    for k, b in net.named_buffers():
        state.setdefault(k, ("buffer", False, b))
    try:
        entries = net.state_dict(keep_vars=True)
    except Exception:  # noqa: BLE001 - a state_dict that fails is the model's own problem
        entries = {}
    for k, v in entries.items():
        state.setdefault(k, ("entry", False, v))
    return state


def _snapshot(net: nn.Module) -> dict[str, tuple[str, bool, object]]:
    def keep(v):
        if torch.is_tensor(v):
            return v.detach().clone()
        try:
            return copy.deepcopy(v)
        except Exception:  # noqa: BLE001
            return v
    return {k: (kind, frozen, keep(v)) for k, (kind, frozen, v) in _state(net).items()}


def _versions(net: nn.Module) -> dict[str, int]:
    return {k: v._version for k, (_, _, v) in _state(net).items() if torch.is_tensor(v)}


def _changed(reference: dict, net: nn.Module, versions: dict[str, int] | None) -> list[tuple[str, str, bool]]:
    """(name, kind, frozen) of the state entries of ``net`` that differ from ``reference`` (with
    ``versions``: a tensor whose version counter did not move counts as unchanged)."""
    now = _state(net)
    out = []
    for key in list(reference) + [k for k in now if k not in reference]:
        kind, frozen, old = reference.get(key, now.get(key))
        if key not in now or key not in reference:
            out.append((key, kind, frozen))
            continue
        new = now[key][2]
        if torch.is_tensor(old) or torch.is_tensor(new):
            if versions is not None and torch.is_tensor(new) and versions.get(key) == new._version:
                continue
            same = torch.is_tensor(old) and torch.is_tensor(new) and _equal(new.detach(), old)
        else:
            try:
                same = bool(old == new)
            except Exception:  # noqa: BLE001 - not comparable: not reported
                same = True
        if not same:
            out.append((key, kind, frozen))
    return out


def _restore(net: nn.Module, reference: dict, keys=None) -> None:
    now = _state(net)
    with torch.no_grad():
        for key, (kind, _, value) in reference.items():
            if kind == "entry" or (keys is not None and key not in keys) or key not in now:
                continue
            t = now[key][2]
            if torch.is_tensor(t) and torch.is_tensor(value) and t.shape == value.shape:
                t.copy_(value)


# ----------------------------------------------------------------------------- one call


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


def _tensors(value, n: int) -> list[torch.Tensor]:
    """The batch-first tensors (first dimension n) in a module's inputs or outputs."""
    if torch.is_tensor(value):
        return [value] if value.dim() >= 1 and value.shape[0] == n else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, n)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v, n)]
    return []


def _rows(value, n: int) -> list[torch.Tensor]:
    """Detached copies of the first ``ROWS`` rows of the batch-first tensors in ``value``."""
    return [t[:ROWS].detach().clone() for t in _tensors(value, n)]


def _live(value, n: int) -> list[torch.Tensor]:
    """The batch-first float tensors in ``value`` that carry a gradient."""
    return [t for t in _tensors(value, n) if t.is_floating_point() and t.requires_grad]


class _Record:
    """One call: per module call (name, index of the call), the first rows of its batch-first inputs
    and outputs, in the order the calls finished; the buffers each module changed; the model's
    outputs; with weights, the parameters' gradients of the last weighted loss, the module (and
    whether in its own forward code) where one example's loss reached another example's gradient,
    and the parameters used outside their module."""

    def __init__(self):
        self.calls: dict[tuple[str, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.order: dict[str, int] = {}                 # module name -> position of its first finished call
        self.buffers: dict[str, list[str]] = {}         # module name -> buffers it changed
        self.out: list[torch.Tensor] = []
        self.r: list[torch.Tensor] = []                 # the loss surrogate's random directions
        self.grads: dict[str, torch.Tensor] = {}        # parameter name -> gradient of the last weighted loss
        self.grad_culprit: tuple[str, bool] | None = None
        self.outside: list[str] = []


def _call(net: nn.Module, xs: list[torch.Tensor], seed: int, weights: tuple = (), r=None,
          gen: torch.Generator | None = None, params: bool = False):
    """A training call of ``net`` on ``xs``: its forward pass in training mode with gradients
    enabled under ``seed``, hooks recording every module call; with ``weights`` (one or two [n]
    vectors), backward passes of the weighted per-example loss surrogate (module docstring), with
    ``params`` to the parameters too (and each parameter's uses traced). A :class:`_Record`, or a
    one-line problem when a pass fails."""
    n = xs[0].shape[0]
    rec = _Record()
    names = {m: name for name, m in net.named_modules()}
    counts: dict[str, int] = {}
    before: dict[nn.Module, list[torch.Tensor]] = {}
    grads_on = bool(weights)
    live: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    aliases: list[tuple[nn.Parameter, torch.Tensor]] = []
    alias = params and len(weights) == 2

    def pre(module, args):
        before[module] = [b.detach().clone() for b in module.buffers(recurse=False)]
        if alias:       # the parameter as the module's forward sees it: a view of its own
            for pname, p in module._parameters.items():
                if p is not None and p.requires_grad:
                    view = p.view_as(p)
                    module.__dict__[pname] = view
                    aliases.append((p, view))

    def post(module, args, kwargs, output):
        name = names[module]
        if alias:
            for pname in module._parameters:
                module.__dict__.pop(pname, None)
        k = counts.get(name, 0)
        counts[name] = k + 1
        rec.calls[(name, k)] = (_rows((args, kwargs), n), _rows(output, n))
        rec.order.setdefault(name, len(rec.order))
        changed = [bn for (bn, b), old in zip(module.named_buffers(recurse=False), before.pop(module, []))
                   if not _equal(b, old)]
        if changed:
            rec.buffers.setdefault(name, [])
            rec.buffers[name] += [b for b in changed if b not in rec.buffers[name]]
        if grads_on:
            ins, outs = _live((args, kwargs), n), _live(output, n)
            for t in ins + outs:
                tensors[id(t)] = t
            live[(name, k)] = ([id(t) for t in ins], [id(t) for t in outs])

    handles = []
    try:
        for m in net.modules():
            handles.append(m.register_forward_pre_hook(pre, prepend=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        net.train()
        devices = _devices(xs)
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            torch.random.default_generator.manual_seed(seed)      # the generators of the devices used only
            for d in devices:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(seed)
            out = net(*[x.clone() for x in xs])     # a copy: a model may change its input
    except Exception as exc:  # noqa: BLE001
        return (f"model: its training forward pass failed on the per-example check's batch of {n} inputs "
                f"of shape {list(xs[0].shape[1:])} ({type(exc).__name__}: {' '.join(str(exc).split())})")
    finally:
        for h in handles:
            h.remove()
        if alias:
            for m in net.modules():
                for pname in m._parameters:
                    m.__dict__.pop(pname, None)
    rec.out = _rows(out, n)
    if not grads_on:
        return rec
    try:
        _backward(rec, net, out, n, weights, r, gen, live, tensors, aliases if alias else None, params)
    except Exception as exc:  # noqa: BLE001
        return (f"model: its training forward pass ran but its backward pass failed on the per-example check's batch "
                f"of {n} inputs "
                f"of shape {list(xs[0].shape[1:])} ({type(exc).__name__}: {' '.join(str(exc).split())})")
    return rec


def _backward(rec: _Record, net: nn.Module, out, n: int, weights: tuple, r, gen, live: dict, tensors: dict,
              aliases: list | None, with_params: bool) -> None:
    """The backward passes of :func:`_call` (module docstring, 3. and 4.); ``aliases``: (parameter,
    the view its module's forward pass used) for each use inside a module, None: not traced."""
    outs = _live(out, n)
    if not outs:
        return
    if r is None:
        r = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs]
    rec.r = r
    # the per-example loss surrogate l_i = <r_i, y_i> + |y_i|^2 / 2 over the model's outputs y
    per_row = sum(((ri * o) + 0.5 * o * o).reshape(n, -1).sum(1) for ri, o in zip(r, outs))
    params = [(k, p) for k, p in net.named_parameters() if p.requires_grad] if with_params else []
    ps = [p for _, p in params]
    last = weights[-1].to(per_row)

    def grad(w, inputs, retain):
        return torch.autograd.grad((w.to(per_row) * per_row).sum(), inputs, retain_graph=retain, allow_unused=True)

    if len(weights) == 1:
        if ps:
            rec.grads = {k: g.detach() for (k, _), g in zip(params, grad(last, ps, False)) if g is not None}
        return
    ts = list(tensors.values())
    views = [v for _, v in aliases or ()]
    if not ts and not ps:
        return
    g1 = grad(weights[0], ts + ps + views, True)
    g2 = grad(last, ts + ps, True)
    rec.grads = {k: g.detach() for (k, _), g in zip(params, g2[len(ts):]) if g is not None}
    # 3. the gradients at every module's inputs and outputs: per example iff g2_i = w_i g1_i
    mixed = {id(t): _grad_mixed(a, b, last) for t, a, b in zip(ts, g1, g2)}
    grad1 = {id(t): a for t, a in zip(ts, g1)}
    grad2 = {id(t): b for t, b in zip(ts, g2)}
    if any(mixed.values()):
        position = {key: i for i, key in enumerate(live)}
        candidates = sorted((key for key, (ins, outs) in live.items()
                             if outs and any(mixed[i] for i in ins) and not any(mixed[o] for o in outs)),
                            key=lambda key: (-(key[0].count(".") + 1 if key[0] else 0), -position[key]))
        for key in candidates:          # the deepest module whose own backward pass mixes
            ins, outs = live[key]
            o = [tensors[i] for i in outs]
            local = []
            for g in (grad1, grad2):
                go = [g[i] if g[i] is not None else torch.zeros_like(tensors[i]) for i in outs]
                local.append(torch.autograd.grad(o, [tensors[i] for i in ins], grad_outputs=go, retain_graph=True,
                                                 allow_unused=True))
            if any(_grad_mixed(a, b, last) for a, b in zip(*local)):
                name = key[0]
                rec.grad_culprit = (name, any(k[0].startswith(f"{name}.") or (not name and k[0]) for k in live))
                break
        else:
            rec.grad_culprit = ("", any(k[0] for k in live))
    # 4. each parameter's gradient against the sum of its uses inside its module's forward passes
    full = g1[len(ts):len(ts) + len(ps)]
    hooked: dict[int, torch.Tensor] = {}
    for (p, _), g in zip(aliases or (), g1[len(ts) + len(ps):]):
        if g is not None:
            hooked[id(p)] = g if id(p) not in hooked else hooked[id(p)] + g
    if aliases is not None:
        for (k, p), g in zip(params, full):
            h = hooked.get(id(p))
            if g is None and h is None:
                continue
            g = torch.zeros_like(h) if g is None else g
            h = torch.zeros_like(g) if h is None else h
            if _moved(g, h):
                rec.outside.append(k)


# ----------------------------------------------------------------------------- comparisons


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


def _grad_mixed(g1: torch.Tensor | None, g2: torch.Tensor | None, w: torch.Tensor) -> bool:
    """Whether a tensor's gradients under all-one loss weights (``g1``) and under the weights ``w``
    (``g2``) are not per example: per example, row i of g2 is w_i times row i of g1 (beyond RTOL x
    the largest finite magnitude of either)."""
    if g1 is None and g2 is None:
        return False
    g1 = torch.zeros_like(g2) if g1 is None else g1.detach()
    g2 = torch.zeros_like(g1) if g2 is None else g2.detach()
    b = g1 * w.to(device=g1.device, dtype=g1.dtype).reshape(-1, *[1] * (g1.dim() - 1))
    scale = float(torch.maximum(g2.abs().amax(), b.abs().amax())) if g2.numel() else 0.0
    gap = float((g2 - b).abs().amax()) if g2.numel() else 0.0
    if not (math.isfinite(scale) and math.isfinite(gap)):     # non-finite entries: the finite ones compared
        ok = torch.isfinite(g2) & torch.isfinite(b)
        a, b = g2[ok].double(), b[ok].double()
        if not a.numel():
            return False
        scale, gap = max(float(a.abs().max()), float(b.abs().max())), float((a - b).abs().max())
    return gap > RTOL * scale


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
