"""A sliding-window model frees the KV blocks that fall out of its window as a sequence goes (as vLLM
does): greedy generation of prompts several windows long still equals transformers' `generate`, on the
native decode path and the torch one, on the device tier and the CPU tier, and on CUDA (the Triton
decode kernel, replayed from CUDA graphs or eager; skipped without a GPU), while each sequence holds
about window / block_size blocks rather than its whole length."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import SchedulerConfig
from tandem.kv import attention
from tandem.kv.cache import CPU, DEVICE
from test_parity import hf_greedy, prompt_for
from tier_probe import count_tier_traffic

WINDOW, BS = 8, 4
HELD = WINDOW // BS + 2  # blocks a sequence may hold: its window's, one the window starts inside, one it grows into
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [prompt_for(1, 40), prompt_for(2, 33), prompt_for(3, 21)]


@pytest.fixture(scope="module")
def model_dir(demo_model_dir):
    return demo_model_dir("mixtral", initializer_range=0.2, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(model_dir):
    return [hf_greedy(model_dir, prompt, GREEDY.max_tokens)[0] for prompt in PROMPTS]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["native", "torch", pytest.param("cuda_graphs", marks=cuda),
                        pytest.param("cuda_eager", marks=cuda)])
def path(request, monkeypatch):
    """Which decode path runs: the native decode layer, or torch ops for every attention (paged decode
    attention included: its native kernel reads only the window, torch's gathers every block); on
    CUDA, the Triton decode kernel from CUDA graphs or launched eagerly, and the torch prefill."""
    if request.param == "torch":
        monkeypatch.setattr(attention, "_native_decode", False)
    return request.param


def engine(model_dir, path: str, **config) -> LLMEngine:
    # Chunked prefill (16-token chunks), and no prefix cache: every free block is nobody's (see watch).
    on_cuda = path.startswith("cuda")
    config = EngineConfig(block_size=BS, max_num_batched_tokens=16, max_model_len=128, enable_prefix_caching=False,
                          enforce_eager=path != "cuda_graphs", **config)
    e = LLMEngine.from_pretrained(model_dir, device="cuda" if on_cuda else "cpu", dtype="float32", config=config)
    e.model.native_decode = path == "native"
    assert (e.runner.graphs is not None) == (path == "cuda_graphs")
    return e


def watch(e: LLMEngine) -> list[dict]:
    """Before every step, put NaN in every block no sequence holds, as another request may have left
    there: a block freed a token too early, or a freed block's placeholder read as keys, would make a
    NaN of a token. Returns the list it appends each step's blocks in use to, by tier, and whether a
    CPU-tier table held placeholders."""
    bm, seen, real_step = e.block_manager, [], e.step

    def step(*args, **kwargs):
        for tier, tensors in e.cache.tiers.items():
            free = torch.tensor(bm._pools[tier].free_block_ids(), dtype=torch.long)
            for tensor in tensors.values():  # [layers, blocks, block_size, ...]
                tensor[:, free] = float("nan")
        placeholders_on_cpu = any(None in table for rid, table in bm._tables.items() if bm._tier[rid] == CPU)
        seen.append({DEVICE: bm.num_used_blocks(DEVICE), CPU: bm.num_used_blocks(CPU),
                     "placeholders_on_cpu": placeholders_on_cpu})
        return real_step(*args, **kwargs)

    e.step = step
    return seen


def test_tokens_equal_transformers_while_each_sequence_holds_only_its_window(model_dir, reference, path):
    e = engine(model_dir, path, num_device_blocks=48, num_cpu_blocks=0)
    seen = watch(e)
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == reference
    # Without freeing, the sequences would hold 16 + 15 + 12 blocks by their end.
    assert max(s[DEVICE] for s in seen) <= len(PROMPTS) * HELD
    assert (e.model.native_path is not None) == (path == "native")
    if path == "cuda_graphs":  # every decode step replayed a graph
        assert e.runner.graphs.steps >= GREEDY.max_tokens - 1
    assert e.stats().kv_blocks_used == {DEVICE: 0, CPU: 0}


def test_sequences_decoding_on_the_cpu_tier_free_their_window_there_too(model_dir, reference, path):
    e = engine(model_dir, path, num_device_blocks=5, num_cpu_blocks=64)
    swaps, cpu_tokens = count_tier_traffic(e)
    seen = watch(e)
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == reference
    assert swaps["out"] and cpu_tokens[0], (swaps, cpu_tokens)
    assert any(s["placeholders_on_cpu"] for s in seen)
    assert max(s[CPU] for s in seen) <= len(PROMPTS) * HELD
    assert e.stats().kv_blocks_used == {DEVICE: 0, CPU: 0}


@pytest.mark.parametrize("stream", [False, True], ids=["returned", "streamed"])
def test_multi_step_runs_free_the_window_too(model_dir, reference, stream):
    # A run of 4 decode steps gets the slots of all four at once, and is accounted at its end or,
    # streamed, step by step while it goes on: blocks are freed in the middle of the run.
    e = engine(model_dir, "native", num_device_blocks=48, num_cpu_blocks=0, num_scheduler_steps=4)
    seen = watch(e)
    for i, prompt in enumerate(PROMPTS):
        e.add_request(f"r{i}", prompt, GREEDY)
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    while e.has_unfinished_requests():
        batches = []
        batches.append(e.step(emit=batches.append) if stream else e.step())
        for out in (o for batch in batches for o in batch):
            tokens[out.request_id] += out.new_token_ids
    assert list(tokens.values()) == reference
    assert max(s[DEVICE] for s in seen) <= len(PROMPTS) * HELD
    assert e.model.native_path.greedy_steps > 0
    assert e.stats().kv_blocks_used == {DEVICE: 0, CPU: 0}


def test_a_prefix_the_window_freed_is_still_a_prefix_cache_hit(model_dir, reference):
    e = LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32",
                                  config=EngineConfig(block_size=BS, max_model_len=128))
    [first] = e.generate(PROMPTS[:1], GREEDY)
    [again] = e.generate(PROMPTS[:1], GREEDY)
    assert first.token_ids == again.token_ids == reference[0]
    assert again.num_cached_tokens == 36  # the prompt's 9 full blocks, from block 0 on, freed but cached


# A sequence holds the window's keys and a step's new tokens (here a 16-token prefill chunk): 7
# blocks of 4 at most, against max_model_len's 32. The device tier need only hold that much, and
# the engine sizes it so (7 blocks a sequence) when nothing sets it.
HELD_AT_ONCE = (WINDOW - 1 + 16 + BS - 2) // BS + 1


def test_a_device_tier_of_a_window_serves_sequences_longer_than_it(model_dir, reference):
    e = engine(model_dir, "native", num_device_blocks=HELD_AT_ONCE, num_cpu_blocks=0)
    seen = watch(e)
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == reference  # 64, 57 and 45 tokens in 28
    assert max(s[DEVICE] for s in seen) <= HELD_AT_ONCE
    assert e.stats().kv_blocks_used == {DEVICE: 0, CPU: 0}
    with pytest.raises(ValueError, match=rf"holds {BS * (HELD_AT_ONCE - 1)} tokens and the CPU tier 0, fewer than "
                                         rf"the {BS * HELD_AT_ONCE} a sequence holds at once with its sliding window "
                                         r"of 8 \(of max_model_len=128, .*\); lower max_num_batched_tokens"):
        engine(model_dir, "native", num_device_blocks=HELD_AT_ONCE - 1, num_cpu_blocks=0)


def test_the_engine_gives_the_device_tier_what_its_sequences_can_hold(model_dir):
    e = engine(model_dir, "native", max_num_seqs=3, num_cpu_blocks=0)
    assert e.block_manager.num_total_blocks(DEVICE) == 3 * HELD_AT_ONCE
    # Prefill chunks of up to 2,048 tokens (the default) can hold a whole sequence's 128 at once.
    unchunked = LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32",
                                          config=EngineConfig(block_size=BS, max_model_len=128, max_num_seqs=3))
    assert unchunked.block_manager.num_total_blocks(DEVICE) == 3 * 128 // BS


def test_the_blocks_a_sequence_holds_are_counted_as_the_scheduler_frees_them():
    # Before a step at position p, a sequence holds the blocks of p - window + 1 .. p - 1 (Scheduler
    # frees those before) and takes those of the step's new tokens p .. p + step - 1: the most over
    # every p, counted block by block, is what max_blocks_held says (one block more or less fails).
    for window, step, bs, steps in [(8, 16, 4, 1), (8, 1, 4, 1), (4096, 2048, 16, 1), (5, 3, 4, 8), (1, 1, 16, 1)]:
        config = SchedulerConfig(max_model_len=1 << 20, max_num_batched_tokens=step, sliding_window=window,
                                 num_scheduler_steps=steps)
        new = max(step, steps)
        most = max(((p + new - 1) // bs) - (max(p - window + 1, 0) // bs) + 1 for p in range(window, window + 4 * bs))
        assert config.max_blocks_held(bs) == most, (window, step, bs)
    # At most the whole length's blocks, and without a window exactly those.
    assert SchedulerConfig(max_model_len=100, max_num_batched_tokens=64, sliding_window=90).max_blocks_held(16) == 7
    assert SchedulerConfig(max_model_len=100).max_blocks_held(16) == 7
