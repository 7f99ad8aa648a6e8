"""The table of real provider error bodies in docs/providers.md, generated from the fixtures.

``python -m tests.providers.error_table`` prints it; ``--write`` replaces the table between the markers in
``docs/providers.md``. ``test_error_classification.py`` checks that the doc and the fixtures agree, so a
new fixture (or a changed classification) shows up in the doc or fails the suite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from service.providers.base import ContextOverflow, ProviderError, RateLimited
from service.providers.errors import classify_error

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "provider_errors"
DOC = ROOT / "docs" / "providers.md"
START = "<!-- provider-errors-table:start (generated: python -m tests.providers.error_table --write) -->"
END = "<!-- provider-errors-table:end -->"

# Every server SPEC §7 names, as the fixtures spell them, in SPEC's order (Vertex AI has only
# rate-limit fixtures, so it is ordered but not among the servers needing an overflow fixture).
SPEC_SERVERS = (
    "OpenAI",
    "Anthropic",
    "vLLM",
    "SGLang",
    "llama.cpp server",
    "Ollama",
    "LM Studio",
    "Hugging Face TGI",
    "LiteLLM proxy",
    "OpenRouter",
    "Together AI",
    "Groq",
    "Fireworks AI",
    "DeepSeek",
    "Mistral",
    "Azure OpenAI",
    "Amazon Bedrock",
    "Gemini",
)
# The table's order: SPEC §7's servers, then anything else alphabetically.
SERVER_ORDER = (*SPEC_SERVERS, "Vertex AI")
_MESSAGE_CHARS = 110


def load(path: Path) -> dict[str, Any]:
    """One fixture file."""
    fixture: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return fixture


def classify(fixture: dict[str, Any], *, now: float | None = None) -> ProviderError:
    """Classify a fixture's body the way the adapters would."""
    if fixture["in_stream"]:
        return classify_error(None, fixture["body"])
    return classify_error(fixture["status"], fixture["body"], fixture["headers"], now=now)


def server_of(fixture: dict[str, Any]) -> str:
    """The server a fixture belongs to: its provider name without the parenthesised detail."""
    return str(fixture["provider"]).split(" (")[0]


def _sort_key(item: tuple[Path, dict[str, Any]]) -> tuple[int, str, str]:
    path, fixture = item
    server = server_of(fixture)
    rank = SERVER_ORDER.index(server) if server in SERVER_ORDER else len(SERVER_ORDER)
    return rank, server, path.stem


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("`", "'")


def _shape(body: Any) -> str:
    inner = body[0] if isinstance(body, list) and body else body
    if isinstance(inner, str):
        return "HTML / text" if inner.lstrip().startswith("<") else "text"
    if not isinstance(inner, dict):
        return "text"
    error = inner.get("error", inner)
    if isinstance(error, str):
        return "string `error`"
    if not isinstance(error, dict):
        return "object"
    parts = []
    kind = error.get("type") or error.get("status")
    if kind:
        parts.append(f"`{_cell(str(kind))}`")
    if error.get("code") not in (None, ""):
        parts.append(f"code `{_cell(str(error['code']))}`")
    if not parts and "detail" in inner:
        parts.append("`detail`")
    return " ".join(parts) or "object"


def _phrasing(fixture: dict[str, Any], error: ProviderError) -> str:
    message = _cell(error.message)
    if message.lstrip().startswith("<"):
        message = "HTML error page"
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS].rstrip() + "…"
    return f"{_shape(fixture['body'])}: “{message}”"


def _class(error: ProviderError) -> str:
    name = type(error).__name__
    if isinstance(error, ContextOverflow):
        return f"**{name}**"
    if isinstance(error, RateLimited):
        if error.quota_exhausted:
            return f"{name} (quota, not retried)"
        if error.retry_after_s is not None:
            return f"{name} (wait {error.retry_after_s:g} s)"
    return name


def _counts(error: ProviderError) -> str:
    if not isinstance(error, ContextOverflow):
        return ""
    parts = []
    if error.prompt_tokens is not None:
        parts.append(f"prompt {error.prompt_tokens}")
    if error.context_limit is not None:
        parts.append(f"window {error.context_limit}")
    return ", ".join(parts) or "—"


def _now(fixture: dict[str, Any]) -> float | None:
    import datetime

    stamp = fixture.get("classified_at")
    if not stamp:
        return None
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def render_table() -> str:
    """The Markdown table: one row per fixture, in SPEC §7's server order."""
    rows = [
        "| Server | HTTP | Shape and phrasing | Classified as | Parsed counts "
        "| Fixture (links to its source) |",
        "|---|---|---|---|---|---|",
    ]
    items = sorted(((p, load(p)) for p in FIXTURES.glob("*.json")), key=_sort_key)
    for path, fixture in items:
        error = classify(fixture, now=_now(fixture))
        status = "200, then in stream" if fixture["in_stream"] else str(fixture["status"])
        rows.append(
            f"| {_cell(fixture['provider'])} | {status} | {_phrasing(fixture, error)} | {_class(error)} "
            f"| {_counts(error)} | [`{path.stem}`]({fixture['source']}) |"
        )
    return "\n".join(rows)


def documented_table(doc: str) -> str:
    """The table currently between the markers in ``doc``."""
    start = doc.index(START) + len(START)
    end = doc.index(END)
    return doc[start:end].strip()


def write_table() -> None:
    """Replace the table between the markers in docs/providers.md."""
    doc = DOC.read_text(encoding="utf-8")
    start = doc.index(START) + len(START)
    end = doc.index(END)
    DOC.write_text(doc[:start] + "\n" + render_table() + "\n" + doc[end:], encoding="utf-8")


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write_table()
    else:
        print(render_table())
