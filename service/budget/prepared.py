"""A snapshot prepared once, when it is stored (issue 12): normalised, estimated, grouped, hashed.

Snapshots are immutable, so everything a request derives from one — the canonical messages, each
message's estimate, the groups a cut must not split, the content digest of every prefix (the
context-summary cache is keyed by them, SPEC §6.2) — is computed once by :func:`prepare_snapshot`
and kept beside the snapshot as JSON (:meth:`PreparedSnapshot.to_json`). A request then reads it
instead of re-normalising and re-hashing 1600 messages.

:data:`PREPARED_VERSION` names the format *and* the estimator: a change to either bumps it, and a
stored preparation of another version is simply recomputed from the snapshot (never trusted).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from service.budget.estimate import estimate_message, estimate_system, estimate_tools
from service.budget.messages import MessageGroup, NormalizedSnapshot, group_messages, normalize_snapshot
from service.vocabulary import canonical_bytes

PREPARED_VERSION: Final = 1

# The seed of the prefix digest chain: part of every cache key, so changing it invalidates them all.
_CHAIN_SEED: Final = b"sidequest-context-prefix-v1"


def prefix_digests(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """``digests[k]`` = content digest of ``messages[:k]`` (k = 0..len), one hash chain pass."""
    state = hashlib.sha256(_CHAIN_SEED).digest()
    digests = [state]
    for message in messages:
        state = hashlib.sha256(state + hashlib.sha256(canonical_bytes(message)).digest()).digest()
        digests.append(state)
    return digests


def summary_cache_key(prefix_digest: bytes, model: str, prompt_version: str) -> str:
    """Cache key of a context summary of the prefix with this digest, by ``model``, with these prompts."""
    return hashlib.sha256(
        prefix_digest + canonical_bytes({"model": model, "prompt_version": prompt_version})
    ).hexdigest()


@dataclass(frozen=True)
class PreparedSnapshot:
    """Everything a request needs from one snapshot, computed once.

    ``message_tokens[i]`` is the estimate of ``messages[i]`` (envelope included); ``digests[k]`` the
    content digest of ``messages[:k]``; ``groups`` the message groups (tool call + results together).
    """

    snapshot: NormalizedSnapshot
    taken_at: str | None
    system_tokens: int
    tools_tokens: int
    message_tokens: tuple[int, ...]
    groups: tuple[MessageGroup, ...]
    digests: tuple[bytes, ...]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The canonical messages (shared: callers must not mutate them)."""
        return self.snapshot.messages

    @property
    def total_tokens(self) -> int:
        """System + tools + every message: the SPEC §5 estimate of the whole snapshot."""
        return self.system_tokens + self.tools_tokens + sum(self.message_tokens)

    def tokens_of(self, start: int, end: int | None = None) -> int:
        """Estimate of ``messages[start:end]``, envelopes included."""
        return sum(self.message_tokens[start:end])

    def cache_key(self, length: int, model: str, prompt_version: str) -> str:
        """The context-summary cache key of ``messages[:length]``."""
        return summary_cache_key(self.digests[length], model, prompt_version)

    def to_json(self) -> dict[str, Any]:
        """The stored form (``main_snapshots.prepared``)."""
        snap = self.snapshot
        return {
            "version": PREPARED_VERSION,
            "system": snap.system,
            "tools": snap.tools,
            "messages": snap.messages,
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

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> PreparedSnapshot:
        """Inverse of :meth:`to_json`; ``ValueError`` for another version (recompute instead)."""
        if value.get("version") != PREPARED_VERSION:
            raise ValueError(f"prepared snapshot version {value.get('version')!r} is not {PREPARED_VERSION}")
        snapshot = NormalizedSnapshot(
            system=value["system"],
            tools=list(value["tools"]),
            messages=list(value["messages"]),
            context_window=value.get("context_window"),
            max_output_tokens=value.get("max_output_tokens"),
        )
        return cls(
            snapshot=snapshot,
            taken_at=value.get("taken_at"),
            system_tokens=int(value["system_tokens"]),
            tools_tokens=int(value["tools_tokens"]),
            message_tokens=tuple(int(t) for t in value["message_tokens"]),
            groups=tuple(MessageGroup(*g) for g in value["groups"]),
            digests=_split_digests(value["digests"]),
        )


def _split_digests(value: Any) -> tuple[bytes, ...]:
    raw = bytes.fromhex(value) if isinstance(value, str) else b"".join(bytes.fromhex(d) for d in value)
    return tuple(raw[i : i + 32] for i in range(0, len(raw), 32))


def prepare_snapshot(content: Mapping[str, Any]) -> PreparedSnapshot:
    """Normalise, estimate, group and hash a snapshot as posted (raises ``ValueError`` for one that
    does not normalise; the API refuses those before storing)."""
    snapshot = normalize_snapshot(content)
    message_tokens = [estimate_message(message) for message in snapshot.messages]
    taken_at = content.get("taken_at")
    return PreparedSnapshot(
        snapshot=snapshot,
        taken_at=taken_at if isinstance(taken_at, str) else None,
        system_tokens=estimate_system(snapshot.system),
        tools_tokens=estimate_tools(snapshot.tools),
        message_tokens=tuple(message_tokens),
        groups=tuple(group_messages(snapshot.messages, message_tokens)),
        digests=tuple(prefix_digests(snapshot.messages)),
    )


__all__ = [
    "PREPARED_VERSION",
    "PreparedSnapshot",
    "prefix_digests",
    "prepare_snapshot",
    "summary_cache_key",
]
