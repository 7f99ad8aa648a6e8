"""The client half of the ``sidequest`` command (``ask``, ``sessions``, ``archive export|import``,
``handoff``) over HTTP; what each prints, and the exit codes, are in docs/quickstart.md.

``ask`` writes status, progress and usage to stderr and only the answer to stdout, so
``sidequest ask … > answer.txt`` captures just the answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

import httpx

from service.budget.handoff import ordinal_runs
from service.client.render import Outcome, Renderer, format_error, plural
from service.client.sse import iter_sse
from service.vocabulary import Status

DEFAULT_URL = "http://127.0.0.1:8080"
EXIT_OK = 0
EXIT_REQUEST_FAILED = 1
EXIT_CLIENT_ERROR = 2
EXIT_INTERRUPTED = 130

# The server pings idle streams every 15 s; four missed pings mean the connection is dead.
STREAM_READ_TIMEOUT_S = 60.0
# Consecutive reconnects without a single new event before giving up.
MAX_RECONNECTS = 8
MAX_RETRY_WAIT_S = 5.0


class ClientError(Exception):
    """The command cannot continue; its message is printed and the command exits with 2."""


def _client(args: argparse.Namespace) -> httpx.Client:
    """A client of the server at ``--url``, with ``--token`` (or their environment variables)."""
    headers = {"User-Agent": "sidequest-cli"}
    if token := args.token or os.environ.get("SIDEQUEST_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(
        base_url=(args.url or os.environ.get("SIDEQUEST_URL") or DEFAULT_URL).rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(30.0, read=STREAM_READ_TIMEOUT_S),
        trust_env=False,  # a local service: never route through a proxy from the environment
    )


def _call(
    client: httpx.Client, method: str, path: str, what: str, ok: tuple[int, ...] = (200,), **kw: Any
) -> Any:
    """The JSON body of ``method path``; an unreachable server, or a status not in ``ok`` (the
    server's refusal of ``what``), is a :class:`ClientError`."""
    try:
        response = client.request(method, path, **kw)
    except httpx.TransportError as exc:
        # httpx keeps a base URL with a trailing "/" (and normalised); the message names it without.
        raise ClientError(f"cannot reach {str(client.base_url).rstrip('/')}: {exc}") from None
    if response.status_code not in ok:
        raise _refused(response, what)
    try:
        return response.json()
    except ValueError:  # --url names some other web server
        raise ClientError(
            f"{str(client.base_url).rstrip('/')} answered HTTP {response.status_code} without a JSON body;"
            " is it a Sidequest server?"
        ) from None


def _path_id(value: str) -> str:
    return quote(value, safe="")


def _refused(response: httpx.Response, action: str) -> ClientError:
    """The server's error body as one clear message, a list of problems one per line."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return ClientError(f"{action} refused: HTTP {response.status_code} {response.text[:200]}")
    refused = f"{action} refused ({response.status_code})"
    problems = error["detail"].get("errors") if isinstance(error.get("detail"), dict) else None
    if not isinstance(problems, list) or not problems:
        return ClientError(f"{refused} {format_error(error)}")
    message = f"{refused} {error.get('code')}: {error.get('message')}"
    for problem in problems[:20]:
        if isinstance(problem, dict):
            loc = ".".join(str(p) for p in found) if isinstance(found := problem.get("loc"), list) else found
            message += f"\n  {loc}: {problem.get('message') or problem.get('msg')}"
    return ClientError(message)


def _read_json_file(name: str, what: str) -> tuple[bytes, Any]:
    """The raw bytes and parsed JSON of a file (``-`` is stdin)."""
    try:
        raw = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
    except OSError as exc:
        raise ClientError(f"cannot read {what} {name}: {exc.strerror or exc}") from None
    try:
        return raw, json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ClientError(f"{what} {name} is not valid JSON: {exc}") from None


def _question_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"question": args.question}
    if args.snapshot:
        _raw, snapshot = _read_json_file(args.snapshot, "snapshot")
        if not isinstance(snapshot, dict):
            raise ClientError(f"snapshot {args.snapshot} must be a JSON object")
        body["snapshot"] = snapshot
    if args.snapshot_id:
        body["snapshot_id"] = args.snapshot_id
    for name in ("model", "max_output_tokens"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    return body


def pause(seconds: float) -> None:
    """Wait before reconnecting (a function of its own so tests can skip the wait)."""
    time.sleep(seconds)


def follow(
    client: httpx.Client,
    request_id: str,
    renderer: Renderer,
    *,
    max_reconnects: int = MAX_RECONNECTS,
) -> Outcome:
    """Follow the request's event stream to its terminal event, resuming with ``Last-Event-ID``."""
    last_id: str | None = None
    retry_s = 1.0
    failures = 0
    path = f"/v1/questions/{_path_id(request_id)}/events"
    while True:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
        progressed = False
        try:
            with client.stream("GET", path, headers=headers) as response:
                if response.status_code == 204:
                    return _final_outcome(client, request_id, renderer)
                if response.status_code != 200:
                    response.read()
                    raise _refused(response, "following the request")
                for message in iter_sse(response.iter_lines()):
                    if message.retry_ms is not None:
                        retry_s = min(message.retry_ms / 1000, MAX_RETRY_WAIT_S)
                    if message.id is not None:
                        last_id = message.id
                    if not message.event:
                        continue
                    progressed = True
                    try:
                        data = json.loads(message.data)
                    except ValueError:
                        continue  # not ours; never let one odd message end the stream
                    outcome = renderer.handle(message.event, data if isinstance(data, dict) else {})
                    if outcome is not None:
                        return outcome
            reason = "the stream ended before the request finished"
        except httpx.TransportError as exc:
            reason = f"the stream dropped ({type(exc).__name__})"
        failures = 0 if progressed else failures + 1
        if failures > max_reconnects:
            raise ClientError(f"{reason}; gave up after {max_reconnects} reconnects")
        renderer.note(f"{reason}; resuming after event {last_id or 0}")
        pause(retry_s * min(failures, 4) if failures else 0.05)


def _final_outcome(client: httpx.Client, request_id: str, renderer: Renderer) -> Outcome:
    """After a 204 (nothing after our cursor), the record tells how the request ended."""
    record = _call(client, "GET", f"/v1/questions/{_path_id(request_id)}", "reading the request")
    if record.get("status") == Status.SUCCEEDED:
        outcome = renderer.handle("done", {"record": record})
    else:
        outcome = renderer.handle("error", record.get("error") or {"code": record.get("status")})
    assert outcome is not None
    return outcome


def ask(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``sidequest ask``: post the question, render its stream, return the exit code."""
    renderer = Renderer(out=out, err=err, live=err.isatty())
    with _client(args) as client:
        path = f"/v1/sessions/{_path_id(args.parent_id)}/questions"
        record = _call(client, "POST", path, "the question was", (200, 202), json=_question_body(args))
        request_id = str(record["id"])
        renderer.lasting(f"question #{record.get('ordinal')} admitted ({request_id}) in {args.parent_id}")
        try:
            outcome = follow(client, request_id, renderer)
        except KeyboardInterrupt:
            renderer.lasting("interrupted: cancelling the request")
            try:
                client.post(f"/v1/questions/{_path_id(request_id)}/cancel", timeout=5.0)
            except httpx.HTTPError:
                err.write(f"could not cancel {request_id}; it keeps running on the server\n")
            return EXIT_INTERRUPTED
    return EXIT_OK if outcome.status == Status.SUCCEEDED else EXIT_REQUEST_FAILED


def archive_export(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``sidequest archive export``: write the session's archive to a file or stdout."""
    path = f"/v1/sessions/{_path_id(args.parent_id)}/archive"
    with _client(args) as client:
        document = _call(client, "GET", path, "the export was", params={"version": args.version})
    text = json.dumps(document, ensure_ascii=False, indent=2) + "\n"
    if args.output in (None, "-"):
        out.write(text)
        out.flush()
    else:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise ClientError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        err.write(
            f"exported {plural(len(document.get('questions', [])), 'request')} of {args.parent_id} "
            f"(archive version {document.get('version')}) to {args.output}\n"
        )
    return EXIT_OK


def archive_import(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``sidequest archive import``: restore an archive file into a session."""
    raw, document = _read_json_file(args.file, "archive")
    if not isinstance(document, dict):
        raise ClientError(
            f"{args.file} is not an archive: an archive is a JSON object with a version, "
            "a parent_id and questions"
        )
    parent_id = args.parent_id or document.get("parent_id")
    if not isinstance(parent_id, str) or not parent_id:
        raise ClientError("the archive names no parent_id; pass --parent-id")
    path = f"/v1/sessions/{_path_id(parent_id)}/archive"
    params = {"mode": "replace"} if args.replace else {}
    headers = {"Content-Type": "application/json"}
    with _client(args) as client:
        result = _call(client, "POST", path, "the import was", content=raw, params=params, headers=headers)
    replaced = f", replacing {result['replaced']}" if result.get("replaced") else ""
    out.write(
        f"restored {plural(result.get('restored'), 'request')} into {parent_id} "
        f"(archive version {result.get('version')}{replaced}); next ordinal {result.get('next_ordinal')}\n"
    )
    return EXIT_OK


def handoff(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``sidequest handoff``: the block on stdout as it is (the text, or the message JSON), what it
    carried on stderr (docs/handoff.md); nothing to hand off is a note on stderr and exit 0."""
    body: dict[str, Any] = {"format": args.format, "include": "all" if args.all else "new"}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    path = f"/v1/sessions/{_path_id(args.parent_id)}/handoffs"
    with _client(args) as client:
        result = _call(client, "POST", path, "the hand-off was", (200, 201), json=body)
    ordinals = result.get("ordinals") or []
    if not ordinals:
        err.write(f"nothing to hand off in {args.parent_id}\n")
        return EXIT_OK
    if result.get("message") is not None:
        out.write(json.dumps(result["message"], ensure_ascii=False, indent=2) + "\n")
    else:
        out.write(str(result.get("text", "")) + "\n")
    out.flush()
    notes = [f"handed off {plural(len(ordinals), 'side answer')} ({ordinal_runs(ordinals)})"]
    if result.get("summarized_ordinals"):
        notes.append(f"{len(result['summarized_ordinals'])} through the Q&A summary")
    omitted = result.get("omitted_ordinals") or []
    # Truncated with nothing left out: something was cut (an answer, a question or the summary).
    if result.get("shortened_ordinals") or (result.get("truncated") and not omitted):
        notes.append("shortened to fit")
    if omitted:
        # Not carried; pinned for the next hand-off unless handed off before (docs/handoff.md).
        notes.append(
            f"{plural(len(omitted), 'side answer')} ({ordinal_runs(omitted)}) left out to fit"
            " (each not handed off before is pinned for the next hand-off; a larger --max-tokens"
            " carries them now)"
        )
    err.write(", ".join(notes) + f"; about {result.get('estimate_tokens')} tokens\n")
    return EXIT_OK


def _session_line(item: dict[str, Any]) -> str:
    """One session as a table row: parent id, requests by status, clear version, last activity."""
    counts = item.get("counts")
    by_status = ", ".join(f"{n} {s}" for s, n in counts.items() if n) if isinstance(counts, dict) else ""
    return (
        f"{item.get('parent_id')}\t{by_status or 'no requests'}\tclear {item.get('clear_version')}"
        f"\t{item.get('updated_at')}"
    )


def list_sessions(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``sidequest sessions``: one line per session, most recently active first; without ``--all``
    one page, and the ``--before`` cursor of the next one on stderr."""
    params: dict[str, Any] = {"limit": args.limit}
    if args.before:
        params["before"] = args.before
    shown = 0
    with _client(args) as client:
        while True:
            page = _call(client, "GET", "/v1/sessions", "listing sessions was", params=params)
            for item in page.get("items") or []:
                out.write((json.dumps(item, ensure_ascii=False) if args.json else _session_line(item)) + "\n")
                shown += 1
            out.flush()
            cursor = page.get("next_before")
            if not page.get("has_more") or not cursor:
                break
            if not args.all:
                err.write(f"more sessions: sidequest sessions --before {cursor}\n")
                break
            params = {"limit": args.limit, "before": cursor}
    if shown == 0 and not args.json:
        err.write("no sessions\n")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO, TextIO], int]] = {
    "ask": ask,
    "archive export": archive_export,
    "archive import": archive_import,
    "handoff": handoff,
    "sessions": list_sessions,
}


def main(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run a client command; returns the exit code (docs/quickstart.md)."""
    out = out or sys.stdout
    err = err or sys.stderr
    # The CLI configures INFO logging for the server commands; a client's output is its rendering,
    # not one log line per HTTP request.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # service/cli.py calls this for these commands only, and argparse requires an archive's subcommand.
    name = f"archive {args.archive_command}" if args.command == "archive" else args.command
    try:
        return COMMANDS[name](args, out, err)
    except ClientError as exc:
        err.write(f"sidequest: {exc}\n")
        err.flush()
        return EXIT_CLIENT_ERROR
    except httpx.HTTPError as exc:
        err.write(f"sidequest: HTTP error: {exc}\n")
        return EXIT_CLIENT_ERROR
    except KeyboardInterrupt:  # before a request exists (while posting): nothing to cancel
        err.write("sidequest: interrupted\n")
        return EXIT_INTERRUPTED
