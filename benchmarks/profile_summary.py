"""Summarise a py-spy raw (collapsed stacks) profile: where the server's CPU went, by layer.

Run: ``python benchmarks/profile_summary.py prof.txt`` (``bench_admission.py --profile prof`` writes
``prof.txt``). Each sample is attributed to the innermost frame that belongs to a known layer, so the
shares add up to 100 %; then the top functions by inclusive share.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

# Innermost match wins: a pydantic frame called from FastAPI counts as pydantic.
LAYERS = (
    ("sqlalchemy ORM", ("sqlalchemy/orm/",)),
    ("sqlalchemy core/engine/pool", ("sqlalchemy/",)),
    ("asyncpg", ("asyncpg/",)),
    ("pydantic", ("pydantic", "pydantic_core")),
    ("json", ("json/",)),
    ("service.store", ("service/store/",)),
    ("service.api", ("service/api/",)),
    ("fastapi", ("fastapi/",)),
    ("starlette", ("starlette/",)),
    ("uvicorn + h11", ("uvicorn/", "h11/")),
    ("asyncio event loop", ("asyncio/", "selectors.py")),
)


# Whole-stack buckets, first match wins: who caused the work, socket sends included (a send to
# PostgreSQL under SQLAlchemy counts as SQLAlchemy's; the HTTP response's as the response's).
BUCKETS = (
    ("sync dependencies via the thread pool", ("run_in_threadpool", "anyio/", "threading.py", "queue.py")),
    ("SQLAlchemy ORM (and the I/O under it)", ("sqlalchemy/orm/",)),
    ("SQLAlchemy Core/engine/pool (and the I/O under it)", ("sqlalchemy/",)),
    ("asyncpg direct (and its socket I/O)", ("asyncpg/",)),
    ("HTTP response: render and send", ("starlette/responses",)),
    ("FastAPI dependencies, body validation", ("fastapi/dependencies", "pydantic")),
    ("service code (routes, store, records)", ("service/api/", "service/store/", "post_question (bare_app")),
    ("HTTP parsing, routing, middleware", ("h11/", "uvicorn/", "starlette/", "fastapi/")),
)


def bucket(stack: str) -> str:
    for name, needles in BUCKETS:
        if any(n in stack for n in needles):
            return name
    return "event loop, other"


def layer(frame: str) -> str | None:
    for name, needles in LAYERS:
        if any(n in frame for n in needles):
            return name
    return None


def summarise(path: Path, top: int = 25) -> str:
    by_layer: Counter[str] = Counter()
    by_bucket: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        name = next((n for f in reversed(frames) if (n := layer(f)) is not None), "other")
        by_layer[name] += count
        by_bucket[bucket(stack)] += count
        for frame in set(frames):
            inclusive[frame] += count
    out = [f"{total} samples", "by cause (whole stack, first match):"]
    out += [f"  {share * 100 / total:5.1f} %  {name}" for name, share in by_bucket.most_common()]
    out.append("by layer (innermost known frame):")
    out += [f"  {share * 100 / total:5.1f} %  {name}" for name, share in by_layer.most_common()]
    out.append("top frames (inclusive):")
    out += [f"  {share * 100 / total:5.1f} %  {frame}" for frame, share in inclusive.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 25))
