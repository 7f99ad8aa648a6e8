"""Side-question archives (SPEC §10, docs/archive.md): the format, pure; docs/architecture.md says
which module holds what. The SQL of export and restore is :mod:`service.store.archive`'s.
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
from service.archive.schema import ARCHIVE_VERSIONS, archive_json_schema

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
    "superseding_ids",
]
