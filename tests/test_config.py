"""Settings are validated at start, with messages that name the variable and its range."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.config import SettingsError, load_settings


def test_defaults_match_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SIDEQUEST_"):
            monkeypatch.delenv(name)
    settings = load_settings()
    assert settings.provider == "offline"
    assert settings.max_output_tokens == 8192
    assert settings.max_concurrency == 4
    assert settings.request_timeout_s == 120
    assert settings.max_summary_calls == 12
    assert settings.context_window is None
    assert settings.database_url is None


@pytest.mark.parametrize("value", ["100", "255", "32769"])
def test_output_cap_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("SIDEQUEST_MAX_OUTPUT_TOKENS", value)
    with pytest.raises(SettingsError, match="SIDEQUEST_MAX_OUTPUT_TOKENS"):
        load_settings()


@pytest.mark.parametrize("value", ["256", "32768"])
def test_output_cap_edges_are_accepted(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("SIDEQUEST_MAX_OUTPUT_TOKENS", value)
    assert load_settings().max_output_tokens == int(value)


def test_plain_postgres_url_uses_asyncpg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_DATABASE_URL", "postgresql://u@h:5432/d")
    assert load_settings().database_url == "postgresql+asyncpg://u@h:5432/d"


def test_malformed_api_tokens_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_API_TOKENS", "acme")
    with pytest.raises(SettingsError, match="tenant:token"):
        load_settings()


def test_api_tokens_map_token_to_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_API_TOKENS", "acme:t1, globex:t2")
    assert load_settings().tenant_tokens() == {"t1": "acme", "t2": "globex"}


def test_cli_exits_non_zero_naming_the_variable_and_range() -> None:
    env = {**os.environ, "SIDEQUEST_MAX_OUTPUT_TOKENS": "100"}
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "migrate"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "SIDEQUEST_MAX_OUTPUT_TOKENS" in proc.stderr
    assert "accepted range 256–32768" in proc.stderr
