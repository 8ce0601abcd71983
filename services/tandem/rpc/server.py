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
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engine.heap import freeze_heap, thaw_heap
from tandem.metrics import ExpertsMetrics, ServingMetrics
from tandem.rpc import experts_server, inference_server, loading
from tandem.rpc.auth import ApiKeyInterceptor
from tandem.rpc.cpu_attention import CpuAttention, SharedCpuKV, publish_layout, withdraw_layout
from tandem.rpc.engine_loop import EngineLoop
from tandem.rpc.expert_wire import data_socket_path
from tandem.rpc.experts_data import DataPlaneServer
from tandem.rpc.listeners import listen
from tandem.rpc.serve_options import ServeOptions

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
NEVER_MS = 2**31 - 1  # gRPC's "never" for a keepalive time (a C int of milliseconds)


def server_options(opts: ServeOptions) -> tuple:
    """--listen's gRPC server's options. The experts role's one peer, its pod's attention process on a Unix
    socket, needs no connection lifetime: a new connection would reach the same process, and the kernel
    closes the socket of a process that dies, with no ping."""
    return SERVER_OPTIONS if opts.role == "experts" else INFERENCE_OPTIONS + connection_options(opts)


def connection_options(opts: ServeOptions) -> tuple:
    """How long the Inference API's connections live (README "Connections").

    A connection older than --max-connection-age gets GOAWAY (gRPC adds +-10% jitter): its client
    opens a new one for its next calls, through the Service to any replica, so replicas the
    autoscaler adds take a share of the clients already connected. Its calls in flight finish on the
    old one: no grpc.max_connection_age_grace_ms, so a long generation is never cut.

    Keepalive pings close a connection whose client vanished without closing it (its node gone, a
    network partition), cancelling its calls: their KV blocks return within keepalive time plus
    timeout, not when TCP gives up. A client's own keepalive may ping every min_client_ping_interval_s,
    with calls in flight or without, and is not answered GOAWAY too_many_pings."""
    age = (("grpc.max_connection_age_ms", _ms(opts.max_connection_age_s)),) if opts.max_connection_age_s else ()
    return age + (
        ("grpc.keepalive_time_ms", _ms(opts.keepalive_time_s) if opts.keepalive_time_s else NEVER_MS),
        ("grpc.keepalive_timeout_ms", _ms(opts.keepalive_timeout_s)),
        # What grpcio 1.85 waits for a ping's ack: a minute unless set, whatever keepalive_timeout_ms says (an
        # arg of chttp2's internal.h, not of the public headers: check it when upgrading grpcio; the tests do)
        ("grpc.http2.ping_timeout_ms", _ms(opts.keepalive_timeout_s)),
        # A client's keepalive on an idle connection (a pool's) is no abuse: otherwise gRPC allows one ping
        # per two hours without calls. It lets the server ping idle connections too, finding dead ones.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(opts.min_client_ping_interval_s)),
    )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000)) if seconds else 0


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
    server = grpc.aio.server(options=server_options(opts), interceptors=interceptors)
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
    frozen = 0
    try:
        loaded = await _wait_loaded(_load_in_thread(lambda: _load(opts, metrics)), stop)
        if loaded is None:
            log.info("stopped while loading")
            return 0
        # Before health says SERVING: the full collection in it takes ~0.2 s (tandem.engine.heap)
        frozen = freeze_heap()
        log.debug("%d objects of the loaded process frozen out of the garbage collector's walks", frozen)
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
        if frozen:  # what the server froze is the collector's again (an embedding process goes on)
            thaw_heap()
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
