"""A scripted model server for tests: OpenAI-compatible and Anthropic-compatible, over real HTTP.

The provider is the only thing the tests fake, and only at the wire (docs/architecture.md): the real
SDKs talk to this server on ``127.0.0.1`` (a free port), so every adapter, error path and header is
exercised for real. The server runs its own asyncio loop in a background thread, so it serves sync
tests, async tests and other processes (a worker subprocess) alike.

Usage::

    with ScriptedServer() as server:                       # or the ``scripted_server`` fixture
        server.script("answer", Step.text("hello", chunks=3, usage=Usage(10, 5)))
        server.script("qa_summary", Step.rate_limited(retry_after="2"), Step.valid_summary())
        provider = OpenAIProvider(server.base_url, "key")  # base_url includes /v1
        ...
        server.requests(purpose="answer")[0].body["max_tokens"]

Steps are consumed first-in first-out per purpose (the ``X-Sidequest-Purpose`` header); when a
purpose's queue is empty its default step answers (``server.set_default``; out of the box a short text
answer for ``answer`` and a valid summary document for the summary purposes). Every request is recorded,
in order, with its headers and JSON body.

Endpoints: ``POST /v1/chat/completions`` (streaming and not), ``POST /v1/messages`` (Anthropic Messages,
streaming and not) and ``GET /v1/models``. One :class:`Step` renders on either endpoint; finish reasons
are given in OpenAI's words and translated for Anthropic (``length`` → ``max_tokens`` …).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import itertools
import json
import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import pytest

_ANTHROPIC_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}

VALID_SUMMARY: dict[str, Any] = {
    "objective": "Ship the scripted feature.",
    "state": "Tests are being written.",
    "decisions": ["Use the scripted server for provider tests."],
    "open_work": ["Wire the worker."],
    "risks": [],
}

OPENAI_OVERFLOW_BODY: dict[str, Any] = {
    "error": {
        "message": "This model's maximum context length is 128000 tokens. However, your messages resulted "
        "in 130412 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
ANTHROPIC_OVERFLOW_BODY: dict[str, Any] = {
    "type": "error",
    "error": {
        "type": "invalid_request_error",
        "message": "prompt is too long: 213462 tokens > 200000 maximum",
    },
}
OPENAI_RATE_LIMIT_BODY: dict[str, Any] = {
    "error": {
        "message": "Rate limit reached for gpt-4o-mini in organization org-scripted on tokens per min (TPM): "
        "Limit 200000, Used 199000, Requested 3000. Please try again in 600ms.",
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
OPENAI_QUOTA_BODY: dict[str, Any] = {
    "error": {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}
OPENAI_SERVER_ERROR_BODY: dict[str, Any] = {
    "error": {
        "message": "The server had an error while processing your request. Sorry about that!",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}
# What vLLM puts in the stream when the engine fails after the 200 (an overflow, here).
STREAM_OVERFLOW_ERROR: dict[str, Any] = {
    "error": {
        "object": "error",
        "message": "This model's maximum context length is 4096 tokens. However, your request has 5120 input "
        "tokens. Please reduce the length of the input messages.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}
STREAM_SERVER_ERROR: dict[str, Any] = {
    "error": {"message": "Engine died while generating.", "type": "InternalServerError", "code": 500}
}


@dataclass(frozen=True)
class Usage:
    """Usage to report. ``prompt_tokens`` includes ``cached_tokens`` (OpenAI's convention); for the
    Anthropic endpoint it is split into ``input_tokens`` + cache read + cache creation."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cache_creation_tokens: int = 0

    def openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def anthropic_input(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens - self.cached_tokens - self.cache_creation_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": self.cache_creation_tokens,
        }


def wire_estimate(body: Mapping[str, Any]) -> int:
    """Sidequest's estimator applied to a request body as received (OpenAI or Anthropic wire): every
    text ÷ 3 UTF-8 bytes, rounded up per text, plus 4 per non-system message — what our estimate of the
    same request comes to, give or take a few tokens of per-block rounding."""

    def text_tokens(text: str) -> int:
        return -(-len(text.encode("utf-8")) // 3)

    def content_tokens(content: Any) -> int:
        if isinstance(content, str):
            return text_tokens(content)
        if isinstance(content, list):
            return sum(
                text_tokens(part.get("text") or "") if isinstance(part, dict) else 0 for part in content
            )
        return 0

    total = content_tokens(body.get("system"))  # Anthropic's top-level system
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            total += content_tokens(message.get("content"))
            if message.get("role") != "system":
                total += 4
    return total


@dataclass(frozen=True)
class CountedUsage:
    """Usage whose prompt tokens are counted from the request body: ``factor`` × :func:`wire_estimate`
    (a tokenizer that agrees with our estimate at 1.0). The default steps use it, so a test that does
    not care about usage does not teach the calibration (SPEC 5.1) a tokenizer that does not exist."""

    completion_tokens: int
    factor: float = 1.0

    def resolve(self, body: Mapping[str, Any]) -> Usage:
        return Usage(max(1, math.ceil(self.factor * wire_estimate(body))), self.completion_tokens)


@dataclass(frozen=True)
class ScriptedToolCall:
    name: str
    arguments: str = "{}"
    id: str = "call_scripted_1"


@dataclass(frozen=True)
class Step:
    """One scripted reply. Build it with the named constructors; the fields compose (e.g. a text reply
    with a delay, or a partial reply followed by a stream error)."""

    content: str = ""
    reasoning: str = ""
    chunks: int = 1
    finish_reason: str | None = "stop"
    tool: ScriptedToolCall | None = None
    usage: Usage | CountedUsage | None = None
    # Send the usage before the text (the error-after-usage cases); normally it comes last.
    usage_first: bool = False
    delay_before_s: float = 0.0
    delay_between_s: float = 0.0
    # status >= 400: an HTTP error with this body and these headers, instead of a reply.
    status: int = 200
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # After the text: an error object sent inside the stream, or the connection dropped mid-body.
    stream_error: Any = None
    # After the text: this text as an SSE chunk's data, verbatim (not JSON-encoded): an error a server
    # sent as words, or as JSON that does not parse.
    stream_error_text: str | None = None
    break_stream: bool = False
    # Never answer (before anything when there is no text, else after the text).
    hangs: bool = False
    reasoning_field: str = "reasoning_content"

    # ---- replies -------------------------------------------------------------------------------
    @classmethod
    def text(
        cls,
        text: str,
        *,
        chunks: int = 1,
        usage: Usage | CountedUsage | None = None,
        finish: str = "stop",
        reasoning: str = "",
        delay_before_s: float = 0.0,
        delay_between_s: float = 0.0,
    ) -> Step:
        """A normal reply: ``text`` in ``chunks`` deltas (after ``reasoning``, if any)."""
        return cls(
            content=text,
            reasoning=reasoning,
            chunks=chunks,
            usage=usage,
            finish_reason=finish,
            delay_before_s=delay_before_s,
            delay_between_s=delay_between_s,
        )

    @classmethod
    def reasoning_only(cls, reasoning: str, *, chunks: int = 1, usage: Usage | None = None) -> Step:
        """Thinking and no body (a summary reply that must be rejected as empty)."""
        return cls(reasoning=reasoning, chunks=chunks, usage=usage)

    @classmethod
    def truncated(cls, text: str, *, chunks: int = 1, usage: Usage | None = None) -> Step:
        """Cut by the output cap: ``finish_reason: length`` (Anthropic ``max_tokens``)."""
        return cls(content=text, chunks=chunks, usage=usage, finish_reason="length")

    @classmethod
    def tool_call(
        cls, name: str, *, arguments: str = "{}", text: str = "", usage: Usage | None = None
    ) -> Step:
        """The model tries to call a tool."""
        return cls(
            content=text, tool=ScriptedToolCall(name, arguments), usage=usage, finish_reason="tool_calls"
        )

    @classmethod
    def empty(cls, *, usage: Usage | None = None) -> Step:
        """A reply with no text at all."""
        return cls(usage=usage)

    @classmethod
    def invalid_summary(cls, *, usage: Usage | None = None) -> Step:
        """Prose around JSON: not a valid summary document."""
        return cls(
            content='Sure! Here is the summary: {"objective": "x"} Hope it helps.', chunks=2, usage=usage
        )

    @classmethod
    def valid_summary(
        cls, document: Mapping[str, Any] | None = None, *, chunks: int = 3, usage: Usage | None = None
    ) -> Step:
        """A valid summary document (SPEC §6.4) as the reply."""
        return cls(content=json.dumps(dict(document or VALID_SUMMARY)), chunks=chunks, usage=usage)

    # ---- failures ------------------------------------------------------------------------------
    @classmethod
    def http_error(cls, status: int, body: Any, *, headers: Mapping[str, str] | None = None) -> Step:
        """Answer with HTTP ``status`` and ``body`` (a JSON value, or raw text when a str, sent as
        ``text/plain`` unless ``headers`` name another content-type)."""
        return cls(status=status, body=body, headers=dict(headers or {}))

    @classmethod
    def overflow(cls, body: Any = None, *, status: int = 400) -> Step:
        """A context overflow before any output (default: OpenAI's ``context_length_exceeded``)."""
        return cls.http_error(status, OPENAI_OVERFLOW_BODY if body is None else body)

    @classmethod
    def overflow_in_stream(cls, error: Any = None, *, usage: Usage | None = None) -> Step:
        """HTTP 200, then an error object as the first thing in the stream (vLLM, old llama.cpp)."""
        return cls(
            stream_error=STREAM_OVERFLOW_ERROR if error is None else error,
            usage=usage,
            usage_first=usage is not None,
        )

    @classmethod
    def text_error_in_stream(cls, data: str) -> Step:
        """HTTP 200, then ``data`` as the first chunk's data exactly as given (the wire form of an
        in-stream error that is plain text or broken JSON: ``data: {"error": {"message": "…\\'s"}}``)."""
        return cls(stream_error_text=data)

    @classmethod
    def error_after_partial(
        cls, text: str, *, chunks: int = 2, error: Any = None, usage: Usage | None = None
    ) -> Step:
        """Some text, then the stream fails: with ``error`` as an in-stream error object, else the
        connection simply breaks. ``usage`` (if given) is sent before the text."""
        return cls(
            content=text,
            chunks=chunks,
            stream_error=error,
            break_stream=error is None,
            usage=usage,
            usage_first=usage is not None,
        )

    @classmethod
    def rate_limited(
        cls,
        *,
        retry_after: str | None = "1",
        retry_after_ms: str | None = None,
        body: Any = None,
        status: int = 429,
    ) -> Step:
        """A rate limit (429 by default) with the given ``Retry-After`` / ``retry-after-ms``."""
        headers = {}
        if retry_after is not None:
            headers["retry-after"] = retry_after
        if retry_after_ms is not None:
            headers["retry-after-ms"] = retry_after_ms
        return cls.http_error(status, OPENAI_RATE_LIMIT_BODY if body is None else body, headers=headers)

    @classmethod
    def quota_exhausted(cls) -> Step:
        """OpenAI's 429 ``insufficient_quota``: never worth retrying."""
        return cls.http_error(429, OPENAI_QUOTA_BODY)

    @classmethod
    def server_error(cls, status: int = 500, body: Any = None) -> Step:
        return cls.http_error(status, OPENAI_SERVER_ERROR_BODY if body is None else body)

    @classmethod
    def model_not_found(cls, model: str = "missing-model") -> Step:
        """OpenAI's 404 ``model_not_found``."""
        return cls.http_error(
            404,
            {
                "error": {
                    "message": f"The model `{model}` does not exist or you do not have access to it.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "model_not_found",
                }
            },
        )

    @classmethod
    def hang(cls, *, text: str = "") -> Step:
        """Accept the request and never finish it (after ``text``, if any)."""
        return cls(content=text, hangs=True, chunks=1)

    def with_delay(self, *, before_s: float = 0.0, between_s: float = 0.0) -> Step:
        return replace(self, delay_before_s=before_s, delay_between_s=between_s)


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server received."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: Any  # parsed JSON, or None
    at: float  # time.monotonic() when it arrived

    @property
    def purpose(self) -> str | None:
        return self.headers.get("x-sidequest-purpose")

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-sidequest-request-id")


def _resolved(step: Step) -> Usage:
    """The usage of a step being rendered: ``_route`` has resolved a :class:`CountedUsage` by then."""
    assert isinstance(step.usage, Usage), step.usage
    return step.usage


def default_steps() -> dict[str, Step]:
    """What each purpose gets when nothing is scripted for it."""
    return {
        "answer": Step.text("Scripted answer.", chunks=2, usage=CountedUsage(4)),
        "qa_summary": replace(Step.valid_summary(), usage=CountedUsage(60)),
        "context_summary": replace(Step.valid_summary(), usage=CountedUsage(60)),
    }


class ScriptedServer:
    """The scripted server (see the module docstring). Start with ``with`` or :meth:`start`."""

    def __init__(self, *, models: tuple[str, ...] = ("scripted-model",)) -> None:
        self.models = models
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Step]] = defaultdict(deque)
        self._defaults: dict[str, Step] = default_steps()
        self._body_responders: dict[str, Callable[[dict[str, Any]], Step]] = {}
        self._requests: list[RecordedRequest] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._stopping: asyncio.Event | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self.port = 0

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> ScriptedServer:
        """Bind 127.0.0.1 on a free port and serve from a background thread."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._stopping = asyncio.Event()
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve_connection, "127.0.0.1", 0)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # surface bind errors in the starting thread
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="scripted-provider", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("scripted provider did not start")
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Stop serving: close the listener, end hanging replies, join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        with contextlib.suppress(Exception):
            future.result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    async def _shutdown(self) -> None:
        assert self._server is not None and self._stopping is not None
        self._server.close()
        self._stopping.set()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- scripting -----------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The OpenAI SDK's base URL (with ``/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        """The Anthropic SDK's base URL (it adds ``/v1/messages`` itself)."""
        return f"http://127.0.0.1:{self.port}"

    def script(self, purpose: str, *steps: Step) -> None:
        """Queue ``steps`` for ``purpose``; each request with that purpose consumes the next one."""
        with self._lock:
            self._queues[purpose].extend(steps)

    def set_default(self, purpose: str, step: Step) -> None:
        """The step ``purpose`` gets whenever its queue is empty."""
        with self._lock:
            self._defaults[purpose] = step

    def respond_with(self, purpose: str, responder: Callable[[dict[str, Any]], Step]) -> None:
        """When ``purpose``'s queue is empty, ``responder(request body)`` picks the step (instead of
        the default): e.g. usage computed from what was sent, or an overflow when it is too long."""
        with self._lock:
            self._body_responders[purpose] = responder

    def pending(self, purpose: str) -> int:
        """How many scripted steps of ``purpose`` are still unconsumed."""
        with self._lock:
            return len(self._queues[purpose])

    def requests(self, purpose: str | None = None, *, path: str | None = None) -> list[RecordedRequest]:
        """Requests received so far, in order (optionally only one purpose / one path)."""
        with self._lock:
            found = list(self._requests)
        return [
            r for r in found if (purpose is None or r.purpose == purpose) and (path is None or r.path == path)
        ]

    def reset(self) -> None:
        """Forget scripted steps, custom defaults and recorded requests."""
        with self._lock:
            self._queues.clear()
            self._defaults = default_steps()
            self._body_responders.clear()
            self._requests.clear()

    def _next_step(self, purpose: str | None) -> Step:
        with self._lock:
            key = purpose or "answer"
            queue = self._queues.get(key)
            if queue:
                return queue.popleft()
            return self._defaults.get(key) or self._defaults["answer"]

    def _pick_step(self, purpose: str | None, body: Any) -> Step:
        """A scripted step first; else the purpose's responder (:meth:`respond_with`); else the default."""
        with self._lock:
            key = purpose or "answer"
            responder = None if self._queues.get(key) else self._body_responders.get(key)
        if responder is not None:
            return responder(body if isinstance(body, dict) else {})
        return self._next_step(purpose)

    # ---- HTTP ----------------------------------------------------------------------------------
    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            request = await _read_request(reader)
            if request is None:
                return
            with self._lock:
                self._requests.append(request)
            await self._route(request, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _route(
        self, request: RecordedRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        path = request.path.split("?", 1)[0].rstrip("/")
        if request.method == "GET" and path == "/v1/models":
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "scripted"} for m in self.models]
            await _send_json(writer, 200, {"object": "list", "data": data})
            return
        if request.method == "POST" and path in ("/v1/chat/completions", "/v1/messages"):
            step = self._pick_step(request.purpose, request.body)
            if step.delay_before_s:
                await asyncio.sleep(step.delay_before_s)
            if step.status >= 400:
                await _send_json(writer, step.status, step.body, step.headers)
                return
            if step.hangs and not step.content:
                await self._hang(reader)
                return
            body = request.body if isinstance(request.body, dict) else {}
            if isinstance(step.usage, CountedUsage):
                step = replace(step, usage=step.usage.resolve(body))
            anthropic = path == "/v1/messages"
            if body.get("stream"):
                render = self._anthropic_events if anthropic else self._openai_events
                await self._stream(writer, reader, step, render(step, body))
            else:
                reply = (
                    self._anthropic_message(step, body) if anthropic else self._openai_completion(step, body)
                )
                await _send_json(writer, 200, reply)
            return
        await _send_json(
            writer, 404, {"error": {"message": f"no route {request.method} {path}", "type": "x"}}
        )

    async def _hang(self, reader: asyncio.StreamReader) -> None:
        """Wait until the client gives up (closes the socket) or the server stops."""
        assert self._stopping is not None
        closed = asyncio.ensure_future(reader.read(1))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            stopping.cancel()

    async def _stream(
        self,
        writer: asyncio.StreamWriter,
        reader: asyncio.StreamReader,
        step: Step,
        events: list[_Event],
    ) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        await writer.drain()
        for event in events:
            if event.kind == "pause":
                if step.delay_between_s:
                    await asyncio.sleep(step.delay_between_s)
                continue
            if event.kind == "hang":
                await self._hang(reader)
                return
            if event.kind == "break":
                # End the connection without the terminating chunk: the client sees a broken body.
                writer.transport.abort()
                return
            await _write_chunk(writer, event.data)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    # ---- OpenAI rendering ------------------------------------------------------------------------
    def _openai_events(self, step: Step, body: dict[str, Any]) -> list[_Event]:
        completion_id = f"chatcmpl-scripted-{next(self._ids)}"
        model = str(body.get("model", "scripted-model"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> _Event:
            data = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            return _Event.sse(data)

        def usage_chunk() -> _Event:
            data: dict[str, Any] = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [],
                "usage": _resolved(step).openai(),
            }
            return _Event.sse(data)

        send_usage = step.usage is not None and include_usage
        events: list[_Event] = [chunk({"role": "assistant", "content": ""})]
        if send_usage and step.usage_first:
            events.append(usage_chunk())
        for piece in _split(step.reasoning, step.chunks):
            events += [_Event.pause(), chunk({step.reasoning_field: piece})]
        for piece in _split(step.content, step.chunks):
            events += [_Event.pause(), chunk({"content": piece})]
        if step.tool is not None:
            call = step.tool
            opening = {
                "index": 0,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            events += [
                _Event.pause(),
                chunk({"tool_calls": [opening]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": call.arguments}}]}),
            ]
        if step.stream_error is not None:
            error = step.stream_error if "error" in step.stream_error else {"error": step.stream_error}
            return [*events, _Event.pause(), _Event.sse(error), _Event.raw(b"data: [DONE]\n\n")]
        if step.stream_error_text is not None:
            chunk_data = b"data: " + step.stream_error_text.encode() + b"\n\n"
            return [*events, _Event.pause(), _Event.raw(chunk_data), _Event.raw(b"data: [DONE]\n\n")]
        if step.break_stream:
            return [*events, _Event.pause(), _Event.broken()]
        if step.hangs:
            return [*events, _Event.hanging()]
        if step.finish_reason is not None:
            events += [_Event.pause(), chunk({}, step.finish_reason)]
        if send_usage and not step.usage_first:
            events.append(usage_chunk())
        events.append(_Event.raw(b"data: [DONE]\n\n"))
        return events

    def _openai_completion(self, step: Step, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": step.content or None}
        if step.reasoning:
            message[step.reasoning_field] = step.reasoning
        if step.tool is not None:
            message["tool_calls"] = [
                {
                    "id": step.tool.id,
                    "type": "function",
                    "function": {"name": step.tool.name, "arguments": step.tool.arguments},
                }
            ]
        reply: dict[str, Any] = {
            "id": f"chatcmpl-scripted-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model", "scripted-model")),
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": step.finish_reason}
            ],
        }
        if step.usage is not None:
            reply["usage"] = _resolved(step).openai()
        return reply

    # ---- Anthropic rendering ---------------------------------------------------------------------
    def _anthropic_events(self, step: Step, body: dict[str, Any]) -> list[_Event]:
        message: dict[str, Any] = {
            "id": f"msg_scripted_{next(self._ids)}",
            "type": "message",
            "role": "assistant",
            "model": str(body.get("model", "scripted-model")),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
        }
        if step.usage is not None:
            message["usage"] = {**_resolved(step).anthropic_input(), "output_tokens": 1}
        events: list[_Event] = [
            _Event.anthropic("message_start", {"type": "message_start", "message": message})
        ]
        index = 0

        def block(start: dict[str, Any], deltas: Sequence[dict[str, Any]]) -> None:
            nonlocal index
            events.append(
                _Event.anthropic(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": start},
                )
            )
            for delta in deltas:
                events.append(_Event.pause())
                events.append(
                    _Event.anthropic(
                        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
                    )
                )
            events.append(
                _Event.anthropic("content_block_stop", {"type": "content_block_stop", "index": index})
            )
            index += 1

        if step.reasoning:
            thinking = [
                {"type": "thinking_delta", "thinking": p} for p in _split(step.reasoning, step.chunks)
            ]
            signature = {"type": "signature_delta", "signature": "c2NyaXB0ZWQ="}
            block({"type": "thinking", "thinking": "", "signature": ""}, [*thinking, signature])
        if step.content:
            pieces = _split(step.content, step.chunks)
            if (
                step.stream_error is not None
                or step.stream_error_text is not None
                or step.break_stream
                or step.hangs
            ):
                # The failure comes mid-block: open the block and send the text, never close it.
                events.append(
                    _Event.anthropic(
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "index": index,
                            "content_block": {"type": "text", "text": ""},
                        },
                    )
                )
                for piece in pieces:
                    events.append(_Event.pause())
                    events.append(
                        _Event.anthropic(
                            "content_block_delta",
                            {
                                "type": "content_block_delta",
                                "index": index,
                                "delta": {"type": "text_delta", "text": piece},
                            },
                        )
                    )
            else:
                block({"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in pieces])
        if step.stream_error is not None:
            error = step.stream_error
            if "type" not in error or error.get("type") != "error":
                inner = error.get("error", error)
                error = {"type": "error", "error": inner}
            return [*events, _Event.pause(), _Event.anthropic("error", error)]
        if step.stream_error_text is not None:
            chunk_data = b"event: error\ndata: " + step.stream_error_text.encode() + b"\n\n"
            return [*events, _Event.pause(), _Event.raw(chunk_data)]
        if step.break_stream:
            return [*events, _Event.pause(), _Event.broken()]
        if step.hangs:
            return [*events, _Event.hanging()]
        if step.tool is not None:
            call = step.tool
            block(
                {"type": "tool_use", "id": call.id, "name": call.name, "input": {}},
                [{"type": "input_json_delta", "partial_json": call.arguments}],
            )
        stop = _ANTHROPIC_STOP.get(step.finish_reason or "", step.finish_reason)
        delta_usage = {"output_tokens": _resolved(step).completion_tokens} if step.usage is not None else None
        message_delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None},
        }
        if delta_usage is not None:
            message_delta["usage"] = delta_usage
        events += [
            _Event.pause(),
            _Event.anthropic("message_delta", message_delta),
            _Event.anthropic("message_stop", {"type": "message_stop"}),
        ]
        return events

    def _anthropic_message(self, step: Step, body: dict[str, Any]) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if step.reasoning:
            content.append({"type": "thinking", "thinking": step.reasoning, "signature": "c2NyaXB0ZWQ="})
        if step.content:
            content.append({"type": "text", "text": step.content})
        if step.tool is not None:
            content.append(
                {
                    "type": "tool_use",
                    "id": step.tool.id,
                    "name": step.tool.name,
                    "input": json.loads(step.tool.arguments or "{}"),
                }
            )
        reply: dict[str, Any] = {
            "id": f"msg_scripted_{next(self._ids)}",
            "type": "message",
            "role": "assistant",
            "model": str(body.get("model", "scripted-model")),
            "content": content,
            "stop_reason": _ANTHROPIC_STOP.get(step.finish_reason or "", step.finish_reason),
            "stop_sequence": None,
        }
        if step.usage is not None:
            reply["usage"] = {
                **_resolved(step).anthropic_input(),
                "output_tokens": _resolved(step).completion_tokens,
            }
        return reply


@dataclass(frozen=True)
class _Event:
    """One thing to do on a streaming response."""

    kind: str  # "data" | "pause" | "break" | "hang"
    data: bytes = b""

    @classmethod
    def sse(cls, payload: Any) -> _Event:
        return cls("data", b"data: " + json.dumps(payload).encode() + b"\n\n")

    @classmethod
    def anthropic(cls, name: str, payload: Any) -> _Event:
        return cls("data", f"event: {name}\n".encode() + b"data: " + json.dumps(payload).encode() + b"\n\n")

    @classmethod
    def raw(cls, data: bytes) -> _Event:
        return cls("data", data)

    @classmethod
    def pause(cls) -> _Event:
        return cls("pause")

    @classmethod
    def broken(cls) -> _Event:
        return cls("break")

    @classmethod
    def hanging(cls) -> _Event:
        return cls("hang")


def _split(text: str, chunks: int) -> list[str]:
    """``text`` in ``chunks`` nearly equal pieces (fewer if the text is shorter)."""
    if not text:
        return []
    chunks = max(1, min(chunks, len(text)))
    size, extra = divmod(len(text), chunks)
    pieces, start = [], 0
    for i in range(chunks):
        end = start + size + (1 if i < extra else 0)
        pieces.append(text[start:end])
        start = end
    return pieces


async def _read_request(reader: asyncio.StreamReader) -> RecordedRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    raw = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            raw += await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        raw = await reader.readexactly(int(headers["content-length"]))
    body: Any = None
    if raw:
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", errors="replace")
    return RecordedRequest(method=method, path=target, headers=headers, body=body, at=time.monotonic())


async def _send_json(
    writer: asyncio.StreamWriter, status: int, body: Any, headers: Mapping[str, str] | None = None
) -> None:
    if isinstance(body, str):
        payload, content_type = body.encode(), "text/plain; charset=utf-8"
    else:
        payload, content_type = json.dumps(body).encode(), "application/json"
    headers = dict(headers or {})
    # A scripted content-type wins: a server may label as JSON a body that does not parse.
    for name in [n for n in headers if n.lower() == "content-type"]:
        content_type = headers.pop(name)
    reason = http.HTTPStatus(status).phrase if status in http.HTTPStatus._value2member_map_ else "Status"
    head = [f"HTTP/1.1 {status} {reason}", f"content-type: {content_type}", f"content-length: {len(payload)}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    head.append("connection: close")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
    await writer.drain()


async def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


@pytest.fixture
def scripted_server() -> Iterator[ScriptedServer]:
    """A started :class:`ScriptedServer`, stopped after the test."""
    with ScriptedServer() as server:
        yield server
