"""SPEC §1 and §3, running the service: health, readiness, metrics, OpenAPI, CORS, refusals at start.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.contract.helpers import (
    Limited,
    Service,
    _tenant_client,
    ask,
    new_parent,
    wait_for,
)
from tests.net import free_port

SPEC_ROUTES = {
    ("post", "/v1/sessions/{}/questions"),
    ("get", "/v1/sessions/{}/questions"),
    ("delete", "/v1/sessions/{}/questions"),
    ("get", "/v1/questions/{}"),
    ("get", "/v1/questions/{}/events"),
    ("get", "/v1/sessions/{}/events"),
    ("post", "/v1/questions/{}/cancel"),
    ("put", "/v1/sessions/{}/snapshots/{}"),
    ("get", "/v1/sessions/{}"),
    ("get", "/v1/sessions/{}/archive"),
    ("post", "/v1/sessions/{}/archive"),
    ("post", "/v1/questions/{}/stream-token"),
    ("post", "/v1/sessions/{}/stream-token"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
}


async def test_health_ready_and_metrics_need_no_token_and_carry_no_tenant_data(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    parent = new_parent()
    record = await ask(acme, parent, "Tenant data must not leak into metrics.")
    await wait_for(acme, record["id"])
    async with _tenant_client(services, None) as anonymous:
        assert (await anonymous.get("/healthz")).status_code == 200
        assert (await anonymous.get("/readyz")).status_code == 200
        metrics = await anonymous.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        assert "sidequest_" in metrics.text
        for secret in ("acme", "globex", parent, "tok-a", "tok-g", record["id"]):
            assert secret not in metrics.text


async def test_openapi_lists_every_spec_route(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    listed = {
        (method, re.sub(r"\{[^}]+\}", "{}", path))
        for path, operations in document["paths"].items()
        for method in operations
    }
    assert SPEC_ROUTES <= listed, SPEC_ROUTES - listed


def _serve_refuses(env_extra: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_serve_refuses_an_out_of_range_output_cap_and_a_public_bind_without_tokens(
    database_url: str, tmp_path: Path
) -> None:
    for value, bound in (("255", "256"), ("32769", "32768")):
        refused = await asyncio.to_thread(
            _serve_refuses,
            {"SIDEQUEST_DATABASE_URL": database_url, "SIDEQUEST_MAX_OUTPUT_TOKENS": value},
            "--port",
            str(free_port()),
            cwd=tmp_path,
        )
        assert refused.returncode != 0
        assert "SIDEQUEST_MAX_OUTPUT_TOKENS" in refused.stderr and bound in refused.stderr
    public = await asyncio.to_thread(
        _serve_refuses,
        {"SIDEQUEST_DATABASE_URL": database_url},
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        cwd=tmp_path,
    )
    assert public.returncode != 0 and "SIDEQUEST_API_TOKENS" in public.stderr
    assert not (tmp_path / ".sidequest").exists()


async def test_cors_answers_configured_origins_only(limited: Limited) -> None:
    async with limited.client() as http:
        preflight = await http.options(
            f"/v1/sessions/{new_parent()}/questions",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type,idempotency-key",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        allowed = await http.get("/healthz", headers={"Origin": "https://other.example"})
        assert allowed.headers["access-control-allow-origin"] == "https://other.example"
        foreign = await http.get("/healthz", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in foreign.headers
