"""The benchmark runners that write their results tables into docs/ (published vs measured)."""

from __future__ import annotations

import pytest

from benchmarks import dpgan_mnist_full as bench

ROW = {"tstr_acc": 0.7, "tstr_acc_std": 0.01, "seeds": [0, 1], "epsilon_rdp": 9.99, "sample_quality": 0.75,
       "train_seconds": 400.0}


def _docs(tmp_path):
    (tmp_path / "docs").mkdir()
    for doc in bench.DOC_TABLES:
        extra = "<!-- paper-eps:begin -->\nold\n<!-- paper-eps:end -->\n\n" if doc == "docs/dpgan.md" else ""
        (tmp_path / doc).write_text(f"# title\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n\n{extra}tail\n")


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
    assert "0.700 ± 0.010" in text and "--docs" in text and "generated" in text
    assert "`dp_merf_paper`" in (tmp_path / "docs/dp_merf.md").read_text()


def test_paper_epsilon_table_names_the_batch_and_the_runs_missing(tmp_path):
    _docs(tmp_path)
    bench.update_docs({"dpgan_hist": {"eps_3.2": {**ROW, "seeds": [0]}}}, root=tmp_path)
    text = (tmp_path / "docs/dpgan.md").read_text()
    assert "| 3.2 | 1200 | 0.700 | 0 | 9.990 |" in text
    assert "| 0.72 | 2000 | not run |" in text and text.count("old") == 0


def test_update_docs_refuses_a_doc_without_exactly_one_block_and_writes_nothing(tmp_path):
    _docs(tmp_path)
    merf = tmp_path / "docs/dp_merf.md"
    merf.write_text(merf.read_text() * 2)                 # the second doc is broken: two blocks
    before = (tmp_path / "docs/dpgan.md").read_text()
    with pytest.raises(ValueError, match="dp_merf.md: expected one 'results' block"):
        bench.update_docs({"dpgan": {"eps_10": ROW}}, root=tmp_path)
    assert (tmp_path / "docs/dpgan.md").read_text() == before      # the first doc left as it was


def test_label_dp_tables_say_met_missed_and_not_run():
    from benchmarks import labeldp_mnist_full as ldp

    s = lambda v: {"mean": v, "std": 0.001, "n": 3, "seeds": [v] * 3}     # noqa: E731
    result = {"classification": {"lp2st": {"eps_1": s(0.96), "eps_2": s(0.98)}, "non_private": s(0.99)},
              "regression": {"non_private": {"mse": 0.30, "mse_std": 0.01, "mse_seeds": [0.3] * 3}},
              "runs": {}, "units_done": 5, "units_total": 123}
    t = ldp.doc_tables(result)
    assert "| LP-2ST | 1 | 95.82% | ≥ 95.5% | 96.00 ± 0.10 (n = 3) | yes |" in t["labeldp-targets"]
    assert "| LP-2ST | 2 | 98.78% | ≥ 98.5% | 98.00 ± 0.10 (n = 3) | no (-0.50 points) |" in t["labeldp-targets"]
    assert "| LP-2ST | 4 | 99.24% | ≥ 99.0% | not run | – |" in t["labeldp-targets"]
    assert "MSE 0.3000 ± 0.0100 (n = 3) | no |" in t["labeldp-targets"]
    assert "| Laplace | not run |" in t["labeldp-grid"] and "5 of 123 units" in t["labeldp-grid"]


def test_dpgan_merge_adds_units_from_another_file_without_replacing(tmp_path):
    import json

    unit = {"method": "dpgan", "epsilon_target": 10.0, "seed": 0, "tstr_acc": 0.7, "sample_quality": 0.7,
            "epsilon_rdp": 9.99, "train_seconds": 1.0}
    main, other = tmp_path / "main.json", tmp_path / "other.json"
    main.write_text(json.dumps({"units": {"dpgan.eps_10.seed_0": unit}}))
    other.write_text(json.dumps({"units": {"dpgan.eps_10.seed_0": dict(unit, tstr_acc=0.1),
                                           "dpgan.eps_10.seed_1": dict(unit, seed=1, tstr_acc=0.8)}}))
    bench.main(["--out", str(main), "--merge", str(other)])
    got = json.loads(main.read_text())["superseded"]["dpgan"]   # dpgan: a superseded recipe (dpgan_hist ships)
    assert got["units"]["dpgan.eps_10.seed_0"]["tstr_acc"] == 0.7           # the existing unit is kept
    assert got["results"]["eps_10"]["seeds"] == [0, 1]
    assert abs(got["results"]["eps_10"]["tstr_acc"] - 0.75) < 1e-9


def test_label_dp_merge_unions_runs_of_the_same_settings_only(tmp_path):
    import json

    from benchmarks import labeldp_mnist_full as ldp

    run = {"task": "classification", "method": "lp2st", "epsilon": 1.0, "seed": 0, "acc": 0.95, "mse": None}
    main, same, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    main.write_text(json.dumps({"settings": {"epochs": 6}, "runs": {"classification/lp2st/eps_1/seed0": run}}))
    same.write_text(json.dumps({"settings": {"epochs": 6}, "runs": {
        "classification/lp2st/eps_1/seed0": dict(run, acc=0.1),
        "classification/lp2st/eps_1/seed1": dict(run, seed=1, acc=0.97)}}))
    other.write_text(json.dumps({"settings": {"epochs": 12}, "runs": {}}))
    ldp.main(["--out", str(main), "--merge", str(same)])
    got = json.loads(main.read_text())
    assert got["classification"]["lp2st"]["eps_1"]["seeds"] == [0.95, 0.97]      # the existing run kept
    with pytest.raises(SystemExit, match="settings differ"):
        ldp.main(["--out", str(main), "--merge", str(other)])


def test_label_dp_comparison_table_names_the_two_settings_and_pairs_units():
    from benchmarks import labeldp_mnist_full as ldp

    st = {"epochs": 12, "stage1_epochs": 20, "width": 16, "hidden": 128}
    run = lambda acc, eps=2.0: {"method": "lp2st", "epsilon": eps, "acc": acc, "mse": None}      # noqa: E731
    small = {"settings": st, "runs": {"classification/lp2st/eps_2/seed0": run(0.981)}}
    wide = {"settings": {**st, "width": 32, "hidden": 256},
            "runs": {"classification/lp2st/eps_2/seed0": run(0.985), "classification/lp2st/eps_4/seed0": run(0.99, 4.0)}}
    table = ldp.schedule_table(small, wide, ldp.network_label)
    assert "| unit | CNN 16/32 channels, 128 hidden | CNN 32/64 channels, 256 hidden | published |" in table
    assert "| classification/lp2st/eps_2/seed0 | 98.10% | 98.50% | 98.78% |" in table
    assert "| classification/lp2st/eps_4/seed0 | not run | 99.00% | 99.24% |" in table
