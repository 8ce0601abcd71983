"""`tandem bench`: prefill and decode speed, latency percentiles, throughput per concurrency, and
the share of the memory roofline that decode reaches on this machine.

Roofline: decode streams weights from memory once per step, so its limit is
bytes read per step / read bandwidth. Bytes read per step count the distinct experts the step
touched (measured, per layer) plus every other weight (attention, dense, router, LM head).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


class ExpertTraffic:
    """Wraps an expert executor to count the bytes of expert weights each call touches."""

    def __init__(self, executor, bytes_per_expert: dict[int, int]):
        self.inner, self.bytes_per_expert = executor, bytes_per_expert
        self.bytes = 0

    def forward(self, layer, hidden, topk_ids, topk_weights):
        self.bytes += int(torch.unique(topk_ids).numel()) * self.bytes_per_expert.get(layer, 0)
        return self.inner.forward(layer, hidden, topk_ids, topk_weights)


def dense_weight_bytes(model) -> int:
    """Bytes of the non-expert weights one decode step reads (embedding lookups read a row only),
    int8 dense layers (`--dense-quant int8`) at their quantized size."""
    from tandem.model.quant_linear import dense_nbytes

    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    total += dense_nbytes(model)
    if model.cfg.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total += emb.numel() * emb.element_size()
    return total


def instrument(engine, bytes_per_expert: dict[int, int]) -> ExpertTraffic | None:
    layers = [layer.mlp for layer in engine.model.model.layers if hasattr(layer.mlp, "executor")]
    if not layers:
        return None
    traffic = ExpertTraffic(layers[0].executor, bytes_per_expert)
    for mlp in layers:
        mlp.executor = traffic
    return traffic


def expert_bytes(engine) -> dict[int, int]:
    """Bytes of one routed expert per layer: as the executor stores them (quantized sizes included),
    or, for a remote executor, from the config at the serving dtype."""
    from tandem.bench import expert_bytes_per_layer

    cfg = engine.model_config
    executors = [layer.mlp.executor for layer in engine.model.model.layers if hasattr(layer.mlp, "executor")]
    if executors and (measured := expert_bytes_per_layer(executors[0])):
        return measured
    elem = next(engine.model.parameters()).element_size()
    return {layer: 3 * cfg.hidden_size * cfg.moe_intermediate_size * elem for layer in cfg.moe_layers}


def run_requests(engine, prompts: list[list[int]], gen_len: int) -> dict:
    """Run prompts concurrently; per request: time to first token and inter-token gaps."""
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    last: dict[str, float] = {}
    ttft, itl, generated = [], [], 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{start}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if not out.new_token_ids:
                continue
            generated += len(out.new_token_ids)
            if out.request_id not in last:
                ttft.append(now - start)
            else:
                itl.append(now - last[out.request_id])
            last[out.request_id] = now
    return {"wall_s": time.perf_counter() - start, "ttft": ttft, "itl": itl, "generated": generated}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def bench(engine, prompt_len: int, gen_len: int, concurrency: list[int], bandwidth_gbs: float | None,
          traffic: ExpertTraffic | None) -> dict:
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]

    run_requests(engine, prompts(1), 4)  # warm-up: kernels, allocator, native extension
    # prefill alone, then single-stream decode with the expert traffic it causes
    t = time.perf_counter()
    run_requests(engine, prompts(1), 1)
    prefill_s = time.perf_counter() - t
    before = traffic.bytes if traffic else 0
    single = run_requests(engine, prompts(1), gen_len)
    decode_steps = len(single["itl"])
    decode_s = sum(single["itl"])
    result = {
        "prompt_len": prompt_len, "gen_len": gen_len,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": decode_steps / decode_s if decode_s else float("nan"),
        "ttft_s": single["ttft"][0],
        "itl_p50_s": percentile(single["itl"], 50), "itl_p95_s": percentile(single["itl"], 95),
    }
    if traffic is not None:
        # Expert bytes for the decode steps only: subtract the prefill's share (its first step).
        expert_bytes = (traffic.bytes - before) * decode_steps / max(1, decode_steps + 1)
        bytes_per_step = expert_bytes / max(1, decode_steps) + dense_weight_bytes(engine.model)
    else:
        bytes_per_step = dense_weight_bytes(engine.model)
    result["weight_bytes_per_step"] = bytes_per_step
    if bandwidth_gbs:
        from tandem.bench import roofline_share

        result.update(read_bandwidth_gbs=bandwidth_gbs, roofline_tok_s=bandwidth_gbs * 1e9 / bytes_per_step,
                      roofline_share=roofline_share(bytes_per_step, result["decode_tok_s"], bandwidth_gbs))
    result["concurrency"] = {}
    for c in concurrency:
        run = run_requests(engine, prompts(c), gen_len)
        result["concurrency"][c] = {"aggregate_tok_s": run["generated"] / run["wall_s"],
                                    "itl_p50_s": percentile(run["itl"], 50), "itl_p95_s": percentile(run["itl"], 95)}
    return result


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode speed and the memory-roofline share")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated stream counts")
    p.add_argument("--mode", choices=["embedded", "split"], default="embedded")
    p.add_argument("--no-bandwidth", action="store_true", help="skip measuring this machine's read bandwidth")
    from tandem.cli import add_engine_args

    add_engine_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from tandem.cli import UsageError, build_engine

    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise UsageError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if args.prompt_len < 1 or args.gen_len < 2 or any(c < 1 for c in concurrency):
        raise UsageError("--prompt-len must be >= 1, --gen-len >= 2 and every concurrency >= 1")
    bandwidth = None
    if not args.no_bandwidth:
        from tandem.bench import measure_read_bandwidth

        bandwidth = measure_read_bandwidth(threads=args.threads)
    experts_proc = None
    if args.mode == "split":
        experts_proc, executor = start_split_experts(args)
        args.expert_executor = executor
    try:
        engine = build_engine(args)
        traffic = instrument(engine, expert_bytes(engine))
        result = bench(engine, args.prompt_len, args.gen_len, concurrency, bandwidth, traffic)
    finally:
        if experts_proc is not None:
            experts_proc.terminate()
            experts_proc.wait(timeout=30)
    result["mode"] = args.mode
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def start_split_experts(args):
    """Start `tandem serve --role experts` on a Unix socket; return (process, gRPC expert executor)."""
    import tempfile

    from tandem.rpc.experts_client import GrpcExpertExecutor

    sock = Path(tempfile.mkdtemp(prefix="tandem-bench-")) / "experts.sock"
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--role", "experts", "--model", args.model,
           "--listen", f"unix:{sock}", "--metrics-port", "0"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    executor = GrpcExpertExecutor(f"unix:{sock}")
    deadline = time.monotonic() + 300
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the experts process did not start")
        time.sleep(0.2)
    return proc, executor
