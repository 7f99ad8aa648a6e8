"""The summary document: strict parse, validation, deterministic rendering, provenance, storage form.

The model writes only the five-key body (SPEC §6.4). Where a summary came from — which Q&A ordinals or
which snapshot prefix, as of which main-context time, by which model, when — is *ours* (:class:`Provenance`),
never taken from the model's text, so a model cannot claim sources it did not see.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from service.budget import estimate_text
from service.budget.chunk import SUMMARY_BODY_TOKEN_LIMIT
from service.summary.errors import SummaryInvalid, SummaryTooLong

# SPEC §6.4 limits. A string is measured in UTF-8 bytes, not characters: 2 KiB of Chinese is ~680 chars.
MAX_STRING_BYTES = 2048
MAX_LIST_ITEMS = 32
# SPEC §6.3: a rendered body estimated above this is "too long" and triggers the one retry (the
# budget kernel reserves room for summaries by the same number).
BODY_TOKEN_LIMIT = SUMMARY_BODY_TOKEN_LIMIT

DOCUMENT_KEYS: tuple[str, ...] = ("objective", "state", "decisions", "open_work", "risks")
_STRING_KEYS = ("objective", "state")
_LIST_KEYS = ("decisions", "open_work", "risks")

# One optional fence around the whole reply: ```json … ``` or ``` … ``` (the info string is case-blind).
_FENCE = re.compile(r"\A```(?:[jJ][sS][oO][nN])?\s*(?P<body>.*?)\s*```\Z", re.DOTALL)


@dataclass(frozen=True)
class SummaryDocument:
    """The model-written part of a summary, already validated."""

    objective: str
    state: str
    decisions: tuple[str, ...] = ()
    open_work: tuple[str, ...] = ()
    risks: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The document as the session memory stores it (a model reads :func:`render_body`)."""
        return _json_form(self)

    @classmethod
    def from_json(cls, value: Any) -> SummaryDocument:
        """Rebuild a stored document, validating it exactly like a model reply (stored data may be old)."""
        return _validate(value)


def _json_form(value: SummaryDocument | Provenance) -> dict[str, Any]:
    """A dataclass's fields in their order, tuples as JSON lists."""
    items = ((f.name, getattr(value, f.name)) for f in fields(value))
    return {name: list(item) if isinstance(item, tuple) else item for name, item in items}


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last of two equal keys; a document that says two things is invalid.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise SummaryInvalid(f"the key {key!r} appears twice")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise SummaryInvalid(f"{name} is not JSON")


def _check_string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise SummaryInvalid(f"{where} must be a string, not {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate from a "\ud800" escape
        raise SummaryInvalid(f"{where} is not valid Unicode text") from exc
    if size > MAX_STRING_BYTES:
        raise SummaryInvalid(f"{where} is {size} bytes of UTF-8, over the limit of {MAX_STRING_BYTES}")
    return value


def _validate(value: Any) -> SummaryDocument:
    if not isinstance(value, dict):
        raise SummaryInvalid(f"the reply must be one JSON object, not {type(value).__name__}")
    keys = set(value)
    missing = [k for k in DOCUMENT_KEYS if k not in keys]
    extra = sorted(str(k) for k in keys - set(DOCUMENT_KEYS))
    if missing or extra:
        found = (("missing", missing), ("unexpected", extra))
        parts = [f"{what} {', '.join(names)}" for what, names in found if names]
        raise SummaryInvalid("the object must have exactly the five keys (" + "; ".join(parts) + ")")
    strings = {k: _check_string(k, value[k]) for k in _STRING_KEYS}
    lists: dict[str, tuple[str, ...]] = {}
    for key in _LIST_KEYS:
        items = value[key]
        if not isinstance(items, list):
            raise SummaryInvalid(f"{key} must be a list of strings, not {type(items).__name__}")
        if len(items) > MAX_LIST_ITEMS:
            raise SummaryInvalid(f"{key} has {len(items)} items, over the limit of {MAX_LIST_ITEMS}")
        lists[key] = tuple(_check_string(f"{key}[{i}]", item) for i, item in enumerate(items))
    # A document that says nothing would be "success while doing nothing": it would silently replace
    # real material with blanks, so it is invalid (and gets the one retry) rather than accepted.
    texts = (*strings.values(), *(item for items in lists.values() for item in items))
    if not any(text.strip() for text in texts):
        raise SummaryInvalid("every field is empty")
    return SummaryDocument(strings["objective"], strings["state"], *(lists[key] for key in _LIST_KEYS))


def parse_summary_document(text: str) -> SummaryDocument:
    """Parse a model reply strictly: exactly one JSON object with exactly the five keys and the SPEC
    §6.4 limits, optionally in one ```json (or bare ```) fence around the whole reply; anything else —
    prose around it, two objects, a second fence, duplicate keys — raises :class:`SummaryInvalid`."""
    body = text.strip()
    if not body:
        raise SummaryInvalid("the reply is blank")
    if body.startswith("```"):
        match = _FENCE.match(body)
        if match is None:
            raise SummaryInvalid("the reply has a code fence that does not wrap the whole reply")
        body = match.group("body").strip()
        if "```" in body:
            raise SummaryInvalid("the reply has more than one code fence")
    try:
        value = json.loads(body, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise SummaryInvalid(
            f"not one JSON object ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    return _validate(value)


@dataclass(frozen=True)
class Provenance:
    """Where a summary came from: ``source`` the human line ("side Q&A ordinals 1–30", "snapshot
    3fa2c0d19b7e messages 0–139"), the other fields the same for code; ``context_time`` the main
    snapshot's ``taken_at`` the material was read against (None without a snapshot)."""

    source: str
    model: str
    created_at: str
    context_time: str | None = None
    first_ordinal: int | None = None
    covered_through_ordinal: int | None = None
    snapshot_hash: str | None = None
    # Half-open [start, end) range of snapshot message indexes the summary covers.
    message_range: tuple[int, int] | None = None

    @classmethod
    def for_qa(
        cls,
        *,
        first_ordinal: int,
        covered_through_ordinal: int,
        model: str,
        created_at: str,
        context_time: str | None,
    ) -> Provenance:
        """Provenance of a rolling Q&A summary over ordinals ``first_ordinal..covered_through_ordinal``."""
        return cls(
            source=f"side Q&A ordinals {first_ordinal}–{covered_through_ordinal}",
            model=model,
            created_at=created_at,
            context_time=context_time,
            first_ordinal=first_ordinal,
            covered_through_ordinal=covered_through_ordinal,
        )

    @classmethod
    def for_context(
        cls,
        *,
        prefix_hash: str,
        end: int,
        model: str,
        created_at: str,
        context_time: str | None,
    ) -> Provenance:
        """Provenance of a context summary of the snapshot prefix ``[0, end)`` with this content hash (a
        context summary always covers a prefix: it is keyed by one)."""
        return cls(
            source=f"snapshot {prefix_hash[:12]} messages 0–{max(0, end - 1)}",
            model=model,
            created_at=created_at,
            context_time=context_time,
            snapshot_hash=prefix_hash,
            message_range=(0, end),
        )

    def to_json(self) -> dict[str, Any]:
        """JSON form for the session memory."""
        return _json_form(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Provenance:
        rng = value.get("message_range")
        return cls(
            source=str(value["source"]),
            model=str(value["model"]),
            created_at=str(value["created_at"]),
            context_time=value.get("context_time"),
            first_ordinal=value.get("first_ordinal"),
            covered_through_ordinal=value.get("covered_through_ordinal"),
            snapshot_hash=value.get("snapshot_hash"),
            message_range=(int(rng[0]), int(rng[1])) if rng is not None else None,
        )


def _section(title: str, items: tuple[str, ...]) -> list[str]:
    # Keep a multi-line item visibly one item: continuation lines are indented under its dash.
    lines = ["- " + item.strip().replace("\n", "\n  ") for item in items]
    return [f"{title}:", *(lines or ["- (none)"])]


def render_body(document: SummaryDocument) -> str:
    """The document as prompt text, without provenance; this is what the body limit measures."""
    lines = [
        f"Objective: {document.objective.strip()}",
        f"State: {document.state.strip()}",
        *_section("Decisions", document.decisions),
        *_section("Open work", document.open_work),
        *_section("Risks", document.risks),
    ]
    return "\n".join(lines)


def check_body_size(document: SummaryDocument) -> int:
    """The rendered body's estimate (the budget kernel's estimator, never a tokenizer), or
    :class:`SummaryTooLong` when it is over the body limit."""
    tokens = estimate_text(render_body(document))
    if tokens > BODY_TOKEN_LIMIT:
        raise SummaryTooLong(body_tokens=tokens, limit=BODY_TOKEN_LIMIT)
    return tokens


def render_summary(document: SummaryDocument, provenance: Provenance) -> str:
    """Deterministic prompt text: one provenance header line, then the body. Same input, same bytes."""
    header = f"[Summary of {provenance.source}"
    if provenance.context_time:
        header += f"; main context as of {provenance.context_time}"
    header += f"; summarised by {provenance.model} at {provenance.created_at}]"
    return header + "\n" + render_body(document)
