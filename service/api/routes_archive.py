"""Archive routes (SPEC §10): ``GET`` exports a session's history, ``POST`` restores one. The format is
:mod:`service.archive`'s, the SQL :mod:`service.store.archive`'s; this module documents the routes."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service.api.deps import DbSession, Tenant, settings_of
from service.api.errors import ApiError, undeclared_json
from service.api.routes_common import ParentId, errors
from service.archive import ARCHIVE_VERSIONS, archive_json_schema, load_archive_json, parse_archive
from service.store.archive import export_archive, restore_archive

router = APIRouter(prefix="/v1", tags=["archives"])

_ARCHIVE_SCHEMA: dict[str, Any] = {
    "description": "A side-question archive of version 1, 2 or 3 (docs/archive.md).",
    "oneOf": [archive_json_schema(version, standalone=False) for version in ARCHIVE_VERSIONS],
}
_ERROR_TEXTS = {
    400: "not JSON, not an object, or an unsupported version",
    401: "missing or invalid bearer token",
    404: "no such session for this tenant",
    409: "the session already has history (use mode=replace), or has requests in flight",
    413: "the archive is larger than the snapshot size limit",
    422: "an archive breaking its version's format (detail.errors lists every problem), or bad parameters",
}


class ArchiveRestored(BaseModel):
    """What a restore did."""

    parent_id: str
    version: int = Field(description="the version of the archive that was restored")
    restored: int = Field(description="requests written")
    replaced: int = Field(description="requests of the session's previous history hidden (mode=replace)")
    next_ordinal: int = Field(description="the ordinal the next question of the session gets")
    clear_version: int = Field(description="the session's clear_version; restored requests carry it")


@router.get(
    "/sessions/{parent_id}/archive",
    responses={
        200: {
            "description": "the archive document",
            "content": {"application/json": {"schema": _ARCHIVE_SCHEMA}},
        },
        **errors(401, 404, 422, descriptions=_ERROR_TEXTS),
    },
)
async def export_session_archive(
    parent_id: ParentId,
    tenant: Tenant,
    tx: DbSession,
    version: Annotated[int, Query(ge=1, le=3, description="archive version to write")] = 3,
) -> JSONResponse:
    """Export the session's finished side questions (and, in v3, its memory) as an archive."""
    return JSONResponse(await export_archive(tx, tenant, parent_id, version))


@router.post(
    "/sessions/{parent_id}/archive",
    response_model=ArchiveRestored,
    responses=errors(400, 401, 409, 413, 422, descriptions=_ERROR_TEXTS),
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ARCHIVE_SCHEMA}}}
    },
)
async def restore_session_archive(
    parent_id: ParentId,
    request: Request,
    tenant: Tenant,
    tx: DbSession,
    mode: Annotated[
        Literal["replace"] | None,
        Query(description="`replace` discards the session's existing history first"),
    ] = None,
) -> ArchiveRestored:
    """Restore an archive of any version into this session; nothing is written unless all of it is."""
    refused = undeclared_json(request)
    if refused is not None:
        raise refused  # read as raw bytes, so the framework's own check never runs here
    settings = settings_of(request)
    limit = settings.max_snapshot_bytes
    # BodyLimit bounds what is read; past the archive's own limit, a 413 with BodyLimit's code and detail.
    body = await request.body()
    if len(body) > limit:
        raise ApiError(
            413, "payload_too_large", f"an archive may be at most {limit} bytes", {"limit_bytes": limit}
        )
    archive = parse_archive(load_archive_json(body), max_question_bytes=settings.max_question_bytes)
    async with tx.begin():
        result = await restore_archive(tx, tenant, parent_id, archive, replace=mode == "replace")
    return ArchiveRestored(**asdict(result))
