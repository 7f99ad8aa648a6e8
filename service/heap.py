"""The process's heap after start-up, out of the cyclic collector's way.

Importing the app (FastAPI, pydantic, SQLAlchemy and the provider SDKs, the Anthropic one above all)
leaves about 110 000 tracked objects that live as long as the process. Every full (generation 2)
collection walked all of them: 100–400 ms on this 2-core machine, during which nothing else in the
process ran — an admission, an SSE write, a slot hand-off all waited (measured: docs/benchmarks.md,
"Where the time went"). ``gc.freeze()`` moves them to the permanent generation, so a collection only
walks what requests allocate; a larger first threshold makes the ~50 000 objects of one parsed
600 KB snapshot cost a few young collections instead of ~70.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_THRESHOLD: Final = 10_000


def freeze_startup_heap() -> None:
    """Collect once, then freeze every object alive now; call it when start-up imports are done."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
