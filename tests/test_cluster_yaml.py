from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = Path(__file__).resolve().parent.parent / "cluster.yaml"


def test_cluster_yaml_passes_rays_schema():
    config = yaml.safe_load(CLUSTER.read_text())
    validate_config(prepare_config(config))  # what `ray up` does first; raises on any schema violation
    assert config["head_node_type"] in config["available_node_types"]


def test_cluster_keeps_token_auth_and_ships_no_secret():
    text = CLUSTER.read_text()
    config = yaml.safe_load(text)
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in cmd for cmd in starts if "ray start" in cmd)
    assert "RAY_AUTH_TOKEN=" not in text


def test_schema_check_is_real():
    import pytest

    config = yaml.safe_load(CLUSTER.read_text())
    config["max_workerz"] = 3
    with pytest.raises(Exception, match="max_workerz"):
        validate_config(prepare_config(config))


def test_cluster_keeps_the_warm_pool_on_running_nodes():
    """One GPU worker per node: min_workers holds the job and its pool, max_workers its autoscaling room."""
    from etrain.core.config import load_config

    nodes = yaml.safe_load(CLUSTER.read_text())["available_node_types"]
    cfg = load_config("gpu-125m").cluster
    assert nodes["gpu_worker"]["min_workers"] == cfg.num_workers + cfg.warm_pool
    assert nodes["gpu_worker"]["max_workers"] == cfg.max_workers + cfg.warm_pool
    assert nodes["head"]["resources"] == {"CPU": 0}  # no training worker on the head
