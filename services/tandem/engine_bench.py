"""`tandem bench`: prefill and decode speed, latency percentiles, throughput per concurrency, and
the share of the memory roofline that decode reaches on this machine.

Roofline: decode streams weights from memory once per step, so its limit is
bytes read per step / read bandwidth. Bytes read per step count the distinct experts the step
touched (measured, per layer) plus every other weight (attention, dense, router, LM head). The
KV cache a step attends to is read too: `roofline_share_with_kv` adds it (the single-stream
decode's mean context, in the cache's dtype), beside the weights-only `roofline_share`. Each
`--concurrency` row has its own bytes a step and share: a batch's tokens touch more experts.

The read bandwidth is measured before the engine loads (best of 5, as STREAM reports it), and
again beside the decode: `--paired-rounds` single-stream decodes, each between two `sum` reads
(the median of 5: the rate a read keeps, as a decode must) taken in the same process seconds
apart, give `roofline_share_paired`, the median of the rounds' shares. A VM's bandwidth moves from
minute to minute (26.8-52.1 GB/s within one session on the development VM), so a share read against
a bandwidth taken at another moment is as much that drift as the decode. Within it the memory
gives ~30 GB/s for a while, then ~55 for seconds at a time, whatever the buffer (benchmarks/RESULTS.md,
round thirty-three), so a round's reads can fall in such a spell: the median over rounds keeps one out.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from tandem.bench import expert_bytes_per_layer, roofline_share
from tandem.engine.heap import freeze_heap, frozen_heap, thaw_heap


class ExpertTraffic:
    """Wraps an expert executor to count the bytes of expert weights each call touches.

    The count is taken when `bytes` is read, not during the timed steps: each call only keeps its ids."""

    def __init__(self, executor, bytes_per_expert: dict[int, int]):
        self.inner, self.bytes_per_expert = executor, bytes_per_expert
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._calls: list[tuple[int, int, int]] = []  # (layer, tokens, bytes) of each call counted

    def forward(self, layer, hidden, topk_ids, topk_weights):
        self.observe(layer, topk_ids, 0.0)
        return self.inner.forward(layer, hidden, topk_ids, topk_weights)

    def observe(self, layer, topk_ids, seconds: float) -> None:
        """Count a call, also one the native decode path made directly (tandem.model.native_decode)."""
        self._pending.append((layer, topk_ids.clone()))

    def _count(self) -> None:
        for layer, ids in self._pending:
            touched = int(torch.unique(ids).numel()) * self.bytes_per_expert.get(layer, 0)
            self._calls.append((layer, ids.shape[0], touched))
        self._pending.clear()

    @property
    def bytes(self) -> int:
        self._count()
        return sum(touched for _, _, touched in self._calls)

    @property
    def calls(self) -> int:
        """Calls so far: a mark for step_bytes."""
        self._count()
        return len(self._calls)

    def step_bytes(self, since: int, tokens: int) -> float | None:
        """Expert bytes a step of `tokens` tokens read: over the calls after the first `since` that
        had that many tokens (a batch's decode steps, its streams one token each), each layer's mean
        bytes a call, summed over the layers. None where no call had that many."""
        self._count()
        by_layer: dict[int, list[int]] = {}
        for layer, n, touched in self._calls[since:]:
            if n == tokens:
                by_layer.setdefault(layer, []).append(touched)
        return sum(statistics.fmean(v) for v in by_layer.values()) if by_layer else None


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


def kv_bytes_per_step(engine, prompt_len: int, gen_len: int) -> float:
    """Bytes of KV cache one single-stream decode step reads, on average over a request of
    prompt_len + gen_len tokens: decode step j (1 .. gen_len - 1) attends to prompt_len + j tokens,
    a sliding window's last `window` of them."""
    steps = range(1, gen_len)
    if not steps:
        return 0.0
    window = engine.model_config.sliding_window
    contexts = [min(prompt_len + j, window) if window else prompt_len + j for j in steps]
    return engine.cache.layout.bytes_per_token() * sum(contexts) / len(contexts)


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
    cfg = engine.model_config
    executors = [layer.mlp.executor for layer in engine.model.model.layers if hasattr(layer.mlp, "executor")]
    if executors and (measured := expert_bytes_per_layer(executors[0])):
        return measured
    elem = next(engine.model.parameters()).element_size()
    return {layer: 3 * cfg.hidden_size * cfg.moe_intermediate_size * elem for layer in cfg.moe_layers}


def run_requests(engine, prompts: list[list[int]], gen_len: int) -> dict:
    """Run prompts concurrently; per request: time to first token and inter-token gaps. The engine
    streams a multi-step decode's tokens as each step ends (LLMEngine.step's emit), as it does for
    the server; an output of several tokens would count its gap once per token, spread evenly over
    them: the gaps add up to the decode time, one gap a token."""
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    last: dict[str, float] = {}
    ttft, itl, generated = [], [], 0

    def record(outputs) -> None:
        nonlocal generated
        now = time.perf_counter()
        for out in outputs:
            if not out.new_token_ids:
                continue
            generated += len(out.new_token_ids)
            if out.request_id not in last:
                ttft.append(now - start)  # a prefill step samples one token
            else:
                itl.extend([(now - last[out.request_id]) / len(out.new_token_ids)] * len(out.new_token_ids))
            last[out.request_id] = now

    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{start}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        record(engine.step(emit=record))
    return {"wall_s": time.perf_counter() - start, "ttft": ttft, "itl": itl, "generated": generated}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def decode_run(engine, prompts: list[list[int]], gen_len: int, traffic: ExpertTraffic | None) -> tuple[dict, float]:
    """run_requests, and the bytes of weights each of its decode steps read: the distinct experts
    the steps touched (without the prefill's) and every other weight."""
    before = traffic.bytes if traffic else 0
    run = run_requests(engine, prompts, gen_len)
    bytes_per_step = dense_weight_bytes(engine.model)
    if traffic is not None:
        # Expert bytes for the decode steps only: subtract the prefill's share (its first step).
        steps = len(run["itl"])
        bytes_per_step += (traffic.bytes - before) / max(1, steps + 1)
    return run, bytes_per_step


def paired_roofline(engine, prompt, gen_len: int, traffic: ExpertTraffic | None, read_bandwidth,
                    rounds: int) -> dict:
    """`rounds` single-stream decodes of prompt(), each between two calls of read_bandwidth() (GB/s):
    each round's roofline share against the mean of its two reads, and the medians."""
    out = []
    for _ in range(rounds):
        before = read_bandwidth()
        run, bytes_per_step = decode_run(engine, prompt(), gen_len, traffic)
        after = read_bandwidth()
        tok_s = len(run["itl"]) / sum(run["itl"])
        bandwidth = (before + after) / 2
        out.append({"read_bandwidth_gbs": [before, after], "decode_tok_s": tok_s,
                    "weight_bytes_per_step": bytes_per_step,
                    "roofline_share": roofline_share(bytes_per_step, tok_s, bandwidth)})
    return {"read_bandwidth_paired_gbs": statistics.median(sum(r["read_bandwidth_gbs"]) / 2 for r in out),
            "roofline_share_paired": statistics.median(r["roofline_share"] for r in out),
            "paired_rounds": out}


def bench(engine, prompt_len: int, gen_len: int, concurrency: list[int], bandwidth: dict | None,
          traffic: ExpertTraffic | None, read_bandwidth=None, paired_rounds: int = 0) -> dict:
    """The report of `tandem bench`. bandwidth: {"sum": GB/s, "gemv": GB/s} measured before, or None;
    read_bandwidth: a call that measures it again (GB/s), for `paired_rounds` (see paired_roofline)."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]

    run_requests(engine, prompts(1), 4)  # warm-up: kernels, allocator, native extension
    if max(concurrency, default=1) > 1:  # and the batched path: prefill chunks of several prompts, wider batches
        run_requests(engine, prompts(max(concurrency)), 4)
    # prefill alone, then single-stream decode with the expert traffic it causes
    t = time.perf_counter()
    run_requests(engine, prompts(1), 1)
    prefill_s = time.perf_counter() - t
    single, bytes_per_step = decode_run(engine, prompts(1), gen_len, traffic)
    decode_steps = len(single["itl"])
    decode_s = sum(single["itl"])
    native = engine.model.native_path  # tandem.model.native_decode: None when the torch layers decode
    graphs = engine.runner.graphs  # tandem.engine.cuda_graph: None off CUDA and with --enforce-eager
    path = "cuda-graphs" if graphs is not None and graphs.steps else "torch"
    result = {
        "prompt_len": prompt_len, "gen_len": gen_len,
        "decode_path": "native" if native is not None and native.steps else path,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": decode_steps / decode_s if decode_s else float("nan"),
        "ttft_s": single["ttft"][0],
        "itl_p50_s": percentile(single["itl"], 50), "itl_p95_s": percentile(single["itl"], 95),
    }
    result["weight_bytes_per_step"] = bytes_per_step
    result["kv_bytes_per_step"] = kv = kv_bytes_per_step(engine, prompt_len, gen_len)
    if bandwidth:  # {"sum": GB/s, "gemv": GB/s}; the roofline is `sum`'s (see tandem.bench)
        result.update(read_bandwidth_gbs=bandwidth["sum"], roofline_tok_s=bandwidth["sum"] * 1e9 / bytes_per_step,
                      roofline_share=roofline_share(bytes_per_step, result["decode_tok_s"], bandwidth["sum"]),
                      roofline_share_with_kv=roofline_share(bytes_per_step + kv, result["decode_tok_s"],
                                                            bandwidth["sum"]),
                      gemv_read_bandwidth_gbs=bandwidth["gemv"],
                      roofline_share_gemv=roofline_share(bytes_per_step, result["decode_tok_s"], bandwidth["gemv"]))
    if read_bandwidth is not None and paired_rounds > 0:
        result.update(paired_roofline(engine, lambda: prompts(1), gen_len, traffic, read_bandwidth, paired_rounds))
    # Each concurrency's decode steps read the distinct experts its streams' tokens touched together
    # (8 streams over 8 experts of which each picks 2 touch ~7 of them a layer, where one stream
    # touches 2): its roofline share is those bytes a step over the step's time, the streams' median
    # inter-token gap, as the single stream's is over its mean.
    result["concurrency"] = {}
    dense = dense_weight_bytes(engine.model)
    for c in concurrency:
        since = traffic.calls if traffic is not None else 0
        run = run_requests(engine, prompts(c), gen_len)
        row = result["concurrency"][c] = {"aggregate_tok_s": run["generated"] / run["wall_s"],
                                          "itl_p50_s": (itl := percentile(run["itl"], 50)),
                                          "itl_p95_s": percentile(run["itl"], 95)}
        if traffic is not None and (experts := traffic.step_bytes(since, c)) is not None:
            row["weight_bytes_per_step"] = dense + experts
            if bandwidth and itl > 0:
                row["roofline_share"] = roofline_share(dense + experts, 1 / itl, bandwidth["sum"])
    return result


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode speed and the memory-roofline share",
                       description="Prefill and decode speed, TTFT and inter-token latency at each concurrency, "
                                   "with this machine's read bandwidth and the roofline share of the decode.")
    p.add_argument("--model", required=True, help="checkpoint directory (Hugging Face format)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens a request (default 128)")
    p.add_argument("--gen-len", type=int, default=64, help="tokens a request generates (default 64)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated stream counts (default 1,4,8)")
    p.add_argument("--mode", choices=["embedded", "split"], default="embedded",
                   help="split: experts in a `serve --role experts` process on cores disjoint from this "
                        "one's, measured against embedded in the same run (see --rounds)")
    split_flags = [
        p.add_argument("--rounds", type=int, default=5,
                       help="--mode split: alternating single-stream decode rounds of embedded and split, the "
                            "ratio is their median (default 5)"),
        p.add_argument("--split-cores", choices=["disjoint", "shared"], default="disjoint",
                       help="--mode split: disjoint cores per process (default; 2 cores split 1 + 1), or both "
                            "processes on every core, taking turns"),
        p.add_argument("--spin-us", type=int, default=20000,
                       help="--mode split: how long each side of the data plane polls for the other, yielding "
                            "its core, before sleeping (default 20000)"),
        p.add_argument("--experts-shm", metavar="PATH",
                       help="--mode split: the experts process shares its weights in this shared-memory file, as "
                            "the operator's pods do, so that on CUDA large prefill chunks' experts run on the GPU"),
    ]
    p.add_argument("--no-bandwidth", action="store_true", help="skip measuring this machine's read bandwidth")
    p.add_argument("--paired-rounds", type=int, default=3,
                   help="single-stream decodes, each between two read-bandwidth measurements in this process, "
                        "for roofline_share_paired (default 3; 0: none)")
    from tandem.cli import add_engine_args

    add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print the report as one line of JSON")
    p.set_defaults(func=cmd_bench, split_flags=split_flags)


def cmd_bench(args) -> int:
    from tandem.cli import UsageError, flags_given

    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise UsageError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if args.prompt_len < 1 or args.gen_len < 2 or args.rounds < 1 or any(c < 1 for c in concurrency):
        raise UsageError("--prompt-len must be >= 1, --gen-len >= 2, --rounds >= 1 and every concurrency >= 1")
    if args.paired_rounds < 0:
        raise UsageError(f"--paired-rounds must be >= 0, got {args.paired_rounds}")
    given = flags_given(args, args.split_flags)
    if args.mode != "split" and given:
        raise UsageError(f"{', '.join(given)}: for --mode split")
    check_context(args)  # before the bandwidth, which takes a while
    bandwidth = None
    if not args.no_bandwidth:
        from tandem.bench import measure_read_bandwidth  # looked up per call: the tests stand in for it

        bandwidth = {m: measure_read_bandwidth(threads=args.threads, method=m) for m in ("sum", "gemv")}
    if args.mode == "split":
        result = bench_split(args, concurrency, bandwidth)
    else:
        result = bench_engine(args, concurrency, bandwidth)
    result["mode"] = args.mode
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def check_context(args) -> None:
    """The model loads (its config) and each request fits its context: --prompt-len + --gen-len."""
    from tandem.cli import UsageError, checked_context
    from tandem.engine.llm_engine import EngineConfig

    limit = checked_context(args.model, EngineConfig(max_model_len=args.max_model_len))
    if args.prompt_len + args.gen_len > limit:
        raise UsageError(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} is more than the "
                         f"{limit} tokens of the engine's context (--max-model-len)")


def bench_engine(args, concurrency: list[int], bandwidth: dict | None) -> dict:
    """Build the engine from the flags and bench it."""
    from tandem.cli import build_engine

    engine = build_engine(args)
    try:
        with frozen_heap():  # no full collection of the loaded heap inside a timed decode
            return bench_built(engine, args, concurrency, bandwidth, expert_bytes(engine))
    finally:
        del engine
        gc.collect()  # free its weights now, not whenever the collector runs


def bench_built(engine, args, concurrency: list[int], bandwidth: dict | None,
                bytes_per_expert: dict[int, int]) -> dict:
    """`bench` an engine already built, counting its expert traffic at `bytes_per_expert`."""
    from tandem.bench import measure_read_bandwidth  # looked up per call: the tests stand in for it

    traffic = instrument(engine, bytes_per_expert)
    read = None if bandwidth is None else lambda: measure_read_bandwidth(threads=args.threads, statistic="median")
    return bench(engine, args.prompt_len, args.gen_len, concurrency, bandwidth, traffic, read, args.paired_rounds)


def split_cores(cores: list[int]) -> tuple[list[int], list[int]]:
    """(attention cores, experts cores), disjoint: the experts, which read most of the weights,
    get three quarters (at least one each; 2 cores split 1 + 1). One core cannot be split."""
    if len(cores) < 2:
        raise ValueError(f"splitting needs at least 2 cores, this process has {len(cores)}")
    attention = max(1, len(cores) // 4)
    return cores[:attention], cores[attention:]


def pin_process(cores: list[int]) -> None:
    """Pin every thread of this process (torch's pool, gRPC's) to `cores`: sched_setaffinity
    with pid 0 would move only the calling thread."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just exited


def bench_split(args, concurrency: list[int], bandwidth: dict | None) -> dict:
    """Embedded (all cores) against the split pair, both loaded in one run: the per-token ratio
    between them is the cost of the split deployment on this machine.

    Each engine is benched in full first (the split one's report at the top level, embedded's under
    "embedded"). Then `--rounds` rounds decode one fresh prompt on each, taking turns at going
    first, so that load drifting on a noisy machine favours neither: `split_vs_embedded_decode` is
    the median of the rounds' ratios, each round in "rounds".

    Disjoint cores are what Kubernetes' static CPU manager gives the pod's two containers. On
    shared cores the processes take turns: attention, the experts of that layer, the next layer's
    attention. Either way both processes run a thread per core of theirs, and each side of the data
    plane waits for the other polling the socket (`--spin-us`), its OpenMP workers parked in the
    wait too (experts/csrc/data_plane.cpp), rather than sleeping: a sleeping core is slow to wake
    (most of all a VM's). The polling threads yield their core at every turn, so on shared cores
    the process whose turn it is gets both."""
    from tandem.cli import UsageError, build_engine

    all_cores = sorted(os.sched_getaffinity(0))
    if args.split_cores == "shared":
        attention_cores = expert_cores = all_cores
    else:
        try:
            attention_cores, expert_cores = split_cores(all_cores)
        except ValueError as exc:
            raise UsageError(f"--mode split: {exc}") from None
    spin_us = args.spin_us
    threads = torch.get_num_threads()  # the embedded engine's executor sets its own; restored below
    embedded_engine = split_engine = experts_proc = None
    try:
        embedded_engine = build_engine(args)
        freeze_heap()  # as bench_engine does; again once the split engine has loaded
        embedded_threads = torch.get_num_threads()  # as its executor set them
        bytes_per_expert = expert_bytes(embedded_engine)
        embedded = bench_built(embedded_engine, args, concurrency, bandwidth, bytes_per_expert)
        experts_proc, args.expert_executor = start_split_experts(args, expert_cores, spin_us)
        run_on(attention_cores, len(attention_cores))
        split_engine = build_engine(args)
        freeze_heap()
        attention_threads = torch.get_num_threads()  # as it runs (the engine could have changed it)
        result = bench_built(split_engine, args, concurrency, bandwidth, bytes_per_expert)
        rounds = decode_rounds({"embedded": (embedded_engine, all_cores, embedded_threads),
                                "split": (split_engine, attention_cores, attention_threads)},
                               args.rounds, args.prompt_len, args.gen_len)
    finally:
        executor, args.expert_executor = args.expert_executor, None
        run_on(all_cores, threads)
        if executor is not None:
            executor.close()  # the experts process serves a connected attention side on past SIGTERM
        if experts_proc is not None:
            experts_proc.terminate()
            experts_proc.wait(timeout=30)
        thaw_heap()
        del embedded_engine, split_engine
        gc.collect()  # free both engines' weights now
    ratios = [r["ratio"] for r in rounds]
    result["cores"] = {"attention": attention_cores, "experts": expert_cores, "split": args.split_cores,
                       "attention_threads": attention_threads, "spin_us": spin_us}
    result["embedded"] = {k: embedded[k] for k in ("prefill_tok_s", "decode_tok_s", "itl_p50_s", "concurrency")}
    result["rounds"] = rounds
    result["split_vs_embedded_decode"] = statistics.median(ratios)
    stolen = [r[f"{side}_steal"] for r in rounds for side in ("embedded", "split") if r[f"{side}_steal"] is not None]
    steal = f"; the hypervisor stole {min(stolen):.0%} to {max(stolen):.0%} of the CPU time" if stolen else ""
    print(f"split ({args.split_cores}): attention on cores {attention_cores}, experts on cores {expert_cores}; decode "
          f"{result['split_vs_embedded_decode']:.2f}x embedded (on all {len(all_cores)} cores), the median of "
          f"{len(rounds)} alternating rounds ({min(ratios):.2f}x to {max(ratios):.2f}x{steal}); full runs: split "
          f"{result['decode_tok_s']:.1f} tok/s, embedded {embedded['decode_tok_s']:.1f} tok/s", file=sys.stderr)
    return result


def decode_rounds(sides: dict[str, tuple], rounds: int, prompt_len: int, gen_len: int) -> list[dict]:
    """`rounds` single-stream greedy decodes of a fresh prompt on each side, {"embedded": (engine,
    cores, threads), "split": (...)}, each on its own cores and threads; the side that goes first
    alternates, so that load drifting during a round favours neither."""
    vocab = sides["embedded"][0].model_config.vocab_size
    g = torch.Generator().manual_seed(1)  # not bench's prompts: those are in the prefix cache
    measured = []
    for r in range(rounds):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        tok_s, steal = {}, {}
        for name in ("embedded", "split") if r % 2 == 0 else ("split", "embedded"):
            engine, cores, threads = sides[name]
            run_on(cores, threads)
            before = psutil.cpu_times()
            itl = run_requests(engine, [prompt], gen_len)["itl"]
            steal[name] = steal_share(before, psutil.cpu_times())
            tok_s[name] = len(itl) / sum(itl)
        measured.append({"embedded_decode_tok_s": tok_s["embedded"], "split_decode_tok_s": tok_s["split"],
                         "ratio": tok_s["split"] / tok_s["embedded"],
                         "embedded_steal": steal["embedded"], "split_steal": steal["split"]})
    return measured


def steal_share(before, after) -> float | None:
    """The share of every CPU's time between two `psutil.cpu_times()` that the hypervisor gave to
    other guests (steal time: this VM's vCPUs were runnable but not running). None where the kernel
    does not count it (not Linux)."""
    if not hasattr(after, "steal"):
        return None
    total = sum(after) - sum(before)
    return (after.steal - before.steal) / total if total > 0 else 0.0


def run_on(cores: list[int], threads: int) -> None:
    """Move this process onto `cores`, with `threads` torch threads."""
    pin_process(cores)
    torch.set_num_threads(threads)


def start_split_experts(args, cores: list[int], spin_us: int = 0):
    """Start `tandem serve --role experts` on a Unix socket, pinned to `cores` with as many expert
    threads, at the bench's expert quantization, both ends of the data plane spinning for up to
    `spin_us`; return (process, gRPC expert executor)."""
    import tempfile

    from tandem.rpc.experts_client import GrpcExpertExecutor

    sock = Path(tempfile.mkdtemp(prefix="tandem-bench-")) / "experts.sock"
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--role", "experts", "--model", args.model,
           "--listen", f"unix:{sock}", "--metrics-port", "0", "--threads", str(len(cores)),
           "--expert-quant", args.expert_quant, "--spin-us", str(spin_us)]
    if args.experts_gguf:
        cmd += ["--experts-gguf", args.experts_gguf]
    if getattr(args, "experts_shm", None):
        cmd += ["--experts-shm", args.experts_shm]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    # taskset pins before Python starts, so every thread the process makes inherits the cores
    # (a preexec_fn is not safe in this process, which runs threads).
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("--mode split pins the experts process with taskset (util-linux), not found")
    proc = subprocess.Popen([taskset, "-c", ",".join(map(str, cores)), *cmd], stdout=subprocess.DEVNULL)
    executor = GrpcExpertExecutor(f"unix:{sock}", spin_us=spin_us)
    deadline = time.monotonic() + 300
    while not _serving(executor, sock):  # it listens before its weights are loaded
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the experts process did not start")
        time.sleep(0.2)
    return proc, executor


def _serving(executor, sock: Path) -> bool:
    from tandem.experts.base import ExpertsUnavailable

    if not sock.exists():
        return False
    try:
        executor.info(timeout_s=2.0)
    except ExpertsUnavailable:
        return False
    return True
