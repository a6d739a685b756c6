"""bench/scale.py's sessions on the shared Ray: the real coordinator over fake workers must still train every step
once, replace a lost member, grow by a node and commit a save of N parts, or its figures measure nothing."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scale():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n, extra", [(8, ()), (64, ()), (64, ("cluster.relay_from=0",))], ids=["8", "64", "64-direct"])
def test_a_session_commits_every_step_replaces_the_lost_member_and_grows_by_a_node(ray_session, scale, n, extra):
    """At 64 a step goes through the nodes' relays (the default from 64 members), or to each member itself."""
    steps = 3
    result = scale.run_session(n, scale.Fleet(inline=False), steps=steps, extra=extra)  # what it does, not its times
    facts = result.pop("facts")
    relayed = scale.relayed(n) and not extra  # a relay per node that carried a member: 8 each, the joiners' nodes
    assert facts["relays"] >= n // scale.NODE if relayed else facts["relays"] == 0
    saved = scale.WARM + steps  # the save after the measured steps; rank n/2 killed in the step after it
    # every step committed once: the killed one redone (not committed twice), one sent ahead before the node's join
    # came (not when relayed: a relayed step is not sent ahead), the first one after it
    last = saved + (2 if relayed else 3)
    assert facts["steps"] == list(range(1, last + 1)), facts
    assert facts["states"] == ["running"] * steps
    assert facts["changes"] == [("recover", n, n, 1), ("scale-out", n, n + scale.NODE, 0)]
    assert facts["recoveries"] == 1 and facts["world"] == n + scale.NODE
    # the cursor is exact: 4 samples a worker at the start's size, whatever the size after it
    assert facts["cursor"] == facts["batches"] == facts["last_cursor"] == last * 4 * n
    assert facts["checkpoints"] == [(saved, "full")] and facts["parts"] == n
    # each scenario's own time, and the part of it in Ray's get and wait
    assert set(result) == {*scale.SCENARIOS, *(f"{k}_ray" for k in scale.SCENARIOS)}, result
    assert all(0 < result[f"{k}_ray"] <= result[k] for k in scale.SCENARIOS), result


def test_the_fakes_are_gone_from_the_process_after_a_session(ray_session, scale):
    """The redirections end with the session: a real spawn, ray.kill and the caches' start come back."""
    import ray

    import etrain.worker
    from etrain.control.data_plane import DataPlane
    from etrain.control.relay import Relays

    scale.run_session(8, scale.Fleet(inline=False), steps=1)
    assert "spawn" not in vars(etrain.worker) and ray.kill.__module__ == "ray._private.worker"
    assert ray.get is scale.REAL_GET and ray.wait is scale.REAL_WAIT
    assert DataPlane.start_caches.__module__ == "etrain.control.data_plane"
    assert Relays._start.__module__ == "etrain.control.relay"
