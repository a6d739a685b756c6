"""One way to wait for workers, with one error policy: every answer, or the workers lost, named.

A wait ends at the first failure or at its deadline. Then every worker asked is pinged
(`timeouts.ping_s`): the dead and the silent are stopped and raised as WorkersLost, so the
caller can replace them (one silent because it waits in a rendezvous for a peer that is gone is
released instead, and kept); if all answer, the failure is on live workers, which no
replacement would mend, and a JobError says so. A worker whose constructor failed is a
JobError too: a replacement built from the same config would fail the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from etrain.control.control import JobError
from etrain.core.errors import Failure, why


class WorkersLost(Exception):
    """Workers died or hung while `what` ran. `lost` are stopped already; `finished[i]` tells whether the
    i-th ref of the wait had returned (a step whose survivors all finished is complete); `cause`: what ended the
    wait (a worker's error, or the timeout, named)."""

    def __init__(self, what: str, lost: list, finished: list[bool], cause: str = ""):
        super().__init__(f"{len(lost)} worker(s) lost during {what}" + (f" ({cause})" if cause else ""))
        self.what, self.lost, self.finished, self.cause = what, lost, finished, cause
        self.since = time.perf_counter()


def gather(
    refs: list,
    among: list,
    what: str,
    timeout: float,
    ping_s: float,
    retire: Callable[[list], None],
    queued: list = (),
    queued_s: float = 0.0,
    timeout_name: str = "",
    stop: Callable[[], None] | None = None,
    spans: list[list[int]] | None = None,
    pings: Callable[[list, float], tuple[list, list]] | None = None,
) -> list:
    """The results of `refs`, in order. `among` are the workers answerable for them (pinged on a failure). `queued`:
    calls made to them after these (a step sent ahead, control/step.py), which a worker ends before it can answer a
    ping: on a failure they are waited for, up to `queued_s`, so that a survivor busy in one is not taken for hung.
    `timeout_name`: the config key `timeout` comes from, named when it runs out. `stop`: called at the first failure,
    before the pings, to end the work the others still do for a call that can no longer succeed (a step: a ping
    waits for it, and a recovery with it). `spans`: `refs` are node relays' (relay.py), `spans[i]` the ranks in
    `among` the i-th answers for; the results are then the members', in rank order, and a relay's answer that
    names a member's failure fails the wait as that member's own answer would. `pings`: how the workers are pinged
    (`ping`'s signature; through their relays, relay.py)."""
    results, pending, failed = {}, list(refs), None
    deadline = time.perf_counter() + timeout
    while pending and failed is None and time.perf_counter() < deadline:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.perf_counter()))
        if done and pending:  # the answers already back too, in one wait: a wait per answer over all still pending
            # costs O(N²) for N workers (0.9 s for 1,024 here: bench/scale.py)
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            done += more
        values, bad, error = to_first_failure(done)
        for ref in done:  # in the order asked, to the first failure: what a wait per answer read
            if ref == bad:
                failed = error
                if isinstance(failed, ray.exceptions.RayActorError) and failed.actor_init_failed:
                    raise JobError(could_not_start(failed)) from None
                break
            results[ref] = values[ref]
            if spans is not None and (failed := _relayed_failure(values[ref])) is not None:
                break
    if failed is None and not pending:
        return [results[r] for r in refs] if spans is None else _by_rank(refs, spans, results, "results", None)
    named = f"{timeout_name}=" if timeout_name else ""
    cause = getattr(failed, "cause", failed) if failed is not None else f"no answer within {named}{timeout:g} s"
    details = "\n".join(filter(None, [str(failed) if failed is not None else None, getattr(cause, "details", None)]))
    if isinstance(cause, Failure):  # named by the work itself (a reward that fails): its peers may be waiting in a
        # collective for it and miss the ping; none of them is lost, and no replacement would do better
        raise JobError(str(cause), details) from None
    if stop is not None and failed is not None:
        stop()
    if queued:
        ray.wait(list(queued), num_returns=len(queued), timeout=queued_s)
    lost = find_lost(among, what, cause, ping_s, retire, details or None, pings)
    said = why(cause) if isinstance(cause, BaseException) else str(cause)
    finished = [r in results for r in refs] if spans is None else _by_rank(refs, spans, results, "back", False)
    raise WorkersLost(what, lost, finished, said)


def to_first_failure(refs: list) -> tuple[dict, object, BaseException | None]:
    """The values of `refs` (all back) by ref, in the order asked up to the first that failed, and that one's ref
    and error: one get for all, split in halves around a failure (a get per answer cost the coordinator 151 ms of
    a step at 1,024 workers, one get for them all 109: bench/scale.py; when a member is lost in the all-reduce,
    every answer is a failure, and the first is found in log2(N) gets)."""
    try:
        return dict(zip(refs, ray.get(refs))), None, None
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        if len(refs) == 1:
            return {}, refs[0], e
    half = len(refs) // 2
    values, bad, error = to_first_failure(refs[:half])
    if error is not None:
        return values, bad, error
    more, bad, error = to_first_failure(refs[half:])
    return values | more, bad, error


def values_of(refs: list) -> tuple[dict, set]:
    """The values of `refs` (all back) by ref, and the refs whose actor is dead (any other error is raised): in one
    get, split in halves around a dead one (a few among many: a recovery's pings, where a get per ping cost 1,024
    gets at 1,024 workers)."""
    try:
        return dict(zip(refs, ray.get(refs))), set()
    except ray.exceptions.RayActorError:
        if len(refs) == 1:
            return {}, set(refs)
    half = len(refs) // 2
    (values, dead), (more, more_dead) = values_of(refs[:half]), values_of(refs[half:])
    return values | more, dead | more_dead


def _relayed_failure(answer):
    """The member's failure a relay's answer names, or None."""
    if isinstance(answer.error, ray.exceptions.RayActorError) and answer.error.actor_init_failed:
        raise JobError(could_not_start(answer.error)) from None
    return answer.error


def _by_rank(refs: list, spans: list[list[int]], results: dict, part: str, missing) -> list:
    """The relays' answers' `part` (their members' results, or whether each was back) in rank order; `missing`
    for the members of a relay that had not answered."""
    out = [missing] * sum(len(s) for s in spans)
    for ref, span in zip(refs, spans):
        if ref in results:
            for rank, value in zip(span, getattr(results[ref], part)):
                out[rank] = value
    return out


def find_lost(
    workers: list,
    what: str,
    cause,
    ping_s: float,
    retire: Callable[[list], None],
    details: str | None = None,
    pings: Callable[[list, float], tuple[list, list]] | None = None,
) -> list:
    """The workers that are dead or do not answer a ping within `ping_s` (`pings`: `ping`, or a relayed one),
    stopped (a hung one would block the next group too). None of them means `what` failed on live workers: a
    JobError saying `cause`, with `details` (the worker's traceback) for the driver's log."""
    dead, silent = (pings or ping)(workers, ping_s)
    dead, silent = set(dead), set(silent)
    # busy: hung, or waiting in a rendezvous for a peer that is gone
    lost = [w for w in workers if w in dead or (w in silent and not released(w, ping_s))]
    retire(lost)
    if not lost:
        raise JobError(
            f"{what} failed on live workers, which no replacement mends: {cause}; the worker's traceback is in the "
            "driver's log",
            details,
        )
    return lost


def ping(workers: list, ping_s: float) -> tuple[list, list]:
    """The dead among `workers` (a ping answered with its death), and the silent (no answer within `ping_s`)."""
    pings = {w: w.info.remote() for w in workers}
    back, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=ping_s)  # all at once: a get per
    # ping cost a recovery 1,024 gets at 1,024 workers, and a ping_s each for the silent
    _, dead = values_of(back)
    back = set(back)
    return [w for w, ref in pings.items() if ref in dead], [w for w, ref in pings.items() if ref not in back]


def released(worker, ping_s: float) -> bool:
    """Whether `worker` was waiting for its peers to meet, and is now let go (etrain/worker/actor.py `release`)."""
    try:
        return ray.get(worker.release.remote(), timeout=ping_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def could_not_start(error: ray.exceptions.RayActorError) -> str:
    """A worker's constructor failed: its own exception, and what to do about it."""
    said = why(error)
    if any(m in said.lower() for m in ("allocate", "out of memory", "outofmemory")):
        return (
            f"a worker could not start: {said}; the model does not fit a worker's memory: lower model.d_model, "
            f"model.n_layer or train.micro_batch (`etrain config` prints the estimate), or use larger nodes"
        )
    return f"a worker could not start: {said}; fix the cause, then start the job again"
