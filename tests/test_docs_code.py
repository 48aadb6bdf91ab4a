"""The Python blocks of the docs that no other test runs (docs/audit.md, docs/own_model.md,
docs/specs.md, docs/mia.md) run as written, each doc's blocks in order in one namespace, from the project root.
(docs/notebook.md, README.md and docs/adding_a_mechanism.md have tests of their own.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/audit.md", "docs/own_model.md", "docs/specs.md", "docs/mia.md")
OWN_TESTS = ("docs/notebook.md", "README.md", "docs/adding_a_mechanism.md")


def blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_doc_blocks_run_as_written(doc, monkeypatch):
    monkeypatch.chdir(ROOT)
    found = blocks(ROOT / doc)
    assert found, f"{doc} has no python block"
    namespace: dict = {}
    for i, code in enumerate(found):
        exec(compile(code, f"{doc} block {i + 1}", "exec"), namespace)


def test_every_doc_with_python_blocks_is_run_by_some_test():
    with_code = {str(p.relative_to(ROOT)) for p in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"] if blocks(p)}
    assert with_code <= set(DOCS) | set(OWN_TESTS), sorted(with_code - set(DOCS) - set(OWN_TESTS))
