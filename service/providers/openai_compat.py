"""Adapter for any OpenAI-compatible Chat Completions endpoint (OpenAI, vLLM, Ollama, llama.cpp,
LM Studio, DeepSeek, Groq, OpenRouter, …) on the official ``openai`` SDK, its own retries off. Always
streams, with ``stream_options.include_usage`` so the final chunk carries the usage.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import httpx2
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from service.budget.estimate import POSTED_FORM
from service.budget.messages import tool_result_text
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

# OpenAI's finish reasons are SPEC §3's own stop reasons; only the legacy function_call is renamed.
_FINISH_REASONS = {"function_call": "tool_calls"}


class OpenAIProvider:
    """Streams Chat Completions through ``openai.AsyncOpenAI``."""

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        default_model: str = DEFAULT_MODELS["openai"],
    ) -> None:
        self.default_model = default_model
        api_key = sdk_api_key(api_key, base_url)
        try:
            self._client = openai.AsyncOpenAI(api_key=api_key, base_url=base_url, max_retries=0)
        except openai.OpenAIError as exc:
            raise ValueError(
                "the openai provider needs an API key: set SIDEQUEST_API_KEY or OPENAI_API_KEY "
                f"(or SIDEQUEST_BASE_URL for a local server) ({exc})"
            ) from exc
        # OpenAI's own API wants max_completion_tokens (its reasoning models refuse max_tokens); several
        # compatible servers (Ollama, older vLLM and llama.cpp) only read max_tokens.
        is_openai = base_url is None or "api.openai.com" in base_url
        self._output_cap_param = "max_completion_tokens" if is_openai else "max_tokens"

    async def aclose(self) -> None:
        await self._client.close()

    def build_request(self, call: ProviderCall) -> dict[str, Any]:
        """The Chat Completions body for ``call`` (without headers and timeout)."""
        body: dict[str, Any] = {
            "model": call.model or self.default_model,
            "messages": to_openai_messages(call.messages, call.system),
            "stream": True,
            "stream_options": {"include_usage": True},
            self._output_cap_param: call.max_output_tokens,
        }
        if call.tools:
            # Tool schemas keep the transcript's tool history valid; the model may not call them.
            body["tools"] = [to_openai_tool(tool) for tool in call.tools]
            body["tool_choice"] = "none"
        return body

    async def stream(self, call: ProviderCall) -> AsyncGenerator[ProviderEvent, None]:
        headers = call.headers()
        try:
            # The client's documented ``post`` rather than ``chat.completions.create``: create() walks
            # every message against the SDK's TypedDicts (``async_maybe_transform``) to rename aliased
            # keys, which our plain JSON messages never have — two thirds of the service's own time
            # before a cached answer on a 200k-token snapshot (docs/benchmarks.md).
            response = await self._client.post(
                "/chat/completions",
                cast_to=ChatCompletion,
                body=self.build_request(call),
                options={"headers": headers, "timeout": call.timeout_s, "security": {"bearer_auth": True}},
                stream=True,
                stream_cls=openai.AsyncStream[ChatCompletionChunk],
            )
        except openai.APIStatusError as exc:
            raise _classify_status_error(exc) from exc
        except openai.APITimeoutError as exc:
            raise ProviderTimeout(f"no response within {call.timeout_s:.1f}s") from exc
        except openai.APIConnectionError as exc:
            raise ProviderError(f"could not reach the provider: {_cause(exc)}") from exc
        except openai.APIError as exc:
            raise sdk_error(exc) from exc

        usage: CallUsage | None = None
        finish_raw: str | None = None
        seen_tool_calls: set[int] = set()
        try:
            async for chunk in response:
                if chunk.usage is not None:
                    usage = usage_from_openai(chunk.usage)
                    yield UsageReport(usage)
                for choice in chunk.choices or []:
                    if choice.index not in (0, None):
                        continue  # we ask for one choice; ignore any others
                    finish_raw = choice.finish_reason or finish_raw
                    delta = choice.delta
                    if delta is None:
                        continue
                    for field in ("reasoning_content", "reasoning"):  # vLLM, DeepSeek / Ollama, OpenRouter
                        reasoning = getattr(delta, field, None)
                        if isinstance(reasoning, str) and reasoning:
                            yield ReasoningDelta(reasoning)
                            break
                    # A refusal is what the model answered (OpenAI streams it apart from content).
                    for text in (delta.content, getattr(delta, "refusal", None)):
                        if isinstance(text, str) and text:
                            yield TextDelta(text)
                    for tool_call in delta.tool_calls or []:
                        index = tool_call.index if tool_call.index is not None else len(seen_tool_calls)
                        if index in seen_tool_calls:
                            continue  # a later delta of a call already reported (its arguments)
                        seen_tool_calls.add(index)
                        name = tool_call.function.name if tool_call.function is not None else None
                        yield ToolCall(name=name or "", id=tool_call.id)
                    if delta.function_call is not None and delta.function_call.name:
                        yield ToolCall(name=delta.function_call.name)
        except openai.APITimeoutError as exc:
            raise ProviderTimeout(STALLED, usage=usage) from exc
        except openai.APIConnectionError as exc:
            raise ProviderError(f"the stream broke: {_cause(exc)}", usage=usage) from exc
        except openai.APIError as exc:
            # An SSE data chunk carrying an "error" object: the SDK raises it (a plain APIError, never a
            # status error once the 200 has arrived) with that object as body.
            raise sdk_error(exc, usage) from exc
        except (httpx2.HTTPError, ValueError) as exc:
            raise stream_broke(exc, usage) from exc
        finally:
            await response.close()

        yield finished(finish_raw, _FINISH_REASONS, usage)


def usage_from_openai(usage: Any) -> CallUsage:
    """Our usage from an OpenAI ``usage`` object (``prompt_tokens`` already includes cached tokens)."""
    cached = reported_count(getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None))
    if not cached:
        # DeepSeek reports its context cache hits at the top level instead.
        cached = reported_count((getattr(usage, "model_extra", None) or {}).get("prompt_cache_hit_tokens"))
    completion_details = getattr(usage, "completion_tokens_details", None)
    return CallUsage(
        input_tokens=reported_count(getattr(usage, "prompt_tokens", None)),
        output_tokens=reported_count(getattr(usage, "completion_tokens", None)),
        reasoning_tokens=reported_count(getattr(completion_details, "reasoning_tokens", None)),
        cached_tokens=cached,
        reported=True,
    )


def to_openai_messages(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """Canonical (Anthropic-style) messages → Chat Completions messages, system prompt first
    (docs/providers.md, "Message conversion"); messages already in OpenAI shape pass through."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        posted = message.get(POSTED_FORM)
        if posted:
            # Converted from the main session's own OpenAI messages: those, as posted; then any
            # blocks added after them (the final turn merged into a trailing tool-result message).
            out.extend(dict(m) for m in posted["messages"])
            rest = content[posted["blocks"] :] if isinstance(content, list) else []
            out.extend(_user_messages(role or "user", rest))
            continue
        if role in ("system", "tool", "developer") or "tool_calls" in message or isinstance(content, str):
            out.append(dict(message))
            continue
        blocks = content if isinstance(content, list) else []
        if role == "assistant":
            out.append(_assistant_message(blocks))
        else:
            out.extend(_user_messages(role or "user", blocks))
    return out


def to_openai_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A canonical tool schema (``name``, ``description``, ``input_schema``) as an OpenAI function;
    one converted from the main session's OpenAI tool is that tool as posted (``strict`` included)."""
    if POSTED_FORM in tool:
        return dict(tool[POSTED_FORM])
    if tool.get("type") == "function" and "function" in tool:
        return dict(tool)
    function: dict[str, Any] = {
        "name": tool.get("name", ""),
        "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
    }
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                    },
                }
            )
    if not tool_calls:
        return {"role": "assistant", "content": "\n".join(texts)}
    return {"role": "assistant", "content": "\n".join(texts) if texts else None, "tool_calls": tool_calls}


def _user_messages(role: str, blocks: list[Any]) -> list[dict[str, Any]]:
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "tool_result":
            tool_messages.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id", "")),
                    "content": _tool_result_text(block.get("content")),
                }
            )
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            source = block.get("source") or {}
            if source.get("type") == "base64":
                url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif source.get("type") == "url":
                parts.append({"type": "image_url", "image_url": {"url": source.get("url", "")}})
    if parts:
        texts_only = all(part["type"] == "text" for part in parts)
        content = "\n".join(part["text"] for part in parts) if texts_only else parts
        tool_messages.append({"role": role, "content": content})
    return tool_messages


def _tool_result_text(content: Any) -> str:
    return tool_result_text(
        content,
        other_block=lambda block: f"[{block.get('type', 'content')} omitted]",
        other_value=lambda value: json.dumps(value, ensure_ascii=False, default=str),
    )


def _classify_status_error(exc: openai.APIStatusError) -> ProviderError:
    """Classify from the full response body (the SDK's ``exc.body`` drops the ``error`` envelope)."""
    try:
        text = exc.response.text
    except Exception:  # the body may not be readable any more (closed stream)
        text = ""
    return classify_error(exc.status_code, text if text.strip() else exc.body, dict(exc.response.headers))


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return f"{exc} ({type(cause).__name__}: {cause})" if cause is not None else str(exc)
