"""Which model answers and which summarises (SPEC §11.2). Pure: plain values in, a name out.

- answers: the request's ``model`` → the session's ``answer_model`` → ``SIDEQUEST_MODEL`` → the
  provider's default;
- summaries: the session's ``summary_model`` → ``SIDEQUEST_SUMMARY_MODEL`` → the request's answer model
  (for a request's own summaries) → ``SIDEQUEST_MODEL`` → the provider's default (a background job has
  no request, so it goes straight from ``SIDEQUEST_SUMMARY_MODEL`` to ``SIDEQUEST_MODEL``).

Empty strings count as not given, like a missing value.
"""

from __future__ import annotations


def _first(*names: str | None) -> str | None:
    for name in names:
        if name:
            return name
    return None


def answer_model(
    request_model: str | None, session_model: str | None, config_model: str | None, provider_default: str
) -> str:
    """The model of a request's answer call."""
    return _first(request_model, session_model, config_model) or provider_default


def summary_model(
    session_model: str | None,
    config_summary_model: str | None,
    request_answer_model: str | None,
    config_model: str | None,
    provider_default: str,
) -> str:
    """The model of a summary call; ``request_answer_model`` is None for a background job."""
    return _first(session_model, config_summary_model, request_answer_model, config_model) or provider_default


__all__ = ["answer_model", "summary_model"]
