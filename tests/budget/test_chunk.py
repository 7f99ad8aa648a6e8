"""Summary capacity and UTF-8-safe chunking (SPEC §6.3)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import (
    FIRST_OUTPUT_TOKENS,
    MIN_CHUNK_CAPACITY,
    RETRY_OUTPUT_TOKENS,
    chunk_pieces,
    estimate_text,
    safety_margin,
    summary_capacity,
)

from .strategies import mixed_text

FAMILY = "👨\u200d👩\u200d👧\u200d👦"  # one cluster of 7 code points, 25 bytes


def split_text(text: str, capacity: int) -> list[str]:
    """One string chunked alone: the splitting rules without any packing of pieces."""
    return chunk_pieces([text], capacity)


def test_attempt_output_caps() -> None:
    assert FIRST_OUTPUT_TOKENS == 2048
    assert RETRY_OUTPUT_TOKENS == 8192


def test_capacity_reserves_the_retry_output_and_prompt() -> None:
    margin = safety_margin(200_000)
    assert summary_capacity(200_000, 1500, margin) == 200_000 - 8192 - 8192 - 1500
    assert summary_capacity(200_000, 1500, margin, retry_output_tokens=4096) == 200_000 - 8192 - 4096 - 1500


def test_capacity_can_be_exhausted() -> None:
    assert summary_capacity(8192, 500, safety_margin(8192)) < 0
    assert summary_capacity(16_384, 0, safety_margin(16_384)) == 16_384 - 820 - 8192


def test_pieces_are_packed_greedily_at_piece_boundaries() -> None:
    pieces = ["a" * 30, "b" * 30, "c" * 30]  # 10 tokens each
    assert chunk_pieces(pieces, 20) == ["a" * 30 + "b" * 30, "c" * 30]
    assert chunk_pieces(pieces, 30) == ["".join(pieces)]


def test_a_piece_that_fits_a_fresh_chunk_is_not_split() -> None:
    pieces = ["a" * 15, "b\n" * 15]  # 5 and 10 tokens; 15 > capacity 12
    assert chunk_pieces(pieces, 12) == ["a" * 15, "b\n" * 15]


def test_oversized_piece_splits_at_lines() -> None:
    piece = "line one\n" * 10  # 90 bytes, 30 tokens
    chunks = chunk_pieces(["intro\n", piece], 10)  # 30 bytes per chunk
    assert "".join(chunks) == "intro\n" + piece
    assert all(chunk.endswith("\n") for chunk in chunks)
    assert all(estimate_text(chunk) <= 10 for chunk in chunks)
    assert chunks[0] == "intro\n" + "line one\n" * 2  # the oversized piece fills the open chunk


def test_overlong_line_splits_between_characters() -> None:
    text = "中" * 10  # 30 bytes; capacity 2 → 6 bytes → two characters per chunk
    assert split_text(text, 2) == ["中中"] * 5


def test_never_splits_inside_a_utf8_character() -> None:
    text = "a" + "中" * 5  # 16 bytes: with 6-byte chunks a byte cut would fall inside 中
    parts = split_text(text, 2)
    assert "".join(parts) == text
    assert parts == ["a中", "中中", "中中"]


def test_emoji_and_zwj_sequences_stay_whole_when_they_fit() -> None:
    text = FAMILY * 3
    parts = split_text(text, 9)  # 27 bytes: one family per chunk
    assert parts == [FAMILY] * 3


def test_cluster_larger_than_a_chunk_splits_between_code_points() -> None:
    parts = split_text(FAMILY, 3)  # 9 bytes < 25 bytes
    assert "".join(parts) == FAMILY
    assert all(estimate_text(part) <= 3 for part in parts)


def test_combining_marks_stay_with_their_base() -> None:
    text = "e\u0301" * 10  # 3 bytes per cluster
    parts = split_text(text, 3)  # 9 bytes
    assert parts == ["e\u0301" * 3] * 3 + ["e\u0301"]


def test_flags_are_not_split_between_their_regional_indicators() -> None:
    text = "🇯🇵🇺🇸🇫🇷"  # three flags of 8 bytes
    assert split_text(text, 3) == ["🇯🇵", "🇺🇸", "🇫🇷"]
    # A 9-byte cut of "xx🇯🇵" would fall between the flag's two indicators; it backs off before it.
    assert split_text("xx🇯🇵", 3) == ["xx", "🇯🇵"]
    assert split_text("🇯🇵🇺🇸x", 5) == ["🇯🇵", "🇺🇸x"]


def test_skin_tone_and_variation_selector_stay_attached() -> None:
    text = "👍🏽" * 3 + "❤\ufe0f" * 3  # 8 and 6 bytes per cluster
    parts = split_text(text, 3)  # 9 bytes
    assert parts == ["👍🏽"] * 3 + ["❤\ufe0f"] * 3


def test_crlf_is_not_split() -> None:
    # A 6-byte cut of the 7-byte line would fall between CR and LF; it backs off before the CR.
    assert split_text("xxxxx\r\nyy", 2) == ["xxxxx", "\r\nyy"]


def test_empty_input_gives_no_chunks() -> None:
    assert split_text("", 10) == []
    assert chunk_pieces([], 10) == []
    assert chunk_pieces(["", ""], 10) == []


def test_capacity_below_minimum_is_refused() -> None:
    assert MIN_CHUNK_CAPACITY == 2
    for capacity in (-1, 0, 1):
        with pytest.raises(ValueError):
            split_text("x", capacity)
        with pytest.raises(ValueError):
            chunk_pieces(["x"], capacity)


def test_four_byte_character_fits_the_minimum_capacity() -> None:
    assert split_text("😀😀", 2) == ["😀", "😀"]


def _clusters_cut(parts: list[str]) -> int:
    """How many cuts fall right before a combining mark (a split grapheme cluster)."""
    return sum(1 for part in parts[1:] if part and unicodedata.combining(part[0]))


@given(st.lists(mixed_text, max_size=12), st.integers(MIN_CHUNK_CAPACITY, 120))
@settings(max_examples=150)
def test_chunks_rejoin_exactly_and_respect_capacity(pieces: list[str], capacity: int) -> None:
    chunks = chunk_pieces(pieces, capacity)
    assert "".join(chunks) == "".join(pieces)
    assert all(chunk and estimate_text(chunk) <= capacity for chunk in chunks)


@given(mixed_text, st.integers(MIN_CHUNK_CAPACITY, 60))
@settings(max_examples=150)
def test_split_text_rejoins_exactly_and_respects_capacity(text: str, capacity: int) -> None:
    parts = split_text(text, capacity)
    assert "".join(parts) == text
    assert all(part and estimate_text(part) <= capacity for part in parts)
    # Round-tripping through UTF-8 per part proves no part ends inside a character.
    assert b"".join(part.encode("utf-8") for part in parts) == text.encode("utf-8")


@given(
    st.lists(st.sampled_from(["e\u0301", "a\u0308\u0301", "中", "x"]), min_size=1, max_size=60),
    st.integers(3, 30),
)
@settings(max_examples=100)
def test_combining_sequences_are_kept_whole_when_a_cluster_fits(clusters: list[str], capacity: int) -> None:
    # Every cluster here is at most 5 bytes, and capacity >= 3 gives >= 9 bytes per chunk.
    assert _clusters_cut(split_text("".join(clusters), capacity)) == 0


@given(st.lists(st.text(max_size=40), min_size=1, max_size=10), st.integers(MIN_CHUNK_CAPACITY, 80))
@settings(max_examples=100)
def test_pieces_that_fit_are_never_split(pieces: list[str], capacity: int) -> None:
    fitting = [piece for piece in pieces if piece and estimate_text(piece) <= capacity]
    chunks = chunk_pieces(fitting, capacity)
    # Each chunk is a concatenation of whole consecutive pieces.
    position = 0
    for chunk in chunks:
        joined = ""
        while len(joined) < len(chunk):
            joined += fitting[position]
            position += 1
        assert joined == chunk
    assert position == len(fitting)


CLUSTERS = ["e\u0301", "a\u0308\u0301", "中", "x", "👍🏽", "\n"]


@given(
    st.lists(
        st.lists(st.sampled_from(CLUSTERS), max_size=40).map("".join),
        min_size=1,
        max_size=8,
    ),
    st.integers(3, 30),
)
@settings(max_examples=100)
def test_packing_into_a_partly_filled_chunk_keeps_clusters_whole(pieces: list[str], capacity: int) -> None:
    # Clusters are at most 8 bytes and chunks at least 9, so no cluster ever needs cutting, even
    # when an oversized piece starts filling the room left in a partly filled chunk.
    chunks = chunk_pieces(pieces, capacity)
    assert "".join(chunks) == "".join(pieces)
    assert _clusters_cut(chunks) == 0
    assert not any(chunk.startswith("\U0001f3fd") for chunk in chunks)  # skin tone never split off


def test_calibrated_summary_capacity_fits_prompt_and_material_once_scaled() -> None:
    from service.budget import Calibration

    calibration = Calibration(samples=5, estimate_sum=5000, provider_sum=7500)
    margin = safety_margin(200_000)
    room = 200_000 - margin - 8192
    raw = summary_capacity(200_000, 1500, margin)
    calibrated = summary_capacity(200_000, 1500, margin, calibration=calibration)
    assert calibrated == room * 2 // 3 - 1500 < raw
    # The whole input (prompt + material) of a full chunk fits the room in the provider's tokens.
    assert calibration.apply(calibrated + 1500) <= room
    # Fewer than 5 samples: nothing changes.
    assert summary_capacity(200_000, 1500, margin, calibration=Calibration(1, 1, 2)) == raw
