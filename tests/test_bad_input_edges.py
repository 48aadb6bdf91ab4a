"""The seven invalid inputs of issue 49.7 that slipped past validation, through the real ``dpsweep``
entry point: each is exit 2 with one line naming the key and the rule, before Ray starts, with nothing
written (no experiment folder, no MLflow store)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BASE = {"name": "edges", "common": {"train_size": 64, "test_size": 32, "certify_images": 0},
        "trainables": [{"name": "pixeldp", "search": {"epochs": 1}}]}


def _run(tmp: Path, text: str, capsys, *extra: str) -> tuple[int, list[str]]:
    from sweeps.cli import main

    spec = tmp / "spec.yaml"
    spec.write_text(text)
    capsys.readouterr()
    code = main(["run", str(spec), "--storage", str(tmp / "ray_results"),
                 "--tracking-uri", f"sqlite:///{tmp}/mlflow.db", *extra])
    out = capsys.readouterr()
    errors = [ln for ln in out.err.splitlines() if ln.strip()]
    assert sorted(p.name for p in tmp.iterdir()) == ["spec.yaml"], "nothing may be written"
    return code, errors


def _spec(**changes) -> str:
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    for path, value in changes.items():
        node = raw
        *parts, last = path.split(".")
        for p in parts:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[last] = value
    return yaml.safe_dump(raw)


@pytest.mark.parametrize("text, words", [
    (_spec(name="n" * 10_000), "name: at most 120 characters"),
    (_spec(**{"mlflow.experiment": "e" * 5_000}), "mlflow.experiment: String should have at most 250 characters"),
    (_spec(**{"trainables.0.search.epochs": 10**30}), "epochs: at most 100,000 epochs"),
    (_spec(**{"search.algorithm": "optuna", "search.num_samples": 10**9, "search.metric": "acc_clean",
              "search.mode": "max", "trainables.0.search.lr": {"loguniform": [0.001, 0.1]}}),
     "search.num_samples: must be <= 10000"),
    ("name: a\nname: b\ntrainables:\n  - name: pixeldp\n", "the key 'name' is written twice (first on line 1)"),
    ("name: a\ntrainables:\n  - name: pixeldp\n    search: {epochs: 1, epochs: 2}\n", "the key 'epochs' is written twice"),
    (_spec(**{"mlflow.tracking_uri": "ftp://example.invalid/x"}), "mlflow.tracking_uri: scheme 'ftp'"),
    ("name: a\nx: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply to read"),
], ids=["long-name", "long-experiment", "epochs-1e30", "num-samples-1e9", "duplicate-key", "duplicate-flow-key",
        "ftp-tracking-uri", "deep-nesting"])
def test_each_is_one_line_and_nothing_written(tmp_path, capsys, text, words):
    code, errors = _run(tmp_path, text, capsys)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("dpsweep: error: ") and words in errors[0], errors


def test_an_ftp_tracking_uri_on_the_command_line_is_one_line(tmp_path, capsys):
    from sweeps.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(_spec())
    code = main(["run", str(spec), "--storage", str(tmp_path / "ray_results"), "--tracking-uri", "ftp://x/y"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(errors) == 1 and "scheme 'ftp'" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_controls_the_bounds_admit_what_studies_use(tmp_path):
    """The same keys at sizes a study uses validate: a 120-character name, 100,000 epochs, 10,000
    Optuna samples, a YAML merge key, a deep-but-sane nesting."""
    from sweeps.spec import load_spec

    spec = tmp_path / "ok.yaml"
    spec.write_text(_spec(name="n" * 120, **{"trainables.0.search.epochs": 100_000}))
    assert load_spec(spec).name == "n" * 120
    spec.write_text("name: m\nx: &c {train_size: 64}\ncommon:\n  <<: *c\n  test_size: 32\n"
                    "trainables:\n  - name: pixeldp\n")
    with pytest.raises(Exception, match="x: unknown key"):   # the merge key itself is not refused
        load_spec(spec)
