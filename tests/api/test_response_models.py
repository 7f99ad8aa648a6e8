"""Each route's body is its declared response model exactly: it validates, and at every level of the
model its keys are the model's fields, no more, no fewer.

The routes send the record the store built (``JSONResponse``), not the model serialised
(docs/architecture.md, "Records and response models"); this test is what keeps OpenAPI and the wire
from drifting apart.
"""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from service.api.schemas import (
    Cleared,
    Handoff,
    HandoffPage,
    HistoryPage,
    RequestRecord,
    SessionOut,
    SessionPage,
    SessionSettingsOut,
    SnapshotStored,
    StreamToken,
)
from service.context_info import ContextInfo
from service.store.db import Database
from tests.api.conftest import Server
from tests.api.helpers import ask, finish

# What a record holds only once it is known (SPEC §3: context_info fills in as the request runs).
FILLED_AS_KNOWN: set[type[BaseModel]] = {ContextInfo}
SNAPSHOT = {"messages": [{"role": "user", "content": "hello"}]}


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (through ``X | None``, ``list[X]``, ``Annotated``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, types.UnionType, list) or hasattr(annotation, "__metadata__"):
        return [model for arg in get_args(annotation) for model in _models(arg)]
    return []


def assert_shape(model: type[BaseModel], body: Any, where: str) -> None:
    assert isinstance(body, dict), where
    fields = set(model.model_fields)
    if model in FILLED_AS_KNOWN:
        assert set(body) <= fields, f"{where}: {sorted(set(body) - fields)} not in the model"
    else:
        assert set(body) == fields, f"{where}: {sorted(body)} != {sorted(fields)}"
    for name, field in model.model_fields.items():
        value = body.get(name)
        for inner in _models(field.annotation):
            for item in value if isinstance(value, list) else [value]:
                if item is not None:
                    assert_shape(inner, item, f"{where}.{name}")


def openapi_model(document: dict[str, Any], method: str, path: str, status: int) -> str:
    """The name of the response model OpenAPI gives for this route's success."""
    content = document["paths"][path][method.lower()]["responses"][str(status)]["content"]
    ref: str = content["application/json"]["schema"]["$ref"]
    return ref.rsplit("/", 1)[1]


async def test_every_record_route_sends_exactly_its_response_model(server: Server, db: Database) -> None:
    async with server.client() as client:
        document = (await client.get("/openapi.json")).json()
        done = await ask(client, "p-shape", "first?")
        await finish(db, done["id"])
        queued = await ask(client, "p-shape", "second?")
        question, session = "/v1/questions/{request_id}", "/v1/sessions/{parent_id}"
        calls: list[tuple[str, str, str, Any, type[BaseModel]]] = [
            (
                "POST",
                session + "/questions",
                "/v1/sessions/p-shape/questions",
                {"question": "?"},
                RequestRecord,
            ),
            ("GET", question, f"/v1/questions/{done['id']}", None, RequestRecord),
            ("POST", question + "/pin", f"/v1/questions/{done['id']}/pin", None, RequestRecord),
            ("DELETE", question + "/pin", f"/v1/questions/{done['id']}/pin", None, RequestRecord),
            (
                "POST",
                question + "/stream-token",
                f"/v1/questions/{done['id']}/stream-token",
                None,
                StreamToken,
            ),
            ("POST", question + "/cancel", f"/v1/questions/{queued['id']}/cancel", None, RequestRecord),
            ("GET", session, "/v1/sessions/p-shape", None, SessionOut),
            ("GET", "/v1/sessions", "/v1/sessions", None, SessionPage),
            ("GET", session + "/questions", "/v1/sessions/p-shape/questions", None, HistoryPage),
            ("POST", session + "/stream-token", "/v1/sessions/p-shape/stream-token", None, StreamToken),
            (
                "PUT",
                session + "/snapshots/{snapshot_id}",
                "/v1/sessions/p-shape/snapshots/s1",
                SNAPSHOT,
                SnapshotStored,
            ),
            ("POST", session + "/handoffs", "/v1/sessions/p-shape/handoffs", {}, Handoff),
            ("GET", session + "/handoffs", "/v1/sessions/p-shape/handoffs", None, HandoffPage),
            ("GET", session + "/settings", "/v1/sessions/p-shape/settings", None, SessionSettingsOut),
            ("DELETE", session + "/questions", "/v1/sessions/p-shape/questions", None, Cleared),
        ]
        for method, path, url, body, model in calls:
            response = await client.request(method, url, json=body)
            assert response.is_success, (url, response.text)
            assert openapi_model(document, method, path, response.status_code) == model.__name__
            model.model_validate(response.json())
            assert_shape(model, response.json(), f"{method} {path}")
