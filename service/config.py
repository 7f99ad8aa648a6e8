"""The one settings object: every ``SIDEQUEST_`` variable of SPEC §1, validated at start."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.vocabulary import CONTEXT_WINDOW_MAX, CONTEXT_WINDOW_MIN, OUTPUT_CAP_MAX, OUTPUT_CAP_MIN

# Query parameters as libpq spells them (asyncpg reads a DSN's itself): SQLAlchemy's ssl is renamed,
# and libpq's connect_timeout, which asyncpg would send on as a server setting, yields to ours (5 s).
_QUERY_RENAMED = {"ssl": "sslmode"}
_QUERY_DROPPED = frozenset({"connect_timeout"})


def asyncpg_url(value: str | None) -> str | None:
    """The URL as asyncpg reads it (``None`` for unset or empty; docs/operations.md,
    ``SIDEQUEST_DATABASE_URL``), for the settings and the Alembic environment alike. SQLAlchemy's
    several hosts, ``?host=h1:5432&host=h2:5432``, move into the netloc as libpq writes them, because
    asyncpg reads only the last of repeated query parameters and would silently keep one host."""
    if value is None or value == "":
        return None
    value = re.sub(r"^postgres(?:ql)?://", "postgresql+asyncpg://", value)
    parts = urlsplit(value)
    if not parts.query:
        return value
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    hosts = [item for name, item in pairs if name == "host"]
    query = [
        (_QUERY_RENAMED.get(name, name), item)
        for name, item in pairs
        if name not in _QUERY_DROPPED and not (len(hosts) > 1 and name == "host")
    ]
    if len(hosts) > 1:
        userinfo, at, _ = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{userinfo}{at}{','.join(hosts)}")
    return urlunsplit(parts._replace(query=urlencode(query)))


def shown_url(url: str) -> str:
    """A database URL fit for a message: its password hidden (every host of a multi-host URL kept)."""
    try:
        parts = urlsplit(url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:***@{hosts}" if colon else parts.netloc
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:  # an unreadable URL is refused by the settings before this
        return "(the configured URL)"


def url_hosts(url: str) -> list[tuple[str, int | None]]:
    """The ``(host, port)`` pairs of a database URL's netloc, one per host of a multi-host URL;
    raises ``ValueError`` for a port that is not a number."""
    hostlist = urlsplit(url).netloc.rpartition("@")[2]
    result: list[tuple[str, int | None]] = []
    for spec in hostlist.split(","):
        if spec.startswith("["):  # an IPv6 literal, [::1]:5432
            host, _, rest = spec[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_text = spec.partition(":")
        if port_text and not port_text.isdigit():
            raise ValueError(f"port {port_text!r} is not a number")
        result.append((host, int(port_text) if port_text else None))
    return result


class Settings(BaseSettings):
    """Service settings. Read once at start by the CLI and passed down; never global."""

    model_config = SettingsConfigDict(env_prefix="SIDEQUEST_", extra="ignore", frozen=True)

    database_url: str | None = None
    data_dir: Path = Path(".sidequest")
    provider: Literal["openai", "anthropic", "offline"] = "offline"
    base_url: str | None = None
    api_key: str | None = None
    model: str | None = None
    context_window: int | None = Field(default=None, ge=CONTEXT_WINDOW_MIN, le=CONTEXT_WINDOW_MAX)
    max_output_tokens: int = Field(default=8192, ge=OUTPUT_CAP_MIN, le=OUTPUT_CAP_MAX)
    max_concurrency: int = Field(default=4, ge=1, le=1024)
    request_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    max_summary_calls: int = Field(default=12, ge=1, le=1000)
    api_tokens: str | None = None
    cors_origins: str | None = None
    # Background summaries (SPEC §6.6), parallel chunks (§6.3), calibration (§5.1).
    background_summaries: Literal["on", "off"] = "on"
    max_background_concurrency: int = Field(default=2, ge=1, le=1024)
    background_timeout_s: float = Field(default=300.0, gt=0, le=3600)
    summary_parallelism: int = Field(default=4, ge=1, le=64)
    summary_model: str | None = None
    calibration: Literal["on", "off"] = "on"

    # SPEC 9.1: the LISTEN connection apart from the pools, and what sits between pools and PostgreSQL.
    listen_database_url: str | None = None
    database_pooler: Literal["none", "transaction"] = "none"

    # Not in SPEC's table but needed to run: documented in docs/operations.md.
    lease_s: float = Field(default=30.0, gt=0, le=3600)
    heartbeat_s: float = Field(default=5.0, gt=0, le=3600)
    poll_s: float = Field(default=1.0, gt=0, le=3600)
    stream_token_secret: str | None = None
    max_question_bytes: int = Field(default=65536, ge=1)
    max_snapshot_bytes: int = Field(default=32 * 1024 * 1024, ge=1)
    max_queued_per_session: int = Field(default=20, ge=1)

    @field_validator("database_url", "listen_database_url")
    @classmethod
    def _asyncpg_url(cls, value: str | None) -> str | None:
        url = asyncpg_url(value)
        if url is None:
            return None
        if not url.startswith("postgresql+asyncpg://"):
            raise ValueError("must be a postgresql:// URL (postgresql+asyncpg:// is accepted too)")
        try:
            url_hosts(url)
        except ValueError as exc:
            raise ValueError(f"is not a URL that can be read ({exc})") from None
        return url

    def listen_url(self, database_url: str) -> str:
        """Where this process's LISTEN connection goes: ``SIDEQUEST_LISTEN_DATABASE_URL``, else the
        URL the pools use (``database_url``: the configured one, or the embedded server's)."""
        return self.listen_database_url or database_url

    @property
    def background_on(self) -> bool:
        """Whether summaries are made ahead of time (``SIDEQUEST_BACKGROUND_SUMMARIES=on``)."""
        return self.background_summaries == "on"

    @property
    def calibration_on(self) -> bool:
        """Whether the estimator learns per-model ratios (``SIDEQUEST_CALIBRATION=on``)."""
        return self.calibration == "on"

    def tenant_tokens(self) -> dict[str, str]:
        """Map token → tenant from ``tenant:token,tenant:token``. Empty (auth off) when the variable is
        unset or holds no entry at all (``","``, blanks); a token given to two tenants is refused."""
        result: dict[str, str] = {}
        for item in (self.api_tokens or "").split(","):
            item = item.strip()
            if not item:
                continue
            tenant, sep, token = item.partition(":")
            if not sep or not tenant or not token:
                raise ValueError("SIDEQUEST_API_TOKENS entries must look like tenant:token")
            if result.get(token, tenant) != tenant:
                raise ValueError(
                    "SIDEQUEST_API_TOKENS gives one token to two tenants "
                    f"({result[token]!r} and {tenant!r}); a token must name one tenant"
                )
            result[token] = tenant
        return result

    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in (self.cors_origins or "").split(",") if o.strip()]

    def resolved_api_key(self) -> str | None:
        return self.api_key or self._sdk_variable("API_KEY")

    def resolved_base_url(self) -> str | None:
        return self.base_url or self._sdk_variable("BASE_URL")

    def _sdk_variable(self, name: str) -> str | None:
        """The provider SDK's own variable (``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, …)."""
        return os.environ.get(("ANTHROPIC_" if self.provider == "anthropic" else "OPENAI_") + name)


def _accepted_range(field_name: str) -> str:
    """``; accepted range 256–32768`` (or ``> 0 and ≤ 3600``) for a bounded setting, else ``""``."""
    bounds = {
        kind: getattr(constraint, kind)
        for constraint in Settings.model_fields[field_name].metadata
        for kind in ("ge", "gt", "le")
        if getattr(constraint, kind, None) is not None
    }
    if "ge" in bounds and "le" in bounds:
        return f"; accepted range {bounds['ge']}–{bounds['le']}"
    words = {"ge": "≥", "gt": ">", "le": "≤"}
    described = " and ".join(f"{words[kind]} {value}" for kind, value in bounds.items())
    return f"; accepted: {described}" if described else ""


# Settings whose values may hold credentials: never repeated in an error message.
_SECRET_FIELDS = frozenset(
    {"database_url", "listen_database_url", "api_key", "api_tokens", "stream_token_secret"}
)


class SettingsError(Exception):
    """Settings are invalid; the message names each variable and its accepted range."""


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment, turning validation errors into one clear message."""
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
        settings.tenant_tokens()
        if settings.heartbeat_s > settings.lease_s / 2:
            raise ValueError(
                f"SIDEQUEST_HEARTBEAT_S ({settings.heartbeat_s:g}) must be at most half of SIDEQUEST_LEASE_S "
                f"({settings.lease_s:g}), so that a lease outlives one late heartbeat"
            )
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = "SIDEQUEST_" + "_".join(str(p) for p in err["loc"]).upper()
            field = str(err["loc"][0])  # every check is a field's: the model has no validator of its own
            # A URL or key can carry a password: say what was wrong, never echo the value.
            got = "" if field in _SECRET_FIELDS else f" (got {err.get('input')!r})"
            lines.append(f"{name}: {err['msg']}{got}{_accepted_range(field)}")
        raise SettingsError("invalid configuration:\n  " + "\n  ".join(lines)) from None
    except ValueError as exc:
        raise SettingsError(f"invalid configuration: {exc}") from None
    return settings
