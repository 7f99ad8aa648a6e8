"""Summaries (SPEC §6): the strict summary document, the summary call policy, the rolling Q&A summary,
the content-keyed context summary cache, and the assembly of the side answer prompt
(docs/summaries.md). Pure of I/O beyond the provider interface: saving what these return is the store's.
"""
