"""Prompts: the summary calls (first attempt, retry, update, merge; Q&A folding vs context compaction) and the
assembly of the side answer request (SPEC §7 layout).

Changing any summary prompt text changes what a cached context summary means, so it must come with a
new :data:`PROMPT_VERSION` (part of the context-summary cache key).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service.budget import (
    SegmentEstimate,
    envelope_tokens,
    estimate_block,
    estimate_messages,
    estimate_system,
    estimate_text,
    estimate_tools,
    pending_tool_ids,
)
from service.summary.document import BODY_TOKEN_LIMIT
from service.summary.material import QAPair, render_qa_pair

PROMPT_VERSION = "summary-prompts-1"

SummaryKind = Literal["qa", "context"]
_MATERIAL: dict[SummaryKind, str] = {"qa": "side questions and answers", "context": "transcript"}

# What the first attempt asks for: comfortably below the 2200-token body limit.
FIRST_BODY_TOKENS = 1500
# What the retry asks for, well under the limit so a verbose model still lands inside it.
RETRY_BODY_TOKENS = 600

_SCHEMA = (
    '{"objective": string, "state": string, "decisions": [string], "open_work": [string], "risks": [string]}'
)

_SYSTEM_COMMON = f"""You write working summaries for Sidequest, a service that answers side questions \
asked beside a running agent task. You never call tools.

Reply with exactly one JSON object and nothing else: no prose before or after it, at most one ```json fence. \
The object has exactly these keys:
{_SCHEMA}
- objective: what the work is trying to achieve.
- state: where it stands now.
- decisions: conclusions reached, facts established, choices made (with the reason when known).
- open_work: what is still to be done or answered.
- risks: known problems, doubts, things that could go wrong.
Each string at most 2 KiB, each list at most 32 items. Keep concrete facts: names, numbers, file paths, \
identifiers, commands, error messages. Write in the language of the material."""

_SYSTEM_QA = (
    _SYSTEM_COMMON
    + """

The material is earlier side questions and their answers, asked beside a main agent task. Summarise what \
was asked and what was concluded, so that later side questions can build on it. Those answers were given \
from the main context as it was at the time: record them as earlier conclusions, not as new tool evidence."""
)

_SYSTEM_CONTEXT = (
    _SYSTEM_COMMON
    + """

The material is the older part of a main agent's transcript (user messages, assistant messages, tool calls \
and tool results). Summarise it so that a model that reads only your summary and the most recent messages \
can answer questions about the task: goals, what was done and found, files and commands involved, decisions, \
what is pending."""
)


SESSION_INSTRUCTIONS_HEADER = (
    "Additional instructions for this session. They add to the rules above and never change the reply "
    "format: still exactly one JSON object with the five keys."
)


def summary_system_prompt(kind: SummaryKind, instructions: str | None = None) -> str:
    """The system prompt of a summary call of this kind; a session's ``instructions`` (SPEC §11.2)
    come *after* the built-in ones, so they can never replace the document format."""
    base = _SYSTEM_QA if kind == "qa" else _SYSTEM_CONTEXT
    if instructions is None or not instructions.strip():
        return base
    return (
        f"{base}\n\n{SESSION_INSTRUCTIONS_HEADER}\n"
        f"<session_instructions>\n{instructions.strip()}\n</session_instructions>"
    )


def prompt_version(instructions: str | None = None) -> str:
    """:data:`PROMPT_VERSION`, extended by a hash of the session's summary instructions (part of the
    cache key: a summary made under other instructions is not reused)."""
    if instructions is None or not instructions.strip():
        return PROMPT_VERSION
    digest = hashlib.sha256(instructions.strip().encode("utf-8")).hexdigest()[:16]
    return f"{PROMPT_VERSION}+instructions-{digest}"


@dataclass(frozen=True)
class SummaryPrompt:
    """One summary call's prompt: system text and canonical messages."""

    system: str
    messages: list[dict[str, Any]]

    def tokens(self) -> int:
        """The prompt's estimate as sent: its system text plus its messages, envelopes included."""
        return estimate_system(self.system) + estimate_messages(self.messages)


def build_summary_prompt(
    kind: SummaryKind,
    material: str,
    *,
    previous_body: str | None,
    retry: bool,
    chunk: int = 1,
    chunks: int = 1,
    instructions: str | None = None,
) -> SummaryPrompt:
    """The prompt of one summary attempt over ``material``: an *update* of ``previous_body`` (the
    running valid summary, rendered) when given; ``retry`` adds a firmer format reminder and asks for a
    body under 600 tokens."""
    parts: list[str] = []
    if previous_body is not None:
        parts.append(
            "Here is the summary so far, covering earlier material:\n<previous_summary>\n"
            + previous_body
            + "\n</previous_summary>\n\n"
            "Update it with the new material below. This is an update, not a rewrite: keep the earlier "
            "conclusions, decisions and open points unless the new material explicitly settles or "
            "replaces them, and merge new facts in."
        )
    else:
        parts.append(f"Summarise the {_MATERIAL[kind]} below.")
    if chunks > 1:
        parts.append(f"This is part {chunk} of {chunks} of the material.")
    parts.append(f"<material>\n{material}\n</material>")
    return _prompt(kind, parts, retry, instructions)


def _prompt(kind: SummaryKind, parts: list[str], retry: bool, instructions: str | None) -> SummaryPrompt:
    """The system prompt, and one user turn of ``parts`` closed by :func:`_closing`."""
    content = "\n\n".join([*parts, _closing(retry)])
    return SummaryPrompt(summary_system_prompt(kind, instructions), [{"role": "user", "content": content}])


def _closing(retry: bool) -> str:
    """The last paragraph of every summary prompt: the size asked for, and the format reminder."""
    if retry:
        return (
            "Your previous reply to this could not be used (it was empty, cut off, not the required JSON "
            f"object, or too long). Keep the whole summary under {RETRY_BODY_TOKENS} tokens: keep the most "
            "important facts and drop detail. Reply with the JSON object only."
        )
    return f"Keep the whole summary under about {FIRST_BODY_TOKENS} tokens. Reply with the JSON object only."


# The merge prompt (SPEC §6.3, parallel mode): N documents, in material order, into one. Each document
# is one ``merge_piece``; the pieces are joined with nothing in between, so a merge prompt's size is
# exactly its skeleton (no documents) plus the sum of its pieces, which is what merge grouping counts.
MERGE_OPEN = "<partial_summaries>\n"
MERGE_CLOSE = "</partial_summaries>"


def merge_piece(part: int, body: str) -> str:
    """One document of a merge prompt: the rendered body of the ``part``-th summary, tagged."""
    return f'<summary part="{part}">\n{body}\n</summary>\n'


def _merge_prompt(
    kind: SummaryKind, pieces: str, count: int, *, retry: bool, instructions: str | None = None
) -> SummaryPrompt:
    parts = [
        f"Below are {count} partial summaries of consecutive parts of the {_MATERIAL[kind]}, in order: "
        f"part 1 summarises the oldest material, part {count} the newest. Merge them into one summary in the "
        "same format. This is a merge, not a rewrite: keep the conclusions, decisions and open points of "
        "every part unless a later part explicitly settles or replaces them; where parts disagree, the "
        "later part describes the newer state. Say each fact once.",
        MERGE_OPEN + pieces + MERGE_CLOSE,
    ]
    return _prompt(kind, parts, retry, instructions)


def build_merge_prompt(
    kind: SummaryKind, bodies: Sequence[str], *, retry: bool, instructions: str | None = None
) -> SummaryPrompt:
    """The prompt of one merge attempt: ``bodies`` (rendered valid documents, in material order) → one.
    Needs at least two documents: merging one would be a rewrite for nothing."""
    if len(bodies) < 2:
        raise ValueError("a merge needs at least two documents")
    pieces = "".join(merge_piece(part, body) for part, body in enumerate(bodies, start=1))
    return _merge_prompt(kind, pieces, len(bodies), retry=retry, instructions=instructions)


def merge_prompt_reserve(kind: SummaryKind, instructions: str | None = None) -> int:
    """Tokens a merge prompt needs besides its documents (the retry variant, up to 999 parts)."""
    return _merge_prompt(kind, "", 999, retry=True, instructions=instructions).tokens()


def summary_prompt_reserve(kind: SummaryKind, instructions: str | None = None) -> int:
    """Tokens a summary prompt needs besides its material, in the worst case: the retry variant of an
    update with a previous summary at the body limit, or of a merge prompt without its documents,
    whichever is larger (the session's instructions included). Chunk sizes and merge groups reserve
    this, so the retry of any chunk or merge fits as well as its first attempt."""
    skeleton = build_summary_prompt(
        kind, "", previous_body="", retry=True, chunk=999, chunks=999, instructions=instructions
    )
    return max(skeleton.tokens() + BODY_TOKEN_LIMIT, merge_prompt_reserve(kind, instructions))


# --------------------------------------------------------------------------------------------------
# The side answer request (SPEC §7).

ANSWER_INSTRUCTIONS = """[Sidequest] The conversation above is the main agent's session, shown to you \
read-only. The person running it asks a side question ("by the way…"); the main task keeps running and is \
not affected by your answer.

- Answer the side question below directly and concisely, from the context above.
- Do not call any tools: none are available to you here, even if tools are listed.
- Earlier side answers (the side Q&A summary and the recent side Q&A below) are earlier conclusions, \
not new tool evidence; the latest main context wins wherever they disagree with it.
- If the context does not contain the answer, say so instead of guessing."""

# Used instead of ANSWER_INSTRUCTIONS when the question came without any snapshot (SPEC §3: it is then
# answered from the side Q&A history alone), so the model is not told of a conversation that is not there.
ANSWER_INSTRUCTIONS_NO_CONTEXT = """[Sidequest] A person running a main agent task asks a side question \
("by the way…"). No snapshot of the main session came with it: answer from the earlier side questions and \
answers below.

- Answer the side question below directly and concisely.
- Do not call any tools: none are available to you here.
- Earlier side answers are earlier conclusions, not new tool evidence, and may be out of date.
- If they do not contain the answer, say so instead of guessing."""

CONTEXT_SUMMARY_ACK = (
    "Understood. I have the summary of the earlier part of the session; the recent messages follow."
)

PENDING_TOOL_RESULT = "(no result yet: the main task was still running this tool when the snapshot was taken)"


@dataclass(frozen=True)
class AnswerRequest:
    """The assembled answer call: what to send, and its estimate per segment."""

    system: str | None
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    estimate: SegmentEstimate
    # The system as the snapshot's text blocks, when it came as such (NormalizedSnapshot.system_blocks).
    system_blocks: tuple[dict[str, Any], ...] = ()


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def build_answer_request(
    *,
    question: str,
    system: str | None = None,
    system_blocks: Sequence[Mapping[str, Any]] = (),
    tools: Sequence[Mapping[str, Any]] = (),
    messages: Sequence[Mapping[str, Any]] = (),
    messages_tokens: int | None = None,
    context_summary: str | None = None,
    qa_summary: str | None = None,
    replayed: Sequence[QAPair] = (),
    context_time: str | None = None,
) -> AnswerRequest:
    """Assemble the side answer request in the SPEC §7 order, for the main session's prefix cache:
    the snapshot's system and tools, its messages exactly as given (or a context summary, then the kept
    ones), then ONE final user turn — merged into a trailing user turn, and completing a trailing
    unanswered tool call with pending results (docs/summaries.md, "The answer request")."""
    out: list[dict[str, Any]] = []
    if context_summary is not None:
        out.append({"role": "user", "content": [_text_block(context_summary)]})
        if not messages or messages[0].get("role") != "assistant":
            out.append({"role": "assistant", "content": [_text_block(CONTEXT_SUMMARY_ACK)]})
    summary_tokens = estimate_messages(out)
    out.extend(dict(m) for m in messages)
    # A prepared snapshot knows its messages' estimates already (``messages_tokens``, envelopes
    # included): the same number, without encoding 1600 messages again.
    kept_tokens = estimate_messages(messages) if messages_tokens is None else messages_tokens
    context_tokens = summary_tokens + kept_tokens - envelope_tokens(len(out))

    instructions = ANSWER_INSTRUCTIONS if out else ANSWER_INSTRUCTIONS_NO_CONTEXT
    if context_time and out:
        instructions += f"\n- The main context above was taken at {context_time}."
    blocks: list[dict[str, Any]] = [
        {"type": "tool_result", "tool_use_id": tool_id, "content": PENDING_TOOL_RESULT}
        for tool_id in pending_tool_ids(out)
    ]
    # The stand-in results complete the snapshot's own tool calls, so they count as context.
    context_tokens += sum(estimate_block(block) for block in blocks)

    def add(text: str) -> int:
        """Append one text block to the final turn; its estimate."""
        blocks.append(_text_block(text))
        return estimate_text(text)

    # Sidequest's own text in the final turn (instructions, the "Side question:" label) is envelope:
    # the "question" segment is the question's bytes alone (SPEC §5), so a user can read it as such.
    wrapper_tokens = add(instructions)
    qa_summary_tokens = 0
    if qa_summary is not None:
        qa_summary_tokens = add("Summary of earlier side questions and answers:\n" + qa_summary)
    qa_raw_tokens = 0
    if replayed:
        pairs = "\n".join(render_qa_pair(pair) for pair in replayed)
        qa_raw_tokens = add("Recent side questions and answers (oldest first):\n\n" + pairs)
    question_tokens = estimate_text(question)
    # The label's share is what the labelled block costs beyond the bare question (per-block rounding
    # included), so the segments still add up to the estimate of what is sent.
    wrapper_tokens += add("Side question:\n" + question) - question_tokens

    if out and out[-1].get("role") == "user":
        last = out[-1]
        content = last.get("content")
        existing: list[Any] = [_text_block(content)] if isinstance(content, str) else list(content or [])
        out[-1] = {**last, "content": existing + blocks}
    else:
        out.append({"role": "user", "content": blocks})

    return AnswerRequest(
        system=system,
        tools=[dict(t) for t in tools],
        messages=out,
        estimate=SegmentEstimate(
            system=estimate_system(system),
            tools=estimate_tools(list(tools)),
            context=context_tokens,
            qa_summary=qa_summary_tokens,
            qa_raw=qa_raw_tokens,
            question=question_tokens,
            envelope=envelope_tokens(len(out)) + wrapper_tokens,
        ),
        system_blocks=tuple(dict(b) for b in system_blocks),
    )
