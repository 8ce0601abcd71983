"""The native CPU expert kernel: compiled on first use into a cache directory, or absent.

Why compile lazily rather than in `pip install`: a setuptools extension build runs in pip's
isolated build environment, which would install an unpinned (multi-GB CUDA) torch to build
against; and a machine without a compiler must still serve. So the extension is built with
`torch.utils.cpp_extension.load` against the torch already installed, cached (rebuilt only
when the sources or torch change), and `make install` warms the cache by running
`python -m tandem.experts.build`. When the build fails, `load_kernel()` returns None and the
executor uses torch's own kernels.

Environment: TANDEM_EXPERTS_KERNEL_DIR (cache directory), TANDEM_EXPERTS_NO_NATIVE=1 (never
build; use the torch kernels). A build directory marked built is imported as it is, without
ninja or a compiler and without writing to it: the container images build the kernel into
/opt/tandem/kernels at image build time and run with a read-only root filesystem.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

# How a weight matrix is stored, as the kernels' `kind` argument takes it (csrc/ops.h's Kind).
KIND_F32, KIND_BF16, KIND_INT8, KIND_INT4 = 0, 1, 2, 3

_CSRC = Path(__file__).parent / "csrc"
_NAME = "tandem_moe_cpu"
_BUILT = "built"  # written into a build directory once its library has been built and imported
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

    # The build directory is named by the sources' content, the torch/Python versions and the
    # environment they are installed in, and the sources are compiled from a copy inside it:
    # checkouts at different paths (a fresh clone, a worktree) using one environment share one
    # build, an extension built for another torch ABI is never picked up, and two environments
    # (whose build.ninja files name their own include paths) do not rebuild each other's.
    sources = sorted(_CSRC.glob("*.cpp")) + sorted(_CSRC.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources)
                            + str(Path(torch.__file__).resolve().parent).encode()
                            + sysconfig.get_path("include").encode()).hexdigest()[:16]
    tag = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    build_dir = cache_dir() / tag
    if (build_dir / _BUILT).exists():  # no ninja run, no lock, no writes: a read-only image's prebuilt kernel
        return _import(build_dir / f"{_NAME}.so")
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if (build_dir / _BUILT).exists():  # built by the process we waited for
            return _import(build_dir / f"{_NAME}.so")
        for p in sources:
            if not (src / p.name).exists() or (src / p.name).read_bytes() != p.read_bytes():
                tmp = src / f".{p.name}.{os.getpid()}"
                shutil.copyfile(p, tmp)
                os.replace(tmp, src / p.name)  # atomic: a process loading the build never sees half a file
        _put_ninja_on_path()
        module = load(
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
        (build_dir / _BUILT).touch()  # after the import: the library is whole and loads
        return module


def _import(path: Path):
    """The extension at `path`, imported as torch's `load` would import it."""
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One process at a time builds (or loads) in `build_dir`.

    torch's own lock is a file it creates and deletes; a build killed in between leaves it, and
    every later `load` waits for it forever. Ours is an flock, which the kernel drops when its
    holder dies: whoever holds it knows that no live build owns torch's file, and removes it."""
    with open(build_dir / "tandem-build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"  # torch.utils.cpp_extension's FileBaton
            if stale.exists():
                _log.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


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
