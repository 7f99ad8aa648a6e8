"""A snapshot prepared once, when it is stored: normalised, estimated, grouped, hashed.

Snapshots are immutable, so what a request derives from one (canonical messages, estimates, groups,
the prefix digests that key the context-summary cache, SPEC §6.2) is computed once and kept beside it
as JSON. :data:`PREPARED_VERSION` names the format *and* the estimator: a stored preparation of
another version is recomputed from the snapshot, never trusted.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from service.budget.estimate import estimate_message, estimate_system, estimate_tools
from service.budget.masking import Artifact, MaskedGroup, group_artifacts, mask_groups
from service.budget.messages import MessageGroup, NormalizedSnapshot, group_messages, normalize_snapshot
from service.budget.trail import TrailEntry, bound_trail, collect_trail
from service.vocabulary import canonical_bytes, json_has_nul

PREPARED_VERSION: Final = 4

# The seed of the prefix digest chain: part of every cache key, so changing it invalidates them all.
_CHAIN_SEED: Final = b"sidequest-context-prefix-v1"

# Where the masked groups and the artifacts are kept, once computed (PreparedSnapshot.memo).
_MASKED: Final = "budget.masked_groups"
_ARTIFACTS: Final = "budget.artifacts"

# Deeper nesting than this is refused: it would only exhaust the pipeline's recursion later.
MAX_SNAPSHOT_DEPTH: Final = 128

_UNSTORABLE: Final = {
    "nul": "the snapshot contains NUL characters",
    "surrogate": "the snapshot contains unpaired surrogates",
    "depth": f"the snapshot is nested deeper than {MAX_SNAPSHOT_DEPTH} levels",
    "number": "the snapshot contains a number too large for a 64-bit float (such as 1e400)",
}

# A non-finite number in the canonical text: json.dumps writes one as a bare token (strict JSON
# input has no NaN or Infinity, so it is a number that overflowed, 1e400 say). A string holding the
# word in that spot matches too, so a match is only settled by a walk of the value.
_NON_FINITE: Final = re.compile(rb"[:,\[]-?(?:NaN|Infinity)")


def has_non_finite(value: Any, canonical: bytes) -> bool:
    """Whether ``value`` (whose :func:`canonical_bytes` are ``canonical``) holds a non-finite number:
    C-speed substring tests first, then the pattern, and only where it matches, the walk."""
    if b"NaN" not in canonical and b"Infinity" not in canonical:
        return False
    if _NON_FINITE.search(canonical) is None:
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class UnstorableSnapshot(ValueError):
    """A snapshot that cannot be stored or used (PostgreSQL or a provider would refuse it); ``reason``
    is a key of :data:`_UNSTORABLE`."""

    def __init__(self, reason: str) -> None:
        super().__init__(_UNSTORABLE[reason])
        self.reason = reason


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 1, ``{"a": 1}`` is 2), without recursion; only
    containers go on the stack (a 600 KB snapshot has tens of thousands of strings)."""
    if not isinstance(value, dict | list):
        return 1
    deepest = 1
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        inner = level + 1
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                stack.append((child, inner))
            elif inner > deepest:
                deepest = inner
    return deepest


# Stands for the message array while the rest is encoded: a string of one NUL, found first (keys are sorted,
# only those before "messages" precede it); a snapshot holding such a string is refused for its NUL anyway.
_MESSAGES_MARK: Final = "\x00"
_MESSAGES_MARK_JSON: Final = b'"\\u0000"'


@dataclass(frozen=True)
class EncodedSnapshot:
    """A snapshot as posted, encoded canonically once: the admission's size check, its content hash,
    the prefix digests and the stored JSON all come from ``canonical`` (exactly :func:`canonical_bytes`
    of the whole); ``message_bytes[i]`` is that of ``content["messages"][i]``."""

    content: Mapping[str, Any]
    canonical: bytes
    message_bytes: tuple[bytes, ...]

    @property
    def content_hash(self) -> str:
        """:func:`service.vocabulary.content_hash` of the content."""
        return hashlib.sha256(self.canonical).hexdigest()

    @property
    def size(self) -> int:
        """UTF-8 bytes of the snapshot's compact JSON (key order does not change the length)."""
        return len(self.canonical)

    def bytes_of(self, messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
        """The canonical bytes of each of ``messages``: reused for a message posted as is (the same
        object, as normalisation returns every canonical message), encoded for one it rewrote."""
        raw = self.content.get("messages")
        known = dict(zip(map(id, raw), self.message_bytes, strict=True)) if isinstance(raw, list) else {}
        return [known.get(id(message)) or canonical_bytes(message) for message in messages]


def _head(rest: Mapping[str, Any]) -> bytes:
    """Canonical bytes of ``rest`` with the mark where its message array goes."""
    return canonical_bytes({**rest, "messages": _MESSAGES_MARK})


def _splice(head: bytes, items: Sequence[bytes]) -> bytes:
    """``head`` with its mark replaced by the array of ``items`` (each an element's canonical bytes):
    exactly the canonical bytes of the whole, since keys are sorted and separators compact."""
    at = head.find(_MESSAGES_MARK_JSON)
    return b"".join((head[:at], b"[", b",".join(items), b"]", head[at + len(_MESSAGES_MARK_JSON) :]))


def _too_deep(content: Mapping[str, Any], messages: Any, parts: tuple[bytes, ...]) -> bool:
    """Whether ``content`` nests deeper than :data:`MAX_SNAPSHOT_DEPTH`. A message (at depth 2) is at
    most one deeper than the ``{`` and ``[`` bytes of its canonical JSON, so one with no more than
    ``MAX - 3`` of them is not walked: counting bytes is C-speed, walking is not."""
    if not isinstance(messages, list) or not parts:
        return json_depth(content) > MAX_SNAPSHOT_DEPTH
    envelope = {key: value for key, value in content.items() if key != "messages"}
    limit = MAX_SNAPSHOT_DEPTH - 2
    return json_depth(envelope) > MAX_SNAPSHOT_DEPTH or any(
        encoded.count(b"{") + encoded.count(b"[") > limit - 1 and json_depth(message) > limit
        for message, encoded in zip(messages, parts, strict=True)
    )


def encode_snapshot(content: Mapping[str, Any]) -> EncodedSnapshot:
    """Encode ``content`` once; raises :class:`UnstorableSnapshot` for a NUL, a lone surrogate or
    nesting deeper than :data:`MAX_SNAPSHOT_DEPTH` (json's own recursion limit catches what nests far
    deeper while it encodes; :func:`_too_deep` the rest, from the encoded bytes)."""
    messages = content.get("messages")
    try:
        if isinstance(messages, list):
            parts = tuple(canonical_bytes(message) for message in messages)
            canonical = _splice(_head(content), parts)
        else:
            parts = ()
            canonical = canonical_bytes(content)
    except UnicodeEncodeError:
        raise UnstorableSnapshot("surrogate") from None
    except RecursionError:
        raise UnstorableSnapshot("depth") from None
    if _too_deep(content, messages, parts):
        raise UnstorableSnapshot("depth")
    # The mark was spliced away, so any NUL left is the snapshot's own.
    if json_has_nul(canonical):
        raise UnstorableSnapshot("nul")
    if has_non_finite(content, canonical):
        raise UnstorableSnapshot("number")
    return EncodedSnapshot(content, canonical, parts)


def prefix_digests(
    messages: Sequence[Mapping[str, Any]], encoded: EncodedSnapshot | None = None
) -> list[bytes]:
    """``digests[k]`` = content digest of ``messages[:k]`` (k = 0..len), one hash chain pass;
    ``encoded``, the snapshot they came from, lends the bytes of those posted as is (no second encoding)."""
    state = hashlib.sha256(_CHAIN_SEED).digest()
    digests = [state]
    for item in encoded.bytes_of(messages) if encoded is not None else map(canonical_bytes, messages):
        state = hashlib.sha256(state + hashlib.sha256(item).digest()).digest()
        digests.append(state)
    return digests


def summary_cache_key(prefix_digest: bytes, model: str, prompt_version: str) -> str:
    """Cache key of a context summary of the prefix with this digest, by ``model``, with these prompts."""
    return hashlib.sha256(
        prefix_digest + canonical_bytes({"model": model, "prompt_version": prompt_version})
    ).hexdigest()


@dataclass(frozen=True)
class PreparedSnapshot:
    """Everything a request needs from one snapshot, computed once: ``message_tokens[i]`` estimates
    ``messages[i]`` (envelope included), ``digests[k]`` is the content digest of ``messages[:k]``."""

    snapshot: NormalizedSnapshot
    taken_at: str | None
    system_tokens: int
    tools_tokens: int
    message_tokens: tuple[int, ...]
    groups: tuple[MessageGroup, ...]
    digests: tuple[bytes, ...]
    # The canonical messages are the snapshot's own (the usual case): the stored form leaves them out
    # and the store reads them from the snapshot's content, not from a second copy of the transcript.
    messages_as_posted: bool = False
    # Values a later layer derives at most once per snapshot (service.summary.context.snapshot_pieces),
    # kept with it in the worker's memory, never stored.
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The canonical messages (shared: callers must not mutate them)."""
        return self.snapshot.messages

    @property
    def total_tokens(self) -> int:
        """System + tools + every message: the SPEC §5 estimate of the whole snapshot."""
        return self.system_tokens + self.tools_tokens + sum(self.message_tokens)

    def tokens_of(self, start: int, end: int | None = None) -> int:
        return sum(self.message_tokens[start:end])

    def cache_key(self, length: int, model: str, prompt_version: str) -> str:
        return summary_cache_key(self.digests[length], model, prompt_version)

    def masked(self) -> tuple[MaskedGroup, ...]:
        """Every group in its masked form (SPEC §6.8), computed at most once per preparation."""
        found: tuple[MaskedGroup, ...] | None = self.memo.get(_MASKED)
        if found is None:
            found = self.memo[_MASKED] = mask_groups(self.messages, self.groups, self.message_tokens)
        return found

    def masked_tokens(self) -> tuple[int, ...]:
        return tuple(group.tokens for group in self.masked())

    def artifacts(self) -> tuple[list[tuple[Artifact, bool]], ...]:
        """Each group's artifacts in call order, with their results' error flags (SPEC §6.9)."""
        found: tuple[list[tuple[Artifact, bool]], ...] | None = self.memo.get(_ARTIFACTS)
        if found is None:
            found = self.memo[_ARTIFACTS] = tuple(
                group_artifacts(self.messages[g.start : g.end]) for g in self.groups
            )
        return found

    def trail(self, groups: int) -> list[TrailEntry]:
        """The bounded artifact trail of the first ``groups`` groups (what a summary of them covers)."""
        return bound_trail(collect_trail(use for found in self.artifacts()[:groups] for use in found))

    def group_index(self, message: int) -> int:
        """The index of the group that starts at ``message`` (the count of groups for the end)."""
        index = next((i for i, group in enumerate(self.groups) if group.start >= message), len(self.groups))
        if self.boundary(index) != message:
            raise ValueError(f"message {message} is not a group boundary")
        return index

    def boundary(self, group: int) -> int:
        """The message index where group ``group`` starts (the message count past the last group)."""
        return self.groups[group].start if group < len(self.groups) else len(self.messages)

    def to_json(self) -> dict[str, Any]:
        """The stored form (``main_snapshots.prepared``)."""
        snap = self.snapshot
        return {
            "version": PREPARED_VERSION,
            "system": snap.system,
            "system_blocks": list(snap.system_blocks),
            "tools": snap.tools,
            "messages": None if self.messages_as_posted else snap.messages,
            "messages_as_posted": self.messages_as_posted,
            "context_window": snap.context_window,
            "max_output_tokens": snap.max_output_tokens,
            "taken_at": self.taken_at,
            "system_tokens": self.system_tokens,
            "tools_tokens": self.tools_tokens,
            "message_tokens": list(self.message_tokens),
            "groups": [
                [g.start, g.end, g.tokens, g.has_tool_calls, g.unanswered_calls, g.orphan_results]
                for g in self.groups
            ],
            # One hex string (32 bytes a prefix): decoding it is one call, not 1600.
            "digests": b"".join(self.digests).hex(),
        }

    def to_json_text(self, encoded: EncodedSnapshot | None = None) -> str:
        """:meth:`to_json` as JSON text, the message array spliced from ``encoded``'s bytes where the
        messages are the ones posted (no second encoding of a 600 KB transcript)."""
        stored = self.to_json()
        if self.messages_as_posted:
            return canonical_bytes(stored).decode()
        messages = stored.pop("messages")
        items = encoded.bytes_of(messages) if encoded is not None else [canonical_bytes(m) for m in messages]
        return _splice(_head(stored), items).decode()

    @classmethod
    def from_json(
        cls, value: Mapping[str, Any], posted_messages: Sequence[Any] | None = None
    ) -> PreparedSnapshot:
        """Inverse of :meth:`to_json`; ``ValueError`` for another version (recompute instead).
        ``posted_messages``: the snapshot's own ``messages``, needed when the stored form left them out."""
        if value.get("version") != PREPARED_VERSION:
            raise ValueError(f"prepared snapshot version {value.get('version')!r} is not {PREPARED_VERSION}")
        as_posted = bool(value.get("messages_as_posted"))
        if as_posted and posted_messages is None:
            raise ValueError("this preparation needs the snapshot's own messages")
        messages = posted_messages if as_posted else value["messages"]
        assert messages is not None
        digests = bytes.fromhex(value["digests"])
        snapshot = NormalizedSnapshot(
            system=value["system"],
            tools=list(value["tools"]),
            messages=list(messages),
            context_window=value.get("context_window"),
            max_output_tokens=value.get("max_output_tokens"),
            system_blocks=tuple(value["system_blocks"]),
        )
        return cls(
            snapshot=snapshot,
            taken_at=value.get("taken_at"),
            system_tokens=int(value["system_tokens"]),
            tools_tokens=int(value["tools_tokens"]),
            message_tokens=tuple(int(t) for t in value["message_tokens"]),
            groups=tuple(MessageGroup(*g) for g in value["groups"]),
            digests=tuple(digests[i : i + 32] for i in range(0, len(digests), 32)),
            messages_as_posted=as_posted,
        )


def prepare_snapshot(content: Mapping[str, Any], encoded: EncodedSnapshot | None = None) -> PreparedSnapshot:
    """Normalise, estimate, group and hash a snapshot as posted (raises ``ValueError`` for one that
    does not normalise; the API refuses those before storing). ``encoded`` (:func:`encode_snapshot`
    of the same ``content``) lends the canonical bytes of the messages to the prefix digests."""
    snapshot = normalize_snapshot(content)
    message_tokens = [estimate_message(message) for message in snapshot.messages]
    taken_at = content.get("taken_at")
    posted = content.get("messages")
    as_posted = (
        isinstance(posted, list)
        and len(posted) == len(snapshot.messages)
        and all(a is b for a, b in zip(posted, snapshot.messages, strict=True))
    )
    return PreparedSnapshot(
        snapshot=snapshot,
        taken_at=taken_at if isinstance(taken_at, str) else None,
        system_tokens=estimate_system(snapshot.system),
        tools_tokens=estimate_tools(snapshot.tools),
        message_tokens=tuple(message_tokens),
        groups=tuple(group_messages(snapshot.messages, message_tokens)),
        messages_as_posted=as_posted,
        digests=tuple(prefix_digests(snapshot.messages, encoded)),
    )
