"""Pure builder tests: affinity, QoS, volumes, security context and probes, for several specs."""

from __future__ import annotations

import copy
import posixpath

import kubernetes_validate.utils
import pytest
from kubernetes.utils import parse_quantity

from tandem import contract
from tandem_operator import names, placement
from tandem_operator.children import build_children
from tandem_operator.spec import SpecError, parse_spec

BASE = {"model": {"path": "mixtral", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "image": "ghcr.io/example/tandem:0.1.0"}
SPECS = {
    "defaults": BASE,
    "hostpath-int8": {**BASE,
                      "model": {"path": "", "volume": {"hostPath": {"path": "/srv/models", "type": "Directory"}}},
                      "experts": {"cpus": 48, "memory": "384Gi", "threads": 46, "quantization": "int8"},
                      "attention": {"gpus": 2, "cpus": 8, "memory": "64Gi", "numSchedulerSteps": 8,
                                    "schedulingPolicy": "priority"},
                      "replicas": 3},
    "custom-placement": {**BASE, "placement": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["moe"]}]}]}},
        "tolerations": [], "nodeSelector": {"topology.kubernetes.io/zone": "a"}, "onePerNode": False},
        "kvCache": {"cpuTierGiB": 0, "blockSize": 32, "gpuMemoryFraction": 0.5, "cpuDecode": False, "dtype": "fp8",
                    "prefixCaching": False}},
    "nfs-volume": {**BASE, "model": {"path": "org/model", "volume": {"nfs": {"server": "nfs", "path": "/m"}}},
                   "imagePullSecrets": [{"name": "registry"}], "imagePullPolicy": "Always"},
}


def children(raw: dict) -> dict[str, dict]:
    return {c["kind"]: c for c in build_children(parse_spec(raw), "mx", "ns")}


def pod_spec(raw: dict) -> dict:
    return children(raw)["Deployment"]["spec"]["template"]["spec"]


def containers(raw: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec(raw)["containers"]}


def qos_class(spec: dict) -> str:
    """The pod's QoS class by the kubelet's rules (v1 qos.GetPodQOS, for cpu and memory)."""
    every = [c.get("resources", {}) for c in spec["containers"]]
    guaranteed = all(
        r.get("limits", {}).get(res) is not None
        and parse_quantity(r.get("requests", {}).get(res, r["limits"][res])) == parse_quantity(r["limits"][res])
        for r in every for res in ("cpu", "memory"))
    if guaranteed:
        return "Guaranteed"
    return "Burstable" if any(r.get("requests") or r.get("limits") for r in every) else "BestEffort"


@pytest.mark.parametrize("name", SPECS)
def test_children_are_valid_kubernetes_objects(name):
    for child in children(SPECS[name]).values():
        kubernetes_validate.utils.validate(child, "1.31.0", strict=True)


@pytest.mark.parametrize("name", SPECS)
def test_pod_is_guaranteed_with_whole_cpus(name):
    spec = pod_spec(SPECS[name])
    assert qos_class(spec) == "Guaranteed"
    for container in spec["containers"]:
        cpu = container["resources"]["requests"]["cpu"]
        assert parse_quantity(cpu) == int(parse_quantity(cpu)), "the static CPU manager pins integer CPUs only"
    attention = containers(SPECS[name])["attention"]
    assert attention["resources"]["limits"]["nvidia.com/gpu"] == str(parse_spec(SPECS[name]).attention.gpus)
    assert "nvidia.com/gpu" not in containers(SPECS[name])["experts"]["resources"]["limits"]


def test_qos_check_can_fail():
    spec = pod_spec(BASE)
    spec["containers"][1]["resources"]["requests"]["cpu"] = "1"
    assert qos_class(spec) == "Burstable"


def test_default_placement_is_amd_single_numa_gpu_one_per_node():
    spec = pod_spec(BASE)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (term,) = terms
    expressions = {e["key"]: (e["operator"], e["values"]) for e in term["matchExpressions"]}
    assert expressions == {placement.CPU_VENDOR_LABEL: ("In", ["AMD"]),
                           placement.NUMA_LABEL: ("NotIn", ["true"]),
                           placement.GPU_PRESENT_LABEL: ("In", ["true"])}
    (anti,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == {"labelSelector": {"matchLabels": {names.MODEL_LABEL: "mx"}},
                    "topologyKey": "kubernetes.io/hostname"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # None, not missing: the operator owns the key, so it deletes it from a Deployment that has it.
    assert spec["nodeSelector"] is None and spec["imagePullSecrets"] is None


def test_placement_overrides_replace_defaults():
    spec = pod_spec(SPECS["custom-placement"])
    node_affinity = SPECS["custom-placement"]["placement"]["nodeAffinity"]
    assert spec["affinity"] == {"nodeAffinity": {**node_affinity, placement.PREFERRED: None}, "podAntiAffinity": None}
    assert spec["tolerations"] == []
    assert spec["nodeSelector"] == {"topology.kubernetes.io/zone": "a"}


@pytest.mark.parametrize("name", SPECS)
def test_volumes_and_mounts(name):
    spec = pod_spec(SPECS[name])
    volumes = {v["name"]: v for v in spec["volumes"]}
    model_source = {k: v for k, v in volumes["model"].items() if k != "name"}
    assert model_source == SPECS[name]["model"]["volume"]
    assert volumes["kv-cpu-tier"]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes["sockets"]
    for container in spec["containers"]:
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
        assert mounts["kv-cpu-tier"]["mountPath"] == contract.KV_SHM_DIR
        assert mounts["expert-weights"] == {"name": "expert-weights", "mountPath": contract.EXPERTS_SHM_DIR}
        assert contract.EXPERTS_SOCKET.removeprefix("unix:").startswith(mounts["sockets"]["mountPath"] + "/")


@pytest.mark.parametrize("name", SPECS)
def test_shared_memory_volumes_are_sized_for_their_files(name):
    volumes = {v["name"]: v for v in pod_spec(SPECS[name])["volumes"]}
    spec = parse_spec(SPECS[name])
    # The experts container writes its weights, so its memory limit bounds them: the volume gets the same bound.
    assert volumes["expert-weights"]["emptyDir"] == {"medium": "Memory", "sizeLimit": spec.experts.memory}
    tier = spec.kvCache.cpuTierGiB
    limit = volumes["kv-cpu-tier"]["emptyDir"].get("sizeLimit")
    if tier == 0:
        assert limit is None
    else:  # the tier's k/v files and 1 MiB for its layout file
        assert parse_quantity(limit) - parse_quantity(f"{tier}Gi") == parse_quantity("1Mi")


def shared_memory_files() -> dict[str, list[str]]:
    """Each shared-memory flag and the suffixes the services add to its path prefix for their files."""
    from tandem.model.deepseek_attention import LATENT
    from tandem.rpc.cpu_attention import LAYOUT_SUFFIX

    # The KV tier's files are PATH.<entry> (tandem.kv.cache), one per layout entry: k and v (grouped-query
    # attention, tandem.model.attention) or MLA's latent.
    kv = [".k", ".v", f".{LATENT}", LAYOUT_SUFFIX]
    # tandem.experts.shared_weights: DATA_SUFFIX and MANIFEST_SUFFIX.
    experts = [".bin", ".json"]
    return {"kv_shm": kv, "experts_shm": experts}


@pytest.mark.parametrize("name", SPECS)
def test_shared_memory_files_lie_in_memory_volumes_both_containers_mount(name):
    spec = pod_spec(SPECS[name])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounted = [{(m["name"], m["mountPath"]) for m in c["volumeMounts"]} for c in spec["containers"]]
    flags = {c["name"]: set() for c in spec["containers"]}
    for container in spec["containers"]:
        args = container["args"]
        for flag, suffixes in shared_memory_files().items():
            if contract.SERVE_FLAGS[flag] not in args:
                continue
            flags[container["name"]].add(flag)
            prefix = args[args.index(contract.SERVE_FLAGS[flag]) + 1]
            for path in (posixpath.normpath(prefix + suffix) for suffix in suffixes):
                under = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
                assert under, f"{container['name']}: {path} is in no volume"
                # The deepest mount is the one the file lands in.
                mount = max(under, key=lambda m: len(m["mountPath"]))
                assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory", path
                assert all((mount["name"], mount["mountPath"]) in each for each in mounted), path
                assert not mount.get("readOnly"), path
    assert flags == {"attention": {"kv_shm"}, "experts": {"kv_shm", "experts_shm"}}


@pytest.mark.parametrize("name", SPECS)
def test_security_context(name):
    spec = pod_spec(SPECS[name])
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["automountServiceAccountToken"] is False
    for container in spec["containers"]:
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}


def test_probes_use_grpc_health():
    attention, experts = containers(BASE)["attention"], containers(BASE)["experts"]
    assert attention["readinessProbe"]["grpc"] == {"port": contract.GRPC_PORT, "service": contract.INFERENCE_SERVICE}
    assert attention["livenessProbe"]["grpc"]["port"] == contract.GRPC_PORT
    assert attention["startupProbe"]["failureThreshold"] * attention["startupProbe"]["periodSeconds"] >= 600
    command = experts["readinessProbe"]["exec"]["command"]
    assert contract.EXPERTS_SOCKET in command and contract.EXPERTS_SERVICE in command
    # The probe script is valid Python that asks the gRPC health service.
    script = command[command.index("-c") + 1]
    compile(script, "probe", "exec")
    assert "HealthStub" in script


@pytest.mark.parametrize("name", SPECS)
def test_a_slow_healthy_load_is_not_a_stuck_rollout(name):
    # The Deployment controller reports ProgressDeadlineExceeded (shown as Degraded) after
    # progressDeadlineSeconds without progress: that must outlast the slowest load the startup
    # probes allow, with room to schedule the pod and pull its image.
    deployment = children(SPECS[name])["Deployment"]
    startup = max(c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"]
                  + c["startupProbe"].get("initialDelaySeconds", 0) for c in containers(SPECS[name]).values())
    assert startup >= 1800
    assert deployment["spec"]["progressDeadlineSeconds"] >= startup + 600


def test_container_commands_follow_the_contract():
    spec = parse_spec(SPECS["hostpath-int8"])
    attention, experts = containers(SPECS["hostpath-int8"])["attention"], containers(SPECS["hostpath-int8"])["experts"]

    def flag(container, name):
        args = container["args"]
        return args[args.index(contract.SERVE_FLAGS[name]) + 1]

    assert attention["command"] == ["tandem"] and attention["args"][0] == "serve"
    assert flag(attention, "role") == "attention" and flag(experts, "role") == "experts"
    assert flag(attention, "experts") == contract.EXPERTS_SOCKET == flag(experts, "listen")
    assert flag(attention, "model") == flag(experts, "model") == "/models"
    assert flag(experts, "threads") == "46" and flag(experts, "expert_quant") == "int8"
    # The experts process keeps its weights in shared memory; the attention process learns the path over gRPC.
    assert flag(experts, "experts_shm") == contract.EXPERTS_SHM_PATH
    assert contract.SERVE_FLAGS["experts_shm"] not in attention["args"]
    assert flag(attention, "metrics_port") != flag(experts, "metrics_port")
    assert contract.SERVE_FLAGS["spin_us"] not in attention["args"] + experts["args"]  # unset: not rendered
    assert spec.replicas == children(SPECS["hostpath-int8"])["Deployment"]["spec"]["replicas"] == 3


def test_spin_microseconds_reaches_both_ends_of_the_data_plane():
    raw = copy.deepcopy(SPECS["hostpath-int8"])
    raw["experts"]["spinMicroseconds"] = 20000
    for container in containers(raw).values():
        args = container["args"]
        assert args[args.index(contract.SERVE_FLAGS["spin_us"]) + 1] == "20000", container["name"]


GGUF = "DeepSeek-R1-GGUF/DeepSeek-R1-Q4_K_M.gguf"


def test_experts_gguf_replaces_expert_quant_in_the_experts_container_only():
    raw = copy.deepcopy(BASE)
    raw["experts"] = {"gguf": GGUF}
    attention, experts = containers(raw)["attention"], containers(raw)["experts"]
    gguf, quant = contract.SERVE_FLAGS["experts_gguf"], contract.SERVE_FLAGS["expert_quant"]
    # Relative to the volume's root, like model.path, not to the checkpoint directory (model.path "mixtral").
    assert experts["args"][experts["args"].index(gguf) + 1] == f"/models/{GGUF}"
    assert quant not in experts["args"]
    # Nothing else changes: `--expert-quant none` becomes `--experts-gguf FILE` in place.
    before = containers(BASE)["experts"]["args"]
    at = before.index(quant)
    assert experts["args"] == before[:at] + [gguf, f"/models/{GGUF}"] + before[at + 2:]
    # The attention container loads no routed experts: it is left exactly as it was.
    assert gguf not in attention["args"] and attention["args"] == containers(BASE)["attention"]["args"]


@pytest.mark.parametrize("name", SPECS)
def test_without_gguf_the_experts_container_keeps_expert_quant(name):
    args = containers(SPECS[name])["experts"]["args"]
    assert contract.SERVE_FLAGS["experts_gguf"] not in args
    assert args[args.index(contract.SERVE_FLAGS["expert_quant"]) + 1] == parse_spec(SPECS[name]).experts.quantization


def test_gguf_command_line_is_what_tandem_serve_accepts():
    from tandem.cli import build_parser
    from tandem.rpc.cli_serve import options_from_args

    raw = {**SPECS["hostpath-int8"], "experts": {"cpus": 48, "memory": "384Gi", "gguf": GGUF}}
    experts = containers(raw)["experts"]
    args = build_parser().parse_args(experts["command"][1:] + experts["args"])
    assert args.experts_gguf == f"/models/{GGUF}" and args.expert_quant == "none"
    # Every check passes but the last: the file is on the pod's volume, not here.
    with pytest.raises(ValueError, match=f"--experts-gguf: /models/{GGUF} is not a file"):
        options_from_args(args)


# Settings of the attention process alone (the experts process runs no scheduler, and reads the
# CPU tier's dtype from the layout the attention process publishes): (spec section, field, the
# serve flag's key, default, another value).
ATTENTION_ONLY = [
    ("attention", "numSchedulerSteps", "num_scheduler_steps", 1, 8),
    ("kvCache", "dtype", "kv_cache_dtype", "auto", "fp8"),
    ("attention", "schedulingPolicy", "scheduling_policy", "fcfs", "priority"),
]


@pytest.mark.parametrize("section, name, key, default, other", ATTENTION_ONLY, ids=[a[1] for a in ATTENTION_ONLY])
@pytest.mark.parametrize("set_default", [True, False], ids=["default", "set"])
def test_attention_settings_reach_the_attention_container_only_when_not_default(section, name, key, default,
                                                                                 other, set_default):
    raw = copy.deepcopy(BASE)
    raw[section] = {name: default if set_default else other}
    attention, experts = containers(raw)["attention"], containers(raw)["experts"]
    flag = contract.SERVE_FLAGS[key]
    assert flag not in experts["args"]
    if set_default:  # the default renders nothing, so an operator upgrade leaves existing pods as they are
        assert flag not in attention["args"] and attention["args"] == containers(BASE)["attention"]["args"]
    else:
        assert attention["args"][attention["args"].index(flag) + 1] == str(other)


@pytest.mark.parametrize("enabled", [True, False])
def test_prefix_caching_off_reaches_the_attention_container_only(enabled):
    raw = {**BASE, "kvCache": {"prefixCaching": enabled}}
    attention, experts = containers(raw)["attention"], containers(raw)["experts"]
    flag = contract.SERVE_FLAGS["no_enable_prefix_caching"]
    assert flag not in experts["args"]
    if enabled:  # the default renders nothing: existing pods stay as they are
        assert attention["args"] == containers(BASE)["attention"]["args"]
    else:
        assert flag in attention["args"]


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    raw = copy.deepcopy(BASE)
    raw["kvCache"] = {"dtype": "fp8_e5m2"}
    with pytest.raises(SpecError, match="spec.kvCache.dtype must be one of auto, fp8; got 'fp8_e5m2'"):
        parse_spec(raw)


@pytest.mark.parametrize("name", SPECS)
def test_container_args_are_what_tandem_serve_accepts(name):
    """Every rendered command line goes through the real `tandem serve` parser and options check."""
    from tandem.cli import build_parser
    from tandem.rpc.cli_serve import options_from_args

    spec = parse_spec(SPECS[name])
    for container in containers(SPECS[name]).values():
        opts = options_from_args(build_parser().parse_args(container["command"][1:] + container["args"]))
        assert opts.role == container["name"] and opts.kv_shm == contract.KV_SHM_PATH
        assert opts.block_size == spec.kvCache.blockSize and opts.cpu_kv_gib == spec.kvCache.cpuTierGiB
        if opts.role == "attention":
            assert opts.cpu_decode is spec.kvCache.cpuDecode
            assert opts.gpu_memory_fraction == spec.kvCache.gpuMemoryFraction
            assert opts.num_scheduler_steps == spec.attention.numSchedulerSteps
            assert opts.scheduling_policy == spec.attention.schedulingPolicy
            assert opts.kv_cache_dtype == spec.kvCache.dtype
            assert opts.experts_shm is None
        else:
            assert opts.expert_quant == spec.experts.quantization
            assert opts.experts_shm == contract.EXPERTS_SHM_PATH


def test_service_and_pdb_select_the_pods():
    kids = children(BASE)
    pod_labels = kids["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for selector in (kids["Service"]["spec"]["selector"],
                     kids["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                     kids["Deployment"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    ports = {p["name"]: p["port"] for p in kids["Service"]["spec"]["ports"]}
    assert ports == {"grpc": contract.GRPC_PORT, "metrics": contract.METRICS_PORT,
                     "expert-metrics": contract.EXPERTS_METRICS_PORT}


@pytest.mark.parametrize("name", SPECS)
def test_every_service_port_targets_a_container_port(name):
    # A Service port whose named targetPort no container declares is an endpoint Prometheus would
    # mark down: each metrics port must land on the process that serves it, at its port number.
    kids = children(SPECS[name])
    declared = {port["name"]: (container["name"], port["containerPort"])
                for container in kids["Deployment"]["spec"]["template"]["spec"]["containers"]
                for port in container.get("ports", [])}
    targets = {port["name"]: declared.get(port["targetPort"]) for port in kids["Service"]["spec"]["ports"]}
    assert targets == {"grpc": ("attention", contract.GRPC_PORT), "metrics": ("attention", contract.METRICS_PORT),
                       "expert-metrics": ("experts", contract.EXPERTS_METRICS_PORT)}
    experts_args = containers(SPECS[name])["experts"]["args"]
    metrics_flag = experts_args.index(contract.SERVE_FLAGS["metrics_port"])
    assert experts_args[metrics_flag + 1] == str(contract.EXPERTS_METRICS_PORT)
