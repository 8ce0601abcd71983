"""Certificates for the TLS tests: CAs and the pairs they issue (tests/operator/tls_certs.py), client
credentials, and a Secret's files as the kubelet mounts and swaps them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.append(str(Path(__file__).resolve().parents[1] / "operator"))  # after ours: only tls_certs from there
from tls_certs import CA, Issued  # noqa: E402

from svc_helpers import channel  # noqa: E402

__all__ = ["CA", "Issued", "MountedSecret", "check", "server_pair", "trusting"]


def server_pair(ca: CA) -> Issued:
    """A server certificate for the addresses the tests dial."""
    return ca.issue(("localhost",), ("127.0.0.1",))


def trusting(ca: CA | None, client: Issued | None = None) -> grpc.ChannelCredentials:
    """A client's TLS credentials: trusting `ca` (None: the system's roots), presenting `client`."""
    return grpc.ssl_channel_credentials(
        root_certificates=ca.cert_pem.encode() if ca is not None else None,
        private_key=client.key_pem.encode() if client is not None else None,
        certificate_chain=client.cert_pem.encode() if client is not None else None)


async def check(address: str, credentials: grpc.ChannelCredentials | None = None, service: str = ""):
    """One Health.Check on a new connection (TLS with `credentials`): the status; grpc.aio.AioRpcError
    when the connection fails."""
    async with channel(address, credentials) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return reply.status


class MountedSecret:
    """A Secret's files as the kubelet mounts them: `tls.crt` -> `..data/tls.crt`, `..data` ->
    `..<version>`, a directory of the files. An update writes a new version and swaps `..data`."""

    def __init__(self, root: Path, files: dict[str, str]):
        self.root = root
        self.versions = 0
        self.update(files)
        for name in files:
            (root / name).symlink_to(Path("..data") / name)

    def path(self, name: str) -> str:
        return str(self.root / name)

    def update(self, files: dict[str, str]) -> None:
        self.versions += 1
        version = self.root / f"..{self.versions}"
        version.mkdir()
        for name, text in files.items():
            (version / name).write_text(text)
        swap = self.root / "..data_tmp"
        swap.symlink_to(version.name)
        os.replace(swap, self.root / "..data")  # atomic, as the kubelet's rename
