"""docs/adding_a_mechanism.md, proved: a toy mechanism added in exactly the page's four steps.

A temporary copy of the source tree (dpmech/, trainables/, sweeps/, tests/, pyproject.toml) gets
the page's code blocks, read out of the page: the dpmech package (step 1), the trainable module
(step 2), the ONE registry line, inserted by a text edit of the copied ``trainables/registry.py``
(step 3), and the spec (step 4), plus the page's unit-test file. Then every command of the page's
``bash`` blocks runs there, in a fresh process whose ``PYTHONPATH`` puts the copy before the
editable install (checked: the copy's packages are the ones imported), through the installed
``dpsweep`` script as a user runs it: the spec validates, ``dpsweep mechanisms`` lists the toy, the
sweep runs on a local Ray into a local MLflow store in the copy, the report is written, and the
page's tests pass. In MLflow the toy's trials are FINISHED with ``acc_clean`` and an ``epsilon``
equal to dp-accounting's for the noise multiplier the trial drew.

Negative control: the same copy with steps 1, 2 and 4 but no registry line refuses the spec with
the one-line "unknown trainable" error (exit 2) and creates no MLflow store.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding_a_mechanism.md"
COPIED = ("dpmech", "trainables", "sweeps", "tests", "pyproject.toml")
REGISTRY = "trainables/registry.py"
NAME = "dp_centroid"
# the page's four steps: these files (and the registry line) and nothing else of the source tree
STEP_FILES = (f"dpmech/{NAME}/__init__.py", f"dpmech/{NAME}/trainer.py", f"trainables/{NAME}.py",
              f"sweeps/{NAME}.yaml")
# what a user's or a CI's environment may set that would send the sweep elsewhere
FOREIGN_ENV = ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME",
               "DPSWEEP_STORAGE", "DPSWEEP_SHARED_STORAGE", "PYTHONPATH")

_BLOCK = re.compile(r"(?:^`(?P<path>[\w./-]+)`:\n\n)?^```(?P<lang>\w+)\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL)


def doc_blocks() -> list[tuple[str | None, str, str]]:
    """Every fenced block of the page: (the file it is, when a line "`path`:" precedes it, or None;
    its language; its code)."""
    return [(m["path"], m["lang"], m["code"]) for m in _BLOCK.finditer(DOC.read_text())]


def doc_files() -> dict[str, str]:
    return {path: code for path, _, code in doc_blocks() if path}


def doc_commands() -> list[str]:
    """The lines of the page's bash blocks, in order (comments and blank lines dropped)."""
    lines = []
    for path, lang, code in doc_blocks():
        if lang == "bash" and path is None:
            lines += [ln.strip() for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return lines


def test_the_page_is_four_steps_and_every_block_is_used():
    blocks = doc_blocks()
    files = doc_files()
    assert set(STEP_FILES) | {REGISTRY} <= set(files), sorted(files)
    assert set(files) == set(STEP_FILES) | {REGISTRY, f"tests/test_{NAME}.py"}, "a block the test does not apply"
    assert [b for b in blocks if b[0] is None and b[1] != "bash"] == [], "every block is a file or commands"
    assert len(files[REGISTRY].strip().splitlines()) == 1, "step 3 is one line"
    assert [c.split()[:2] for c in doc_commands() if c.startswith("dpsweep")] == [
        ["dpsweep", "validate"], ["dpsweep", "mechanisms"], ["dpsweep", "run"], ["dpsweep", "report"]]
    for step in ("## 1.", "## 2.", "## 3.", "## 4."):
        assert step in DOC.read_text()


def source_copy(dest: Path) -> Path:
    """The project's source tree, without caches, virtual environments, benchmarks or stores."""
    dest.mkdir()
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        else:
            shutil.copy2(src, dest / name)
    assert not (dest / "dpmech" / NAME).exists() and not (dest / "trainables" / f"{NAME}.py").exists()
    return dest


def add_registry_line(root: Path, line: str) -> None:
    """Step 3 as a text edit: the line goes last in the ``MODULES = (...)`` tuple."""
    path = root / REGISTRY
    text = path.read_text()
    m = re.search(r"^MODULES\s*=\s*\((?P<body>.*?)^\)", text, re.MULTILINE | re.DOTALL)
    assert m, f"{REGISTRY} has no MODULES = (...) tuple"
    line = line.rstrip("\n")
    new = text[:m.end("body")] + line + "\n" + text[m.end("body"):]
    assert len(new.splitlines()) == len(text.splitlines()) + 1
    path.write_text(new)


def apply_steps(root: Path, *, registry_line: bool = True) -> None:
    for path, code in doc_files().items():
        if path == REGISTRY:
            if registry_line:
                add_registry_line(root, code)
            continue
        target = root / path
        assert not target.exists(), f"{path} exists before the step writes it"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)


def copy_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env["PYTHONPATH"] = str(root)   # the copy first: it shadows the editable install of /work/main
    # a Ray of its own: ray.init() without an address joins a cluster that another process started
    # with `ray start` on this machine (a cluster test running beside this one), whose workers
    # import the editable install
    env["RAY_ADDRESS"] = "local"
    return env


def argv(command: str) -> list[str]:
    """A command of the page as this environment runs it: the installed ``dpsweep`` script (its
    own directory first on sys.path, so only PYTHONPATH can put the copy first), ``python`` = this
    interpreter."""
    words = shlex.split(command, comments=True)
    if words[0] == "dpsweep":
        script = Path(sys.executable).parent / "dpsweep"
        return ([str(script)] if script.exists() else [sys.executable, "-m", "sweeps.cli"]) + words[1:]
    if words[0] == "python":
        return [sys.executable] + words[1:]
    raise AssertionError(f"the page runs {words[0]!r}; this test knows dpsweep and python")


def run(command: str, root: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv(command), cwd=root, env=copy_env(root), capture_output=True, text=True, check=False,
                          timeout=timeout)


def test_a_toy_mechanism_added_in_four_steps_runs_end_to_end(tmp_path):
    start = time.perf_counter()
    root = source_copy(tmp_path / "src")
    apply_steps(root)

    # the copy is what every process imports, not the editable install
    probe = ("import dpmech, sweeps, trainables, trainables.registry as r\n"
             f"import dpmech.{NAME}.trainer, trainables.{NAME}\n"
             "print(dpmech.__file__, sweeps.__file__, trainables.__file__, r.__file__)\n"
             f"print(sorted(r.REGISTRY))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=copy_env(root), capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    files, names = out.stdout.splitlines()
    assert all(Path(f).is_relative_to(root) for f in files.split()), files
    assert NAME in names
    installed = subprocess.run([sys.executable, "-c", "import trainables; print(trainables.__file__)"], cwd=tmp_path,
                               env={k: v for k, v in copy_env(root).items() if k != "PYTHONPATH"},
                               capture_output=True, text=True, timeout=120, check=False)
    assert not Path(installed.stdout.strip()).is_relative_to(root)   # without PYTHONPATH: the installed one

    outputs = {}
    for command in doc_commands():
        done = run(command, root)
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs[command] = done.stdout

    def output_of(prefix: str) -> str:
        return next(o for c, o in outputs.items() if c.startswith(prefix))

    assert f"valid (2 trials, trainables: {NAME})" in output_of("dpsweep validate")
    listing = output_of("dpsweep mechanisms")
    assert listing.startswith(f"{NAME}: DP nearest centroid")
    assert "epsilon protects: training examples, image and label" in listing and "clip_norm" in listing
    assert all("passed" in o and "failed" not in o for c, o in outputs.items() if "pytest" in c)
    assert any((root / "report").iterdir())

    from dp_accounting import GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dp-centroid")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    children = [r for r in runs if r.data.tags.get("dpsweep.trainable") == NAME]
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    assert sorted(float(r.data.params["epsilon"]) for r in children) == [0.5, 2.0]
    for r in children:
        m, target = r.data.metrics, float(r.data.params["epsilon"])
        assert m["acc_clean"] > 0.6, m        # a nearest-centroid classifier that learned (chance: 0.1)
        accountant = RdpAccountant()
        accountant.compose(GaussianDpEvent(m["noise_multiplier"]))
        assert m["epsilon"] == pytest.approx(accountant.get_epsilon(m["delta"]), rel=1e-12)
        assert 0.99 * target < m["epsilon"] <= target
        assert m["delta"] == 1e-5 and m["sensitivity"] == pytest.approx(2 ** 0.5)
    elapsed = time.perf_counter() - start
    print(f"four steps and {len(outputs)} commands in {elapsed:.0f}s")


def test_without_the_registry_line_the_spec_is_refused_in_one_line(tmp_path):
    root = source_copy(tmp_path / "src")
    apply_steps(root, registry_line=False)   # steps 1, 2 and 4 only
    validate = next(c for c in doc_commands() if c.startswith("dpsweep validate"))
    done = run(validate, root)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("dpsweep: error: trainables[0].name: unknown trainable 'dp_centroid'"), lines[0]
    assert not (root / "mlflow.db").exists() and not (root / "ray_results").exists()
