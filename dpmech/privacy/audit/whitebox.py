"""White-box gradient canaries inside the DP-SGD engine, and their one-run audit.

The black-box audit (:mod:`dpmech.privacy.audit.one_run`) scores canary *images* from the final model; it sees a
tiny fraction of what the privacy analysis covers. The analysis of DP-SGD (Abadi et al. 2016,
Alg. 1) holds for an adversary who chooses every example's gradient and sees every noisy update;
Steinke, Nasr & Jagielski (NeurIPS 2023, Sec. 6, "white-box" Dirac canaries) and Nasr et al.
(USENIX Security 2023) audit against that adversary. This module is that adversary, in two kinds
(docs/audit.md, "Two kinds of canary"):

* **Engine canaries** (:class:`EngineCanaries`, ``kind = "engine"``; the default of the dpsgd and
  secure_sgd trials). Canary j is an *example* of the training set D (by a fair coin, the secret
  S_j, ``included``): the engine's own Poisson sampler draws it with every real example (one
  sampling plan: ``DPSGDTrainer.poisson_batch`` over N + |included| rows, q = batch_size /
  N_planned), it is a row of the engine's forward and backward pass, and its per-example gradient
  goes through the engine's clipping routine (bk, ghost or flat) like any example's. Its
  per-example loss is chosen so that the gradient is exact and known: for a coordinate (r, c) of
  the weight W of an ``nn.Linear`` layer, the layer's input on the canary's row is s e_c
  (s = ``raw_norm``; a forward pre-hook puts it there, so no earlier layer gets a gradient from the
  row) and the row's loss is C y_r, the layer's output r (so no later layer gets one either). The
  gradient is then C s e_r e_c^T on W (plus C e_r on the bias, if the layer has one), of norm
  C sqrt(s^2 + 1) (C s without a bias): 100 C at the default s = 100, clipped by the engine to C.
  After clipping the canary's coordinate carries kappa C with kappa = s / sqrt(s^2 + 1) (1 without
  a bias; 0.99995 at s = 100), up to the engines' 1e-6 in the clip factor. A clipping bug that lets
  the raw gradient through, or a sampler that draws examples at another rate, reaches the canaries
  exactly as it reaches the real examples, and the auditor is told nothing about it.
* **Inserted canaries** (:class:`WhiteBoxCanaries`, ``kind = "inserted"``): the cheap Dirac
  canaries. Canary j's *clipped* gradient C e_c (or C u for a random unit u, ``direction="random"``)
  is added to the clipped sum before the noise, for the canaries in the step's batch. On the
  DP-SGD engine the batch is the engine's draw too (:meth:`WhiteBoxCanaries.set_batch`: the same
  ``poisson_batch`` over N + |included| rows), so only the clipping is bypassed: they test the noise
  and the accounting, and give the audit's ceiling (no real gradient, no clipping arithmetic). On a
  trainer that does not draw them (DPGAN's critic) they draw themselves, at the trainer's q.

In both kinds the accountant sees nothing special: D = real data + included canaries, q =
batch_size / N_planned (the trial's configured size), and the ledger records (q, sigma) per step.

* **The auditor sees every update the engine applies** (on the DP-SGD engine: B times each
  parameter's gradient when the optimizer steps, i.e. sum_i clip(g_i) + N(0, sigma^2 C^2 I) for a
  correct engine, whatever the engine did to get there; DPGAN hands its noisy sums to
  :meth:`observe`), and keeps one statistic per canary and step: x_t = the update's projection on
  the canary's direction, in units of C. Under the model x_t ~ N(kappa b_t, sigma^2) (b_t = 1 when
  the canary was in the batch, probability q if it is in D), the Neyman-Pearson statistic of one
  step is the log-likelihood ratio of (1 - q) N(0, sigma^2) + q N(kappa, sigma^2) against
  N(0, sigma^2):

      llr_t = log(1 - q + q exp((kappa x_t - kappa^2 / 2) / sigma^2)),

  and the score of a canary is the sum over steps (``statistic="llr"``, the default).
  ``statistic="sum"`` scores sum_t x_t (Steinke et al.'s statistic).
* **The audit** guesses the top and bottom ``guess_fraction`` / 2 of the scores (as
  :func:`dpmech.privacy.audit.one_run.audit`) and runs
  :func:`dpmech.privacy.audit.estimators.run_estimators` (which output is a bound on what:
  docs/audit.md); its result names the kind of canary (``canary_kind``).

Coordinates (``placement``): real examples' clipped gradients also land on a canary's
coordinate and blur its score, and they are smallest, per coordinate, in the largest parameter
tensor. ``"largest"`` (default) draws the m coordinates from the largest trainable tensor (engine
canaries: the largest ``nn.Linear`` weight), ``"all"`` uniformly from every trainable coordinate
(engine canaries: of every ``nn.Linear`` weight).

Memory: Dirac canaries are indices (m integers, never an m x P matrix); random directions are an
m x P matrix, refused above :data:`RANDOM_MAX` floats. Engine canaries add about q |included| rows
to each step's forward and backward pass.

Usage::

    canaries = EngineCanaries(1000, seed=0)                   # or WhiteBoxCanaries(1000) (inserted)
    trainer = DPSGDTrainer(model, x, y, cfg, canaries=canaries)
    trainer.fit()
    canaries.audit(delta=cfg.delta, estimators=("steinke", "fdp", "gdp"), beta=0.05)
    # {"audit_epsilon_lb_steinke": ..., "audit_epsilon_lb_fdp": ..., "canary_kind": "engine", ...}
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpmech import _validate as v

DIRECTIONS = ("dirac", "random")
STATISTICS = ("llr", "sum")
PLACEMENTS = ("largest", "all")
KINDS = ("engine", "inserted")
RANDOM_MAX = 1 << 26          # m x P floats of random directions (256 MB)
RAW_NORM = 100.0              # an engine canary's raw gradient norm, in units of C (module docstring)
_CANARY_STREAM = 0xCA7A       # the canaries' own seed streams: the trainer's streams are untouched


class WhiteBoxCanaries:
    """m inserted Dirac (or random-direction) gradient canaries: added to the clipped sum, scored
    from every observed update (module docstring). A trainer calls :meth:`attach` once, then per
    step (optionally) :meth:`set_batch` with its own draw, :meth:`insert` before its noise and
    :meth:`observe` on what it releases."""

    kind = "inserted"

    def __init__(self, m: int, *, seed: int = 0, direction: str = "dirac", statistic: str = "llr",
                 placement: str = "largest"):
        self.m = v.positive_int("canaries", m, minimum=0)
        self.seed = v.positive_int("seed", seed, minimum=0)
        self.direction = v.choice("direction", direction, DIRECTIONS)
        self.statistic = v.choice("statistic", statistic, STATISTICS)
        self.placement = v.choice("placement", placement, PLACEMENTS)
        gen = np.random.default_rng(np.random.SeedSequence([self.seed, _CANARY_STREAM, 0]))
        self.included = gen.random(self.m) < 0.5          # the secret bits S_j
        self.member_ids = np.flatnonzero(self.included)   # D's canary row k is canary member_ids[k]
        self._coord_seed = int(gen.integers(2 ** 62))
        # drawn only where the trainer does not draw the canaries with its own sampler (DPGAN's critic)
        self.sample_gen = torch.Generator().manual_seed(int(gen.integers(2 ** 62)))
        self.scores = np.zeros(self.m)
        self.sampled = np.zeros(self.m, dtype=np.int64)   # steps in which each canary was in the batch
        self.steps = 0
        self.last_batch = np.zeros(self.m, dtype=bool)    # canaries in the last step's batch (tests)
        self.kappa = 1.0                                  # a sampled canary's mean projection, in units of C
        self._engine_batch = None
        self.attached = False

    @property
    def members(self) -> int:
        """|included|: the canaries that are examples of D (rows N .. N + members - 1 of the
        engine's sampler)."""
        return int(self.member_ids.shape[0])

    def identity(self) -> tuple:
        return (self.kind, self.m, self.seed, self.direction, self.statistic, self.placement)

    # ------------------------------------------------------------------ setup
    def attach(self, params: list[torch.Tensor], *, max_grad_norm: float, sampling_rate: float,
               noise_multiplier: float, model: torch.nn.Module | None = None) -> None:
        """Fix the canaries' directions in the flattened ``params`` (the trainer's trainable
        parameters, in its optimizer's order) and the step's C, q and sigma."""
        self._attach_common(max_grad_norm, sampling_rate, noise_multiplier)
        sizes = np.array([p.numel() for p in params], dtype=np.int64)
        total = int(sizes.sum())
        gen = np.random.default_rng(self._coord_seed)
        self._device = params[0].device if params else torch.device("cpu")
        self._sizes = sizes
        if self.direction == "dirac":
            if self.placement == "largest":
                k = int(np.argmax(sizes)) if len(sizes) else 0
                if self.m > (sizes[k] if len(sizes) else 0):
                    raise ValueError(f"canaries: {self.m} Dirac canaries need {self.m} distinct coordinates; the "
                                     f"largest parameter tensor has {int(sizes[k]) if len(sizes) else 0} (use placement 'all')")
                flat = int(sizes[:k].sum()) + gen.choice(int(sizes[k]), size=self.m, replace=False)
            else:
                if self.m > total:
                    raise ValueError(f"canaries: {self.m} Dirac canaries need {self.m} distinct coordinates; the "
                                     f"model has {total} trainable parameters")
                flat = gen.choice(total, size=self.m, replace=False)
            self._set_coordinates(np.asarray(flat, dtype=np.int64), sizes)
        else:
            if self.m * total > RANDOM_MAX:
                raise ValueError(f"canaries: {self.m} random directions x {total} parameters exceed {RANDOM_MAX} "
                                 "floats; use fewer canaries or direction 'dirac'")
            tgen = torch.Generator(device=self._device).manual_seed(self._coord_seed)
            u = torch.randn(self.m, total, generator=tgen, device=self._device)
            self.directions = u / torch.linalg.vector_norm(u, dim=1, keepdim=True).clamp_min(1e-12)
        self.attached = True

    def _attach_common(self, max_grad_norm, sampling_rate, noise_multiplier) -> None:
        if self.attached:
            raise ValueError("canaries: these canaries are attached to a trainer already; make new ones per trainer")
        self.C = v.positive("max_grad_norm", max_grad_norm)
        self.q = v.unit_interval("sampling_rate", sampling_rate, low_open=True)
        self.sigma = v.non_negative("noise_multiplier", noise_multiplier)
        if self.statistic == "llr" and self.sigma == 0:
            raise ValueError("statistic: 'llr' needs noise (noise_multiplier > 0); use 'sum' without noise")
        self._included_t = torch.from_numpy(self.included)

    def _set_coordinates(self, flat: np.ndarray, sizes: np.ndarray) -> None:
        """Canary j's coordinate in the flattened parameters, and its (param, local index) groups."""
        self.coordinates = flat                               # flat index of canary j's coordinate
        starts = np.concatenate([[0], np.cumsum(sizes)])
        which = np.searchsorted(starts, self.coordinates, side="right") - 1
        self._per_param = []                                  # (param index, canary indices, local indices)
        for k in np.unique(which):
            js = np.flatnonzero(which == k)
            self._per_param.append((int(k), torch.from_numpy(js),
                                    torch.from_numpy(self.coordinates[js] - starts[k]).to(self._device)))

    # ------------------------------------------------------------------ one step
    def set_batch(self, ids) -> None:
        """The engine's draw for this step: ``ids`` (canary numbers 0 .. m - 1) are the canaries its
        Poisson sampler put in the batch (one sampling plan for real examples and canaries)."""
        batch = np.zeros(self.m, dtype=bool)
        batch[np.asarray(ids, dtype=np.int64)] = True
        if (batch & ~self.included).any():
            raise ValueError("canaries: the engine drew a canary that is not in the training set")
        self._record(batch)
        self._engine_batch = batch

    def _record(self, batch: np.ndarray) -> None:
        self.last_batch = batch.copy()
        self.sampled += batch

    def draw(self) -> np.ndarray:
        """This step's canaries: the engine's draw (:meth:`set_batch`) when it made one, else a
        Poisson draw of the included canaries at the attached q (trainers that do not sample the
        canaries themselves: DPGAN's critic)."""
        if self._engine_batch is not None:
            batch, self._engine_batch = self._engine_batch, None
            return batch
        batch = ((torch.rand(self.m, generator=self.sample_gen) < self.q) & self._included_t).numpy()
        self._record(batch)
        return self.last_batch

    def insert(self, sums: list[torch.Tensor]) -> None:
        """Add C times the direction of each canary in this step's batch (:meth:`draw`) to the
        clipped sums ``sums`` (one tensor per parameter, in place)."""
        batch = torch.from_numpy(self.draw())
        if not bool(batch.any()):
            return
        if self.direction == "dirac":
            for k, js, local in self._per_param:
                sel = batch[js].to(local.device)
                if bool(sel.any()):
                    flat = sums[k].view(-1)
                    flat[local[sel]] += self.C
        else:
            vec = self.C * (batch.to(self.directions.device, self.directions.dtype) @ self.directions)
            start = 0
            for s in sums:
                n = s.numel()
                s.view(-1).add_(vec[start:start + n].to(s.dtype))
                start += n

    def observe(self, noisy: list[torch.Tensor]) -> None:
        """Score the step: each canary's projection x_t of the released update (in units of C),
        through the statistic (module docstring), added to its running score."""
        x = self.projections(noisy)
        if self.statistic == "llr":
            s2 = self.sigma ** 2
            k = self.kappa
            stat = np.logaddexp(math.log1p(-self.q) if self.q < 1 else -np.inf,
                                math.log(self.q) + (k * x - k * k / 2) / s2)
        else:
            stat = x
        self.scores += stat
        self.steps += 1

    def projections(self, noisy: list[torch.Tensor]) -> np.ndarray:
        """<noisy update, direction_j> / C for every canary j."""
        if self.m == 0:
            return np.zeros(0)
        if self.direction == "dirac":
            x = torch.empty(self.m, dtype=torch.float64)
            for k, js, local in self._per_param:
                x[js] = noisy[k].reshape(-1)[local].detach().to("cpu", torch.float64)
        else:
            flat = torch.cat([g.detach().reshape(-1) for g in noisy]).to(self.directions.dtype)
            x = (self.directions @ flat).to("cpu", torch.float64)
        return x.numpy() / self.C

    # ------------------------------------------------------------------ the audit
    def audit(self, *, delta: float, estimators=("steinke", "fdp", "gdp"), beta: float = 0.05,
              guess_fraction: float = 0.2, claim: float | None = None) -> dict:
        """The estimators on this run's scores (:func:`dpmech.privacy.audit.estimators.run_estimators`),
        with ``audit_steps`` and ``canary_kind`` (``"engine"`` or ``"inserted"``)."""
        from dpmech.privacy.audit.estimators import run_estimators

        if self.steps == 0:
            raise ValueError("canaries: no step observed yet; train first")
        out = run_estimators(self.scores, self.included, estimators=estimators, beta=beta, delta=delta,
                             guess_fraction=guess_fraction, claim=claim)
        out["audit_steps"] = float(self.steps)
        out["canary_kind"] = self.kind
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"identity": self.identity(), "m": self.m, "seed": self.seed, "direction": self.direction,
                "statistic": self.statistic, "placement": self.placement,
                "scores": torch.from_numpy(self.scores.copy()),
                "sampled": torch.from_numpy(self.sampled.copy()), "steps": self.steps,
                "sample_gen": self.sample_gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        mine = self.identity()
        theirs = tuple(state.get("identity") or ("inserted", state["m"], state["seed"], state["direction"],
                                                 state["statistic"], state["placement"]))
        if mine != theirs:
            raise ValueError(f"canaries: the checkpoint's canaries {theirs} are not these {mine}")
        self.scores = state["scores"].cpu().numpy().astype(np.float64).copy()
        self.sampled = state["sampled"].cpu().numpy().astype(np.int64).copy()
        self.steps = int(state["steps"])
        self.sample_gen.set_state(state["sample_gen"].cpu())


class EngineCanaries(WhiteBoxCanaries):
    """m gradient canaries that are examples of the engine's training set: drawn by its sampler,
    forwarded and back-propagated as rows of its batch, clipped by its clipping routine (module
    docstring). Dirac only: canary j's coordinate is (r_j, c_j) of an ``nn.Linear`` weight.

    The engine (:class:`dpmech.dpsgd.trainer.DPSGDTrainer`) calls :meth:`attach` with its model,
    then per step :meth:`set_batch` (its draw), :meth:`begin` (the rows of the batch that are
    canaries) before the forward pass, :meth:`losses` on its per-example losses, :meth:`end`
    after the backward pass, and :meth:`observe` on the update it applies."""

    kind = "engine"

    def __init__(self, m: int, *, seed: int = 0, statistic: str = "llr", placement: str = "largest",
                 raw_norm: float = RAW_NORM):
        super().__init__(m, seed=seed, direction="dirac", statistic=statistic, placement=placement)
        self.raw_norm = v.positive("raw_norm", raw_norm)
        self._handles = []
        self._active = None
        self._outputs = {}

    def identity(self) -> tuple:
        return super().identity() + (self.raw_norm,)

    def attach(self, params: list[torch.Tensor], *, max_grad_norm: float, sampling_rate: float,
               noise_multiplier: float, model: torch.nn.Module | None = None, capture=None) -> None:
        """As :meth:`WhiteBoxCanaries.attach`, on the ``nn.Linear`` weights of ``model``. ``capture``:
        for engines that read per-example gradients from backward hooks on the layers' outputs
        (Opacus's flat and ghost routes), a callable that is true while those hooks record; the
        canary's output gradient is then also handed to them (:meth:`_grad_pre_hook`)."""
        if model is None:
            raise ValueError("canaries: engine canaries are examples of a DP-SGD engine's model (DPSGDTrainer); "
                             "this trainer does not give its model, use inserted canaries (WhiteBoxCanaries)")
        position = {id(p): k for k, p in enumerate(params)}
        layers = [(name, mod) for name, mod in model.named_modules()
                  if isinstance(mod, torch.nn.Linear) and id(mod.weight) in position]
        if not layers:
            raise ValueError("canaries: engine canaries plant their gradient on an nn.Linear weight and the model has "
                             "no trainable nn.Linear layer; use inserted canaries (kind 'inserted')")
        self._attach_common(max_grad_norm, sampling_rate, noise_multiplier)
        self._device = params[0].device
        sizes = np.array([p.numel() for p in params], dtype=np.int64)
        wsizes = np.array([mod.weight.numel() for _, mod in layers], dtype=np.int64)
        gen = np.random.default_rng(self._coord_seed)
        if self.placement == "largest":
            chosen = [int(np.argmax(wsizes))]
        else:
            chosen = list(range(len(layers)))
        avail = int(wsizes[chosen].sum())
        if self.m > avail:
            where = f"the largest nn.Linear weight ({layers[chosen[0]][0]}) has" if self.placement == "largest" \
                else "the nn.Linear weights have"
            raise ValueError(f"canaries: {self.m} engine canaries need {self.m} distinct coordinates; {where} {avail}"
                             + (" (use placement 'all')" if self.placement == "largest" else ""))
        pick = gen.choice(avail, size=self.m, replace=False)
        bounds = np.concatenate([[0], np.cumsum(wsizes[chosen])])
        which = np.searchsorted(bounds, pick, side="right") - 1      # index into chosen
        local = pick - bounds[which]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        flat = np.empty(self.m, dtype=np.int64)
        self.kappa = np.empty(self.m)
        self._targets = {}                     # module -> (canary numbers, rows r, columns c)
        self.layer_names = []
        for w in np.unique(which):
            name, mod = layers[chosen[int(w)]]
            js = np.flatnonzero(which == w)
            out_f, in_f = mod.weight.shape
            r, c = local[js] // in_f, local[js] % in_f
            flat[js] = starts[position[id(mod.weight)]] + local[js]
            bias = mod.bias is not None and mod.bias.requires_grad
            s = self.raw_norm
            norm = s * math.sqrt(1.0 + (1.0 / (s * s) if bias else 0.0))   # ||g|| / C
            self.kappa[js] = s * min(1.0, 1.0 / norm)
            self._targets[mod] = (js, torch.from_numpy(r), torch.from_numpy(c))
            self.layer_names.append(name)
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook))
            self._handles.append(mod.register_forward_hook(self._hook))
            if capture is not None:
                self._handles.append(mod.register_full_backward_pre_hook(self._grad_pre_hook))
        self._capture = capture
        self._set_coordinates(flat, sizes)
        self._rows_of = np.full(self.m, -1, dtype=np.int64)          # canary number -> row in the batch
        self.attached = True

    def remove(self) -> None:
        """Remove the forward hooks from the model (the trainer's ``close``)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ the engine's step
    def insert(self, sums: list[torch.Tensor]) -> None:
        """Nothing to add: the canaries' gradients came through the engine's clipping."""
        self._engine_batch = None

    def begin(self, n_real: int, ids) -> None:
        """The engine's batch has ``n_real`` real rows followed by one row per canary of ``ids``
        (this order): the forward hooks plant the canaries' inputs on those rows."""
        ids = np.asarray(ids, dtype=np.int64)
        self._rows_of[:] = -1
        self._rows_of[ids] = n_real + np.arange(ids.shape[0])
        groups = {}
        for mod, (js, r, c) in self._targets.items():
            rows = self._rows_of[js]
            keep = rows >= 0
            if keep.any():
                groups[mod] = (torch.from_numpy(rows[keep]), r[torch.from_numpy(keep)], c[torch.from_numpy(keep)])
        self._active = (int(n_real) + int(ids.shape[0]), int(n_real), groups)
        self._outputs = {}

    def end(self) -> None:
        self._active = None
        self._outputs = {}

    def _pre_hook(self, module, args):
        if self._active is None or module not in self._active[2]:
            return None
        total, _, groups = self._active
        rows, _, cols = groups[module]
        x = args[0]
        if x.shape[0] != total:
            raise ValueError(f"canaries: the batch reached {type(module).__name__} with {x.shape[0]} rows, not the "
                             f"engine's {total}; engine canaries need one row per example (use kind 'inserted')")
        rows = rows.to(x.device)
        block = x.new_zeros((rows.shape[0],) + tuple(x.shape[1:]))
        block.view(rows.shape[0], -1, x.shape[-1])[torch.arange(rows.shape[0], device=x.device), 0,
                                                   cols.to(x.device)] = self.raw_norm
        x = x.clone()
        x[rows] = block                          # constant rows: nothing before the layer gets their gradient
        return (x,) + tuple(args[1:])

    def _hook(self, module, args, output):
        if self._active is None or module not in self._active[2]:
            return
        if module in self._outputs:
            raise ValueError(f"canaries: {type(module).__name__} ran twice in one forward pass; engine canaries need "
                             "their layer to run once (use kind 'inserted')")
        self._outputs[module] = output

    def _grad_pre_hook(self, module, grad_output):
        """Hooks on a layer's output (Opacus) see the gradient that reaches the output the rest of
        the network consumes, not the gradient of a loss read from the layer itself (the canary's,
        :meth:`losses`). While they record, the canary rows' share is handed to them here: d(mean
        loss)/d y = C e_r / (rows) on row j (Opacus's routes reduce by the mean). Their backward
        with the hooks off (ghost's second pass: sum_i c_i l_i) takes the loss's own gradient."""
        if self._active is None or module not in self._active[2] or not self._capture():
            return None
        total, _, groups = self._active
        rows, r, _ = groups[module]
        g = grad_output[0]
        if g is None:
            return None
        add = torch.zeros_like(g)
        add.view(total, -1, g.shape[-1])[rows.to(g.device), 0, r.to(g.device)] = self.C / total
        return (g + add,) + tuple(grad_output[1:])

    def losses(self, per_example: torch.Tensor) -> torch.Tensor:
        """The engine's per-example losses with the canaries' rows replaced by C y_r (the
        planted layer's output r on the row, position 0): the real rows keep their loss."""
        if self._active is None:
            return per_example
        total, n_real, groups = self._active
        if per_example.shape[0] != total:
            raise ValueError(f"canaries: {per_example.shape[0]} per-example losses for a batch of {total} rows")
        if total == n_real:
            return per_example
        canary = torch.zeros_like(per_example)
        for mod, (rows, r, _) in groups.items():
            if mod not in self._outputs:
                raise ValueError(f"canaries: the forward pass did not run {type(mod).__name__}, the layer holding "
                                 "the canaries")
            out = self._outputs[mod]
            rows_d = rows.to(out.device)
            vals = out[rows_d].reshape(rows_d.shape[0], -1, out.shape[-1])[
                torch.arange(rows_d.shape[0], device=out.device), 0, r.to(out.device)]
            canary = canary.index_put((rows_d,), (self.C * vals).to(canary.dtype))
        real = torch.arange(total, device=per_example.device) < n_real
        return torch.where(real, per_example, canary)
