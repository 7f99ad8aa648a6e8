"""The archives' JSON Schemas (draft 2020-12), made from the one model: version 3 is
:class:`~service.archive.model.ArchiveV3`'s, versions 1 and 2 are it without the fields they lack
(docs/archive/v*.schema.json, and the archive bodies of /openapi.json).
"""

from __future__ import annotations

import copy
from typing import Any, Final

from pydantic.json_schema import GenerateJsonSchema

from service.archive.model import (
    NO_NUL_PATTERN,
    QUESTION_FIELDS,
    STORABLE_JSON_NAME,
    STORABLE_OBJECT_NAME,
    STORABLE_REF,
    ArchiveV3,
)

ARCHIVE_VERSIONS: Final = (1, 2, 3)
OPENAPI_REFS: Final = "#/components/schemas/"
STANDALONE_REFS: Final = "#/$defs/"
_BOUNDS: Final = {"ge": "minimum", "le": "maximum"}

_DESCRIPTIONS: Final = {
    1: "Questions and answers only; holds succeeded requests and restores as succeeded history.",
    2: "Adds each request's outcome: status, error, usage, model, timings, snapshot reference "
    "(and truncated, stop_reason).",
    3: "Adds the session's memory (rolling Q&A summary, context-summary cache) and each request's "
    "context_info; and the session's hand-offs, handed_off_through and settings, and each request's "
    "pinned.",
}


def storable_json_defs(refs: str) -> dict[str, dict[str, Any]]:
    """``StorableJson`` (any JSON value) and ``StorableObject`` (a JSON object) without NUL anywhere:
    recursive, so pydantic cannot make them; ``refs`` is where they are found (``#/$defs/`` in a
    standalone schema, ``#/components/schemas/`` in OpenAPI)."""
    value = {"$ref": refs + STORABLE_JSON_NAME}
    return {
        STORABLE_JSON_NAME: {
            "description": "Any JSON value without NUL characters in any string or key.",
            "anyOf": [
                {"type": "string", "pattern": NO_NUL_PATTERN},
                {"type": ["number", "boolean", "null"]},
                {"type": "array", "items": value},
                {"$ref": refs + STORABLE_OBJECT_NAME},
            ],
        },
        STORABLE_OBJECT_NAME: {
            "type": "object",
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": value,
            "description": "A JSON object without NUL characters in any string or key "
            "(PostgreSQL refuses them).",
        },
    }


class _Untitled(GenerateJsonSchema):
    """pydantic's generator without a title on every field (a schema for people, not for classes)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _tidy(node: Any, defs: dict[str, Any], refs: str) -> Any:
    """Models written in place, ``anyOf [X, null]`` as ``"type": [X, "null"]`` like every other
    nullable field, and the NUL-free JSON definitions referred to under ``refs``."""
    if isinstance(node, list):
        return [_tidy(item, defs, refs) for item in node]
    if not isinstance(node, dict):
        return node
    if (name := node.get("$ref", "").removeprefix(STANDALONE_REFS)) in defs:
        node = {
            **{k: v for k, v in defs[name].items() if k != "title"},
            **{k: v for k, v in node.items() if k != "$ref"},
        }
    if STORABLE_REF in node:
        return {"$ref": refs + node[STORABLE_REF]}
    if "enum" in node or "const" in node:
        node = {k: v for k, v in node.items() if k != "type"}  # the values say it
    if node.get("type") == "integer":
        # pydantic leaves the bounds of an integer behind a validator (the settings') as ge/le.
        node = {_BOUNDS.get(k, k): v for k, v in node.items()}
    match node.get("anyOf"):
        case [dict() as only, {"type": "null"}]:
            only = _tidy(only, defs, refs)
            rest = _tidy({k: v for k, v in node.items() if k != "anyOf"}, defs, refs)
            if "enum" in only:
                return {**only, "enum": [*only["enum"], None], **rest}
            if isinstance(only.get("type"), str):
                return {**only, "type": [only["type"], "null"], **rest}
    return {key: _tidy(value, defs, refs) for key, value in node.items()}


def _older(schema: dict[str, Any], version: int) -> dict[str, Any]:
    """The v3 schema cut down to version 1 or 2: no session, only that version's question fields."""
    older = copy.deepcopy(schema)
    older["title"] = older["title"].replace("version 3", f"version {version}")
    del older["properties"]["session"]
    questions = older["properties"]["questions"]["items"]
    questions["properties"] = {
        k: v for k, v in questions["properties"].items() if k in QUESTION_FIELDS[version]
    }
    if version == 1:  # no status: every request succeeded and has its answer
        del questions["allOf"]
        questions["properties"]["answer"] = {"type": "string", "pattern": NO_NUL_PATTERN}
    else:
        questions["allOf"] = questions["allOf"][:1]  # pins are version 3's
    return older


def archive_json_schema(version: int, *, standalone: bool = True) -> dict[str, Any]:
    """The JSON Schema of a version ``version`` archive: ``standalone`` (the published files) with
    ``$schema``, ``$id`` and the NUL-free JSON definitions in its own ``$defs``; else as OpenAPI embeds
    it, referring to its components (the app adds them there)."""
    generated = ArchiveV3.model_json_schema(schema_generator=_Untitled)
    defs = generated.pop("$defs", {})
    schema: dict[str, Any] = _tidy(generated, defs, STANDALONE_REFS if standalone else OPENAPI_REFS)
    schema = {
        "title": schema.pop("title"),
        **schema,
        "description": _DESCRIPTIONS[version],
        "properties": {**schema["properties"], "version": {"const": version}},
    }
    if version < 3:
        schema = _older(schema, version)
    if not standalone:
        return schema
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:sidequest:archive:v{version}",
        **schema,
        "$defs": storable_json_defs(STANDALONE_REFS),
    }
