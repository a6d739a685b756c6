"""A Ray head with the real autoscaler on Ray's fake multi-node provider, for end-to-end tests.

It runs beside the test session's own Ray instance, on its own ports and temp
directory, with token authentication on. It is stopped by killing exactly the
processes it started (never `ray stop`, which would take every Ray on the machine).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeCluster:
    def __init__(self, workdir: Path, head_cpus: int = 1):
        self.workdir, self.head_cpus = workdir, head_cpus
        # Ray's session files, short (Unix socket paths under it must stay within 107 bytes); also how
        # this cluster's processes are told apart from the test session's own Ray.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # `etrain` for jobs
        mine = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # none of the session Ray's
        self.env = {**mine, "PATH": path, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.head: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        config = yaml.safe_load((ROOT / "cluster-fake.yaml").read_text())
        config["provider"]["gcs_address"] = self.address
        config_path = self.workdir / "cluster-fake.yaml"
        config_path.write_text(yaml.safe_dump(config))
        env = {**self.env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        cmd = [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            f"--num-cpus={self.head_cpus}",
            f"--temp-dir={self.temp_dir}",
            f"--autoscaling-config={config_path}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            "--node-manager-port=0",
            "--object-manager-port=0",
            "--min-worker-port=0",
            "--max-worker-port=0",
            # Ports of their own: the session's Ray holds the defaults (the job agent's 52365 above all).
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        self.log = open(self.workdir / "head.log", "wb")
        self.head = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_up(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_up(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.head.poll() is not None:
                raise RuntimeError(f"ray start failed: {(self.workdir / 'head.log').read_text()[-2000:]}")
            if self._dashboard_up():
                return
            time.sleep(0.5)
        raise RuntimeError(f"fake cluster head not up within {timeout} s")

    def _dashboard_up(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=1).close()
        except urllib.error.HTTPError:
            pass  # 401 without the token: up
        except OSError:
            return False
        return True

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: the head's process group and the fake nodes' raylets
        (started by the autoscaler), recognised by this cluster's temp dir or GCS port."""
        marks = (str(self.temp_dir), f":{self.port}")
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmdline = " ".join(p.info["cmdline"] or [])
                if any(m in cmdline for m in marks) or (self.head and os.getpgid(p.pid) == self.head.pid):
                    found.append(p)
            except (psutil.Error, ProcessLookupError):
                continue
        return found

    def stop(self) -> None:
        if self.head is None:
            return
        try:
            os.killpg(self.head.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive + self.processes():
            try:
                p.kill()
            except psutil.Error:
                pass
        self.head = None
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """A command against this cluster (ray job ..., etrain ..., python ...), as a user would type it."""
        env = {**self.env, "RAY_ADDRESS": self.address, "RAY_API_SERVER_ADDRESS": self.dashboard}
        done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done
