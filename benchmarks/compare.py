"""Tandem against HF transformers `generate` and llama.cpp, in one go, on one machine and checkpoint.

    python benchmarks/compare.py [--checkpoint DIR] [--prompt-len 32] [--gen-len 64] [--threads 2]
                                 [--precisions f32,bf16,int8,int4] [--concurrency 1,4,8] [--rounds 1]
                                 [--num-scheduler-steps 1] [--paired-rounds 0] [--interleaved 0]
                                 [--json out.json]

Each system runs in its own process (so one's memory never slows another) on the same
Mixtral-architecture checkpoint (made by make_checkpoint.py when absent: ~1.8 GB f32), at equal
precision: f32 against llama.cpp f32 and transformers f32; bf16 (the checkpoint loaded at bfloat16, what
Mixtral, Qwen and DeepSeek ship) against llama.cpp BF16 and transformers bf16; int8 (experts and dense
layers int8) against Q8_0; int4 (experts int4, dense layers int8) against Q4_0; q4_k_m: llama.cpp's
Q4_K_M file, its routed experts loaded by Tandem too (`--experts-gguf`: Q4_K as int4 with the
file's codes, the Q6_K layers as int8; dense layers int8), so both read the same expert weights.
llama.cpp is llama-cpp-python built from its PyPI sdist (CMAKE_ARGS="-DGGML_NATIVE=ON"); the
GGUF files come from the sdist's own vendor/llama.cpp/convert_hf_to_gguf.py and
`llama_model_quantize`. When llama_cpp is not installed, or the sdist cannot be found, the
llama.cpp rows are skipped with the reason. Tandem runs through `tandem bench`, with
`--num-scheduler-steps N` passed on (multi-step decode: N greedy tokens in one native call, as
`tandem serve --num-scheduler-steps` runs them; default 1, a Python step a token), and with
`--paired-rounds N` Tandem's own roofline share paired in its process (`tandem bench
--paired-rounds`: N decodes, each between two bandwidth reads) beside the one below. With
`--interleaved TURNS`, Tandem and llama.cpp also run in one process, taking turns on the same
prompts (worker_interleaved): on a VM whose memory changes speed from one minute to the next, the
ratio that holds still.

Decode tok/s here is single-stream greedy decode; the roofline is read bandwidth (torch sum over
1 GiB, measured again just before each precision's runs) over the bytes of weights one token reads
in that system's format. The share of a second
roofline, from what torch's BLAS GEMV reads (F.linear over 1 GiB), is printed beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"
SDIST_GLOB = "llama_cpp_python-*.tar.gz"
GGUF_TYPES = {"f32": ("f32", None), "bf16": ("bf16", None), "int8": ("q8_0", None),
              "int4": ("f32", 2), "q4_k_m": ("f32", 15)}  # LLAMA_FTYPE_MOSTLY_Q4_0, _Q4_K_M
LLAMA_NAMES = {"f32": "f32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0", "q4_k_m": "Q4_K_M"}
# (experts, dense) quantization ("gguf": the experts of the llama.cpp file); the dtype the
# checkpoint loads at (None: its own, float32 here)
QUANTS = {"f32": ("none", "none"), "bf16": ("none", "none"), "int8": ("int8", "int8"), "int4": ("int4", "int8"),
          "q4_k_m": ("gguf", "int8")}
DTYPES = {"bf16": "bfloat16"}
HF_PRECISIONS = ("f32", "bf16")  # transformers runs unquantized only


# workers: each runs in a fresh process and prints one JSON line


def worker_hf(ckpt: str, dtype: str, prompt_len: int, gen_len: int, threads: int) -> dict:
    import torch
    import transformers as tf

    torch.set_num_threads(threads)
    model = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    timed(2)  # warm-up
    first, full = timed(1), timed(gen_len)
    return {"prefill_tok_s": prompt_len / first, "decode_tok_s": (gen_len - 1) / (full - first)}


def llama_decoder(gguf: str, prompt_len: int, gen_len: int, threads: int):
    """llama.cpp's model from `gguf`, and run(prompt, n) -> (prefill seconds, seconds of n - 1 decode steps)."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    # llama.cpp's extra CPU buffer types (AMX and weight repacking) crash on this VM for Q8_0 and
    # Q4_0 (a segfault in the first decode), so they are turned off; llama-cpp-python has no
    # argument for it, hence the patched default parameters. RESULTS.md says so.
    defaults = llama_module.llama_cpp.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = without_extra_buffers
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=prompt_len + gen_len + 16, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)

    def run(prompt: list[int], n: int) -> tuple[float, float]:
        # generate() evaluates the prompt and yields a token, then evaluates each token it yielded
        # before sampling the next: n - 1 more tokens are n - 1 decode steps. EOS is not checked.
        llm.reset()
        start = time.perf_counter()
        tokens = llm.generate(prompt, temp=0.0, top_k=1, reset=True)
        next(tokens)
        first = time.perf_counter()
        for _ in range(n - 1):
            next(tokens)
        return first - start, time.perf_counter() - first

    return llm, run


def worker_llama(gguf: str, prompt_len: int, gen_len: int, threads: int) -> dict:
    import numpy as np

    llm, run = llama_decoder(gguf, prompt_len, gen_len, threads)
    prompt = np.random.default_rng(0).integers(3, llm.n_vocab(), prompt_len).tolist()
    run(prompt, 2)  # warm-up
    prefill, decode = run(prompt, gen_len)
    return {"prefill_tok_s": prompt_len / prefill, "decode_tok_s": (gen_len - 1) / decode}


def worker_interleaved(gguf: str, argv_json: str, prompt_len: int, gen_len: int, threads: int,
                       turns: int) -> dict:
    """Tandem and llama.cpp in one process, taking turns: each turn both decode `gen_len` tokens from
    the same fresh prompt, one after the other (the order swapped every turn), so that both meet the
    same memory. A VM's read bandwidth moves by 2x between spells that last seconds to minutes, which
    swamps a comparison of one system's run against the other's a minute later; within a turn (two
    runs of ~1 s) it rarely moves. Each system's threads are idle while the other's run."""
    import numpy as np

    from tandem.bench import measure_read_bandwidth
    from tandem.cli import build_engine, build_parser
    from tandem.engine_bench import run_requests
    from tandem.engine.heap import frozen_heap

    engine = build_engine(build_parser().parse_args(json.loads(argv_json)))
    llm, llama_run = llama_decoder(gguf, prompt_len, gen_len, threads)
    rng = np.random.default_rng(0)

    def tandem(prompt: list[int]) -> float:
        run = run_requests(engine, [prompt], gen_len)
        return len(run["itl"]) / sum(run["itl"])

    def llama(prompt: list[int]) -> float:
        return (gen_len - 1) / llama_run(prompt, gen_len)[1]

    out = []
    with frozen_heap():  # no full collection of the loaded heaps inside a timed decode
        for _ in range(2):  # warm-up
            prompt = rng.integers(3, llm.n_vocab(), prompt_len).tolist()
            tandem(prompt)
            llama(prompt)
        for turn in range(turns):
            prompt = rng.integers(3, llm.n_vocab(), prompt_len).tolist()
            bandwidth = measure_read_bandwidth(threads=threads, statistic="median")
            order = (("tandem", tandem), ("llama_cpp", llama))[:: 1 if turn % 2 == 0 else -1]
            out.append({"read_bandwidth_gb_s": bandwidth, **{name: fn(prompt) for name, fn in order}})
    ratios = [t["tandem"] / t["llama_cpp"] for t in out]
    return {"turns": out, "median_ratio": statistics.median(ratios),
            "turns_at_least_1": sum(r >= 1.0 for r in ratios),
            "tandem_decode_tok_s": statistics.median(t["tandem"] for t in out),
            "llama_cpp_decode_tok_s": statistics.median(t["llama_cpp"] for t in out)}


def run_worker(name: str, *args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# systems


def bench_argv(ckpt: Path, precision: str, args, experts_gguf: Path | None = None) -> list[str]:
    """`tandem bench`'s command line at `precision`; a "gguf" precision takes its experts from `experts_gguf`."""
    quants = QUANTS[precision]
    argv = ["bench", "--model", str(ckpt), "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len), "--concurrency", args.concurrency, "--dense-quant", quants[1],
            "--threads", str(args.threads), "--device", "cpu", "--json",
            "--num-scheduler-steps", str(args.num_scheduler_steps)]
    argv += ["--paired-rounds", str(args.paired_rounds)] if args.paired_rounds else ["--no-bandwidth"]
    if quants[0] == "gguf":
        argv += ["--experts-gguf", str(experts_gguf)]
    else:
        argv += ["--expert-quant", quants[0]]
    if precision in DTYPES:
        argv += ["--dtype", DTYPES[precision]]
    return argv


def tandem_bench(ckpt: Path, precision: str, args, experts_gguf: Path | None = None) -> dict:
    """`tandem bench` at `precision`, in its own process."""
    cmd = [sys.executable, "-m", "tandem.cli", *bench_argv(ckpt, precision, args, experts_gguf)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["tandem bench failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_cpp_skip_reason() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (pip install llama-cpp-python from its sdist)"
    if find_convert_script() is None:
        return f"llama-cpp-python's sdist ({SDIST_GLOB}) not found under {CACHE}/llama or $LLAMA_CPP_SDIST"
    return None


def find_convert_script() -> Path | None:
    """The sdist's vendor/llama.cpp/convert_hf_to_gguf.py, unpacked once into the cache."""
    unpacked = CACHE / "llama" / "src"
    found = sorted(unpacked.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if found:
        return found[-1]
    sdist = os.environ.get("LLAMA_CPP_SDIST") or next(iter(sorted((CACHE / "llama").glob(SDIST_GLOB))), None)
    if not sdist:
        return None
    with tarfile.open(sdist) as tar:
        # the converter, the package it imports (conversion/) and its gguf-py: every Python file
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                   (m.name.endswith(".py") or "/gguf-py/" in m.name or "/conversion/" in m.name)]
        tar.extractall(unpacked, members=members, filter="data")
    found = sorted(unpacked.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


def make_gguf(ckpt: Path, precision: str) -> Path:
    """The checkpoint as GGUF at `precision`: converted by the sdist's script, quantized by llama.cpp."""
    outtype, ftype = GGUF_TYPES[precision]
    base = ckpt / f"tandem-compare-{outtype}.gguf"
    if not base.exists():
        script = find_convert_script()
        env = dict(os.environ, PYTHONPATH=str(script.parent / "gguf-py"))
        subprocess.run([sys.executable, str(script), str(ckpt), "--outtype", outtype, "--outfile", str(base)],
                       check=True, env=env, capture_output=True)
    if ftype is None:
        return base
    out = ckpt / f"tandem-compare-{LLAMA_NAMES[precision]}.gguf"
    if not out.exists():
        result = run_worker("quantize", base, out, ftype)
        if "error" in result:
            raise RuntimeError(f"llama_model_quantize to {LLAMA_NAMES[precision]} failed: {result['error']}")
    return out


def worker_quantize(src: str, dst: str, ftype: int) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise RuntimeError("llama_model_quantize failed")
    return {"path": dst}


def active_bytes(ckpt: Path, precision: str, experts_gguf: Path | None = None) -> float:
    """Bytes of weights one decode token reads in Tandem's layout: experts at `precision`, the
    attention and LM head at f32 (f32), bf16 (bf16) or int8 (int8, int4), the routers at f32 (bf16 in
    a bf16 model)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    h, i, layers, k = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or h // cfg["num_attention_heads"])
    int8, int4 = 1.0 + 4.0 / h, 0.5 + 4.0 / 32  # an f32 scale a row; an fp16 scale and min a group of 32
    if precision == "q4_k_m":  # a layer whose ffn_down_exps is not Q4_K runs int8 (tandem.experts.gguf_experts)
        import gguf

        reader = gguf.GGUFReader(str(experts_gguf))
        down = [t.tensor_type.name for t in reader.tensors if t.name.endswith("ffn_down_exps.weight")]
        experts = sum(k * 3 * h * i * (int4 if t == "Q4_K" else int8) for t in down)
    else:
        per_weight = {"f32": 4.0, "bf16": 2.0, "int8": int8, "int4": int4}[precision]
        experts = layers * k * 3 * h * i * per_weight
    dense_per_weight = {"f32": 4.0, "bf16": 2.0}.get(precision, 1.0 + 4.0 / h)  # int8: an f32 scale a row
    dense = dense_per_weight * (layers * (2 * h * h + 2 * h * kv) + cfg["vocab_size"] * h)
    routers = (2.0 if precision == "bf16" else 4.0) * layers * cfg["num_local_experts"] * h
    return experts + dense + routers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", default="f32,bf16,int8,int4")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--skip", default="", help="comma-separated: hf, llama, tandem")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of each precision's systems, one after another; with more than one, the row is "
                         "the median round and the medians of the rounds' ratios")
    ap.add_argument("--num-scheduler-steps", type=int, default=1, metavar="N",
                    help="Tandem's decode tokens per engine step (tandem bench's flag; default 1)")
    ap.add_argument("--paired-rounds", type=int, default=0, metavar="N",
                    help="tandem bench's: N decodes each between two bandwidth reads in its process, for its "
                         "paired roofline share (default 0: none)")
    ap.add_argument("--interleaved", type=int, default=0, metavar="TURNS",
                    help="after a precision's rounds, Tandem and llama.cpp in one process taking TURNS turns, "
                         "each turn both decoding the same prompt one after the other (see worker_interleaved); "
                         "the median of the turns' ratios (default 0: not run)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.worker:
        fn = {"hf": worker_hf, "llama": worker_llama, "quantize": worker_quantize,
              "interleaved": worker_interleaved}[args.worker]
        strings = 1 if args.worker == "llama" else 2  # the leading string arguments, then integers
        print(json.dumps(fn(*rest[:strings], *map(int, rest[strings:]))))
        return

    sys.path.insert(0, str(HERE))
    from make_checkpoint import make_checkpoint

    from tandem.bench import measure_read_bandwidth

    if not (args.checkpoint / "config.json").exists():
        print(f"making the checkpoint in {args.checkpoint} ...", flush=True)
        make_checkpoint(args.checkpoint)
    skip = set(filter(None, args.skip.split(",")))
    bandwidth = measure_read_bandwidth(threads=args.threads)
    gemv_bandwidth = measure_read_bandwidth(threads=args.threads, method="gemv")
    report = {"checkpoint": str(args.checkpoint), "threads": args.threads, "read_bandwidth_gb_s": bandwidth,
              "gemv_read_bandwidth_gb_s": gemv_bandwidth,
              "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "num_scheduler_steps": args.num_scheduler_steps, "rows": []}
    print(f"read bandwidth {bandwidth:.1f} GB/s (sum), {gemv_bandwidth:.1f} GB/s (GEMV), {args.threads} threads; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    llama_skip = "skipped by --skip" if "llama" in skip else llama_cpp_skip_reason()
    if llama_skip:
        print(f"llama.cpp: {llama_skip}")

    for precision in args.precisions.split(","):
        gguf, gguf_error = None, llama_skip  # llama.cpp's file at this precision
        if not llama_skip:
            try:
                gguf = make_gguf(args.checkpoint, precision)
            except (subprocess.CalledProcessError, RuntimeError) as e:
                gguf_error = str(e)
        if QUANTS[precision][0] == "gguf" and gguf is None:  # Tandem reads its experts from that file
            print(f"[{precision}] skipped: no {LLAMA_NAMES[precision]} file ({gguf_error})", flush=True)
            continue
        rounds = [measure_round(args, precision, gguf, gguf_error, llama_skip, skip, gemv_bandwidth / bandwidth)
                  for _ in range(args.rounds)]
        row = combine_rounds(rounds)
        report["rows"].append(row)
        print(format_row(row), flush=True)
        if args.interleaved > 0 and gguf is not None and "tandem" not in skip:
            row["interleaved"] = run_worker("interleaved", gguf, json.dumps(bench_argv(args.checkpoint, precision,
                                                                                        args, gguf)),
                                            args.prompt_len, args.gen_len, args.threads, args.interleaved)
            print(format_interleaved(precision, row["interleaved"]), flush=True)
    report["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def measure_round(args, precision: str, gguf: Path | None, gguf_error: str | None, llama_skip: str | None,
                  skip: set, gemv_factor: float) -> dict:
    """One round of a precision's row: the read bandwidth, then each system once, one after another."""
    from tandem.bench import measure_read_bandwidth

    # measured again next to this round's runs: on a VM it drifts by 10-20% over minutes
    row_bandwidth = measure_read_bandwidth(threads=args.threads)
    roofline = row_bandwidth * 1e9 / active_bytes(args.checkpoint, precision, gguf)
    row = {"precision": precision, "read_bandwidth_gb_s": row_bandwidth, "roofline_tok_s": roofline,
           "gemv_roofline_tok_s": roofline * gemv_factor}
    if "tandem" not in skip:
        row["tandem"] = tandem_bench(args.checkpoint, precision, args, gguf)
    if precision in HF_PRECISIONS and "hf" not in skip:
        row["transformers"] = run_worker("hf", args.checkpoint, DTYPES.get(precision, "float32"),
                                         args.prompt_len, args.gen_len, args.threads)
    if gguf is not None:
        row["llama_cpp"] = run_worker("llama", gguf, args.prompt_len, args.gen_len, args.threads)
        row["llama_cpp"]["format"] = LLAMA_NAMES[precision]
    elif not llama_skip:
        row["llama_cpp"] = {"error": gguf_error}
    return row


def decode(result: dict | None) -> float | None:
    return result.get("decode_tok_s") if result else None


def combine_rounds(rounds: list[dict]) -> dict:
    """One row from a precision's rounds: the round with the median Tandem decode, and, with more
    than one round, each round's ratios (Tandem over llama.cpp, over transformers, over the roofline)
    and their medians: a VM's bandwidth moves between rounds, so ratios within a round are what
    compare."""
    if len(rounds) == 1:
        return rounds[0]
    ordered = sorted(rounds, key=lambda r: decode(r.get("tandem")) or 0.0)
    row = dict(ordered[(len(ordered) - 1) // 2])
    ratios: dict[str, list[float]] = {"llama.cpp": [], "transformers": [], "roofline": []}
    for r in rounds:
        t = decode(r.get("tandem"))
        if t is None:
            continue
        for name, other in (("llama.cpp", decode(r.get("llama_cpp"))), ("transformers", decode(r.get("transformers"))),
                            ("roofline", r["roofline_tok_s"])):
            if other:
                ratios[name].append(t / other)
        if "roofline_share_paired" in r["tandem"]:
            ratios.setdefault("paired roofline", []).append(r["tandem"]["roofline_share_paired"])
    row["round_ratios"] = {k: v for k, v in ratios.items() if v}
    row["median_ratios"] = {k: statistics.median(v) for k, v in row["round_ratios"].items()}
    row["rounds"] = [{"read_bandwidth_gb_s": r["read_bandwidth_gb_s"], "tandem": decode(r.get("tandem")),
                      "llama_cpp": decode(r.get("llama_cpp")), "transformers": decode(r.get("transformers"))}
                     for r in rounds]
    return row


def format_row(row: dict) -> str:
    def tok_s(r):
        return f"{r['decode_tok_s']:.1f}" if r and "decode_tok_s" in r else (r or {}).get("error", "-")

    t, hf, ll = row.get("tandem"), row.get("transformers"), row.get("llama_cpp")
    parts = [f"[{row['precision']}] roofline {row['roofline_tok_s']:.1f} tok/s "
             f"({row['read_bandwidth_gb_s']:.1f} GB/s just before)",
             f"tandem {tok_s(t)}", f"llama.cpp {tok_s(ll)}", f"transformers {tok_s(hf)}"]
    medians = row.get("median_ratios")
    if medians:  # --rounds > 1: the medians of the rounds' own ratios, then each round's
        parts.append(f"{len(row['rounds'])} rounds' median ratios: " +
                     ", ".join(f"{v:.2f}x {k}" for k, v in medians.items()))
        parts.append("rounds " + "; ".join(f"{r['read_bandwidth_gb_s']:.0f} GB/s {r['tandem'] or 0:.1f}/"
                                           f"{r['llama_cpp'] or 0:.1f}" for r in row["rounds"])
                     + " (bandwidth, tandem/llama.cpp)")
    if t and "decode_tok_s" in t:
        parts.append(f"tandem roofline share {t['decode_tok_s'] / row['roofline_tok_s']:.0%}"
                     f" (GEMV roofline {t['decode_tok_s'] / row['gemv_roofline_tok_s']:.0%})")
        if "roofline_share_paired" in t:
            parts.append(f"paired in its process {t['roofline_share_paired']:.0%}"
                         f" ({t['read_bandwidth_paired_gbs']:.1f} GB/s)")
        for other, name in ((ll, "llama.cpp"), (hf, "transformers")):
            if other and "decode_tok_s" in other:
                parts.append(f"{t['decode_tok_s'] / other['decode_tok_s']:.2f}x {name}")
        agg = t.get("concurrency", {})
        parts.append("aggregate " + ", ".join(f"{c}: {v['aggregate_tok_s']:.1f}" for c, v in agg.items()))
    return " | ".join(parts)


def format_interleaved(precision: str, result: dict) -> str:
    if "error" in result:
        return f"[{precision}] interleaved: {result['error']}"
    turns = result["turns"]
    return (f"[{precision}] interleaved, {len(turns)} turns in one process: median ratio "
            f"{result['median_ratio']:.2f}x llama.cpp ({result['turns_at_least_1']} of {len(turns)} turns >= 1.0x), "
            f"tandem {result['tandem_decode_tok_s']:.1f} / llama.cpp {result['llama_cpp_decode_tok_s']:.1f} tok/s "
            f"(medians) | turns " + "; ".join(f"{t['read_bandwidth_gb_s']:.0f} GB/s {t['tandem']:.1f}/"
                                              f"{t['llama_cpp']:.1f}" for t in turns))


if __name__ == "__main__":
    main()
