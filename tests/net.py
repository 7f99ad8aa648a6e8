"""Loopback ports for the servers tests and benchmarks start (every one binds to 127.0.0.1)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now. The socket is closed before returning, so another process may take
    it first; the servers started here bind it within milliseconds, which has been enough."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
