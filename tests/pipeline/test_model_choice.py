"""SPEC §11.2 model choice as a pure function."""

from __future__ import annotations

from service.pipeline.choices import answer_model, summary_model


def test_answer_model_is_request_then_session_then_service_then_provider_default() -> None:
    assert answer_model("req", "sess", "svc", "dflt") == "req"
    assert answer_model(None, "sess", "svc", "dflt") == "sess"
    assert answer_model("", None, "svc", "dflt") == "svc"
    assert answer_model(None, None, None, "dflt") == "dflt"


def test_summary_model_is_session_then_summary_setting_then_answer_model_then_service() -> None:
    assert summary_model("sess", "svc-sum", "answer", "svc", "dflt") == "sess"
    assert summary_model(None, "svc-sum", "answer", "svc", "dflt") == "svc-sum"
    assert summary_model(None, None, "answer", "svc", "dflt") == "answer"
    # A background job has no request: straight to SIDEQUEST_MODEL, then the provider's default.
    assert summary_model(None, None, None, "svc", "dflt") == "svc"
    assert summary_model(None, None, None, None, "dflt") == "dflt"
