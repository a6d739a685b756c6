"""One way to reach Ray, bounded in time: a dead address or a refused token fails within
`timeouts.connect_s`, with a line that says which.

`ray.init` alone retries a dead GCS for about 14 minutes (20 tries of ~41 s, measured on
Ray 2.60), and reports a refused token as a failed connection after 20 s. So the address is
resolved as Ray resolves it (RAY_ADDRESS, the running GCS, the last `ray start`), then
probed: a TCP connect, then a handshake with the GCS under a deadline, through Ray's own GCS
client (a private API: the only one that takes a deadline and names an authentication
failure as such). Only an address that answered goes to `ray.init`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

import ray

from etrain.core.config import ConfigError

NAMESPACE = "etrain"
RAY_LOG = logging.getLogger("etrain.ray")  # Ray's messages about the job's workers: the log file, not the terminal
RAY_LOG.propagate = False  # only to the handlers given to it (etrain train: RUN/driver.log)
RAY_LOG.setLevel(logging.INFO)
TOKEN_HELP = (
    "this cluster uses token authentication: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, "
    "or the token file ~/.ray/auth_token) to the head node's token (`ray get-auth-token` on the head prints it)"
)


def connect(address: str | None, timeout_s: float, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` ("auto": the one running here), or start a local instance when
    `address` is None. The driver's own log lines only: workers log to Ray's session directory."""
    if ray.is_initialized():
        return
    if address is None:
        # "local": a new instance even when a stale ray_current_cluster names a dead one.
        ray.init(
            address="local", num_cpus=num_cpus, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False
        )
    else:
        if not address.startswith("ray://"):  # Ray Client: its own connection with its own timeout
            address = probe(address, timeout_s)
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
        except ConnectionError as e:
            raise ConfigError(f"could not join the Ray cluster at {address}: {e}") from None
    _route_worker_deaths()


def _route_worker_deaths() -> None:
    """Ray prints a paragraph to the driver's stdout for every worker of the job that dies ("A worker died or
    was killed ..."). A lost worker is what this application recovers from, and the coordinator reports it
    in one line; the paragraph goes to the log (`etrain.ray`, in RUN/driver.log under `etrain train`)."""
    import ray._private.worker as ray_worker

    printed = ray_worker.print_to_stdstream
    if getattr(printed, "routed", False):
        return

    def route(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            RAY_LOG.info("%s", " ".join(data.get("lines", [])))
        else:
            printed(data, ignore_prefix)

    route.routed = True
    ray_worker.print_to_stdstream = route


def probe(address: str, timeout_s: float) -> str:
    """The cluster's GCS address (host:port) once it answered within `timeout_s`; ConfigError naming why not."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        target = canonicalize_bootstrap_address(address)
    except ConnectionError:  # "auto", and nothing found
        target = None
    if target is None:
        raise ConfigError(
            "no Ray cluster is running here (no RAY_ADDRESS, no `ray start` on this machine); run this where "
            "the job runs (the head node), or set RAY_ADDRESS to its head (host:6379)"
        )
    host, port = target.rsplit(":", 1)
    _token_mode_if_token()
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout_s, 5)).close()
    except OSError as e:
        raise ConfigError(
            f"no Ray cluster at {target} ({e.strerror or e}); its head is not running (a run that ended "
            f"takes its local Ray with it), or set RAY_ADDRESS / cluster.address to the head's host:port"
        ) from None
    try:
        with _quiet_stderr():  # Ray's C++ client logs a refusal itself; the ConfigError below says it in one line
            client = ray._raylet.InnerGcsClient.standalone(target, None, int(timeout_s * 1000))
            client.internal_kv_get(b"session_name", b"session", timeout=timeout_s)
    except ray.exceptions.AuthenticationError:
        raise ConfigError(f"the Ray cluster at {target} refused this client's token: {TOKEN_HELP}") from None
    except ray.exceptions.RpcError:
        raise ConfigError(
            f"{target} accepts connections but no Ray GCS answered within {timeout_s:.0f} s (timeouts.connect_s): not "
            "a Ray head, or one that is hung"
        ) from None
    return target


def _token_mode_if_token() -> None:
    """Token authentication for this client when RAY_AUTH_MODE is unset and a token is at hand (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token): a run started here by `etrain train` has token auth on (Ray's default
    for a new local cluster) and its token in ~/.ray/auth_token, and `etrain scale` or `status` must reach it as
    it is. As Ray's own ray.init does for a cluster it starts; a cluster without token auth ignores the token."""
    from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR, _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader

    if os.environ.get(AUTH_MODE_ENV_VAR) is None and AuthenticationTokenLoader.instance().has_token(
        ignore_auth_mode=True
    ):
        _enable_token_auth()


@contextlib.contextmanager
def _quiet_stderr():
    """The process's own stderr (file descriptor 2, where C++ writes) discarded for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
