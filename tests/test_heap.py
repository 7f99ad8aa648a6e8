"""The start-up heap is frozen out of the cyclic collector's walks (service/heap.py)."""

from __future__ import annotations

import subprocess
import sys


def test_freezing_moves_the_startup_heap_out_of_full_collections() -> None:
    # In a fresh interpreter: freezing is process-wide and would change this test process's GC.
    script = """
import gc, time
import service.api.app, service.serve  # what `sidequest serve` imports before it freezes
from service.heap import YOUNG_THRESHOLD, freeze_startup_heap
before = len(gc.get_objects())
freeze_startup_heap()
assert gc.get_freeze_count() >= before * 0.9, (gc.get_freeze_count(), before)
assert len(gc.get_objects()) < before * 0.1
assert gc.get_threshold()[0] >= YOUNG_THRESHOLD
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
