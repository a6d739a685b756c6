"""Telemetry of one node, read when the coordinator asks (every `health.every_s`): its sources' readings
(etrain/core/telemetry_sources.py). One actor per node with workers, pinned there, holding no CPU."""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from etrain.core.health import Reading
from etrain.core.telemetry_sources import SOURCES

logger = logging.getLogger(__name__)


class Telemetry:
    def __init__(self, sources: list[str]):
        self.node = ray.get_runtime_context().get_node_id()
        self.sources = [SOURCES[name]() for name in sources]

    def read(self) -> list[Reading]:
        readings = []
        for source in self.sources:
            try:
                if (r := source.read(self.node)) is not None:
                    readings.append(r)
            except Exception as e:  # a source failing is not a node failing: it is logged and skipped
                logger.warning("telemetry source %s failed on node %s: %s", source.name, self.node, e)
        return readings


REMOTE = ray.remote(Telemetry)  # one class, exported once (relay.py's REMOTE)


def start(node: str, sources: list[str]):
    """The node's telemetry actor; Ray restarts it if it dies (it holds nothing)."""
    here = NodeAffinitySchedulingStrategy(node, soft=False)
    return REMOTE.options(num_cpus=0, max_restarts=-1, scheduling_strategy=here).remote(sources)
