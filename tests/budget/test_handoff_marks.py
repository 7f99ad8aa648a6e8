"""What recording a hand-off does to its session's mark and pins (handoff_marks), as a pure rule."""

from __future__ import annotations

from service.budget.handoff import HandoffBlock, handoff_marks


def block(ordinals: tuple[int, ...], omitted: tuple[int, ...] = ()) -> HandoffBlock:
    return HandoffBlock(text="…", estimate_tokens=10, ordinals=ordinals, omitted_ordinals=omitted)


def test_the_mark_moves_up_to_the_highest_carried_ordinal_and_never_down() -> None:
    assert handoff_marks(block((3, 5)), 2).handed_off_through == 5
    assert handoff_marks(block((1,)), 4).handed_off_through == 4


def test_carried_qa_are_unpinned_and_unseen_left_out_ones_pinned() -> None:
    marks = handoff_marks(block((2, 7), omitted=(1, 4, 6)), 3)
    assert marks.unpin == (2, 7)
    # #1 was at or below the old mark: the main conversation has it, so it is not pinned again.
    assert marks.pin == (4, 6)
