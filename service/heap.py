"""The process's heap after start-up, out of the cyclic collector's way.

Importing the app leaves about 110 000 tracked objects that live as long as the process, and every
full collection walked all of them: 100–400 ms during which nothing else in the process ran
(docs/benchmarks.md, "The heap"). ``gc.freeze()`` moves them to the permanent generation; a larger
first threshold makes one parsed 600 KB snapshot cost a few young collections instead of ~70.
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
