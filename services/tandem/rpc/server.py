"""One `tandem serve` process: a grpc.aio server with health, reflection and `/metrics`,
serving `Inference` (roles all, attention) or `Experts` (role experts).

The server listens before the model loads, answering health NOT_SERVING until it is ready,
so Kubernetes probes and clients can tell "loading" from "down". SIGTERM stops admitting,
lets in-flight streams finish for `shutdown_grace_s`, cancels the rest and exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import contract
from tandem.metrics import ExpertsMetrics, ServingMetrics
from tandem.rpc import experts_server, inference_server, loading
from tandem.rpc.addresses import check_address
from tandem.rpc.auth import ApiKeyInterceptor, check_keys
from tandem.rpc.cpu_attention import CpuAttention, SharedCpuKV, publish_layout, withdraw_layout
from tandem.rpc.engine_loop import EngineLoop
from tandem.rpc.expert_wire import data_socket_path
from tandem.rpc.experts_data import DataPlaneServer
from tandem.rpc.listeners import listen
from tandem.rpc.tls import TlsFiles, server_files

log = logging.getLogger("tandem.serve")

MESSAGE_LIMIT = 1 << 30  # expert calls carry [T, H] activations: far above gRPC's 4 MiB default
# gRPC binds with SO_REUSEPORT on Linux, so a second server on a port in use would start and take
# half of its connections: refused instead, as any other server's bind is.
EXCLUSIVE_PORT = (("grpc.so_reuseport", 0),)
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    *EXCLUSIVE_PORT,
)
# The public API takes prompts: 16 MiB holds a million token ids, or several times any context's
# text. A larger request is refused (RESOURCE_EXHAUSTED) before it is read.
REQUEST_LIMIT = 16 << 20
INFERENCE_OPTIONS = (("grpc.max_receive_message_length", REQUEST_LIMIT), *EXCLUSIVE_PORT)


# What only the engine (--role all, attention) reads, by ServeOptions field. --block-size and
# --cpu-kv-gib are not here: the operator renders them for both roles of a pair, and the experts
# role takes the CPU tier's layout from the file the attention role publishes (its dtype and an fp8
# tier's scales too: --kv-cache-dtype is the attention role's).
ENGINE_ONLY_FLAGS = {
    "dense_quant": contract.DENSE_QUANT_FLAG, "gpu_memory_fraction": contract.SERVE_FLAGS["gpu_memory_fraction"],
    "num_device_blocks": "--num-device-blocks", "cpu_decode": contract.SERVE_FLAGS["no_cpu_decode"],
    "page_lock_experts": "--no-page-lock-experts", "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens", "max_model_len": "--max-model-len",
    "max_waiting": "--max-waiting", "expert_timeout_s": "--expert-timeout", "enforce_eager": "--enforce-eager",
    "num_scheduler_steps": contract.SERVE_FLAGS["num_scheduler_steps"],
    "kv_cache_dtype": contract.SERVE_FLAGS["kv_cache_dtype"],
    "scheduling_policy": contract.SERVE_FLAGS["scheduling_policy"],
}


@dataclass
class ServeOptions:
    """`tandem serve`'s settings, checked on construction."""

    model: str
    listen: str = f"0.0.0.0:{contract.GRPC_PORT}"
    metrics_port: int | None = contract.METRICS_PORT  # None: no /metrics endpoint
    metrics_host: str | None = None  # None: every address, IPv6 and IPv4
    role: str = "all"
    experts: str | None = None
    kv_shm: str | None = None
    experts_shm: str | None = None  # --role experts: the weights in this shared-memory file
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    block_size: int = 16
    gpu_memory_fraction: float = 0.9
    cpu_kv_gib: float = 1.0
    kv_cache_dtype: str = "auto"  # the KV cache's dtype, both tiers (tandem.kv.fp8)
    num_device_blocks: int | None = None  # None: sized from the device's memory
    cpu_decode: bool = True
    expert_quant: str = "none"
    experts_gguf: str | None = None  # routed experts from this llama.cpp GGUF file (roles all, experts)
    dense_quant: str = "none"  # the attention side's dense layers (tandem.model.quant_linear)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting: int = 1024
    shutdown_grace_s: float = 30.0
    expert_timeout_s: float = 30.0
    spin_us: int = 0  # data plane: poll the peer this long before sleeping (cores of its own)
    enforce_eager: bool = False  # CUDA: no decode graphs
    page_lock_experts: bool = True  # CUDA: the experts' host memory page-locked for prefill copies
    num_scheduler_steps: int = 1  # decode tokens per engine step while only decodes run
    scheduling_policy: str = "fcfs"  # or "priority": GenerateRequest.priority orders the queues
    ssl_certfile: str | None = None  # TLS on --listen: the certificate chain
    ssl_keyfile: str | None = None  # and its key
    ssl_ca_certs: str | None = None  # mutual TLS: clients present a certificate these CAs signed
    health_listen: str | None = None  # a second, plaintext listener serving only grpc.health.v1
    api_keys: tuple[str, ...] = ()  # calls of the Inference API must carry one (tandem.rpc.auth); () for none

    def __post_init__(self):
        if self.role not in contract.ROLES:
            raise ValueError(f"--role must be one of {', '.join(contract.ROLES)}, got {self.role!r}")
        check_address(self.listen, "--listen")
        if self.role == "attention":
            if not self.experts:
                raise ValueError("--role attention needs --experts ADDR (the experts process)")
            check_address(self.experts, "--experts")
        elif self.experts:
            raise ValueError(f"--experts is only for --role attention, not --role {self.role}")
        if self.expert_quant not in contract.EXPERT_QUANTS:
            raise ValueError(f"--expert-quant must be one of {', '.join(contract.EXPERT_QUANTS)}")
        if self.experts_gguf is not None:
            if self.role == "attention":
                raise ValueError("--experts-gguf is for the process that holds the experts (--role all or experts), "
                                 "not --role attention")
            if self.expert_quant != "none":
                raise ValueError("--experts-gguf and --expert-quant exclude each other: the GGUF file's types "
                                 "decide the experts' format")
            if not Path(self.experts_gguf).is_file():
                raise ValueError(f"--experts-gguf: {self.experts_gguf} is not a file")
        for flag, path in ((contract.SERVE_FLAGS["kv_shm"], self.kv_shm),
                           (contract.SERVE_FLAGS["experts_shm"], self.experts_shm)):
            if path is not None and not path.strip():
                raise ValueError(f"{flag}: an empty path")
        if self.experts_shm and self.role != "experts":
            raise ValueError(f"--experts-shm is for --role experts (the attention process maps the file the experts "
                             f"process names), not --role {self.role}")
        if self.dense_quant not in contract.DENSE_QUANTS:
            raise ValueError(f"--dense-quant must be one of {', '.join(contract.DENSE_QUANTS)}")
        if self.kv_cache_dtype not in contract.KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(contract.KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in contract.SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(contract.SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ValueError(f"--num-device-blocks must be at least 1, got {self.num_device_blocks}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.metrics_host is not None and not self.metrics_host.strip("[] "):
            raise ValueError("--metrics-host: an empty address")
        if not 0 <= self.shutdown_grace_s < math.inf:  # NaN fails too
            raise ValueError(f"--shutdown-grace must be a number of seconds >= 0, got {self.shutdown_grace_s}")
        if not 0 < self.expert_timeout_s < math.inf:
            raise ValueError(f"--expert-timeout must be a number of seconds > 0, got {self.expert_timeout_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if not 0 <= self.spin_us <= 1_000_000:
            raise ValueError(f"--spin-us must be in 0..1000000, got {self.spin_us}")
        self._check_spin()
        self._check_listeners()
        check_keys(self.api_keys)
        if self.api_keys and self.role == "experts":  # its peer, the attention process, sends none
            raise ValueError("--api-key is for the Inference API (--role all or attention), not --role experts")
        if self.role == "experts":
            self._check_experts_role()
        elif self.role == "attention" and self.max_num_batched_tokens > experts_server.MAX_FORWARD_TOKENS:
            raise ValueError(f"--max-num-batched-tokens must be at most {experts_server.MAX_FORWARD_TOKENS} for "
                             f"--role attention (the most one call to the experts carries), "
                             f"got {self.max_num_batched_tokens}")

    def _check_spin(self) -> None:
        """--spin-us polls the data plane, which the split roles open only on a Unix socket."""
        if not self.spin_us:
            return
        if self.role == "all":
            raise ValueError("--spin-us is for the split roles (attention, experts), not --role all")
        flag, address = ("--listen", self.listen) if self.role == "experts" else ("--experts", self.experts)
        if data_socket_path(address) is None:
            raise ValueError(f"--spin-us polls the data plane, which needs a Unix socket: --role {self.role} "
                             f"with {flag} {address}")

    def _check_listeners(self) -> None:
        """--health-listen, and --listen's TLS files."""
        flag = contract.SERVE_FLAGS["health_listen"]
        if self.health_listen is not None:
            check_address(self.health_listen, flag)
            if self.health_listen == self.listen:
                raise ValueError(f"{flag} {self.health_listen}: the address of --listen too")
        files = self.tls_files
        if files is None:
            return
        if self.role == "experts":  # its peer, the attention process in the same pod, dials it in plaintext
            raise ValueError(f"{contract.SERVE_FLAGS['ssl_certfile']} is for the Inference API (--role all or "
                             f"attention), not --role experts")
        files.load()  # a file that cannot serve is a bad flag, found before anything starts

    @property
    def tls_files(self) -> TlsFiles | None:
        return server_files(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)

    def _check_experts_role(self) -> None:
        """The experts role computes on the CPU and runs no engine: a flag it would ignore is an error,
        unless it has its default value (the operator renders some flags for both roles)."""
        if self.device not in (None, "cpu"):
            raise ValueError(f"--device {self.device}: --role experts computes on the CPU")
        defaults = {f.name: f.default for f in fields(self)}
        for name, flag in ENGINE_ONLY_FLAGS.items():
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"{flag} is for the engine of --role all or attention; --role experts "
                                 f"would ignore it")

    @property
    def service(self) -> str:
        return contract.EXPERTS_SERVICE if self.role == "experts" else contract.INFERENCE_SERVICE


class Health:
    """The standard health service: our one service's status (readiness: can it take requests
    now?) and the overall ("") status (liveness: is the process loaded and working?).

    They differ while the attention process waits for its experts peer, or drains after SIGTERM:
    the service is NOT_SERVING, the process SERVING. A liveness probe on "" then leaves the
    process that holds the GPU weights alone while a probe on the service takes it out of
    rotation.

    One servicer answers on every server it is added to: --listen's and --health-listen's report
    the same statuses."""

    def __init__(self, server: grpc.aio.Server, service: str):
        self.servicer = health.aio.HealthServicer()
        self.service = service
        self.add_to(server)

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        """The service's status."""
        await self.servicer.set(self.service, _status(serving))

    async def set_alive(self, alive: bool) -> None:
        """The overall status: SERVING from the end of the load to the exit."""
        await self.servicer.set("", _status(alive))


def _status(serving: bool):
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


LOAD_THREAD = "load-model"


def still_loading() -> bool:
    """Whether a model load is still running (on its daemon thread): serve() returned while loading."""
    return any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate())


def _load_in_thread(fn) -> concurrent.futures.Future:
    # A daemon thread, not asyncio.to_thread: SIGTERM during a long load must not wait for it.
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - reported by serve()
            done.set_exception(exc)

    threading.Thread(target=run, name=LOAD_THREAD, daemon=True).start()
    return done


async def serve(opts: ServeOptions, stop: asyncio.Event | None = None,
                started: asyncio.Future | None = None) -> int:
    """Runs the server until SIGTERM or SIGINT; returns the exit status (0 after a clean shutdown).

    Embedding it (tests): pass `stop` to stop it instead of signals, and `started` to learn
    {"address": bound address, "metrics_port": port or None, "health_address": --health-listen's
    bound address or None} once it listens.
    """
    loop = asyncio.get_running_loop()
    metrics = ExpertsMetrics() if opts.role == "experts" else ServingMetrics()
    interceptors = [ApiKeyInterceptor(opts.api_keys, opts.service)] if opts.api_keys else []
    server = grpc.aio.server(options=SERVER_OPTIONS if opts.role == "experts" else INFERENCE_OPTIONS,
                             interceptors=interceptors)
    health_state = Health(server, opts.service)
    if opts.role == "experts":
        servicer = experts_server.ExpertsServicer(metrics)
        experts_server.add_to_server(servicer, server)
    else:
        servicer = inference_server.InferenceServicer(metrics)
        inference_server.add_to_server(servicer, server)
    reflection.enable_server_reflection(
        (opts.service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await health_state.set(False)
    await health_state.set_alive(False)
    # The kubelet's gRPC probes speak no TLS: they get the health service alone, in plaintext.
    health_server = grpc.aio.server(options=EXCLUSIVE_PORT) if opts.health_listen else None
    if health_server is not None:
        health_state.add_to(health_server)
    servers = [s for s in (server, health_server) if s is not None]

    try:
        bound = listen(server, health_server, metrics, opts)
    except ValueError as exc:  # found before the server starts, as a bad flag is: exit code 2
        log.error("cannot listen: %s", str(exc))  # str: a record holding exc would hold its frames, server too
        for s in servers:  # bound or not: the usual start-then-stop, not the teardown of one never started
            await s.start()
            await s.stop(grace=0)
        return 2
    for s in servers:
        await s.start()
    log.info("role %s listening on %s", opts.role, bound.describe())
    if started is not None:
        started.set_result({"address": bound.address, "metrics_port": bound.metrics_port,
                            "health_address": bound.health_address})

    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    engine = engine_loop = data_plane = tier_watch = None
    try:
        loaded = await _wait_loaded(_load_in_thread(lambda: _load(opts, metrics)), stop)
        if loaded is None:
            log.info("stopped while loading")
            return 0
        if opts.role == "experts":
            executor, info = loaded
            path = data_socket_path(opts.listen)
            if path is not None:  # the hot path for a same-host attention process
                data_plane = DataPlaneServer(path, servicer, spin_us=opts.spin_us)
                info.data_socket = path
            cpu_kv = SharedCpuKV(opts.kv_shm) if opts.kv_shm else None
            if cpu_kv is not None:
                tier_watch = asyncio.create_task(_release_withdrawn_tier(cpu_kv))
            servicer.attach(executor, info, CpuAttention(cpu_kv) if cpu_kv is not None else None)
            await health_state.set_alive(True)
            await health_state.set(True)
        else:
            engine, reachable, client = loaded
            if opts.kv_shm:  # the experts process maps the CPU tier from this description
                publish_layout(engine.cache, opts.kv_shm)
            engine_loop = _engine_loop(engine, client, metrics, health_state, loop)
            servicer.attach(engine_loop, _model_info(opts, engine))
            # Health first, then the loop: its own changes must land after this one.
            await health_state.set_alive(True)
            await health_state.set(reachable)
            if not reachable:
                engine_loop.mark_experts_down(RuntimeError("experts unreachable at startup"))
            engine_loop.start()
        log.info("model loaded from %s: %s", opts.model, "SERVING" if opts.role == "experts" or reachable
                 else "NOT_SERVING until the experts process answers")
        await stop.wait()
        log.info("shutting down")
        if engine_loop is not None:
            engine_loop.stop_admitting()
        await health_state.set(False)
        if engine_loop is not None:
            await _drain(engine_loop, opts.shutdown_grace_s)
        grace = 5.0
        if opts.role == "experts":
            # Both containers of a pod get SIGTERM at once, and the attention process drains its
            # requests with this process's help: serve on until it has gone, within the grace.
            deadline = time.monotonic() + opts.shutdown_grace_s
            if data_plane is not None:
                await _wait_for_peers(data_plane, deadline)
            grace = max(0.0, deadline - time.monotonic())  # then in-flight gRPC calls get what is left
        await server.stop(grace=grace)
        return 0
    except ValueError as exc:  # ModelError and the engine's limits: one line says what to fix
        log.debug("load failed", exc_info=True)
        log.error("cannot load the model: %s", exc)
        await server.stop(grace=0)
        return 1
    except Exception:
        log.exception("tandem serve failed")
        await server.stop(grace=0)
        return 1
    finally:
        if tier_watch is not None:
            tier_watch.cancel()
        if engine_loop is not None:
            engine_loop.stop(timeout=5.0)
        if engine is not None:  # the CPU KV tier's shared-memory files go with the process that owns them
            if opts.kv_shm:
                withdraw_layout(opts.kv_shm)  # first: an experts process maps nothing more from it
            engine.close()
        if opts.role == "experts":
            servicer.close()
        if data_plane is not None:
            data_plane.close()
        if bound.httpd is not None:
            bound.httpd.close()  # the port is free once serve() returns
        if health_server is not None:  # after the main server: probes see the drain's NOT_SERVING to the end
            await health_server.stop(grace=0)


async def _release_withdrawn_tier(cpu_kv: SharedCpuKV, period_s: float = 1.0) -> None:
    """The experts process lets the CPU KV tier go soon after its attention process ends (withdrawing
    the layout, removing the files): mapped here, the files would keep their memory, and a restarted
    attention process would find the volume's room taken."""
    while True:
        await asyncio.sleep(period_s)
        cpu_kv.release_if_withdrawn()


async def _wait_loaded(load: concurrent.futures.Future, stop: asyncio.Event):
    """The load's result, or None when stop was asked for first; re-raises a failed load."""
    load_task = asyncio.wrap_future(load)
    stop_task = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({load_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if load_task in done:
        stop_task.cancel()
        return load_task.result()
    return None


def _load(opts: ServeOptions, metrics):
    if opts.role == "experts":
        return loading.load_experts(opts)
    if opts.role == "all":
        return loading.load_embedded(opts, metrics), True, None
    client, reachable = loading.connect_experts(opts, metrics)
    return loading.load_attention(opts, client), reachable, client


def _engine_loop(engine, client, metrics, health_state: Health, loop) -> EngineLoop:
    def on_serving_change(serving: bool) -> None:
        asyncio.run_coroutine_threadsafe(health_state.set(serving), loop)

    async def not_alive() -> None:
        await health_state.set(False)
        await health_state.set_alive(False)  # a liveness probe on "" restarts the process

    def probe() -> None:
        # ExpertsUnavailable while the experts are unreachable, and (a subclass) ExpertsMismatch while
        # the process answering serves another model: either way the loop stays down and retries.
        client.info(timeout_s=1.0)
        # The experts process is back (or up for the first time): map the weights it shares before
        # serving again, not in the first request (which tries again if this fails).
        try:
            loading.prepare_shared_prefill(engine)
        except Exception:  # noqa: BLE001 - serving goes on, the prefill's experts on the experts process
            log.exception("could not map the experts process's shared weights")

    return EngineLoop(engine, metrics, on_serving_change=on_serving_change,
                      probe_experts=probe if client is not None else None,
                      on_fatal=lambda exc: asyncio.run_coroutine_threadsafe(not_alive(), loop))


def _model_info(opts: ServeOptions, engine) -> dict:
    dtype = next(engine.model.parameters()).dtype
    return {"model": opts.model, "role": opts.role, "device": str(engine.device),
            "dtype": str(dtype).removeprefix("torch.")}


async def _wait_for_peers(data_plane: DataPlaneServer, deadline: float) -> None:
    """Waits until no attention process is connected to the data plane, or the deadline."""
    if data_plane.num_connections():
        log.info("serving %d attention connection(s) until they close", data_plane.num_connections())
    while data_plane.num_connections() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def _drain(engine_loop: EngineLoop, grace_s: float) -> None:
    """Waits up to grace_s for in-flight requests, then cancels the rest."""
    deadline = time.monotonic() + grace_s
    while engine_loop.in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if engine_loop.in_flight():
        log.info("cancelling %d in-flight requests", engine_loop.in_flight())
        engine_loop.cancel_all()
