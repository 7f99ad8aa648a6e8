"""The summary document: strict parse, limits, deterministic rendering, storage round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.budget import estimate_text
from service.summary.document import (
    BODY_TOKEN_LIMIT,
    MAX_LIST_ITEMS,
    MAX_STRING_BYTES,
    Provenance,
    SummaryDocument,
    check_body_size,
    parse_summary_document,
    render_body,
    render_summary,
)
from service.summary.errors import SummaryInvalid, SummaryTooLong

VALID = {
    "objective": "Port the parser to Rust",
    "state": "Lexer done, parser half done",
    "decisions": ["use logos for lexing"],
    "open_work": ["error recovery"],
    "risks": [],
}


def _text(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def test_a_plain_object_with_the_five_keys_parses() -> None:
    doc = parse_summary_document(_text(VALID))
    assert doc == SummaryDocument(
        objective="Port the parser to Rust",
        state="Lexer done, parser half done",
        decisions=("use logos for lexing",),
        open_work=("error recovery",),
        risks=(),
    )


@pytest.mark.parametrize(
    "wrap",
    [
        "  \n{}\n\t ",
        "```json\n{}\n```",
        "```JSON\n{}\n```",
        "```\n{}\n```",
        "\n\n```json\n{}\n```\n",
        "```json {} ```",
    ],
)
def test_whitespace_and_one_fence_are_tolerated(wrap: str) -> None:
    doc = parse_summary_document(wrap.replace("{}", _text(VALID)))
    assert doc.objective == VALID["objective"]


@pytest.mark.parametrize(
    ("text", "reason_part"),
    [
        ("", "blank"),
        ("Here is the summary: " + _text(VALID), "not one JSON object"),
        (_text(VALID) + "\nHope this helps!", "not one JSON object"),
        (_text(VALID) + _text(VALID), "not one JSON object"),
        ("```json\n" + _text(VALID) + "\n```\n```json\n{}\n```", "more than one code fence"),
        ("Sure!\n```json\n" + _text(VALID) + "\n```", "not one JSON object"),
        ("```json\n" + _text(VALID) + "\n``` trailing", "fence"),
        ("```python\n" + _text(VALID) + "\n```", "not one JSON object"),
        (_text([VALID]), "one JSON object"),
        (_text({**VALID, "extra": 1}), "unexpected extra"),
        (_text({k: v for k, v in VALID.items() if k != "risks"}), "missing risks"),
        (_text({**VALID, "objective": 3}), "objective must be a string"),
        (_text({**VALID, "decisions": "one"}), "decisions must be a list"),
        (_text({**VALID, "risks": [1]}), "risks[0] must be a string"),
        (
            '{"objective": "a", "objective": "b", "state": "",'
            ' "decisions": [], "open_work": [], "risks": []}',
            "appears twice",
        ),
        (_text(VALID).replace('"risks": []', '"risks": [NaN]'), "NaN"),
        (_text({**VALID, "state": "\ud800"}).replace("\ud800", "\\ud800"), "Unicode"),
        (_text({"objective": " ", "state": "", "decisions": [], "open_work": [""], "risks": []}), "empty"),
    ],
)
def test_anything_else_is_invalid(text: str, reason_part: str) -> None:
    with pytest.raises(SummaryInvalid) as caught:
        parse_summary_document(text)
    assert reason_part in caught.value.reason
    assert caught.value.code == "summary_invalid"
    assert caught.value.detail["reason"] == caught.value.reason


def test_string_limit_counts_utf8_bytes_not_characters() -> None:
    # 中 is 3 bytes: 682 of them (2046 bytes) fit 2 KiB, 683 (2049 bytes) do not.
    fits = "中" * (MAX_STRING_BYTES // 3)
    parse_summary_document(_text({**VALID, "state": fits}))
    with pytest.raises(SummaryInvalid, match="state is 2049 bytes"):
        parse_summary_document(_text({**VALID, "state": fits + "中"}))
    with pytest.raises(SummaryInvalid, match=r"decisions\[1\] is 2049 bytes"):
        parse_summary_document(_text({**VALID, "decisions": ["ok", fits + "中"]}))


def test_list_limit_is_32_items() -> None:
    parse_summary_document(_text({**VALID, "open_work": ["x"] * MAX_LIST_ITEMS}))
    with pytest.raises(SummaryInvalid, match="33 items"):
        parse_summary_document(_text({**VALID, "open_work": ["x"] * (MAX_LIST_ITEMS + 1)}))


def _provenance() -> Provenance:
    return Provenance.for_qa(
        first_ordinal=1,
        covered_through_ordinal=30,
        model="m-1",
        created_at="2026-11-29T10:05:00Z",
        context_time="2026-11-29T10:00:00Z",
    )


def test_rendering_is_deterministic_and_carries_our_provenance() -> None:
    doc = parse_summary_document(_text(VALID))
    text = render_summary(doc, _provenance())
    assert text == render_summary(parse_summary_document(_text(VALID)), _provenance())
    first_line, body = text.split("\n", 1)
    assert "side Q&A ordinals 1–30" in first_line
    assert "2026-11-29T10:00:00Z" in first_line and "m-1" in first_line
    assert body == render_body(doc)
    assert body.splitlines() == [
        "Objective: Port the parser to Rust",
        "State: Lexer done, parser half done",
        "Decisions:",
        "- use logos for lexing",
        "Open work:",
        "- error recovery",
        "Risks:",
        "- (none)",
    ]


def test_context_provenance_names_the_snapshot_hash_and_message_range() -> None:
    prov = Provenance.for_context(
        prefix_hash="ab" * 32, end=140, model="m", created_at="t", context_time=None
    )
    assert prov.source == "snapshot abababababab messages 0–139"
    assert prov.message_range == (0, 140)
    assert Provenance.from_json(json.loads(json.dumps(prov.to_json()))) == prov


def test_body_limit_raises_too_long_with_size_detail() -> None:
    # One token per 3 UTF-8 bytes: 3 × 2000 bytes of items is about 2000 tokens, under the limit;
    # 700 more bytes cross it.
    big = "x" * 2000
    doc = SummaryDocument(objective="o", state="s", decisions=(big,) * 3)
    assert check_body_size(doc) == estimate_text(render_body(doc)) <= BODY_TOKEN_LIMIT
    bigger = SummaryDocument(objective="o", state="s", decisions=(big,) * 3, risks=("y" * 700,))
    with pytest.raises(SummaryTooLong) as caught:
        check_body_size(bigger)
    tokens = estimate_text(render_body(bigger))
    assert caught.value.detail == {"body_tokens": tokens, "limit": BODY_TOKEN_LIMIT}
    assert tokens > BODY_TOKEN_LIMIT


def test_stored_documents_are_validated_again() -> None:
    doc = parse_summary_document(_text(VALID))
    assert SummaryDocument.from_json(json.loads(json.dumps(doc.to_json()))) == doc
    with pytest.raises(SummaryInvalid):
        SummaryDocument.from_json({**VALID, "extra": []})


@given(
    objective=st.text(min_size=1, max_size=200).filter(lambda s: s.strip() != ""),
    state=st.text(max_size=200),
    decisions=st.lists(st.text(max_size=60), max_size=5),
    risks=st.lists(st.text(max_size=60), max_size=5),
)
def test_any_valid_document_survives_json_and_renders_identically(
    objective: str, state: str, decisions: list[str], risks: list[str]
) -> None:
    try:
        doc = SummaryDocument.from_json(
            {"objective": objective, "state": state, "decisions": decisions, "open_work": [], "risks": risks}
        )
    except SummaryInvalid:
        # Only lone surrogates may be refused here (sizes are within limits by construction).
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in objective + state + "".join(decisions + risks))
        return
    again = parse_summary_document("```json\n" + json.dumps(doc.to_json()) + "\n```")
    assert again == doc
    assert render_summary(again, _provenance()) == render_summary(doc, _provenance())
