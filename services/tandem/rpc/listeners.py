"""Where one `tandem serve` process listens: --listen (plaintext, or TLS with --ssl-certfile), the
Prometheus /metrics endpoint (plaintext), and with --health-listen a second, plaintext gRPC server
that serves the health service alone, for the kubelet's gRPC probes, which speak no TLS."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tandem import contract
from tandem.rpc.addresses import prepare_unix_socket, with_bound_port
from tandem.rpc.tls import ServerCredentials

F = contract.SERVE_FLAGS


@dataclass
class Listening:
    """What `listen` bound."""

    address: str  # --listen, port 0 replaced by the port bound
    health_address: str | None  # --health-listen, the same way
    httpd: object | None  # the /metrics HTTP server (tandem.metrics), closed by the caller
    tls: ServerCredentials | None

    @property
    def metrics_port(self) -> int | None:
        return self.httpd.server_port if self.httpd is not None else None

    def describe(self) -> str:
        """The addresses, as the log line after "listening on" gives them (tests read it)."""
        parts = [self.address]
        if self.tls is not None:
            parts.append("TLS, client certificates required" if self.tls.requires_client_certificate else "TLS")
        if self.httpd is not None:
            host = self.httpd.server_address[0]
            parts.append(f"metrics on http://{f'[{host}]' if ':' in host else host}:{self.httpd.server_port}/metrics")
        if self.health_address is not None:
            parts.append(f"health on {self.health_address}")
        return "; ".join(parts)


def listen(server: grpc.aio.Server, health_server: grpc.aio.Server | None, metrics, opts) -> Listening:
    """Binds `opts` (ServeOptions) --listen, --health-listen and --metrics-port. ValueError naming the
    flag when one cannot be bound or a TLS file cannot serve, with nothing left bound but the gRPC
    servers' ports (which the caller must start and stop)."""
    # The TLS files and the metrics endpoint first: a gRPC server with a bound port must be started
    # before it goes (grpc/grpc#10084: destroying one that never started can crash the process), so
    # its port is bound last, once nothing else can fail.
    files = opts.tls_files
    tls = ServerCredentials(files) if files is not None else None
    httpd = None
    if opts.metrics_port is not None:
        try:
            httpd = metrics.serve_http(opts.metrics_port, opts.metrics_host)
        except OSError as exc:  # in use, or --metrics-host not an address of this host
            where = f"port {opts.metrics_port}"
            if opts.metrics_host:
                where = f"{opts.metrics_host} {where}"
            raise ValueError(f"--metrics-port: cannot serve /metrics on {where}: {exc.strerror or exc}") from None
    try:
        port = _bind(server, opts.listen, F["listen"], tls.credentials() if tls is not None else None)
        health_address = None
        if health_server is not None:
            health_port = _bind(health_server, opts.health_listen, F["health_listen"])
            health_address = with_bound_port(opts.health_listen, health_port)
    except ValueError:
        if httpd is not None:
            httpd.close()
        raise
    return Listening(with_bound_port(opts.listen, port), health_address, httpd, tls)


def _bind(server: grpc.aio.Server, address: str, flag: str, credentials: grpc.ServerCredentials | None = None) -> int:
    prepare_unix_socket(address)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:  # gRPC's own message says only "failed to bind", and logs the reason
        raise ValueError(f"{flag} {address}: cannot bind it (in use, or not an address of this host)") from None
