"""A real Prometheus server for the end-to-end tests, on a free local port, and polling it."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import yaml

STARTUP_TIMEOUT_S = 60


@contextlib.contextmanager
def prometheus_process(binary: str, directory: Path, config: dict, *flags: str, scheme: str = "http", ready):
    """Runs `binary` with `config` (prometheus.yml) and `flags`, its data and log in `directory`;
    yields (its URL, the process) once `ready(url)` is true, and stops it after."""
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"{scheme}://127.0.0.1:{port}"
    log = directory / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", *flags],
            stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: ready(url), "Prometheus ready", process, log)
            yield url, process
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_until(check, what: str, process: subprocess.Popen, log: Path | None = None):
    """check()'s first true value, polled until STARTUP_TIMEOUT_S; an AssertionError (with the log's
    tail, when given) if the process exits or time runs out first."""
    tail = (lambda: f":\n{log.read_text()[-2000:]}") if log is not None else (lambda: "")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited with {process.returncode} while waiting for {what}{tail()}")
        value = check()
        if value:
            return value
        time.sleep(0.2)  # a polling step, bounded by the deadline
    raise AssertionError(f"timed out waiting for {what}{tail()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
