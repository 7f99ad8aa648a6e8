"""SPEC §5 / §11.2: the session's window and output cap sit between the request's and the rest."""

from __future__ import annotations

from service.budget import resolve_output_cap, resolve_window
from service.budget.window import DEFAULT_WINDOW


def test_window_order_is_request_session_snapshot_config_default() -> None:
    assert resolve_window(1000, 2000, 3000, session_window=4000) == 1000
    assert resolve_window(None, 2000, 3000, session_window=4000) == 4000
    assert resolve_window(None, 2000, 3000, session_window=None) == 2000
    assert resolve_window(None, None, 3000, session_window=None) == 3000
    assert resolve_window(None, None, None, session_window=0) == DEFAULT_WINDOW


def test_output_cap_order_is_request_session_config_and_never_above_the_main_cap() -> None:
    assert resolve_output_cap(1000, 8192, None, session_cap=3000) == 1000
    assert resolve_output_cap(None, 8192, None, session_cap=3000) == 3000
    assert resolve_output_cap(None, 8192, None, session_cap=None) == 8192
    assert resolve_output_cap(None, 8192, 2000, session_cap=3000) == 2000
    assert resolve_output_cap(4000, 8192, 2000, session_cap=3000) == 2000
