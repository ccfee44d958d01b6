"""Real servers for the server tests, on loopback: uvicorn in a thread of the test process,
or `specdec serve` in a subprocess (for signals and memory). Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn


@contextmanager
def serve_in_thread(app: Any, timeout: float = 20.0) -> Iterator[str]:
    """Run `app` with uvicorn on a free loopback port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m specdec.cli serve ...` with its log in a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not start: {self.log()[-3000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 10.0) -> float:
        """SIGTERM; returns the seconds it took to exit (raises if it did not within timeout)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def sse_chunks(lines: Iterator[str]) -> list[dict[str, Any] | str]:
    """The data of each server-sent event: parsed JSON, or the string "[DONE]"."""
    out: list[dict[str, Any] | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
