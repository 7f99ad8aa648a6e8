"""The settings of SPEC 9.1: several hosts, the LISTEN connection apart, the pooler."""

from __future__ import annotations

import pytest

from service.config import SettingsError, asyncpg_url, load_settings, shown_url, url_hosts


def test_sqlalchemys_repeated_host_parameters_become_libpqs_host_list() -> None:
    url = asyncpg_url("postgresql://u:p@/db?host=h1:5432&host=h2:5433&target_session_attrs=read-write")
    assert url == "postgresql+asyncpg://u:p@h1:5432,h2:5433/db?target_session_attrs=read-write"
    assert url_hosts(url) == [("h1", 5432), ("h2", 5433)]


def test_a_single_host_parameter_is_left_as_it_is() -> None:
    # libpq's way to name a Unix socket directory: not a host list.
    assert asyncpg_url("postgresql://u@/db?host=/run/pg") == "postgresql+asyncpg://u@/db?host=%2Frun%2Fpg"


def test_multi_host_urls_are_read_and_their_ports_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "SIDEQUEST_DATABASE_URL", "postgresql://u:secret@a:6432,b:6432/db?target_session_attrs=read-write"
    )
    monkeypatch.setenv("SIDEQUEST_LISTEN_DATABASE_URL", "postgresql://u:secret@a:5432,[::1]:5432/db")
    monkeypatch.setenv("SIDEQUEST_DATABASE_POOLER", "transaction")
    settings = load_settings()
    assert settings.database_pooler == "transaction"
    assert settings.database_url is not None
    assert settings.listen_url(settings.database_url) == "postgresql+asyncpg://u:secret@a:5432,[::1]:5432/db"
    assert url_hosts(settings.listen_url(settings.database_url)) == [("a", 5432), ("::1", 5432)]
    assert shown_url(settings.database_url) == (
        "postgresql+asyncpg://u:***@a:6432,b:6432/db?target_session_attrs=read-write"
    )

    monkeypatch.setenv("SIDEQUEST_LISTEN_DATABASE_URL", "postgresql://u:secret@a:5432,b:x/db")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "SIDEQUEST_LISTEN_DATABASE_URL" in str(caught.value)
    assert "secret" not in str(caught.value)


def test_the_listen_connection_follows_the_pools_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_DATABASE_URL", "postgresql://u@h:5432/db")
    settings = load_settings()
    assert settings.listen_url("postgresql+asyncpg://u@h:5432/db") == "postgresql+asyncpg://u@h:5432/db"
    assert settings.database_pooler == "none"


def test_an_unknown_pooler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_DATABASE_POOLER", "session")
    with pytest.raises(SettingsError, match="SIDEQUEST_DATABASE_POOLER"):
        load_settings()
