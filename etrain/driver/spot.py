"""Spot interruption notices become Ray drain requests, so a running job moves off the node in time.

AWS gives a spot instance two minutes' notice through its instance metadata
(`spot/instance-action`). Ray's autoscaler v1 does not watch it; this does, on
each worker node (`cluster.yaml` starts it next to the raylet), and drains its
own node with reason PREEMPTION and the notice's deadline. The coordinator sees
draining nodes at its next step boundary and moves the workers off
(etrain/control/coordinator.py).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from datetime import datetime

logger = logging.getLogger(__name__)

IMDS = "http://169.254.169.254"


def interruption(imds: str, timeout: float = 2.0) -> dict | None:
    """The pending spot interruption ({"action": ..., "time": ...}), or None. IMDSv2: token first."""
    token_req = urllib.request.Request(
        f"{imds}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    with urllib.request.urlopen(token_req, timeout=timeout) as r:
        token = r.read().decode()
    req = urllib.request.Request(
        f"{imds}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:  # no interruption scheduled
            return None
        raise


def drain(node_id: str, notice: dict) -> None:
    """Ask the GCS to drain `node_id` by the notice's deadline (what `ray drain-node` does)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline = datetime.fromisoformat(notice["time"].replace("Z", "+00:00")).timestamp()
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        f"spot interruption: {notice.get('action', 'terminate')} at {notice['time']}",
        int(deadline * 1000),
    )
    if not accepted:
        raise RuntimeError(f"drain of node {node_id} refused: {why}")


def watch(imds: str = IMDS, node_id: str | None = None, every: float = 5.0) -> dict:
    """Poll until a notice comes, drain this node, return the notice. Metadata errors are retried."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", logging_level=logging.WARNING)
    node_id = node_id or ray.get_runtime_context().get_node_id()  # a driver on this node: this node's id
    while True:
        try:
            notice = interruption(imds)
        except OSError as e:
            logger.warning("instance metadata unreachable (%s); retrying in %.0f s", e, every)
            notice = None
        if notice:
            drain(node_id, notice)
            logger.warning("spot interruption for node %s at %s: drain requested", node_id, notice["time"])
            return notice
        time.sleep(every)
