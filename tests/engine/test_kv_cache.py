"""The KV cache's tensors: a CPU tier in shared-memory files, made new, refused when they cannot fit,
and removed when the cache is closed or collected."""

from __future__ import annotations

import gc
import shutil
from collections import namedtuple

import pytest
import torch

from tandem.kv.cache import CPU, DEVICE, KVCache, KVLayout

LAYOUT = KVLayout((("k", (2, 4)), ("v", (2, 4))), num_layers=2, dtype=torch.float32)
BLOCK = 4


def files(shm) -> list[str]:
    return sorted(p.name for p in shm.parent.iterdir()) if shm.parent.exists() else []


def test_a_shared_tier_replaces_an_earlier_processs_files_of_another_size(tmp_path):
    shm = tmp_path / "shm" / "kv"
    shm.parent.mkdir()
    stale = LAYOUT.bytes_per_block(BLOCK) * 100  # an earlier run's larger tier
    for name in ("k", "v"):
        (tmp_path / "shm" / f"kv.{name}").write_bytes(b"\xff" * stale)  # NaN as float32
    peer = torch.from_file(str(tmp_path / "shm" / "kv.k"), shared=True, size=stale // 4, dtype=torch.float32)
    cache = KVCache(LAYOUT, BLOCK, num_device_blocks=2, num_cpu_blocks=3, device="cpu", cpu_shm_path=shm)
    for name, tensor in cache.tiers[CPU].items():
        assert (tmp_path / "shm" / f"kv.{name}").stat().st_size == tensor.numel() * 4  # no more than the tier
        assert torch.all(tensor == 0)
    assert peer.isnan().all()  # a process still mapping the old file keeps it until it maps the new one
    cache.close()


def test_a_shared_tier_takes_over_an_earlier_processs_files_of_its_size(tmp_path):
    """An attention process restarted in its pod, the experts process still mapping the tier: one
    copy of the tier in memory, not two."""
    shm = tmp_path / "shm" / "kv"
    shm.parent.mkdir()
    numel = LAYOUT.num_layers * 3 * BLOCK * 2 * 4  # [layers, blocks, block_size, heads, head_dim]
    for name in ("k", "v"):  # an earlier process's, of this size, that died
        (tmp_path / "shm" / f"kv.{name}").write_bytes(bytes(numel * 4))
    peer = torch.from_file(str(tmp_path / "shm" / "kv.k"), shared=True, size=numel, dtype=torch.float32)
    inode = (tmp_path / "shm" / "kv.k").stat().st_ino
    cache = KVCache(LAYOUT, BLOCK, 2, 3, "cpu", shm)
    assert (tmp_path / "shm" / "kv.k").stat().st_ino == inode
    cache.tiers[CPU]["k"][1, 2] = 7.0
    assert (peer == 7.0).sum() == BLOCK * 2 * 4  # the same memory
    cache.close()
    assert files(shm) == []


def test_close_and_collection_remove_only_the_files_the_cache_made(tmp_path):
    shm = tmp_path / "shm" / "kv"
    cache = KVCache(LAYOUT, BLOCK, 2, 3, "cpu", shm)
    assert files(shm) == ["kv.k", "kv.v"]
    tier = cache.tiers[CPU]["k"]
    cache.close()
    assert files(shm) == []
    tier[0, 0] = 1.0  # this process's tensors stay valid
    cache.close()  # twice is harmless

    KVCache(LAYOUT, BLOCK, 2, 3, "cpu", shm)  # dropped at once
    gc.collect()
    assert files(shm) == []

    first = KVCache(LAYOUT, BLOCK, 2, 3, "cpu", shm)
    second = KVCache(LAYOUT, BLOCK, 2, 5, "cpu", shm)  # another size: its own files
    first.close()
    assert files(shm) == ["kv.k", "kv.v"]  # the second cache's, left alone
    second.close()
    assert files(shm) == []


def test_a_tier_larger_than_its_volume_is_refused_before_any_file_is_made(tmp_path, monkeypatch):
    shm = tmp_path / "shm" / "kv"
    needed = LAYOUT.bytes_per_block(BLOCK) * 64
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(needed, 1, needed - 1))
    with pytest.raises(ValueError, match=r"--kv-shm: .* the CPU KV tier needs .* \(64 blocks\): lower --cpu-kv-gib"):
        KVCache(LAYOUT, BLOCK, 2, 64, "cpu", shm)
    assert files(shm) == []
    cache = KVCache(LAYOUT, BLOCK, 2, 63, "cpu", shm)  # what fits
    assert cache.num_blocks(CPU) == 63 and cache.num_blocks(DEVICE) == 2
    cache.close()
