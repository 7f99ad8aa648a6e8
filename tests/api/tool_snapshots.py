"""Main-session snapshots shaped like real agent sessions: mostly tool payloads (SPEC §6.8), so the
compaction ladder masks them before it summarises anything. Shared by the CLI and inspector tests of
``context_info.fidelity`` (§6.10)."""

from __future__ import annotations

from typing import Any


def tool_heavy_snapshot(
    snapshot_id: str,
    *,
    groups: int,
    context_window: int,
    max_output_tokens: int,
    payload_lines: int = 12,
) -> dict[str, Any]:
    """A user request, then ``groups`` tool-call groups (an assistant ``Read`` of one file, its
    result: ``payload_lines`` lines, well over the 512-byte payload threshold), then a closing
    assistant line. Each group reads its own file, so every group has one distinct artifact."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Refactor the rounding in billing."}]
    for i in range(groups):
        path = f"billing/module_{i}.py"
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Reading {path}."},
                    {"type": "tool_use", "id": f"toolu_{i}", "name": "Read", "input": {"file_path": path}},
                ],
            }
        )
        body = "\n".join(
            f"{n:4d}  def total_{i}_{n}(invoice): return round(invoice.amount * {n}, 2)"
            for n in range(payload_lines)
        )
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": body}
        messages.append({"role": "user", "content": [result]})
    messages.append({"role": "assistant", "content": "Every billing module is read; rounding is next."})
    return {
        "snapshot_id": snapshot_id,
        "taken_at": "2026-12-01T09:00:00Z",
        "system": "You are a coding agent working on the billing service.",
        "tools": [{"name": "Read", "description": "read a file", "input_schema": {"type": "object"}}],
        "messages": messages,
        "context_window": context_window,
        "max_output_tokens": max_output_tokens,
    }
