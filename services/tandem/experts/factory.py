"""The one place the model loader gets its expert executor from."""

from __future__ import annotations

from tandem.experts.base import ExpertExecutor, ExpertWeights
from tandem.experts.cpu_executor import KERNELS, CpuExpertExecutor
from tandem.experts.quant import check_quant


def make_expert_executor(
    layers: dict[int, ExpertWeights],
    *,
    threads: int | None = None,
    quant: str = "none",
    kernel: str = "auto",
    group_size: int = 32,
) -> ExpertExecutor:
    """An executor for the routed experts of `layers` (layer index -> weights) on this CPU.

    quant: "none" (weights' own f32/bf16), "int8" (per output channel) or "int4" (group-wise,
    `group_size` 32, 64 or 128). kernel: "auto" (the native kernel when it builds, else torch's),
    "native" or "torch". threads: defaults to the cores this process was given.
    """
    check_quant(quant)
    if kernel not in KERNELS:
        raise ValueError(f"unknown expert kernel {kernel!r}; choose one of {KERNELS}")
    if not isinstance(layers, dict) or not all(isinstance(w, ExpertWeights) for w in layers.values()):
        raise ValueError("layers must map layer index -> ExpertWeights")
    return CpuExpertExecutor(layers, threads=threads, quant=quant, kernel=kernel, group_size=group_size)
