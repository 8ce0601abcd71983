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


def make_checkpoint(out: Path, layers: int) -> Path:
    import transformers

    if (out / "config.json").is_file():
        return out
    config = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.MixtralForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"wrote {size / 1e9:.1f} GB checkpoint in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    del model
    gc.collect()
    torch.cuda.empty_cache()
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
    model_dir = make_checkpoint(args.model_dir, args.layers)
    bandwidth = measure_read_bandwidth(method="sum")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
              "cpu_read_bandwidth_gbs": bandwidth, "layers": args.layers, "expert_quant": args.expert_quant,
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
