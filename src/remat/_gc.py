"""Pausing Python's cyclic garbage collector while a program is built.

Building remat's IR allocates many long-lived objects (instructions, values, types); each full
collection walks every live object again (an exported graph's too), which at 64 GPT layers was 60%
of the time of translation, the training graph and the passes, and made them grow faster than the
graph. The garbage of those steps is a few copies of the program, collected once the collector runs
again. Reference counting frees everything without cycles meanwhile."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def cyclic_gc_paused(pause: bool = True) -> Iterator[None]:
    """Pause the cyclic garbage collector while the block runs (``pause=False``: leave it as it is)."""
    was = gc.isenabled()
    if pause and was:
        gc.disable()
    try:
        yield
    finally:
        if pause and was:
            gc.enable()
