"""SPEC §11.2 model choice (``prepare.choose_models``, its one home): plain values in, names out."""

from __future__ import annotations

from typing import Any

from service.config import Settings
from service.pipeline.prepare import choose_models


def _settings(**values: Any) -> Settings:
    return Settings(database_url="postgresql+asyncpg://x/y", **values)


def test_answer_model_is_request_then_session_then_service_then_provider_default() -> None:
    svc = _settings(model="svc")
    assert choose_models(svc, {"answer_model": "sess"}, "req", "dflt").answer == "req"
    assert choose_models(svc, {"answer_model": "sess"}, None, "dflt").answer == "sess"
    assert choose_models(svc, {"answer_model": ""}, "", "dflt").answer == "svc"  # empty counts as unset
    assert choose_models(_settings(), {}, None, "dflt").answer == "dflt"


def test_summary_model_is_session_then_summary_setting_then_answer_model() -> None:
    both = _settings(model="svc", summary_model="svc-sum")
    assert choose_models(both, {"summary_model": "sess"}, "req", "dflt").summary == "sess"
    assert choose_models(both, {}, "req", "dflt").summary == "svc-sum"
    assert choose_models(_settings(model="svc"), {"answer_model": "sess-ans"}, "req", "dflt").summary == "req"
    assert choose_models(_settings(model="svc"), {}, None, "dflt").summary == "svc"
    assert choose_models(_settings(), {}, None, "dflt").summary == "dflt"


def test_a_background_job_summarises_as_a_request_without_a_model_of_its_own_would() -> None:
    """docs/summaries.md: the summary model is part of the cache key, so a job (no request model, the
    same call as a question without a model of its own) takes the session's answer model before
    SIDEQUEST_MODEL — what the next question looks up."""
    job = choose_models(_settings(model="svc"), {"answer_model": "sess-ans"}, None, "dflt")
    assert job.summary == "sess-ans"
