"""Read a provider's error body, in whatever form it arrives (parsed JSON, its text, JSON inside a string,
JSON that does not parse, plain text), into the parts classification looks at, by one path for every
form: docs/providers.md ("Error classification": "And whatever form the body arrives in").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

# A body is unwrapped (JSON inside a JSON string inside …) at most this often: real gateways nest once
# or twice, and a bound keeps a hostile body from recursing without end.
_MAX_NESTING = 4
_NOT_JSON = object()
# ``\'`` is no JSON escape, yet bodies built by Python string code carry it (SGLang): undone only after
# an even run of backslashes, so an escaped backslash before a quote keeps its meaning.
_BACKSLASH_QUOTE = re.compile(r"(?<!\\)((?:\\\\)*)\\'")
_JSON_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|[\"'\\/bfnrt])")
_ESCAPED = {'"': '"', "'": "'", "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# Where a body that does not parse opens its error object: its fields are read from there, so an outer
# ``"type": "error"`` (Anthropic) does not stand for the error's own type.
_ERROR_OBJECT = re.compile(r"[\"']error[\"']\s*:\s*\{")
# One ``"key": value`` of a body that does not parse, in JSON's quotes or Python's (a gateway that
# printed the upstream dict); a string cut short runs to the end of the text.
_FIELD = re.compile(
    r"[\"'](?P<key>[A-Za-z_][\w-]*)[\"']\s*:\s*"
    r"(?:\"(?P<dq>(?:[^\"\\]|\\.)*)\"?|'(?P<sq>(?:[^'\\]|\\.)*)'?|(?P<num>-?\d+)\b"
    r"|(?:true|false|null|True|False|None)\b)"
)


@dataclass(frozen=True)
class ErrorInfo:
    """The parts of an error body that classification looks at."""

    message: str
    type: str | None = None
    code: str | None = None
    param: str | None = None
    status_hint: int | None = None  # an HTTP-like status some servers put in error.code (vLLM, llama.cpp)
    text: str = ""  # everything searchable, for phrase matching
    fields: Mapping[str, Any] | None = None  # the inner error object's own fields (llama.cpp's n_ctx)

    @property
    def searchable(self) -> str:
        """The message and the whole body: where phrasings are looked for."""
        return self.message + "\n" + self.text


def parse_body(body: Any, depth: int = 0) -> ErrorInfo:
    """Pull message / type / code / param out of the many error envelopes in the wild."""
    if isinstance(body, str):
        stripped = body.strip()
        if not stripped:
            return ErrorInfo("")
        parsed = _loads(stripped)
        if parsed is _NOT_JSON or depth >= _MAX_NESTING:
            return _from_text(stripped, depth)
        return parse_body(parsed, depth + 1)
    if isinstance(body, list) and len(body) == 1:
        body = body[0]  # Gemini's streaming endpoint wraps the error in a one-element array
    if not isinstance(body, Mapping):
        text = "" if body is None else str(body)
        return ErrorInfo(text, text=text)
    info = _from_mapping(body, json.dumps(body, ensure_ascii=False, default=str))
    # A gateway that re-encodes the upstream body puts it, as JSON text, where its message goes.
    if depth < _MAX_NESTING and info.message.lstrip().startswith(("{", "[")):
        nested = parse_body(info.message, depth + 1)
        # The upstream error a gateway wrapped, with the gateway's own fields where it says nothing.
        merged = {f.name: getattr(nested, f.name) or getattr(info, f.name) for f in fields(ErrorInfo)}
        return replace(ErrorInfo(**merged), text=nested.text + "\n" + info.text)
    return info


def _from_mapping(body: Mapping[str, Any], whole: str) -> ErrorInfo:
    """The error in a JSON object (or in the fields read from a body that does not parse)."""
    inner: Any = body.get("error", body)
    fields = inner if isinstance(inner, Mapping) else None
    if isinstance(inner, str):
        # TGI ({"error": "...", "error_type": "validation"}), LM Studio and Ollama's native API.
        inner = {
            "message": inner,
            "type": body.get("error_type") or body.get("type"),
            "code": body.get("code"),
        }
    elif fields is None:
        inner = {"message": str(inner)}
    message = _text_or_none(inner.get("message") or inner.get("detail") or inner.get("msg")) or ""
    etype = _text_or_none(inner.get("type"))
    code_value = inner.get("code")
    # Gemini / Vertex: {"error": {"code": 429, "message": …, "status": "RESOURCE_EXHAUSTED"}}.
    if etype is None and isinstance(inner.get("status"), str):
        etype = str(inner["status"])

    valid = isinstance(code_value, int | str) and not isinstance(code_value, bool) and code_value != ""
    code = str(code_value) if valid else None
    status_hint = int(code) if code is not None and code.isdigit() and 400 <= int(code) <= 599 else None
    return ErrorInfo(message, etype, code, _text_or_none(inner.get("param")), status_hint, whole, fields)


def _from_text(text: str, depth: int) -> ErrorInfo:
    """A body that is not JSON: plain words, a dict as Python prints it, or broken JSON."""
    if text.startswith(('"{', '"[')) and depth < _MAX_NESTING:
        # A JSON string that does not parse (cut short, or ``\'`` inside): its content, unescaped.
        return parse_body(_unescape(text[1:].removesuffix('"')), depth + 1)
    found: dict[str, Any] = {}
    start = _ERROR_OBJECT.search(text)
    for match in _FIELD.finditer(text, start.end() if start else 0):
        found.setdefault(match.group("key"), _field_value(match))
    unescaped = _unescape(text)
    if any(isinstance(found.get(key), str) for key in ("message", "detail", "msg", "error")):
        info = _from_mapping(found, unescaped)
        # Broken JSON: its message is the error's words. Prose around a printed dict ("litellm.
        # NotFoundError: … {'error': …}") is the server's words too, and stays the message.
        message = info.message if text.startswith(("{", "[")) else unescaped
        return replace(info, message=message, text=unescaped)
    return ErrorInfo(unescaped, text=unescaped)


def _loads(text: str) -> Any:
    """``text`` as JSON, else as JSON once its ``\\'`` escapes are undone, else :data:`_NOT_JSON`."""
    for candidate in dict.fromkeys((text, _BACKSLASH_QUOTE.sub(r"\1'", text))):
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    return _NOT_JSON


def _field_value(match: re.Match[str]) -> Any:
    for group in ("dq", "sq"):
        if match.group(group) is not None:
            return _unescape(match.group(group))
    if match.group("num") is not None:
        return int(match.group("num"))
    return None  # true / false / null: nothing classification reads


def _unescape(text: str) -> str:
    """JSON's backslash escapes (and ``\\'``) undone; a lone surrogate becomes U+FFFD, so the message
    stays storable text."""
    if "\\" not in text:
        return text
    unescaped = _JSON_ESCAPE.sub(
        lambda m: chr(int(m.group(1)[1:], 16)) if m.group(1)[0] == "u" else _ESCAPED[m.group(1)], text
    )
    return unescaped.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
