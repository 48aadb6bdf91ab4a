"""Book-keeping per-example clipping (Bu, Wang, Zha & Karypis 2023, "Differentially Private
Optimization on Large Model at Small Cost", Alg. 1): the clipped sum of per-example gradients in
ONE backward pass, without autograd computing any parameter gradient.

For a batch of B examples with losses l_i, DP-SGD needs (Abadi et al. 2016, Alg. 1, "clip"):

    S = sum_i c_i g_i,   g_i = grad_theta l_i,   c_i = min(1, C / ||g_i||_2)

over the flat vector of all parameters. For a layer z = a W^T + b (linear; a convolution is one
after ``unfold``: a_i is [T, d] patches, z_i is [T, p] outputs, T the spatial positions), the
per-example weight gradient is g_i^W = dz_i^T a_i ([p, d]) and the bias gradient sum_t dz_i[t]
(dz_i = dl_i / dz_i, the layer's output gradient of example i). So:

1. **One backward pass** to the layers' outputs: ``torch.autograd.grad(sum_i l_i, [z_1..z_L])``
   (saved by forward hooks). Autograd computes the input gradients it needs on the way, but no
   parameter gradient (Alg. 1, "back-propagate to the output gradients only").
2. **Per-example squared norms**, per layer, by one of these exact *routes* (Alg. 1's "ghost norm
   or instantiation", Bu et al. 2022's "mixed" rule; the routes differ in cost only, all are
   tested against ``torch.func`` in float64):
   * ``ghost``: the ghost norm (Goodfellow 2015; Li et al. 2022)
     ||g_i^W||^2 = sum_{t,s} (a_it . a_is)(dz_it . dz_is), two Gram matrices per example,
     O(T^2 (p + d)); for T = 1 (a linear layer on vectors) ||a_i||^2 ||dz_i||^2, always used there;
   * ``inst``: instantiation, g_i^W = dz_i^T a_i for the whole batch at once (a B x p x d tensor
     and a full copy of the unfolded patches), O(T p d) per example, then its norm (issue 14);
   * ``bmm``: instantiation chunk by chunk of examples (``chunk_size``: the chunk's gradients,
     patches and output gradients fill ~2 MB, so they stay in cache; the chunk's patches copied
     from a strided view of the input), never the whole patch tensor;
   * ``grouped`` (convolutions): a chunk's per-example gradients as the weight gradient of ONE
     grouped convolution (the chunk's examples stacked as groups: Rochette, Manoel & Tramel 2019),
     so oneDNN's kernel gathers the patches (no patch copy);
   * ``compiled`` (convolutions, one row per example): ``bmm`` with each full chunk's patch
     gather, batched matmul and squared norm compiled by ``torch.compile`` (inductor generates
     the gather as one C++ loop, ~2x faster than torch's strided copy here); where torch.compile
     fails (no C++ compiler) the route warns once and runs ``bmm``.
3. **Clipped sum** with c_i = C / (||g_i|| + 1e-6) capped at 1 (Opacus's factor), by one of:
   * from the *kept* per-example gradients, S^W = sum_i c_i g_i^W (a [B] x [B, p d] product; the
     routes ``inst``, ``bmm``, ``grouped``, ``compiled``; needs B p d <= ``INST_MAX`` floats);
   * the weight gradient of the *re-weighted* output gradients, S^W = sum_i c_i dz_i^T a_i, one
     weight-gradient convolution / matmul, the non-private step's cost (``ghost``, and ``bmm_w``,
     ``grouped_w`` that drop the per-example gradients after their norms);
   * *fused* (``bmm_f``, ``grouped_f``, ``compiled_f``): the layers with fused routes go last and
     together, once every other layer's norms are known: chunk by chunk of examples, their
     per-example gradients give their norms, the chunk's factors c_i and each layer's share
     sum_i c_i g_i^W while still in cache: no second weight-gradient pass, no B x p x d tensor.
   A route may end in ``@k`` (e.g. ``bmm_f@2``): its chunks are split over k Python threads of one
   intra-op thread each (per-example work is independent across examples; torch's intra-op
   threads do not speed up 512 small matmuls).

``prefer`` picks each layer's route: ``"measured"`` (the default) times every plausible route of
the layer (estimated cost within ``PRUNE``x of the other rule's; compiled routes only on layers of
>= ``COMPILE_MIN`` multiply-adds; with n > 1 threads each chunked route also as ``@n``) once, on
its first batch, and keeps the fastest,
cached per layer geometry and thread count for the process: a one-off of well under a second for
the MNIST CNNs, plus a few seconds of torch.compile. ``BookKeeper.routes`` says which route each
layer took; ``routes=`` / :meth:`BookKeeper.pin` fix them (``DPSGDTrainer`` checkpoints them, so a
resumed run takes the same arithmetic: routes agree to float rounding, not bit for bit).
``"mixed"`` is issue 14's estimated-cost rule (whole-batch instantiation when p d <= T^2 (p + d)
and B p d <= ``INST_MAX``, else ghost norms); a route name forces that route on every layer that
has it (a layer without it takes the nearest: grouped / compiled -> bmm on linear layers, a kept
route over ``INST_MAX`` -> its ``_w`` form). GroupNorm's affine parameters: the per-example
gradients (sum over positions of dz * x_hat, and of dz) are [B, C], always instantiated.

**Shared parameters (weight tying).** A parameter used by several modules (two ``nn.Linear``
sharing one weight, an input and an output projection) has, for example i, the gradient
g_i^W = sum_u dz_{u,i}^T a_{u,i} over its uses u; its norm is ||sum_u g_{u,i}||, not
sqrt(sum_u ||g_{u,i}||^2): adding per-layer squared norms would drop the cross terms
2 <g_{u,i}, g_{v,i}> and clip to up to sqrt(k) C for k aligned uses. So the uses of a shared weight
are one *unit*: each use in the form of a linear layer with positions (a convolution's input as
its unfolded patches [T, d], its output gradient as [T, p]), concatenated along the position axis
(the same rule as ``rows_per_example``), so that every route above computes the norm of the sum
exactly (the ghost norm's cross terms over positions of different uses are the cross terms between
the uses) and the clipped sum sum_i c_i g_i^W. A shared bias or GroupNorm parameter: the sum over
its uses of the per-example gradients [B, n], instantiated. Every parameter of a module that shares
any parameter goes through such units (a unit of one use for the rest); routes of a shared weight
are named by its uses, e.g. ``"enc.weight+dec.weight"`` in ``BookKeeper.routes``.

The result is exact (no approximation; tested against a per-example clip-and-sum reference and
each layer's per-example norm against ``torch.func``; tied weights in tests/test_clipping_tied.py).
Supported parameterised modules: ``nn.Linear`` (inputs [B, d] or [B, ..., d]), ``nn.Conv2d`` (zero
padding, any stride, dilation, groups = 1), ``nn.GroupNorm``. Any other module with trainable
parameters (e.g. the PixelDP ``BoundedConv2d``, whose kernel is renormalised in the forward pass) is
refused with an error that names it; use ``clipping="ghost"`` there. A module used twice in one
forward pass is refused too (tie two modules' parameters instead). Of the other engines, Opacus's
``flat`` per-sample gradients sum a shared parameter's uses before clipping (exact); Opacus's ghost
clipping refuses tying (``NotImplementedError: Parameter tying is not supported with Ghost
Clipping``, at the first step).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED = (nn.Linear, nn.Conv2d, nn.GroupNorm)
ROUTES = ("ghost", "inst", "bmm", "bmm_w", "bmm_f", "grouped", "grouped_w", "grouped_f", "compiled", "compiled_w",
          "compiled_f")
PREFER = ("measured", "mixed") + ROUTES
KEPT = ("inst", "bmm", "grouped", "compiled")   # routes whose clipped sum comes from the kept per-example gradients
FUSED = ("bmm_f", "grouped_f", "compiled_f")    # the clipped sum taken chunk by chunk (one layer per step)
INST_MAX = 1 << 26      # largest kept per-example weight gradient of one layer (B p d floats, 256 MB)
CHUNK_FLOATS = 1 << 19  # a chunk's working set (its gradients, patches and output gradients), ~2 MB in float32
PRUNE = 8               # a route estimated to cost PRUNE x another's is not timed
COMPILE_MIN = 1 << 26   # "measured" times the compiled routes only on layers of >= this many B T p d multiply-adds
MEASURE_REPEATS = 4     # timed rounds over the routes (after one untimed) when prefer="measured"; the minimum counts

# seconds per route measured per layer geometry (kind, shapes, dtype, device, threads): one timing per process
_MEASURED: dict[tuple, dict[str, float]] = {}


def _supported(module: nn.Module) -> bool:
    if type(module) not in SUPPORTED:        # subclasses may change the forward (BoundedConv2d)
        return False
    if isinstance(module, nn.Conv2d):
        return module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)
    return True


def check_model(model: nn.Module) -> list[nn.Module]:
    """The parameterised leaf modules of ``model`` (trainable parameters), or a ValueError naming the
    first one that book-keeping clipping cannot handle. A parameter shared by several of them is
    allowed (clipped exactly: :class:`_Shared`)."""
    layers = []
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not _supported(m):
            raise ValueError(f"clipping: 'bk' cannot clip layer {name or 'model'!r} ({_type_path(m)}): it supports "
                             f"nn.Linear, nn.Conv2d (groups 1, zero padding) and nn.GroupNorm; {engines_that_can(m)}")
        layers.append(m)
    return layers


def _type_path(m: nn.Module) -> str:
    t = type(m)
    return f"{t.__module__}.{t.__qualname__}"


def engines_that_can(m: nn.Module) -> str:
    """Which other clipping engines handle the layer ``m`` (a phrase for error messages): Opacus's
    'ghost' and 'flat' through its per-sample gradient of that layer type, or through functorch
    (``torch.func``) for a layer type it has none for."""
    from opacus.grad_sample import GradSampleModule

    if type(m) in GradSampleModule.GRAD_SAMPLERS:
        return f"use clipping 'ghost' or 'flat' (Opacus has per-sample gradients of {type(m).__name__})"
    return (f"use clipping 'ghost' or 'flat' (Opacus computes per-sample gradients of {type(m).__name__} with "
            f"torch.func, which needs a forward pass free of in-place changes and batch statistics)")


def _patches(a: torch.Tensor, m: nn.Conv2d) -> torch.Tensor:
    """The convolution's input patches as a strided view [B, C, H_out, W_out, kh, kw] (what
    ``F.unfold`` gives, without its per-example im2col loop; a copy happens only where a route
    reshapes it, chunk by chunk)."""
    ph, pw = m.padding
    if ph or pw:
        a = F.pad(a, (pw, pw, ph, ph))
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    p = a.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)
    return p[..., ::dh, ::dw] if (dh > 1 or dw > 1) else p


def chunk_size(p: int, d: int, t: int) -> int:
    """Examples per chunk: the chunk's per-example gradients (p d), patches (t d) and output
    gradients (t p) fill about ``CHUNK_FLOATS`` numbers, so a chunk's batched matmul and its norm
    run in cache."""
    return max(1, CHUNK_FLOATS // (p * d + t * (p + d)))


class _Layer:
    """One saved linear / convolution call, for b examples of k rows each: the per-example squared
    weight-gradient norms by a route, and the clipped weight sum."""

    def __init__(self, m: nn.Module, a: torch.Tensor, dz: torch.Tensor, k: int):
        self.m, self.a, self.dz, self.k = m, a, dz, k
        self.rows = a.shape[0]
        self.b = self.rows // k
        self.conv = isinstance(m, nn.Conv2d)
        self.shape = m.weight.shape
        self.p = dz.shape[1] if self.conv else dz.shape[-1]
        self.d = m.weight[0].numel()
        self.t = (dz.shape[2] * dz.shape[3] if self.conv else dz[0].numel() // self.p) * k   # positions per example
        self.n = chunk_size(self.p, self.d, self.t)      # examples per chunk (a fused group sets one for all)
        self._pv = None

    # ---------------------------------------------------------------- per-example gradients
    def cols(self) -> tuple[torch.Tensor, torch.Tensor]:
        """u [b, d, kT] (inputs / unfolded patches) and g [b, p, kT] (output gradients) of the whole
        batch: a full copy (the "inst" route, issue 14's layout)."""
        m, a, dz, k, rows = self.m, self.a, self.dz, self.k, self.rows
        if self.conv:
            u = _patches(a, m).permute(0, 1, 4, 5, 2, 3).reshape(rows, self.d, -1)
            g = dz.reshape(rows, self.p, -1)
        else:
            u = a.reshape(rows, -1, a.shape[-1]).transpose(1, 2)
            g = dz.reshape(rows, -1, dz.shape[-1]).transpose(1, 2)
        if k > 1:   # [kB, x, T] -> [B, x, kT] (rows jB + i -> example i)
            u, g = (v.reshape(k, self.b, *v.shape[1:]).permute(1, 2, 0, 3).reshape(self.b, v.shape[1], -1)
                    for v in (u, g))
        return u, g

    def chunk_cols(self, i: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples i..e-1 as u [n, kT, d] (patches / inputs; one copy of the chunk from a strided
        view, possibly a transposed view of it) and g [n, p, kT] (output gradients)."""
        n, b, k = e - i, self.b, self.k
        if self.conv:
            if self._pv is None:
                self._pv = _patches(self.a, self.m)
            # copied as [n, d, T] (the strided copy runs along the output positions; [n, T, d] copies
            # along the kernel's short rows, ~2x slower here) and used transposed
            us = [self._pv[j * b + i:j * b + e].permute(0, 1, 4, 5, 2, 3).reshape(n, self.d, -1).transpose(1, 2)
                  for j in range(k)]
            gs = [self.dz[j * b + i:j * b + e].reshape(n, self.p, -1) for j in range(k)]
        else:
            us = [self.a[j * b + i:j * b + e].reshape(n, -1, self.d) for j in range(k)]
            gs = [self.dz[j * b + i:j * b + e].reshape(n, -1, self.p).transpose(1, 2) for j in range(k)]
        return (us[0], gs[0]) if k == 1 else (torch.cat(us, 1), torch.cat(gs, 2))

    def grouped(self, i: int, e: int) -> torch.Tensor:
        """Per-example weight gradients [n, p, d] of examples i..e-1 as the weight gradient of one
        convolution with the n examples as groups (input [1, n C, H, W], output gradient
        [1, n p, H', W']; Rochette, Manoel & Tramel 2019)."""
        m, n, b = self.m, e - i, self.b
        w = torch.empty((n * self.p,) + tuple(self.shape[1:]), dtype=self.a.dtype, device=self.a.device)
        out = None
        for j in range(self.k):
            a = self.a[j * b + i:j * b + e].reshape(1, -1, *self.a.shape[2:])
            dz = self.dz[j * b + i:j * b + e].reshape(1, -1, *self.dz.shape[2:])
            gw = torch.ops.aten.convolution_backward(dz, a, w, None, m.stride, m.padding, m.dilation, False,
                                                     [0, 0], n, [False, True, False])[1]
            out = gw if out is None else out + gw
        return out.reshape(n, self.p, self.d)

    def chunk_grads(self, route: str, i: int, e: int, out: torch.Tensor | None = None):
        """Per-example weight gradients [n, p d] of examples i..e-1 (into ``out`` if given) and
        their squared norms [n]."""
        n = e - i
        if route.startswith("compiled") and n == self.chunk and not _COMPILE_ERROR:   # a full chunk
            try:
                if route == "compiled_w":        # the norms only: the gradients stay inside the kernel
                    return None, _compiled("norms")(self._pv[i:e], self.dz[i:e])
                g, sq = _compiled("grads")(self._pv[i:e], self.dz[i:e])
            except Exception as err:          # no C++ compiler, an unsupported platform: eager instead
                _compile_failed(err)
            else:
                return (g.reshape(n, -1) if out is None else out.copy_(g.reshape(n, -1))), sq
        if route.startswith("grouped"):
            g = self.grouped(i, e).reshape(n, -1)
            g = g if out is None else out.copy_(g)
        else:
            u, dz = self.chunk_cols(i, e)
            g = torch.bmm(dz, u) if out is None else torch.bmm(dz, u, out=out.view(n, self.p, self.d))
            g = g.reshape(n, -1)
        return g, torch.linalg.vector_norm(g, dim=1).square()

    # ---------------------------------------------------------------- norms
    @property
    def chunk(self) -> int:
        return self.n

    def ranges(self) -> list[tuple[int, int]]:
        n = self.n
        return [(i, min(self.b, i + n)) for i in range(0, self.b, n)]

    def norms(self, route: str, workers: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Squared per-example weight-gradient norms [b] by ``route`` (a fused route as its "_w"
        form), and the per-example gradients [b, p d] where the route keeps them for the sum
        (written chunk by chunk into one buffer: one [b, p d] allocation, where a list of chunks
        costs the allocator fresh pages every step); the chunks split over ``workers`` threads
        (:func:`_split`)."""
        b, p, d = self.b, self.p, self.d
        if route == "inst":
            u, g = self.cols()
            kept = torch.bmm(g, u.transpose(1, 2)).reshape(b, -1)        # [B, p d]
            return torch.linalg.vector_norm(kept, dim=1).square(), kept
        sq = torch.empty(b, dtype=self.a.dtype, device=self.a.device)
        keep = route in KEPT
        kept = torch.empty(b, p * d, dtype=self.a.dtype, device=self.a.device) if keep else None
        if self.conv and not route.startswith("grouped") and self._pv is None:
            self._pv = _patches(self.a, self.m)

        def chunk(i: int, e: int) -> None:
            if route == "ghost":
                u, g = self.chunk_cols(i, e)                               # [n, kT, d], [n, p, kT]
                sq[i:e] = (torch.bmm(u, u.transpose(1, 2)) * torch.bmm(g.transpose(1, 2), g)).sum((1, 2))
                return
            sq[i:e] = self.chunk_grads(route, i, e, kept[i:e] if keep else None)[1]
        _split(self.ranges(), workers, lambda part: [chunk(i, e) for i, e in part])
        return sq, kept

    def kept_sum(self, kept: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """sum_i c_i g_i^W from the kept per-example gradients [b, p d]."""
        return (c @ kept).reshape(self.shape)

    def fused(self, route: str, sq_rest: torch.Tensor, max_grad_norm: float,
              workers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer of a step (Alg. 1's clipped sum without a second weight-gradient pass):
        per chunk, the per-example gradients G_i, their squared norms s_i, the factors
        c_i = min(1, C / (sqrt(sq_rest_i + s_i) + 1e-6)) (``sq_rest``: every other parameter's
        squared norm) and the running sum_i c_i G_i, while G_i is in cache. Returns (s [b], sum)."""
        sq = torch.empty(self.b, dtype=self.a.dtype, device=self.a.device)
        if self.conv and not route.startswith("grouped") and self._pv is None:
            self._pv = _patches(self.a, self.m)

        bound = torch.tensor(max_grad_norm, dtype=self.a.dtype, device=self.a.device)

        def part(ranges: list[tuple[int, int]]) -> torch.Tensor:
            w = torch.zeros(self.p * self.d, dtype=self.a.dtype, device=self.a.device)
            for i, e in ranges:
                if route == "compiled_f" and e - i == self.chunk and not _COMPILE_ERROR:
                    try:         # the norms, factors and the chunk's share of the sum in one compiled call
                        s, share = _compiled("fused")(self._pv[i:e], self.dz[i:e], sq_rest[i:e], bound)
                    except Exception as err:
                        _compile_failed(err)
                    else:
                        sq[i:e] = s
                        w += share
                        continue
                gi, s = self.chunk_grads(route, i, e)
                sq[i:e] = s
                c = (max_grad_norm / ((sq_rest[i:e] + s).clamp_min(0).sqrt() + 1e-6)).clamp(max=1.0)
                w.addmv_(gi.t(), c)
            return w
        parts = _split(self.ranges(), workers, part)
        w = parts[0]
        for other in parts[1:]:
            w += other
        return sq, w.reshape(self.shape)

    # ---------------------------------------------------------------- clipped sum
    def weighted_sum(self, c: torch.Tensor) -> torch.Tensor:
        """sum_i c_i g_i^W as the weight gradient of the re-weighted output gradients c_i dz_i."""
        m, k = self.m, self.k
        if self.conv:
            scaled = self.dz * c.repeat(k).reshape(-1, 1, 1, 1)
            return torch.nn.grad.conv2d_weight(self.a, self.shape, scaled, stride=m.stride, padding=m.padding,
                                               dilation=m.dilation)
        a = self.a.reshape(self.rows, -1, self.d)
        g = self.dz.reshape(self.rows, -1, self.p) * c.repeat(k)[:, None, None]
        return g.reshape(-1, self.p).t().mm(a.reshape(-1, self.d)).reshape(self.shape)

    # ---------------------------------------------------------------- choosing a route
    def candidates(self) -> tuple[str, ...]:
        """The exact routes this layer has: grouped convolutions for convolutions only; compiled
        ones for convolutions with one row per example where torch.compile works; routes that keep
        the per-example gradients only when B p d <= INST_MAX."""
        names = ROUTES if self.conv else tuple(r for r in ROUTES if not r.startswith(("grouped", "compiled")))
        if self.k > 1 or _COMPILE_ERROR:
            names = tuple(r for r in names if not r.startswith("compiled"))
        if self.b * self.p * self.d > INST_MAX:
            names = tuple(r for r in names if r not in KEPT)
        return names

    def key(self) -> tuple:
        """The layer's geometry (what its routes' costs depend on, the batch size aside)."""
        m = self.m
        geo = (tuple(self.a.shape[1:]), tuple(self.dz.shape[1:]), m.stride, m.padding, m.dilation) if self.conv \
            else (self.d, self.p, self.t)
        return (type(m).__name__, geo, self.k, self.a.dtype, self.a.device.type, torch.get_num_threads())

    def resolve(self, prefer: str) -> str:
        """The route that ``prefer`` gives this layer: issue 14's estimated cost for "mixed"; a forced
        route the layer lacks falls back to chunked instantiation (grouped -> bmm on linear layers,
        a kept route over INST_MAX -> the one that drops the gradients)."""
        names = self.candidates()
        if prefer == "mixed":
            p, d, t = self.p, self.d, self.t
            return "inst" if p * d <= t * t * (p + d) and "inst" in names else "ghost"
        route, workers = parse_route(prefer)
        if not self.conv:
            route = route.replace("grouped", "bmm")
        if route.startswith("compiled"):
            workers = 1                  # a compiled kernel runs its own threads
            if route not in names:       # a linear layer, k > 1 rows per example, torch.compile unavailable
                route = route.replace("compiled", "bmm")
        if route not in names:
            route = route + "_w" if route + "_w" in names else "ghost"
        return route if workers == 1 or route == "inst" else f"{route}@{workers}"

    def plausible(self) -> tuple[str, ...]:
        """The candidates worth timing: a route whose estimated multiply-adds per example (ghost
        T^2 (p + d), instantiation T p d) exceed ``PRUNE`` times the other's is not timed."""
        p, d, t = self.p, self.d, self.t
        ghost, inst = t * t * (p + d), t * p * d
        names = self.candidates()
        if self.b * t * p * d < COMPILE_MIN:
            names = tuple(r for r in names if not r.startswith("compiled"))
        if ghost > PRUNE * inst:
            names = tuple(r for r in names if r != "ghost")
        elif inst > PRUNE * ghost:
            names = tuple(r for r in names if r == "ghost")
        return names

    def measure(self) -> dict[str, float]:
        """Seconds of every plausible route (norms and clipped sum, c = 1) on this batch, each in one
        thread team (intra-op threads) and, with more than one thread, with its chunks split over
        that many threads ("route@k"): one untimed round over all of them (compilation, first
        touch), then ``MEASURE_REPEATS`` rounds, the routes interleaved in each (a burst of load
        from other processes hits one round of every route, not every run of one); the minimum."""
        ones = torch.ones(self.b, dtype=self.a.dtype, device=self.a.device)
        threads = torch.get_num_threads()
        variants = []
        for r in self.plausible():
            split = threads > 1 and r != "inst" and not r.startswith("compiled") and len(self.ranges()) > 1
            variants += [(r, w) for w in ([1, threads] if split else [1])]
        times = {}
        for rep in range(MEASURE_REPEATS + 1):
            for r, workers in variants:
                if r.startswith("compiled") and _COMPILE_ERROR:
                    continue                       # torch.compile failed on the untimed run: not a candidate
                t0 = time.perf_counter()
                if r in FUSED:
                    sq, w = self.fused(r, torch.zeros_like(ones), 1.0, workers)
                else:
                    sq, kept = self.norms(r, workers)
                    w = self.kept_sum(kept, ones) if kept is not None else self.weighted_sum(ones)
                float(sq[0] + w.flatten()[0])     # wait for the result (an accelerator is asynchronous)
                seconds = time.perf_counter() - t0
                self._pv = None
                if rep:
                    name = r if workers == 1 else f"{r}@{workers}"
                    times[name] = min(times.get(name, float("inf")), seconds)
        return times


def _grads_and_norms(pv: torch.Tensor, dz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's per-example gradients [n, p, C kh kw] from its patch view [n, C, H', W', kh, kw]
    and output gradients [n, p, H', W'], and their squared norms [n]: the function of the
    "compiled" routes (torch.compile generates the patch gather as one loop kernel, then one
    batched matmul, the norm fused after it)."""
    n, p = dz.shape[0], dz.shape[1]
    g = torch.einsum("npij,ncijkl->npckl", dz, pv).reshape(n, p, -1)
    return g, g.square().sum(2).sum(1)


def _norms_only(pv: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """The squared norms of :func:`_grads_and_norms` alone ("compiled_w")."""
    return _grads_and_norms(pv, dz)[1]


def _fused_share(pv: torch.Tensor, dz: torch.Tensor, rest: torch.Tensor,
                 bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """"compiled_f": a chunk's squared norms s_i, its factors c_i = min(1, C / (sqrt(rest_i + s_i)
    + 1e-6)) and its share sum_i c_i g_i of the clipped sum, in one compiled call."""
    g, s = _grads_and_norms(pv, dz)
    c = (bound / ((rest + s).clamp_min(0).sqrt() + 1e-6)).clamp(max=1.0)
    return s, c @ g.reshape(g.shape[0], -1)


_KERNELS = {"grads": _grads_and_norms, "norms": _norms_only, "fused": _fused_share}
_COMPILED: dict = {}
_COMPILE_ERROR: str | None = None


def _compiled(kind: str = "grads"):
    if kind not in _COMPILED:
        _COMPILED[kind] = torch.compile(_KERNELS[kind], dynamic=False)
    return _COMPILED[kind]


def _compile_failed(err: Exception) -> None:
    global _COMPILE_ERROR
    _COMPILE_ERROR = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    warnings.warn(f"clipping: torch.compile failed ({_COMPILE_ERROR}); the compiled routes run eagerly (bmm)")


def _fused_group(lays: list[_Layer], routes: list[str], rest: torch.Tensor, max_grad_norm: float,
                 workers: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The layers with fused routes, last and together (Alg. 1's clip and sum without a second
    weight-gradient pass and without keeping per-example gradients): chunk by chunk of examples,
    every layer's per-example gradients and squared norms, the chunk's factors
    c_i = min(1, C / (sqrt(rest_i + sum of the layers' s_i) + 1e-6)) (``rest``: every other
    parameter's squared norm) and each layer's share sum_i c_i g_i, while the gradients are in
    cache. Returns (the total squared norms [b], rest included: the ones the factors used; the
    layers' clipped sums). One layer: its own :meth:`_Layer.fused` (a single compiled call per
    chunk for ``compiled_f``)."""
    if len(lays) == 1:
        s, w = lays[0].fused(routes[0], rest, max_grad_norm, workers)
        return rest + s, [w]
    b = lays[0].b
    n = min(lay.n for lay in lays)
    for lay, route in zip(lays, routes):
        lay.n = n                                          # one grid of chunks for all of them
        if lay.conv and not route.startswith("grouped") and lay._pv is None:
            lay._pv = _patches(lay.a, lay.m)
    sq = torch.empty(b, dtype=rest.dtype, device=rest.device)

    def part(ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        ws = [torch.zeros(lay.p * lay.d, dtype=rest.dtype, device=rest.device) for lay in lays]
        for i, e in ranges:
            grads, total = [], rest[i:e].clone()
            for lay, route in zip(lays, routes):
                g, s = lay.chunk_grads(route, i, e)
                grads.append(g)
                total += s
            sq[i:e] = total
            c = (max_grad_norm / (total.clamp_min(0).sqrt() + 1e-6)).clamp(max=1.0)
            for w, g in zip(ws, grads):
                w.addmv_(g.t(), c)
        return ws
    parts = _split([(i, min(b, i + n)) for i in range(0, b, n)], workers, part)
    sums = parts[0]
    for other in parts[1:]:
        for w, o in zip(sums, other):
            w += o
    return sq, [w.reshape(lay.shape) for w, lay in zip(sums, lays)]


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _split(ranges: list, workers: int, fn) -> list:
    """``fn`` of ``workers`` contiguous shares of the chunk ranges, run in that many threads with
    one intra-op thread each (torch's thread count is process-wide: set to 1 meanwhile, then
    restored), or ``[fn(ranges)]`` in the calling thread's intra-op team when workers is 1."""
    workers = min(workers, len(ranges))
    if workers <= 1:
        return [fn(ranges)]
    step = -(-len(ranges) // workers)
    shares = [ranges[j:j + step] for j in range(0, len(ranges), step)]
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="dpmech-clipping")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return list(_POOLS[workers].map(fn, shares))
    finally:
        torch.set_num_threads(threads)


def parse_route(route: str) -> tuple[str, int]:
    """"bmm_f@2" -> ("bmm_f", 2): a route and the threads its chunks are split over (1: none)."""
    base, _, workers = route.partition("@")
    return base, int(workers) if workers else 1


def _unfused(route: str) -> str:
    base, workers = parse_route(route)
    return route if base not in FUSED else base[:-2] + ("" if workers == 1 else f"@{workers}")


def _is_fused(route: str) -> bool:
    return parse_route(route)[0] in FUSED


def _check_route(field: str, value, allowed: tuple) -> None:
    """``value`` is one of ``allowed``, or a route of :data:`ROUTES` with "@k" (k >= 1 threads)."""
    base, _, workers = value.partition("@") if isinstance(value, str) else (value, "", "")
    if value in allowed or (base in ROUTES and workers.isdigit() and int(workers) >= 1):
        return
    raise ValueError(f"{field} must be one of {allowed} (a route may end in '@k', k >= 1 threads), got {value!r}")


class _Shared:
    """A clipping unit of the parameters of modules that share one (weight tying; module docstring).

    ``kind`` "weight": a Linear / Conv2d weight used by ``uses`` (its modules); its saved calls are
    joined into one linear layer with positions (:meth:`linear_form`), which :class:`_Layer` treats
    as any multi-position linear layer, so every route gives the exact norm of the summed gradient.
    ``kind`` "vector": a bias or GroupNorm parameter; its per-example gradient [B, n] is the sum
    over its uses. Looks like a layer to the clipped-sum code: ``weight`` is the parameter, ``bias``
    None."""

    def __init__(self, param: nn.Parameter, uses: list[tuple[nn.Module, str]], name: str):
        self.weight, self.bias, self.uses, self.name = param, None, uses, name
        self.kind = "weight" if uses[0][1] == "weight" and isinstance(uses[0][0], (nn.Linear, nn.Conv2d)) else "vector"

    def linear_form(self, saved: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs [rows, T, d] and output gradients [rows, T, p] of every use, concatenated along
        the positions T (a convolution's input as its unfolded patches)."""
        us, gs = [], []
        for m, _ in self.uses:
            a, dz = saved[m]
            rows = a.shape[0]
            if isinstance(m, nn.Conv2d):
                p = dz.shape[1]
                us.append(_patches(a, m).permute(0, 1, 4, 5, 2, 3).reshape(rows, m.weight[0].numel(), -1)
                          .transpose(1, 2))
                gs.append(dz.reshape(rows, p, -1).transpose(1, 2))
            else:
                us.append(a.reshape(rows, -1, a.shape[-1]))
                gs.append(dz.reshape(rows, -1, dz.shape[-1]))
        return torch.cat(us, 1), torch.cat(gs, 1)

    def per_example(self, saved: dict, k: int) -> torch.Tensor:
        """The per-example gradient [B, n] of a "vector" parameter: the sum over its uses (a bias:
        the output gradient summed over positions; a GroupNorm weight: dz * x_hat summed)."""
        total = None
        for m, attr in self.uses:
            a, dz = saved[m]
            if isinstance(m, nn.GroupNorm):
                dims = tuple(range(2, dz.dim()))
                g = (dz * F.group_norm(a, m.num_groups, eps=m.eps)).sum(dims) if attr == "weight" else dz.sum(dims)
            else:
                pos = tuple(range(2, dz.dim())) if isinstance(m, nn.Conv2d) else tuple(range(1, dz.dim() - 1))
                g = dz.sum(pos) if pos else dz
            g = g.reshape(k, -1, g.shape[-1]).sum(0)
            total = g if total is None else total + g
        return total


def _shared_units(layers: list[nn.Module], names: dict) -> tuple[list[_Shared], set]:
    """The units of the modules that share a trainable parameter (every parameter of such a module,
    shared or not, one unit per parameter), and the set of those modules."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for m in layers:
        for attr, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                uses.setdefault(id(p), []).append((m, attr))
                params[id(p)] = p
    tied = {m for u in uses.values() if len(u) > 1 for m, _ in u}
    units = []
    for key, u in uses.items():
        if any(m in tied for m, _ in u):
            name = "+".join(f"{names[m]}.{attr}" if names[m] else attr for m, attr in u)
            units.append(_Shared(params[key], u, name))
    return units, tied


class BookKeeper:
    """Forward hooks saving each supported layer's input and output; :meth:`clipped_sum` then
    computes sum_i min(1, C/||g_i||) g_i into ``p.grad`` of every trainable parameter.

    ``prefer``: "measured" (default), "mixed" or a route of :data:`ROUTES` (module docstring);
    ``routes``: {layer name in ``model.named_modules()``: route} pinning some layers' routes.
    After a step, ``routes`` holds the route each convolution / multi-position linear layer took
    (the fused ones: the layers whose sums were taken chunk by chunk, together), and ``timings`` the
    seconds per route measured for this BookKeeper's layers."""

    def __init__(self, model: nn.Module, prefer: str = "measured", rows_per_example: int = 1,
                 routes: dict[str, str] | None = None):
        _check_route("prefer", prefer, PREFER)
        if rows_per_example < 1:
            raise ValueError(f"rows_per_example must be >= 1, got {rows_per_example}")
        self.model = model
        self.prefer = prefer
        # k > 1: rows i, B + i, ..., (k-1)B + i of a kB-row forward pass are ONE example (its gradient
        # is their sum, clipped once): per layer the k rows are concatenated along the position axis
        # (a linear layer on vectors becomes T = k positions, a convolution kT), so g_i^W =
        # sum_j dz_{jB+i}^T a_{jB+i} and the ghost-norm / instantiation rules apply exactly
        self.rows_per_example = rows_per_example
        self.layers = check_model(model)
        members = set(self.layers)
        self._names = {m: name for name, m in model.named_modules() if m in members}
        # modules sharing a parameter (weight tying) are clipped by units of their parameters
        self._units, self._tied = _shared_units(self.layers, self._names)
        self._names.update({u: u.name for u in self._units})
        self._pinned: dict[str, str] = {}
        self.pin(routes or {})
        self.routes: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self._saved: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.enabled = False
        self._handles = [m.register_forward_hook(self._hook) for m in self.layers]

    def pin(self, routes: dict[str, str]) -> None:
        """Fix the routes of some layers ({layer name: route}, e.g. a checkpoint's ``routes``: the
        measured choice of another process, so that a resumed run takes the same arithmetic)."""
        routes = dict(routes)
        tied = {self._names[m] for m in self._tied}
        for name, r in routes.items():
            if name in tied:
                unit = next((u.name for u in self._units if u.kind == "weight"
                             and any(self._names[m] == name for m, _ in u.uses)), "")
                raise ValueError(f"routes: {name!r} shares a parameter with another layer; its weight's route is "
                                 f"the unit's, {unit!r}")
            if name not in self._names.values():
                raise ValueError(f"routes: {name!r} is not a parameterised layer (or shared weight) of the model")
            _check_route(f"routes: the route of {name!r}", r, ROUTES)
        self._pinned.update(routes)

    def _hook(self, module, inputs, output):
        if not self.enabled:
            return
        if module in self._saved:
            raise ValueError(f"clipping: 'bk' needs every layer to run once per forward pass; "
                             f"{type(module).__name__} ran twice")
        self._saved[module] = (inputs[0].detach(), output, output._version)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ routes
    def _plan(self, lays: dict[nn.Module, _Layer]) -> dict[nn.Module, str]:
        """Each routed layer's route: pinned, the fastest measured, or ``prefer`` resolved."""
        plan = {}
        for m, lay in lays.items():
            name = self._names[m]
            if name in self._pinned:
                plan[m] = lay.resolve(self._pinned[name])
            elif self.prefer == "measured":
                key = lay.key()
                if key not in _MEASURED:
                    _MEASURED[key] = self.timings[name] = lay.measure()
                times = {r: s for r, s in _MEASURED[key].items() if parse_route(r)[0] in lay.candidates()}
                plan[m] = min(times, key=times.get)
            else:
                plan[m] = lay.resolve(self.prefer)
        return plan

    # ------------------------------------------------------------------ per layer
    def _bias(self, m: nn.Module, dz: torch.Tensor, b: int, conv: bool):
        """Per-example bias gradients [B, p] (None without a trainable bias) and their squared norms."""
        if m.bias is None or not m.bias.requires_grad:
            return None, torch.zeros(b, dtype=dz.dtype, device=dz.device)
        pos = tuple(range(2, dz.dim())) if conv else tuple(range(1, dz.dim() - 1))
        gb = (dz.sum(pos) if pos else dz).reshape(self.rows_per_example, b, -1).sum(0)
        return gb, (gb * gb).sum(1)

    def _per_layer(self, m: nn.Module, a: torch.Tensor, dz: torch.Tensor, route: str | None = None):
        """Squared per-example norms [B] of this layer's parameter gradients, and a closure giving
        the clipped sums (weight, bias) for factors c [B]. ``route``: the planned route of a
        convolution / multi-position linear layer (None: as ``prefer`` resolves it)."""
        k, rows = self.rows_per_example, a.shape[0]
        b = rows // k

        if isinstance(m, _Shared) and m.kind == "vector":      # a: the per-example gradients [B, n]
            return (a * a).sum(1), (lambda c: (c @ a, None))

        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(a, m.num_groups, eps=m.eps)
            dims = tuple(range(2, dz.dim()))
            gw = (dz * xhat).sum(dims) if m.weight is not None else None      # [kB, C]
            gb = dz.sum(dims) if m.bias is not None else None
            gw, gb = (None if g is None else g.reshape(k, b, -1).sum(0) for g in (gw, gb))   # [B, C]
            sq = sum((g * g).sum(1) for g in (gw, gb) if g is not None)

            def clipped(c):
                return (None if gw is None else c @ gw), (None if gb is None else c @ gb)
            return sq, clipped

        lay = _Layer(m, a, dz, k)
        gb, sq = self._bias(m, dz, b, lay.conv)
        shape = m.weight.shape
        if lay.t == 1:
            # rank one per example: ||dz_i a_i^T||^2 = ||a_i||^2 ||dz_i||^2
            u2, g2 = a.reshape(b, -1), dz.reshape(b, -1)
            sq = sq + (u2 * u2).sum(1) * (g2 * g2).sum(1)

            def clipped(c):
                return (g2 * c[:, None]).t().mm(u2).reshape(shape), (None if gb is None else c @ gb)
            return sq, clipped
        if route is None:
            route = self._plan({m: lay})[m]
        sw, kept = lay.norms(*parse_route(_unfused(route)))
        sq = sq + sw

        def clipped(c):
            w = lay.kept_sum(kept, c) if kept is not None else lay.weighted_sum(c)
            return w, (None if gb is None else c @ gb)
        return sq, clipped

    # ------------------------------------------------------------------ the step
    def _backward(self, loss_sum: torch.Tensor):
        """One backward pass of ``loss_sum`` to the saved layer outputs: [(module, input, output
        gradient)] in forward order; and the plan of routes for the layers that have them."""
        mods = list(self._saved)
        if set(mods) != set(self.layers):
            missing = [type(m).__name__ for m in self.layers if m not in self._saved]
            raise ValueError(f"clipping: 'bk' saw no forward pass through {missing} (parameters outside the loss)")
        for m in mods:
            if self._saved[m][1]._version != self._saved[m][2]:
                self._saved.clear()
                raise ValueError(f"clipping: 'bk' needs each layer's output unchanged after the layer; the output of "
                                 f"{type(m).__name__} was modified in place (e.g. ReLU(inplace=True)): make it out of place")
        outs = [self._saved[m][1] for m in mods]
        grads = torch.autograd.grad(loss_sum, outs, allow_unused=True)
        k = self.rows_per_example
        items = []
        for m, dz in zip(mods, grads):
            a, out = self._saved[m][0], self._saved[m][1]
            if a.shape[0] % k:
                self._saved.clear()
                raise ValueError(f"clipping: {k} rows per example need a multiple of {k} rows, got {a.shape[0]}")
            items.append((m, a, (torch.zeros_like(out) if dz is None else dz).detach()))
        self._saved.clear()
        if self._units:     # the modules that share a parameter: one item per parameter (their units)
            saved = {m: (a, dz) for m, a, dz in items if m in self._tied}
            items = [it for it in items if it[0] not in self._tied]
            for u in self._units:
                items.append((u, *u.linear_form(saved)) if u.kind == "weight" else (u, u.per_example(saved, k), None))
        lays = {}
        for m, a, dz in items:
            if not isinstance(m, nn.GroupNorm) and not (isinstance(m, _Shared) and m.kind == "vector"):
                lay = _Layer(m, a, dz, k)
                if lay.t > 1:
                    lays[m] = lay
        plan = self._plan(lays)
        self.routes = {self._names[m]: r for m, r in plan.items()}
        return items, plan

    def per_example_norms(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, list]:
        """One backward pass of ``loss_sum`` (= sum_i l_i) to the saved layer outputs; the flat
        per-example gradient norms [B] and the per-layer clipped-sum closures (for any factors c;
        a fused route takes its unfused form here)."""
        items, plan = self._backward(loss_sum)
        plan = {m: _unfused(r) for m, r in plan.items()}
        self.routes = {self._names[m]: r for m, r in plan.items()}
        sq, closures = None, []
        for m, a, dz in items:
            s, clip = self._per_layer(m, a, dz, plan.get(m))
            sq = s if sq is None else sq + s
            closures.append((m, clip))
        return sq.clamp_min(0).sqrt(), closures

    def clipped_sum(self, loss_sum: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
        """Set ``p.grad`` = sum_i min(1, C / (||g_i|| + 1e-6)) g_i for every trainable parameter;
        returns the per-example norms ||g_i||. The layers with fused routes go last, together
        (:func:`_fused_group`): their sums are taken chunk by chunk with the chunk's factors."""
        items, plan = self._backward(loss_sum)
        sq, closures, fused = None, [], []
        for m, a, dz in items:
            if m in plan and _is_fused(plan[m]):
                fused.append((m, a, dz))
                continue
            s, clip = self._per_layer(m, a, dz, plan.get(m))
            sq = s if sq is None else sq + s
            closures.append((m, clip))
        if fused:
            lays, biases = [], []
            for m, a, dz in fused:
                lays.append(_Layer(m, a, dz, self.rows_per_example))
                gb, s_bias = self._bias(m, dz, lays[-1].b, lays[-1].conv)
                sq = s_bias if sq is None else sq + s_bias
                biases.append(gb)
            routes = [parse_route(plan[m]) for m, _, _ in fused]
            sq, sums = _fused_group(lays, [r for r, _ in routes], sq, max_grad_norm, max(w for _, w in routes))
            for (m, _, _), w, gb in zip(fused, sums, biases):
                closures.append((m, lambda c, w=w, gb=gb: (w, None if gb is None else c @ gb)))
        norms = sq.clamp_min(0).sqrt()
        c = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        for m, clip in closures:
            w, b = clip(c)
            for p, g in ((m.weight, w), (getattr(m, "bias", None), b)):
                if p is not None and p.requires_grad and g is not None:
                    p.grad = g.to(p.dtype) if p.grad is None else p.grad + g.to(p.dtype)
        return norms
