"""Storage fault injection for tests: paths that refuse writes, and an S3 endpoint that fails on demand.

`S3Faults` is a small HTTP proxy in front of the session's moto server. The session's
AWS_ENDPOINT_URL points at it, so every process of the test session (the Ray workers
and the coordinator included) talks to S3 through it. By default it passes everything
through; a test can take it down (connections closed at once, as an endpoint that
has gone away) or make requests whose method and key match fail with an S3 error
(403 AccessDenied by default: s3fs raises PermissionError, as a read-only bucket does).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import stat
import subprocess
import threading
from pathlib import Path
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


class S3Faults:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream).netloc
        self.down = False
        self.rules: list[tuple[str, re.Pattern, int]] = []
        self.failed: list[str] = []  # "METHOD path" of every request made to fail
        self.served: list[tuple[str, str, int]] = []  # (method, path, bytes of the answer) of every request passed
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                proxy._forward(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

            def log_message(self, *args):
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, name="s3-faults", daemon=True).start()

    def fail(self, method: str, key: str, status: int = 403) -> None:
        """Requests with `method` whose path matches the regex `key` answer `status`."""
        with self._lock:
            self.rules.append((method, re.compile(key), status))

    def reset(self) -> None:
        with self._lock:
            self.down, self.rules, self.failed, self.served = False, [], [], []

    @contextlib.contextmanager
    def outage(self):
        """The endpoint is gone for the duration: every connection is closed unanswered."""
        self.down = True
        try:
            yield
        finally:
            self.down = False

    def close(self) -> None:
        self.server.shutdown()

    def _forward(self, request: http.server.BaseHTTPRequestHandler) -> None:
        body = _read_body(request)
        if self.down:  # no answer: the client sees its connection closed
            request.close_connection = True
            return
        status = self._rule(request.command, request.path)
        if status is not None:
            return _error(request, status)
        upstream = http.client.HTTPConnection(self.upstream, timeout=60)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        upstream.request(request.command, request.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        with self._lock:
            self.served.append((request.command, request.path, len(data)))
        request.send_response(response.status, response.reason)
        head = request.command == "HEAD"  # its Content-Length is the object's size: passed through
        for k, v in response.getheaders():
            if k.lower() not in HOP and (head or k.lower() != "content-length"):
                request.send_header(k, v)
        if not head:
            request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if not head:
            request.wfile.write(data)
        upstream.close()

    def _rule(self, method: str, path: str) -> int | None:
        with self._lock:
            for m, key, status in self.rules:
                if m == method and key.search(path):
                    self.failed.append(f"{method} {path}")
                    return status
        return None


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up (a killed worker, an outage): nothing to report


def _read_body(request) -> bytes | None:
    if request.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while (size := int(request.rfile.readline().split(b";")[0], 16)) > 0:
            chunks.append(request.rfile.read(size))
            request.rfile.readline()
        while request.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(chunks)
    length = int(request.headers.get("Content-Length") or 0)
    return request.rfile.read(length) if length else (b"" if request.command in ("PUT", "POST") else None)


def _error(request, status: int) -> None:
    code = {403: "AccessDenied", 500: "InternalError", 503: "SlowDown"}.get(status, "InternalError")
    message = "<Message>injected by tests/helpers/faults.py</Message>"
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>{message}</Error>'.encode()
    request.send_response(status)
    request.send_header("Content-Type", "application/xml")
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    if request.command != "HEAD":
        request.wfile.write(body)


@contextlib.contextmanager
def immutable(path: Path):
    """`path` (a file or directory) refuses changes: nothing in a directory can be created, removed or
    renamed. root ignores permission bits, so as root the inode is made immutable (chattr +i)."""
    path = Path(path)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        try:
            yield path
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        return
    mode = path.stat().st_mode
    path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield path
    finally:
        path.chmod(mode)
