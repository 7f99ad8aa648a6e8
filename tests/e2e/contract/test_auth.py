"""SPEC §3, auth: bearer tokens, tenants, stream tokens.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import httpx

from tests.api.sse_client import messages
from tests.e2e.contract.helpers import (
    Service,
    _tenant_client,
    ask,
    assert_error,
    events_of,
    new_parent,
    parse_utc,
    read_stream,
    wait_for,
)


async def test_auth_requires_a_token_and_other_tenants_get_404_everywhere(
    services: dict[str, Service], acme: httpx.AsyncClient, globex: httpx.AsyncClient
) -> None:
    parent = new_parent()
    record = await ask(acme, parent, "Acme's question.")
    await wait_for(acme, record["id"])
    rid = record["id"]
    async with _tenant_client(services, None) as anonymous, _tenant_client(services, "wrong") as wrong:
        for http in (anonymous, wrong):
            assert_error(await http.get(f"/v1/questions/{rid}"), 401)
            assert_error(await http.post(f"/v1/sessions/{parent}/questions", json={"question": "x"}), 401)
            assert (await read_stream(http, f"/v1/questions/{rid}/events"))[0] == 401

    for response in (
        await globex.get(f"/v1/questions/{rid}"),
        await globex.post(f"/v1/questions/{rid}/cancel"),
        await globex.post(f"/v1/questions/{rid}/stream-token"),
        await globex.get(f"/v1/sessions/{parent}"),
        await globex.get(f"/v1/sessions/{parent}/questions"),
        await globex.delete(f"/v1/sessions/{parent}/questions"),
        await globex.get(f"/v1/sessions/{parent}/archive"),
        await globex.post(f"/v1/sessions/{parent}/stream-token"),
    ):
        assert_error(response, 404)
    assert (await read_stream(globex, f"/v1/questions/{rid}/events"))[0] == 404
    assert (await read_stream(globex, f"/v1/sessions/{parent}/events"))[0] == 404

    # The same parent id in another tenant is another session.
    theirs = await ask(globex, parent, "Globex's question.")
    assert theirs["ordinal"] == 1
    await wait_for(globex, theirs["id"])
    assert [
        i["question"] for i in (await globex.get(f"/v1/sessions/{parent}/questions")).json()["items"]
    ] == ["Globex's question."]
    assert [i["question"] for i in (await acme.get(f"/v1/sessions/{parent}/questions")).json()["items"]] == [
        "Acme's question."
    ]
    assert_error(await globex.get(f"/v1/questions/{rid}"), 404)
    assert (await acme.get(f"/v1/questions/{rid}")).json()["status"] == "succeeded"


async def test_stream_tokens_open_their_own_stream_only(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    parent = new_parent()
    first = await ask(acme, parent, "First.")
    second = await ask(acme, parent, "Second.")
    await wait_for(acme, second["id"])
    issued = await acme.post(f"/v1/questions/{first['id']}/stream-token")
    assert issued.status_code == 200, issued.text
    body = issued.json()
    assert set(body) >= {"token", "expires_at", "url"}
    expires = parse_utc(body["expires_at"])
    assert timedelta(minutes=9) < expires - datetime.now(UTC) <= timedelta(minutes=10, seconds=5)
    assert body["url"].endswith(f"/v1/questions/{first['id']}/events?token={body['token']}")
    token = body["token"]
    async with _tenant_client(services, None) as browser:
        status, stream = await read_stream(browser, body["url"])
        assert status == 200 and events_of(stream)[-1].event == "done"
        assert events_of(stream)[0].json()["request_id"] == first["id"]
        other = await read_stream(browser, f"/v1/questions/{second['id']}/events", params={"token": token})
        assert other[0] == 401
        assert_error(await browser.get(f"/v1/questions/{first['id']}", params={"token": token}), 401)
        assert_error(await browser.get(f"/v1/sessions/{parent}/questions", params={"token": token}), 401)
        assert (await read_stream(browser, f"/v1/sessions/{parent}/events", params={"token": token}))[
            0
        ] == 401

        session_token = (await acme.post(f"/v1/sessions/{parent}/stream-token")).json()
        assert session_token["url"].endswith(f"/v1/sessions/{parent}/events?token={session_token['token']}")
        async with asyncio.timeout(10):
            async with browser.stream("GET", session_token["url"]) as response:
                assert response.status_code == 200
                async for message in messages(response):
                    if message.event is not None:
                        assert message.json()["request_id"] in (first["id"], second["id"])
                        break
        assert (
            await read_stream(
                browser, f"/v1/questions/{first['id']}/events", params={"token": session_token["token"]}
            )
        )[0] == 401


async def test_stream_tokens_never_appear_in_the_server_log(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    record = await ask(acme, new_parent())
    await wait_for(acme, record["id"])
    issued = (await acme.post(f"/v1/questions/{record['id']}/stream-token")).json()
    async with _tenant_client(services, None) as browser:
        assert (await read_stream(browser, issued["url"]))[0] == 200
        assert (
            await read_stream(
                browser, f"/v1/questions/{uuid.uuid4()}/events", params={"token": issued["token"]}
            )
        )[0] in (401, 404)
    await asyncio.sleep(0.2)
    assert issued["token"] not in services["auth"].log.read_text()


async def test_a_stream_token_is_not_a_bearer_token_and_archive_export_defaults_to_v3(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    parent = new_parent()
    record = await ask(acme, parent)
    await wait_for(acme, record["id"])
    token = (await acme.post(f"/v1/questions/{record['id']}/stream-token")).json()["token"]
    async with _tenant_client(services, token) as holder:
        assert (await read_stream(holder, f"/v1/questions/{record['id']}/events"))[0] == 401
        assert_error(await holder.get(f"/v1/questions/{record['id']}"), 401)
    exported = (await acme.get(f"/v1/sessions/{parent}/archive")).json()
    assert exported["version"] == 3 and "session" in exported
    assert_error(await acme.get(f"/v1/sessions/{new_parent()}/archive"), 404)
