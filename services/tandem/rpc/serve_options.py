"""`tandem serve`'s settings (ServeOptions), checked on construction: a bad flag is an error naming it,
found before anything listens or loads."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from tandem import contract
from tandem.rpc import experts_server
from tandem.rpc.addresses import check_address
from tandem.rpc.auth import check_keys
from tandem.rpc.expert_wire import data_socket_path
from tandem.rpc.tls import TlsFiles, server_files


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
    "enable_prefix_caching": contract.SERVE_FLAGS["no_enable_prefix_caching"],
}
# The Inference API's connection lifetime (tandem.rpc.server.connection_options), by ServeOptions field; the
# last has no flag. Not --role experts': its one peer, the attention process of its pod, dials a Unix socket.
CONNECTION_FLAGS = {
    "max_connection_age_s": "--max-connection-age", "keepalive_time_s": "--keepalive-time",
    "keepalive_timeout_s": "--keepalive-timeout", "min_client_ping_interval_s": "min_client_ping_interval_s",
}
# gRPC takes these in milliseconds, in a C int: about 24.8 days at most
MAX_CONNECTION_SECONDS = (2**31 - 1) // 1000


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
    enable_prefix_caching: bool = True  # a prompt's full blocks shared with later requests that start alike
    ssl_certfile: str | None = None  # TLS on --listen: the certificate chain
    ssl_keyfile: str | None = None  # and its key
    ssl_ca_certs: str | None = None  # mutual TLS: clients present a certificate these CAs signed
    health_listen: str | None = None  # a second, plaintext listener serving only grpc.health.v1
    api_keys: tuple[str, ...] = ()  # calls of the Inference API must carry one (tandem.rpc.auth); () for none
    # Connections of the Inference API, in seconds (fractions too): see tandem.rpc.server.connection_options.
    max_connection_age_s: float = 300.0  # then GOAWAY: new calls on a new connection; 0: never
    keepalive_time_s: float = 20.0  # ping each connection this often; 0: never
    keepalive_timeout_s: float = 10.0  # and close it (cancelling its calls) when a ping is not answered in this
    # a client's keepalive may ping this often without GOAWAY; README tells clients 10 s, so that a ping
    # brought forward by network jitter is no strike (three, and the server sends GOAWAY)
    min_client_ping_interval_s: float = 5.0

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
        self._check_connections()
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

    def _check_connections(self) -> None:
        """The connection lifetime's durations; --role experts takes their defaults and uses none of them."""
        for name, flag in CONNECTION_FLAGS.items():
            seconds = getattr(self, name)
            if not 0 <= seconds <= MAX_CONNECTION_SECONDS:  # NaN fails too
                raise ValueError(f"{flag} must be a number of seconds in 0..{MAX_CONNECTION_SECONDS}, got {seconds}")
        if self.keepalive_timeout_s == 0:
            raise ValueError("--keepalive-timeout must be a number of seconds > 0, got 0")
        if self.role == "experts":
            defaults = {f.name: f.default for f in fields(self)}
            for name, flag in CONNECTION_FLAGS.items():
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"{flag} is for the Inference API (--role all or attention), not --role experts")

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
