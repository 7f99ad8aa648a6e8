"""The stored copy of a snapshot as posted (service.store.sessions.posted_json): orjson's fast path
keeps the key order and the value; what orjson would refuse takes json.dumps."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from service.budget.prepared import UnstorableSnapshot, encode_snapshot
from service.store.sessions import posted_json


def _stored(content: dict[str, Any]) -> str:
    return posted_json(content, encode_snapshot(content))


def test_key_order_and_value_are_kept() -> None:
    content = {
        "z": 1,
        "messages": [{"role": "user", "content": "é \u2028 ✓", "a": [1.5, 1e16, None]}],
        "b": True,
    }
    text = _stored(content)
    assert json.loads(text) == content
    assert list(json.loads(text)) == ["z", "messages", "b"]
    assert text.index('"z"') < text.index('"messages"') < text.index('"b"')


def test_huge_integers_are_written_as_json_dumps_writes_them() -> None:
    for content in ({"messages": [], "x": 2**80}, {"messages": [{"role": "user", "n": [-(2**70)]}]}):
        assert _stored(content) == json.dumps(content, ensure_ascii=False, separators=(",", ":"))


def test_a_non_finite_number_never_reaches_it() -> None:
    """orjson would write null for one; encode_snapshot refuses it first (1e400 parses as inf)."""
    for content in ({"messages": [], "x": math.nan}, {"messages": [{"role": "user", "x": [-math.inf]}]}):
        with pytest.raises(UnstorableSnapshot) as refused:
            encode_snapshot(content)
        assert refused.value.reason == "number"


def test_a_string_that_looks_non_finite_is_still_exact() -> None:
    for text in (":NaN,Infinity", "[-Infinity", "a,NaN"):
        content = {"messages": [{"role": "user", "content": text}], "n": [1.5, -2.0e300]}
        assert json.loads(_stored(content)) == content
