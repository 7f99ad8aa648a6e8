"""The ``sidequest`` command: serve, api, worker, migrate, ask, sessions, archive, handoff."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

from service.budget.handoff import HANDOFF_MAX_TOKENS, HANDOFF_MIN_TOKENS
from service.config import Settings, SettingsError, load_settings, shown_url

log = logging.getLogger("sidequest")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def migrated_database(settings: Settings) -> Iterator[str]:
    """The database URL, migrated to head: the configured one, or an embedded server's (stopped on exit)."""
    from service.embedded import embedded_database
    from service.store.schema import upgrade_to_head

    with ExitStack() as stack:
        url = settings.database_url or stack.enter_context(embedded_database(settings.data_dir))
        upgrade_to_head(url)
        log.info("database migrated to head")
        yield url


class _Shutdown(Exception):
    """SIGINT / SIGTERM arrived: unwind so that an embedded PostgreSQL is stopped on the way out."""


def _raise_shutdown(signum: int, _frame: object) -> None:
    raise _Shutdown(signum)


def _serve(settings: Settings, host: str, port: int, *, api: bool, worker: bool) -> int:
    if api and not settings.tenant_tokens() and not _is_loopback(host):
        print(
            f"refusing to bind {host}: SIDEQUEST_API_TOKENS names no token, so the API has no auth; "
            "bind 127.0.0.1 or configure tokens",
            file=sys.stderr,
        )
        return 2
    import uvicorn

    from service.heap import freeze_startup_heap

    # uvicorn shuts down gracefully on a signal and then re-raises it to the handler that was in
    # place before it started; ours turns it into an exception so the `finally` below still runs.
    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    try:
        with migrated_database(settings) as url:
            if api:
                from service.api.app import create_app
                from service.serve import create_serving_app

                app = create_serving_app(settings, url) if worker else create_app(settings, url)
                freeze_startup_heap()
                uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
            else:
                from service.worker import run_worker_forever

                freeze_startup_heap()
                run_worker_forever(settings, url)
    except _Shutdown:
        log.info("stopped by signal")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sidequest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "API and worker in one process (migrates first)"),
        ("api", "the HTTP API alone (migrates first)"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=_port, default=8080)
    sub.add_parser("worker", help="the worker alone (migrates first)")
    sub.add_parser("migrate", help="alembic upgrade head")

    ask = sub.add_parser("ask", help="post a side question and render its stream")
    ask.add_argument("parent_id")
    ask.add_argument("question")
    snapshot = ask.add_mutually_exclusive_group()
    snapshot.add_argument(
        "--snapshot", metavar="FILE", help="a snapshot JSON file to send inline (- for stdin)"
    )
    snapshot.add_argument(
        "--snapshot-id", help="a snapshot already stored (with PUT, or inline by an earlier question)"
    )
    ask.add_argument("--model", help="model for this question (default: the server's)")
    ask.add_argument("--max-output-tokens", type=int, help="side answer output cap (256-32768)")
    ask.add_argument("--url", help="server URL (default $SIDEQUEST_URL or http://127.0.0.1:8080)")
    ask.add_argument("--token", help="bearer token (default $SIDEQUEST_TOKEN)")

    sessions = sub.add_parser("sessions", help="list the tenant's sessions, most recently active first")
    sessions.add_argument("--limit", type=int, default=20, help="sessions per page (1-100)")
    sessions.add_argument("--before", help="the cursor printed after the previous page")
    sessions.add_argument("--all", action="store_true", help="follow every page")
    sessions.add_argument("--json", action="store_true", help="one session object per line, as JSON")

    archive = sub.add_parser("archive", help="export or import a session archive")
    archive_sub = archive.add_subparsers(dest="archive_command", required=True)
    export = archive_sub.add_parser("export")
    export.add_argument("parent_id")
    export.add_argument("--version", type=int, default=3, choices=(1, 2, 3))
    export.add_argument("--output", "-o", default="-", help="file to write (default: stdout)")
    imp = archive_sub.add_parser("import")
    imp.add_argument("file")
    imp.add_argument("--parent-id", help="restore into this parent id (default: the archive's)")
    imp.add_argument("--replace", action="store_true", help="replace existing history")

    hand = sub.add_parser(
        "handoff", help="hand side findings back to the main conversation (prints the block)"
    )
    hand.add_argument("parent_id")
    hand.add_argument(
        "--format",
        choices=("text", "anthropic", "openai"),
        default="text",
        help="text (default): the block as plain text; anthropic / openai: the user message as JSON",
    )
    hand.add_argument(
        "--max-tokens",
        type=_handoff_tokens,
        help="the block's token limit (256-32768; default 2000)",
    )
    hand.add_argument("--all", action="store_true", help="every succeeded side answer, not only the new ones")
    for client_command in (sessions, export, imp, hand):
        client_command.add_argument("--url")
        client_command.add_argument("--token")
    return parser


def _int_in(low: int, high: int, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``, refused (exit 2) before anything starts."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be {what}from {low} to {high}, not {number}")
        return number

    return parse


_port = _int_in(1, 65535, "a TCP port ")  # ``--port`` (70000 would listen on 4464)
_handoff_tokens = _int_in(HANDOFF_MIN_TOKENS, HANDOFF_MAX_TOKENS)  # ``--max-tokens`` of a hand-off


def _provider_problem(settings: Settings) -> str | None:
    """Why the configured provider cannot be built (its SDK missing, say), before anything starts: a
    process that serves or works needs it, and failing later is a traceback per process."""
    import asyncio

    from service.providers import build_provider

    try:
        provider = build_provider(settings)
    except ValueError as exc:
        return str(exc)
    asyncio.run(provider.aclose())
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # a line per plugin, each start
    if args.command in ("ask", "archive", "handoff", "sessions"):
        from service import client

        return client.main(args)
    try:
        settings = load_settings()
        problem = _provider_problem(settings) if args.command in ("serve", "api", "worker") else None
    except SettingsError as exc:
        problem = str(exc)
    if problem is not None:
        print(f"sidequest: {problem}", file=sys.stderr)
        return 2
    try:
        if args.command == "migrate":
            with migrated_database(settings):
                return 0
        if args.command == "worker":
            return _serve(settings, "127.0.0.1", 0, api=False, worker=True)
        return _serve(settings, args.host, args.port, api=True, worker=args.command == "serve")
    except Exception as exc:
        from service.store.db import unusable_reason

        reason = unusable_reason(exc)
        if reason is None:
            raise
        where = shown_url(settings.database_url) if settings.database_url else "the embedded PostgreSQL"
        print(
            f"sidequest: cannot use the database ({where}, SIDEQUEST_DATABASE_URL): {reason}", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
