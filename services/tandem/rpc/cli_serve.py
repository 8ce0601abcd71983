"""`tandem serve`: the flags (named as `tandem.contract.SERVE_FLAGS`, which the operator renders)
and the entry point that runs `tandem.rpc.server.serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from tandem import contract

F = contract.SERVE_FLAGS


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `serve` subcommand to a `tandem` argparse subparsers object."""
    from tandem.cli import add_dense_quant_arg, add_kv_cache_dtype_arg, add_page_lock_arg

    p = subparsers.add_parser(
        "serve", help="serve the gRPC Inference API (or, with --role experts, the Experts API)",
        description="Serve a model over gRPC with health, reflection and Prometheus /metrics.")
    p.add_argument(F["model"], required=True, help="checkpoint directory (Hugging Face format)")
    p.add_argument(F["listen"], default=f"0.0.0.0:{contract.GRPC_PORT}",
                   help="host:port or unix:/path to listen on; port 0 picks a free one "
                        f"(default 0.0.0.0:{contract.GRPC_PORT})")
    p.add_argument(F["metrics_port"], type=int,
                   help="port of the Prometheus /metrics endpoint; 0 picks a free one (default "
                        f"{contract.METRICS_PORT}, or {contract.EXPERTS_METRICS_PORT} for --role experts, "
                        "which shares the pod's network with the attention role)")
    p.add_argument("--metrics-host", metavar="ADDR",
                   help="address the /metrics endpoint listens on, e.g. 127.0.0.1 (default: every address, "
                        "IPv6 and IPv4)")
    p.add_argument(F["role"], choices=contract.ROLES, default="all",
                   help="all: everything in one process (default); attention: all but the routed experts, "
                        "calling --experts; experts: only the routed experts")
    p.add_argument(F["experts"],
                   help=f"address of the experts process, for --role attention (e.g. {contract.EXPERTS_SOCKET})")
    p.add_argument(F["kv_shm"], help="back the CPU KV tier with this shared-memory file (both roles of a split pair)")
    p.add_argument(F["experts_shm"], metavar="PATH",
                   help="--role experts: keep the routed experts' weights in the shared-memory file PATH.bin "
                        "(manifest PATH.json), which a same-host attention process on a GPU maps to run large "
                        "prefill chunks' experts there; a restart whose model, dtype and quantization match maps "
                        "it instead of loading again")
    p.add_argument(F["device"], choices=["cpu", "cuda"], help="compute device (default: cuda when available)")
    p.add_argument(F["dtype"], choices=["float32", "bfloat16"],
                   help="default: the checkpoint's (float16 loads as float32)")
    p.add_argument(F["threads"], type=int, help="CPU threads for the experts (default: all cores)")
    p.add_argument(F["block_size"], type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(F["gpu_memory_fraction"], type=float, default=0.9,
                   help="share of free GPU memory for the device KV tier (default 0.9)")
    p.add_argument(F["cpu_kv_gib"], type=float, default=1.0, help="GiB of CPU-tier KV (default 1)")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--num-device-blocks", type=int,
                   help="KV blocks of the device tier, instead of sizing it from the device's free memory")
    p.add_argument(F["cpu_decode"], action=argparse.BooleanOptionalAction, default=True,
                   help="a sequence the device KV tier cannot hold moves to the CPU tier and keeps decoding "
                        "there, attention on the CPU cores (default); --no-cpu-decode pauses it until the "
                        "device tier has room")
    p.add_argument(F["expert_quant"], choices=contract.EXPERT_QUANTS, default="none",
                   help="weight-only quantization of the routed experts (default none)")
    p.add_argument(F["experts_gguf"], metavar="FILE",
                   help="take the routed experts from this llama.cpp GGUF file (Q4_0, Q4_K, Q8_0, ...; its types "
                        "decide their format, so not with --expert-quant), the rest of the model from --model")
    add_dense_quant_arg(p)
    add_page_lock_arg(p)
    p.add_argument("--max-num-seqs", type=int, default=64, help="largest running batch (default 64)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every decode step eagerly instead of replaying CUDA graphs")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens computed per engine step, prefill chunks included (default 2048)")
    p.add_argument(F["num_scheduler_steps"], type=int, default=1, metavar="N",
                   help="decode tokens per engine step while only decodes run (vLLM's multi-step scheduling): "
                        "the scheduling between forward passes runs once per N tokens; each token is still "
                        "streamed as its step ends, and a run ends early for a new request (default 1)")
    p.add_argument(F["scheduling_policy"], choices=contract.SCHEDULING_POLICIES, default="fcfs",
                   help="which request runs first: fcfs, by arrival (default); priority, by each request's "
                        "priority (GenerateRequest.priority, lower first), then arrival: waiting requests are "
                        "admitted and preempted ones resumed in that order, and the lowest-priority running "
                        "request is preempted when blocks run out (vLLM's policy)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of a prompt's full blocks with later requests that start with the "
                        "same tokens (vLLM's flag; on by default): --no-enable-prefix-caching computes every "
                        "prompt in full, e.g. to measure prefill")
    p.add_argument("--max-model-len", type=int,
                   help="longest prompt plus generation (default: the model's context, at most 8192)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="waiting requests beyond this are refused with RESOURCE_EXHAUSTED (default 1024)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight streams may run after SIGTERM before they are cancelled (default 30)")
    p.add_argument("--expert-timeout", type=float, default=30.0,
                   help="seconds one call to the experts process may take before it counts as down (default 30)")
    p.add_argument(F["spin_us"], type=int, default=0,
                   help="split roles on a Unix socket: wait for the other process polling, yielding the core at "
                        "each poll, for up to this many microseconds before sleeping (a sleeping core is slow to "
                        "wake). Worth it (e.g. 20000) whether the two processes have cores of their own or share "
                        "them; the polling is CPU time, counted against a container's CPU limit (default 0: "
                        "sleep at once)")
    tls = p.add_argument_group("TLS", "TLS on --listen (health and reflection included); /metrics stays plaintext")
    tls.add_argument(F["ssl_certfile"], metavar="PEM",
                     help="serve --listen over TLS with this certificate chain (with --ssl-keyfile); the files are "
                          "read again when they change (a renewed Secret), for new connections")
    tls.add_argument(F["ssl_keyfile"], metavar="PEM", help="the certificate's private key, unencrypted")
    tls.add_argument(F["ssl_ca_certs"], metavar="PEM",
                     help="mutual TLS: clients must present a certificate signed by one of these CAs")
    p.add_argument(F["health_listen"], metavar="ADDR",
                   help="also serve the health service alone, in plaintext, on host:port or unix:/path (e.g. "
                        f"{contract.HEALTH_SOCKET}): for the kubelet's gRPC probes, which speak no TLS")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help=f"calls of the Inference API must carry the metadata 'authorization: Bearer KEY' (vLLM's "
                        f"flag); repeat it to accept several (an old and a new key while clients move over). "
                        f"{contract.API_KEY_ENV}, if set, is one more (a key out of the process's arguments). "
                        f"Health and reflection stay open")
    conn = p.add_argument_group("connections", "the Inference API's connections (--role all, attention)")
    conn.add_argument("--max-connection-age", type=float, default=300.0, metavar="SECONDS",
                      help="after this long (+-10%%) a connection gets GOAWAY and its client opens a new one for its "
                           "next calls, through a Kubernetes Service to any replica, so that replicas added take "
                           "a share of the clients; calls in flight finish on the old one. 0: never (default 300)")
    conn.add_argument("--keepalive-time", type=float, default=20.0, metavar="SECONDS",
                      help="ping each connection this often, to find clients gone without closing it (their calls "
                           "cancelled, their KV blocks freed). 0: never (default 20)")
    conn.add_argument("--keepalive-timeout", type=float, default=10.0, metavar="SECONDS",
                      help="close the connection when a ping is not answered within this (default 10)")
    p.set_defaults(func=run_serve)
    return p


def options_from_args(args):
    """ServeOptions from parsed flags; ValueError names the bad flag."""
    from tandem.rpc.auth import server_keys
    from tandem.rpc.serve_options import ServeOptions

    metrics_port = args.metrics_port
    if metrics_port is None:
        metrics_port = contract.EXPERTS_METRICS_PORT if args.role == "experts" else contract.METRICS_PORT
    return ServeOptions(
        model=args.model, listen=args.listen, metrics_port=metrics_port, metrics_host=args.metrics_host, role=args.role,
        experts=args.experts, kv_shm=args.kv_shm, experts_shm=args.experts_shm, device=args.device, dtype=args.dtype,
        threads=args.threads,
        block_size=args.block_size, gpu_memory_fraction=args.gpu_memory_fraction, cpu_kv_gib=args.cpu_kv_gib,
        kv_cache_dtype=args.kv_cache_dtype,
        num_device_blocks=args.num_device_blocks, cpu_decode=args.cpu_decode,
        expert_quant=args.expert_quant, experts_gguf=args.experts_gguf, dense_quant=args.dense_quant,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_waiting=args.max_waiting, shutdown_grace_s=args.shutdown_grace, expert_timeout_s=args.expert_timeout,
        spin_us=args.spin_us, enforce_eager=args.enforce_eager, page_lock_experts=args.page_lock_experts,
        num_scheduler_steps=args.num_scheduler_steps, scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
        health_listen=args.health_listen, api_keys=server_keys(args.api_key),
        max_connection_age_s=args.max_connection_age, keepalive_time_s=args.keepalive_time,
        keepalive_timeout_s=args.keepalive_timeout)


def run_serve(args) -> int:
    """Runs `tandem serve` until SIGTERM/SIGINT; returns the exit status."""
    import torch

    from tandem.cli import UsageError, checked_context
    from tandem.rpc.loading import engine_config
    from tandem.rpc.server import serve, still_loading

    try:
        opts = options_from_args(args)
        config = engine_config(opts)  # the engine's limits (--max-num-seqs, ...), checked before anything starts
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    checked_context(opts.model, config)  # so is the checkpoint's config, and --max-model-len against it
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this process")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status = asyncio.run(serve(opts))
    if still_loading():
        # Stopped while the model loads: the load's thread may be inside torch's intra-op thread pool, whose
        # teardown at the interpreter's exit then aborts the process (std::terminate, exit 134 for a clean
        # SIGTERM). Everything of the server's is closed by now: leave without that teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status

