"""Shared pieces of the benchmarks: environment description, the results files and their sections,
resumable per-seed runs, merging and the docs' generated blocks.

Layout: ``benchmarks/<name>.py`` writes ``benchmarks/results/<name>.json`` only (a ``--demo`` run
under its ``demo`` key, beside the full run at the top level) and keeps its per-run files (one JSON
per run, scores, images) in the folder ``benchmarks/results/<name>/``."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
from contextlib import contextmanager
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def log(msg: str) -> None:
    """Print a progress line at once (benchmarks run for minutes)."""
    print(msg, flush=True)


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def environment(device: torch.device) -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "torchvision", "numpy", "scipy", "opacus", "dp-accounting", "ray", "mlflow"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {"device": device_description(device), "python": platform.python_version(),
            "versions": versions, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def save_checkpoint(state, path: Path) -> None:
    """``torch.save`` that never leaves a half-written file at ``path``: a ``.tmp`` beside it, then an
    atomic rename (a unit killed mid-write resumes from the previous epoch's checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def write_result(name: str, payload: dict, out: Path | None = None) -> Path:
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def read_result(path: Path) -> dict:
    """The JSON at ``path``, or {} when there is none yet."""
    return json.loads(path.read_text()) if path.exists() else {}


def write_part(name: str, payload: dict, part: str | None = None, out: Path | None = None,
               keep: tuple[str, ...] = ()) -> Path:
    """Write ``payload`` into ``results/<name>.json`` (or ``out``): as the entry at the dotted key path
    ``part`` ("demo", "variants.long"), the rest of the file kept; or, without ``part``, as the whole
    file but for the top-level keys ``keep`` of the file as it was (the parts other runs wrote)."""
    path = out or RESULTS / f"{name}.json"
    old = read_result(path)
    if part is None:
        new = {**payload, **{k: old[k] for k in keep if k in old}}
    else:
        new = old or {"benchmark": name}
        *parents, leaf = part.split(".")
        node = new
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = payload
    return write_result(name, new, path)


def demo_parser(doc: str, demo_help: str = "small, quick version") -> argparse.ArgumentParser:
    """The command line of a benchmark with a ``--demo`` mode, to add its own options to: ``--demo``,
    ``--epochs`` and ``--train-size`` (None: the mode's own), ``--seed``, ``--out`` (see :func:`write_run`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--demo", action="store_true", help=demo_help)
    ap.add_argument("--epochs", type=int, default=None, help="epochs (default: the mode's own)")
    ap.add_argument("--train-size", type=int, default=None, help="training images (default: the mode's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results alone to this file instead")
    return ap


def write_run(name: str, payload: dict, demo: bool, out: Path | None = None) -> Path:
    """The results of a benchmark with a ``--demo`` mode: the full run is the top level of
    ``results/<name>.json`` and the demo run its ``demo`` key; writing one keeps the other. With
    ``out`` the payload alone is written there. Logs the path."""
    if out is not None:
        path = write_result(name, payload, out)
    else:
        path = write_part(name, payload, "demo" if demo else None, keep=("demo",))
    log(f"wrote {path}")
    return path


def seed_runs(runs: Path, row: str) -> list[dict]:
    """The run files ``runs/<row>_seed<k>.json`` of one row, in seed order."""
    return sorted((json.loads(p.read_text()) for p in runs.glob(f"{row}_seed*.json")), key=lambda r: r["seed"])


def _claim_owner_dead(claim: Path) -> bool:
    """Whether ``claim`` names a process of this host that no longer exists (killed: its ``finally`` never
    ran). A claim without an owner (written before claims named one) or of another host counts as alive."""
    import os
    import socket

    try:
        host, pid = claim.read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _take_claim(claim: Path) -> bool:
    """Create ``claim`` naming this process (host, pid); a claim left by a dead process of this host is
    moved aside first (an atomic rename: of two processes finding it stale, one takes it over)."""
    import os
    import socket

    for _ in range(2):
        try:
            with claim.open("x") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            return True
        except FileExistsError:
            if not _claim_owner_dead(claim):
                return False
            try:
                claim.rename(claim.with_name(f"{claim.name}.stale-{os.getpid()}"))
            except FileNotFoundError:
                return False
            claim.with_name(f"{claim.name}.stale-{os.getpid()}").unlink(missing_ok=True)
            log(f"[{claim.stem}] the process that claimed it died: taken over")
    return False


@contextmanager
def claimed_unit(runs: Path, stem: str, label: str | None = None):
    """One resumable unit of a long benchmark: yields the JSON path to write when the unit has to
    run, or None when ``runs/<stem>.json`` exists (done) or another live process holds
    ``runs/<stem>.running`` (it names its host and pid; a claim whose process of this host died, killed
    before it could release it, is taken over); the claim is released on exit."""
    label = label or stem
    path = runs / f"{stem}.json"
    if path.exists():
        log(f"[{label}] already done, skipped")
        yield None
        return
    claim = runs / f"{stem}.running"
    if not _take_claim(claim):
        log(f"[{label}] claimed by another process ({claim.name}: {claim.read_text().strip() or 'no owner recorded'};"
            " delete it if that process died), skipped")
        yield None
        return
    try:
        yield path
    finally:
        claim.unlink(missing_ok=True)


def update_doc_blocks(blocks: dict[Path, dict[str, str]]) -> list[Path]:
    """Replace generated blocks in docs: for each doc, each ``name`` -> text goes between the doc's
    ``<!-- name:begin ... -->`` and ``<!-- name:end -->`` lines (the begin marker is rewritten to say
    what generated it). Every doc is checked (each block present exactly once) before any is written,
    so a bad doc leaves all of them as they were."""
    import re

    new_texts = {}
    for path, named in blocks.items():
        text = path.read_text()
        for name, body in named.items():
            pattern = rf"<!-- {re.escape(name)}:begin.*?<!-- {re.escape(name)}:end -->"
            block = f"<!-- {name}:begin (generated; do not edit by hand) -->\n{body.strip()}\n<!-- {name}:end -->"
            text, n = re.subn(pattern, lambda _: block, text, flags=re.S)
            if n != 1:
                raise ValueError(f"{path.name}: expected one '{name}' block (<!-- {name}:begin ... {name}:end -->), "
                                 f"found {n}")
        new_texts[path] = text
    for path, text in new_texts.items():
        path.write_text(text)
    return list(new_texts)


def merge_new(existing: dict, others: list[Path], key: str, same: str | None = None,
              base: dict | None = None, part=None) -> dict:
    """``existing`` plus the entries of each JSON file's ``key`` mapping that ``existing`` lacks (an
    entry already there is kept); with ``same``, a file whose ``same`` field differs from ``base``'s
    is refused (exit with a one-line reason) before anything is merged; ``part`` (a function of the
    loaded file) picks the section of each file that holds them. Logs the count per file."""
    loaded = [(p, (part or (lambda o: o))(json.loads(p.read_text()))) for p in others]
    for p, o in loaded:
        if same is not None and o.get(same) != (base or {}).get(same):
            raise SystemExit(f"{p}: {same} differ from the results'; not merged")
    merged = dict(existing)
    for p, o in loaded:
        new = {k: v for k, v in o.get(key, {}).items() if k not in merged}
        merged.update(new)
        log(f"{p}: {len(new)} new {key}")
    return merged
