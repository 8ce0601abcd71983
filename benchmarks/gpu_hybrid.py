"""Hybrid serving on a GPU machine: attention, dense layers, router and LM head on the GPU, the
routed experts on that machine's CPU cores. Needs an NVIDIA GPU (the suite never does).

    PYTHONPATH=services python benchmarks/gpu_hybrid.py [--layers 4] [--prompt-len 512]
        [--gen-len 64] [--concurrency 1,4,8] [--expert-quant none] [--multi-step 8] [--rows a,b]
        [--json out.json]

It writes a Mixtral-architecture checkpoint (transformers' own class, random weights, bfloat16;
hidden 4096, 8 experts of intermediate 14336, top-2, as Mixtral-8x7B, with fewer layers: 2.8 GB of
experts a layer) unless one is there, then measures in this one process:

  tandem, CUDA graphs   decode steps replayed from graphs (tandem.engine.cuda_graph); measured
                        first and again after the other tandem rows
  ... multi-step        the same with --num-scheduler-steps N (each run's tokens streamed)
  tandem, eager         the same engine with its graphs set aside (--enforce-eager), single- and
                        multi-step
  tandem, CPU prefill   graphs, with every prefill chunk's experts on the CPU cores instead of
                        streamed to the GPU (tandem.experts.device_prefill)
  ... pageable prefill  graphs, last, with the experts' host memory no longer page-locked (the
                        engine locks it for the prefill copies: EngineConfig.page_lock_experts)
  transformers          `generate` with the whole model in GPU memory: the speed the hybrid would
                        have if the experts fitted on the card, which is what it is for when they
                        do not

and the CPU's read bandwidth (torch `sum` over 1 GiB, all cores), which bounds hybrid decode: one
step reads the distinct experts it routes to from RAM (counted per step) over that bandwidth.
Expert seconds per step (the executor's calls) split the step into CPU and GPU time.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services"))

from tandem.bench import measure_read_bandwidth  # noqa: E402
from tandem.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from tandem.engine_bench import bench, dense_weight_bytes, expert_bytes, instrument  # noqa: E402


MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                   num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                   rope_theta=1e6, tie_word_embeddings=False)
# DeepSeek-V3's attention (MLA: 128 heads on a 512 + 64 latent), dense layer and shared expert;
# 16 routed experts a layer instead of 256 (a layer's experts 1.4 GB, not 22.5), top-8 of them
DEEPSEEK_V3_ATTENTION = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=8, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1, max_position_embeddings=4096,
    tie_word_embeddings=False)
FP8_BLOCK = [128, 128]  # weight_block_size of the fp8 experts (as DeepSeek-V3 ships)


def make_checkpoint(out: Path, layers: int, experts_fp8: bool = False, arch: str = "mixtral", **shape) -> Path:
    """Mixtral-8x7B's shapes (or `shape`'s overrides) with `layers` layers, random weights, bfloat16;
    with `experts_fp8` the routed experts are stored block-scaled fp8 (`write_fp8_experts_checkpoint`).
    `arch` "deepseek_v3": DEEPSEEK_V3_ATTENTION's shapes instead."""
    import transformers

    if (out / "config.json").is_file():
        return out
    config_class, model_class, base = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, MIXTRAL_8X7B),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, DEEPSEEK_V3_ATTENTION)}[arch]
    config = config_class(**{**base, "num_hidden_layers": layers, **shape})
    if experts_fp8:
        if arch != "mixtral":
            raise SystemExit("--experts-fp8 writes Mixtral checkpoints only")
        return write_fp8_experts_checkpoint(config, out)
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device("cuda"):
        model = model_class._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"wrote {size / 1e9:.1f} GB checkpoint in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def write_fp8_experts_checkpoint(config, out: Path) -> Path:
    """A Mixtral checkpoint written tensor by tensor, one shard a layer, never a model in memory: its
    routed experts block-scaled fp8 (`tandem.model.fp8`: e4m3 values, one float32 scale per
    128 x 128 block), everything else bfloat16. Mixtral-8x7B's 32 layers are 47 GB on disk this way,
    and 93 GB once served in bfloat16: more than an 80 GB card holds. Random weights of
    transformers' initializer scale (normal, std initializer_range; norms one)."""
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(0)
    h, i, e, v = config.hidden_size, config.intermediate_size, config.num_local_experts, config.vocab_size
    head_dim = config.head_dim or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    std = config.initializer_range

    def normal(*shape):
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16).cpu()

    def ones():
        return torch.ones(h, dtype=torch.bfloat16)

    def fp8(n, k):  # e4m3 values of std 1, scaled to std initializer_range by their blocks' scales
        values = torch.randn(n, k, generator=g, device=device).to(torch.float8_e4m3fn).cpu()
        blocks = (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
        return values, torch.full(blocks, std, dtype=torch.float32)

    out.mkdir(parents=True, exist_ok=True)
    shards = config.num_hidden_layers + 1
    weight_map, t, size = {}, time.perf_counter(), 0
    for shard in range(shards):
        if shard == config.num_hidden_layers:  # the last shard: embeddings, final norm, head
            tensors = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": ones(),
                       "lm_head.weight": normal(v, h)}
        else:
            prefix = f"model.layers.{shard}"
            attn = f"{prefix}.self_attn"
            tensors = {f"{prefix}.input_layernorm.weight": ones(), f"{prefix}.post_attention_layernorm.weight": ones(),
                       f"{attn}.q_proj.weight": normal(q, h), f"{attn}.k_proj.weight": normal(kv, h),
                       f"{attn}.v_proj.weight": normal(kv, h), f"{attn}.o_proj.weight": normal(h, q),
                       f"{prefix}.block_sparse_moe.gate.weight": normal(e, h)}
            for expert in range(e):
                for proj, shape in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
                    name = f"{prefix}.block_sparse_moe.experts.{expert}.{proj}.weight"
                    tensors[name], tensors[name + "_scale_inv"] = fp8(*shape)
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        size += sum(x.numel() * x.element_size() for x in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=1))
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": FP8_BLOCK}
    config.architectures = ["MixtralForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(out)  # last: the directory counts as written once config.json is there
    print(f"wrote {size / 1e9:.1f} GB checkpoint (experts fp8) in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return out


class ExpertClock:
    """Wraps the expert executor: seconds spent in routed-expert calls."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def forward(self, layer, hidden, topk_ids, topk_weights):
        t = time.perf_counter()
        out = self.inner.forward(layer, hidden, topk_ids, topk_weights)
        self.seconds += time.perf_counter() - t
        return out


def bench_tandem(model_dir: Path, args, bandwidth: float) -> dict:
    t = time.perf_counter()
    config = EngineConfig(max_model_len=args.prompt_len + args.gen_len + 64, max_num_seqs=max(args.concurrency))
    engine = LLMEngine.from_pretrained(model_dir, device="cuda", dtype="bfloat16", config=config,
                                       expert_quant=args.expert_quant)
    load_s = time.perf_counter() - t
    streamed = engine.gpu_prefill  # DevicePrefill (tandem.experts.device_prefill)
    traffic = instrument(engine, expert_bytes(engine))
    clock = ExpertClock(traffic)
    dense = dense_weight_bytes(engine.model)
    for layer in engine.model.model.layers:
        if hasattr(layer.mlp, "executor"):
            layer.mlp.executor = clock
    graphs = engine.runner.graphs
    min_tokens = [e.min_tokens for e in streamed]
    # the engine page-locks the experts' host memory for the prefill copies (page_lock_experts)
    results = {"load_s": load_s, "experts_page_locked": bool(streamed) and all(e.pinned for e in streamed)}
    # (name, graphs, prefill experts on the GPU, decode tokens a scheduled step); the graphed
    # single-step rows on either side of the others, which they are compared with
    rows = [("graphs", graphs, True, 1), ("graphs_multi_step", graphs, True, args.multi_step),
            ("eager", None, True, 1), ("eager_multi_step", None, True, args.multi_step),
            ("graphs_cpu_prefill", graphs, False, 1), ("graphs_again", graphs, True, 1)]
    if results["experts_page_locked"]:
        rows.append(("graphs_pageable_prefill", graphs, True, 1))
    if args.rows:
        rows = [row for row in rows if row[0] in args.rows]
    for name, runner_graphs, gpu_prefill, steps in rows:
        if name == "graphs_pageable_prefill":  # last: the prefill copies from pageable memory
            for e in streamed:
                e.unlock()
        engine.runner.graphs = runner_graphs
        engine.scheduler.config.num_scheduler_steps = steps
        for e, own in zip(streamed, min_tokens):
            e.min_tokens = own if gpu_prefill else 1 << 30
        steps_before = graphs.steps if graphs else 0
        clock.seconds = 0.0
        r = bench(engine, args.prompt_len, args.gen_len, args.concurrency, None, traffic)
        expert_bytes_step = r["weight_bytes_per_step"] - dense
        r["num_scheduler_steps"] = steps
        r["expert_bytes_per_step"] = expert_bytes_step
        r["cpu_roofline_tok_s"] = bandwidth * 1e9 / expert_bytes_step
        r["cpu_roofline_share"] = r["decode_tok_s"] / r["cpu_roofline_tok_s"]
        r["graphed_steps"] = (graphs.steps - steps_before) if graphs else 0
        r["expert_seconds_total"] = clock.seconds
        results[name] = r
    results["captured_sizes"] = graphs.captured_sizes if graphs else []
    del engine, traffic, clock
    gc.collect()
    torch.cuda.empty_cache()
    return results


def bench_transformers(model_dir: Path, args) -> dict:
    import transformers

    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    model.generation_config.eos_token_id = None
    load_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(0)

    def generate(batch: int, new: int) -> float:
        ids = torch.randint(3, model.config.vocab_size, (batch, args.prompt_len), generator=g).cuda()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    generate(1, 4)  # warm-up
    prefill_s = statistics.median(generate(1, 1) for _ in range(3))
    full_s = statistics.median(generate(1, args.gen_len) for _ in range(3))
    out = {"load_s": load_s, "prefill_tok_s": args.prompt_len / prefill_s,
           "decode_tok_s": (args.gen_len - 1) / (full_s - prefill_s), "concurrency": {}}
    for c in args.concurrency:
        out["concurrency"][c] = {"aggregate_tok_s": c * args.gen_len / generate(c, args.gen_len)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem-gpu-mixtral"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--arch", choices=["mixtral", "deepseek_v3"], default="mixtral",
                   help="deepseek_v3: DeepSeek-V3's attention shapes (MLA), 16 routed experts a layer")
    p.add_argument("--experts-fp8", action="store_true",
                   help="write the checkpoint's experts as block-scaled fp8 (served dequantized): with --layers 32, "
                        "Mixtral-8x7B whole, 47 GB on disk and 93 GB served, more than an 80 GB card")
    p.add_argument("--expert-quant", choices=["none", "int8", "int4"], default="none")
    p.add_argument("--multi-step", type=int, default=8, help="num_scheduler_steps of the multi-step rows")
    p.add_argument("--rows", type=lambda v: v.split(","), help="only these tandem rows (names as printed)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    model_dir = make_checkpoint(args.model_dir, args.layers, args.experts_fp8, args.arch)
    bandwidth = measure_read_bandwidth(method="sum")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
              "cpu_read_bandwidth_gbs": bandwidth, "arch": args.arch, "layers": args.layers,
              "experts_fp8": args.experts_fp8, "expert_quant": args.expert_quant,
              "tandem": bench_tandem(model_dir, args, bandwidth)}
    if not args.skip_transformers:
        report["transformers_gpu_only"] = bench_transformers(model_dir, args)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    t, hf = report["tandem"], report.get("transformers_gpu_only")
    print(f"\n{'':24}{'prefill tok/s':>14}{'decode tok/s':>14}{'ITL p50 ms':>12}{'CPU roofline':>14}"
          + "".join(f"{f'agg@{c}':>10}" for c in args.concurrency))
    for name in [k for k in t if isinstance(t[k], dict) and "decode_tok_s" in t[k]]:
        r = t[name]
        print(f"{'tandem ' + name:24}{r['prefill_tok_s']:14.0f}{r['decode_tok_s']:14.1f}{r['itl_p50_s'] * 1e3:12.2f}"
              f"{r['cpu_roofline_share']:14.0%}"
              + "".join(f"{r['concurrency'][c]['aggregate_tok_s']:10.1f}" for c in args.concurrency))
    if hf:
        print(f"{'transformers (all GPU)':24}{hf['prefill_tok_s']:14.0f}{hf['decode_tok_s']:14.1f}{'':12}{'':14}"
              + "".join(f"{hf['concurrency'][c]['aggregate_tok_s']:10.1f}" for c in args.concurrency))
    print(f"CPU bandwidth {bandwidth:.0f} GB/s; loading took {t['load_s']:.1f} s, page-locking included")
    for what, a, b, key in (
            ("graphs / eager decode", "graphs", "eager", "decode_tok_s"),
            ("... again", "graphs_again", "eager", "decode_tok_s"),
            ("multi-step / single-step decode, graphs", "graphs_multi_step", "graphs", "decode_tok_s"),
            ("... against the second graphs row", "graphs_multi_step", "graphs_again", "decode_tok_s"),
            ("multi-step / single-step decode, eager", "eager_multi_step", "eager", "decode_tok_s"),
            ("GPU / CPU prefill experts", "graphs", "graphs_cpu_prefill", "prefill_tok_s"),
            ("page-locked / pageable prefill copies", "graphs_again", "graphs_pageable_prefill", "prefill_tok_s")):
        if a in t and b in t:  # both rows ran (--rows)
            print(f"{what}: {t[a][key] / t[b][key]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
