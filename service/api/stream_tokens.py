"""Short-lived signed tokens that let a browser's EventSource open exactly one stream: one is accepted only
as ``?token=`` on its own stream's route. The token's format, its secret and why the secret is derived
from the API tokens when none is set: docs/api.md, "Stream tokens"."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from service.config import Settings

TOKEN_TTL_S = 600


def stream_secret(settings: Settings) -> bytes:
    """The signing key for this deployment (docs/api.md)."""
    if settings.stream_token_secret:
        return hashlib.sha256(b"sidequest-stream-token:" + settings.stream_token_secret.encode()).digest()
    tokens = settings.tenant_tokens()
    if tokens:
        material = ",".join(f"{tenant}:{token}" for token, tenant in sorted(tokens.items()))
        return hmac.new(b"sidequest-stream-token-derived", material.encode(), hashlib.sha256).digest()
    return secrets.token_bytes(32)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def request_stream_name(request_id: str) -> str:
    """The stream a token for one request's events names."""
    return f"q:{request_id}"


def session_stream_name(parent_id: str) -> str:
    """The stream a token for one session's events names."""
    return f"s:{parent_id}"


def _sign(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def issue_token(secret: bytes, tenant: str, stream: str, now: float | None = None) -> tuple[str, int]:
    """A token for ``stream`` of ``tenant`` and its expiry (unix seconds)."""
    expires = int((now if now is not None else time.time()) + TOKEN_TTL_S)
    payload = json.dumps({"t": tenant, "s": stream, "e": expires}, separators=(",", ":")).encode()
    return f"{_b64(payload)}.{_b64(_sign(secret, payload))}", expires


def check_token(secret: bytes, token: str, stream: str, now: float | None = None) -> str | None:
    """The tenant of ``token`` when it is genuine, unexpired and for ``stream``; None otherwise."""
    try:
        payload, signature = map(_unb64, token.split(".", 1))
    except (ValueError, UnicodeError):
        return None
    if not hmac.compare_digest(signature, _sign(secret, payload)):
        return None
    try:
        data = json.loads(payload)
        tenant, granted, expires_at = str(data["t"]), str(data["s"]), int(data["e"])
    except (ValueError, KeyError, TypeError):
        return None
    if granted != stream or expires_at < (now if now is not None else time.time()):
        return None
    return tenant
