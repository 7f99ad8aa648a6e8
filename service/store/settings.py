"""Per-session settings (SPEC §11.2, docs/api.md "Session settings"): their read and their one write.
An unset field is absent from ``side_question_sessions.settings``; the public object names every
field, ``null`` when unset. Their rules are one model, :class:`service.archive.model.SessionSettingsIn`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func
from sqlalchemy.ext.asyncio import AsyncSession

from service.archive.model import SETTINGS_FIELDS, SessionSettingsIn, public_settings
from service.store.sessions import find_session, lock_or_create_session


async def read_settings(tx: AsyncSession, tenant: str, parent_id: str) -> dict[str, Any] | None:
    """The tenant's session settings as the public object, or None when there is no such session."""
    session_row = await find_session(tx, tenant, parent_id)
    return None if session_row is None else public_settings(session_row.settings)


async def update_settings(
    tx: AsyncSession, tenant: str, parent_id: str, changes: SessionSettingsIn
) -> dict[str, Any]:
    """Apply a PUT (only the fields ``changes`` names; ``None`` clears one), creating the session if
    needed, inside the caller's transaction. Returns the whole settings object after the change."""
    session_row = await lock_or_create_session(tx, tenant, parent_id)
    merged = {k: v for k, v in (session_row.settings or {}).items() if k in SETTINGS_FIELDS}
    for name in changes.model_fields_set:
        if (value := getattr(changes, name)) is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    session_row.settings = merged
    session_row.updated_at = func.now()
    await tx.flush()
    return public_settings(merged)
