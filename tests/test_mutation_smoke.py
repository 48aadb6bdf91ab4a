"""The mutation check itself (benchmarks/mutation_check.py, issue 35): the two-mutant smoke run kills
both mutants on a copy whose unmutated tests pass, every listed old text is still in its file, and
the harness can report a survivor and a rotten entry (its negative controls)."""

from __future__ import annotations

import json

import pytest

from benchmarks import mutation_check as mc


def test_every_listed_mutant_still_applies():
    """The list rots loudly: an entry whose old text is gone (or ambiguous) fails here, in the suite."""
    mutants = mc.load_mutants()
    assert len(mutants) >= 33
    stale = [f"{m.name} ({m.file}: found {mc.occurrences(mc.ROOT, m)} times)" for m in mutants
             if mc.occurrences(mc.ROOT, m) != 1]
    assert not stale, "mutants whose old text is not found exactly once: " + ", ".join(stale)
    assert sum(m.smoke for m in mutants) == 2
    assert mc.main(["--list"]) == 0


def test_smoke_run_kills_both_mutants_and_the_unmutated_copy_passes(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    assert mc.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["baseline"]["status"] == "passed"        # the same tests pass without a mutation
    assert result["selection"] == "smoke" and result["summary"]["killed"] == 2
    assert [m["status"] for m in result["mutants"]] == ["killed", "killed"]
    for m in result["mutants"]:
        assert m["killed_by"].split("::")[0] in {t.split("::")[0] for t in m["tests"]}
    assert {"device", "versions", "date"} <= set(result)
    assert (mc.ROOT / "dpmech").is_dir()  # the working tree was never mutated
    for m in mc.load_mutants():
        if m.smoke:
            assert mc.occurrences(mc.ROOT, m) == 1


def test_harness_reports_a_survivor_and_a_rotten_entry():
    """Negative controls of the harness: a mutation no test can see (a docstring) survives, and an
    entry whose old text is not in its file is an error, not a silent skip."""
    target = ["tests/test_mechanisms.py::test_laplace_scale"]
    harmless = mc.Mutant("docstring_only", "dpmech/privacy/mechanisms.py", '"""Scale b of the Laplace mechanism:',
                         '"""The scale b of the Laplace mechanism:', target)
    rotten = mc.Mutant("rotten", "dpmech/privacy/mechanisms.py", "this text is in no file", "x", target)
    outcomes, baseline = mc.check([harmless, rotten], timeout=300, log=lambda *_: None)
    assert baseline["status"] == "passed"
    assert [(o.name, o.status) for o in outcomes] == [("docstring_only", "survived"), ("rotten", "error")]
    assert "found 0 times" in outcomes[1].detail


def test_bad_lists_are_refused_in_one_line(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("- {name: a, file: f.py, old: x, new: x, tests: [t.py]}\n")
    with pytest.raises(ValueError, match="'a': new text equals old text"):
        mc.load_mutants(bad)
    bad.write_text("- {name: a, file: f.py, old: x, new: y}\n")
    with pytest.raises(ValueError, match=r"missing fields \['tests'\]"):
        mc.load_mutants(bad)
    with pytest.raises(SystemExit, match="--only: no mutant named nope"):
        mc.main(["--only", "nope"])
