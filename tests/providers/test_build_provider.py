"""build_provider picks the adapter, endpoint, key and default model from the settings."""

from __future__ import annotations

import pytest

from service.config import Settings
from service.providers import DEFAULT_MODELS, build_provider
from service.providers.anthropic_provider import AnthropicProvider
from service.providers.base import sdk_api_key
from service.providers.offline import OfflineProvider
from service.providers.openai_compat import OpenAIProvider
from tests.providers.helpers import collect, make_call
from tests.scripted_provider import ScriptedServer, Step


def test_offline_is_the_default_and_needs_nothing() -> None:
    provider = build_provider(Settings())
    assert isinstance(provider, OfflineProvider)
    assert provider.default_model == "offline"


@pytest.mark.parametrize(
    ("name", "cls", "model"),
    [("openai", OpenAIProvider, "gpt-4o-mini"), ("anthropic", AnthropicProvider, "claude-sonnet-4-5")],
)
async def test_default_models_per_provider(name: str, cls: type, model: str) -> None:
    provider = build_provider(Settings(provider=name, api_key="k", base_url="http://127.0.0.1:9/v1"))  # type: ignore[arg-type]
    assert isinstance(provider, cls)
    assert provider.default_model == model == DEFAULT_MODELS[name]
    await provider.aclose()


async def test_configured_model_and_endpoint_are_used(server: ScriptedServer) -> None:
    server.script("answer", Step.text("configured"))
    provider = build_provider(Settings(provider="openai", base_url=server.base_url, model="my-model"))
    try:
        # No API key is needed for a local endpoint; the call's model falls back to the configured one.
        got = await collect(provider, make_call(model=""))
    finally:
        await provider.aclose()
    assert got.text == "configured"
    assert server.requests()[0].body["model"] == "my-model"


async def test_openai_key_and_base_url_are_read_from_openai_variables(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    provider = build_provider(Settings(provider="openai"))
    try:
        await collect(provider, make_call())
    finally:
        await provider.aclose()
    assert server.requests()[0].headers["authorization"] == "Bearer from-env"


@pytest.mark.parametrize("adapter", ["openai", "anthropic"])
async def test_a_local_server_without_a_key_gets_the_placeholder_and_a_real_key_wins(
    adapter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server of one's own needs no key, but the SDKs refuse to start without one."""
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert sdk_api_key(None, "http://127.0.0.1:9/v1") == "sidequest-no-api-key"
    assert sdk_api_key("real", "http://127.0.0.1:9/v1") == "real"
    assert sdk_api_key(None, None) is None  # the SDK's own environment variable then decides
    with ScriptedServer() as server:
        provider: OpenAIProvider | AnthropicProvider = (
            OpenAIProvider(server.base_url, None, "scripted-model")
            if adapter == "openai"
            else AnthropicProvider(server.root_url, None, "claude-scripted")
        )
        try:
            await collect(provider, make_call())
        finally:
            await provider.aclose()
        (request,) = server.requests()
        sent = request.headers.get("authorization") or request.headers.get("x-api-key", "")
        assert sent.removeprefix("Bearer ") == "sidequest-no-api-key"
