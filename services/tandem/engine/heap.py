"""The cyclic garbage collector in a process that serves an engine: its startup heap frozen.

A full (generation 2) collection walks every object the collector tracks, holding the GIL. A
process with a loaded engine tracks ~350,000 (torch, transformers, the model's modules and
tensors): one full collection took ~165 ms on the development VM. The collector runs one as soon
as enough objects have outlived the younger collections since the last, and loading a model leaves
that many, so the first one after loading comes due soon: in `tandem bench` it fell inside the
first timed single-stream decode in every run, one gap of 150-220 ms between two tokens
(benchmarks/RESULTS.md, round forty-one). `gc.freeze()` moves every object tracked now into a
permanent generation that collections skip; vLLM freezes its engine process's startup heap so.

What freezing costs: a frozen object that becomes part of unreachable cycles later is not freed
until `thaw_heap`. So a server freezes once its engine has loaded, and thaws when it stops, and
the objects it freezes (the engine, the modules) live until then anyway.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> int:
    """Collect what is garbage now, then freeze every object still tracked. Returns how many
    objects are frozen (gc.get_freeze_count())."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Back into the collector's oldest generation: every frozen object, garbage or not."""
    gc.unfreeze()


@contextmanager
def frozen_heap() -> Iterator[int]:
    """freeze_heap for the block's length (yields the frozen count); thawed however it ends."""
    count = freeze_heap()
    try:
        yield count
    finally:
        thaw_heap()
