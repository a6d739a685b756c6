"""A Ray head on this machine, with token authentication and (optionally) the real autoscaler on Ray's
fake multi-node provider: `etrain cluster up` / `etrain cluster down`, and the end-to-end tests.

`ray stop` kills every Ray process on the machine, other users' and other sessions' included, and a
SIGTERM to `ray start` leaves the GCS, the raylet and the autoscaler running. So the head runs in a
session (process group) of its own, with its own ports and a short temp directory of its own, and
is stopped by killing exactly its processes: its process group, and the fake nodes' processes,
known by its temp directory or GCS port.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from etrain.core.errors import Failure, UsageError
from etrain.core.ports import free_port

ROOT = Path(__file__).resolve().parents[2]  # the checkout: where a user runs commands (tests only)
FAKE_PROVIDER = Path(__file__).resolve().parent / "local_cluster.yaml"  # the fake multi-node autoscaler's config
STATE = Path.home() / ".cache" / "etrain" / "cluster.json"  # the head `etrain cluster up` started
# Ray's switch for a cluster on one machine (its default on macOS and Windows): every node's address is 127.0.0.1, so
# what binds to its node's address or to all (the GCS, the raylets, and the autoscaler's, the dashboard's and each
# node's Prometheus metrics, which take no token) listens on loopback alone
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass
class LocalCluster:
    workdir: str  # the head's log and autoscaler config
    temp_dir: str  # Ray's session files (short: Unix socket paths under it must stay within 107 bytes)
    port: int
    dashboard_port: int
    token: str
    head_cpus: int = 1
    fake: bool = True  # the autoscaler on the fake multi-node provider (local_cluster.yaml)
    pid: int = 0  # of `ray start --block`, leader of the head's process group
    reachable: bool = False  # listens on this machine's network address too, not on 127.0.0.1 alone

    @classmethod
    def new(cls, workdir: Path, head_cpus: int = 1, fake: bool = True, reachable: bool = False) -> LocalCluster:
        workdir.mkdir(parents=True, exist_ok=True)
        temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        ports = free_port(), free_port()
        return cls(str(workdir), temp, *ports, secrets.token_hex(32), head_cpus, fake, reachable=reachable)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def token_path(self) -> Path:
        return Path(self.workdir) / "auth_token"

    def env(self) -> dict[str, str]:
        """What a client of this cluster needs: `ray job submit`, `etrain status`, a driver. The token by its file
        (readable by its owner alone), never by value: these lines are printed, and terminals, CI logs and shared
        screens keep what is printed. On loopback alone, Ray's switch for a one-machine cluster too: without it a
        client rewrites 127.0.0.1 into the machine's network address, where nothing of this cluster listens."""
        return {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_API_SERVER_ADDRESS": self.dashboard,
        } | ({} if self.reachable else LOOPBACK)

    def start(self, timeout: float = 60) -> None:
        workdir = Path(self.workdir)
        self.token_path.touch(mode=0o600)
        self.token_path.chmod(0o600)
        self.token_path.write_text(self.token)
        bin_dir = Path(sys.executable).parent
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # not another Ray's settings
        env |= {
            "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            # the autoscaler's and the dashboard's Prometheus endpoints: ports of their own, not Ray's fixed ones
            "AUTOSCALER_METRIC_PORT": str(free_port()),
            "DASHBOARD_METRIC_PORT": str(free_port()),
        }
        env |= {} if self.reachable else LOOPBACK
        cmd = [
            str(bin_dir / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            f"--num-cpus={self.head_cpus}",
            f"--temp-dir={self.temp_dir}",
        ]
        cmd += [
            f"--dashboard-host={'0.0.0.0' if self.reachable else '127.0.0.1'}",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
        ]
        cmd += ["--node-manager-port=0", "--object-manager-port=0", "--min-worker-port=0", "--max-worker-port=0"]
        # Ports of their own: another Ray on this machine may hold the defaults (the job agent's 52365 above all).
        cmd += [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}"]
        cmd += [f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
        if self.fake:
            config = yaml.safe_load(FAKE_PROVIDER.read_text())
            config["provider"]["gcs_address"] = self.address
            (workdir / "cluster-fake.yaml").write_text(yaml.safe_dump(config))
            cmd.append(f"--autoscaling-config={workdir / 'cluster-fake.yaml'}")
            env |= {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        with open(workdir / "head.log", "wb") as log:
            head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = head.pid
        deadline = time.time() + timeout
        while not self._dashboard_up():
            if head.poll() is not None or time.time() > deadline:
                self.stop()
                raise Failure(
                    f"the Ray head did not start within {timeout:.0f} s: {(workdir / 'head.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)

    def _dashboard_up(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=1).close()
        except urllib.error.HTTPError:
            pass  # 401 without the token: up
        except OSError:
            return False
        return True

    def processes(self) -> list:
        """Every process of this cluster: the head's process group, and the fake nodes' (known by this
        cluster's temp directory or GCS port)."""
        import psutil

        marks = (self.temp_dir, f":{self.port}")
        found = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_ZOMBIE:  # dead, waiting for its parent to reap it
                    continue
                cmdline = " ".join(p.info["cmdline"] or [])
                if any(m in cmdline for m in marks) or (self.pid and os.getpgid(p.pid) == self.pid):
                    found.append(p)
            except (psutil.Error, ProcessLookupError):
                continue
        return found

    def stop(self) -> None:
        """Terminate this cluster's processes, kill what is left after 10 s (and what started meanwhile), remove its
        temp directory."""
        import psutil

        if self.pid:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for grace in (10, 5, 5):  # a raylet may start a worker while it is told to stop: look again
            procs = self.processes()
            if not procs:
                break
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.terminate()
            _, alive = psutil.wait_procs(procs, timeout=grace)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        if self.pid:
            with contextlib.suppress(ChildProcessError):  # `ray start` is this process's child when it started it here
                os.waitpid(self.pid, os.WNOHANG)
        self.pid = 0
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """A command against this cluster (ray job ..., etrain ..., python ...), as a user would type it."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | self.env() | {"PATH": path}
        done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise AssertionError(
                f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done


def exports(cluster: LocalCluster) -> str:
    return "export " + " ".join(f"{k}={v}" for k, v in cluster.env().items())


def up(head_cpus: int, fake: bool, reachable: bool = False) -> LocalCluster:
    """`etrain cluster up`: start a head and remember it (one at a time); on 127.0.0.1 alone unless `reachable`."""
    if STATE.is_file():
        running = LocalCluster(**json.loads(STATE.read_text()))
        if running.processes():
            raise UsageError(
                f"a cluster started by `etrain cluster up` is running at {running.address}; `etrain cluster down` first"
            )
    cluster = LocalCluster.new(STATE.parent / "cluster", head_cpus, fake, reachable)
    cluster.start()
    STATE.write_text(json.dumps(asdict(cluster)))
    STATE.chmod(0o600)  # it holds the token
    return cluster


def down() -> LocalCluster:
    """`etrain cluster down`: stop the head `etrain cluster up` started, and its fake nodes."""
    if not STATE.is_file():
        raise UsageError(
            "no cluster started by `etrain cluster up` is known here (nothing in ~/.cache/etrain/cluster.json)"
        )
    cluster = LocalCluster(**json.loads(STATE.read_text()))
    cluster.stop()
    STATE.unlink()
    return cluster


def current() -> LocalCluster:
    if not STATE.is_file():
        raise UsageError("no cluster started by `etrain cluster up` is known here; start one with `etrain cluster up`")
    return LocalCluster(**json.loads(STATE.read_text()))
