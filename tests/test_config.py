"""Settings are validated at start, with messages that name the variable and its range."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import SettingsError, load_settings
from tests.net import free_port


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


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SIDEQUEST_LEASE_S", "inf"),
        ("SIDEQUEST_LEASE_S", "0"),
        ("SIDEQUEST_POLL_S", "nan"),
        ("SIDEQUEST_MAX_QUEUED_PER_SESSION", "0"),
        ("SIDEQUEST_MAX_QUEUED_PER_SESSION", "-1"),
        ("SIDEQUEST_MAX_QUESTION_BYTES", "-1"),
        ("SIDEQUEST_MAX_SNAPSHOT_BYTES", "-5"),
        ("SIDEQUEST_DATABASE_URL", "not-a-url"),
        ("SIDEQUEST_DATABASE_URL", "mysql://root@127.0.0.1/x"),
        ("SIDEQUEST_DATABASE_URL", "postgresql://u@h:port/d"),
    ],
)
def test_values_the_service_cannot_run_with_stop_it_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        load_settings()


def test_a_refused_database_url_is_not_repeated_with_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_DATABASE_URL", "mysql://root:s3cret@db/x")
    with pytest.raises(SettingsError, match=r"SIDEQUEST_DATABASE_URL: .*postgresql://") as refused:
        load_settings()
    assert "s3cret" not in str(refused.value)


def test_a_heartbeat_slower_than_half_the_lease_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_HEARTBEAT_S", "100")
    with pytest.raises(SettingsError, match=r"SIDEQUEST_HEARTBEAT_S.*SIDEQUEST_LEASE_S"):
        load_settings()
    monkeypatch.setenv("SIDEQUEST_LEASE_S", "200")
    assert load_settings().heartbeat_s == 100


def test_a_token_given_to_two_tenants_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDEQUEST_API_TOKENS", "alice:same,bob:same")
    with pytest.raises(SettingsError, match="two tenants"):
        load_settings()
    monkeypatch.setenv("SIDEQUEST_API_TOKENS", "alice:old,alice:new")  # a rotation: both are alice's
    assert load_settings().tenant_tokens() == {"old": "alice", "new": "alice"}


@pytest.mark.parametrize("value", [",", " ", " , "])
def test_tokens_that_name_no_token_leave_auth_off_and_the_loopback_guard_on(value: str) -> None:
    """SPEC 1: no auth, and then the server refuses to bind anything but loopback — whether the
    variable is unset or holds only separators and blanks."""
    env = {**os.environ, "SIDEQUEST_API_TOKENS": value}
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--host", "0.0.0.0", "--port", "9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "refusing to bind 0.0.0.0" in proc.stderr


def test_libpq_style_query_parameters_are_kept_for_asyncpg(monkeypatch: pytest.MonkeyPatch) -> None:
    """?sslmode=… is how a managed PostgreSQL is reached: asyncpg reads it from the DSN (passed on as
    a keyword it would crash every command); SQLAlchemy's ?ssl= spelling is renamed, and
    connect_timeout gives way to the service's own."""
    monkeypatch.setenv(
        "SIDEQUEST_DATABASE_URL",
        "postgresql://u:p@h:5432/d?sslmode=require&application_name=sq&connect_timeout=10",
    )
    assert (
        load_settings().database_url
        == "postgresql+asyncpg://u:p@h:5432/d?sslmode=require&application_name=sq"
    )
    monkeypatch.setenv("SIDEQUEST_DATABASE_URL", "postgresql+asyncpg://u@h/d?ssl=require")
    assert load_settings().database_url == "postgresql+asyncpg://u@h/d?sslmode=require"


@pytest.mark.parametrize("command", ["migrate", "worker"])
def test_a_database_that_cannot_be_used_at_start_is_one_clear_line_without_its_password(
    database_url: str, command: str
) -> None:
    """An unreachable database, or one that does not exist, is one line naming SIDEQUEST_DATABASE_URL
    (password hidden) and the driver's reason, not a traceback an operator must dig through."""
    from sqlalchemy.engine import make_url

    existing = make_url(database_url)
    cases = {
        f"postgresql://postgres:s3cret@127.0.0.1:{free_port()}/x": "Connect call failed",
        existing.set(database="sidequest_no_such_db").render_as_string(hide_password=False): "does not exist",
    }
    for url, reason in cases.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")}
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", command],
            env={**env, "SIDEQUEST_DATABASE_URL": url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stderr
        lines = done.stderr.strip().splitlines()
        assert lines[-1].startswith("sidequest: cannot use the database (") and reason in lines[-1], lines
        assert "SIDEQUEST_DATABASE_URL" in lines[-1] and "s3cret" not in done.stderr
        assert "Traceback" not in done.stderr


def test_a_provider_that_cannot_be_built_stops_the_process_with_one_line(
    tmp_path: Path,
) -> None:
    """With the anthropic SDK missing, each process stops with one line saying how to fix it, not
    start-up tracebacks ending in an unrelated error. An importable stand-in that raises ImportError
    plays the missing SDK."""
    fake = tmp_path / "anthropic"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no anthropic here')\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")}
    for command in ("worker", "api"):
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", command],
            env={
                **env,
                "PYTHONPATH": str(tmp_path),
                "SIDEQUEST_PROVIDER": "anthropic",
                "SIDEQUEST_API_KEY": "x",
                "SIDEQUEST_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/never-reached",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            "sidequest: SIDEQUEST_PROVIDER=anthropic needs the anthropic SDK, a dependency of Sidequest: "
            "reinstall Sidequest (pip install 'sidequest[anthropic]')"
        ]
