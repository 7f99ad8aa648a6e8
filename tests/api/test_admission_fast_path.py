"""The admission's fast path (service.api.fast_admission): a plain valid POST is admitted without
FastAPI, with the route's own result; anything in doubt goes to the app, which answers exactly as the
route does; errors of the admission itself get the app's error bodies; the body limit and CORS
still apply."""

from __future__ import annotations

import json
from typing import Any

import httpx

from service.api.fast_admission import AdmissionFastPath, fast_path_of
from tests.api.conftest import Server, StartServer

QUESTION = {"question": "what is the agent doing?"}


def _path_of(server: Server) -> AdmissionFastPath:
    fast = fast_path_of(server.app)
    assert fast is not None
    return fast


async def _post(
    client: httpx.AsyncClient,
    parent: str,
    body: bytes,
    content_type: str = "application/json",
    **headers: str,
) -> httpx.Response:
    return await client.post(
        f"/v1/sessions/{parent}/questions", content=body, headers={"content-type": content_type, **headers}
    )


async def test_a_plain_valid_question_takes_the_fast_path_and_gets_the_routes_record(
    start_server: StartServer,
) -> None:
    server = await start_server()
    async with server.client() as client:
        fast_reply = await _post(client, "p-fast", json.dumps({**QUESTION, "context_window": 8192}).encode())
        fast = _path_of(server)
        assert (fast.taken, fast.declined) == (1, 0)
        # The same question in a media type the fast path leaves to the route: FastAPI admits it.
        routed = await _post(client, "p-fast", json.dumps(QUESTION).encode(), "application/vnd.api+json")
        assert (fast.taken, fast.declined) == (1, 1)
        for reply in (fast_reply, routed):
            assert reply.status_code == 202
            record = reply.json()
            assert reply.headers["location"] == f"/v1/questions/{record['id']}"
            # Exactly the stored record, as every read returns it.
            assert record == (await client.get(f"/v1/questions/{record['id']}")).json()
        assert set(fast_reply.json()) == set(routed.json())
        assert fast_reply.json()["ordinal"] == 1 and routed.json()["ordinal"] == 2
        assert fast_reply.json()["question"] == routed.json()["question"] == QUESTION["question"]
        # An idempotent replay through the fast path: 200 and the original record.
        first = await _post(client, "p-key", json.dumps(QUESTION).encode(), **{"Idempotency-Key": "k1"})
        again = await _post(
            client, "p-key", b'{ "question" : "what is the agent doing?" }', **{"Idempotency-Key": "k1"}
        )
        assert (first.status_code, again.status_code) == (202, 200)
        assert again.json() == first.json()
        assert fast.taken == 3


async def test_anything_in_doubt_goes_to_the_app_and_gets_its_answer(start_server: StartServer) -> None:
    server = await start_server()
    cases: list[tuple[str, bytes, dict[str, str], int, str]] = [
        ("p", b"{", {}, 400, "malformed_json"),
        ("p", b"[]", {}, 422, "validation_error"),
        ("p", b'{"question": ""}', {}, 422, "validation_error"),
        ("p", b'{"question": "q", "extra": 1}', {}, 422, "validation_error"),
        ("p" * 501, b'{"question": "q"}', {}, 422, "validation_error"),
        ("p", b'{"question": "q"}', {"Idempotency-Key": "k" * 301}, 422, "validation_error"),
        # Nested beyond the parser's recursion limit (the fast path's parse raised RecursionError).
        ("p", b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400, "malformed_json"),
    ]
    async with server.client() as client:
        for parent, body, headers, status, code in cases:
            reply = await _post(client, parent, body, **headers)
            assert reply.status_code == status, (parent[:10], body, reply.text)
            assert reply.json()["error"]["code"] == code
        no_type = await client.post("/v1/sessions/p/questions", content=b'{"question": "q"}')
        assert no_type.status_code == 422  # FastAPI reads a body without a JSON media type as bytes
        # Not JSON at all: refused before the fast path or the app sees it (service/api/strict_input.py).
        nan = await _post(client, "p", b'{"question": "q", "context_window": NaN}')
        assert nan.status_code == 400 and nan.json()["error"]["code"] == "malformed_json"
    fast = _path_of(server)
    assert (fast.taken, fast.declined) == (0, len(cases) + 1)


async def test_refusals_of_the_admission_itself_get_the_apps_error_bodies(start_server: StartServer) -> None:
    server = await start_server(max_queued_per_session=1, max_question_bytes=100)
    async with server.client() as client:
        assert (await _post(client, "p-full", json.dumps(QUESTION).encode())).status_code == 202
        full = await _post(client, "p-full", json.dumps(QUESTION).encode())
        large = await _post(client, "p-large", json.dumps({"question": "x" * 101}).encode())
        missing = await _post(client, "p-missing", json.dumps({**QUESTION, "snapshot_id": "nope"}).encode())
    assert full.status_code == 429 and full.json()["error"] == {
        "code": "queue_full",
        "message": "the session already has 1 queued questions; wait for some to finish",
        "detail": {"max_queued": 1},
    }
    assert large.status_code == 413 and large.json()["error"]["code"] == "question_too_large"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "snapshot_missing"
    assert _path_of(server).taken == 4


async def test_tokens_the_body_limit_and_cors_apply_to_the_fast_path(start_server: StartServer) -> None:
    server = await start_server(
        api_tokens="acme:tok-acme", cors_origins="https://ui.example", max_snapshot_bytes=1000
    )
    body = json.dumps(QUESTION).encode()
    origin = {"Origin": "https://ui.example"}
    async with server.client() as client:
        ok = await _post(client, "p-auth", body, Authorization="Bearer tok-acme", **origin)
        assert ok.status_code == 202
        assert ok.headers["access-control-allow-origin"] == "https://ui.example"
        fast = _path_of(server)
        assert fast.taken == 1
        for auth in (None, "Bearer wrong", "Basic tok-acme"):
            headers: dict[str, Any] = {"Authorization": auth} if auth else {}
            refused = await _post(client, "p-auth", body, **headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        # Refused before either path: without a valid token nothing else looks at the request.
        assert (fast.taken, fast.declined) == (1, 0)
        # Beyond the body limit (snapshot + question + 1 MiB of slack): refused before either path.
        huge = await _post(
            client, "p-auth", b" " * (1000 + 65536 + 1024 * 1024 + 1), Authorization="Bearer tok-acme"
        )
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "payload_too_large"
        assert (fast.taken, fast.declined) == (1, 0)
