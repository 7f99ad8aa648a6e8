"""HTTP edges: CORS from settings, 405 with the full Allow list, OpenAPI covers every route."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.api.conftest import Server, StartServer


async def test_cors_only_when_origins_are_configured(start_server: StartServer, server: Server) -> None:
    cors = await start_server(cors_origins="https://ui.example, https://other.example")
    preflight_headers = {
        "Origin": "https://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, idempotency-key",
    }
    async with cors.client() as client:
        preflight = await client.options("/v1/sessions/p/questions", headers=preflight_headers)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
        simple = await client.get("/healthz", headers={"Origin": "https://other.example"})
        assert simple.headers["access-control-allow-origin"] == "https://other.example"
        exposed = {h.strip().lower() for h in simple.headers["access-control-expose-headers"].split(",")}
        assert {"location", "retry-after"} <= exposed
        stranger = await client.get("/healthz", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in stranger.headers
        # A refused preflight answers with SPEC's error body, not Starlette's plain text.
        refused = await client.options(
            "/v1/sessions/p/questions", headers={**preflight_headers, "Origin": "https://evil.example"}
        )
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        error = refused.json()["error"]
        assert error["code"] == "bad_request" and "origin" in error["message"] and error["detail"] == {}
    async with server.client() as client:
        plain = await client.get("/healthz", headers={"Origin": "https://ui.example"})
        assert "access-control-allow-origin" not in plain.headers


async def test_wrong_method_is_405_listing_every_method_of_the_path(server: Server) -> None:
    async with server.client() as client:
        response = await client.patch("/v1/sessions/p/questions")
        assert response.status_code == 405
        assert response.headers["allow"] == "DELETE, GET, POST"
        assert response.json()["error"]["code"] == "method_not_allowed"


async def test_openapi_describes_every_v1_route(server: Server) -> None:
    async with server.client() as client:
        spec = (await client.get("/openapi.json")).json()
    paths = spec["paths"]
    expected = {
        ("/v1/sessions/{parent_id}/questions", "post"),
        ("/v1/sessions/{parent_id}/questions", "get"),
        ("/v1/sessions/{parent_id}/questions", "delete"),
        ("/v1/questions/{request_id}", "get"),
        ("/v1/questions/{request_id}/events", "get"),
        ("/v1/sessions/{parent_id}/events", "get"),
        ("/v1/questions/{request_id}/cancel", "post"),
        ("/v1/questions/{request_id}/stream-token", "post"),
        ("/v1/sessions/{parent_id}/stream-token", "post"),
        ("/v1/sessions/{parent_id}/snapshots/{snapshot_id}", "put"),
        ("/v1/sessions/{parent_id}", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
    }
    assert {(p, m) for p, m in expected if m in paths.get(p, {})} == expected
    post = paths["/v1/sessions/{parent_id}/questions"]["post"]
    assert {"202", "200", "409", "413", "422", "429"} <= set(post["responses"])
    record = spec["components"]["schemas"]["RequestRecord"]["properties"]
    assert {"id", "ordinal", "truncated", "stop_reason", "context_info", "attempt"} <= set(record)
    assert (
        "text/event-stream"
        in paths["/v1/questions/{request_id}/events"]["get"]["responses"]["200"]["content"]
    )


async def test_a_body_that_is_not_json_text_is_400_on_every_route(server: Server) -> None:
    """RFC 8259 text only: Python's parser would read NaN and decode UTF-16 or a BOM."""
    not_json = [b'{"context_window": NaN}', '{"on_busy": "reject"}'.encode("utf-16"), b"\xef\xbb\xbf{}"]
    async with server.client() as client:
        for method, url in (
            ("PUT", "/v1/sessions/p-json/settings"),
            ("POST", "/v1/sessions/p-json/handoffs"),
            ("PUT", "/v1/sessions/p-json/snapshots/s"),
            ("POST", "/v1/sessions/p-json/questions"),
        ):
            for body in not_json:
                response = await client.request(
                    method, url, content=body, headers={"Content-Type": "application/json"}
                )
                assert response.status_code == 400, (url, body, response.text)
                assert response.json()["error"]["code"] == "malformed_json"
        archive = await client.post(
            "/v1/sessions/p-json/archive",
            content='{"version": 1}'.encode("utf-16"),
            headers={"Content-Type": "application/json"},
        )
        assert archive.status_code == 400 and archive.json()["error"]["code"] == "invalid_archive"
        assert (await client.get("/v1/sessions/p-json")).status_code == 404  # nothing written


async def test_a_json_body_not_declared_as_json_says_so(server: Server) -> None:
    """A valid body sent as text/plain (or without a Content-Type) is refused saying the content type
    is the problem; pydantic's "Input should be a valid dictionary" would not."""
    async with server.client() as client:
        for method, url, body in (
            ("PUT", "/v1/sessions/p-ct/settings", b'{"on_busy": "reject"}'),
            ("POST", "/v1/sessions/p-ct/handoffs", b"{}"),
            ("PUT", "/v1/sessions/p-ct/snapshots/s", b'{"messages": []}'),
            ("POST", "/v1/sessions/p-ct/questions", b'{"question": "q"}'),
            # Read as raw bytes, so it needs the rule itself, or a text/plain archive would be restored.
            ("POST", "/v1/sessions/p-ct/archive", b'{"version": 1, "parent_id": "p", "questions": []}'),
        ):
            for headers in ({"Content-Type": "text/plain"}, {"Content-Type": ""}):
                response = await client.request(method, url, content=body, headers=headers)
                assert response.status_code == 422, (url, headers, response.text)
                error = response.json()["error"]
                assert error["code"] == "validation_error"
                assert "Content-Type: application/json" in error["message"], (url, error)
        assert (await client.get("/v1/sessions/p-ct")).status_code == 404  # nothing written


async def _raw(
    server: Server, method: str, target: str, body: bytes = b"", extra: str = ""
) -> tuple[int, bytes]:
    """One request sent as written (no client resolves its dot segments): (status, body)."""
    host, port = server.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = f"{method} {target} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}"
        writer.write(f"{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
    status = int(response.split(b" ", 2)[1])
    return status, response.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize("segment", [".", "..", "%2E", "%2e%2E"])
async def test_dot_segments_are_no_ids(server: Server, segment: str) -> None:
    """A session under "." or ".." could not be reached by any client that resolves dot segments
    (browsers, httpx, the inspector): such a path names no session, 404 (docs/api.md)."""
    question = b'{"question": "q"}'
    twice = "x-twice: 1\r\nx-twice: 2\r\n"  # a repeated header: the fast path leaves it to the route
    for method, target, body, extra in (
        ("POST", f"/v1/sessions/{segment}/questions", question, ""),  # the admission's fast path
        ("POST", f"/v1/sessions/{segment}/questions", question, twice),  # the route
        ("PUT", f"/v1/sessions/p/snapshots/{segment}", b'{"messages": []}', ""),
        ("GET", f"/v1/sessions/{segment}", b"", ""),
    ):
        status, text = await _raw(server, method, target, body, extra)
        if status != 404:  # some dot paths never reach a route: the server's own 404
            raise AssertionError((method, target, status, text))
        if text.startswith(b"{"):
            assert json.loads(text)["error"]["code"] == "not_found", text
    async with server.client() as client:
        assert (await client.get("/v1/sessions")).json()["items"] == []
