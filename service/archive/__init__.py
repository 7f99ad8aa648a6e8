"""Side-question archives (SPEC §10, docs/archive.md): the format, pure; docs/architecture.md says
which module holds what. The SQL of export and restore is :mod:`service.store.archive`'s.
"""

# The names the other layers import from the package; "import X as X" marks a re-export (PEP 484).
from service.archive.codec import Archive as Archive
from service.archive.codec import ArchivedHandoff as ArchivedHandoff
from service.archive.codec import ArchivedRequest as ArchivedRequest
from service.archive.codec import ArchiveError as ArchiveError
from service.archive.codec import ArchiveInvalid as ArchiveInvalid
from service.archive.codec import ArchiveUnreadable as ArchiveUnreadable
from service.archive.codec import archived_error as archived_error
from service.archive.codec import encode_archive as encode_archive
from service.archive.codec import load_archive_json as load_archive_json
from service.archive.codec import parse_archive as parse_archive
from service.archive.codec import superseding_ids as superseding_ids
from service.archive.model import MAX_ORDINAL as MAX_ORDINAL
from service.archive.model import QUESTION_FIELDS as QUESTION_FIELDS
from service.archive.schema import ARCHIVE_VERSIONS as ARCHIVE_VERSIONS
from service.archive.schema import archive_json_schema as archive_json_schema
