"""DP-SGD step speed against a plain step (issue 26, "Speed"): book-keeping clipping by every route
of :mod:`dpmech.privacy.clipping`, Opacus's ghost clipping, and the plain (non-private) step, side by side.

Per model (``tb_cnn``, ``pixeldp_cnn``): fixed batches of 512 from a 10,000-image MNIST subset, the
same threads; every round draws one batch and runs one step of every trainer on it, in an order
shuffled per round (so a busy machine slows them alike); a trainer's ratio is the median over the
rounds of (its step time / the plain step's time in the same round). The plain step is the
model's forward, backward and SGD step (``DPSGDTrainer`` with epsilon None), the same as issue 14's.

Writes ``benchmarks/results/dpsgd_speed.json`` (a run of some models keeps the others' entries):
``speed.<model>`` = {plain_img_s, dp_img_s, slowdown (the default engine's ratio),
clipping, modes {bk, ghost}, routes {route: ratio}, routes_img_s, layer_routes (what the default
chose), layer_timings_ms (its one-off measurement), target, load_avg, ...}; and the routes table of
docs/dpsgd.md. One line re-measures everything (the figures the docs quote)::

    python benchmarks/dpsgd_speed.py --threads 2

``--docs`` only rewrites the routes table from the results file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, environment, log, read_result, update_doc_blocks, write_result  # noqa: E402

NAME = "dpsgd_speed"
DOC = Path(__file__).resolve().parent.parent / "docs" / "dpsgd.md"
MODELS = ("tb_cnn", "pixeldp_cnn")
TARGETS = {"tb_cnn": 1.25, "pixeldp_cnn": 1.5}
DEFAULT = "measured"
# route name -> BookKeeper(prefer=...); "opacus_ghost" is the trainer's clipping="ghost" mode
ROUTES = {
    "estimated": "mixed",      # issue 14's engine: estimated-cost rule, whole-batch instantiation
    "ghost": "ghost",          # ghost norms everywhere (chunked), sums by re-weighted weight gradients
    "inst": "inst",            # whole-batch instantiation everywhere, sums from the kept gradients
    "bmm": "bmm",              # chunked instantiation from the strided patch view, sums from kept
    "bmm_f": "bmm_f",          # ... the sums fused into the chunk loop (after the other layers' norms)
    "grouped": "grouped",      # per-example gradients of a chunk by one grouped convolution, kept
    "grouped_f": "grouped_f",  # ... fused
    "compiled": "compiled",    # bmm with the chunk's patch gather, matmul and norm by torch.compile, kept
    "compiled_w": "compiled_w",  # compiled norms only; sums by re-weighted weight gradients
    "compiled_f": "compiled_f",  # ... fused
    "bmm_f@2": "bmm_f@2",      # bmm_f with the chunks split over 2 threads (1 intra-op thread each)
    "grouped_f@2": "grouped_f@2",
    "measured": "measured",    # the default: each layer's fastest route by a one-off timing
}
DESCRIPTION = {
    "estimated": "issue 14's engine: whole-batch instantiation or ghost norms by estimated cost",
    "ghost": "ghost norms (Gram matrices) on every layer, chunked; sums by re-weighted weight gradients",
    "inst": "per-example gradients of the whole batch at once (full patch copy), sums from them",
    "bmm": "per-example gradients chunk by chunk (patches copied per chunk), kept for the sums",
    "bmm_f": "bmm, every layer's sum taken chunk by chunk once all norms of the chunk are known (nothing kept)",
    "grouped": "per-example conv gradients as one grouped convolution per chunk (no patch copy), kept",
    "grouped_f": "grouped, the sums fused the same way",
    "compiled": "bmm with each full chunk's patch gather + matmul + norm compiled by torch.compile (inductor, C++)",
    "compiled_w": "compiled norms only (the gradients stay in the kernel); sums by re-weighted weight gradients",
    "compiled_f": "compiled, the sums fused (a single fused layer: norms, factors and share in one compiled call per chunk)",
    "bmm_f@2": "bmm_f with the chunks split over 2 Python threads of 1 intra-op thread each",
    "grouped_f@2": "grouped_f with the chunks split over 2 threads",
    "measured": "**default**: per layer the fastest of all routes by a one-off timing at the first step",
    "opacus_ghost": "Opacus ghost clipping (two backward passes), for scale",
}


def make_trainers(name: str, x: torch.Tensor, y: torch.Tensor, batch: int, routes: list[str]) -> dict:
    from dpmech.privacy.clipping import BookKeeper
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, build_dpsgd_model

    def dp(clipping: str):
        return DPSGDTrainer(build_dpsgd_model("mnist", 0, name), x, y, DPSGDConfig(
            epsilon=None, noise_multiplier=1.0, max_grad_norm=0.1, batch_size=batch, lr=0.01, momentum=0.9,
            clipping=clipping))

    trainers = {"plain": DPSGDTrainer(build_dpsgd_model("mnist", 0, name), x, y, DPSGDConfig(
        epsilon=None, batch_size=batch, lr=0.01, momentum=0.9))}
    for r in routes:
        if r == "opacus_ghost":
            trainers[r] = dp("ghost")
            continue
        t = dp("bk")
        if ROUTES[r] != t.bookkeeper.prefer:          # the trainer's engine is the default one
            t.bookkeeper.remove()
            t.bookkeeper = BookKeeper(t.model, prefer=ROUTES[r])
        trainers[r] = t
    return trainers


def measure_model(name: str, routes: list[str], rounds: int, batch: int, warmup: int = 3) -> dict:
    """Step seconds of the plain step and every route, interleaved (shuffled order) per round."""
    from dpmech.datasets.splits import load_splits

    train, _ = load_splits("mnist", train_size=10000, test_size=100, seed=0)
    x, y = train.tensors
    trainers = make_trainers(name, x, y, batch, routes)
    g = torch.Generator().manual_seed(0)
    seconds = {k: [] for k in trainers}
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    for s in range(rounds + warmup):                  # the first rounds (the one-off timing) are not counted
        idx = torch.randperm(x.shape[0], generator=g)[:batch]
        order = [list(trainers)[i] for i in torch.randperm(len(trainers), generator=g).tolist()]
        for k in order:
            t0 = time.perf_counter()
            trainers[k]._step(idx)
            if s >= warmup:
                seconds[k].append(time.perf_counter() - t0)
    load_after = os.getloadavg()
    ratio = {k: statistics.median(t / p for t, p in zip(seconds[k], seconds["plain"])) for k in routes}
    img_s = {k: batch / statistics.median(v) for k, v in seconds.items()}
    default = trainers[DEFAULT].bookkeeper
    entry = {
        "plain_img_s": img_s["plain"], "dp_img_s": img_s[DEFAULT], "slowdown": ratio[DEFAULT], "clipping": "bk",
        "default_route": DEFAULT, "target": TARGETS.get(name),
        "modes": {"bk": {"dp_img_s": img_s[DEFAULT], "slowdown": ratio[DEFAULT]}},
        "routes": ratio, "routes_img_s": {k: img_s[k] for k in routes},
        "layer_routes": dict(default.routes),
        "layer_timings_ms": {lay: {r: 1e3 * s for r, s in t.items()} for lay, t in default.timings.items()},
        "steps": rounds, "batch_size": batch, "threads": torch.get_num_threads(),
        "ratio_statistic": "median over rounds of route step time / plain step time in the same round",
        "load_avg": {"before": list(load_before), "after": list(load_after)},
        "wall_s": time.perf_counter() - t_start,
    }
    if "opacus_ghost" in ratio:
        entry["modes"]["ghost"] = {"dp_img_s": img_s["opacus_ghost"], "slowdown": ratio["opacus_ghost"]}
    log(f"speed {name} ({torch.get_num_threads()} threads, load {load_before[0]:.2f} -> {load_after[0]:.2f}): "
        f"plain {img_s['plain']:.0f} img/s; " + ", ".join(f"{k} {ratio[k]:.2f}x" for k in routes)
        + f"; default chose {default.routes}")
    return entry


def routes_table(speed: dict) -> str:
    models = [m for m in MODELS if m in speed]
    routes = [r for r in speed[models[0]]["routes"]]
    head = "| route | what it does | " + " | ".join(f"{m} ratio" for m in models) + " |"
    rows = [head, "| --- | --- | " + " | ".join("---" for _ in models) + " |"]
    rows.append("| plain | the non-private step (the baseline) | " + " | ".join(
        f"1.00 ({speed[m]['plain_img_s']:,.0f} img/s)" for m in models) + " |")
    for r in routes:
        rows.append(f"| `{r}` | {DESCRIPTION.get(r, '')} | " + " | ".join(
            f"{speed[m]['routes'][r]:.2f}x ({speed[m]['routes_img_s'][r]:,.0f} img/s)" for m in models) + " |")
    rows.append("| target | issue 26 | " + " | ".join(f"<= {speed[m]['target']}x" for m in models) + " |")
    meta = speed[models[0]]
    load = ", ".join(f"{m}: {speed[m]['load_avg']['before'][0]:.2f} -> {speed[m]['load_avg']['after'][0]:.2f}"
                     for m in models)
    rows.append("")
    rows.append(f"{meta['steps']} interleaved rounds per model, batch {meta['batch_size']}, {meta['threads']} threads, "
                f"{meta.get('date', '')}; 1-minute load average before -> after ({os.cpu_count()} cores; the benchmark's own "
                f"threads count ~{meta['threads']}): {load}. Ratio: median over the rounds of (route step / plain step "
                "in the same round); img/s: batch / median step time. "
                "Default's per-layer choice: " + "; ".join(
                    f"{m} {speed[m]['layer_routes']}" for m in models) + ".")
    return "\n".join(rows)


def write_speed(speed: dict, threads: int, docs: bool) -> Path:
    """Read-modify-write of the results JSON: the models measured and ``threads`` replaced, the rest kept."""
    path = RESULTS / f"{NAME}.json"
    data = read_result(path) or {"benchmark": NAME}
    data["speed"] = {**data.get("speed", {}), **speed}       # a run of some models keeps the others
    data["threads"] = threads
    write_result(NAME, data)
    if docs:
        update_doc_blocks({DOC: {"speed-routes": routes_table(speed)}})
    return path


def measure(models=MODELS, routes=None, rounds: int = 50, batch: int = 512) -> dict:
    routes = list(routes or (list(ROUTES) + ["opacus_ghost"]))
    if DEFAULT not in routes:
        routes.append(DEFAULT)
    env = environment(torch.device("cpu"))
    out = {}
    for name in models:
        out[name] = measure_model(name, routes, rounds, batch)
        out[name].update(device=env["device"], date=env["date"], torch=env["versions"].get("torch"))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=50, help="timed rounds per model (3 warm-up rounds more)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--routes", nargs="+", default=None, choices=list(ROUTES) + ["opacus_ghost"])
    ap.add_argument("--no-write", action="store_true", help="print only (no JSON, no docs)")
    ap.add_argument("--docs", action="store_true", help="only rewrite docs/dpsgd.md's routes table from the results file")
    args = ap.parse_args(argv)
    if args.docs:
        speed = read_result(RESULTS / f"{NAME}.json")["speed"]
        update_doc_blocks({DOC: {"speed-routes": routes_table(speed)}})
        log(f"updated {DOC}")
        return speed
    torch.set_num_threads(args.threads)
    speed = measure(args.models, args.routes, args.rounds)
    if not args.no_write:
        full = set(args.models) == set(MODELS) and args.routes is None
        path = write_speed(speed, args.threads, docs=full)
        log(f"wrote {path}" + (" and docs/dpsgd.md's routes table" if full else ""))
    return speed


if __name__ == "__main__":
    main()
