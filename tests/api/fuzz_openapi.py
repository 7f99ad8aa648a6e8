"""Schemathesis against /openapi.json of a real server (not part of the default pytest run).

    .venv/bin/python -m tests.api.fuzz_openapi [--max-examples 50] [--seed 1]

Starts PostgreSQL the way the tests do (tests/pg.py), a fresh migrated database, and the API with
its worker (offline provider, so request streams end) and two bearer tokens on a free 127.0.0.1
port; then runs ``st run --checks all`` twice:

1. the session stream alone, first, while the database holds no session yet, so every generated
   call must be answered at once (404 / 401 / 400 / 422) — an open session stream never ends by
   design, a fuzzer could only time out on it; the open stream is covered by tests/api/test_sse.py;
2. every other operation, authenticated as tenant ``fuzz``.

Exit status 0 when both runs find nothing. The result is recorded in docs/api.md.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from service.config import Settings
from service.serve import create_serving_app
from service.store.schema import upgrade_to_head
from tests import pg

TOKEN = "fuzz-token"
ST = Path(sys.executable).with_name("st")


def _start_server(database_url: str) -> tuple[uvicorn.Server, threading.Thread, str]:
    settings = Settings(
        database_url=database_url,
        provider="offline",
        api_tokens=f"fuzz:{TOKEN},other:other-token",
        poll_s=0.2,
        heartbeat_s=0.5,
        lease_s=5.0,
    )
    app = create_serving_app(settings, database_url)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def _st(url: str, extra: list[str], args: argparse.Namespace) -> int:
    command = [
        str(ST),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--max-examples",
        str(args.max_examples),
        "--seed",
        str(args.seed),
        "--request-timeout",
        "20",
        "--workers",
        "1",
        "--generation-database",
        "none",
        "--no-color",
        # NUL is generated (the default): every string the service refuses it in says so with a
        # pattern, nested snapshot and archive JSON through the recursive StorableJson definitions.
        *extra,
    ]
    print("$", " ".join(command).replace(TOKEN, "<token>"), flush=True)
    return subprocess.call(command)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-examples", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    server_pg = pg.find_server()
    database_url = asyncio.run(pg.create_database(server_pg.admin_url))
    try:
        upgrade_to_head(database_url)
        server, thread, url = _start_server(database_url)
        try:
            assert httpx.get(f"{url}/readyz").status_code == 200
            streams = "^/v1/sessions/\\{parent_id\\}/events$"
            # The session stream first, while the database holds no session at all.
            second = _st(url, ["--include-path-regex", streams], args)
            first = _st(url, ["--exclude-path-regex", streams], args)
        finally:
            server.should_exit = True
            thread.join(15)
    finally:
        asyncio.run(pg.drop_database(server_pg.admin_url, database_url))
        server_pg.stop()
    print(
        f"schemathesis: all operations but the session stream → exit {first}; session stream → exit {second}"
    )
    return 0 if first == 0 and second == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
