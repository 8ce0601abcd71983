"""The weights on 2 MiB pages (tandem.model.huge_pages): which ranges, that Linux moves them, that
nothing changes in them, and that loading hands every weight over."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from tandem.model import huge_pages, loader
from tandem.model.huge_pages import HUGE_PAGE, huge_ranges

MiB = 1 << 20


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_ranges_are_the_whole_huge_pages_inside_each_storage_once():
    big = torch.empty(9 * MiB, dtype=torch.uint8)
    start = big.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + big.numel()) // HUGE_PAGE * HUGE_PAGE
    # A view and a second reference of the same storage count once; a storage with no whole page inside none.
    ranges = huge_ranges([big, big[MiB:], big.view(torch.int32), torch.empty(MiB, dtype=torch.uint8)])
    assert ranges == [(first, end - first)]
    assert end - first >= 6 * MiB and first >= start and end <= start + big.numel()
    assert huge_ranges([torch.empty(16 * MiB, device="meta")]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_COLLAPSE) is Linux's")
def test_collapse_moves_a_weight_to_huge_pages_and_keeps_its_values():
    weight = torch.randn(4 * MiB)  # 16 MiB of float32, private anonymous memory
    before = weight.clone()
    probe = huge_ranges([weight])[0]
    if huge_pages._madvise()(probe[0], HUGE_PAGE, huge_pages.MADV_COLLAPSE) != 0:
        pytest.skip(f"this kernel does not collapse to huge pages here (errno {ctypes.get_errno()})")
    done = huge_pages.collapse([weight, weight[:10]])
    assert done == probe[1] and done >= 14 * MiB
    assert anon_huge_kib(probe[0]) * 1024 >= done  # madvise gave the huge pages a mapping of their own
    assert torch.equal(weight, before)


def test_collapse_counts_only_what_the_kernel_moved(monkeypatch):
    # A kernel that refuses one storage (no MADV_COLLAPSE, shared memory, no free huge page) and
    # moves the other: the refused one is left as it was, and not counted.
    refused, moved = torch.zeros(6 * MiB, dtype=torch.uint8), torch.zeros(6 * MiB, dtype=torch.uint8)
    (bad, _), (good, good_length) = huge_ranges([refused]) + huge_ranges([moved])
    calls = []

    def madvise(address, length, advice):
        calls.append((address, advice))
        if address == bad:
            ctypes.set_errno(22)
            return -1
        return 0

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    assert huge_pages.collapse([refused, moved]) == good_length
    assert (good, huge_pages.MADV_HUGEPAGE) in calls and (good, huge_pages.MADV_COLLAPSE) in calls
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)  # not Linux
    assert huge_pages.collapse([moved]) == 0


def test_loading_hands_every_weight_to_collapse(demo_model_dir, monkeypatch):
    handed = []
    monkeypatch.setattr(huge_pages, "collapse", lambda tensors: handed.extend(tensors) or 0)
    model, executor = loader.load_model(demo_model_dir("mixtral"), device="cpu", expert_quant="int8",
                                        dense_quant="int8")
    storages = {t.untyped_storage().data_ptr() for t in handed}
    wanted = [*model.parameters(), *loader.expert_tensors(executor)]
    assert loader.expert_tensors(executor), "the in-process executor's weights are listed"
    missing = [tuple(t.shape) for t in wanted if t.numel() and t.untyped_storage().data_ptr() not in storages]
    assert not missing

    handed.clear()
    executor = loader.build_expert_executor(demo_model_dir("mixtral"), quant="int4")
    assert {t.untyped_storage().data_ptr() for t in handed} >= {
        t.untyped_storage().data_ptr() for t in loader.expert_tensors(executor) if t.numel()}

    handed.clear()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # 4 KiB pages asked for: nothing collapsed
    loader.load_model(demo_model_dir("mixtral"), device="cpu")
    loader.build_expert_executor(demo_model_dir("mixtral"))
    assert handed == []


def test_the_command_asks_torch_for_huge_pages_unless_told_otherwise(monkeypatch, tmp_path):
    from tandem import cli

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert cli.main(["make-demo-model", str(tmp_path / "a")]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # an operator's choice is kept
    assert cli.main(["make-demo-model", str(tmp_path / "b")]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
