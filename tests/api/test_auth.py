"""Tenants and tokens: 401 without a token, 404 for another tenant everywhere, stream tokens."""

from __future__ import annotations

import logging
import uuid

import httpx

from service.api.app import RedactStreamTokens
from service.api.stream_tokens import (
    check_token,
    issue_token,
    request_stream_name,
    session_stream_name,
    stream_secret,
)
from service.config import Settings
from service.store.db import Database
from tests.api.conftest import TOKENS, Server, StartServer
from tests.api.helpers import ask, finish
from tests.api.sse_client import events


async def _acme_state(server: Server) -> tuple[str, str]:
    async with server.client("tok-acme") as acme:
        record = await ask(acme, "acme-parent")
        put = await acme.put("/v1/sessions/acme-parent/snapshots/s-acme", json={"messages": []})
        assert put.status_code == 201
    return record["id"], "acme-parent"


def _routes(rid: str, parent: str) -> list[tuple[str, str, dict[str, object]]]:
    """Every route that names an existing session or request (archive ones included)."""
    return [
        ("GET", f"/v1/questions/{rid}", {}),
        ("GET", f"/v1/questions/{rid}/events", {}),
        ("POST", f"/v1/questions/{rid}/cancel", {}),
        ("POST", f"/v1/questions/{rid}/stream-token", {}),
        ("GET", f"/v1/sessions/{parent}", {}),
        ("GET", f"/v1/sessions/{parent}/questions", {}),
        ("GET", f"/v1/sessions/{parent}/events", {}),
        ("DELETE", f"/v1/sessions/{parent}/questions", {}),
        ("POST", f"/v1/sessions/{parent}/stream-token", {}),
        ("GET", f"/v1/sessions/{parent}/archive", {}),
    ]


async def test_another_tenant_gets_404_on_every_route(auth_server: Server, db: Database) -> None:
    rid, parent = await _acme_state(auth_server)
    async with auth_server.client("tok-globex") as globex:
        for method, path, _ in _routes(rid, parent):
            response = await globex.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["error"]["code"] == "not_found"
        # A snapshot of another tenant's session does not exist for globex either.
        response = await globex.post(
            f"/v1/sessions/{parent}/questions", json={"question": "q", "snapshot_id": "s-acme"}
        )
        assert response.status_code == 404 and response.json()["error"]["code"] == "snapshot_missing"
    async with auth_server.client("tok-acme") as acme:
        assert (await acme.get(f"/v1/questions/{rid}")).json()["status"] == "queued"  # untouched
        assert (await acme.get(f"/v1/sessions/{parent}")).json()["counts"]["queued"] == 1


async def test_without_a_valid_token_every_v1_route_is_401(auth_server: Server) -> None:
    rid, parent = await _acme_state(auth_server)
    routes = [*_routes(rid, parent), ("POST", f"/v1/sessions/{parent}/questions", {})]
    routes.append(("PUT", f"/v1/sessions/{parent}/snapshots/x", {}))
    for token in (None, "wrong"):
        async with auth_server.client(token) as anonymous:
            for method, path, _ in routes:
                response = await anonymous.request(method, path, json={"question": "q"})
                assert response.status_code == 401, (method, path, response.text)
                assert response.json()["error"]["code"] == "unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
            for path in ("/healthz", "/readyz", "/metrics"):
                assert (await anonymous.get(path)).status_code == 200
            # The token is asked for first: without one, no 400 for a bad body, 404 for a bad id or
            # 422 for a bad path or query tells a stranger anything about the input.
            for method, path, content in (
                ("POST", f"/v1/sessions/{parent}/questions", b"{not json"),
                ("GET", "/v1/questions/not-a-uuid/events", b""),
                ("GET", "/v1/sessions/a%FFb", b""),
                ("GET", f"/v1/sessions/{parent}/questions?limit=0", b""),
                ("POST", "/v1/nowhere", b""),
                # A query name that merely ends in "token" is not a stream token.
                ("GET", "/v1/questions/not-a-uuid/events?xtoken=abc", b""),
            ):
                response = await anonymous.request(
                    method, path, content=content, headers={"content-type": "application/json"}
                )
                assert response.status_code == 401, (method, path, response.text)


async def test_stream_token_opens_its_stream_only(auth_server: Server, db: Database) -> None:
    rid, parent = await _acme_state(auth_server)
    other = uuid.uuid4()
    async with auth_server.client("tok-acme") as acme, auth_server.client() as browser:
        other_rid = (await ask(acme, parent, "second"))["id"]
        issued = await acme.post(f"/v1/questions/{rid}/stream-token")
        assert issued.status_code == 200
        body = issued.json()
        token = body["token"]
        assert body["url"].endswith(f"/v1/questions/{rid}/events?token={token}")
        assert body["expires_at"].endswith("Z")
        await finish(db, rid)
        async with browser.stream("GET", body["url"]) as response:
            assert response.status_code == 200
            got = [m async for m in events(response)]
        assert got[-1].event == "done"
        # Not on another request's stream, not on the session stream, not on ordinary routes.
        for path in (
            f"/v1/questions/{other_rid}/events",
            f"/v1/questions/{other}/events",
            f"/v1/sessions/{parent}/events",
            f"/v1/questions/{rid}",
            f"/v1/sessions/{parent}/questions",
        ):
            response = await browser.get(path, params={"token": token})
            assert response.status_code == 401, path
        session_token = (await acme.post(f"/v1/sessions/{parent}/stream-token")).json()
        async with browser.stream("GET", session_token["url"]) as response:
            assert response.status_code == 200
            first = await anext(events(response))
            assert first.json()["ordinal"] == 1
        wrong = await browser.get(f"/v1/questions/{rid}/events", params={"token": session_token["token"]})
        assert wrong.status_code == 401


async def test_a_session_stream_tokens_url_percent_encodes_the_parent_id(auth_server: Server) -> None:
    """The url's parent id is percent-encoded: "x#1" or "a b?c" raw would send a client to
    /v1/sessions/x."""
    async with auth_server.client("tok-acme") as acme, auth_server.client() as browser:
        for parent, encoded in (("x#1", "x%231"), ("a b?c", "a%20b%3Fc"), ("é%", "%C3%A9%25")):
            assert (await acme.put(f"/v1/sessions/{encoded}/settings", json={})).status_code == 200
            issued = (await acme.post(f"/v1/sessions/{encoded}/stream-token")).json()
            assert f"/v1/sessions/{encoded}/events?token=" in issued["url"], issued["url"]
            async with browser.stream("GET", issued["url"] + "&after=0") as response:
                assert response.status_code == 200, parent


def test_stream_tokens_expire_and_resist_tampering() -> None:
    settings = Settings(api_tokens=TOKENS)
    secret = stream_secret(settings)
    token, expires = issue_token(secret, "acme", request_stream_name("r1"), now=1000.0)
    assert expires == 1600
    assert check_token(secret, token, request_stream_name("r1"), now=1599.0) is not None
    assert check_token(secret, token, request_stream_name("r1"), now=1601.0) is None
    assert check_token(secret, token, session_stream_name("r1"), now=1000.0) is None
    payload, signature = token.split(".")
    assert check_token(secret, payload + "." + signature[::-1], request_stream_name("r1"), now=1000.0) is None
    assert check_token(secret, "garbage", request_stream_name("r1"), now=1000.0) is None
    # Two API processes of one deployment agree without configuring a secret …
    assert check_token(
        stream_secret(Settings(api_tokens=TOKENS)), token, request_stream_name("r1"), now=1000.0
    )
    # … and an explicit secret or other API tokens give other keys.
    assert not check_token(
        stream_secret(Settings(api_tokens="acme:x")), token, request_stream_name("r1"), now=1000.0
    )
    assert stream_secret(Settings(api_tokens=TOKENS, stream_token_secret="s")) != stream_secret(settings)


async def test_stream_tokens_never_reach_the_logs(start_server: StartServer, db: Database) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(level=logging.DEBUG)
    watched = [
        logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.access", "uvicorn.error", "service")
    ]
    access = logging.getLogger("uvicorn.access")
    level = access.level
    access.setLevel(logging.INFO)
    for logger in watched:
        logger.addHandler(keep)
    try:
        server = await start_server(api_tokens=TOKENS, access_log=True)
        async with server.client("tok-acme") as acme, httpx.AsyncClient(base_url=server.url) as browser:
            rid = (await ask(acme, "p-log"))["id"]
            token = (await acme.post(f"/v1/questions/{rid}/stream-token")).json()["token"]
            await finish(db, rid)
            assert (
                await browser.get(f"/v1/questions/{rid}/events", params={"token": token})
            ).status_code == 200
            assert (await browser.get(f"/v1/questions/{rid}", params={"token": token})).status_code == 401
        texts = [record.getMessage() for record in records]
        assert any("/events" in text for text in texts), texts  # the access log did run
        assert not any(token in text for text in texts)
    finally:
        access.setLevel(level)
        for logger in watched:
            logger.removeHandler(keep)


def test_the_redaction_filter_keeps_a_mapping_of_arguments_a_mapping() -> None:
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, "%(path)s from %(who)s", None, None
    )
    record.args = {"path": "/v1/questions/x/events?token=secret&x=1", "who": "me"}
    RedactStreamTokens().filter(record)
    assert record.getMessage() == "/v1/questions/x/events?token=[redacted]&x=1 from me"
    positional = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, "%s %s", ("GET", "/e?token=secret"), None
    )
    RedactStreamTokens().filter(positional)
    assert positional.getMessage() == "GET /e?token=[redacted]"


async def test_no_tokens_configured_means_one_default_tenant(server: Server) -> None:
    async with server.client() as client, server.client("anything") as other:
        record = await ask(client, "p-open")
        assert (await other.get(f"/v1/questions/{record['id']}")).status_code == 200
