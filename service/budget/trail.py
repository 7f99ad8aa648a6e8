"""The artifact trail (SPEC §6.9): what the summarised groups touched, extracted, not summarised.

A summary model keeps some of the files and commands of what it summarises and drops the rest (the
"artifact trail" is the weakest dimension of every summariser measured). The trail puts them back
without a call: each distinct (tool, artifact) of the summarised groups, in order of last use, with
how often it was used and whether its last result was an error. It is bounded (the most recently used
entries kept) so that a session of thousands of calls cannot crowd out the window, and deterministic,
so it is cached with the summary it follows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from service.budget.estimate import utf8_length
from service.budget.masking import Artifact

# Bounds of the rendered trail: the most recently used entries are kept within both.
TRAIL_MAX_ENTRIES: Final = 64
TRAIL_MAX_BYTES: Final = 4096
TRAIL_HEADING: Final = (
    "Artifact trail of the summarised part (extracted by Sidequest from its tool calls, not summarised;"
    " least recently used first):"
)
# The trail at its largest, in tokens (bytes / 3, rounded up): what a plan reserves for it.
TRAIL_MAX_TOKENS: Final = -(-TRAIL_MAX_BYTES // 3)


@dataclass(frozen=True)
class TrailEntry:
    """One distinct artifact of the summarised part: how often it was used, and whether its last
    use's result was marked as an error."""

    artifact: Artifact
    uses: int
    last_error: bool

    def line(self) -> str:
        return _line(self.artifact, self.uses, self.last_error)


def _line(artifact: Artifact, uses: int, last_error: bool) -> str:
    # Terse on purpose: every byte spent on decoration is a path or a command that does not fit.
    times = f" (x{uses})" if uses > 1 else ""
    error = " [last result an error]" if last_error else ""
    return f"- {artifact.tool}: {artifact.text}{times}{error}"


def collect_trail(uses: Iterable[tuple[Artifact, bool]]) -> list[TrailEntry]:
    """Every distinct artifact of ``uses`` (in call order, each with its result's error flag), in
    order of last use (least recent first)."""
    counts: dict[Artifact, int] = {}
    last_error: dict[Artifact, bool] = {}
    order: dict[Artifact, int] = {}
    for position, (artifact, error) in enumerate(uses):
        counts[artifact] = counts.get(artifact, 0) + 1
        last_error[artifact] = error
        order[artifact] = position
    ranked = sorted(order, key=order.__getitem__)
    return [TrailEntry(a, counts[a], last_error[a]) for a in ranked]


def bound_trail(entries: Sequence[TrailEntry]) -> list[TrailEntry]:
    """The most recently used entries that fit :data:`TRAIL_MAX_ENTRIES` and, rendered with the
    heading, :data:`TRAIL_MAX_BYTES`; in their original order."""
    size = utf8_length(TRAIL_HEADING)
    kept: list[TrailEntry] = []
    for entry in reversed(entries):
        line = utf8_length(entry.line()) + 1
        if len(kept) == TRAIL_MAX_ENTRIES or size + line > TRAIL_MAX_BYTES:
            break
        kept.append(entry)
        size += line
    kept.reverse()
    return kept


def trail_tokens(entries: Sequence[TrailEntry]) -> int:
    """What the rendered trail adds after a summary (its text and the blank line before it)."""
    text = render_trail(entries)
    return -(-(utf8_length(text) + 2) // 3) if text else 0


class TrailSizes:
    """``sizes(s)``: :func:`trail_tokens` of the bounded trail of the first ``s`` groups. The uses are
    taken in once, in order, as ``s`` grows (a plan tries one ``s`` after another); each artifact's
    line length is kept as it changes, so a size costs one walk of at most the 64 newest entries."""

    def __init__(self, artifacts: Sequence[Sequence[tuple[Artifact, bool]]]) -> None:
        self._artifacts = artifacts
        self._reset()

    def _reset(self) -> None:
        self._taken = 0  # groups whose uses are in the state below
        self._uses: dict[Artifact, int] = {}
        self._error: dict[Artifact, bool] = {}
        self._line_bytes: dict[Artifact, int] = {}
        # Insertion order is last-use order: a re-used artifact is popped and put back at the end.
        self._order: dict[Artifact, None] = {}
        self._sizes: dict[int, int] = {0: 0}

    def __call__(self, groups: int) -> int:
        known = self._sizes.get(groups)
        if known is not None:
            return known
        if groups < self._taken:  # asked backwards: start over (a plan never does)
            self._reset()
        while self._taken < groups:
            for artifact, error in self._artifacts[self._taken]:
                uses = self._uses[artifact] = self._uses.get(artifact, 0) + 1
                self._error[artifact] = error
                self._line_bytes[artifact] = utf8_length(_line(artifact, uses, error)) + 1
                self._order.pop(artifact, None)
                self._order[artifact] = None
            self._taken += 1
        size = self._sizes[groups] = self._bounded_tokens()
        return size

    def _bounded_tokens(self) -> int:
        if not self._order:
            return 0
        size = utf8_length(TRAIL_HEADING)
        count = 0
        for artifact in reversed(self._order):
            line = self._line_bytes[artifact]
            if count == TRAIL_MAX_ENTRIES or size + line > TRAIL_MAX_BYTES:
                break
            size += line
            count += 1
        return -(-(size + 2) // 3) if count else 0


def render_trail(entries: Sequence[TrailEntry]) -> str:
    """The trail as prompt text (empty when there is nothing to list); ``entries`` already bounded."""
    if not entries:
        return ""
    return "\n".join([TRAIL_HEADING, *(entry.line() for entry in entries)])


__all__ = [
    "TRAIL_HEADING",
    "TRAIL_MAX_BYTES",
    "TRAIL_MAX_ENTRIES",
    "TRAIL_MAX_TOKENS",
    "TrailEntry",
    "TrailSizes",
    "bound_trail",
    "collect_trail",
    "render_trail",
    "trail_tokens",
]
