"""Fixtures for the gRPC services: tiny demo checkpoints, in-process servers, `tandem serve` subprocesses."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
from svc_helpers import SERVING, STARTUP_TIMEOUT_S, ServeProcess, wait_health

@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """`model_dir(arch, seed=0)` -> a random-weight demo checkpoint (hidden 64, 2 layers), made once per
    session; another seed gives a checkpoint of the same shapes with other weights."""
    from tandem.demo import make_demo_model

    made: dict[tuple[str, int], Path] = {}

    def make(arch: str = "mixtral", seed: int = 0) -> Path:
        if (arch, seed) not in made:
            made[arch, seed] = make_demo_model(tmp_path_factory.mktemp(arch), arch=arch, seed=seed)
        return made[arch, seed]

    return make


# -- in-process servers (the same `serve` coroutine `tandem serve` runs) ------------------------


@dataclass
class InProcessServer:
    address: str
    metrics_port: int | None
    stop: asyncio.Event
    task: asyncio.Task

    async def close(self) -> int:
        self.stop.set()
        return await asyncio.wait_for(self.task, 60)


@pytest.fixture
async def start_server():
    """`await start_server(model=..., **ServeOptions)` -> a SERVING InProcessServer, stopped after the test."""
    from tandem.rpc.server import ServeOptions, serve

    servers: list[InProcessServer] = []

    async def start(wait_serving: bool = True, **kwargs) -> InProcessServer:
        kwargs.setdefault("listen", "127.0.0.1:0")
        kwargs.setdefault("metrics_port", None)
        if kwargs.get("role") != "experts":  # which runs no engine, and takes none of its flags
            kwargs.setdefault("max_model_len", 256)
            kwargs.setdefault("max_num_seqs", 8)
        kwargs.setdefault("cpu_kv_gib", 0.01)
        kwargs.setdefault("device", "cpu")
        opts = ServeOptions(**kwargs)
        stop, started = asyncio.Event(), asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(opts, stop=stop, started=started))
        done, _ = await asyncio.wait({task, started}, timeout=STARTUP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if started not in done:
            raise RuntimeError(f"server did not start: {task.result() if task in done else 'timeout'}")
        info = started.result()
        server = InProcessServer(info["address"], info["metrics_port"], stop, task)
        servers.append(server)
        if wait_serving:
            await wait_health(server.address, SERVING, service=opts.service)
        return server

    yield start
    for server in servers:
        if not server.task.done():
            await server.close()


@pytest.fixture
def serve_process():
    """`serve_process(*flags)` -> a ServeProcess, killed after the test if still running."""
    procs: list[ServeProcess] = []

    def start(*args: str, wait: bool = True) -> ServeProcess:
        proc = ServeProcess(*args, wait=wait)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
