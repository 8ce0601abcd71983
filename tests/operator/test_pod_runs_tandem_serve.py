"""The attention container the operator renders for `spec.tls` and `spec.apiKeySecret`, run for real:
its TLS flags, its API key's environment variable and its exec probes, with the pod's paths mapped to
files here, against a real `tandem serve` (the embedded role: the attention role would need an experts
process, and takes the same flags)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
from tandem_serve import svc
from test_builders import BASE, containers
from tls_certs import CA

from tandem import contract
from tandem_operator.containers import CLIENT_CA_DIR, TLS_DIR
from tandem.rpc.auth import client_metadata
from tandem.rpc.gen import inference_pb2_grpc

KEY = "tk-pod-0123456789"
SPEC = {**BASE, "tls": {"certSecret": {"name": "mx-tls"}, "clientCASecret": {"name": "clients"}},
        "apiKeySecret": {"name": "mx-keys"}}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _mapped(value: str, paths: dict[str, str]) -> str:
    for pod_path, here in paths.items():
        value = value.replace(pod_path, here)
    return value


def _probe_passes(command: list[str], timeout_s: float) -> bool:
    """Runs the exec probe as the kubelet would, until it exits 0 or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if subprocess.run(command, capture_output=True, timeout=30).returncode == 0:
            return True
        if time.monotonic() > deadline:
            return False


def test_the_rendered_tls_api_key_and_probes_serve_and_answer(tmp_path, monkeypatch):
    from tandem.demo import make_demo_model

    server_ca, client_ca = CA("server CA"), CA("clients CA")
    (tmp_path / "tls").mkdir()
    (tmp_path / "client-ca").mkdir()
    server_ca.issue(("localhost",), ("127.0.0.1",)).write(tmp_path / "tls", "tls")  # tls.crt, tls.key
    (tmp_path / "client-ca" / "ca.crt").write_text(client_ca.cert_pem)
    paths = {TLS_DIR: str(tmp_path / "tls"), CLIENT_CA_DIR: str(tmp_path / "client-ca"),
             contract.HEALTH_SOCKET: f"unix:{tmp_path}/health.sock"}

    attention = containers(SPEC)["attention"]
    args = attention["args"]
    start = args.index(contract.SERVE_FLAGS["ssl_certfile"])  # the TLS flags the operator adds, in its order
    tls_args = [_mapped(a, paths) for a in args[start:]]
    (env,) = [e for e in attention["env"] if e["name"] == contract.API_KEY_ENV]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "mx-keys", "key": "api-key"}
    monkeypatch.setenv(contract.API_KEY_ENV, KEY)  # what the kubelet sets from the Secret

    model = make_demo_model(tmp_path / "model", arch="mixtral", seed=0)
    server = svc.ServeProcess("--model", str(model), "--listen", "127.0.0.1:0", "--metrics-port", "0",
                              "--device", "cpu", *svc.SMALL_ENGINE, *tls_args)
    try:
        for name in PROBES:
            command = attention[name]["exec"]["command"]
            assert command[0] == "python"  # the image's; here, this test's
            command = [sys.executable, *(_mapped(c, paths) for c in command[1:])]
            assert _probe_passes(command, svc.STARTUP_TIMEOUT_S), f"{name} never passed:\n{server.log()}"

        client = client_ca.issue(("pipeline",), client=True)
        credentials = grpc.ssl_channel_credentials(server_ca.cert_pem.encode(), client.key_pem.encode(),
                                                   client.cert_pem.encode())

        async def generate(metadata) -> list[int]:
            async with grpc.aio.secure_channel(server.address, credentials) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                return [t async for r in stub.Generate(svc.greedy([1, 2, 3], max_tokens=3), metadata=metadata,
                                                       timeout=60) for t in r.token_ids]

        assert len(asyncio.run(generate(client_metadata(KEY)))) == 3
        try:
            asyncio.run(generate(()))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        else:
            raise AssertionError("a call without the API key was served")
    finally:
        server.kill()
