"""Merge planning for parallel summaries (SPEC §6.3; docs/summaries.md, "Parallel mode and merges"):
which documents each merge call takes, in rounds. Pure. :func:`planned_merge_calls` bounds the calls
with every document at its largest: next-fit never needs more groups for smaller items, so the real
rounds never need more merge calls than planned (checked by a property test).
"""

from __future__ import annotations

from collections.abc import Sequence


def merge_groups(sizes: Sequence[int], capacity: int) -> list[range]:
    """Split documents of these token ``sizes`` into consecutive groups (next-fit, order kept) whose
    sizes sum to at most ``capacity``, unless a group is a single document larger than that."""
    groups: list[range] = []
    start = 0
    used = 0
    for index, size in enumerate(sizes):
        if index > start and used + size > capacity:
            groups.append(range(start, index))
            start, used = index, 0
        used += size
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


def merge_calls_of(groups: Sequence[range]) -> int:
    """Merge calls of one round: one per group of two or more documents (a single one passes through)."""
    return sum(1 for group in groups if len(group) > 1)


def can_merge(piece_tokens: int, capacity: int) -> bool:
    """Whether one merge call can take two documents of ``piece_tokens`` each (else merging stalls)."""
    return piece_tokens > 0 and 2 * piece_tokens <= capacity


def planned_merge_calls(documents: int, piece_tokens: int, capacity: int) -> int:
    """Merge calls needed to fold ``documents`` of at most ``piece_tokens`` each into one, all rounds;
    ``ValueError`` when one call cannot take two of them (the rounds would never end)."""
    if documents < 2:
        return 0
    if not can_merge(piece_tokens, capacity):
        raise ValueError(f"a merge call of {capacity} tokens cannot take two {piece_tokens}-token documents")
    calls = 0
    while documents > 1:
        groups = merge_groups([piece_tokens] * documents, capacity)
        calls += merge_calls_of(groups)
        documents = len(groups)
    return calls
