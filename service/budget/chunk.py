"""Summary call capacity and UTF-8-safe chunking of summary material (SPEC §6.3).

A chunk fits when ``estimate_text(chunk) <= capacity``, i.e. at most ``3 × capacity`` UTF-8 bytes, so
packing works on byte counts; where it splits is in docs/budget.md "Chunking" (never inside a character).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Final

from service.budget.estimate import BYTES_PER_TOKEN, Calibration, utf8_length

# SPEC §6.3: a summary body estimated above this is "too long" and triggers the one retry; so a valid
# summary is at most this, plus its provenance header (SUMMARY_HEADER_TOKENS at the most).
SUMMARY_BODY_TOKEN_LIMIT: Final = 2200
SUMMARY_HEADER_TOKENS: Final = 200
# What a plan reserves for a summary it has not made yet: the largest valid one.
SUMMARY_MAX_TOKENS: Final = SUMMARY_BODY_TOKEN_LIMIT + SUMMARY_HEADER_TOKENS

# Output cap of a summary call's first attempt and of its single retry.
FIRST_OUTPUT_TOKENS: Final = 2048
RETRY_OUTPUT_TOKENS: Final = 8192

# Material a summary call must be able to carry for the retry to keep its SPEC cap of 8192: below it
# (a window of ~8k tokens, common for local models), the caps shrink to fit (:func:`summary_output_caps`).
MIN_SUMMARY_MATERIAL: Final = 1024

# The smallest capacity that can hold any code point: a 4-byte character is ceil(4 / 3) = 2 tokens.
MIN_CHUNK_CAPACITY: Final = 2

_ZWJ: Final = "\u200d"
_ZWNJ: Final = "\u200c"
# Where a piece is cut into lines: after every LF, each keeping its own.
_AFTER_LF: Final = re.compile("(?<=\n)")


def summary_output_caps(window: int, prompt_tokens: int, safety_margin: int) -> tuple[int, int]:
    """The output caps of a summary call's (first attempt, retry): SPEC §6.3's 2048 and 8192, unless the
    window is too small to reserve 8192 and still carry :data:`MIN_SUMMARY_MATERIAL` (an 8000-token
    window could not summarise at all): then the retry gets half of what the window leaves after the prompt
    and the margin, and the first attempt at most that."""
    room = window - safety_margin - prompt_tokens
    if room - RETRY_OUTPUT_TOKENS >= MIN_SUMMARY_MATERIAL:
        return FIRST_OUTPUT_TOKENS, RETRY_OUTPUT_TOKENS
    retry = max(1, room // 2)
    return min(FIRST_OUTPUT_TOKENS, retry), retry


def summary_capacity(
    window: int,
    prompt_tokens: int,
    safety_margin: int,
    retry_output_tokens: int = RETRY_OUTPUT_TOKENS,
    calibration: Calibration | None = None,
) -> int:
    """Tokens of material one summary call may carry, sized so a retry from it fits too; if ≤ 0 the caller
    must fail. A ``calibration`` turns the window's room (provider tokens) into raw estimate tokens."""
    room = window - safety_margin - retry_output_tokens
    if calibration is not None:
        room = calibration.raw_capacity(room)
    return room - prompt_tokens


def _is_regional_indicator(char: str) -> bool:
    return "\U0001f1e6" <= char <= "\U0001f1ff"


def _extends(char: str) -> bool:
    """Whether ``char`` attaches to the character before it (no break before it)."""
    return (
        char in (_ZWJ, _ZWNJ)
        or "\ufe00" <= char <= "\ufe0f"  # variation selectors
        or "\U000e0100" <= char <= "\U000e01ef"  # variation selectors supplement
        or "\U0001f3fb" <= char <= "\U0001f3ff"  # emoji skin-tone modifiers
        or "\U000e0020" <= char <= "\U000e007f"  # tag characters (subdivision flags)
        or unicodedata.category(char) in ("Mn", "Me", "Mc")
    )


def _is_soft_boundary(text: str, index: int) -> bool:
    """Whether ``text`` may be cut before ``text[index]`` without breaking a grapheme cluster: a
    stdlib approximation of UAX #29 (no break inside CR LF, before a mark that extends, after ZWJ, nor
    inside a flag pair; Hangul jamo sequences are not recognised, precomposed syllables are)."""
    before, after = text[index - 1], text[index]
    if before == "\r" and after == "\n":
        return False
    if before == _ZWJ or _extends(after):
        return False
    if _is_regional_indicator(before) and _is_regional_indicator(after):
        run = 0  # regional indicators right before the cut: an odd count splits a flag
        while run < index and _is_regional_indicator(text[index - run - 1]):
            run += 1
        return run % 2 == 0
    return True


def _split_characters(text: str, limit_bytes: int, first_limit_bytes: int) -> list[str]:
    """Split one line into parts of at most ``limit_bytes`` UTF-8 bytes (the first at most
    ``first_limit_bytes``, the room left in the current chunk), at grapheme boundaries where possible.
    The first part is ``""`` when that room cannot take the first cluster: a fresh chunk is better than
    a broken cluster. Only a cluster larger than a chunk is cut between code points."""
    data = text.encode("utf-8")
    parts: list[str] = []
    start = 0  # byte offset of the part being cut
    room = first_limit_bytes
    while len(data) - start > room:
        end = start + room
        # data[end] is the first byte after the candidate part; back off over continuation bytes
        # so the cut sits right before the first byte of a code point.
        while end > start and (data[end] & 0xC0) == 0x80:
            end -= 1
        piece = data[start:end].decode("utf-8")
        # The largest cut with a grapheme boundary before it (the code point right after the piece
        # decides whether its end splits a cluster); 0: the whole piece is one cluster running on past it.
        probe = piece + data[end : end + 4].decode("utf-8", errors="ignore")[:1]
        cut = len(piece)
        while cut > 0 and not _is_soft_boundary(probe, cut):
            cut -= 1
        if cut == 0:
            if room < limit_bytes:
                parts.append("")  # no cluster fits the partial room: close that chunk
                room = limit_bytes
                continue
            cut = len(piece)  # one cluster larger than a whole chunk: code points are all we have
        part = piece[:cut]
        parts.append(part)
        start += len(part.encode("utf-8"))
        room = limit_bytes
    parts.append(data[start:].decode("utf-8"))
    return parts


def chunk_pieces(pieces: Sequence[str], capacity_tokens: int) -> list[str]:
    """Pack ``pieces`` (e.g. rendered message groups) greedily into chunks that fit ``capacity_tokens``;
    ``"".join(chunks) == "".join(pieces)``. Raises ``ValueError`` below :data:`MIN_CHUNK_CAPACITY`. A unit too
    large for a whole chunk is taken apart (a piece into lines, a line into characters) and its parts go on
    filling the current chunk, so there are as few chunks (summary calls) as greedy allows."""
    if capacity_tokens < MIN_CHUNK_CAPACITY:
        raise ValueError(
            f"chunk capacity must be at least {MIN_CHUNK_CAPACITY} tokens (got {capacity_tokens}):"
            " a smaller one cannot hold a 4-byte character"
        )
    limit = capacity_tokens * BYTES_PER_TOKEN
    chunks: list[list[str]] = [[]]
    used = 0  # UTF-8 bytes in chunks[-1]
    for piece in pieces:
        # Only LF splits a piece into lines: other separators are ordinary characters.
        for line in [piece] if utf8_length(piece) <= limit else _AFTER_LF.split(piece):
            size = utf8_length(line)
            if size <= limit:  # whole: in the current chunk, or else at the start of a new one
                parts = [line] if used + size <= limit else ["", line]
            else:
                parts = _split_characters(line, limit, limit - used)
            # The first part fills the current chunk; each later one opens a new chunk.
            for at, part in enumerate(parts):
                if at:
                    chunks.append([])
                    used = 0
                chunks[-1].append(part)
                used += utf8_length(part)
    return [text for chunk in chunks if (text := "".join(chunk))]
