"""The client's own logic without a server: SSE parsing, rendering, and resuming a dropped stream."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service import client as cli_client
from service.cli import build_parser
from service.client import follow
from service.client.render import Renderer, describe_fidelity, describe_progress, format_error
from service.client.sse import SseMessage, iter_sse


def sse(event_id: int, event: str, **data: Any) -> bytes:
    payload = json.dumps({"seq": event_id, **data})
    return f"id: {event_id}\nevent: {event}\ndata: {payload}\n\n".encode()


class Dropping(httpx.SyncByteStream):
    """A response body that sends ``chunks`` and then, if told to, breaks like a reset connection."""

    def __init__(self, chunks: list[bytes], *, drop: bool) -> None:
        self.chunks = chunks
        self.drop = drop

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        if self.drop:
            raise httpx.ReadError("connection reset by peer")


def renderer() -> tuple[Renderer, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Renderer(out=out, err=err, live=False), out, err


def test_sse_parser_joins_data_lines_and_returns_comment_blocks_as_non_events() -> None:
    lines = [
        ": sidequest stream",
        "retry: 3000",
        "",
        "id: 7",
        "event: delta",
        'data: {"text":',
        'data:  "hi"}',
        "",
        ": ping",
        "",
        "data: no event name",
        "",
        "id: 9",
        "event: half",
        "data: cut off by the end of the stream",
    ]
    messages = list(iter_sse(lines))
    assert messages == [
        SseMessage(event=None, data="", id=None, retry_ms=3000, comments=("sidequest stream",)),
        SseMessage(event="delta", data='{"text":\n "hi"}', id="7"),
        SseMessage(event=None, data="", id="7", comments=("ping",)),
        SseMessage(event="message", data="no event name", id="7"),
    ]


def test_progress_lines_name_what_is_being_done() -> None:
    chunk = {
        "stage": "compacting_context",
        "what": "summary_chunk",
        "purpose": "context_summary",
        "chunk": 2,
        "chunks": 5,
    }
    assert describe_progress(chunk) == "context summary chunk 2/5"
    replay = {
        "what": "replay",
        "replayed_groups": 3,
        "replayed_ordinals": [4, 6],
        "folded_groups": 2,
        "seq": 4,
    }
    assert describe_progress(replay) == "replaying 3 Q&A groups (#4–#6), folding 2 into the rolling summary"
    cache = {"what": "context_summary_cache", "cache": "hit", "key": "k", "covered_messages": 40}
    assert describe_progress({"what": "replay", "replayed_groups": 1, "replayed_ordinals": [3, 3]}) == (
        "replaying 1 Q&A group (#3)"
    )
    assert describe_progress({"what": "replay", "replayed_groups": 0, "folded_groups": 0}) == (
        "no earlier Q&A in this session"
    )
    assert describe_progress(cache) == "context summary cache hit (40 messages)"
    assert describe_progress({"what": "overflow_retry", "estimate_after": 900, "retry": 1}).startswith(
        "context overflow: retrying once"
    )
    assert describe_progress({"stage": "answering", "what": "something_new", "n": 2}) == "something new n=2"
    masked = {
        "what": "context_masked",
        "tier": "masked",
        "groups": 9,
        "masked_messages": 9,
        "payload_bytes": 7150,
    }
    assert (
        describe_progress(masked)
        == "masked the tool output of 9 older messages (7.2 KB elided) for tier masked"
    )


def test_errors_show_code_message_and_detail() -> None:
    text = format_error(
        {"code": "provider_error", "message": "the provider failed", "detail": {"status": 500}}
    )
    assert text == "provider_error: the provider failed (status=500)"


def test_a_dropped_stream_resumes_after_the_last_event_without_repeating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli_client, "pause", lambda _s: None)
    seen_headers: list[str | None] = []
    record = {"id": "r1", "answer": "Hello, world", "status": "succeeded", "usage": {"input_tokens": 5}}

    def handler(request: httpx.Request) -> httpx.Response:
        last = request.headers.get("last-event-id")
        seen_headers.append(last)
        if last is None:
            chunks = [
                b"retry: 10\n\n",
                sse(1, "status", status="running", stage="preparing"),
                sse(2, "progress", stage="organizing_history", what="replay", replayed_groups=2),
                sse(3, "delta", text="Hello"),
                b'id: 4\nevent: delta\ndata: {"te',  # the connection breaks inside a message
            ]
            return httpx.Response(200, stream=Dropping(chunks, drop=True))
        assert last == "3"
        chunks = [
            sse(4, "delta", text=", world"),
            sse(5, "usage", usage={"input_tokens": 5, "output_tokens": 2, "calls": [{}]}),
            sse(6, "status", status="succeeded", stage=None),
            sse(7, "done", record=record),
        ]
        return httpx.Response(200, stream=Dropping(chunks, drop=False))

    render, out, err = renderer()
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://sq") as client:
        outcome = follow(client, "r1", render)
    assert outcome.status == "succeeded"
    assert seen_headers == [None, "3"]
    assert out.getvalue() == "Hello, world\n"
    log = err.getvalue()
    assert "stage preparing" in log and "organizing_history: replaying 2 Q&A groups" in log
    assert "resuming after event 3" in log
    assert "usage: in 5 · out 2 · 1 call" in log
    assert "succeeded" in log.splitlines()[-1]


def test_a_failed_request_ends_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def handler(_request: httpx.Request) -> httpx.Response:
        chunks = [
            sse(1, "status", status="running", stage="answering"),
            sse(2, "status", status="failed", stage="answering"),
            sse(
                3,
                "error",
                code="timeout",
                message="deadline passed",
                detail={"timeout_s": 1, "stage": "answering"},
            ),
        ]
        return httpx.Response(200, stream=Dropping(chunks, drop=False))

    render, out, err = renderer()
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://sq") as client:
        outcome = follow(client, "r1", render)
    assert outcome.status == "failed" and outcome.error is not None and outcome.error["code"] == "timeout"
    assert 'failed: timeout: deadline passed (timeout_s=1, stage="answering")' in err.getvalue()
    assert out.getvalue() == ""


def test_a_stream_that_never_comes_back_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_client, "pause", lambda _s: None)
    calls = 0

    def handler(_request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused")

    render, _out, _err = renderer()
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://sq") as client:
        with pytest.raises(cli_client.ClientError, match="gave up after 3 reconnects"):
            follow(client, "r1", render, max_reconnects=3)
    assert calls == 4


def test_resuming_past_the_end_reads_the_final_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_client, "pause", lambda _s: None)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            if request.headers.get("last-event-id") is None:
                return httpx.Response(200, stream=Dropping([sse(1, "delta", text="Par")], drop=True))
            return httpx.Response(204)
        return httpx.Response(200, json={"id": "r1", "status": "succeeded", "answer": "Partial answer"})

    render, out, _err = renderer()
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://sq") as client:
        outcome = follow(client, "r1", render)
    assert outcome.status == "succeeded"
    assert out.getvalue() == "Partial answer\n"


def test_a_worker_lost_rerun_discards_the_streamed_text() -> None:
    render, out, err = renderer()
    render.handle("delta", {"text": "first try"})
    render.handle(
        "progress", {"stage": "answering", "what": "worker_lost_rerun", "discard_streamed_text": True}
    )
    render.handle("delta", {"text": "second"})
    outcome = render.handle(
        "done", {"record": {"answer": "second try", "truncated": True, "stop_reason": "length"}}
    )
    assert outcome is not None and outcome.status == "succeeded"
    assert out.getvalue() == "first try\nsecond try\n"
    assert "answer restarts" in err.getvalue()
    assert "answer truncated: stop reason length" in err.getvalue()


def test_a_superseded_request_ends_as_cancelled_not_failed() -> None:
    """`sidequest ask` reports the request's status, cancelled, not "failed: superseded…"."""
    error = {
        "code": "superseded",
        "message": "cancelled because a newer question interrupted it",
        "detail": {},
    }
    streams: list[list[tuple[str, dict[str, Any]]]] = [
        [("status", {"status": "cancelled", "stage": "answering"}), ("error", error)],
        [("error", error)],
    ]
    for stream in streams:
        render, _, err = renderer()
        outcomes = [render.handle(event, data) for event, data in stream]
        assert outcomes[-1] is not None and outcomes[-1].status == "cancelled"
        assert "cancelled: superseded" in err.getvalue()


def test_on_a_terminal_the_status_is_one_live_line_and_the_answer_owns_the_screen() -> None:
    out, err = io.StringIO(), io.StringIO()
    render = Renderer(out=out, err=err, live=True)
    render.handle("status", {"status": "running", "stage": "preparing"})
    render.handle(
        "progress", {"stage": "compacting_context", "what": "summary_chunk", "chunk": 1, "chunks": 2}
    )
    assert "\n" not in err.getvalue() and err.getvalue().count("\r\x1b[2K") == 2
    render.handle("delta", {"text": "Hello"})
    render.handle("usage", {"usage": {"input_tokens": 3, "calls": [{}]}})  # not drawn over the answer
    outcome = render.handle(
        "done", {"record": {"answer": "Hello", "usage": {"input_tokens": 3, "calls": [{}]}}}
    )
    assert outcome is not None and out.getvalue() == "Hello\n"
    assert "usage:" not in err.getvalue()
    assert err.getvalue().endswith("succeeded · in 3 · out 0 · 1 call\n")


def _fidelity(tier: str, verbatim: int, masked: int, payload: int, summarized: int) -> dict[str, Any]:
    return {
        "tier": tier,
        "verbatim_messages": verbatim,
        "masked_messages": masked,
        "masked_payload_bytes": payload,
        "summarized_messages": summarized,
        "artifacts": {"total": 95, "in_prompt": 80 if summarized else 95},
    }


def test_the_fidelity_line_names_the_tier_and_every_message_count() -> None:
    assert describe_fidelity(_fidelity("masked", 120, 40, 310_400, 0)) == (
        "context: masked — 120 verbatim, 40 masked (310 KB elided), 0 summarised messages;"
        " artifacts 95 of 95 in the prompt"
    )
    assert describe_fidelity(_fidelity("summary", 35, 1, 4_250, 80)) == (
        "context: summary — 35 verbatim, 1 masked (4.2 KB elided), 80 summarised messages;"
        " artifacts 80 of 95 in the prompt"
    )
    # Nothing masked: no "(0 bytes elided)"; a megabyte in MB.
    assert describe_fidelity(_fidelity("summary", 35, 0, 0, 1)) == (
        "context: summary — 35 verbatim, 0 masked, 1 summarised message; artifacts 80 of 95 in the prompt"
    )
    assert "(1.2 MB elided)" in str(describe_fidelity(_fidelity("masked", 9, 300, 1_234_567, 0)))
    # Tier none: the whole snapshot as it was, said in words rather than three counts.
    none = {**_fidelity("none", 7, 0, 0, 0), "artifacts": {"total": 0, "in_prompt": 0}}
    assert describe_fidelity(none) == (
        "context: not compacted — the whole snapshot went verbatim (7 messages);"
        " no tool-call artifacts in the snapshot"
    )
    # No snapshot, or the request never built its answer request: no line at all.
    assert describe_fidelity(None) is None


def test_the_fidelity_line_comes_after_the_answer_and_before_the_outcome() -> None:
    render, out, err = renderer()
    render.handle("delta", {"text": "Modules 1 to 4."})
    record = {
        "answer": "Modules 1 to 4.",
        "context_info": {"fidelity": _fidelity("masked", 120, 40, 310_400, 0)},
        "usage": {"input_tokens": 3000, "output_tokens": 5, "calls": [{}]},
    }
    assert render.handle("done", {"record": record}) is not None
    assert out.getvalue() == "Modules 1 to 4.\n"  # stdout stays the answer alone
    lines = [line.split("] ", 1)[1] for line in err.getvalue().splitlines()]
    assert lines == [
        "context: masked — 120 verbatim, 40 masked (310 KB elided), 0 summarised messages;"
        " artifacts 95 of 95 in the prompt",
        "succeeded · in 3000 · out 5 · 1 call",
    ]
    # A record whose fidelity is null (no snapshot) or absent (an older server): no context line.
    for info in ({"fidelity": None}, {}, None):
        render, _out, err = renderer()
        render.handle("done", {"record": {"answer": "x", "context_info": info}})
        assert "context:" not in err.getvalue() and err.getvalue().count("\n") == 1


def test_a_server_that_is_not_sidequest_is_one_clear_line_not_a_traceback() -> None:
    class NotSidequest(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>a web page</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotSidequest) as web:
        threading.Thread(target=web.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{web.server_address[1]}"
        out, err = io.StringIO(), io.StringIO()
        try:
            code = cli_client.main(build_parser().parse_args(["sessions", "--url", url]), out=out, err=err)
        finally:
            web.shutdown()
    assert code == 2
    expected = f"sidequest: {url} answered HTTP 200 without a JSON body; is it a Sidequest server?\n"
    assert err.getvalue() == expected
