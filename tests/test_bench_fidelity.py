"""The fidelity benchmark's own counting (benchmarks/bench_fidelity.py), without running the service.

The benchmark judges ``context_info.fidelity`` by what the model received; a miscount here would make
every verdict of it wrong, so the counting is checked on a request whose answer is known.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from service.budget.masking import Artifact
from service.budget.trail import collect_trail, render_trail

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_fidelity

LS = Artifact("Bash", "ls -la")
NEEDLE = Artifact("Grep", "needle")
KEPT = Artifact("Read", "/src/kept.py")
PROSE = Artifact("Read", "/src/only_in_prose.py")
ABSENT = Artifact("Read", "/src/absent.py")
PREFIX = Artifact("Bash", "ls")  # a prefix of a trail entry's text: not a trail entry itself


def received() -> dict[str, Any]:
    """An answer request as the OpenAI endpoint receives it: a kept (masked) tool call, a summary
    turn with its trail, prose naming a file."""
    trail = render_trail(collect_trail([(LS, False), (NEEDLE, False), (LS, True)]))
    return {
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Summary of the earlier part.\n\n" + trail}],
            },
            {
                "role": "assistant",
                "content": "I will read it.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {
                            "name": "Read",
                            "arguments": json.dumps({"file_path": "/src/kept.py", "limit": 10}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "[elided by Sidequest: 900 bytes, …]"},
            {"role": "user", "content": "Also look at /src/only_in_prose.py please."},
        ]
    }


def test_counts_artifacts_anywhere_and_where_spec_counts_them() -> None:
    everything = {LS, NEEDLE, KEPT, PROSE, ABSENT, PREFIX}
    anywhere, placed = bench_fidelity.artifacts_in_prompt(received(), everything)
    assert anywhere == {LS, NEEDLE, KEPT, PROSE, PREFIX}
    # SPEC 6.10's places only: a kept tool call of the same tool, or a whole trail line (the "(x2)"
    # and error suffixes stripped), never a line that merely starts with the text.
    assert placed == {LS, NEEDLE, KEPT}


def test_tool_call_arguments_are_read_decoded() -> None:
    body = {
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [
                    {"function": {"name": "Bash", "arguments": json.dumps({"command": 'grep "a\\"b" x'})}}
                ],
            }
        ]
    }
    anywhere, placed = bench_fidelity.artifacts_in_prompt(body, {Artifact("Bash", 'grep "a\\"b" x')})
    assert len(anywhere) == len(placed) == 1


def test_a_missing_corpus_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no corpus at"):
        bench_fidelity.load_corpus(tmp_path / "nowhere")
