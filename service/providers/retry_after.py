"""How long a rate-limited provider asks us to wait (docs/providers.md, "Error classification", rule 3)."""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import re
import time
from collections.abc import Mapping

# One part of a wait: "250ms", "6.5s", "60 seconds", "2 minutes", and OpenAI's compound "1m30s" / "1h2m".
_WAIT_UNIT = r"(ms|milliseconds?|seconds?|secs?|s|minutes?|mins?|m|hours?|h)(?![a-z])"
_WAIT_PART = re.compile(rf"(\d+(?:\.\d+)?)\s*{_WAIT_UNIT}", re.IGNORECASE)
_TRY_AGAIN_IN = re.compile(
    rf"(?:try again|retry) (?:in|after) ((?:\d+(?:\.\d+)?\s*{_WAIT_UNIT}\s*)+)", re.IGNORECASE
)
# Gemini / Vertex put the wait in a google.rpc.RetryInfo detail: "retryDelay": "26s" (in Python's
# quotes when a gateway printed the body).
_RETRY_DELAY = re.compile(r"[\"']retryDelay[\"']\s*:\s*[\"'](\d+(?:\.\d+)?)s[\"']")


def _unit_seconds(unit: str) -> float:
    unit = unit.lower()
    if unit == "ms" or unit.startswith("milli"):
        return 0.001
    return {"s": 1.0, "m": 60.0, "h": 3600.0}[unit[0]]


def _wait_seconds(text: str) -> float:
    """``1m30s`` → 90.0: the sum of the wait's parts."""
    return sum(float(number) * _unit_seconds(unit) for number, unit in _WAIT_PART.findall(text))


def parse_retry_after(
    headers: Mapping[str, str] | None,
    *,
    message: str | None = None,
    now: float | None = None,
) -> float | None:
    """Seconds to wait before retrying, from the headers or the provider's message, first found in the
    order docs/providers.md gives (rule 3); None when nothing says."""
    lowered = {k.lower(): v for k, v in (headers or {}).items()}
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        # LiteLLM's proxy passes the upstream's headers on under an ``llm_provider-`` prefix.
        raw = lowered.get(name, lowered.get(f"llm_provider-{name}"))
        if raw is None:
            continue
        with contextlib.suppress(ValueError):
            return max(0.0, float(raw) / divisor)
        if name == "retry-after":  # not seconds: an HTTP date, or nothing we can read
            with contextlib.suppress(TypeError, ValueError, IndexError):
                when = email.utils.parsedate_to_datetime(raw.strip())
                if when.tzinfo is None:  # "-0000": an HTTP date is GMT all the same (RFC 9110)
                    when = when.replace(tzinfo=datetime.UTC)
                return max(0.0, when.timestamp() - (time.time() if now is None else now))
    message = message or ""
    if match := _TRY_AGAIN_IN.search(message):
        return _wait_seconds(match.group(1))
    if match := _RETRY_DELAY.search(message):
        return float(match.group(1))
    return _reset_header_wait(lowered, message)


def _reset_header_wait(headers: Mapping[str, str], message: str) -> float | None:
    """OpenAI's ``x-ratelimit-reset-requests`` / ``-tokens`` ("1s", "6m0s", "20ms"): when the limit
    reset — the one the message names ("… for requests", "… tokens per min"), else the later."""
    waits: dict[str, float] = {}
    for kind in ("requests", "tokens"):
        raw = headers.get(f"x-ratelimit-reset-{kind}")
        if raw is not None and _WAIT_PART.search(raw):
            waits[kind] = _wait_seconds(raw)
    if not waits:
        return None
    lowered = message.lower()
    named = [k for k in waits if k in lowered or (k == "tokens" and "tpm" in lowered)]
    return waits[named[0]] if len(named) == 1 else max(waits.values())
