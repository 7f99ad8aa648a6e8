"""Nothing depends on session state behind a pooler in transaction mode (SPEC 9.1), read off the code.

PgBouncer in transaction mode gives a client a server connection for one transaction; whatever a
statement leaves on the session — a session advisory lock, a ``SET`` (or ``set_config(…, false)``),
a temporary table, a ``WITH HOLD`` cursor, a statement prepared under a name, a ``LISTEN`` — stays
with a server connection that the next transaction may not get. Every statement of the service is
in ``service/`` (the store, and the SQL its migrations install); this reads all of it. The LISTEN
connection (``service/store/listener.py``) is the one exception by design: it goes to
``SIDEQUEST_LISTEN_DATABASE_URL``, never through the pooler. ``tests/e2e/test_pgbouncer.py`` runs
the same paths through a real PgBouncer.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [
        *(ROOT / "service").rglob("*.py"),
        *(ROOT / "service").rglob("*.sql"),
        *(ROOT / "migrations").rglob("*.py"),
    ]
)
LISTENER = ROOT / "service" / "store" / "listener.py"

SESSION_STATE = {
    "a session advisory lock": re.compile(r"pg_(try_)?advisory_(un)?lock(_shared|_all)?\s*\(", re.I),
    "a session setting": re.compile(
        r"""(;|\bBEGIN|\$\$|\bTHEN|\bLOOP|\bELSE|\(\s*[rfbu]?["']{1,3})\s*SET\s+(SESSION\s+)?(?!LOCAL\b)[a-z_.]+\s*(=|\bTO\b)""",
        re.I,
    ),
    "set_config for the session": re.compile(r"set_config\s*\([^;]*?,\s*false\s*\)", re.I),
    "a temporary table": re.compile(r"\bCREATE\s+(GLOBAL\s+|LOCAL\s+)?TEMP(ORARY)?\s+TABLE\b", re.I),
    "a WITH HOLD cursor": re.compile(r"\bWITH\s+HOLD\b", re.I),
    "a statement prepared under a name": re.compile(r"\bPREPARE\s+\w+\s*(\(|\bAS\b)|\.prepare\(", re.I),
    "a LISTEN": re.compile(r"""["']\s*(UN)?LISTEN\b|add_listener\(""", re.I),
}


def test_the_audit_reads_the_service_and_its_migrations() -> None:
    names = {path.name for path in SOURCES}
    assert {"db.py", "queue.py", "events.py", "env.py", "0005_worker_statements.py"} <= names


def test_no_statement_depends_on_its_session() -> None:
    found = []
    for path in SOURCES:
        source = path.read_text(encoding="utf-8")
        for what, pattern in SESSION_STATE.items():
            if what == "a LISTEN" and path == LISTENER:
                continue
            for match in pattern.finditer(source):
                line = source.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}: {match.group(0)!r}")
    assert found == []


def test_the_audit_would_see_each_kind() -> None:
    samples = {
        "a session advisory lock": "SELECT pg_advisory_lock(42)",
        "a session setting": 'text("SET statement_timeout = 0")',
        "set_config for the session": "PERFORM set_config('work_mem', '64MB', false);",
        "a temporary table": "CREATE TEMP TABLE scratch (id int)",
        "a WITH HOLD cursor": "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
        "a statement prepared under a name": "PREPARE claim AS SELECT 1",
        "a LISTEN": 'await conn.execute("LISTEN sidequest_events")',
    }
    for what, sample in samples.items():
        assert SESSION_STATE[what].search(sample), what
    # What is fine behind the pooler is not flagged.
    for fine in (
        "PERFORM pg_advisory_xact_lock(p_lock_key);",
        "PERFORM set_config('synchronous_commit', 'off', true);",
        "UPDATE side_question_jobs SET status = :status",
        "ALTER COLUMN content SET COMPRESSION lz4",
    ):
        assert not any(pattern.search(fine) for pattern in SESSION_STATE.values()), fine
