"""CPU attention by the experts process over the CPU KV tier the attention side shares through files."""

from __future__ import annotations

import asyncio
import gc
import math
import weakref

import pytest
import torch

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.kv.attention import AttentionMetadata, paged_attention
from tandem.kv.cache import CPU
from tandem.rpc.cpu_attention import KVNotShared, SharedCpuKV, layout_path, publish_layout, withdraw_layout
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



async def test_remote_attention_reads_an_fp8_tier_with_its_scales(start_server, model_dir, tmp_path):
    # --kv-cache-dtype fp8 is the attention process's flag: the tier's dtype and each layer's scales reach
    # the experts process in the published layout, and it reads the bytes as they were written.
    from tandem.model.loader import load_model

    shm, path = tmp_path / "shm" / "kv", model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                kv_shm=str(shm))
    model, _ = load_model(path)
    for layer, (ks, vs) in enumerate([(0.25, 3.0), (0.5, 0.125)]):  # as a checkpoint's calibrated scales
        model.model.layers[layer].self_attn.k_scale, model.model.layers[layer].self_attn.v_scale = ks, vs
    engine = LLMEngine(model, None, torch.device("cpu"), EngineConfig(
        max_model_len=256, max_num_seqs=4, cpu_kv_gib=0.01, kv_shm_path=str(shm), kv_cache_dtype="fp8"))
    publish_layout(engine.cache, shm)
    torch.manual_seed(0)
    for tensor in engine.cache.tiers[CPU].values():
        tensor.copy_(torch.randn(tensor.shape).to(torch.float8_e4m3fn))
    cfg = engine.model_config
    query = torch.randn(3, cfg.num_heads, cfg.head_dim)
    tables, lens = [[4, 9], [0], [2, 3, 7]], [20, 5, 33]
    client = GrpcExpertExecutor(server.address)
    try:
        for layer, (ks, vs) in enumerate([(0.25, 3.0), (0.5, 0.125)]):
            remote = await asyncio.to_thread(client.cpu_attention, layer, query, tables, lens)
            cache = engine.cache.layer(layer, CPU)
            values = {"k": cache["k"].float() * ks, "v": cache["v"].float() * vs}
            meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, engine.cache.block_size,
                                           torch.device("cpu"))
            want = paged_attention(query, values["k"], values["v"], meta, 1.0 / math.sqrt(query.shape[-1]))
            torch.testing.assert_close(remote, want, rtol=1e-5, atol=1e-5)
    finally:
        client.close()


async def test_prefill_chunks_and_the_latent_layout_over_the_shared_tier(start_server, model_dir, tmp_path):
    """Several queries per sequence (a chunk offloaded mid-prefill) over DeepSeek's latent cache:
    the experts process attends in the latent space with no weights, and once the attention side
    projects the result out it equals MLA computed by the model's own code on the same blocks."""
    from tandem.model.deepseek_attention import LATENT
    from tandem.model.deepseek_mla import absorb_query, paged_latent_attention, unabsorb_output

    path, shm = model_dir("deepseek_v3"), tmp_path / "shm" / "kv"
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                kv_shm=str(shm))
    engine = LLMEngine.from_pretrained(path, device="cpu", config=EngineConfig(
        max_model_len=256, max_num_seqs=4, cpu_kv_gib=0.01, kv_shm_path=str(shm)))
    publish_layout(engine.cache, shm)
    torch.manual_seed(0)
    engine.cache.tiers[CPU][LATENT].normal_()
    layer = 1
    attn = engine.model.model.layers[layer].self_attn
    dims, heads = attn.dims, attn.num_heads
    tables, lens, query_lens = [[3, 1], [0], [5, 6, 2]], [7, 4, 30], [1, 4, 2]
    t = sum(query_lens)
    q_nope, q_pe = torch.randn(t, heads, dims.qk_nope_head_dim), torch.randn(t, heads, dims.qk_rope_head_dim)
    w = attn.kv_b_proj.weight.detach()
    client = GrpcExpertExecutor(server.address)
    try:
        latent_out = await asyncio.to_thread(
            client.cpu_attention, layer, absorb_query(q_nope, q_pe, w, dims), tables, lens, dims.softmax_scale,
            query_lens=query_lens, value_dim=dims.kv_lora_rank)
        assert latent_out.shape == (t, heads, dims.kv_lora_rank)
        meta = AttentionMetadata.build([n - q for n, q in zip(lens, query_lens)], query_lens, tables,
                                       engine.cache.block_size, torch.device("cpu"))
        # single-query sequences take the absorbed form there, the others the expanded one
        expected = paged_latent_attention(q_nope, q_pe, engine.cache.layer(layer, CPU)[LATENT], meta, w, dims)
        torch.testing.assert_close(unabsorb_output(latent_out, w, dims), expected, rtol=1e-4, atol=1e-5)
        bad = [((layer, absorb_query(q_nope, q_pe, w, dims), tables, lens), dict(query_lens=query_lens), "value_dim"),
               ((layer, q_nope, tables, lens), dict(query_lens=query_lens, value_dim=8), "query"),
               ((layer, absorb_query(q_nope, q_pe, w, dims), tables, lens), dict(query_lens=[1, 4, 3], value_dim=8),
                "query_lens"),
               ((layer, absorb_query(q_nope[:2], q_pe[:2], w, dims), [[0]], [1]), dict(query_lens=[2], value_dim=8),
                "query_lens")]
        for args, kwargs, name in bad:
            with pytest.raises(RuntimeError, match=f"INVALID_ARGUMENT: {name}:"):
                await asyncio.to_thread(client.cpu_attention, *args, **kwargs)
    finally:
        client.close()


async def test_the_attention_process_removes_its_shared_tier_when_it_ends(start_server, model_dir, tmp_path):
    """The tier's files and their published layout belong to the attention process: they go when
    it stops, so a stopped server leaves no memory-backed files behind in /dev/shm."""
    shm, path = tmp_path / "shm" / "kv", model_dir("mixtral")
    experts = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                 kv_shm=str(shm))
    attention = await start_server(model=str(path), role="attention", experts=experts.address, kv_shm=str(shm))
    assert sorted(p.name for p in shm.parent.iterdir()) == ["kv.k", "kv.layout.json", "kv.v"]
    assert await attention.close() == 0
    assert list(shm.parent.iterdir()) == []
    embedded = await start_server(model=str(path), kv_shm=str(shm))  # role all
    assert sorted(p.name for p in shm.parent.iterdir()) == ["kv.k", "kv.layout.json", "kv.v"]
    assert await embedded.close() == 0
    assert list(shm.parent.iterdir()) == []


def test_the_experts_side_unmaps_a_tier_its_attention_process_withdrew(tmp_path, model_dir):
    """Mapped by the experts process, removed files keep their memory: it lets them go once the
    layout is withdrawn, so that a restarted attention process finds the volume's room free."""
    shm = tmp_path / "kv"
    engine = LLMEngine.from_pretrained(model_dir("mixtral"), device="cpu", config=EngineConfig(
        max_model_len=64, max_num_seqs=1, cpu_kv_gib=0.001, kv_shm_path=str(shm)))
    publish_layout(engine.cache, shm)
    kv = SharedCpuKV(shm)
    mapped = weakref.ref(kv.tensors()[1]["k"])
    kv.release_if_withdrawn()
    assert mapped() is not None  # still published: kept
    withdraw_layout(shm)
    engine.close()
    kv.release_if_withdrawn()
    gc.collect()
    assert mapped() is None
    with pytest.raises(KVNotShared, match="no CPU KV tier published"):
        kv.tensors()
