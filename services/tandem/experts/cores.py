"""How many CPU cores this process was given: its affinity mask, capped by a cgroup CPU quota."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


def available_cores() -> int:
    """Cores to size expert threads to: pinned CPUs (Kubernetes' static CPU manager sets the
    affinity mask), further capped by a CPU quota (a limit without pinning)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return max(1, min(cores, quota) if quota else cores)


def _cgroup_quota() -> int | None:
    try:
        quota, period = _CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))
