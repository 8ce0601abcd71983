"""CPU attention by the experts process over the CPU KV tier the attention side shares through files."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.kv.attention import AttentionMetadata, paged_attention
from tandem.kv.cache import CPU
from tandem.rpc.cpu_attention import SharedCpuKV, layout_path, publish_layout
from tandem.rpc.experts_client import GrpcExpertExecutor


@pytest.fixture
async def shared(start_server, model_dir, tmp_path):
    """(experts client, the attention side's engine whose CPU tier lives in shared memory)."""
    shm = tmp_path / "shm" / "kv"
    path = model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                kv_shm=str(shm))
    engine = LLMEngine.from_pretrained(path, device="cpu", config=EngineConfig(
        max_model_len=256, max_num_seqs=4, cpu_kv_gib=0.01, kv_shm_path=str(shm)))
    client = GrpcExpertExecutor(server.address)
    yield client, engine, shm
    client.close()


def local_attention(engine, layer, query, tables, lens):
    cache = engine.cache.layer(layer, CPU)
    meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, engine.cache.block_size,
                                   torch.device("cpu"))
    return paged_attention(query, cache["k"], cache["v"], meta, 1.0 / math.sqrt(query.shape[-1]))


async def test_remote_attention_reads_the_shared_cpu_tier(shared):
    client, engine, shm = shared
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: kv_shm: no CPU KV tier published"):
        await asyncio.to_thread(client.cpu_attention, 0, torch.randn(1, 4, 16), [[0]], [1])
    publish_layout(engine.cache, shm)
    torch.manual_seed(0)
    for tensor in engine.cache.tiers[CPU].values():
        tensor.normal_()  # the attention side writes; the experts process must see these bytes
    cfg = engine.model_config
    query = torch.randn(3, cfg.num_heads, cfg.head_dim)  # [S, H, D]
    tables, lens = [[4, 9], [0], [2, 3, 7]], [20, 5, 33]
    for layer in (0, 1):
        remote = await asyncio.to_thread(client.cpu_attention, layer, query, tables, lens)
        torch.testing.assert_close(remote, local_attention(engine, layer, query, tables, lens), rtol=0, atol=1e-6)
    before = remote
    engine.cache.tiers[CPU]["v"][1, 7] += 1.0  # change one block in place: shared memory, not a copy
    after = await asyncio.to_thread(client.cpu_attention, 1, query, tables, lens)
    torch.testing.assert_close(after[:2], before[:2], rtol=0, atol=0)  # sequences without block 7
    assert not torch.allclose(after[2], before[2])


async def test_bad_cpu_attention_requests_name_the_field(shared):
    client, engine, shm = shared
    publish_layout(engine.cache, shm)
    cfg = engine.model_config
    query = torch.randn(1, cfg.num_heads, cfg.head_dim)
    num_blocks = engine.cache.num_blocks(CPU)
    cases = [
        ((5, query, [[0]], [1]), "layer"),
        ((0, query, [[num_blocks]], [1]), "block_tables"),
        ((0, query, [[0]], [engine.cache.block_size + 1]), "seq_lens"),
        ((0, query, [[0], [1]], [1, 1]), "block_tables"),
        ((0, query[:, :, :8], [[0]], [1]), "query"),
    ]
    for args, name in cases:
        with pytest.raises(RuntimeError, match=f"INVALID_ARGUMENT: {name}:"):
            await asyncio.to_thread(client.cpu_attention, *args)


def test_layout_is_published_next_to_the_shared_files(tmp_path, model_dir):
    shm = tmp_path / "kv"
    engine = LLMEngine.from_pretrained(model_dir("mixtral"), device="cpu", config=EngineConfig(
        max_model_len=64, max_num_seqs=1, cpu_kv_gib=0.001, kv_shm_path=str(shm)))
    assert publish_layout(engine.cache, shm) == layout_path(shm)
    layout, tensors = SharedCpuKV(shm).tensors()
    assert set(tensors) == {"k", "v"} and layout["block_size"] == engine.cache.block_size
    mine = engine.cache.tiers[CPU]["k"]
    assert tensors["k"].shape == mine.shape
    mine[0, 0, 0] = 42.0
    assert torch.all(tensors["k"][0, 0, 0] == 42.0)

