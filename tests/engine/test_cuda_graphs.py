"""Decode on CUDA: attention on the GPU, routed experts on the CPU, steps replayed from CUDA graphs.

The suite never needs a GPU: these tests skip without one, and run on a GPU machine
(benchmarks/RESULTS.md, rounds nine and sixteen). What CUDA graphs change is how kernels are
launched, so a graphed engine must give transformers' greedy tokens, and the same logits as the
eager engine for batches padded to a captured size (padding rows must write no KV and change
nothing); multi-step runs must give the single-step tokens, and prefill experts copied from
page-locked memory transformers' tokens, in the split deployment too, from the weights the
experts process shares."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tandem.engine import cuda_graph
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine_bench import start_split_experts
from tandem.experts.shared_weights import SharedPrefill
from tandem.kv.cache import DEVICE
from tandem.rpc.loading import load_attention
from tandem.rpc.server import ServeOptions

from test_parity import hf_greedy, prompt_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NEW_TOKENS = 24


def test_captured_sizes_cover_every_batch_up_to_the_limit():
    assert cuda_graph.batch_sizes(1) == (1,)
    assert cuda_graph.batch_sizes(5) == (1, 2, 4, 5)
    assert cuda_graph.batch_sizes(128)[-1] == 128
    for limit in (1, 3, 24, 100):
        sizes = cuda_graph.batch_sizes(limit)
        assert all(any(s >= n for s in sizes) for n in range(1, limit + 1)) and max(sizes) == limit


def test_no_graphs_off_cuda(demo_model_dir):
    engine = LLMEngine.from_pretrained(demo_model_dir("mixtral"), device="cpu", config=EngineConfig())
    assert engine.runner.graphs is None
    assert cuda_graph.unsupported_reason(engine.model, engine.cache) == "the compute device is not CUDA"


def test_graphs_serve_grouped_query_and_latent_attention_and_nothing_else(demo_model_dir, monkeypatch):
    # What the check says on a CUDA cache, asked on the CPU: MLA's decode is graphed too.
    monkeypatch.setattr(cuda_graph.triton_attention, "available", lambda device: True)
    cache = SimpleNamespace(device=torch.device("cuda"), block_size=16)
    for arch in ("mixtral", "deepseek_v3"):
        engine = LLMEngine.from_pretrained(demo_model_dir(arch), device="cpu", config=EngineConfig())
        assert cuda_graph.unsupported_reason(engine.model, cache) is None
    engine.model.model.layers[1].self_attn = torch.nn.Identity()
    assert cuda_graph.unsupported_reason(engine.model, cache) == "the model's attention has no graphed decode path"


def cuda_engine(model_dir, *, enforce_eager: bool, dtype="float32", expert_quant="none", **config):
    config = EngineConfig(enforce_eager=enforce_eager, num_device_blocks=160, max_num_seqs=8, **config)
    return LLMEngine.from_pretrained(model_dir, device="cuda", dtype=dtype, config=config, expert_quant=expert_quant)


def prefill_wrapper(engine):
    """The GPU prefill path (tandem.experts.device_prefill) that every MoE layer's executor is: one."""
    [wrapper] = {id(layer.mlp.executor): layer.mlp.executor for layer in engine.model.model.layers}.values()
    return wrapper


def greedy(engine, prompts, n=NEW_TOKENS):
    logits = {}
    engine.runner.logits_hook = lambda rid, row: logits.setdefault(rid, []).append(row.float().cpu())
    results = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [r.token_ids for r in results], [torch.stack(logits[r.request_id]) for r in results]


# DeepSeek-V3's MLA with 16 heads: the Triton kernel scores them on the latent in a matrix-product tile
ARCHS = {"mixtral": {}, "qwen2_moe": {}, "llama": {}, "deepseek_v3": {},
         "deepseek_v3_16_heads": {"num_attention_heads": 16, "num_key_value_heads": 16}}


@cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_decode_gives_transformers_greedy_tokens(arch, demo_model_dir):
    model_dir = demo_model_dir(arch.removesuffix("_16_heads"), initializer_range=0.2, **ARCHS[arch])
    prompt = prompt_for(1, 11)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, NEW_TOKENS)
    engine = cuda_engine(model_dir, enforce_eager=False)
    [tokens], [logits] = greedy(engine, [prompt])
    assert engine.runner.graphs is not None and engine.runner.graphs.steps == NEW_TOKENS - 1
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-3


@cuda
def test_prefill_experts_streamed_to_the_gpu_give_transformers_greedy_tokens(demo_model_dir):
    # Every prefill chunk of 8+ tokens runs its routed experts on the GPU (tandem.experts.device_prefill).
    model_dir = demo_model_dir("mixtral", initializer_range=0.2)
    prompt = prompt_for(2, 30)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, NEW_TOKENS)
    engine = cuda_engine(model_dir, enforce_eager=False, device_prefill_tokens=8)
    [tokens], [logits] = greedy(engine, [prompt])
    assert prefill_wrapper(engine).calls == len(engine.model.model.layers)  # one per layer, the prefill
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-3


@cuda
@pytest.mark.parametrize("arch, num_seqs", [("mixtral", 3), ("mixtral", 5), ("deepseek_v3", 5)])
def test_graphed_batches_match_eager_ones(arch, num_seqs, demo_model_dir):
    # Lengths around the block size (16): partial, exact and multi-block tables; 3 and 5
    # sequences pad to the captured sizes 4 and 8.
    model_dir = demo_model_dir(arch, initializer_range=0.2)
    prompts = [prompt_for(s, n) for s, n in zip(range(num_seqs), (5, 16, 17, 31, 40))]
    eager = cuda_engine(model_dir, enforce_eager=True)
    graphed = cuda_engine(model_dir, enforce_eager=False)
    ref_tokens, ref_logits = greedy(eager, prompts)
    tokens, logits = greedy(graphed, prompts)
    assert eager.runner.graphs is None
    assert graphed.runner.graphs.steps >= NEW_TOKENS - 1
    assert graphed.runner.graphs.captured_sizes[-1] >= num_seqs
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert (a - b).abs().max().item() <= 1e-4
    # Both caches started as zeros and took the same blocks: padding rows wrote nowhere.
    for name, ref in eager.cache.tiers[DEVICE].items():
        torch.testing.assert_close(graphed.cache.tiers[DEVICE][name], ref, atol=1e-4, rtol=0)


@cuda
def test_graphed_bfloat16_tracks_eager(demo_model_dir):
    model_dir = demo_model_dir("qwen3_moe", initializer_range=0.2)
    prompts = [prompt_for(7, 9), prompt_for(8, 20)]
    ref_tokens, ref_logits = greedy(cuda_engine(model_dir, enforce_eager=True, dtype="bfloat16"), prompts)
    tokens, logits = greedy(cuda_engine(model_dir, enforce_eager=False, dtype="bfloat16"), prompts)
    # Same kernels, launched differently: the same numbers.
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert (a - b).abs().max().item() <= 1e-2


@cuda
@pytest.mark.parametrize("stream", [False, True], ids=["returned", "streamed"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphed", "eager"])
def test_multi_step_decode_on_cuda_gives_the_single_step_tokens(enforce_eager, stream, demo_model_dir):
    # Greedy and seeded sampled requests, one cut short by max_tokens inside a run; with graphs,
    # every step of every run replays a graph, the batch shrinking as sequences finish.
    from test_engine import MIXED, prompts, run

    model_dir = demo_model_dir("mixtral", initializer_range=0.2)
    requests = {f"r{i}": (p, params) for i, (p, params) in enumerate(zip(prompts(4), MIXED))}
    want, single_steps = run(cuda_engine(model_dir, enforce_eager=enforce_eager), requests)
    e = cuda_engine(model_dir, enforce_eager=enforce_eager, num_scheduler_steps=4)
    got, steps = run(e, requests, stream)
    assert got == want
    assert len(steps) < len(single_steps) / 2
    sizes = [n for step in steps for batch in step for n in batch.values()]
    assert max(sizes) == (1 if stream else 4)
    if not enforce_eager:
        # every decode step replayed a graph: at least the longest request's steps
        assert e.runner.graphs.steps >= max(len(tokens) for tokens, _, _ in want.values()) - 1
    stats = e.stats()
    assert stats.kv_blocks_used[DEVICE] == 0 and stats.num_running == 0


@cuda
def test_graphed_multi_step_greedy_gives_transformers_tokens(demo_model_dir):
    model_dir = demo_model_dir("qwen2_moe", initializer_range=0.2)
    prompt = prompt_for(3, 14)
    ref_tokens, _ = hf_greedy(model_dir, prompt, NEW_TOKENS)
    engine = cuda_engine(model_dir, enforce_eager=False, num_scheduler_steps=8)
    [result] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert result.token_ids == ref_tokens
    assert engine.runner.graphs.steps == NEW_TOKENS - 1


@cuda
def test_page_locked_prefill_experts_give_transformers_greedy_tokens(demo_model_dir):
    # Experts large enough to page-lock (per layer, float32: gate_up 128 MiB, down 64 MiB; smaller
    # tensors may share pages and are left pageable): the engine locks them by default.
    model_dir = demo_model_dir("mixtral", initializer_range=0.2, hidden_size=512, intermediate_size=4096)
    prompt = prompt_for(4, 40)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, NEW_TOKENS)
    engine = cuda_engine(model_dir, enforce_eager=False, device_prefill_tokens=8)
    streamed = prefill_wrapper(engine)
    assert streamed.pinned
    [tokens], [logits] = greedy(engine, [prompt])
    assert streamed.calls == len(engine.model.model.layers)  # the prefill's experts ran on the GPU
    assert engine.stats().gpu_prefill_expert_calls == streamed.calls
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-3
    # Unlocked, the pages can be locked again (registering a page twice fails).
    streamed.unlock()
    assert not streamed.pinned
    streamed.lock()
    assert streamed.pinned  # unlocked again when the engine goes
    unlocked = cuda_engine(model_dir, enforce_eager=False, device_prefill_tokens=8, page_lock_experts=False)
    assert not prefill_wrapper(unlocked).pinned


@cuda
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_prefill_experts_on_the_gpu_track_the_cpu(quant, demo_model_dir):
    # Copied as stored and dequantized on the GPU: the numbers of the CPU executor, which also
    # dequantizes for a prefill this long (cpu_executor.PREFILL_TOKENS).
    model_dir = demo_model_dir("mixtral", initializer_range=0.2)
    prompt = prompt_for(5, 400)

    gpu = cuda_engine(model_dir, enforce_eager=False, expert_quant=quant, device_prefill_tokens=8)
    [tokens], [logits] = greedy(gpu, [prompt])
    [ref_tokens], [ref_logits] = greedy(cuda_engine(model_dir, enforce_eager=False, expert_quant=quant,
                                                    device_prefill_tokens=0), [prompt])
    assert prefill_wrapper(gpu).calls == len(gpu.model.model.layers)  # the prefill's experts ran on the GPU
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-3


def shm_dir(tmp_path: Path) -> tuple[Path, bool]:
    """A directory on tmpfs (as the pod's emptyDir of medium Memory) when /dev/shm has room, and
    whether it is one: the kernel page-locks a shared file mapping for the GPU on tmpfs only."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 << 30:
        return Path(tempfile.mkdtemp(prefix="tandem-test-", dir=shm)), True
    return tmp_path, False


@cuda
def test_split_prefill_experts_run_on_the_gpu_from_the_weights_the_experts_process_shares(demo_model_dir, tmp_path):
    # A real experts process (`tandem serve --role experts --experts-shm`), its weights in a
    # shared-memory file; the attention engine maps and page-locks them for its prefill on the GPU.
    model_dir = demo_model_dir("mixtral", initializer_range=0.2, hidden_size=512, intermediate_size=4096)
    prompt = prompt_for(4, 140)  # a chunk of at least the serving default's 128 tokens
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, NEW_TOKENS)
    where, tmpfs = shm_dir(tmp_path)
    args = SimpleNamespace(model=str(model_dir), expert_quant="none", experts_gguf=None, dtype="float32",
                           experts_shm=str(where / "weights"))
    proc, client = start_split_experts(args, sorted(os.sched_getaffinity(0)))
    try:
        assert client.last_info.experts_shm_path == args.experts_shm
        opts = ServeOptions(model=str(model_dir), role="attention", experts=client.address, device="cuda",
                            dtype="float32", num_device_blocks=160, max_num_seqs=8)
        engine = load_attention(opts, client)  # as `tandem serve --role attention` loads
        shared = prefill_wrapper(engine)
        assert isinstance(shared, SharedPrefill) and shared.inner is client
        assert shared.shared is not None  # mapped while loading, not in the first request
        [tokens], [logits] = greedy(engine, [prompt])
        assert shared.prefill.calls == len(engine.model.model.layers)  # the prefill's experts ran on the GPU
        assert engine.stats().gpu_prefill_expert_calls == shared.prefill.calls  # tandem_gpu_prefill_expert_calls
        assert shared.prefill.pinned or not tmpfs
        assert tokens == ref_tokens
        assert (logits - ref_logits).abs().max().item() <= 1e-3
        shared.release()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        client.close()
        if tmpfs:
            shutil.rmtree(where, ignore_errors=True)
