"""Model providers: one small streaming interface (:mod:`service.providers.base`), one adapter per
provider, error classification and the calling policy shared by summaries and answers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.providers.base import Provider

if TYPE_CHECKING:
    from service.config import Settings

# The model used when SIDEQUEST_MODEL is unset (docs/providers.md).
DEFAULT_MODELS: dict[str, str] = {
    "offline": "offline",
    "openai": "gpt-4o-mini",
    "anthropic": "claude-sonnet-4-5",
}


def build_provider(settings: Settings) -> Provider:
    """The provider ``settings`` ask for, endpoint, key and default model resolved; the Anthropic SDK is
    imported only here, when chosen. ``ValueError``: it cannot be built (``sidequest`` checks first)."""
    model = settings.model or DEFAULT_MODELS[settings.provider]
    if settings.provider == "offline":
        from service.providers.offline import OfflineProvider

        return OfflineProvider(default_model=model)
    base_url = settings.resolved_base_url()
    api_key = settings.resolved_api_key()
    if settings.provider == "openai":
        from service.providers.openai_compat import OpenAIProvider

        return OpenAIProvider(base_url=base_url, api_key=api_key, default_model=model)
    # Settings.provider is a Literal pydantic has checked: nothing but anthropic is left.
    from service.providers.anthropic_provider import AnthropicProvider

    return AnthropicProvider(base_url=base_url, api_key=api_key, default_model=model)
