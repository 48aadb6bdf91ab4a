"""The benchmark runners that write their results tables into docs/ (published vs measured)."""

from __future__ import annotations

import pytest

from benchmarks import dpgan_mnist_full as bench

ROW = {"tstr_acc": 0.7, "tstr_acc_std": 0.01, "seeds": [0, 1], "epsilon_rdp": 9.99, "sample_quality": 0.75,
       "train_seconds": 400.0}


def _docs(tmp_path):
    (tmp_path / "docs").mkdir()
    for doc in bench.DOC_TABLES:
        (tmp_path / doc).write_text("# title\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n\ntail\n")


def test_results_table_puts_published_target_and_measured_side_by_side():
    table = bench.results_table({"dpgan": {"eps_10": ROW}}, "dpgan")
    eps10 = next(line for line in table.splitlines() if line.startswith("| eps_10"))
    assert "| 0.747 | 0.75 | 0.700 ± 0.010 | 0, 1 | 9.990 |" in eps10
    assert "| eps_1 | 0.586 | 0.55 | not run |" in table          # a target without a run is shown as such


def test_update_docs_rewrites_only_the_results_block(tmp_path):
    _docs(tmp_path)
    bench.update_docs({"dpgan": {"eps_10": ROW}, "dp_merf_paper": {"eps_1": ROW}}, root=tmp_path)
    text = (tmp_path / "docs/dpgan.md").read_text()
    assert text.startswith("# title") and text.rstrip().endswith("tail") and "old" not in text
    assert "0.700 ± 0.010" in text and "--docs" in text
    assert "`dp_merf_paper`" in (tmp_path / "docs/dp_merf.md").read_text()


def test_update_docs_refuses_a_doc_without_exactly_one_block_and_writes_nothing(tmp_path):
    _docs(tmp_path)
    merf = tmp_path / "docs/dp_merf.md"
    merf.write_text(merf.read_text() * 2)                 # the second doc is broken: two blocks
    before = (tmp_path / "docs/dpgan.md").read_text()
    with pytest.raises(ValueError, match="dp_merf.md: expected one results block"):
        bench.update_docs({"dpgan": {"eps_10": ROW}}, root=tmp_path)
    assert (tmp_path / "docs/dpgan.md").read_text() == before      # the first doc left as it was
