"""Adapter for Anthropic's Messages API on the official ``anthropic`` SDK, imported when the provider
is built. Canonical messages already are Anthropic's shape. Each :class:`UsageReport` carries the usage
so far, so a call that fails or is cancelled midway still knows its input tokens.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any

import httpx2

try:
    import anthropic
except ImportError as exc:  # pragma: no cover - a broken install: the SDK is a dependency
    raise ValueError(
        "SIDEQUEST_PROVIDER=anthropic needs the anthropic SDK, a dependency of Sidequest: "
        "reinstall Sidequest (pip install 'sidequest[anthropic]')"
    ) from exc

from service.budget.estimate import without_posted_form
from service.providers import DEFAULT_MODELS
from service.providers.base import (
    CallUsage,
    ProviderCall,
    ProviderError,
    ProviderEvent,
    ProviderTimeout,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    UsageReport,
    finished,
    reported_count,
    sdk_api_key,
)
from service.providers.errors import STALLED, classify_error, sdk_error, stream_broke

# The counts of Anthropic's usage; its input_tokens excludes the cache reads and writes, ours includes both.
_INPUT_COUNTS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
_COUNTS = (*_INPUT_COUNTS, "output_tokens")
# Anthropic's stop reasons as SPEC §3 names them (docs/providers.md, "Stop reasons").
_STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    # The reply ran into the context window: it is cut short exactly like a max_tokens stop.
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


class AnthropicProvider:
    """Streams the Messages API through ``anthropic.AsyncAnthropic`` (SDK retries off)."""

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        default_model: str = DEFAULT_MODELS["anthropic"],
    ) -> None:
        self.default_model = default_model
        api_key = sdk_api_key(api_key, base_url)
        self._client = anthropic.AsyncAnthropic(api_key=api_key, base_url=base_url, max_retries=0)

    async def aclose(self) -> None:
        await self._client.close()

    def build_request(self, call: ProviderCall) -> dict[str, Any]:
        """The Messages API body for ``call`` (without headers and timeout)."""
        body: dict[str, Any] = {
            "model": call.model or self.default_model,
            "max_tokens": call.max_output_tokens,
            # What Sidequest keeps beside a converted OpenAI message is not Anthropic's to see.
            "messages": [without_posted_form(message) for message in call.messages],
            "stream": True,
        }
        if call.system_blocks:  # as the main session sent them, cache_control breakpoints included
            body["system"] = [dict(block) for block in call.system_blocks]
        elif call.system:
            body["system"] = call.system
        if call.tools:
            body["tools"] = [to_anthropic_tool(tool) for tool in call.tools]
            body["tool_choice"] = {"type": "none"}
        return body

    async def stream(self, call: ProviderCall) -> AsyncGenerator[ProviderEvent, None]:
        try:
            response = await self._client.messages.create(
                **self.build_request(call), extra_headers=call.headers(), timeout=call.timeout_s
            )
        except anthropic.APIStatusError as exc:
            raise _classify_status_error(exc, None) from exc
        except anthropic.APITimeoutError as exc:
            raise ProviderTimeout(f"no response within {call.timeout_s:.1f}s") from exc
        except anthropic.APIConnectionError as exc:
            raise ProviderError(f"could not reach the provider: {exc}") from exc
        except anthropic.APIError as exc:
            raise sdk_error(exc) from exc

        counts = dict.fromkeys(_COUNTS, 0)
        usage: CallUsage | None = None
        stop_raw: str | None = None
        try:
            async for event in response:
                kind = getattr(event, "type", None)
                if kind in ("content_block_start", "content_block_delta"):
                    # A block's start and its deltas carry text the same way ("text" / "text_delta").
                    where = "content_block" if kind == "content_block_start" else "delta"
                    part: Any = getattr(event, where, None)
                    part_type = str(getattr(part, "type", "")).removesuffix("_delta")
                    if part_type in ("tool_use", "server_tool_use"):
                        yield ToolCall(name=str(getattr(part, "name", "")), id=getattr(part, "id", None))
                    elif part_type == "text" and getattr(part, "text", None):
                        yield TextDelta(str(part.text))
                    elif part_type == "thinking" and getattr(part, "thinking", None):
                        yield ReasoningDelta(str(part.thinking))
                elif kind in ("message_start", "message_delta"):
                    owner = getattr(event, "message", None) if kind == "message_start" else event
                    reported = getattr(owner, "usage", None)
                    stop_raw = getattr(getattr(event, "delta", None), "stop_reason", None) or stop_raw
                    if reported is not None:
                        # message_start brings the input, message_delta the output (newer API versions
                        # repeat the final input counts there): a count left out keeps its last value.
                        for key in _COUNTS:
                            counts[key] = reported_count(getattr(reported, key, None)) or counts[key]
                        usage = CallUsage(
                            input_tokens=sum(counts[key] for key in _INPUT_COUNTS),
                            output_tokens=counts["output_tokens"],
                            cached_tokens=counts["cache_read_input_tokens"],
                            reported=True,
                        )
                        yield UsageReport(usage)
        except anthropic.APIStatusError as exc:
            # An `event: error` inside the 200 stream arrives as a status error carrying status 200.
            raise _classify_status_error(exc, usage) from exc
        except anthropic.APITimeoutError as exc:
            raise ProviderTimeout(STALLED, usage=usage) from exc
        except anthropic.APIConnectionError as exc:
            raise ProviderError(f"the stream broke: {exc}", usage=usage) from exc
        except anthropic.APIError as exc:
            raise sdk_error(exc, usage) from exc
        except (httpx2.HTTPError, ValueError) as exc:
            raise stream_broke(exc, usage) from exc
        finally:
            await response.close()

        yield finished(stop_raw, _STOP_REASONS, usage)


def to_anthropic_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool schema in Anthropic's shape (OpenAI function tools are converted)."""
    if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
        function = tool["function"]
        converted: dict[str, Any] = {
            "name": function.get("name", ""),
            "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
        }
        if function.get("description"):
            converted["description"] = function["description"]
        return converted
    converted = without_posted_form(tool)
    # A server or versioned tool ({"type": "web_search_20250305", "name": …}) goes as the main session
    # sent it: Anthropic defines its schema itself and refuses an input_schema on it.
    if tool.get("type") in (None, "custom"):
        converted.setdefault("input_schema", {"type": "object", "properties": {}})
    return converted


def _classify_status_error(exc: anthropic.APIStatusError, usage: CallUsage | None) -> ProviderError:
    if exc.status_code < 400:
        return classify_error(None, exc.body, usage=usage)
    return classify_error(exc.status_code, exc.body, dict(exc.response.headers), usage=usage)
