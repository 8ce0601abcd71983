"""`tandem` command line: make-demo-model, generate, serve, bench.

Bad input exits with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """Input the user can fix: reported as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    # torch's allocator puts tensors of 2 MiB and more on transparent huge pages when this is set
    # at its first allocation (the weights as they load: tandem.model.huge_pages). Before any torch.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except UsageError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as for every other input error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tandem", description="Hybrid GPU + CPU serving of MoE language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("make-demo-model", help="write a small random-weight checkpoint in Hugging Face format",
                          description="Write a small checkpoint with random weights (transformers' own model "
                                      "class) and a byte-level tokenizer: a model to try Tandem on, no download.")
    demo.add_argument("out_dir", help="directory to write it to")
    demo.add_argument("--arch", default="mixtral", choices=["mixtral", "qwen2_moe", "qwen3_moe", "llama",
                                                            "deepseek_v3"], help="architecture (default mixtral)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    demo.set_defaults(func=cmd_make_demo_model)

    gen = sub.add_parser("generate", help="generate from a prompt, locally or against a server",
                         description="Generate from one prompt: with --model in this process, with --server over "
                                     "gRPC (the engine flags are then the server's own, and refused here).")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint directory (runs the engine in this process)")
    where.add_argument("--server", help="address of a running `tandem serve` (host:port or unix:/path)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--chat", metavar="JSON",
                        help='a conversation, rendered by the checkpoint\'s chat template with the assistant\'s turn '
                             'opened, e.g. \'[{"role": "user", "content": "Hi"}]\'')
    gen.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 samples greedily (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass, in (0, 1] (default 1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="keep tokens at least this share of the likeliest one's probability (default 0: off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="penalize the prompt's and output's tokens, as transformers does (default 1: off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="subtracted from the logits of tokens in the output, in [-2, 2] (default 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="times a token's count in the output, subtracted from its logit, in [-2, 2] (default 0)")
    gen.add_argument("--logprobs", type=int, help="with --json: each token's log-probability and the N likeliest")
    gen.add_argument("--prompt-logprobs", type=int,
                     help="with --json: each prompt token's log-probability (after the first) and the N likeliest")
    gen.add_argument("--seed", type=int, help="seed of this request's sampling (default: unseeded)")
    gen.add_argument("--priority", type=int, default=0,
                     help="with --server: the request's priority under the server's priority scheduling policy, "
                          "lower first (default 0)")
    gen.add_argument("--cache-salt", metavar="SALT",
                     help="with --server: share prefix-cached KV only with requests of the same salt (vLLM's "
                          "cache_salt), e.g. one per tenant")
    gen.add_argument("--n", type=int, default=1,
                     help="completions to generate, each sampled on its own (completion i with seed + i), printed "
                          "one by one labelled by index; with --json, one object a line (default 1)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--truncate-prompt-tokens", type=int, metavar="K",
                     help="keep only the prompt's last K tokens; -1: as many as fit the context")
    gen.add_argument("--include-stop-str-in-output", action="store_true",
                     help="end the text with the stop string that ended it, not before it")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="no end-of-sequence, stop token or stop string before this many tokens (default 0)")
    gen.add_argument("--logit-bias", metavar="TOKEN=BIAS", action="append", default=[],
                     help="add BIAS, in [-100, 100], to the logit of token id TOKEN (repeatable)")
    gen.add_argument("--allowed-token-ids", metavar="IDS", help="sample only these comma-separated token ids")
    gen.add_argument("--bad-word", action="append", default=[],
                     help="a word never to generate, at the start of the text or after a space (repeatable)")
    gen.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                     help="leave special tokens out of the text (default: yes)")
    structured = gen.add_mutually_exclusive_group()  # SamplingParams.structured_outputs: one constraint
    structured.add_argument("--json-schema", metavar="SCHEMA", help="the output is an instance of this JSON schema "
                            "(JSON text, or @FILE)")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", help="the output matches this regular expression (Rust regex syntax)")
    structured.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    structured.add_argument("--grammar", help="the output follows this Lark or GBNF grammar (text, or @FILE)")
    gen.set_defaults(func=cmd_generate, engine_flags=add_engine_args(gen), server_flags=add_client_connection_args(gen))
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    try:
        from tandem.rpc.cli_serve import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    try:
        from tandem.engine_bench import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def add_engine_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags of an engine in this process (generate --model, bench); returns their actions."""
    actions = [
        p.add_argument("--device", choices=["cpu", "cuda"], help="compute device (default: cuda when available)"),
        p.add_argument("--dtype", choices=["float32", "bfloat16"],
                       help="default: the checkpoint's (float16 loads as float32)"),
        p.add_argument("--threads", type=int, help="CPU threads for the experts (default: all cores)"),
        p.add_argument("--expert-quant", choices=["none", "int8", "int4"], default="none",
                       help="weight-only quantization of the routed experts (default none)"),
        p.add_argument("--experts-gguf", metavar="FILE",
                       help="take the routed experts from this llama.cpp GGUF file (Q4_0, Q4_K, Q8_0, ...; its "
                            "types decide their format, so not with --expert-quant), the rest of the model from "
                            "--model"),
        add_dense_quant_arg(p),
        p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)"),
        add_kv_cache_dtype_arg(p),
        p.add_argument("--max-model-len", type=int,
                       help="longest prompt plus generation (default: the model's context, at most 8192)"),
        p.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run every decode step eagerly instead of replaying CUDA graphs"),
        add_page_lock_arg(p),
        p.add_argument("--num-scheduler-steps", type=int, default=1, metavar="N",
                       help="decode tokens per engine step while only decodes run (vLLM's multi-step "
                            "scheduling; default 1)"),
    ]
    return actions


def add_client_connection_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags of a connection to --server: TLS (the server's names, as vLLM's) and an API key; returns their
    actions."""
    from tandem import contract

    tls = p.add_argument_group("TLS, with --server", "any of these connects over TLS")
    return [
        tls.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's CAs"),
        tls.add_argument("--ssl-ca-certs", metavar="PEM", help="trust the server's certificate by these CAs instead"),
        tls.add_argument("--ssl-certfile", metavar="PEM",
                         help="present this client certificate chain (mutual TLS), with --ssl-keyfile"),
        tls.add_argument("--ssl-keyfile", metavar="PEM", help="the client certificate's private key"),
        tls.add_argument("--ssl-server-name", metavar="NAME",
                         help="the name the server's certificate must hold, when --server names it otherwise "
                              "(an IP address, say)"),
        p.add_argument("--api-key", metavar="KEY",
                       help=f"with --server: the key a server started with --api-key wants (default: "
                            f"{contract.API_KEY_ENV}, if set)"),
    ]


def add_page_lock_arg(p: argparse.ArgumentParser) -> argparse.Action:
    return p.add_argument("--no-page-lock-experts", dest="page_lock_experts", action="store_false",
                          help="CUDA: leave the routed experts' host memory pageable; by default it is page-locked, "
                               "so large prefill chunks copy the experts to the GPU at full speed")


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> argparse.Action:
    from tandem import contract

    return p.add_argument(contract.SERVE_FLAGS["kv_cache_dtype"], choices=contract.KV_CACHE_DTYPES, default="auto",
                          help="the KV cache's dtype, both tiers: auto, the model's (default); fp8 (fp8_e4m3), "
                               "float8 e4m3 with the checkpoint's calibrated KV scales or 1.0: half a bfloat16 "
                               "cache's bytes, twice the tokens in the same memory")


def add_dense_quant_arg(p: argparse.ArgumentParser) -> argparse.Action:
    from tandem import contract

    return p.add_argument(contract.DENSE_QUANT_FLAG, choices=contract.DENSE_QUANTS,
                          help="weight-only quantization of the dense layers: attention, dense MLPs, shared experts, "
                               "LM head; routers stay full precision; int8 runs on the CPU, so --device cpu "
                               "(default none)", default="none")


def cmd_make_demo_model(args) -> int:
    from tandem.demo import make_demo_model

    path = make_demo_model(args.out_dir, arch=args.arch, seed=args.seed)
    print(f"wrote a random-weight {args.arch} checkpoint to {path}", file=sys.stderr)
    return 0


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


def parse_chat(text: str) -> list[tuple[str, str]]:
    """--chat's JSON: a non-empty list of {"role": str, "content": str}, as (role, content) pairs."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--chat is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise UsageError('--chat must be a non-empty JSON list of {"role": ..., "content": ...} messages')
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
            raise UsageError(f'--chat: message {i} is not {{"role": string, "content": string}}: {json.dumps(m)}')
    return [(m["role"], m["content"]) for m in messages]


def structured_from_args(args) -> dict | None:
    """The one structured-output constraint given (--json-schema, --json-object, --regex, --choice,
    --grammar) as StructuredOutputs' keyword and value, or None; @FILE arguments read."""
    def text(flag: str, value: str) -> str:
        if not value.startswith("@"):
            return value
        try:
            return Path(value[1:]).read_text()
        except OSError as e:
            raise UsageError(f"{flag}: cannot read {value[1:]}: {e.strerror}") from None

    if args.json_schema is not None:
        return {"json": text("--json-schema", args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": tuple(args.choice)}
    if args.grammar is not None:
        return {"grammar": text("--grammar", args.grammar)}
    return None


def processors_from_args(args) -> dict:
    """The logits processors' and text's settings (--min-tokens, --logit-bias, --allowed-token-ids,
    --bad-word, --include-stop-str-in-output, --skip-special-tokens) as SamplingParams' keywords."""
    bias = {}
    for item in args.logit_bias:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UsageError(f"--logit-bias takes TOKEN=BIAS, e.g. 42=-5.5, got {item!r}") from None
    allowed = None
    if args.allowed_token_ids is not None:
        try:
            allowed = tuple(int(t) for t in args.allowed_token_ids.split(",") if t.strip())
        except ValueError:
            raise UsageError(f"--allowed-token-ids must be comma-separated integers, got "
                             f"{args.allowed_token_ids!r}") from None
    return dict(min_tokens=args.min_tokens, logit_bias=bias or None, allowed_token_ids=allowed,
                bad_words=tuple(args.bad_word), include_stop_str_in_output=args.include_stop_str_in_output,
                skip_special_tokens=args.skip_special_tokens)


def sampling_from_args(args):
    from tandem.engine.sampling_params import InvalidRequest, SamplingParams, StructuredOutputs

    try:
        structured = structured_from_args(args)
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs, seed=args.seed,
                              stop=tuple(args.stop), n=args.n, truncate_prompt_tokens=args.truncate_prompt_tokens,
                              structured_outputs=StructuredOutputs(**structured) if structured else None,
                              **processors_from_args(args))
    except InvalidRequest as e:
        raise UsageError(str(e)) from None


def flags_given(args, actions: list[argparse.Action]) -> list[str]:
    """The flags among `actions` given a value other than their default."""
    return [a.option_strings[0] for a in actions if getattr(args, a.dest) != a.default]


def checked_context(model: str, config) -> int:
    """The engine's context length for `model` under `config` (an EngineConfig), from the
    checkpoint's config.json alone: a checkpoint that cannot load, or a --max-model-len beyond the
    model's context, is a UsageError before anything is loaded or started."""
    from tandem.engine.llm_engine import context_length
    from tandem.model.config import ModelError, load_config

    try:
        return context_length(load_config(model), config)
    except ModelError as exc:
        raise UsageError(f"--model: {exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc).replace("max_model_len", "--max-model-len")) from None


def build_engine(args):
    """An engine from the common flags; bad model directories and values become UsageError."""
    from tandem.engine.llm_engine import EngineConfig, LLMEngine
    from tandem.model.config import ModelError

    try:
        config = EngineConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                              max_model_len=args.max_model_len,
                              enforce_eager=args.enforce_eager, num_scheduler_steps=args.num_scheduler_steps,
                              page_lock_experts=args.page_lock_experts)
        return LLMEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, config=config,
                                         expert_executor=getattr(args, "expert_executor", None),
                                         expert_threads=args.threads, expert_quant=args.expert_quant,
                                         dense_quant=args.dense_quant, experts_gguf=args.experts_gguf)
    except (ModelError, ValueError) as e:
        raise UsageError(str(e)) from None


def cmd_generate(args) -> int:
    params = sampling_from_args(args)
    if args.prompt is not None and not args.prompt:
        raise UsageError("--prompt is empty")
    chat = parse_chat(args.chat) if args.chat is not None else None  # bad JSON is refused before anything loads
    if args.server:
        from tandem.rpc.cli_client import run_remote_generate

        given = flags_given(args, args.engine_flags)
        if given:
            raise UsageError(f"{', '.join(given)}: engine flags, for --model; with --server the server's own "
                             f"settings apply")
        return run_remote_generate(args)
    given = flags_given(args, args.server_flags)
    if given:
        raise UsageError(f"{', '.join(given)}: for --server, a connection to a server")
    if args.cache_salt is not None:
        raise UsageError("--cache-salt: for --server, whose prefix cache other requests share")
    if args.priority:
        raise UsageError("--priority: for --server, whose scheduler orders requests by it; one request here has "
                         "nothing to wait for")
    from tandem.engine.sampling_params import InvalidRequest

    engine = build_engine(args)
    try:
        if chat is not None:
            from tandem.engine.chat import ChatMessage

            prompt = engine.encode_chat([ChatMessage(role, content) for role, content in chat])
        else:
            prompt = parse_prompt_ids(args.prompt_ids) if args.prompt_ids else engine.encode(args.prompt)
        results = engine.generate([prompt], params)
    except InvalidRequest as e:
        raise UsageError(str(e)) from None
    for r in results:
        print_result(args, r.token_ids, r.text if engine.tokenizer else None, r.finish_reason, r.num_prompt_tokens,
                     r.num_cached_tokens, r.logprobs, r.prompt_logprobs, r.index, r.stop_reason)
    if any(r.finish_reason == "error" for r in results):  # the engine logged why
        print("tandem: error: the forward pass failed", file=sys.stderr)
        return 1
    return 0


def print_result(args, token_ids, text, finish_reason, prompt_tokens, cached_tokens, logprobs=None,
                 prompt_logprobs=None, index: int = 0, stop_reason: int | str | None = None) -> None:
    """One completion: logprobs a TokenLogprobs per token, when asked for; prompt_logprobs one per
    prompt token, None for the first; stop_reason the stop token id or string that ended it. With
    --n above 1 it is labelled with its index."""
    if args.json:
        obj = {"index": index} if args.n > 1 else {}
        obj |= {"token_ids": token_ids, "finish_reason": finish_reason, "stop_reason": stop_reason,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
                          "cached_tokens": cached_tokens}}
        if text is not None:
            obj["text"] = text

        def entry(e):
            return e and {"logprob": e.logprob, "rank": e.rank,
                          "top": [{"token_id": t, "logprob": v} for t, v in e.top]}

        if logprobs is not None:
            obj["logprobs"] = [entry(e) for e in logprobs]
        if prompt_logprobs is not None:
            obj["prompt_logprobs"] = [entry(e) for e in prompt_logprobs]
        print(json.dumps(obj))
    else:
        label = f"[{index}] " if args.n > 1 else ""
        print(label + (text if text is not None else " ".join(map(str, token_ids))))


if __name__ == "__main__":
    # main() of tandem.cli, not of __main__: the modules it imports raise tandem.cli's UsageError
    from tandem.cli import main as tandem_main

    sys.exit(tandem_main())
