"""The merge prompt (pure): what it carries, what capacity reserves for it, and that the chunk prompts
stay byte-for-byte those of their prompt version (ordered mode unchanged, cached summaries valid)."""

from __future__ import annotations

import hashlib
import json

import pytest

from service.budget import estimate_messages, estimate_system, estimate_text
from service.summary.prompts import (
    MERGE_CLOSE,
    MERGE_OPEN,
    PROMPT_VERSION,
    SummaryKind,
    build_merge_prompt,
    build_summary_prompt,
    merge_piece,
    merge_prompt_reserve,
    summary_prompt_reserve,
    summary_system_prompt,
)

# sha256 of every chunk-prompt variant and both reserves under "summary-prompts-1", the prompts the
# cached summaries of that version were made with. A change here is a change of those prompts: bump
# PROMPT_VERSION (it is part of the context-summary cache key) and take the new hash.
CHUNK_PROMPTS_SHA256 = {
    "summary-prompts-1": "337d350bab82960a139864266459ea01028e0b55a9b7ec0ffda5e7c46bfd46c5",
}


def test_the_chunk_prompts_are_unchanged_for_this_prompt_version() -> None:
    out = []
    for kind in ("qa", "context"):
        for previous in (None, "Objective: x\nState: y"):
            for retry in (False, True):
                for chunk, chunks in ((1, 1), (2, 3)):
                    prompt = build_summary_prompt(
                        kind, "MAT\nERIAL", previous_body=previous, retry=retry, chunk=chunk, chunks=chunks
                    )
                    out.append(json.dumps([prompt.system, prompt.messages]))
        out.append(str(summary_prompt_reserve(kind)))
    assert hashlib.sha256("\n".join(out).encode()).hexdigest() == CHUNK_PROMPTS_SHA256[PROMPT_VERSION]


@pytest.mark.parametrize("kind", ["qa", "context"])
def test_a_merge_prompt_carries_the_documents_in_order_with_the_kinds_system_prompt(
    kind: SummaryKind,
) -> None:
    bodies = ["Objective: first\nState: a", "Objective: second\nState: b", "Objective: third\nState: c"]
    prompt = build_merge_prompt(kind, bodies, retry=False)
    assert prompt.system == summary_system_prompt(kind)
    (message,) = prompt.messages
    text = message["content"]
    assert text.index("first") < text.index("second") < text.index("third")
    assert MERGE_OPEN + "".join(merge_piece(i, b) for i, b in enumerate(bodies, 1)) + MERGE_CLOSE in text
    assert "3 partial summaries" in text and "keep the conclusions" in text
    assert "under 600 tokens" in build_merge_prompt(kind, bodies, retry=True).messages[0]["content"]
    with pytest.raises(ValueError):
        build_merge_prompt(kind, bodies[:1], retry=False)


@pytest.mark.parametrize("kind", ["qa", "context"])
def test_capacity_reserves_the_merge_prompt_and_its_size_is_the_skeleton_plus_its_pieces(
    kind: SummaryKind,
) -> None:
    assert summary_prompt_reserve(kind) >= merge_prompt_reserve(kind)
    bodies = ["Objective: 連接池\nState: " + "x" * n for n in (1, 100, 2000, 6000)]
    for retry in (False, True):
        prompt = build_merge_prompt(kind, bodies, retry=retry)
        size = estimate_system(prompt.system) + estimate_messages(prompt.messages)
        pieces = sum(estimate_text(merge_piece(len(bodies), body)) for body in bodies)
        assert size <= merge_prompt_reserve(kind) + pieces
