"""Summaries (SPEC §6): the strict summary document, the summary call policy (one retry, call cap,
deadline, chunking), the rolling Q&A summary, the content-keyed context summary cache, and the
assembly of the side answer prompt. See docs/summaries.md.

Builds on the pure budget kernel and the provider interface; never touches the database — saving what
these functions return is the store's job.
"""

from service.summary.context import (
    CachedContextSummary,
    CacheHit,
    CacheMiss,
    ContextCompaction,
    PrefixReuse,
    compact_context,
    find_reusable,
    prefix_key,
)
from service.summary.document import (
    BODY_TOKEN_LIMIT,
    RETRY_BODY_TOKENS,
    Provenance,
    SummaryDocument,
    body_tokens,
    check_body_size,
    parse_summary_document,
    render_body,
    render_summary,
)
from service.summary.errors import (
    SummaryCallCap,
    SummaryEmpty,
    SummaryError,
    SummaryInvalid,
    SummaryToolCall,
    SummaryTooLong,
    SummaryTruncated,
)
from service.summary.material import QAPair, render_messages, render_qa_pair
from service.summary.policy import SummaryCallBudget, judge_reply
from service.summary.prompts import (
    PROMPT_VERSION,
    AnswerRequest,
    build_answer_request,
    build_summary_prompt,
    summary_prompt_reserve,
)
from service.summary.rolling import StoredQASummary, fold_qa
from service.summary.runner import SummaryRunner

__all__ = [
    "BODY_TOKEN_LIMIT",
    "PROMPT_VERSION",
    "RETRY_BODY_TOKENS",
    "AnswerRequest",
    "CacheHit",
    "CacheMiss",
    "CachedContextSummary",
    "ContextCompaction",
    "PrefixReuse",
    "Provenance",
    "QAPair",
    "StoredQASummary",
    "SummaryCallBudget",
    "SummaryCallCap",
    "SummaryDocument",
    "SummaryEmpty",
    "SummaryError",
    "SummaryInvalid",
    "SummaryRunner",
    "SummaryTooLong",
    "SummaryToolCall",
    "SummaryTruncated",
    "body_tokens",
    "build_answer_request",
    "build_summary_prompt",
    "check_body_size",
    "compact_context",
    "find_reusable",
    "fold_qa",
    "judge_reply",
    "parse_summary_document",
    "prefix_key",
    "render_body",
    "render_messages",
    "render_qa_pair",
    "render_summary",
    "summary_prompt_reserve",
]
