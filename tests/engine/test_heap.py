"""The startup heap frozen out of the garbage collector's walks (tandem.engine.heap): what is alive
at the freeze is skipped until thawed, garbage is collected first, and the block thaws however
it ends."""

from __future__ import annotations

import gc
import weakref

import pytest

from tandem.engine.heap import freeze_heap, frozen_heap, thaw_heap


class Node:
    """A cycle of one: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def tracked_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}


@pytest.fixture(autouse=True)
def thawed():
    assert gc.get_freeze_count() == 0  # nothing else in the test process freezes
    yield
    thaw_heap()


def test_what_is_alive_at_the_freeze_is_out_of_the_walks_until_thawed():
    before = Node()
    with frozen_heap() as count:
        assert count >= gc.get_freeze_count() > 0  # (frozen objects freed by their counts leave it)
        after = Node()
        ids = tracked_ids()
        assert id(before) not in ids and id(before.__dict__) not in ids
        assert id(after) in ids  # what comes after is collected as usual
        assert len(ids) < count  # a full collection now walks the newcomers only
    assert gc.get_freeze_count() == 0
    assert id(before) in tracked_ids()


def test_garbage_is_collected_before_the_freeze_and_a_frozen_cycle_once_thawed():
    garbage, kept = Node(), Node()
    dead, frozen = weakref.ref(garbage), weakref.ref(kept)
    del garbage
    freeze_heap()
    assert dead() is None  # not frozen with the living
    del kept
    gc.collect()
    assert frozen() is not None  # frozen: no collection looks at it
    thaw_heap()
    gc.collect()
    assert frozen() is None


def test_the_block_thaws_when_it_raises():
    with pytest.raises(RuntimeError, match="inside"):
        with frozen_heap():
            raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0
