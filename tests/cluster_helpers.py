"""Helpers of the cluster tests (tests/test_cluster_faults.py) and the scaling benchmark: an
``mlflow server`` on 127.0.0.1, a multi-node Ray cluster on one machine, sweep specs, the node
every trial actor ran on, and a scanner that looks for training examples inside artifacts.

The MLflow server listens on 127.0.0.1 only. The Ray nodes use the machine's own address (Ray
resolves 127.0.0.1 to it when a driver connects), so their traffic never leaves the machine.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` with artifact proxying, bound to 127.0.0.1, backed by SQLite and a
    local artifact directory (standing in for the head's durable storage)."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "server.log"

    @property
    def uri(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 180) -> None:
        self.launch()
        self.wait(timeout)

    def launch(self) -> None:
        """Start the server process (``wait`` until it answers)."""
        mlflow = Path(sys.executable).parent / "mlflow"
        cmd = [str(mlflow), "server", "--host", LOOPBACK, "--port", str(self.port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--serve-artifacts", "--artifacts-destination", str(self.root / "artifacts")]
        # no background job runner (it serves GenAI evaluation jobs; a dozen idle processes here)
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                         start_new_session=True)

    def wait(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log.read_text()[-2000:]}")
            if self.healthy():
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not come up in {timeout}s: {self.log.read_text()[-2000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server and every process it started (its own process group)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        deadline = time.time() + 20  # the port is free again once the server has let it go
        while time.time() < deadline and self.healthy():
            time.sleep(0.2)


def start_cluster(worker_cpus: int = 1, head_cpus: int = 0):
    """A Ray cluster on this machine: a head with ``head_cpus`` CPUs (0, as on the real cluster:
    the head schedules, workers train) and one worker node with ``worker_cpus``. Fast node-death
    detection so a removed node's trials are retried within seconds."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 1000},
    })
    worker = cluster.add_node(num_cpus=worker_cpus, resources={"worker": worker_cpus})
    cluster.wait_for_nodes()
    return cluster, worker


def write_spec(path: Path, name: str, storage: Path, common: dict, space: dict, **extra) -> Path:
    spec = {
        "name": name,
        "storage": str(storage),
        "mlflow": {"experiment": name},
        "common": dict(common),
        "trainables": [{"name": "pixeldp", "search": dict(space)}],
        "resources": {"cpu": 1},
        "failure": {"max_retries": 2},
        **extra,
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def driver_env(address: str) -> dict:
    """Environment of a ``dpsweep`` driver process that joins the test cluster."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env.update({"PYTHONPATH": str(ROOT), "RAY_ADDRESS": address, "DPSWEEP_SHARED_STORAGE": "1",
                "OMP_NUM_THREADS": "1"})
    return env


def trial_actor_nodes() -> dict[int, str]:
    """pid -> node id of every Tune trial actor this Ray cluster has run (alive or dead)."""
    from ray._private import state

    out = {}
    for actor in state.actors().values():
        cls = actor.get("ActorClassName", "") or ""
        if "dispatch" in cls or "ImplicitFunc" in cls:
            out[int(actor.get("Pid") or 0)] = actor["Address"]["NodeID"]
    return out


def result_lines(trial_dir: Path) -> list[dict]:
    path = trial_dir / "result.json"
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return lines


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


# --------------------------------------------------------------------------- training-data scanner


class ExampleScanner:
    """Finds training images inside artifact files.

    Each image is looked for (1) as its exact float32, float64 and uint8 (0..255) bytes in the
    raw file, (2) in every decoded numeric array (torch tensors of a weights file, Parquet
    columns, JSON/YAML numbers, PNG pixel planes) as a contiguous run of its values, within
    1e-6 for floats (any of the three scalings: [-1, 1], [0, 1], 0..255)."""

    def __init__(self, images: np.ndarray):
        x = np.asarray(images, dtype=np.float32).reshape(len(images), -1)
        self.images = x
        u8 = np.clip(np.rint((x + 1) / 2 * 255), 0, 255).astype(np.uint8)
        self.patterns = [row.tobytes() for row in x] + [row.astype(np.float64).tobytes() for row in x] + \
                        [row.tobytes() for row in u8]
        self.variants = [x, (x + 1) / 2, (x + 1) / 2 * 255]
        self.u8 = u8.reshape(len(images), 28, 28) if x.shape[1] == 784 else None

    # -- decoders
    @staticmethod
    def _arrays(path: Path) -> list[np.ndarray]:
        suffix = path.suffix.lower()
        arrays: list[np.ndarray] = []
        if suffix in (".pt", ".pth"):
            import torch

            def walk(obj):
                if isinstance(obj, torch.Tensor):
                    arrays.append(obj.detach().cpu().numpy())
                elif isinstance(obj, dict):
                    for v in obj.values():
                        walk(v)
                elif isinstance(obj, (list, tuple)):
                    for v in obj:
                        walk(v)

            walk(torch.load(path, map_location="cpu", weights_only=True))
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            for col in table.columns:
                values = col.to_pylist()
                flat = _flatten_numbers(values)
                if flat:
                    arrays.append(np.asarray(flat, dtype=np.float64))
        elif suffix in (".json", ".yaml", ".yml"):
            text = path.read_text()
            data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
            flat = _flatten_numbers(data)
            if flat:
                arrays.append(np.asarray(flat, dtype=np.float64))
        elif suffix == ".png":
            from PIL import Image

            img = np.asarray(Image.open(path).convert("RGBA"))
            arrays.extend(img[..., c] for c in range(4))
        return arrays

    def _in_array(self, arr: np.ndarray) -> int | None:
        """Index of a training image found in ``arr``, else None. Candidates are the positions
        holding an image's first non-background value (a sorted lookup), then the whole window
        is compared."""
        a = np.asarray(arr)
        if a.ndim == 2 and a.dtype == np.uint8 and self.u8 is not None:  # PNG plane: look for a 28x28 block
            return self._in_plane(a)
        flat = a.astype(np.float64).ravel()
        d = self.images.shape[1]
        if flat.size < d:
            return None
        for variant in self.variants:
            v = variant.astype(np.float64)
            k = np.argmax(np.abs(v - v.min(axis=1, keepdims=True)) > 0, axis=1)  # first non-background pixel
            anchors = v[np.arange(len(v)), k]
            order = np.argsort(anchors)
            sorted_anchors = anchors[order]
            pos = np.clip(np.searchsorted(sorted_anchors, flat), 1, len(sorted_anchors) - 1)
            near = np.where(np.abs(sorted_anchors[pos - 1] - flat) <= np.abs(sorted_anchors[pos] - flat), pos - 1, pos)
            close = np.flatnonzero(np.abs(sorted_anchors[near] - flat) <= 1e-6)
            for h in close:
                anchor = sorted_anchors[near[h]]
                for i in np.flatnonzero(np.abs(anchors - anchor) <= 1e-6):
                    start = h - k[i]
                    if 0 <= start and start + d <= flat.size and np.allclose(flat[start:start + d], v[i], atol=1e-6):
                        return int(i)
        return None

    def _in_plane(self, plane: np.ndarray) -> int | None:
        rows = [r.tobytes() for r in plane]
        for i, img in enumerate(self.u8):
            j = int(np.argmax([len(set(r.tolist())) for r in img]))  # its most varied row
            needle = img[j].tobytes()
            for y, row in enumerate(rows):
                x = row.find(needle)
                while x != -1:
                    y0 = y - j
                    if 0 <= y0 and y0 + 28 <= plane.shape[0] and np.array_equal(plane[y0:y0 + 28, x:x + 28], img):
                        return i
                    x = row.find(needle, x + 1)
        return None

    def scan(self, path: Path) -> str | None:
        """A description of the training example found in ``path``, else None."""
        raw = path.read_bytes()
        for n, pattern in enumerate(self.patterns):
            if pattern in raw:
                return f"{path.name}: raw bytes of training image {n % len(self.images)}"
        for arr in self._arrays(path):
            i = self._in_array(arr)
            if i is not None:
                return f"{path.name}: values of training image {i}"
        return None


def _flatten_numbers(obj) -> list[float]:
    out: list[float] = []

    def walk(o):
        if isinstance(o, bool) or o is None:
            return
        if isinstance(o, (int, float)):
            out.append(float(o))
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif isinstance(o, np.ndarray):
            out.extend(o.astype(np.float64).ravel().tolist())

    walk(obj)
    return out


def png_bytes(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()
