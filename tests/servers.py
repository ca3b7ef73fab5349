"""Small real servers for the serving tests: a redis-server on a free port, stoppable and restartable."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    """A port free on every interface, drawn from 20000-32767: above Ray's worker ports (10002-19999) and below the
    kernel's ephemeral range (32768+), from which Ray's own processes take theirs. A port the OS hands out for port 0
    can be taken by a starting Ray process before the service binds it (seen once: the gRPC proxy failed to bind)."""
    rng = random.SystemRandom()
    family, any_addr = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket(family) as s:  # "::" binds IPv4 too (dual stack): the port is free on both
            try:
                s.bind((any_addr, port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32767")


class RedisServer:
    """`redis-server` (Debian's package) in a temp dir, no persistence: a restart comes back empty."""

    def __init__(self, dir: Path, port: int | None = None):
        self.dir = Path(dir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server not installed (apt-get install -y redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
