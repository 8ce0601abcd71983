"""The HybridModel spec as typed, validated, defaulted dataclasses.

The API server already applies the CRD's defaults and validation; this module applies the same
again so the operator never acts on a spec it does not understand (an older CRD, a test server
without schema validation). Defaults here must equal the CRD's: tests/operator checks it.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kubernetes.utils import parse_quantity

from tandem import contract

from .prometheus_spec import PrometheusSpec, parse_prometheus
from .spec_fields import (ConfigMapKeyRef, SecretKeyRef, SecretRef, SpecError, _bool, _choice, _int, _key_ref, _known,
                          _number, _object, _quantity, _required, _secret, _string)


# Path segments never start with a dot: no `..` escapes from the volume, no hidden dirs.
_MODEL_PATH = re.compile(r"^$|^[A-Za-z0-9_@+=,-][A-Za-z0-9._@+=,-]*(/[A-Za-z0-9_@+=,-][A-Za-z0-9._@+=,-]*)*$")
# A file by the same rules, named *.gguf.
_GGUF_PATH = re.compile(r"^([A-Za-z0-9_@+=,-][A-Za-z0-9._@+=,-]*/)*[A-Za-z0-9_@+=,-][A-Za-z0-9._@+=,-]*\.gguf$")
# A DNS-1035 label, as the CRD's rule on metadata.name: the name is also the Service's name and a
# label value, and both allow no more.
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_MAX_LENGTH = 63
DTYPES = ("bfloat16", "float32")  # what `tandem serve --dtype` accepts
KV_CACHE_DTYPES = ("auto", "fp8")  # what the CRD takes of `tandem serve --kv-cache-dtype`'s values
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
METRICS_SOURCES = ("Pods", "Prometheus")
CLIENT_CA_KEY = "ca.crt"  # where cert-manager and trust-manager put a CA bundle
API_KEY_KEY = "api-key"  # spec.apiKeySecret's default key


@dataclass(frozen=True)
class ModelSpec:
    volume: dict
    path: str = ""
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class AttentionSpec:
    gpus: int = 1
    cpus: int = 4
    memory: str = "32Gi"
    numSchedulerSteps: int = 1  # decode tokens per engine step while only decodes run (multi-step)
    schedulingPolicy: str = "fcfs"  # or "priority": GenerateRequest.priority orders the engine's queues


@dataclass(frozen=True)
class ExpertsSpec:
    cpus: int = 16
    memory: str = "128Gi"
    threads: int | None = None
    quantization: str = "none"
    gguf: str | None = None  # a llama.cpp file the experts load from, relative to the volume's root
    spinMicroseconds: int = 0  # both containers poll the data plane this long before sleeping

    @property
    def compute_threads(self) -> int:
        """Threads for expert compute: one per whole CPU unless set."""
        return self.threads or self.cpus

    @property
    def gguf_file(self) -> str | None:
        """The GGUF file inside the containers, or None to load the checkpoint's experts."""
        return None if self.gguf is None else posixpath.join(MODEL_MOUNT, self.gguf)


@dataclass(frozen=True)
class KVCacheSpec:
    blockSize: int = 16
    gpuMemoryFraction: float = 0.9
    cpuTierGiB: int = 8
    cpuDecode: bool = True
    dtype: str = "auto"  # the cache's dtype in both tiers: auto (the model's) or fp8 (e4m3: twice the tokens)
    prefixCaching: bool = True  # false: --no-enable-prefix-caching


@dataclass(frozen=True)
class PlacementSpec:
    nodeAffinity: dict | None = None
    tolerations: list | None = None
    nodeSelector: dict = field(default_factory=dict)
    onePerNode: bool = True


@dataclass(frozen=True)
class MetricsSpec:
    source: str = "Pods"
    prometheus: PrometheusSpec | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    minReplicas: int = 1
    maxReplicas: int | None = None
    targetP95InterTokenLatencyMs: float | None = None
    tolerance: float = 0.1
    windowSeconds: int = 60
    scaleUpStabilizationSeconds: int = 0
    scaleDownStabilizationSeconds: int = 300
    metrics: MetricsSpec = field(default_factory=MetricsSpec)


@dataclass(frozen=True)
class TLSSpec:
    """TLS on the public gRPC port; with a client CA, mutual TLS."""

    certSecret: SecretRef  # a kubernetes.io/tls Secret: tls.crt and tls.key
    # The PEM CA bundle client certificates must be signed by, from at most one of a Secret and a ConfigMap.
    clientCASecret: SecretKeyRef | None = None
    clientCAConfigMap: ConfigMapKeyRef | None = None

    @property
    def client_ca(self) -> SecretKeyRef | ConfigMapKeyRef | None:
        """Where the client CA bundle comes from; None when clients need no certificate."""
        return self.clientCASecret or self.clientCAConfigMap


@dataclass(frozen=True)
class HybridModelSpec:
    """A whole, valid HybridModel spec."""

    model: ModelSpec
    image: str
    imagePullPolicy: str = "IfNotPresent"
    imagePullSecrets: tuple = ()
    replicas: int = 1
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    experts: ExpertsSpec = field(default_factory=ExpertsSpec)
    kvCache: KVCacheSpec = field(default_factory=KVCacheSpec)
    placement: PlacementSpec = field(default_factory=PlacementSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    tls: TLSSpec | None = None
    apiKeySecret: SecretKeyRef | None = None  # the key the Inference API requires (tandem serve --api-key)

    @property
    def model_dir(self) -> str:
        """The checkpoint directory inside the containers."""
        return f"{MODEL_MOUNT}/{self.model.path}".rstrip("/")


MODEL_MOUNT = "/models"


def parse_spec(raw: Mapping[str, Any] | None) -> HybridModelSpec:
    """Validate a HybridModel `.spec` and fill in defaults; raise SpecError on the first bad field."""
    spec = _object(raw, "spec")
    _known(spec, "spec", HybridModelSpec)
    replicas = _int(spec, "replicas", "spec", 1, minimum=0)
    parsed = HybridModelSpec(
        model=_model(_object(_required(spec, "model", "spec"), "spec.model")),
        image=_string(spec, "image", "spec", None, min_length=1),
        imagePullPolicy=_choice(spec, "imagePullPolicy", "spec", "IfNotPresent", PULL_POLICIES),
        imagePullSecrets=_pull_secrets(spec.get("imagePullSecrets")),
        replicas=replicas,
        attention=_attention(_object(spec.get("attention", {}), "spec.attention")),
        experts=_experts(_object(spec.get("experts", {}), "spec.experts")),
        kvCache=_kv_cache(_object(spec.get("kvCache", {}), "spec.kvCache")),
        placement=_placement(_object(spec.get("placement", {}), "spec.placement")),
        autoscaling=_autoscaling(_object(spec.get("autoscaling", {}), "spec.autoscaling")),
        tls=None if spec.get("tls") is None else _tls(_object(spec["tls"], "spec.tls")),
        apiKeySecret=None if spec.get("apiKeySecret") is None else _key_ref(spec["apiKeySecret"], "spec.apiKeySecret",
                                                                            SecretKeyRef, API_KEY_KEY),
    )
    _check_attention_memory(parsed)
    return parsed


def check_name(name: str) -> None:
    """Raise SpecError unless `name` can name the HybridModel's Service (a DNS-1035 label)."""
    if len(name) > NAME_MAX_LENGTH or not _NAME.match(name):
        raise SpecError(f"metadata.name {name!r} must be a DNS-1035 label: at most {NAME_MAX_LENGTH} lowercase "
                        "letters, digits and '-', starting with a letter and ending with a letter or digit, as it "
                        "also names the model's Service")


def _check_attention_memory(spec: HybridModelSpec) -> None:
    # The attention process writes the CPU KV tier (the experts process only reads it), and a
    # shared-memory page counts against the container that first writes it.
    tier = spec.kvCache.cpuTierGiB
    if tier and parse_quantity(spec.attention.memory) <= tier * 2**30:
        raise SpecError(f"spec.attention.memory {spec.attention.memory} must hold the {tier} GiB CPU KV tier "
                        f"(spec.kvCache.cpuTierGiB) and the attention process itself: that container writes the "
                        f"tier, so its shared memory counts against the container's limit")


def _model(raw: Mapping) -> ModelSpec:
    _known(raw, "spec.model", ModelSpec)
    volume = _object(_required(raw, "volume", "spec.model"), "spec.model.volume")
    if len(volume) != 1:
        raise SpecError("spec.model.volume must hold exactly one volume source, e.g. persistentVolumeClaim")
    path = _string(raw, "path", "spec.model", "")
    if len(path) > 1024 or not _MODEL_PATH.match(path):
        raise SpecError(f"spec.model.path {path!r} must be a relative path without '.'-leading segments")
    return ModelSpec(volume=dict(volume), path=path, dtype=_choice(raw, "dtype", "spec.model", "bfloat16", DTYPES))


def _attention(raw: Mapping) -> AttentionSpec:
    _known(raw, "spec.attention", AttentionSpec)
    return AttentionSpec(
        gpus=_int(raw, "gpus", "spec.attention", 1, minimum=1, maximum=16),
        cpus=_int(raw, "cpus", "spec.attention", 4, minimum=1),
        memory=_quantity(raw, "memory", "spec.attention", "32Gi"),
        numSchedulerSteps=_int(raw, "numSchedulerSteps", "spec.attention", 1, minimum=1, maximum=64),
        schedulingPolicy=_choice(raw, "schedulingPolicy", "spec.attention", "fcfs", contract.SCHEDULING_POLICIES),
    )


def _experts(raw: Mapping) -> ExpertsSpec:
    _known(raw, "spec.experts", ExpertsSpec)
    threads = raw.get("threads")
    quantization = _choice(raw, "quantization", "spec.experts", "none", contract.EXPERT_QUANTS)
    gguf = None if raw.get("gguf") is None else _gguf(raw["gguf"], quantization)
    return ExpertsSpec(
        cpus=_int(raw, "cpus", "spec.experts", 16, minimum=1),
        memory=_quantity(raw, "memory", "spec.experts", "128Gi"),
        threads=None if threads is None else _int(raw, "threads", "spec.experts", None, minimum=1),
        quantization=quantization,
        gguf=gguf,
        spinMicroseconds=_int(raw, "spinMicroseconds", "spec.experts", 0, minimum=0, maximum=1_000_000),
    )


def _gguf(path: Any, quantization: str) -> str:
    if not isinstance(path, str) or len(path) > 1024 or not _GGUF_PATH.fullmatch(path):
        raise SpecError(f"spec.experts.gguf {path!r} must be a relative path of a .gguf file inside the model "
                        "volume, without '.'-leading segments")
    if quantization != "none":
        # The file's tensor types decide the experts' format; a second quantization has nothing to act on.
        raise SpecError(f"spec.experts.gguf cannot be combined with spec.experts.quantization {quantization}: "
                        "the GGUF file's tensor types decide the experts' format; set quantization to none")
    return path


def _kv_cache(raw: Mapping) -> KVCacheSpec:
    _known(raw, "spec.kvCache", KVCacheSpec)
    fraction = _number(raw, "gpuMemoryFraction", "spec.kvCache", 0.9)
    if not 0 < fraction <= 1:
        raise SpecError(f"spec.kvCache.gpuMemoryFraction must be in (0, 1], got {fraction}")
    return KVCacheSpec(
        blockSize=_int(raw, "blockSize", "spec.kvCache", 16, minimum=1, maximum=1024),
        gpuMemoryFraction=float(fraction),
        cpuTierGiB=_int(raw, "cpuTierGiB", "spec.kvCache", 8, minimum=0),
        cpuDecode=_bool(raw, "cpuDecode", "spec.kvCache", True),
        dtype=_choice(raw, "dtype", "spec.kvCache", "auto", KV_CACHE_DTYPES),
        prefixCaching=_bool(raw, "prefixCaching", "spec.kvCache", True),
    )


def _placement(raw: Mapping) -> PlacementSpec:
    _known(raw, "spec.placement", PlacementSpec)
    affinity = raw.get("nodeAffinity")
    tolerations = raw.get("tolerations")
    selector = _object(raw.get("nodeSelector", {}), "spec.placement.nodeSelector")
    if affinity is not None:
        affinity = dict(_object(affinity, "spec.placement.nodeAffinity"))
    if tolerations is not None:
        if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
            raise SpecError("spec.placement.tolerations must be a list of Kubernetes tolerations")
        tolerations = [dict(t) for t in tolerations]
    if not all(isinstance(v, str) for v in selector.values()):
        raise SpecError("spec.placement.nodeSelector values must be strings")
    return PlacementSpec(
        nodeAffinity=affinity,
        tolerations=tolerations,
        nodeSelector=dict(selector),
        onePerNode=_bool(raw, "onePerNode", "spec.placement", True),
    )


def _autoscaling(raw: Mapping) -> AutoscalingSpec:
    where = "spec.autoscaling"
    _known(raw, where, AutoscalingSpec)
    enabled = _bool(raw, "enabled", where, False)
    minimum = _int(raw, "minReplicas", where, 1, minimum=1)
    maximum = None if raw.get("maxReplicas") is None else _int(raw, "maxReplicas", where, None, minimum=1)
    target = None if raw.get("targetP95InterTokenLatencyMs") is None else _number(
        raw, "targetP95InterTokenLatencyMs", where, None)
    if target is not None and target <= 0:
        raise SpecError(f"{where}.targetP95InterTokenLatencyMs must be > 0, got {target}")
    if enabled and (maximum is None or target is None):
        raise SpecError("autoscaling.enabled needs maxReplicas and targetP95InterTokenLatencyMs")
    if maximum is not None and minimum > maximum:
        raise SpecError(f"autoscaling.minReplicas ({minimum}) must not exceed maxReplicas ({maximum})")
    tolerance = _number(raw, "tolerance", where, 0.1)
    if not 0 <= tolerance <= 1:
        raise SpecError(f"{where}.tolerance must be in [0, 1], got {tolerance}")
    return AutoscalingSpec(
        enabled=enabled, minReplicas=minimum, maxReplicas=maximum,
        targetP95InterTokenLatencyMs=None if target is None else float(target),
        tolerance=float(tolerance),
        windowSeconds=_int(raw, "windowSeconds", where, 60, minimum=1),
        scaleUpStabilizationSeconds=_int(raw, "scaleUpStabilizationSeconds", where, 0, minimum=0),
        scaleDownStabilizationSeconds=_int(raw, "scaleDownStabilizationSeconds", where, 300, minimum=0),
        metrics=_metrics(_object(raw.get("metrics", {}), f"{where}.metrics")),
    )


def _metrics(raw: Mapping) -> MetricsSpec:
    where = "spec.autoscaling.metrics"
    _known(raw, where, MetricsSpec)
    source = _choice(raw, "source", where, "Pods", METRICS_SOURCES)
    prometheus = None if raw.get("prometheus") is None else parse_prometheus(raw["prometheus"])
    if source == "Prometheus" and prometheus is None:
        raise SpecError("metrics.source Prometheus needs metrics.prometheus.url")
    return MetricsSpec(source=source, prometheus=prometheus)


def _tls(raw: Mapping) -> TLSSpec:
    where = "spec.tls"
    _known(raw, where, TLSSpec)
    secret, config_map = raw.get("clientCASecret"), raw.get("clientCAConfigMap")
    if secret is not None and config_map is not None:
        raise SpecError(f"{where} takes at most one of clientCASecret and clientCAConfigMap")
    return TLSSpec(
        certSecret=_secret(_required(raw, "certSecret", where), f"{where}.certSecret"),
        clientCASecret=None if secret is None else _key_ref(secret, f"{where}.clientCASecret", SecretKeyRef,
                                                            CLIENT_CA_KEY),
        clientCAConfigMap=None if config_map is None else _key_ref(config_map, f"{where}.clientCAConfigMap",
                                                                   ConfigMapKeyRef, CLIENT_CA_KEY),
    )


def _pull_secrets(raw: Any) -> tuple:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, dict) and s.get("name") for s in raw):
        raise SpecError("spec.imagePullSecrets must be a list of {name: ...}")
    return tuple({"name": s["name"]} for s in raw)
