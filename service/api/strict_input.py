"""What a request's bytes may be (docs/api.md, "Decisions where SPEC is silent"): a path that is UTF-8
once percent-decoded (the server reads a bad escape as U+FFFD), and a JSON body that is RFC 8259 text by
:func:`service.vocabulary.strict_json`'s rule, checked before a route (or the admission's fast path)
reads it."""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import unquote_to_bytes

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import ApiError, error_response, is_json_media, validation_error
from service.vocabulary import NotJson, may_be_lenient_json, strict_json

_WITH_BODY: Final = frozenset({"POST", "PUT", "PATCH"})
# Archive restore reads its body itself, same rule, and answers its own code (invalid_archive: docs/api.md).
_OWN_PARSER: Final = re.compile(r"/v1/sessions/[^/]+/archive")


async def read_body(receive: Receive) -> bytes | None:
    """The request's whole body, or None when the client went away before sending all of it."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that gives ``body`` once, then whatever the connection says next (a disconnect):
    for a middleware that read the body to hand the request on."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers") or []:
        if name == b"content-type":
            return is_json_media(value)
    return False


class StrictJsonBodies:
    """ASGI middleware: a POST/PUT/PATCH body sent as JSON (:func:`~service.api.errors.is_json_media`)
    that :func:`strict_json` refuses is answered 400 ``malformed_json`` here; every other request goes
    on, its body replayed. Sits inside the body limit (which bounds what is read here), outside the fast
    path and the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in _WITH_BODY
            or not _is_json(scope)
            or _OWN_PARSER.fullmatch(scope["path"])
        ):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away while sending
            return
        if body and may_be_lenient_json(body):
            try:
                strict_json(body)
            except NotJson as exc:
                refusal = ApiError(400, "malformed_json", f"the request body is not valid JSON: {exc}")
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, replaying(body, receive), send)


class Utf8Paths:
    """ASGI middleware: 422 ``validation_error`` for a path whose percent-escapes are not UTF-8 (an id
    must be text: the server would have read each bad byte as U+FFFD). Only a path holding U+FFFD
    after decoding is checked again, from its raw bytes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "\ufffd" in scope.get("path", ""):
            raw = scope.get("raw_path") or scope["path"].encode("utf-8")
            try:
                unquote_to_bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                error = validation_error(["path"], "not UTF-8 once its %-escapes are decoded")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
