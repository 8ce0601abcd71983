"""Where a HybridModel's pods may run: node affinity, tolerations, node selector, anti-affinity.

By default a pod needs a node that Node Feature Discovery reports as AMD with a single NUMA node,
and that GPU feature discovery reports as having an NVIDIA GPU: the experts container owns one
whole socket's cores and memory, which only means something when the node has one socket.
"""

from __future__ import annotations

from . import names
from .spec import HybridModelSpec

CPU_VENDOR_LABEL = "feature.node.kubernetes.io/cpu-model.vendor_id"
NUMA_LABEL = "feature.node.kubernetes.io/memory-numa"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def default_node_affinity() -> dict:
    """Required affinity to AMD, single-NUMA nodes with a GPU."""
    return {
        REQUIRED: {
            "nodeSelectorTerms": [{
                "matchExpressions": [
                    {"key": CPU_VENDOR_LABEL, "operator": "In", "values": ["AMD"]},
                    # NFD sets memory-numa=true only on multi-NUMA nodes; NotIn also admits
                    # nodes that lack the label, which is what one NUMA node looks like.
                    {"key": NUMA_LABEL, "operator": "NotIn", "values": ["true"]},
                    {"key": GPU_PRESENT_LABEL, "operator": "In", "values": ["true"]},
                ],
            }],
        },
    }


def default_tolerations() -> list[dict]:
    """GPU nodes are commonly tainted so that only GPU workloads land there."""
    return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def build_affinity(spec: HybridModelSpec, name: str) -> dict:
    """The pod's affinity: the spec's node affinity (or the default) and one pod per node.

    Keys the spec leaves out are None rather than missing, so that a setting taken out of the
    spec (onePerNode: false, a preferred node affinity) is taken off the Deployment too.
    """
    return {
        "nodeAffinity": _node_affinity(spec.placement.nodeAffinity or default_node_affinity()),
        "podAntiAffinity": _one_per_node(name) if spec.placement.onePerNode else None,
    }


def _node_affinity(affinity: dict) -> dict:
    # Both fields of a NodeAffinity, the one not given as None.
    return {key: affinity.get(key) for key in (REQUIRED, PREFERRED)} | dict(affinity)


def _one_per_node(name: str) -> dict:
    return {
        REQUIRED: [{
            "labelSelector": {"matchLabels": names.selector_labels(name)},
            "topologyKey": HOSTNAME_TOPOLOGY,
        }],
    }


def build_tolerations(spec: HybridModelSpec) -> list[dict]:
    """The spec's tolerations when given (even an empty list), else the default GPU toleration."""
    if spec.placement.tolerations is not None:
        return [dict(t) for t in spec.placement.tolerations]
    return default_tolerations()


def build_node_selector(spec: HybridModelSpec) -> dict[str, str]:
    """Extra node labels from the spec, on top of the node affinity."""
    return dict(spec.placement.nodeSelector)
