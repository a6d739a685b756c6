"""Membership changes on a real local Ray: failures replaced from the warm pool, resizes, no restart."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from etrain.cli import main
from etrain.control.gather import find_lost
from etrain.core.optim import lr_factor
from etrain.core.records import JOIN_PHASES
from etrain.data.embedded import ensure_corpus
from etrain.driver import api
from etrain.driver.job import new_run_dir, train
from etrain.worker import spawn

from helpers.runs import FAMILIES, FAST, drawn, records, run, run_scaled

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def reference(make_cfg_module, module_family) -> Path:
    """The run without faults, of the module's model family (conftest.module_family): recovery holds for each."""
    return run(make_cfg_module, "reference", *FAMILIES[module_family[0]], "train.steps=60", "train.eval_every=60")


@pytest.mark.parametrize("kind", drawn(["kill", "hang", "kill_in_allreduce"], 1, "lost_worker"))
def test_lost_worker_is_replaced_and_the_step_redone(make_cfg, reference, kind, family):
    fault = "faults=[{rank: 1, step: 25, kind: " + kind + "}]"
    run_dir = run(make_cfg, f"fault-{kind}", *family, "train.steps=60", fault)
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 61))  # nothing lost, nothing repeated
    first, *later = records(run_dir, "membership")
    # Killed inside the all-reduce after sending its gradient, rank 1 may have given the survivor every share:
    # then the survivor's step 25 is whole, and committed (without a loss: rank 1's share of it never came back).
    committed = (24, 25) if kind == "kill_in_allreduce" else (24,)
    assert (first["reason"], first["world_before"], first["lost"]) == ("recover", 2, 1)
    assert first["step"] in committed
    assert set(first["phases"]) == {"detect", "acquire", "migrate", "reform", "first_step"}
    # A ready pool worker replaces the lost one at once; if none is ready yet, the survivor goes on
    # alone and the pool worker joins as soon as it is ready. Training never waits for a process start.
    regrow = [] if first["world_after"] == 2 else [("scale-out", 1, 2)]
    assert [(c["reason"], c["world_before"], c["world_after"]) for c in later] == regrow
    assert steps[-1]["world_size"] == 2
    # The failed step was discarded and redone by the new group: the trajectory is the uninterrupted one
    # (bitwise when the world size came back at once; a different world only reorders float sums).
    expected = {r["step"]: r["loss"] for r in records(reference, "train")}
    measured = {r["step"]: r["loss"] for r in steps if r.get("loss") is not None}
    assert len(measured) >= 59 and all(abs(loss - expected[step]) < 1e-3 for step, loss in measured.items())
    if not regrow:
        assert measured == {step: expected[step] for step in measured}


def test_a_step_sent_ahead_is_the_step_sent_after_and_a_failure_before_it_discards_it(make_cfg, reference, family):
    """The reference sends each step before its predecessor's reports are back (train.send_ahead, the default). A
    run that sends each after, with a worker lost at a step, rank and kind drawn from a seed, has the reference's
    losses bitwise (where its world came back at once): what a step sent ahead computes is what it would have, and
    the step sent ahead of a failed one is discarded and redone."""
    rng = random.Random(seed := random.randrange(2**32))
    step, rank, kind = rng.randrange(2, 59), rng.randrange(2), rng.choice(["kill", "kill_in_allreduce"])
    print(f"seed {seed}: {kind} of rank {rank} at step {step}")
    ahead = records(reference, "train")
    assert not ahead[0].get("sent_ahead") and sum(bool(r.get("sent_ahead")) for r in ahead) >= 50
    fault = f"faults=[{{rank: {rank}, step: {step}, kind: {kind}}}]"
    after = run(make_cfg, "sent-after", *family, "train.steps=60", "train.eval_every=60", "train.send_ahead=false")
    assert not any(r.get("sent_ahead") for r in records(after, "train"))
    assert [r["loss"] for r in records(after, "train")] == [r["loss"] for r in ahead]
    failed = run(make_cfg, "sent-ahead-lost", *family, "train.steps=60", "train.eval_every=60", fault)
    steps = records(failed, "train")
    assert [r["step"] for r in steps] == list(range(1, 61))
    [change, *_] = records(failed, "membership")
    assert change["reason"] == "recover" and change["step"] in (step - 1, step)
    expected = {r["step"]: r["loss"] for r in ahead}
    measured = {r["step"]: r["loss"] for r in steps if r.get("loss") is not None}
    back_at_once = all(r["world_size"] == 2 for r in steps)
    assert all(abs(loss - expected[n]) < 1e-3 for n, loss in measured.items())
    if back_at_once:
        assert measured == {n: expected[n] for n in measured}


def test_a_run_through_node_relays_replaces_a_lost_worker_and_stays_on_the_trajectory(make_cfg, reference, family, rng):
    """cluster.relay_from=2: each step reaches the members through their node's relay (etrain/control/relay.py),
    one call per node, and so do the recovery's pings and the group's re-forming. A worker lost at a step, rank and
    kind drawn from a seed: every step once, the reference's losses (bitwise where the world came back at once), the
    recovery the one a direct call's failure leads to."""
    step, rank, kind = rng.randrange(2, 59), rng.randrange(2), rng.choice(["kill", "kill_in_allreduce", "hang"])
    print(f"{kind} of rank {rank} at step {step}")
    fault = f"faults=[{{rank: {rank}, step: {step}, kind: {kind}}}]"
    run_dir = run(make_cfg, "relayed", *family, "train.steps=60", "train.eval_every=60", "cluster.relay_from=2", fault)
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 61))
    # a relayed step is sent once the one before is back (a survivor alone, while the pool starts, is not relayed)
    assert not any(r.get("sent_ahead") for r in steps if r["world_size"] >= 2)
    # the node cache's counts come in its relay's answers (the coordinator asks no relayed node's cache itself)
    # (a step the survivors of a loss in its all-reduce committed has no reports, and no counts)
    assert sum(r.get("fetched_shards", 0) for r in steps if r["world_size"] >= 2) >= 1
    [change, *_] = records(run_dir, "membership")
    assert (change["reason"], change["lost"]) == ("recover", 1)
    assert change["step"] in ((step - 1, step) if kind == "kill_in_allreduce" else (step - 1,))
    expected = {r["step"]: r["loss"] for r in records(reference, "train")}
    measured = {r["step"]: r["loss"] for r in steps if r.get("loss") is not None}
    assert len(measured) >= 59 and all(abs(loss - expected[n]) < 1e-3 for n, loss in measured.items())
    if all(r["world_size"] == 2 for r in steps):
        assert measured == {n: expected[n] for n in measured}


def test_autoscaling_grows_onto_free_room_with_linear_scaling(make_cfg):
    """The session's Ray has 4 CPUs: 2 workers and the pool worker leave room for one more."""
    cfg = make_cfg(
        *FAST, "run.name=autoscale", "train.steps=100", "cluster.max_workers=3", "train.batch_scaling=linear"
    )
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 101))
    changes = records(run_dir, "membership")
    assert [(c["reason"], c["world_before"], c["world_after"], c["joiners"]) for c in changes] == [
        ("scale-out", 2, 3, 1)
    ]
    assert records(run_dir, "autoscale")[0]["wanted"] == 3
    # The joiner's own start, chained up to the change: its process's creation + its phases + the change's phases
    # end at the change's first step, when the record is written.
    [change] = changes
    assert list(change["joined"]) == list(JOIN_PHASES) and min(change["joined"].values()) >= 0
    ended = change["joined_at"] + sum(change["joined"].values()) + change["total_s"]
    assert abs(ended - change["time"]) < 1.0
    assert steps[-1]["world_size"] == 3  # the policy never shrinks a job
    # Linear scaling: 8 samples per worker per step, and the learning rate grows by the same factor.
    assert all(r["batch"] == 8 * r["world_size"] for r in steps)
    assert steps[-1]["cursor"] == sum(r["batch"] for r in steps)
    base = {r["step"]: cfg.optim.lr * lr_factor(r["step"] - 1, cfg.optim, cfg.train.steps) for r in steps}
    assert all(r["lr"] == pytest.approx(base[r["step"]] * r["world_size"] / 2, rel=1e-6) for r in steps)


def test_scale_out_and_in_while_training_keeps_learning(make_cfg, reference, family):
    run_dir = run_scaled(
        make_cfg, "elastic", (3, 2), *family, "train.steps=60", "train.eval_every=60", "faults=[{rank: 0, step: 57}]"
    )
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 61))
    assert 3 in {r["world_size"] for r in steps} and steps[-1]["world_size"] == 2
    changes = {c["reason"]: c for c in records(run_dir, "membership")}
    assert sorted(changes) == ["recover", "scale-in", "scale-out"]
    assert changes["scale-out"]["joiners"] == 1  # from the warm pool: no process start in the join
    # Constant global batch: a different world size changes float reduction order only.
    expected = {r["step"]: r["loss"] for r in records(reference, "train")}
    assert all(abs(r["loss"] - expected[r["step"]]) < 1e-3 for r in steps if r.get("loss") is not None)
    # It learns what the fixed run learns: the same held-out loss at the end, up to the same float reordering.
    fixed, elastic = (records(d, "eval")[-1]["eval_loss"] for d in (reference, run_dir))
    assert elastic == pytest.approx(fixed, rel=1e-4)  # measured: equal to 6 decimals (2.342370)


def test_a_worker_lost_as_a_scale_out_begins_is_recovered(make_cfg):
    """The kill lands in the last step before the change or inside it (state copy, group exit,
    re-form: `1 worker(s) lost during a scale-out` in the log). Either way the job recovers and
    trains every step once. (A kill inside the re-form leaves a member waiting in the rendezvous
    for the dead one, unable to answer the liveness ping: it is replaced too, so 1 or 2 are lost.)"""
    cfg = make_cfg(*FAST, "run.name=race", "train.steps=60")
    run_dir = new_run_dir(cfg)

    def drive():
        while not records(run_dir, "train") or api.status(str(run_dir))["warm_pool_ready"] < 1:
            time.sleep(0.1)
        victim = api.status(str(run_dir))["members"][1]["pid"]
        api.scale(str(run_dir), 3)
        time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    train(cfg, run_dir, progress=False)
    thread.join(timeout=5)
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 61))
    recovered = [c for c in records(run_dir, "membership") if c["reason"] == "recover"]
    assert len(recovered) == 1 and recovered[0]["lost"] in (1, 2)


def test_scale_names_what_is_wrong(make_cfg, capsys):
    assert main(["scale", "no-such-run", "--workers", "2"]) == 2
    assert "no running job 'etrain:no-such-run'" in capsys.readouterr().err


def test_a_worker_waiting_in_the_rendezvous_for_a_dead_peer_is_released_not_lost(make_cfg):
    """A peer killed on its way to the rendezvous: the one waiting for it misses the ping (its only thread is in
    the wait), is released instead of taken for hung, and forms the next group at once, its state kept."""
    cfg = make_cfg(*FAST, "run.name=rendezvous", "timeouts.join_s=120")
    waiting, dead = spawn(cfg, ensure_corpus(cfg), 2)
    host, port = ray.get(waiting.host_store.remote())
    ray.kill(dead)
    join = waiting.join.remote(0, 2, host, port, 1)
    time.sleep(1)  # it is waiting now
    assert find_lost([waiting, dead], "process group formation", "a test", cfg.timeouts.ping_s, lambda lost: None) == [
        dead
    ]
    with pytest.raises(ray.exceptions.RayTaskError, match="released from the rendezvous"):
        ray.get(join, timeout=10)  # at once, not after timeouts.join_s
    ray.get(waiting.join.remote(0, 1, host, port, 2), timeout=30)  # a group of its own, at once
    assert ray.get(waiting.info.remote(), timeout=5)["pid"]
    ray.kill(waiting)
