"""Token estimates without a tokenizer (SPEC §5), and the calibration that scales them (§5.1).

Every estimate is ``ceil(utf8_bytes / 3)``, rounded up everywhere: under-estimating costs a failed
provider call, over-estimating a little window. Why bytes / 3 and not the JSON's length: docs/budget.md.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

# Why each number is what it is: docs/budget.md "The numbers".
BYTES_PER_TOKEN: Final = 3  # bytes / 4 × 4/3
MESSAGE_ENVELOPE_TOKENS: Final = 4  # role and turn markers of one message, rounded up
CALIBRATION_MIN_SAMPLES: Final = 5
CALIBRATION_MIN_RATIO: Final = Fraction(1, 2)
CALIBRATION_MAX_RATIO: Final = Fraction(2)


def tokens_of_bytes(byte_count: int) -> int:
    """Tokens for ``byte_count`` UTF-8 bytes, rounded up (the estimate of text that long)."""
    return -(-byte_count // BYTES_PER_TOKEN)


# Shared, configured once: json.dumps with non-default options builds an encoder per call, which
# dominates the cost of estimating thousands of small tool inputs.
_COMPACT_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)

# JSONEncoder.encode still builds a C encoder (and a cycle-marker dict) on every call, 3 of the 4 µs
# a small tool input costs. The same C encoder built once without cycle markers gives the identical
# text; a cycle then ends in RecursionError and is redone by _COMPACT_ENCODER, which decides as it
# always did. None where the C accelerator is missing: then every call takes _COMPACT_ENCODER.
_c_make_encoder: Callable[..., Callable[[object, int], Sequence[str]]] | None = getattr(
    json.encoder, "c_make_encoder", None
)
_FAST_COMPACT_ENCODER: Final = (
    None
    if _c_make_encoder is None
    else _c_make_encoder(None, str, json.encoder.encode_basestring, None, ":", ",", False, False, True)
)


def compact_json(value: object) -> str:
    """``value`` as compact JSON with non-ASCII kept as UTF-8 (what a provider would see). Never
    raises: an estimate must not crash the pipeline, so an unserialisable value gives its ``repr``."""
    if _FAST_COMPACT_ENCODER is not None:
        try:
            return "".join(_FAST_COMPACT_ENCODER(value, 0))
        except (TypeError, ValueError):
            return repr(value)
        except RecursionError:
            pass  # a cycle (no markers here) or a very deep value: the checked encoder decides
    try:
        return _COMPACT_ENCODER.encode(value)
    except (TypeError, ValueError):
        return repr(value)


def utf8_length(text: str) -> int:
    """``len(text.encode("utf-8"))`` without encoding ASCII text (``isascii`` is O(1) in CPython)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def estimate_text(text: str) -> int:
    """Estimated tokens of ``text``: ``ceil(utf8_bytes / 3)``; 0 for ``""``."""
    return -(-(len(text) if text.isascii() else len(text.encode("utf-8"))) // BYTES_PER_TOKEN)


def _text_bytes(value: object) -> int:
    """UTF-8 bytes of a string field, or of the compact JSON of anything else (None → 0)."""
    if value is None:
        return 0
    return utf8_length(value if isinstance(value, str) else compact_json(value))


def estimate_block(block: object) -> int:
    """By the block's type, as docs/budget.md "Estimator" lists; any other block from its compact JSON."""
    # isinstance(dict) first: the Mapping ABC check is several times slower and rarely needed.
    if isinstance(block, dict) or isinstance(block, Mapping):
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str):
                return -(-(len(text) if text.isascii() else len(text.encode("utf-8"))) // BYTES_PER_TOKEN)
        elif kind == "tool_use":
            fields = (block.get("id"), block.get("name"), block.get("input"))
            return tokens_of_bytes(sum(map(_text_bytes, fields)))
        elif kind == "tool_result":
            use_id = tokens_of_bytes(_text_bytes(block.get("tool_use_id")))
            return use_id + estimate_content(block.get("content"))
    elif isinstance(block, str):
        return estimate_text(block)
    return estimate_text(compact_json(block))


def estimate_content(content: object) -> int:
    """Estimated tokens of a message's ``content``: a string, a list of blocks, or None (0)."""
    if isinstance(content, str):
        # Inlined estimate_text: this is the most frequent call of a whole plan.
        return -(-(len(content) if content.isascii() else len(content.encode("utf-8"))) // BYTES_PER_TOKEN)
    if content is None:
        return 0
    if isinstance(content, (list, tuple)):
        return sum(map(estimate_block, content))
    return estimate_block(content)


def estimate_message_content(message: Mapping[str, Any]) -> int:
    """Estimated tokens of a message without its envelope; raw OpenAI ``tool_calls`` / ``tool_call_id``
    count too, so a caller that forgot to normalise errs high, never low."""
    tokens = estimate_content(message.get("content"))
    if "tool_calls" in message:
        tokens += estimate_text(compact_json(message["tool_calls"]))
    if "tool_call_id" in message:
        tokens += estimate_text(str(message["tool_call_id"]))
    return tokens


def estimate_message(message: Mapping[str, Any]) -> int:
    """Estimated tokens of one message: its content plus :data:`MESSAGE_ENVELOPE_TOKENS`."""
    content = message.get("content")
    if isinstance(content, str) and "tool_calls" not in message and "tool_call_id" not in message:
        # Plain text message (half of a transcript): estimate_message_content without the calls.
        return estimate_text(content) + MESSAGE_ENVELOPE_TOKENS
    return estimate_message_content(message) + MESSAGE_ENVELOPE_TOKENS


def estimate_messages(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(estimate_message(message) for message in messages)


def envelope_tokens(message_count: int) -> int:
    return max(0, message_count) * MESSAGE_ENVELOPE_TOKENS


def estimate_system(system: str | None) -> int:
    return estimate_text(system) if system else 0


# A message or tool converted from OpenAI style keeps what was posted under this key, so an OpenAI-compatible
# provider gets it back byte for byte for its prefix cache (SPEC §7). On a message: ``{"messages": [posted…],
# "blocks": n}``, the posted message(s) standing for its first ``n`` content blocks (later blocks are rendered
# after them); on a tool, the posted tool. Estimates skip it; the Anthropic wire drops it.
POSTED_FORM: Final = "_sidequest_posted"


def estimate_tools(tools: Sequence[Mapping[str, Any]]) -> int:
    """Estimated tokens of the tool schemas: their compact JSON (0 when there are none)."""
    return estimate_text(compact_json([without_posted_form(tool) for tool in tools])) if tools else 0


def without_posted_form(item: Mapping[str, Any]) -> dict[str, Any]:
    """A message or tool schema without :data:`POSTED_FORM`: what the estimate counts."""
    return {k: v for k, v in item.items() if k != POSTED_FORM}


@dataclass(frozen=True)
class Calibration:
    """The ratio of provider prompt tokens to our estimates, from the store's counters (SPEC §5.1). It
    scales a whole total for a fit decision; segment estimates are never rewritten from it."""

    samples: int = 0
    estimate_sum: int = 0
    provider_sum: int = 0

    @classmethod
    def empty(cls) -> Calibration:
        return cls()

    def _ratio(self) -> Fraction:
        if self.samples < CALIBRATION_MIN_SAMPLES or self.estimate_sum <= 0:
            return Fraction(1)
        raw = Fraction(self.provider_sum, self.estimate_sum)
        return min(CALIBRATION_MAX_RATIO, max(CALIBRATION_MIN_RATIO, raw))

    @property
    def ratio(self) -> float:
        """Σ provider / Σ estimate clamped to [0.5, 2.0]; 1.0 below 5 samples."""
        return float(self._ratio())

    def apply(self, total: int) -> int:
        """``total`` scaled by the ratio, rounded up (exact integer arithmetic): what the provider is
        expected to count. Only a fit decision uses it; segments and ``estimate.*`` stay raw."""
        ratio = self._ratio()
        return -(-(total * ratio.numerator) // ratio.denominator)

    def fits(self, total: int, input_budget: int) -> bool:
        """THE fit decision (SPEC §5, §5.1, §6.2): does the raw ``total``, scaled, fit the input budget?"""
        return self.apply(total) <= input_budget

    def raw_capacity(self, capacity: int) -> int:
        """The largest raw estimate whose calibrated total fits ``capacity`` (the inverse of
        :meth:`apply`, rounded down); a non-positive capacity is returned as is."""
        if capacity <= 0:
            return capacity
        ratio = self._ratio()
        return capacity * ratio.denominator // ratio.numerator

    def info(self) -> dict[str, Any]:
        """``context_info.calibration``. ``applied``: whether the ratio changes anything (one not in use is
        exactly 1); ``ratio`` unrounded: rounded to 1.0, it would contradict ``applied: true``."""
        return {"ratio": self.ratio, "samples": self.samples, "applied": self._ratio() != 1}


def overflow_target(input_budget: int, estimate: int, prompt_tokens: int) -> int:
    """The raw estimate a request must shrink to after an overflow that stated its real count, so that at
    the provider's own rate it fits the budget (docs/budget.md "Estimator"); without a count, the budget."""
    if prompt_tokens <= 0 or estimate <= 0:
        return max(0, input_budget)
    return max(0, input_budget * estimate // prompt_tokens)
