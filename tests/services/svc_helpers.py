"""Helpers for the services tests: gRPC calls, health waits, `tandem serve` subprocesses."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import contract
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

STARTUP_TIMEOUT_S = 120  # two cores shared with other test runs: importing torch can be slow
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Small KV so each server allocates megabytes, not the default gibibyte.
SMALL_ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--cpu-kv-gib", "0.01"]


def channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A plaintext channel, or with `credentials` a TLS one whose connections are its own: each
    makes a handshake, not sharing another channel's (a certificate rotated since must show)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, credentials, options=[("grpc.use_local_subchannel_pool", 1)])


async def wait_health(address: str, status, service: str = contract.INFERENCE_SERVICE,
                      timeout_s: float = STARTUP_TIMEOUT_S, credentials: grpc.ChannelCredentials | None = None) -> None:
    """Waits (Health.Watch, no polling) until `service` reports `status`: by default the Inference
    service (readiness); "" is the process as a whole (liveness; see tandem.rpc.server.Health).
    Over TLS with `credentials`."""
    async with channel(address, credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=True)
        async for response in call:
            if response.status == status:
                call.cancel()
                return
    raise AssertionError(f"health watch ended before {service or 'server'} reported {status}")


async def eventually(read, expected, timeout_s: float = 10.0):
    """read() once it returns `expected`, or its last value after timeout_s: for what a server
    records just after it answers (its expert-call metrics)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (value := read()) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return value


async def generate(address: str, request: inference_pb2.GenerateRequest, timeout_s: float = 60,
                   credentials: grpc.ChannelCredentials | None = None):
    """All GenerateResponses of one stream (over TLS with `credentials`)."""
    async with channel(address, credentials) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        return [r async for r in stub.Generate(request, timeout=timeout_s)]


def greedy(prompt_ids, max_tokens: int = 8, **sampling) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids,
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling))


def token_ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


class ServeProcess:
    """A real `tandem serve` process. Reads its log on a thread to learn the bound addresses."""

    LISTENING = re.compile(r"listening on (\S+?)(?:;|$)(?:.*metrics on http://\S+:(\d+)/metrics)?")  # host [::] too

    def __init__(self, *args: str, wait: bool = True):
        """Starts `tandem serve *args`; with wait=False, call wait_listening() before using the addresses."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "serve", *args], stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address: str | None = None
        self.metrics_port: int | None = None
        if wait:
            self.wait_listening()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_listening(self) -> "ServeProcess":
        """Blocks until the server logs its bound addresses (it listens before the model loads)."""
        while self.address is None:
            try:
                line = self._queue.get(timeout=STARTUP_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"tandem serve did not start:\n{self.log()}") from None
            if line is None:
                raise RuntimeError(f"tandem serve exited ({self.proc.wait()}):\n{self.log()}")
            if m := self.LISTENING.search(line):
                self.address, self.metrics_port = m[1], int(m[2]) if m[2] else None
        return self

    def wait_for_line(self, pattern: str) -> str:
        """Blocks until a log line (after the listening one) matches `pattern`; returns it."""
        regex = re.compile(pattern)
        while True:
            try:
                line = self._queue.get(timeout=STARTUP_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"no log line matching {pattern!r}:\n{self.log()}") from None
            if line is None:
                raise RuntimeError(f"tandem serve exited ({self.proc.wait()}) before logging {pattern!r}:\n"
                                   f"{self.log()}")
            if regex.search(line):
                return line

    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout_s: float = 60) -> int:
        """SIGTERM, then the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
