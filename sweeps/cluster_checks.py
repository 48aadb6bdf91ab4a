"""Checks a sweep runs before it starts on a Ray cluster (docs/cluster.md).

On a cluster, Ray Tune writes each trial's checkpoints from the node the trial runs on to the
sweep's storage path, and the driver reads them back to retry or resume the trial, possibly on
another node. A path on one node's own disk therefore loses checkpoints silently: the retry
starts from nothing, or ``dpsweep resume`` finds an experiment without them. Likewise an MLflow
tracking URI that is a local file (``sqlite:///mlflow.db``, a plain path) makes every node log
into its own copy of the store.

``preflight(storage, tracking_uri)`` (called by ``dpsweep run`` and ``dpsweep resume`` once Ray
is up and before any MLflow run exists):

* decides whether the sweep runs on a cluster: ``RAY_ADDRESS`` names an existing cluster (it
  may autoscale from the head alone), or Ray already has more than one alive node;
* refuses (``StorageRefused``, one line, exit code 2) a storage path that is not shared by every
  node: anything but a remote URI (``s3://``, ``gs://``, ``abfs://``, ...), a path on a network
  filesystem found in ``/proc/mounts`` (NFS, CIFS, Lustre, GPFS, BeeGFS, CephFS, GlusterFS, FUSE
  mounts of object stores) or a path the user declares shared with ``DPSWEEP_SHARED_STORAGE=1``;
* warns (stderr, one line each) when the tracking URI is a local file.

``artifact_warning(info)`` warns, after the parent run exists, when the experiment's artifact
location is a node-local path (an MLflow server without artifact proxying).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

SHARED_ENV = "DPSWEEP_SHARED_STORAGE"

#: /proc/mounts filesystem types that every node of a cluster can mount at the same path.
NETWORK_FSTYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "fuse.glusterfs",
    "ceph", "cephfs", "fuse.ceph", "fuse.ceph-fuse", "ocfs2", "gfs2", "afs", "panfs", "wekafs", "fuse.weka",
    "fuse.s3fs", "fuse.gcsfuse", "fuse.mountpoint-s3", "fuse.goofys", "fuse.juicefs", "fuse.rclone",
    "fuse.blobfuse", "fuse.blobfuse2",
})

LOCAL_SCHEMES = ("file", "local")
REMOTE_TRACKING_NAMES = ("databricks", "databricks-uc", "uc")  # remote MLflow stores written without "//"


class StorageRefused(ValueError):
    """The sweep's storage path is node-local while the sweep runs on several nodes."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def uri_scheme(path: str) -> str | None:
    """``s3`` for ``s3://bucket/x``; None for a plain path."""
    if "://" not in path:
        return None
    return path.split("://", 1)[0].lower() or None


def is_remote_uri(path: str) -> bool:
    scheme = uri_scheme(path)
    return scheme is not None and scheme not in LOCAL_SCHEMES


def _unescape_mount(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mounts(text: str | None = None) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, from /proc/mounts (or ``text``)."""
    if text is None:
        try:
            text = Path("/proc/mounts").read_text()
        except OSError:
            return []
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            mounts.append((_unescape_mount(parts[1]), parts[2]))
    return mounts


def mount_fstype(path: str, mounts: list[tuple[str, str]] | None = None) -> str | None:
    """The filesystem type of the mount holding ``path`` (the path need not exist yet: its
    nearest existing ancestor decides); None when unknown."""
    mounts = read_mounts() if mounts is None else mounts
    p = Path(os.path.abspath(Path(path).expanduser()))
    head, tail = p, []
    while not head.exists() and head != head.parent:  # symlinks are resolved where the path exists
        head, tail = head.parent, [head.name, *tail]
    try:
        head = head.resolve()
    except OSError:
        pass
    p = head.joinpath(*tail)
    best, fstype = -1, None
    for point, kind in mounts:  # the last of equal mount points wins: it is mounted on top
        point_path = Path(point)
        if (p == point_path or point_path in p.parents) and len(point) >= best:
            best, fstype = len(point), kind
    return fstype


def storage_is_shared(storage: str, env: Mapping[str, str] | None = None,
                      mounts: list[tuple[str, str]] | None = None) -> tuple[bool, str]:
    """Whether every node can read what one node writes under ``storage``, and why (or why
    not), as a short phrase."""
    env = os.environ if env is None else env
    if is_remote_uri(storage):
        return True, f"{uri_scheme(storage)}:// storage"
    path = storage.split("://", 1)[1] if uri_scheme(storage) else storage
    if _truthy(env.get(SHARED_ENV)):
        return True, f"declared shared by {SHARED_ENV}"
    fstype = mount_fstype(path, mounts)
    if fstype in NETWORK_FSTYPES:
        return True, f"on a {fstype} mount"
    return False, f"on this node's local disk ({fstype or 'unknown filesystem'})"


def connected_to_cluster(env: Mapping[str, str] | None = None) -> bool:
    """``RAY_ADDRESS`` names an existing cluster (``ray job submit`` sets it for the job)."""
    env = os.environ if env is None else env
    address = (env.get("RAY_ADDRESS") or "").strip()
    return bool(address) and address.lower() != "local"


def alive_nodes() -> int:
    """Alive nodes of the Ray instance this process is connected to (0 when Ray is not up)."""
    import ray

    if not ray.is_initialized():
        return 0
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def check_storage(storage: str, *, nodes: int, cluster: bool, env: Mapping[str, str] | None = None,
                  mounts: list[tuple[str, str]] | None = None) -> None:
    """Raise ``StorageRefused`` when ``storage`` is node-local and the sweep runs on a cluster."""
    if not (cluster or nodes > 1):
        return
    shared, why = storage_is_shared(storage, env, mounts)
    if shared:
        return
    where = f"a Ray cluster of {nodes} nodes" if nodes > 1 else "a Ray cluster (RAY_ADDRESS is set)"
    raise StorageRefused(
        f"storage: {storage} is {why} but the sweep runs on {where}: checkpoints written on one node "
        f"are lost to the others; use s3://... or gs://..., a shared mount (NFS, Lustre, ...), or set "
        f"{SHARED_ENV}=1 if every node sees this path")


def tracking_warnings(tracking_uri: str, *, nodes: int, cluster: bool) -> list[str]:
    """Warnings for a tracking URI that is a file on this node while trials run on others."""
    if not (cluster or nodes > 1):
        return []
    scheme = uri_scheme(tracking_uri)
    if tracking_uri.split(":", 1)[0] in REMOTE_TRACKING_NAMES:
        return []
    if scheme in (None, "file") or (scheme or "").startswith("sqlite"):
        return [f"warning: MLflow tracking URI {tracking_uri} is a file on this node, but trials run on other "
                f"nodes and would log into their own copies of it; start `mlflow server --serve-artifacts` on "
                f"the head and pass --tracking-uri http://<head>:5000 (docs/cluster.md)"]
    return []


def artifact_warnings(artifact_location: str, *, nodes: int, cluster: bool) -> list[str]:
    """A warning for an experiment whose artifacts go to a node-local path."""
    if not (cluster or nodes > 1):
        return []
    from urllib.parse import urlparse

    scheme = urlparse(artifact_location).scheme.lower()  # mlflow-artifacts:/1 has no "//"
    if len(scheme) <= 1 or scheme == "file":  # a plain path (or a Windows drive letter)
        return [f"warning: MLflow artifacts of this experiment go to {artifact_location}, a path on each "
                f"trial's own node; run the tracking server with --serve-artifacts (mlflow-artifacts:/ "
                f"locations) or an s3:// artifact root (docs/cluster.md)"]
    return []


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"dpsweep: {line}", file=sys.stderr, flush=True)


def preflight(storage: str, tracking_uri: str) -> int:
    """The checks of ``dpsweep run``/``resume`` once Ray is up; returns the alive node count.
    Raises ``StorageRefused``; prints warnings to stderr."""
    nodes, cluster = alive_nodes(), connected_to_cluster()
    check_storage(storage, nodes=nodes, cluster=cluster)
    _warn(tracking_warnings(tracking_uri, nodes=nodes, cluster=cluster))
    return nodes


def artifact_warning(info: dict) -> None:
    """After the parent run exists: warn when the experiment's artifacts are node-local."""
    nodes, cluster = alive_nodes(), connected_to_cluster()
    if not (cluster or nodes > 1):
        return
    from mlflow.tracking import MlflowClient

    from trainables.tracking import retry

    client = MlflowClient(info["tracking_uri"])
    exp = retry(lambda: client.get_experiment(str(info["experiment_id"])), what="get_experiment")
    _warn(artifact_warnings(exp.artifact_location or "", nodes=nodes, cluster=cluster))


class ResourcesRefused(ValueError):
    """The sweep asks for resources the Ray cluster does not have and cannot get."""


#: the GPU share of one trial under ``resources.gpu: auto`` without max_concurrent_trials
AUTO_GPU_SHARE = 0.25


def resolve_gpu(requested, cluster_resources: Mapping[str, float], *, max_concurrent: int | None,
                can_autoscale: bool) -> float:
    """The GPUs per trial for ``resources.gpu`` once Ray is up (``ray.cluster_resources()``).

    ``auto``: 0 when the cluster reports no GPU; otherwise ``min(1, GPUs / max_concurrent_trials)``
    (floored to 1/100) when max_concurrent_trials is set, else ``AUTO_GPU_SHARE`` (four trials per
    GPU). A number: used as given, but refused (``ResourcesRefused``, one line naming the field) when
    the cluster has fewer GPUs than one trial needs, unless the cluster may autoscale (connected
    through RAY_ADDRESS: GPU workers can still join; Ray then waits for them).
    """
    gpus = float(cluster_resources.get("GPU", 0.0) or 0.0)
    if requested == "auto":
        if gpus <= 0:
            return 0.0
        if max_concurrent:
            return max(0.01, min(1.0, int(gpus / max_concurrent * 100) / 100))
        return AUTO_GPU_SHARE
    requested = float(requested)
    if requested > 0 and gpus < requested and not can_autoscale:
        have = "no GPU" if gpus <= 0 else f"{gpus:g} GPU(s)"
        raise ResourcesRefused(
            f"resources.gpu: {requested:g} GPU(s) per trial, but the Ray cluster has {have} "
            f"(ray.cluster_resources()); trials would wait forever; use resources.gpu: auto or 0")
    return requested


def trial_gpu(requested, max_concurrent: int | None) -> float:
    """``resolve_gpu`` against the running Ray instance (call after ``ray.init``)."""
    import ray

    return resolve_gpu(requested, ray.cluster_resources(), max_concurrent=max_concurrent,
                       can_autoscale=connected_to_cluster())
