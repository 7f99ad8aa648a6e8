"""Session summary instructions in the summary prompt (SPEC §11.2): after the built-in instructions,
reserved in the chunk size, part of the cache key's prompt version, the format unchanged."""

from __future__ import annotations

from service.summary.prompts import (
    PROMPT_VERSION,
    build_summary_prompt,
    prompt_version,
    summary_prompt_reserve,
    summary_system_prompt,
)

INSTRUCTIONS = "Keep every ticket number (JIRA-123) verbatim."


def test_instructions_follow_the_built_in_prompt_which_stays_whole() -> None:
    for kind in ("qa", "context"):
        for retry in (False, True):
            prompt = build_summary_prompt(
                kind, "material", previous_body=None, retry=retry, instructions=INSTRUCTIONS
            )
            built_in = summary_system_prompt(kind)
            assert prompt.system.startswith(built_in)
            assert prompt.system.index(INSTRUCTIONS) > len(built_in)
            assert (
                "exactly one JSON object" in prompt.system[len(built_in) :]
            )  # the format is restated, not changed
        plain = build_summary_prompt(kind, "material", previous_body=None, retry=False)
        assert plain.system == summary_system_prompt(kind)
        assert (
            build_summary_prompt(kind, "m", previous_body=None, retry=False, instructions="  ").system
            == plain.system
        )


def test_the_reserve_grows_by_the_instructions_so_chunks_still_fit() -> None:
    long = "x" * 4096
    assert summary_prompt_reserve("qa", long) >= summary_prompt_reserve("qa") + 4096 // 3


def test_prompt_version_names_the_instructions() -> None:
    assert prompt_version(None) == prompt_version("") == PROMPT_VERSION
    assert prompt_version(INSTRUCTIONS) != PROMPT_VERSION
    assert prompt_version(INSTRUCTIONS) == prompt_version(INSTRUCTIONS + "\n")
    assert prompt_version(INSTRUCTIONS) != prompt_version("other")
