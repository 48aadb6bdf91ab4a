"""The layout docs/layout.md describes holds: dpmech and trainables import each other in no circle,
the shared dpmech packages never import a mechanism package, each package's ``__init__`` says in two
lines what it holds, and the four layers import downwards only. Read from the source (ast), so the
test sees lazy imports inside functions too. Each rule has a negative control on a planted tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ("privacy", "robustness", "datasets", "networks")
MECHANISMS = ("pixeldp", "dpsgd", "secure_sgd", "dpal", "dpal_sound", "adlm", "label_dp", "dpgan", "dp_merf")
LAYERS = ("dpmech", "trainables", "sweeps", "benchmarks")   # each may import only those before it


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (top-level or inside functions)."""
    mods = {module_name(root, p): p for p in (root / package).rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:     # annotations only: no import at run time
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def shared_imports_of_mechanisms(graph) -> list[tuple[str, str]]:
    bad = []
    for mod, deps in graph.items():
        parts = mod.split(".")
        if len(parts) > 1 and parts[1] in SHARED:
            bad += [(mod, d) for d in deps if len(d.split(".")) > 1 and d.split(".")[1] in MECHANISMS]
    return bad


@pytest.mark.parametrize("package", ["dpmech", "trainables", "sweeps"])
def test_no_import_circle(package):
    assert cycles(import_graph(ROOT, package)) == []


def test_shared_dpmech_packages_import_no_mechanism():
    assert shared_imports_of_mechanisms(import_graph(ROOT, "dpmech")) == []


def test_each_package_init_says_in_two_lines_what_it_holds():
    for init in (ROOT / "dpmech").rglob("__init__.py"):
        if init.parent == ROOT / "dpmech":
            continue                       # the public API (lazy names), documented in docs/notebook.md
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc and len(doc.splitlines()) <= 2, f"{init}: a docstring of at most two lines"
        assert len(tree.body) == 1, f"{init}: the docstring only (import from the modules)"


def test_every_mechanism_and_shared_package_exists():
    for name in SHARED + MECHANISMS:
        assert (ROOT / "dpmech" / name / "__init__.py").is_file(), name
    loose = sorted(p.name for p in (ROOT / "dpmech").glob("*.py") if p.name not in ("__init__.py", "_validate.py"))
    assert loose == [], f"dpmech's top level holds packages only, found {loose}"


def test_layers_import_downwards_only():
    for i, layer in enumerate(LAYERS):
        above = LAYERS[i + 1:]
        for path in (ROOT / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for name in names:
                    assert name.split(".")[0] not in above, f"{path.relative_to(ROOT)} imports {name}"
                    if layer == "dpmech":
                        assert name.split(".")[0] not in ("ray", "mlflow"), f"{path.relative_to(ROOT)} imports {name}"


def test_negative_controls_catch_a_planted_circle_and_a_shared_to_mechanism_import(tmp_path):
    pkg = tmp_path / "dpmech"
    for sub, text in {"privacy/__init__.py": "", "privacy/a.py": "from dpmech.privacy import b\n",
                      "privacy/b.py": "def f():\n    from dpmech.privacy.a import x\n",
                      "dpsgd/__init__.py": "", "dpsgd/trainer.py": "",
                      "robustness/__init__.py": "", "robustness/c.py": "import dpmech.dpsgd.trainer\n"}.items():
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text(text)
    (pkg / "__init__.py").write_text("")
    graph = import_graph(tmp_path, "dpmech")
    assert cycles(graph) == [["dpmech.privacy.a", "dpmech.privacy.b"]]
    assert shared_imports_of_mechanisms(graph) == [("dpmech.robustness.c", "dpmech.dpsgd.trainer")]
