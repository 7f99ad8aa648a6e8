"""Chunk capacity under calibration (SPEC 5.1): how much material fits one summary call."""

from __future__ import annotations

import dataclasses

from service.budget import RETRY_OUTPUT_TOKENS, Calibration, estimate_text, safety_margin
from service.summary.prompts import summary_prompt_reserve
from tests.summary.conftest import RunnerFactory


def _calibration(estimate: int, provider: int, samples: int = 5) -> Calibration:
    return Calibration(samples, samples * estimate, samples * provider)


def test_a_tokenizer_counting_more_gets_smaller_chunks(make_runner: RunnerFactory) -> None:
    plain = make_runner(window=60_000)
    calibrated = dataclasses.replace(plain, calibration=_calibration(1000, 1500))
    room = 60_000 - safety_margin(60_000) - RETRY_OUTPUT_TOKENS
    assert plain.capacity("context") == room - summary_prompt_reserve("context")
    capacity = calibrated.capacity("context")
    assert capacity == room * 2 // 3 - summary_prompt_reserve("context")
    # A full chunk plus its prompt fits the window's room once counted the provider's way.
    assert calibrated.calibration is not None
    assert calibrated.calibration.apply(capacity + summary_prompt_reserve("context")) <= room

    pieces = ["x" * 3000 * 10 for _ in range(12)]  # 12 pieces of 10 000 tokens
    assert len(plain.chunk("context", pieces)) < len(calibrated.chunk("context", pieces))
    for chunk in calibrated.chunk("context", pieces):
        assert estimate_text(chunk) <= capacity


def test_fewer_than_five_samples_change_nothing(make_runner: RunnerFactory) -> None:
    plain = make_runner(window=60_000)
    early = dataclasses.replace(plain, calibration=_calibration(1000, 1500, samples=4))
    assert early.capacity("qa") == plain.capacity("qa")
