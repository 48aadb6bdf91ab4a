"""The report reads per-example tables in place from a local artifact store (no MLflow round trip
per run: 960 runs cost 18 s of list_artifacts on SQLite) and through MLflow otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from sweeps.report.data import TABLES, Sweep, load_tables


class _Client:
    def __init__(self, store):
        self.store, self.listed, self.downloaded = store, [], []

    def list_artifacts(self, run_id, path):
        self.listed.append(run_id)
        return [SimpleNamespace(path=p) for p in self.store.get(run_id, {})]

    def download_artifacts(self, run_id, path, dst):
        self.downloaded.append(run_id)
        return str(self.store[run_id][path])


def _table(path, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"index": list(range(n)), "label": [1] * n, "prediction": [1] * n,
                             "certified_size": [0.1] * n}), path)
    return path


def _sweep(tmp_path, uris, client):
    trials = pd.DataFrame({"run_id": list(uris)})
    return Sweep(client, "e", "sqlite:///x", SimpleNamespace(), trials, artifact_uris=uris)


def test_local_artifacts_are_read_in_place(tmp_path):
    rel = TABLES["native"][0]
    a, b = tmp_path / "a" / "artifacts", tmp_path / "b" / "artifacts"
    _table(a / rel, 3)
    (b / "model").mkdir(parents=True)  # a run with weights but no table
    client = _Client({})
    sweep = _sweep(tmp_path, {"ra": f"file://{a}", "rb": str(b)}, client)
    load_tables(sweep)
    assert client.listed == [] and client.downloaded == []
    assert len(sweep.tables[("ra", "native")]) == 3
    assert ("rb", "native") not in sweep.tables


def test_remote_artifacts_go_through_mlflow(tmp_path):
    rel = TABLES["native"][0]
    local = _table(tmp_path / "dl" / rel, 4)
    client = _Client({"rr": {rel: local}})
    sweep = _sweep(tmp_path, {"rr": "mlflow-artifacts:/1/rr/artifacts", "gone": f"file://{tmp_path}/missing"}, client)
    load_tables(sweep)
    assert client.listed == ["rr", "gone"]  # a local root that is not on this disk: asked of MLflow
    assert client.downloaded == ["rr"]
    assert len(sweep.tables[("rr", "native")]) == 4
