"""The weights on 2 MiB pages: fewer TLB misses while decode streams them from RAM.

Decode reads every active weight once a token, ~130 MB a token on the comparison checkpoint, so
on 4 KiB pages it walks a page table every 4 KiB it reads. Linux backs anonymous memory with
transparent huge pages only where asked (`/sys/kernel/mm/transparent_hugepage/enabled` is
"madvise" on many distributions, as on the development VM). Two ways in:

- torch's allocator asks (madvise MADV_HUGEPAGE, 2 MiB-aligned) for every tensor of 2 MiB or
  more under THP_MEM_ALLOC_ENABLE=1, read once, at its first allocation. The `tandem` command
  sets it (unless it is set already) before torch loads, so the weights are allocated on huge
  pages as they load: no copy, and loading took 2.7-4.1 s instead of 6.2 s for 1.6 GiB here.
- Where torch allocated first (Tandem used as a library), the loader calls `collapse`: the
  weights' storages asked in place, MADV_HUGEPAGE (keep them on huge pages) and MADV_COLLAPSE
  (Linux 6.1+: move them now, a copy: ~0.5 GB/s here), over the whole 2 MiB pages inside each.
  On storages already on huge pages it returns at once. THP_MEM_ALLOC_ENABLE=0 (set by whoever
  runs Tandem) keeps 4 KiB pages: the loader then asks for nothing either.

Single-stream int8 decode ran 3-8% faster in this VM's slow-memory spells and 0-7% in its fast
ones; bf16 and f32 moved within noise or a little faster (benchmarks/RESULTS.md, round
thirty-four). Best effort: a kernel without MADV_COLLAPSE, memory that is not private anonymous (a
shared-memory file) or no free huge page leaves that storage as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Iterable

import torch

_log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, length) of the whole 2 MiB pages inside each distinct CPU storage of `tensors`."""
    seen, ranges = set(), []
    for t in tensors:
        if t is None or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if start in seen:
            continue
        seen.add(start)
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        end = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > first:
            ranges.append((first, end - first))
    return ranges


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Put the storages of `tensors` on huge pages where the kernel can; returns how many bytes now are."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done, refused = 0, {}
    for address, length in huge_ranges(tensors):
        if madvise(address, length, MADV_HUGEPAGE) != 0 or madvise(address, length, MADV_COLLAPSE) != 0:
            errno = ctypes.get_errno()
            refused[errno] = refused.get(errno, 0) + length
            continue
        done += length
    for errno, length in refused.items():
        _log.debug("%d MiB of weights left on small pages: madvise failed (errno %d)", length >> 20, errno)
    return done
