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


def layer(frame: str) -> str | None:
    for name, needles in LAYERS:
        if any(n in frame for n in needles):
            return name
    return None


def summarise(path: Path, top: int = 25) -> str:
    by_layer: Counter[str] = Counter()
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
        for frame in set(frames):
            inclusive[frame] += count
    out = [f"{total} samples", "by layer (innermost known frame):"]
    out += [f"  {share * 100 / total:5.1f} %  {name}" for name, share in by_layer.most_common()]
    out.append("top frames (inclusive):")
    out += [f"  {share * 100 / total:5.1f} %  {frame}" for frame, share in inclusive.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 25))
