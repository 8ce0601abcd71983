"""The native CPU decode layer (tandem.model.native_decode): when it serves a step, what the
wrappers around the executor still see, and its input checks. Its numerics against transformers
are in test_parity.py (float32, Mixtral and Qwen3-MoE, with and without a sliding window)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine_bench import ExpertTraffic
from tandem.experts import native
from tandem.rpc.loading import TimedExpertExecutor

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Histogram:
    def __init__(self):
        self.values = []

    def observe(self, value):
        self.values.append(value)


def engine_for(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32", config=EngineConfig(), **kwargs)


def wrap_executors(engine, make):
    wrapped = {}
    for layer in engine.model.model.layers:
        key = id(layer.mlp.executor)
        wrapped.setdefault(key, make(layer.mlp.executor))
        layer.mlp.executor = wrapped[key]
    return next(iter(wrapped.values()))


def test_the_serving_timer_sees_every_native_expert_call(demo_model_dir):
    e = engine_for(demo_model_dir("mixtral"))
    histogram = Histogram()
    wrap_executors(e, lambda inner: TimedExpertExecutor(inner, histogram))
    e.generate([[5, 6, 7, 8]], GREEDY)
    path, layers = e.model.native_path, len(e.model.model.layers)
    assert path is not None and path.steps == GREEDY.max_tokens - 1
    # the prefill called the executor through the wrapper, the decode steps through observe
    assert len(histogram.values) == layers * GREEDY.max_tokens
    assert all(v > 0 for v in histogram.values)


def test_the_bench_counts_the_experts_native_steps_touch(demo_model_dir):
    e = engine_for(demo_model_dir("mixtral"))
    cfg = e.model.cfg
    traffic = wrap_executors(e, lambda inner: ExpertTraffic(inner, {i: 1 for i in range(cfg.num_layers)}))
    e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert e.model.native_path.steps == 1
    # prefill: 4 tokens touch between top_k and num_experts experts per layer; one decode: top_k
    prefill_min = cfg.num_layers * cfg.top_k
    assert prefill_min + cfg.num_layers * cfg.top_k <= traffic.bytes <= cfg.num_layers * (cfg.num_experts + cfg.top_k)


def test_a_patched_executor_forward_is_called_after_the_native_attention(demo_model_dir):
    e = engine_for(demo_model_dir("mixtral"))
    executor = e.model.model.layers[0].mlp.executor
    calls = []
    real = executor.forward
    executor.forward = lambda *args: calls.append(args[0]) or real(*args)
    e.generate([[5, 6, 7]], GREEDY)
    path = e.model.native_path
    assert path.steps == GREEDY.max_tokens - 1 and not path.local_experts
    assert len(calls) == len(e.model.model.layers) * GREEDY.max_tokens


def test_experts_behind_the_executor_give_the_tokens_of_the_torch_path(demo_model_dir):
    # The split deployment's shape: the native call stops at the router and the executor runs the experts.
    model_dir, prompt = demo_model_dir("qwen3_moe", initializer_range=0.2), [3, 9, 4, 7]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("torch", "remote"):
        e = engine_for(model_dir)
        e.model.native_decode = mode != "torch"
        executor = e.model.model.layers[0].mlp.executor
        executor.forward = executor.forward  # an instance attribute: not the executor the native layer can take
        rows = []
        e.runner.logits_hook = lambda rid, row: rows.append(row.clone())
        [out] = e.generate([prompt], params)
        runs[mode] = (out.token_ids, torch.stack(rows))
        if mode == "remote":
            assert e.model.native_path.steps == params.max_tokens - 1 and not e.model.native_path.local_experts
    assert runs["torch"][0] == runs["remote"][0]
    assert (runs["torch"][1] - runs["remote"][1]).abs().max().item() <= 1e-4


def test_int8_dense_layers_take_the_native_path_with_the_torch_paths_numerics(demo_model_dir):
    model_dir = demo_model_dir("mixtral")
    prompt, params = [9, 4, 7, 1, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    logits = {}
    for native in (True, False):
        e = engine_for(model_dir, expert_quant="int8", dense_quant="int8")
        e.model.native_decode = native
        rows = []
        e.runner.logits_hook = lambda rid, row: rows.append(row.clone())
        e.generate([prompt], params)
        logits[native] = torch.stack(rows)
        assert (e.model.native_path is not None) == native
    # the same int8 kernels on both paths; only the glue (norms, RoPE, routing) is new
    assert (logits[True] - logits[False]).abs().max().item() <= 1e-4


def test_decode_layer_rejects_bad_input_and_leaves_the_cache_alone(demo_model_dir):
    e = engine_for(demo_model_dir("mixtral"))
    e.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    layer = e.model.native_path.layers[0].native
    cfg = e.model.cfg
    k_cache = torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    x = torch.randn(1, cfg.hidden_size)
    cos = sin = torch.zeros(1, cfg.head_dim)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="x must be contiguous f32"):
        layer.forward(torch.randn(1, cfg.hidden_size + 1), cos, sin, k_cache, v_cache,
                      torch.zeros(1, dtype=torch.long), tables, lens, 0)
    with pytest.raises(RuntimeError, match="caches must be f32, bf16 or float8_e4m3fn"):
        layer.forward(x, cos, sin, k_cache.half(), v_cache.half(), torch.zeros(1, dtype=torch.long), tables, lens, 0)
    with pytest.raises(RuntimeError, match=r"caches must be f32, bf16 or float8_e4m3fn \(both alike\)"):
        layer.forward(x, cos, sin, k_cache.to(torch.float8_e4m3fn), v_cache, torch.zeros(1, dtype=torch.long), tables,
                      lens, 0)
    before = x.clone()
    with pytest.raises(RuntimeError, match="slot 64 outside the cache"):
        layer.forward(x, cos, sin, k_cache, v_cache, torch.tensor([64]), tables, lens, 0)
    assert torch.equal(x, before) and not k_cache.any() and not v_cache.any()


def test_swapping_layers_after_the_first_step_rebuilds_the_native_layers(demo_model_dir):
    from tandem.model.quant_linear import quantize_dense_

    e = engine_for(demo_model_dir("mixtral"))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    e.generate([[5, 6, 7]], params)
    before = e.model.native_path
    assert before.layers[0].native.q.kind == 0  # float32 projections
    quantize_dense_(e.model, "int8")
    e.generate([[5, 6, 7]], params)
    after = e.model.native_path
    assert after is not before and after.steps == params.max_tokens - 1
    assert after.layers[0].native.q.kind == 2 and after.layers[0].native.q.weight.dtype == torch.int8


def test_one_call_for_all_layers_matches_the_layer_by_layer_calls(demo_model_dir):
    e = engine_for(demo_model_dir("mixtral"))
    e.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    path, cfg = e.model.native_path, e.model.cfg
    assert path.natives is not None  # the experts run in this process: steps take the one call
    kernel = native.load_kernel()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.hidden_size, generator=g)
    cos, sin = torch.randn(2, cfg.head_dim, generator=g), torch.randn(2, cfg.head_dim, generator=g)
    caches = [(torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim))
              for _ in path.layers]
    slots, tables, lens = torch.tensor([3, 17]), torch.tensor([[0], [1]]), torch.tensor([4, 2])
    loop_x, loop_caches = x.clone(), [(k.clone(), v.clone()) for k, v in caches]
    loop_ids = [layer.native.forward(loop_x, cos, sin, k, v, slots, tables, lens, 0)[1]
                for layer, (k, v) in zip(path.layers, loop_caches)]
    out, seconds, ids = kernel.decode_layers(path.natives, x, cos, sin, [k for k, _ in caches], [v for _, v in caches],
                                             slots, tables, lens, 0, path.final_norm, path.final_eps)
    assert torch.equal(x, loop_x)  # the residual stream, updated in place as the loop updates it
    assert torch.equal(out, kernel.rms_norm(loop_x, path.final_norm, path.final_eps))
    assert all(torch.equal(a, b) for a, b in zip(ids, loop_ids)) and len(seconds) == len(path.layers)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(caches, loop_caches))
    assert all(k[0, 3].any() and k[1, 1].any() for k, _ in caches)  # every layer wrote its own cache
    with pytest.raises(RuntimeError, match=f"{len(path.layers)} layers but {len(path.layers) - 1} K"):
        kernel.decode_layers(path.natives, x, cos, sin, [k for k, _ in caches][1:], [v for _, v in caches],
                             slots, tables, lens, 0, path.final_norm, path.final_eps)


@pytest.mark.parametrize("dtype, quant, tied, head_kind", [
    ("float32", ("int4", "int8"), False, native.KIND_INT8),  # int8 dense layers and head, int4 experts
    ("bfloat16", ("none", "none"), False, native.KIND_BF16),  # bf16 throughout
    ("bfloat16", ("int8", "none"), True, native.KIND_BF16),  # the bf16 embedding as the head
])
def test_greedy_runs_give_the_tokens_of_sampling_each_step_in_python(dtype, quant, tied, head_kind, demo_model_dir):
    # A batch of three in runs of up to 4 steps: the native greedy run's embedding lookup, head and
    # argmax pick what the Python sampler picks from the same kernels' logits.
    prompts = [[5, 6, 7], [9, 4, 7, 1, 3], [11]]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    model_dir = demo_model_dir("mixtral", **({"tie_word_embeddings": True} if tied else {}))
    tokens = {}
    for greedy_runs in (True, False):
        e = LLMEngine.from_pretrained(model_dir, device="cpu", dtype=dtype, config=EngineConfig(num_scheduler_steps=4),
                                      expert_quant=quant[0], dense_quant=quant[1])
        if not greedy_runs:
            e.runner.logits_hook = lambda rid, row: None  # something watches the logits: sampled in Python
        tokens[greedy_runs] = [r.token_ids for r in e.generate(prompts, params)]
        path = e.model.native_path
        assert path.head.kind == head_kind and path.steps > 0
        assert path.greedy_steps == (path.steps if greedy_runs else 0)
    assert tokens[True] == tokens[False]


def test_a_batch_with_a_sampled_request_is_sampled_in_python(demo_model_dir):
    model_dir = demo_model_dir("mixtral")
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    e = engine_for(model_dir)
    together = e.generate([[5, 6, 7], [8, 9]], [greedy, sampled])
    assert e.model.native_path.steps == 4 and e.model.native_path.greedy_steps == 0
    alone = engine_for(model_dir)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone.generate([[5, 6, 7], [8, 9]],
                                                                                   [greedy, sampled])]
    [greedy_alone] = alone.generate([[5, 6, 7]], greedy)
    assert alone.model.native_path.greedy_steps == 4 and greedy_alone.token_ids == together[0].token_ids


def test_a_greedy_run_rejects_bad_input_and_leaves_the_cache_alone(demo_model_dir):
    e = engine_for(demo_model_dir("mixtral"))
    e.generate([[5, 6, 7]], GREEDY)
    path, cfg, kernel = e.model.native_path, e.model.cfg, native.load_kernel()
    caches = [(torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim))
              for _ in path.layers]
    rope = e.model.rotary.table(64, torch.device("cpu"))

    tokens = torch.full((1, 1), -1)

    def run(ids, positions):  # one step of one sequence at slot 3 of block 0
        return kernel.decode_greedy(path.natives, path.embed, rope, ids, [k for k, _ in caches],
                                    [v for _, v in caches], positions, torch.tensor([[3]]), torch.tensor([[0]]), 0,
                                    path.final_norm, path.final_eps, path.head, tokens)

    with pytest.raises(RuntimeError, match=f"token {cfg.vocab_size} outside the vocabulary"):
        run(torch.tensor([cfg.vocab_size]), torch.tensor([[3]]))
    with pytest.raises(RuntimeError, match=f"position {rope.shape[1]} outside the RoPE table"):
        run(torch.tensor([5]), torch.tensor([[rope.shape[1]]]))
    with pytest.raises(RuntimeError, match=r"positions and slots must be contiguous int64 \[steps, B\]"):
        run(torch.tensor([5, 6]), torch.tensor([[3]]))
    assert not any(k.any() or v.any() for k, v in caches) and tokens.item() == -1
    # a good step: the argmax of the head over one decode_layers step, its K and V written at slot 3
    seconds, ids = run(torch.tensor([5]), torch.tensor([[3]]))
    x = e.model.model.embed_tokens.weight[5:6].clone()
    cos, sin = rope[:, 3]
    reference = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    hidden, _, ref_ids = kernel.decode_layers(path.natives, x, cos[None], sin[None], [k for k, _ in reference],
                                              [v for _, v in reference], torch.tensor([3]), torch.tensor([[0]]),
                                              torch.tensor([4]), 0, path.final_norm, path.final_eps)
    assert tokens.tolist() == [[e.model.compute_logits(hidden).argmax().item()]]
    assert len(seconds) == len(ids) == 1 and all(torch.equal(a, b) for a, b in zip(ids[0], ref_ids))
    assert all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(caches, reference))
    assert all(k[0, 3].any() for k, _ in caches)
    # a step that fails (its slot outside the cache) after one that did not: the first's token is written
    good, tokens = tokens.item(), torch.full((1, 2), -1)
    with pytest.raises(RuntimeError, match="slot 9999 outside the cache"):
        kernel.decode_greedy(path.natives, path.embed, rope, torch.tensor([5]), [k for k, _ in caches],
                             [v for _, v in caches], torch.tensor([[3], [4]]), torch.tensor([[3], [9999]]),
                             torch.tensor([[0]]), 0, path.final_norm, path.final_eps, path.head, tokens)
    assert tokens.tolist() == [[good, -1]]


def test_the_phase_profile_times_a_greedy_runs_head_and_callback_once_a_step(demo_model_dir):
    e = LLMEngine.from_pretrained(demo_model_dir("mixtral"), device="cpu", dtype="float32",
                                  config=EngineConfig(num_scheduler_steps=4))
    kernel, layers = native.load_kernel(), len(e.model.model.layers)
    e.generate([[5, 6, 7]], GREEDY)  # warm: the native layers are built
    before = e.model.native_path.greedy_steps
    kernel.set_decode_profile(True)
    try:
        e.add_request("profiled", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        streamed = []
        while e.has_unfinished_requests():
            e.step(emit=streamed.extend)  # the streaming callback: decode_greedy's on_step
        profile = kernel.decode_profile()
    finally:
        kernel.set_decode_profile(False)
    steps = e.model.native_path.greedy_steps - before
    assert steps == 4 and len(streamed) == 4  # the greedy steps stream their tokens as each ends
    assert profile["calls"] == steps * layers  # counted by the layers, not by the greedy run's clock
    assert profile["head_argmax"] > 0 and profile["on_step"] > 0 and profile["experts"] > 0
    assert kernel.decode_profile()["head_argmax"] == 0.0  # off: the sums restart
