"""The archive format without a database: upgrades, the settings rule a PUT has, encode ∘ parse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from service.archive import ArchiveInvalid, encode_archive, parse_archive
from service.archive.model import SessionSettingsIn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "archives"


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    return data


def locs(refused: pytest.ExceptionInfo[ArchiveInvalid]) -> list[str]:
    return [e["loc"] for e in refused.value.detail["errors"]]


@pytest.mark.parametrize("name", ["v1.json", "v2.json", "v3.json"])
def test_encoding_a_parsed_archive_gives_the_document_back(name: str) -> None:
    document = fixture(name)
    encoded = encode_archive(parse_archive(document))
    assert {k: v for k, v in encoded.items() if k != "exported_at"} == {
        k: v for k, v in document.items() if k != "exported_at"
    }


def test_a_v1_archive_is_succeeded_history_and_refuses_the_fields_of_later_versions() -> None:
    archive = parse_archive(fixture("v1.json"))
    assert {r.status for r in archive.requests} == {"succeeded"} and archive.version == 1
    assert archive.memory is None and archive.settings is None
    document = fixture("v1.json")
    document["questions"][0].update(status="failed", context_info={})
    with pytest.raises(ArchiveInvalid) as refused:
        parse_archive(document)
    assert locs(refused) == ["questions[0].status", "questions[0].context_info"]


def test_a_v2_archive_refuses_the_fields_of_version_3() -> None:
    document = {**fixture("v2.json"), "session": {}}
    document["questions"][0]["pinned"] = False
    with pytest.raises(ArchiveInvalid) as refused:
        parse_archive(document)
    assert locs(refused) == ["session", "questions[0].pinned"]
    assert [r.context_info for r in parse_archive(fixture("v2.json")).requests] == [{}, {}, {}]


def test_json_the_service_keeps_is_restored_as_the_archive_has_it() -> None:
    document = fixture("v3.json")
    document["questions"][0]["context_info"] = {"fidelity": {"tier": "verbatim", "new": [1.5, None]}}
    document["questions"][0]["usage"]["calls"][0]["later_field"] = {"x": 1}
    archive = parse_archive(document)
    assert archive.requests[0].context_info is document["questions"][0]["context_info"]
    assert archive.requests[0].usage is document["questions"][0]["usage"]


SETTING_VALUES: dict[str, list[object]] = {
    "summary_instructions": [None, "", "x" * 4096, "x" * 4097, "é" * 2048, "é" * 2049, 5, "a\x00", "\ud800"],
    "summary_model": [None, "", "m", "m" * 200, "m" * 201, 5, "a\x00"],
    "answer_model": [None, "", "m" * 201, ["m"]],
    "context_window": [None, 1023, 1024, 4096.0, 4096.5, 10_000_000, 10_000_001, "4096", True],
    "max_output_tokens": [255, 256, 1024.0, 32768, 32769, False],
    "on_busy": [None, "enqueue", "reject", "interrupt", "sometimes", 1],
    "mask_tool_results": [None, True, False, 1, "true"],
    "bogus": [1, None],
}


@pytest.mark.parametrize(
    ("name", "value"), [(name, value) for name, values in SETTING_VALUES.items() for value in values]
)
def test_archived_settings_are_refused_exactly_when_a_put_would_refuse_them(name: str, value: object) -> None:
    document = {"version": 3, "parent_id": "p", "questions": [], "session": {"settings": {name: value}}}
    try:
        SessionSettingsIn.model_validate({name: value})  # a PUT's body
    except ValidationError:
        refused = True
    else:
        refused = False
    try:
        parse_archive(document)
    except ArchiveInvalid as exc:
        assert refused, exc.detail
        assert [e["loc"] for e in exc.detail["errors"]] == [f"session.settings.{name}"]
    else:
        assert not refused


def test_problems_come_document_first_then_question_by_question() -> None:
    document = fixture("v3.json")
    document["questions"][1]["ordinal"] = -1
    document["questions"][0]["question"] = ""
    document["questions"][0]["usage"]["input_tokens"] = float("nan")
    document["session"]["handed_off_through"] = "x"
    with pytest.raises(ArchiveInvalid) as refused:
        parse_archive(document)
    # The NaN counter is reported once, as what PostgreSQL cannot store, not also as a wrong type.
    assert locs(refused) == [
        "session.handed_off_through",
        "questions[0].usage.input_tokens",
        "questions[0].question",
        "questions[1].ordinal",
    ]
    assert refused.value.message.startswith("invalid version 3 archive: session.handed_off_through ")
    assert refused.value.message.endswith(" (and 3 more)")
