"""The native CPU expert kernel: compiled on first use into a cache directory, or absent.

Why compile lazily rather than in `pip install`: a setuptools extension build runs in pip's
isolated build environment, which would install an unpinned (multi-GB CUDA) torch to build
against; and a machine without a compiler must still serve. So the extension is built with
`torch.utils.cpp_extension.load` against the torch already installed, cached (rebuilt only
when the sources or torch change), and `make install` warms the cache by running
`python -m tandem.experts.build`. When the build fails, `load_kernel()` returns None and the
executor uses torch's own kernels.

Environment: TANDEM_EXPERTS_KERNEL_DIR (cache directory), TANDEM_EXPERTS_NO_NATIVE=1 (never
build; use the torch kernels).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

# How a weight matrix is stored, as the kernels' `kind` argument takes it (csrc/ops.h's Kind).
KIND_F32, KIND_BF16, KIND_INT8, KIND_INT4 = 0, 1, 2, 3

_CSRC = Path(__file__).parent / "csrc"
_NAME = "tandem_moe_cpu"
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_module = None
_error: str | None = None


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem" / "kernels"
    return Path(os.environ.get("TANDEM_EXPERTS_KERNEL_DIR", default))


def load_kernel(verbose: bool = False):
    """The compiled kernel module, building it on first call; None when it cannot be built."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        if os.environ.get("TANDEM_EXPERTS_NO_NATIVE") == "1":
            _error = "disabled by TANDEM_EXPERTS_NO_NATIVE=1"
            return None
        try:
            _module = _build(verbose)
        except Exception as exc:  # no compiler, no ninja, or a broken toolchain: fall back to torch
            _error = f"{type(exc).__name__}: {exc}"
            _log.warning("native expert kernel unavailable, using torch kernels: %s", _error)
        return _module


def unavailable_reason() -> str | None:
    """Why the native kernel could not be loaded (None when it is loaded or not yet tried)."""
    return _error


def _build(verbose: bool):
    import torch
    from torch.utils.cpp_extension import load

    # The build directory is named by the sources' content and the torch/Python versions, and
    # the sources are compiled from a copy inside it: checkouts at different paths (a fresh
    # clone, a worktree) with the same sources then share one build instead of rebuilding
    # each other's, and an extension built for another torch ABI is never picked up.
    sources = sorted(_CSRC.glob("*.cpp")) + sorted(_CSRC.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources)).hexdigest()[:16]
    tag = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    build_dir = cache_dir() / tag
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for p in sources:
        if not (src / p.name).exists() or (src / p.name).read_bytes() != p.read_bytes():
            tmp = src / f".{p.name}.{os.getpid()}"
            shutil.copyfile(p, tmp)
            os.replace(tmp, src / p.name)  # atomic: a concurrent build never sees half a file
    _put_ninja_on_path()
    return load(
        name=_NAME,
        # moe_cpu.cpp is the Python module; paged_attention.cpp registers torch.ops.tandem.* ops.
        sources=[str(src / p.name) for p in sources if p.suffix == ".cpp"],
        extra_include_paths=[str(src)],
        # No -march: the kernels pick AVX2 or AVX-512 at run time, so one build runs anywhere.
        extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=verbose,
    )


def _put_ninja_on_path() -> None:
    # The pip-installed ninja lives next to this Python; it is not on PATH when the venv's
    # python is run without activating the venv, and cpp_extension looks for it on PATH.
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
