"""The project's own mutation check (issue 35): is every guarantee pinned by a test that can fail?

``benchmarks/mutants.yaml`` lists guarantee-critical one-text mutants of dpmech -- a noise scale, a
clipping bound, a sampling rate, a step count, a confidence level, a certified radius, a
sensitivity -- each with the file, the exact old text (it must occur exactly once in the file), the
new text and the tests expected to kill it (test files or pytest node ids). This script copies the
source tree to a temporary directory (never touching the working tree, which others may be editing),
runs the union of the named tests once on the unmutated copy (the baseline: a mutant whose tests
fail anyway proves nothing), then applies the mutants one at a time and runs each one's tests with
``-x -q`` under a timeout. A mutant is

* ``killed``: a named test failed (the first failing test is recorded);
* ``survived``: every named test passed with the mutation in place -- a guarantee nothing checks;
* ``timeout``: the tests ran past ``--timeout`` (reported apart; not counted as a kill);
* ``error``: the old text is not in the file, or occurs more than once (the list has rotted: fix
  the entry, loudly, rather than skip it), or pytest could not run the tests at all;
* ``baseline_failed``: every named test already fails without the mutation (a test that fails
  unmutated is reported in ``baseline`` and deselected from every mutant's run).

Usage (from the repository root, with the project's virtual environment)::

    python -m benchmarks.mutation_check --list            # the mutants, and whether each old text is found
    python -m benchmarks.mutation_check --smoke           # the two smoke mutants (seconds)
    python -m benchmarks.mutation_check --only NAME[,NAME]
    python -m benchmarks.mutation_check                   # the whole list (tens of minutes on 2 cores)
    python -m benchmarks.mutation_check --coverage        # which mutants stand on each guarantee file
    python -m benchmarks.mutation_check --coverage --update-docs   # ... and rewrite docs/testing.md's table

The whole list writes ``benchmarks/results/mutation_check.json`` (device, versions, date, one row per
mutant); ``--smoke`` and ``--only`` write only where ``--out`` says. ``--from-head`` copies the
committed tree (``git archive HEAD``) instead of the working tree (tracked and untracked, not
ignored, files), for a consistent snapshot while others edit. Exit status 0 when no mutant
survived and none errored, 1 otherwise. Policy and how to add a mutant: docs/testing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = Path(__file__).resolve().parent / "mutants.yaml"
DEFAULT_TIMEOUT = 600
STATUSES = ("killed", "survived", "timeout", "error", "baseline_failed")
# The guarantee code whose mutants docs/testing.md tabulates (issue 50): every file under these
# folders, the release and the trial runtime (its checkpoint, DIVERGED and trial-key code), and any
# other file a mutant names.
COVERAGE_DIRS = ("dpmech/privacy", "dpmech/robustness", "dpmech/dpsgd", "dpmech/label_dp")
COVERAGE_FILES = ("sweeps/release.py", "trainables/runtime.py")
DOCS = ROOT / "docs" / "testing.md"
TABLE_BEGIN = "<!-- mutation coverage: begin (python -m benchmarks.mutation_check --coverage --update-docs) -->"
TABLE_END = "<!-- mutation coverage: end -->"
FIELDS = {"name", "file", "old", "new", "tests", "what", "smoke"}


@dataclass
class Mutant:
    """One one-text mutation and the tests that must kill it."""

    name: str
    file: str
    old: str
    new: str
    tests: list[str]
    what: str = ""
    smoke: bool = False


@dataclass
class Outcome:
    name: str
    status: str
    seconds: float = 0.0
    killed_by: str | None = None
    detail: str = ""
    tests: list[str] = field(default_factory=list)


def load_mutants(path: Path = MUTANTS) -> list[Mutant]:
    """The list in ``path``, checked: every field known, names unique, old != new, tests non-empty."""
    entries = yaml.safe_load(path.read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: must hold a non-empty list of mutants")
    out, seen = [], set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ValueError(f"{path}: entry {i} must be a mapping, got {type(e).__name__}")
        unknown = set(e) - FIELDS
        missing = {"name", "file", "old", "new", "tests"} - set(e)
        if unknown or missing:
            raise ValueError(f"{path}: entry {e.get('name', i)!r}: unknown fields {sorted(unknown)}, "
                             f"missing fields {sorted(missing)}")
        tests = e["tests"] if isinstance(e["tests"], list) else [e["tests"]]
        m = Mutant(str(e["name"]), str(e["file"]), str(e["old"]), str(e["new"]), [str(t) for t in tests],
                   str(e.get("what", "")), bool(e.get("smoke", False)))
        if not re.fullmatch(r"[a-z0-9_]+", m.name):
            raise ValueError(f"{path}: name must be lower_snake_case, got {m.name!r}")
        if m.name in seen:
            raise ValueError(f"{path}: name {m.name!r} appears twice")
        if m.old == m.new:
            raise ValueError(f"{path}: entry {m.name!r}: new text equals old text")
        if not m.tests:
            raise ValueError(f"{path}: entry {m.name!r}: tests must name at least one test file or node id")
        seen.add(m.name)
        out.append(m)
    return out


def occurrences(tree: Path, m: Mutant) -> int:
    """How often the mutant's old text occurs in its file under ``tree`` (-1: no such file)."""
    path = tree / m.file
    return path.read_text().count(m.old) if path.is_file() else -1


def copy_tree(dest: Path, *, from_head: bool = False, source: Path = ROOT) -> None:
    """The source tree into ``dest``: the committed tree (``git archive HEAD``) or the working tree's
    tracked and untracked, not ignored, files. Bytecode is never copied (ignored by git)."""
    dest.mkdir(parents=True, exist_ok=True)
    if from_head:
        archive = subprocess.run(["git", "-C", str(source), "archive", "HEAD"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        return
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-co", "--exclude-standard", "-z"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = source / rel
        if src.is_file():  # a tracked file deleted in the working tree is skipped
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _env(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant's module is always recompiled from its source
    return env


def check_imports(tree: Path) -> None:
    """The copy's packages shadow any installed ones (else every mutant would 'survive')."""
    code = "import dpmech, sys; print(dpmech.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=_env(tree), capture_output=True, text=True,
                         check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"dpmech imports from {out}, not from the copy {tree}: mutants would not be seen")


def run_tests(tree: Path, tests: list[str], timeout: float, *, stop_first: bool = True,
              deselect: tuple[str, ...] = ()) -> tuple[str, float, list[str], str]:
    """pytest -q (with -x unless ``stop_first`` is False) on ``tests`` in ``tree``, less the node ids in
    ``deselect``: (passed | failed | timeout | error, seconds, failing tests, output tail)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    if stop_first:
        cmd.insert(3, "-x")
    for node in deselect:
        cmd += ["--deselect", node]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, [], ""
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    tail = "\n".join(out.strip().splitlines()[-15:])
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if proc.returncode == 0:
        return "passed", seconds, [], tail
    if proc.returncode == 1 and failed:
        return "failed", seconds, failed, tail
    return "error", seconds, failed, tail  # collection error, no tests collected, ...


def check(mutants: list[Mutant], *, timeout: float = DEFAULT_TIMEOUT, baseline_timeout: float | None = None,
          from_head: bool = False, source: Path = ROOT, log=print, on_outcome=None) -> tuple[list[Outcome], dict]:
    """Baseline, then every mutant, on one temporary copy of the tree (each mutant restored after).

    The baseline runs every named test unmutated (without -x): a test that fails there is reported
    and deselected from the mutants' runs, so it can neither kill a mutant nor hide the others.
    ``on_outcome(outcomes, baseline)`` is called after each mutant (progress files)."""
    with tempfile.TemporaryDirectory(prefix="dpsweep-mutation-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree, from_head=from_head, source=source)
        check_imports(tree)
        targets = sorted({t for m in mutants for t in m.tests})
        log(f"baseline: {len(targets)} test targets on the unmutated copy")
        base_status, base_seconds, broken, base_tail = run_tests(tree, targets, baseline_timeout or 4 * timeout,
                                                                 stop_first=False)
        baseline = {"status": base_status, "seconds": round(base_seconds, 1), "failed": broken, "targets": targets}
        if base_status != "passed":
            log(f"baseline {base_status}: {len(broken)} failing tests, deselected from the mutants' runs: "
                f"{', '.join(broken)}\n{base_tail}")
            if base_status != "failed":
                raise RuntimeError(f"baseline {base_status}: the named tests could not run unmutated\n{base_tail}")
        outcomes = []
        for m in mutants:
            path = tree / m.file
            count = occurrences(tree, m)
            if count != 1:
                why = "file not found" if count < 0 else f"old text found {count} times (must be exactly once)"
                outcomes.append(Outcome(m.name, "error", detail=f"{m.file}: {why}", tests=m.tests))
                log(f"{m.name:40s} error: {why}")
                continue
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                status, seconds, failed, tail = run_tests(tree, m.tests, timeout, deselect=tuple(broken))
            finally:
                path.write_text(original)
            if status == "error" and broken and "no tests ran" in tail:
                status = "baseline_failed"  # every named test was deselected
            result = {"passed": "survived", "failed": "killed", "timeout": "timeout", "error": "error",
                      "baseline_failed": "baseline_failed"}[status]
            detail = tail if result in ("error", "survived") else ""
            first = failed[0] if failed else None
            outcomes.append(Outcome(m.name, result, round(seconds, 1), first, detail, m.tests))
            log(f"{m.name:40s} {result:9s} {seconds:6.1f} s  {first or ''}")
            if on_outcome is not None:
                on_outcome(outcomes, baseline)
    return outcomes, baseline


def coverage(mutants: list[Mutant], root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """(file, names of the mutants on it) for every guarantee file (:data:`COVERAGE_DIRS`,
    :data:`COVERAGE_FILES`, every file a mutant names), sorted by path; [] where none stands on it."""
    files = {p.relative_to(root).as_posix() for d in COVERAGE_DIRS for p in (root / d).rglob("*.py")
             if p.name != "__init__.py"}
    files |= set(COVERAGE_FILES) | {m.file for m in mutants}
    names: dict[str, list[str]] = {}
    for m in mutants:
        names.setdefault(m.file, []).append(m.name)
    return [(f, names.get(f, [])) for f in sorted(files)]


def coverage_table(mutants: list[Mutant], root: Path = ROOT) -> str:
    """The markdown table of :func:`coverage` (docs/testing.md, between its coverage markers)."""
    rows = ["| file | mutants | names |", "| --- | ---: | --- |"]
    for f, names in coverage(mutants, root):
        rows.append(f"| {f} | {len(names)} | {', '.join(f'`{n}`' for n in names) if names else '**none**'} |")
    return "\n".join(rows) + "\n"


def docs_with_table(text: str, table: str) -> str:
    """``text`` (docs/testing.md) with the table between its markers replaced by ``table``."""
    if text.count(TABLE_BEGIN) != 1 or text.count(TABLE_END) != 1 or text.index(TABLE_BEGIN) > text.index(TABLE_END):
        raise ValueError(f"{DOCS.name}: needs one {TABLE_BEGIN!r} line and, after it, one {TABLE_END!r} line")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{table}{TABLE_END}{tail}"


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    return {s: sum(o.status == s for o in outcomes) for s in STATUSES}


def _select(mutants: list[Mutant], args) -> list[Mutant]:
    if args.smoke:
        chosen = [m for m in mutants if m.smoke]
        if len(chosen) != 2:
            raise SystemExit(f"mutants: exactly two entries must have smoke: true, found {len(chosen)}")
        return chosen
    if args.only:
        names = [n.strip() for n in ",".join(args.only).split(",") if n.strip()]
        unknown = [n for n in names if n not in {m.name for m in mutants}]
        if unknown:
            raise SystemExit(f"--only: no mutant named {', '.join(unknown)} (see --list)")
        return [m for m in mutants if m.name in names]
    return mutants


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the mutants and whether each old text is found once")
    p.add_argument("--coverage", action="store_true", help="print which mutants stand on each guarantee file (a "
                                                           "markdown table) and whether docs/testing.md holds it")
    p.add_argument("--update-docs", action="store_true", help="with --coverage: rewrite docs/testing.md's table")
    p.add_argument("--smoke", action="store_true", help="run the two mutants marked smoke: true")
    p.add_argument("--only", action="append", metavar="NAME[,NAME]", help="run only these mutants")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per mutant's test run")
    p.add_argument("--baseline-timeout", type=float, help="seconds for the unmutated run of every named test "
                                                          "(default 4 x --timeout)")
    p.add_argument("--from-head", action="store_true", help="copy the committed tree instead of the working tree")
    p.add_argument("--mutants", type=Path, default=MUTANTS, help="the list (default benchmarks/mutants.yaml)")
    p.add_argument("--out", type=Path, help="results JSON (default for a full run: "
                                            "benchmarks/results/mutation_check.json)")
    args = p.parse_args(argv)
    if argv is None:  # as a program: on SIGTERM stop the running tests and remove the copy
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mutants = load_mutants(args.mutants)
    if args.update_docs and not args.coverage:
        raise SystemExit("--update-docs: only with --coverage")
    if args.coverage:
        table = coverage_table(mutants)
        print(table, end="")
        bare = sum(not names for _, names in coverage(mutants))
        text = DOCS.read_text()
        try:
            updated = docs_with_table(text, table)
        except ValueError as exc:
            if args.update_docs:
                raise SystemExit(f"--update-docs: {exc}") from None
            print(f"{bare} files without a mutant; {exc}")
            return 0
        if args.update_docs and updated != text:
            DOCS.write_text(updated)
            print(f"{bare} files without a mutant; wrote the table to {DOCS.relative_to(ROOT)}")
        else:
            print(f"{bare} files without a mutant; {DOCS.relative_to(ROOT)} "
                  f"{'holds this table' if updated == text else 'is out of date (--update-docs)'}")
        return 0
    if args.list:
        bad = 0
        for m in mutants:
            count = occurrences(ROOT, m)
            ok = "ok" if count == 1 else ("FILE NOT FOUND" if count < 0 else f"OLD TEXT FOUND {count} TIMES")
            bad += count != 1
            print(f"{m.name:40s} {m.file:42s} {ok:6s} {' '.join(m.tests)}")
        print(f"{len(mutants)} mutants, {bad} with an old text not found exactly once")
        return 1 if bad else 0
    chosen = _select(mutants, args)
    start = time.monotonic()
    out = args.out
    if out is None and not (args.smoke or args.only):
        out = ROOT / "benchmarks" / "results" / "mutation_check.json"
    env = None

    def save(outcomes, baseline, complete: bool) -> None:
        nonlocal env
        if out is None:
            return
        sys.path.insert(0, str(ROOT))
        import torch

        from benchmarks.common import environment, write_result

        env = env or environment(torch.device("cpu"))
        listed = args.mutants.resolve()
        payload = {**env, "mutants_file": str(listed.relative_to(ROOT)) if listed.is_relative_to(ROOT) else str(listed),
                   "source": "HEAD" if args.from_head else "working tree",
                   "selection": "smoke" if args.smoke else ("only" if args.only else "all"),
                   "complete": complete, "timeout_s": args.timeout, "wall_s": round(time.monotonic() - start, 1),
                   "summary": summary(outcomes), "baseline": baseline, "mutants": [o.__dict__ for o in outcomes]}
        write_result("mutation_check", payload, out=out)

    outcomes, baseline = check(chosen, timeout=args.timeout, baseline_timeout=args.baseline_timeout,
                               from_head=args.from_head, on_outcome=lambda o, b: save(o, b, False))
    counts = summary(outcomes)
    print(f"{len(outcomes)} mutants: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    for o in outcomes:
        if o.status != "killed":
            print(f"  {o.status}: {o.name} ({' '.join(o.tests)})")
    save(outcomes, baseline, True)
    if out is not None:
        print(f"wrote {out}")
    return 0 if counts["survived"] == counts["error"] == counts["baseline_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
