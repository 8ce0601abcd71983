"""The two containers of a HybridModel pod: `attention` (GPU) and `experts` (CPU socket).

Both run `tandem serve` from the same image with the flags in `tandem.contract`. They talk over
a Unix socket in a shared emptyDir and share two files through emptyDirs of medium Memory, each
mounted in both at a directory of its own: the CPU KV tier (`--kv-shm`, both containers) and the
experts' stored weights (`--experts-shm`, the experts container), which the attention container
maps to run large prefill chunks' experts on the GPU. Requests equal limits in both, with whole
CPUs, so the pod is Guaranteed QoS and the kubelet's static CPU manager and topology manager can
pin it to one socket.

With `spec.tls` the attention container serves the public port over TLS, from the Secret (and a
client CA) mounted read-only; the kubelet's gRPC probes cannot speak TLS, so its probes then ask a
plaintext health listener on a Unix socket in the sockets emptyDir, as the experts' probes do.
"""

from __future__ import annotations

import posixpath

from tandem import contract

from . import names
from .spec import MODEL_MOUNT, HybridModelSpec
from .spec_fields import TLS_CERT_KEY, TLS_KEY_KEY

FLAGS = contract.SERVE_FLAGS
SOCKET_DIR = posixpath.dirname(contract.EXPERTS_SOCKET.removeprefix("unix:"))
TMP_DIR = "/tmp"

# Pod volume names, shared with tandem_operator.pod.
MODEL_VOLUME = "model"
SOCKET_VOLUME = "sockets"
KV_VOLUME = "kv-cpu-tier"
EXPERTS_VOLUME = "expert-weights"
TMP_VOLUME = "tmp"
TLS_VOLUME = "tls"  # with spec.tls: its certSecret
CLIENT_CA_VOLUME = "client-ca"  # with a client CA: its Secret or ConfigMap

# Where the attention container finds spec.tls's files. The Secret's keys keep their names; the client
# CA's key, whatever the spec names it, is the file CLIENT_CA_FILE.
TLS_DIR = "/etc/tandem/tls"
CLIENT_CA_DIR = "/etc/tandem/client-ca"
CLIENT_CA_FILE = "ca.crt"

# The experts process's metrics port name, shared with tandem_operator.service and the chart's
# ServiceMonitor (charts/tandem/templates/_models.tpl).
EXPERTS_METRICS_PORT_NAME = "expert-metrics"

# The kubelet's gRPC probe speaks TCP only, without TLS; the experts server (and, with spec.tls, the
# attention server's health listener) listens on a Unix socket, so their probe is the same health
# Check, made from inside the container with the image's grpcio.
HEALTH_CHECK_SCRIPT = (
    "import sys, grpc\n"
    "from grpc_health.v1 import health_pb2 as pb, health_pb2_grpc as rpc\n"
    "request = pb.HealthCheckRequest(service=sys.argv[2])\n"
    "reply = rpc.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(request, timeout=float(sys.argv[3]))\n"
    "sys.exit(0 if reply.status == pb.HealthCheckResponse.SERVING else 1)\n"
)
PROBE_TIMEOUT_SECONDS = 5
# Loading hundreds of GB of experts from a volume takes minutes: the startup probe allows 30.
STARTUP_FAILURES = 180
STARTUP_PERIOD_SECONDS = 10
STARTUP_BUDGET_SECONDS = STARTUP_FAILURES * STARTUP_PERIOD_SECONDS


def build_attention_container(spec: HybridModelSpec) -> dict:
    """The GPU side: attention, dense layers, router and LM head; serves the public gRPC API."""
    args = _serve_args(spec, "attention") + [
        FLAGS["listen"], f"[::]:{contract.GRPC_PORT}",
        FLAGS["metrics_port"], str(contract.METRICS_PORT),
        FLAGS["experts"], contract.EXPERTS_SOCKET,
        FLAGS["device"], "cuda",
        FLAGS["gpu_memory_fraction"], _number(spec.kvCache.gpuMemoryFraction),
        FLAGS["cpu_decode"] if spec.kvCache.cpuDecode else FLAGS["no_cpu_decode"],
        *_spin_args(spec),
        *_unless_default("num_scheduler_steps", spec.attention.numSchedulerSteps, 1),
        *_unless_default("scheduling_policy", spec.attention.schedulingPolicy, "fcfs"),
        # the attention process writes the KV and publishes the CPU tier's dtype to the experts process
        *_unless_default("kv_cache_dtype", spec.kvCache.dtype, "auto"),
        *([] if spec.kvCache.prefixCaching else [FLAGS["no_enable_prefix_caching"]]),
        *_tls_args(spec),
    ]
    resources = {"cpu": str(spec.attention.cpus), "memory": spec.attention.memory,
                 "nvidia.com/gpu": str(spec.attention.gpus)}
    container = _common(spec, names.ATTENTION, args, resources)
    container["volumeMounts"] += _tls_mounts(spec)
    if spec.apiKeySecret is not None:  # from the environment: the key stays out of the pod's command line
        key_ref = {"name": spec.apiKeySecret.name, "key": spec.apiKeySecret.key}
        container["env"].append({"name": contract.API_KEY_ENV, "valueFrom": {"secretKeyRef": key_ref}})
    return {
        **container,
        "ports": [
            {"name": "grpc", "containerPort": contract.GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": contract.METRICS_PORT, "protocol": "TCP"},
        ],
        "startupProbe": _attention_probe(spec, contract.INFERENCE_SERVICE, STARTUP_PERIOD_SECONDS, STARTUP_FAILURES),
        "readinessProbe": _attention_probe(spec, contract.INFERENCE_SERVICE, 5, 3),
        # Liveness asks for the server as a whole (service ""), so a lost experts peer makes the
        # pod unready rather than restarting the process that holds the GPU weights.
        "livenessProbe": _attention_probe(spec, "", 10, 6),
    }


def build_experts_container(spec: HybridModelSpec) -> dict:
    """The CPU side: routed experts on the socket's whole cores, served on the Unix socket."""
    threads = spec.experts.compute_threads
    args = _serve_args(spec, "experts") + [
        FLAGS["listen"], contract.EXPERTS_SOCKET,
        FLAGS["metrics_port"], str(contract.EXPERTS_METRICS_PORT),
        FLAGS["device"], "cpu",
        FLAGS["threads"], str(threads),
        FLAGS["experts_shm"], contract.EXPERTS_SHM_PATH,
        *_expert_weights_args(spec),
        *_spin_args(spec),
    ]
    resources = {"cpu": str(spec.experts.cpus), "memory": spec.experts.memory}
    container = _common(spec, names.EXPERTS, args, resources)
    container["env"].append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    return {
        **container,
        "ports": [{"name": EXPERTS_METRICS_PORT_NAME, "containerPort": contract.EXPERTS_METRICS_PORT,
                   "protocol": "TCP"}],
        "startupProbe": _exec_probe(contract.EXPERTS_SERVICE, STARTUP_PERIOD_SECONDS, STARTUP_FAILURES,
                                    contract.EXPERTS_SOCKET),
        "readinessProbe": _exec_probe(contract.EXPERTS_SERVICE, 5, 3, contract.EXPERTS_SOCKET),
        "livenessProbe": _exec_probe("", 10, 6, contract.EXPERTS_SOCKET),
    }


def volume_mounts() -> list[dict]:
    """Mounts both containers share: the model (read-only), the socket, the KV tier, the experts' weights, /tmp."""
    # The shared-memory flags name a prefix inside each directory: the files they add suffixes to
    # stay in the volume. The weights are not read-only: the attention side registers their
    # mapping with CUDA, which maps it read-write.
    return [
        {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True},
        {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR},
        {"name": KV_VOLUME, "mountPath": contract.KV_SHM_DIR},
        {"name": EXPERTS_VOLUME, "mountPath": contract.EXPERTS_SHM_DIR},
        {"name": TMP_VOLUME, "mountPath": TMP_DIR},
    ]


def container_security_context() -> dict:
    """Non-root, read-only root filesystem, no privilege escalation, no capabilities."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _serve_args(spec: HybridModelSpec, role: str) -> list[str]:
    return [
        "serve",
        FLAGS["role"], role,
        FLAGS["model"], spec.model_dir,
        FLAGS["dtype"], spec.model.dtype,
        FLAGS["kv_shm"], contract.KV_SHM_PATH,
        FLAGS["block_size"], str(spec.kvCache.blockSize),
        FLAGS["cpu_kv_gib"], str(spec.kvCache.cpuTierGiB),
    ]


def _expert_weights_args(spec: HybridModelSpec) -> list[str]:
    # A GGUF file's tensor types decide the experts' format, so it replaces --expert-quant.
    if spec.experts.gguf_file is not None:
        return [FLAGS["experts_gguf"], spec.experts.gguf_file]
    return [FLAGS["expert_quant"], spec.experts.quantization]


def _spin_args(spec: HybridModelSpec) -> list[str]:
    return _unless_default("spin_us", spec.experts.spinMicroseconds, 0)


def _tls_args(spec: HybridModelSpec) -> list[str]:
    if spec.tls is None:
        return []
    args = [FLAGS["ssl_certfile"], posixpath.join(TLS_DIR, TLS_CERT_KEY),
            FLAGS["ssl_keyfile"], posixpath.join(TLS_DIR, TLS_KEY_KEY)]
    if spec.tls.client_ca is not None:
        args += [FLAGS["ssl_ca_certs"], posixpath.join(CLIENT_CA_DIR, CLIENT_CA_FILE)]
    return args + [FLAGS["health_listen"], contract.HEALTH_SOCKET]


def _tls_mounts(spec: HybridModelSpec) -> list[dict]:
    # Whole directories, never subPath: the kubelet then swaps in a renewed certificate, and the
    # server reloads it.
    if spec.tls is None:
        return []
    mounts = [{"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}]
    if spec.tls.client_ca is not None:
        mounts.append({"name": CLIENT_CA_VOLUME, "mountPath": CLIENT_CA_DIR, "readOnly": True})
    return mounts


def _unless_default(flag: str, value: int | str, default: int | str) -> list[str]:
    # Only when not the default: a new flag in every pod template would roll every HybridModel's
    # pods on an operator upgrade.
    return [FLAGS[flag], str(value)] if value != default else []


def _common(spec: HybridModelSpec, name: str, args: list[str], resources: dict) -> dict:
    return {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.imagePullPolicy,
        "command": ["tandem"],
        "args": args,
        "env": [
            # The root filesystem is read-only: caches go to the /tmp emptyDir.
            {"name": "HOME", "value": TMP_DIR},
            # Weights come from the mounted volume; never reach for the Hugging Face Hub.
            {"name": "HF_HUB_OFFLINE", "value": "1"},
        ],
        # Requests equal limits: Guaranteed QoS, which the static CPU manager needs to pin cores.
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": volume_mounts(),
        "securityContext": container_security_context(),
    }


def _attention_probe(spec: HybridModelSpec, service: str, period: int, failures: int) -> dict:
    # Over TLS the kubelet's gRPC probe fails the handshake: ask the plaintext health socket instead.
    if spec.tls is None:
        return _grpc_probe(service, period, failures)
    return _exec_probe(service, period, failures, contract.HEALTH_SOCKET)


def _grpc_probe(service: str, period: int, failures: int) -> dict:
    return {
        "grpc": {"port": contract.GRPC_PORT, "service": service},
        "periodSeconds": period,
        "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
        "failureThreshold": failures,
    }


def _exec_probe(service: str, period: int, failures: int, socket: str) -> dict:
    command = ["python", "-c", HEALTH_CHECK_SCRIPT, socket, service, str(PROBE_TIMEOUT_SECONDS - 1)]
    return {
        "exec": {"command": command},
        "periodSeconds": period,
        "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
        "failureThreshold": failures,
    }


def _number(value: float) -> str:
    return f"{value:g}"
