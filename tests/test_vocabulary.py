"""The domain vocabulary: one timestamp format, canonical JSON, the storable-text rule, the enums and
the progress events, pinned to their exact values on the wire, which clients read."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, get_args

from hypothesis import given
from hypothesis import strategies as st

from service import vocabulary
from service.api.schemas import RequestRecord
from service.vocabulary import (
    ACTIVE,
    TERMINAL,
    UNSTORABLE_TEXT,
    Status,
    canonical_bytes,
    content_hash,
    iso_or_none,
    json_has_nul,
    unstorable_reason,
    utc_iso,
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63, max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.floats(min_value=1e-10, max_value=1e-4)  # where float reprs switch to exponents
    | st.text()
    | st.text(alphabet=st.characters(max_codepoint=0x3F)),  # control characters, quotes, escapes
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def test_timestamps_always_carry_microseconds_and_z() -> None:
    moment = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    assert utc_iso(moment) == "2026-11-29T10:00:00.000000Z"
    assert utc_iso(moment.astimezone(timezone(timedelta(hours=2)))) == "2026-11-29T10:00:00.000000Z"
    assert utc_iso(datetime(2, 1, 1, tzinfo=UTC)) == "0002-01-01T00:00:00.000000Z"
    assert iso_or_none(None) is None and iso_or_none(moment) == utc_iso(moment)
    now = utc_iso()
    assert len(now) == 27 and now.endswith("Z")


@given(JSON)
def test_canonical_json_is_the_key_sorted_compact_json_hashes_always_used(value: Any) -> None:
    dumped = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    assert canonical_bytes(value) == dumped.encode()
    assert content_hash(value) == hashlib.sha256(dumped.encode("utf-8")).hexdigest()


def test_canonical_json_writes_what_json_dumps_writes_beyond_plain_json_values_too() -> None:
    odd = {"at": datetime(2026, 12, 1, 10, 0, tzinfo=UTC), "status": Status.FAILED, "t": (1, 2), "s": "x"}
    dumped = json.dumps(odd, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)
    assert canonical_bytes(odd) == dumped.encode()
    assert canonical_bytes("a bare string") == b'"a bare string"'
    assert canonical_bytes(float("nan")) == b"NaN"  # as json.dumps: the callers refuse NaN before


def test_equal_documents_hash_equal_whatever_their_key_order() -> None:
    assert content_hash({"b": [1, {"y": 2, "x": "é"}], "a": None}) == content_hash(
        {"a": None, "b": [1, {"x": "é", "y": 2}]}
    )


def test_storable_text_says_why_not() -> None:
    assert unstorable_reason("fine \\u0000 text") is None
    assert unstorable_reason("a\x00b") == "must not contain NUL characters"
    assert unstorable_reason("lone \ud800") == "must not contain unpaired surrogates"
    assert UNSTORABLE_TEXT == "NUL characters and unpaired surrogates are not allowed"
    assert not json_has_nul(canonical_bytes({"a": [1, "x", {"k": "\\u0000"}]}))
    assert not json_has_nul(canonical_bytes({"k": "\\\\\\u0000"}))  # backslash, then the text
    assert json_has_nul(canonical_bytes({"a": [1, {"k": "x\x00"}]}))
    assert json_has_nul(canonical_bytes({"k\x00": 1}))


def test_statuses_are_their_wire_strings() -> None:
    assert [str(status) for status in Status] == ["queued", "running", "succeeded", "failed", "cancelled"]
    assert get_args(RequestRecord.model_fields["status"].annotation) == tuple(Status)  # so does OpenAPI
    assert json.dumps({"status": Status.FAILED}) == '{"status": "failed"}'
    assert TERMINAL | ACTIVE == set(Status) and not TERMINAL & ACTIVE
    assert "succeeded" in TERMINAL and Status.CANCELLED in TERMINAL and Status.RUNNING not in TERMINAL


def test_progress_events_keep_their_keys_in_order() -> None:
    def keys(event: dict[str, Any]) -> list[str]:
        return list(event)

    assert keys(vocabulary.waiting_for_background("j", "qa_fold", "k")) == ["what", "job_id", "kind", "key"]
    assert keys(vocabulary.overflow_retry(estimate_before=9)) == ["what", "estimate_before"]
    assert keys(vocabulary.overflow_retry(estimate_after=5, retry=1)) == ["what", "estimate_after", "retry"]
    replay = ["what", "replayed_groups", "replayed_ordinals", "folded_groups"]
    assert keys(vocabulary.replay(1, None, 0)) == replay
    assert vocabulary.replay(1, None, 0)["replayed_ordinals"] is None  # null, not left out
    assert vocabulary.compaction_skipped("x") == {"what": "compaction_skipped", "reason": "x"}
    assert keys(vocabulary.compaction_refused("r", "why")) == ["what", "reason", "explanation"]
    assert keys(vocabulary.compaction_refused("no_further_cut")) == ["what", "reason"]
    assert keys(
        vocabulary.context_summary_cache(
            "prefix", key="k", covered_messages=3, verbatim_tail_tokens=9, answered_without_waiting=True
        )
    ) == ["what", "cache", "key", "covered_messages", "verbatim_tail_tokens", "answered_without_waiting"]
    assert keys(
        vocabulary.context_summary_cache("miss", stage=vocabulary.Stage.COMPACTING_CONTEXT, new_messages=4)
    ) == ["stage", "what", "cache", "new_messages"]
    assert json.dumps(vocabulary.summary_chunk(vocabulary.Stage.ORGANIZING_HISTORY, "qa_summary", 1, 2)) == (
        '{"stage": "organizing_history", "what": "summary_chunk", "purpose": "qa_summary", "chunk": 1, '
        '"chunks": 2}'
    )
    merge = vocabulary.summary_merge(vocabulary.Stage.COMPACTING_CONTEXT, "context_summary", 1, 2, 3, 4)
    assert keys(merge) == ["stage", "what", "purpose", "round", "merge", "merges", "documents"]


def test_strict_json_is_rfc_8259_text_and_says_why_not() -> None:
    from service.vocabulary import NotJson, may_be_lenient_json, strict_json

    assert strict_json(b'{"b": 1, "a": ["NaN in a string", 1.5]}') == {"b": 1, "a": ["NaN in a string", 1.5]}
    assert list(strict_json(b'{"b": 1, "a": 2}')) == ["b", "a"]  # key order kept
    refused = {
        b'{"x": NaN}': "NaN is not a JSON number",
        b"[-Infinity]": "-Infinity is not a JSON number",
        '{"x": 1}'.encode("utf-16"): "not UTF-8",
        '{"x": 1}'.encode("utf-32"): "not UTF-8",
        '{"x": 1}'.encode("utf-16-le"): "",  # no BOM, NULs: not JSON text either way
        b'\xef\xbb\xbf{"x": 1}': "byte order mark",
        b'{"x": "\xff"}': "not UTF-8",
        b"[" * 100_000 + b"]" * 100_000: "nested too deeply",
        b"{": "",
    }
    beyond = {  # a number beyond a double: Python reads it too, as an infinity
        b'{"x": 1e400}': "1e400 is beyond the range of a 64-bit float",
        b"[-1E+309]": "beyond the range",
        b"[" + b"9" * 400 + b".5]": "beyond the range",
    }
    for raw, why in {**refused, **beyond}.items():
        try:
            strict_json(raw)
        except NotJson as exc:
            assert why in str(exc), (raw[:20], exc)
        else:
            raise AssertionError(f"accepted {raw[:20]!r}")
    # The C-speed prefilter flags every lenient kind (and may flag a string that only mentions one).
    # Not a number beyond a double: no substring tells one apart, and where it lands it is refused all
    # the same — a typed field wants a finite number, a snapshot's encoding and an archive refuse it.
    for raw in refused:
        if raw not in (b"{", b'{"x": "\xff"}', b"[" * 100_000 + b"]" * 100_000):
            assert may_be_lenient_json(raw), raw[:20]
    assert not may_be_lenient_json(b'{"question": "plain"}')


def test_a_rerun_is_a_progress_event_keyed_what_that_discards_the_streamed_text() -> None:
    lost = vocabulary.rerun("worker_lost", "answering", 1)
    assert list(lost) == ["stage", "what", "attempt", "discard_streamed_text"]
    assert lost["what"] == "worker_lost_rerun" and lost["discard_streamed_text"] is True
    stopped = vocabulary.rerun("worker_stopped", None)
    assert stopped == {"stage": None, "what": "worker_stopped_rerun", "discard_streamed_text": True}


def test_terminal_error_objects_have_code_message_and_an_object_detail() -> None:
    for error in (
        vocabulary.cancelled_error(),
        vocabulary.cancelled_error(vocabulary.CANCELLED_BY_CLEAR),
        vocabulary.session_cleared_error(),
        vocabulary.taken_over_error(),
        vocabulary.worker_lost_error(2, "answering", "request"),
        vocabulary.timeout_error("the side request", 30.0, "answering"),
        vocabulary.snapshot_missing_error(),
    ):
        assert list(error) == ["code", "message", "detail"] and isinstance(error["detail"], dict)
    lost = vocabulary.worker_lost_error(2, None, "job")
    assert lost["detail"] == {"attempts": 2, "stage": None} and "job" in lost["message"]


def test_hand_off_times_are_the_one_format_cut_to_the_second() -> None:
    moment = datetime(2026, 11, 29, 10, 3, 10, 123456, tzinfo=UTC)
    assert vocabulary.utc_iso_seconds(moment) == "2026-11-29T10:03:10Z"
    assert vocabulary.utc_iso(moment).startswith("2026-11-29T10:03:10.")
    assert vocabulary.utc_iso_seconds(None) is None
