"""The store's SQL, read once from its one home, ``service/store/sql/*.sql`` (package data): named
queries (``-- name: claim_job``, used as ``queries.claim_job``, a ``text()`` clause) and the current
definitions of the SQL functions (``-- function: sidequest_claim``, applied by migrations).
docs/architecture.md, "The store's front door", has the convention and the tests that keep it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Final, Literal

from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

_HEADER: Final = re.compile(r"^-- (name|function): ([a-z_][a-z0-9_]*)[ \t]*$", re.MULTILINE)
_DEFINES: Final = re.compile(r"\ACREATE OR REPLACE (?:FUNCTION|PROCEDURE) ([a-z_][a-z0-9_]*)\s*\(")


@dataclass(frozen=True)
class Section:
    """One named section of a ``.sql`` file: a query or a function's definition."""

    kind: Literal["name", "function"]
    name: str
    file: str
    sql: str


def _strip_doc(body: str) -> str:
    """The section's SQL: its leading comment lines (what it is for) and blank lines dropped."""
    lines = body.strip().splitlines()
    while lines and (not lines[0].strip() or lines[0].startswith("--")):
        lines.pop(0)
    return "\n".join(lines).strip()


def parse(source: str, file: str) -> list[Section]:
    """The sections of one ``.sql`` file, in order. Raises ``ValueError`` on anything else: text
    before the first header that is not a comment, an empty section, a function section whose
    statement does not create the function its header names, a query not ending in ``;``."""
    headers = list(_HEADER.finditer(source))
    preamble = source[: headers[0].start()] if headers else source
    if _strip_doc(preamble):
        raise ValueError(f"{file}: SQL before the first '-- name:' or '-- function:' header")
    sections: list[Section] = []
    for header, following in zip(headers, [*headers[1:], None], strict=True):
        kind, name = header.group(1), header.group(2)
        body = source[header.end() : following.start() if following else len(source)]
        sql = _strip_doc(body)
        if not sql.endswith(";"):
            raise ValueError(f"{file}: {kind} {name} does not end with ';'")
        if kind == "function":
            defined = _DEFINES.match(sql)
            if defined is None or defined.group(1) != name:
                raise ValueError(f"{file}: section {name} must be 'CREATE OR REPLACE FUNCTION {name}(…'")
            sections.append(Section("function", name, file, sql))
        else:
            sections.append(Section("name", name, file, sql.removesuffix(";").rstrip()))
    return sections


@cache
def sections() -> tuple[Section, ...]:
    """Every section of every file (files in name order), each name once across the files."""
    found: list[Section] = []
    home = resources.files(__package__).joinpath("sql")
    for entry in sorted(home.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            found.extend(parse(entry.read_text(encoding="utf-8"), entry.name))
    seen: dict[str, Section] = {}
    for section in found:
        if section.name in seen:
            raise ValueError(f"{section.name} is defined twice ({seen[section.name].file}, {section.file})")
        if section.kind == "name" and section.name in globals():
            raise ValueError(f"{section.file}: query name {section.name} shadows queries.{section.name}")
        seen[section.name] = section
    return tuple(found)


def definitions() -> list[Section]:
    """The SQL functions' current definitions, in file order: what a migration applies."""
    return [s for s in sections() if s.kind == "function"]


def definitions_digest() -> str:
    """SHA-256 of :func:`definitions` (names and statements, not their comments): the migration that
    last applied the files records it, so a changed definition without a new migration fails a test."""
    digest = hashlib.sha256()
    for section in definitions():
        digest.update(f"{section.name}\n{section.sql}\n".encode())
    return digest.hexdigest()


@cache
def named() -> dict[str, TextClause]:
    """Every named query as a ``text()`` clause, built once (``execute.positional`` caches by clause)."""
    return {s.name: text(s.sql) for s in sections() if s.kind == "name"}


def __getattr__(name: str) -> TextClause:
    """``queries.NAME``: the named query ``NAME``. The first use puts every query in this module's
    namespace, so later lookups are plain attribute reads."""
    clauses = named()
    if name not in clauses:
        raise AttributeError(f"no query named {name!r} in service/store/sql/*.sql")
    globals().update(clauses)
    return clauses[name]
