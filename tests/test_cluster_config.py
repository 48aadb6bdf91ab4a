"""The shipped cluster configs pass Ray's own schema validation (offline), are safe by default,
and the storage / tracking checks of sweeps/cluster_checks.py decide correctly (docs/cluster.md)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from sweeps.cluster_checks import (
    NETWORK_FSTYPES,
    StorageRefused,
    artifact_warnings,
    check_storage,
    connected_to_cluster,
    mount_fstype,
    read_mounts,
    storage_is_shared,
    tracking_warnings,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("cluster.yaml", "cluster.local.yaml")


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def _ray_validate(config: dict) -> dict:
    """What `ray up` does before touching any machine: merge the provider's defaults, then the
    JSON-schema validation of ray/autoscaler/ray-schema.json."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _commands(config: dict, key: str) -> str:
    return "\n".join(config.get(key, []))


# --------------------------------------------------------------------------- Ray's schema


@pytest.mark.parametrize("name", CONFIGS)
def test_config_passes_ray_schema_validation(name):
    prepared = _ray_validate(_load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("path, typo", [(("setup_commands",), "setup_comands"), (("auth", "ssh_user"), "ssh_usr"),
                                        (("head_start_ray_commands",), "head_start_ray_command")])
def test_misspelled_key_is_rejected(name, path, typo):
    import jsonschema

    config = _load(name)
    where = config
    for key in path[:-1]:
        where = where[key]
    where[typo] = where.pop(path[-1])
    with pytest.raises(jsonschema.ValidationError, match=f"'{typo}' was unexpected"):
        _ray_validate(config)


def test_misspelled_nested_keys_of_the_aws_config_are_rejected():
    import jsonschema

    for path in (("available_node_types", "gpu_worker", "min_worker"), ("docker", "imag"),
                 ("provider", "security_group", "IpPermission")):
        config = _load("cluster.yaml")
        where = config
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = 1
        with pytest.raises(jsonschema.ValidationError, match=f"'{path[-1]}' was unexpected"):
            _ray_validate(config)


# --------------------------------------------------------------------------- what the configs promise


def test_aws_config_pins_ray_and_installs_the_project_with_the_constraints():
    config = _load("cluster.yaml")
    pins = dict(line.split("==") for line in (ROOT / "requirements/constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    image = config["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{pins['ray']}-py311") and image.endswith("-gpu")
    setup = _commands(config, "setup_commands")
    assert "pip install" in setup and "-c requirements/constraints.txt -e ." in setup
    assert config["file_mounts"]["/home/ray/dpsweep"] == "."
    workers = [t for k, t in config["available_node_types"].items() if k != config["head_node_type"]]
    assert workers and all(t["max_workers"] > t.get("min_workers", 0) for t in workers)  # autoscaling
    assert all(t["node_config"]["InstanceType"].startswith(("g", "p")) for t in workers)  # GPU instances


@pytest.mark.parametrize("name", CONFIGS)
def test_mlflow_server_and_dashboard_are_not_exposed(name):
    """The dashboard listens on 127.0.0.1; MLflow on the head's private address, with artifact
    proxying into shared storage and a backend off the container; nothing binds 0.0.0.0."""
    config = _load(name)
    head = _commands(config, "head_start_ray_commands")
    assert "--dashboard-host=127.0.0.1" in head
    assert "0.0.0.0" not in yaml.safe_dump(config)
    server = next(c for c in config["head_start_ray_commands"] if "mlflow server" in c)
    assert "--host $MLFLOW_HOST" in server and "--serve-artifacts" in server
    assert "--artifacts-destination $MLFLOW_ARTIFACTS_DESTINATION" in server
    assert "--backend-store-uri $MLFLOW_BACKEND_STORE_URI" in server
    env = _commands(config, "head_setup_commands")
    assert "MLFLOW_HOST=$HEAD_IP" in env and "get_node_ip_address" in env  # the private address
    assert "MLFLOW_ARTIFACTS_DESTINATION=/mnt/shared/" in env
    assert "MLFLOW_BACKEND_STORE_URI=sqlite:////mnt/shared/" in env
    assert "DPSWEEP_STORAGE=/mnt/shared/ray_results" in env
    assert "--num-cpus=0" in head  # the head schedules; workers train


def test_aws_security_group_opens_no_extra_port():
    """provider.security_group adds no IpPermissions: Ray's own group allows SSH and traffic
    within the group only (docs/cluster.md shows how to narrow SSH to one CIDR)."""
    sg = _load("cluster.yaml")["provider"]["security_group"]
    assert sg.get("GroupName") and not sg.get("IpPermissions")


def test_aws_shared_storage_is_mounted_on_every_node():
    config = _load("cluster.yaml")
    init = _commands(config, "initialization_commands")
    assert re.search(r"mount -t nfs4 .*\.efs\..*:/ /mnt/shared", init)
    assert "-v /mnt/shared:/mnt/shared" in config["docker"]["run_options"]


# --------------------------------------------------------------------------- the storage checks

MOUNTS = """\
overlay / overlay rw,relatime 0 0
/dev/nvme0n1p1 /home ext4 rw 0 0
fs-1.efs.us-west-2.amazonaws.com:/ /mnt/shared nfs4 rw,vers=4.1 0 0
10.0.0.5:/export /mnt/with\\040space nfs rw 0 0
/dev/nvme1n1 /mnt/shared/local-cache xfs rw 0 0
"""


def test_mount_table_decides_which_paths_are_shared(tmp_path):
    mounts = read_mounts(MOUNTS)
    assert ("/mnt/with space", "nfs") in mounts  # octal escapes of /proc/mounts
    assert mount_fstype("/mnt/shared/ray_results/not-yet-created", mounts) == "nfs4"
    assert mount_fstype("/mnt/shared/local-cache/x", mounts) == "xfs"  # the deeper mount wins
    assert mount_fstype("/home/ubuntu/ray_results", mounts) == "ext4"
    assert mount_fstype("/mnt/with space/r", mounts) == "nfs"
    assert {"nfs", "nfs4", "cifs", "lustre"} <= NETWORK_FSTYPES
    assert mount_fstype(str(tmp_path)) is not None  # the real /proc/mounts


@pytest.mark.parametrize("storage, env, shared", [
    ("s3://bucket/ray_results", {}, True),
    ("gs://bucket/ray_results", {}, True),
    ("abfs://container/ray_results", {}, True),
    ("/mnt/shared/ray_results", {}, True),
    ("/mnt/shared/local-cache/ray_results", {}, False),
    ("/home/ubuntu/ray_results", {}, False),
    ("file:///home/ubuntu/ray_results", {}, False),
    ("/home/ubuntu/ray_results", {"DPSWEEP_SHARED_STORAGE": "1"}, True),
    ("/home/ubuntu/ray_results", {"DPSWEEP_SHARED_STORAGE": "0"}, False),
])
def test_storage_is_shared(storage, env, shared):
    assert storage_is_shared(storage, env, read_mounts(MOUNTS))[0] is shared


def test_node_local_storage_is_refused_only_on_a_cluster():
    mounts = read_mounts(MOUNTS)
    check_storage("/home/ubuntu/ray_results", nodes=1, cluster=False, env={}, mounts=mounts)  # one machine: fine
    with pytest.raises(StorageRefused, match=r"^storage: /home/ubuntu/ray_results is on this node's local disk "
                                             r"\(ext4\) but the sweep runs on a Ray cluster of 3 nodes"):
        check_storage("/home/ubuntu/ray_results", nodes=3, cluster=False, env={}, mounts=mounts)
    with pytest.raises(StorageRefused, match="RAY_ADDRESS is set"):  # an autoscaling cluster, head only so far
        check_storage("/home/ubuntu/ray_results", nodes=1, cluster=True, env={}, mounts=mounts)
    check_storage("/mnt/shared/ray_results", nodes=3, cluster=True, env={}, mounts=mounts)
    check_storage("s3://b/r", nodes=3, cluster=True, env={}, mounts=mounts)
    try:
        check_storage("/home/ubuntu/ray_results", nodes=3, cluster=True, env={}, mounts=mounts)
    except StorageRefused as exc:
        assert "\n" not in str(exc)


def test_ray_address_means_a_cluster():
    assert connected_to_cluster({"RAY_ADDRESS": "10.0.0.10:6379"})
    assert connected_to_cluster({"RAY_ADDRESS": "auto"})
    assert not connected_to_cluster({"RAY_ADDRESS": "local"})
    assert not connected_to_cluster({})


def test_tracking_and_artifact_warnings():
    for uri in ("sqlite:////home/u/mlflow.db", "/home/u/mlruns", "file:///home/u/mlruns"):
        assert tracking_warnings(uri, nodes=2, cluster=False), uri
        assert not tracking_warnings(uri, nodes=1, cluster=False), uri
    assert not tracking_warnings("http://10.0.0.10:5000", nodes=4, cluster=True)
    assert not tracking_warnings("databricks", nodes=4, cluster=True)  # a remote store without "://"
    assert not artifact_warnings("mlflow-artifacts:/1", nodes=2, cluster=True)
    assert not artifact_warnings("s3://bucket/mlflow/1", nodes=2, cluster=True)
    assert artifact_warnings("/home/u/mlartifacts/1", nodes=2, cluster=True)
    assert artifact_warnings("file:///home/u/mlruns/1", nodes=2, cluster=True)
    assert not artifact_warnings("/home/u/mlartifacts/1", nodes=1, cluster=False)


def test_storage_precedence(monkeypatch):
    """--storage, then DPSWEEP_STORAGE (set on the cluster's head), then the spec's."""
    from sweeps.cli import _storage_path

    monkeypatch.setenv("DPSWEEP_STORAGE", "s3://bucket/ray_results")
    assert _storage_path(None, "./ray_results") == "s3://bucket/ray_results"
    assert _storage_path("/mnt/x", "./ray_results") == "/mnt/x"
    monkeypatch.delenv("DPSWEEP_STORAGE")
    assert _storage_path(None, "s3://b/r") == "s3://b/r"
