"""SPEC §11 in v3 archives: hand-offs, handed_off_through, settings and pins round-trip; older
archives restore with none; what a PUT would refuse an archive cannot bring in."""

from __future__ import annotations

import json
import uuid
from typing import Any

import jsonschema
import pytest
from sqlalchemy import select

from service.archive import ArchiveInvalid, archive_json_schema, parse_archive
from service.archive.model import SessionSettingsIn
from service.store.archive import export_archive, restore_archive
from service.store.db import Database
from service.store.handoffs import HandoffAsk, create_handoff, list_handoffs, set_pinned
from service.store.models import SessionRow
from service.store.settings import update_settings
from tests.factories import add_history, make_session

TENANT = "acme"


async def export(db: Database, parent: str, version: int = 3) -> dict[str, Any]:
    async with db.sessions() as session:
        return await export_archive(session, TENANT, parent, version)


async def restore(db: Database, parent: str, document: Any, *, replace: bool = False) -> None:
    async with db.sessions() as session, session.begin():
        await restore_archive(session, TENANT, parent, parse_archive(document), replace=replace)


async def origin(db: Database) -> None:
    sid = await make_session(db, "origin", TENANT)
    ids = await add_history(db, sid, [(f"q{i}?", f"a{i}.") for i in range(1, 5)])
    async with db.sessions() as session, session.begin():
        await update_settings(
            session, TENANT, "origin", SessionSettingsIn(summary_model="cheap", max_output_tokens=2048)
        )
    async with db.sessions() as session, session.begin():
        await create_handoff(session, TENANT, "origin", HandoffAsk(format="text"))
    async with db.sessions() as session, session.begin():
        await set_pinned(session, TENANT, ids[1], True)


def strip(document: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k not in ("parent_id", "exported_at")}


async def test_export_restore_export_keeps_handoffs_mark_settings_and_pins(db: Database) -> None:
    await origin(db)
    first = await export(db, "origin")
    jsonschema.validate(first, archive_json_schema(3))
    session = first["session"]
    assert session["handed_off_through"] == 4 and len(session["handoffs"]) == 1
    assert "id" not in session["handoffs"][0] and session["handoffs"][0]["ordinals"] == [1, 2, 3, 4]
    assert session["settings"]["summary_model"] == "cheap" and session["settings"]["on_busy"] is None
    assert [q["pinned"] for q in first["questions"]] == [False, True, False, False]
    await restore(db, "copy", json.loads(json.dumps(first)))
    second = await export(db, "copy")
    assert strip(second) == strip(first)
    async with db.sessions() as db_session:
        page = await list_handoffs(db_session, TENANT, "copy", limit=20, before=None)
        copied = await db_session.scalar(select(SessionRow).where(SessionRow.parent_id == "copy"))
    assert page is not None and len(page["items"]) == 1 and page["items"][0]["parent_id"] == "copy"
    assert copied is not None and copied.handed_off_through == 4
    # The restored session behaves: the pinned #2 goes in the next hand-off, nothing else is new.
    async with db.sessions() as db_session, db_session.begin():
        outcome = await create_handoff(db_session, TENANT, "copy", HandoffAsk())
    assert outcome is not None and outcome.handoff["ordinals"] == [2]


async def test_older_archives_restore_with_no_handoffs_mark_0_and_the_settings_kept(db: Database) -> None:
    await origin(db)
    for version in (1, 2):
        document = await export(db, "origin", version)
        target = f"old-{version}"
        async with db.sessions() as session, session.begin():
            await update_settings(session, TENANT, target, SessionSettingsIn(on_busy="reject"))
        await restore(db, target, document)
        exported = (await export(db, target))["session"]
        assert exported["handoffs"] == [] and exported["handed_off_through"] == 0
        assert exported["settings"]["on_busy"] == "reject"  # an archive without settings keeps the session's
    bare = {"version": 3, "parent_id": "x", "questions": []}
    await restore(db, "bare", bare)
    assert (await export(db, "bare"))["session"]["handoffs"] == []


@pytest.mark.parametrize(
    "session_part",
    [
        {"settings": {"summary_instructions": "x" * 4097}},
        {"settings": {"on_busy": "sometimes"}},
        {"settings": {"bogus": 1}},
        {"handed_off_through": -1},
        {"handoffs": [{"created_at": "2026-11-29T10:00:00Z", "format": "text", "ordinals": [], "text": ""}]},
        {
            "handoffs": [
                {
                    "id": str(uuid.uuid4()),
                    "created_at": "2026-11-29T10:00:00Z",
                    "format": "text",
                    "ordinals": [1],
                    "text": "t",
                }
            ]
        },
        {"handoffs": "none"},
        {
            "handoffs": [
                {
                    "created_at": "2026-11-29T10:00:00Z",
                    "format": "openai",
                    "ordinals": [1],
                    "text": "t",
                    "message": {"role": 7, "content": "t"},
                }
            ]
        },
        {
            "handoffs": [
                {
                    "created_at": "2026-11-29T10:00:00Z",
                    "format": "text",
                    "ordinals": [1],
                    "text": "t",
                    "truncated": 1,
                }
            ]
        },
    ],
)
def test_archive_extras_that_break_the_rules_are_refused_before_anything_is_written(
    session_part: dict[str, Any],
) -> None:
    document = {"version": 3, "parent_id": "x", "session": session_part, "questions": []}
    with pytest.raises(ArchiveInvalid) as refused:
        parse_archive(document)
    assert refused.value.detail["errors"][0]["loc"].startswith("session.")
