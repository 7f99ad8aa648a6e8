"""Loopback ports for the servers tests and benchmarks start (every one binds to 127.0.0.1)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A port nothing listens on now. The socket is closed before returning, so another process may take
    it first; the servers started here bind it within milliseconds, which has been enough."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_listening(port: int, timeout_s: float, alive: Callable[[], None] = lambda: None) -> bool:
    """Whether 127.0.0.1:``port`` accepts a connection within ``timeout_s``; ``alive`` runs before each
    try, to raise at once when the server being waited for has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False
