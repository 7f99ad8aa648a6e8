"""The artifact trail (SPEC §6.9): what the summarised groups touched, extracted, not summarised.

A summary model drops some of the files and commands it summarises (the weakest dimension of every
summariser measured); the trail puts them back without a call. It is bounded, so thousands of calls
cannot crowd out the window, and deterministic, so it is cached with its summary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from service.budget.estimate import tokens_of_bytes, utf8_length
from service.budget.masking import Artifact

# Bounds of the rendered trail: the most recently used entries are kept within both.
TRAIL_MAX_ENTRIES: Final = 64
TRAIL_MAX_BYTES: Final = 4096
TRAIL_HEADING: Final = (
    "Artifact trail of the summarised part (extracted by Sidequest from its tool calls, not summarised;"
    " least recently used first):"
)
# The trail at its largest, in tokens: what a plan reserves for it.
TRAIL_MAX_TOKENS: Final = tokens_of_bytes(TRAIL_MAX_BYTES)


@dataclass(frozen=True)
class TrailEntry:
    """One artifact of the summarised part: its use count, and whether its last result was marked an error."""

    artifact: Artifact
    uses: int
    last_error: bool

    def line(self) -> str:
        # Terse on purpose: every byte spent on decoration is a path or a command that does not fit.
        times = f" (x{self.uses})" if self.uses > 1 else ""
        error = " [last result an error]" if self.last_error else ""
        return f"- {self.artifact.tool}: {self.artifact.text}{times}{error}"


# The distinct artifacts seen so far as entries, in order of last use (a re-used one is popped and put back at
# the end), each with the bytes of its rendered line and newline.
_LastUse = dict[Artifact, tuple[TrailEntry, int]]


def _use(seen: _LastUse, artifact: Artifact, error: bool) -> None:
    previous = seen.pop(artifact, None)
    entry = TrailEntry(artifact, previous[0].uses + 1 if previous else 1, error)
    seen[artifact] = (entry, utf8_length(entry.line()) + 1)


def _fitting(newest_first: Iterable[int]) -> tuple[int, int]:
    """How many lines (their bytes with a newline each, newest first) the bounds keep, and the bytes of
    the trail they make with its heading."""
    size = utf8_length(TRAIL_HEADING)
    count = 0
    for line in newest_first:
        if count == TRAIL_MAX_ENTRIES or size + line > TRAIL_MAX_BYTES:
            break
        size += line
        count += 1
    return count, size


def collect_trail(uses: Iterable[tuple[Artifact, bool]]) -> list[TrailEntry]:
    """Distinct artifacts of ``uses`` (call order, with results' error flags), least recently used first."""
    seen: _LastUse = {}
    for artifact, error in uses:
        _use(seen, artifact, error)
    return [entry for entry, _ in seen.values()]


def bound_trail(entries: Sequence[TrailEntry]) -> list[TrailEntry]:
    """The most recently used entries that fit :data:`TRAIL_MAX_ENTRIES` and, rendered with the
    heading, :data:`TRAIL_MAX_BYTES`; in their original order."""
    count, _ = _fitting(utf8_length(entry.line()) + 1 for entry in reversed(entries))
    return list(entries[len(entries) - count :])


def trail_tokens(entries: Sequence[TrailEntry]) -> int:
    """What the rendered trail adds after a summary (its text and the blank line before it)."""
    text = render_trail(entries)
    return tokens_of_bytes(utf8_length(text) + 2) if text else 0


class TrailSizes:
    """``sizes(s)``: :func:`trail_tokens` of the bounded trail of the first ``s`` groups, ``s`` never
    decreasing (as a plan tries them): the uses are taken in once, and a size walks the 64 newest entries."""

    def __init__(self, artifacts: Sequence[Sequence[tuple[Artifact, bool]]]) -> None:
        self._artifacts = artifacts
        self._taken = 0  # groups whose uses are in ``_seen``
        self._seen: _LastUse = {}

    def __call__(self, groups: int) -> int:
        if groups < self._taken:
            raise ValueError("trail sizes are asked for with a never decreasing group count")
        while self._taken < groups:
            for artifact, error in self._artifacts[self._taken]:
                _use(self._seen, artifact, error)
            self._taken += 1
        count, size = _fitting(line_bytes for _, line_bytes in reversed(self._seen.values()))
        return tokens_of_bytes(size + 2) if count else 0


def render_trail(entries: Sequence[TrailEntry]) -> str:
    """The trail as prompt text (empty when there is nothing to list); ``entries`` already bounded."""
    if not entries:
        return ""
    return "\n".join([TRAIL_HEADING, *(entry.line() for entry in entries)])
