"""Side-question archives (SPEC §10, docs/archive.md): the format, pure.

One pydantic model of version 3 (:mod:`~service.archive.model`) validates every restore and makes the
JSON Schemas (:mod:`~service.archive.schema`); versions 1 and 2 are upgraded to it first
(:mod:`~service.archive.upgrade`); :mod:`~service.archive.codec` turns a document into plain values and
back. The SQL of export and restore is :mod:`service.store.archive`'s.
"""

from service.archive.codec import (
    Archive,
    ArchivedHandoff,
    ArchivedRequest,
    ArchiveError,
    ArchiveInvalid,
    ArchiveUnreadable,
    archived_error,
    encode_archive,
    load_archive_json,
    parse_archive,
    superseding_ids,
)
from service.archive.model import MAX_ORDINAL, QUESTION_FIELDS
from service.archive.schema import ARCHIVE_VERSIONS, archive_json_schema, storable_json_defs

__all__ = [
    "ARCHIVE_VERSIONS",
    "MAX_ORDINAL",
    "QUESTION_FIELDS",
    "Archive",
    "ArchiveError",
    "ArchiveInvalid",
    "ArchiveUnreadable",
    "ArchivedHandoff",
    "ArchivedRequest",
    "archive_json_schema",
    "archived_error",
    "encode_archive",
    "load_archive_json",
    "parse_archive",
    "storable_json_defs",
    "superseding_ids",
]
