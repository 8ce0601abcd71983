"""The routed experts' stored weights in a shared-memory file, for the attention process's GPU prefill.

A prefill chunk's routed experts run far faster on the GPU than on the socket's cores (2,371
against 122 tok/s on an H100, benchmarks/RESULTS.md round sixteen), with the weights streamed
to it from host memory (`tandem.experts.device_prefill`). The embedded server has them in its
own memory; in the split deployment they are the experts process's. So the experts process
(`tandem serve --role experts --experts-shm PATH`) keeps its stored weights, as its kernels
read them (quantized or not), in one shared-memory file `PATH.bin`, described by a manifest
`PATH.json`, and names both in its ExpertsInfo. The attention process on a GPU maps the file,
page-locks it, and prefills large chunks' experts on the GPU (`SharedPrefill`); decode and small
chunks still go to the experts process. RAM holds one copy of the weights.

The file is written layer by layer, each layer's own memory freed once it is copied, so loading
needs no room for a second copy. The manifest is written last and removed first, so a reader
never takes a half-written file. It records what the weights were made from (`load_key`): an
experts process restarting with the same model files, dtype and quantization maps the file
instead of loading the checkpoint again, and the attention process's mapping stays valid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import logging
import mmap
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem import __version__
from tandem.experts.base import ExpertsUnavailable, ExpertWeights
from tandem.experts import device_prefill
from tandem.experts.device_prefill import DevicePrefill
from tandem.experts.gguf_experts import gguf_files
from tandem.experts.quant import FORMATS, Stored, from_parts, stored_format, stored_parts

log = logging.getLogger(__name__)

DATA_SUFFIX = ".bin"
MANIFEST_SUFFIX = ".json"
LOCK_SUFFIX = ".lock"
TMP_SUFFIX = ".tmp"
FORMAT_VERSION = 1
_ALIGN = 4096  # each tensor starts on a page of its own
_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.int16, torch.int8, torch.uint8)}


class SharedWeightsError(RuntimeError):
    """No usable weights at the path: none published, half written, damaged, or made from other inputs."""


def data_path(path: str | Path) -> Path:
    return Path(f"{path}{DATA_SUFFIX}")


def manifest_path(path: str | Path) -> Path:
    return Path(f"{path}{MANIFEST_SUFFIX}")


def lock_path(path: str | Path) -> Path:
    return Path(f"{path}{LOCK_SUFFIX}")


def load_key(model_dir: str | Path, dtype: str, quant: str, experts_gguf: str | Path | None = None) -> dict:
    """What the stored weights are made from: the files they are read from (name, size, mtime),
    the dtype and quantization asked for, and this code's version."""
    sources = gguf_files(experts_gguf) if experts_gguf else sorted(Path(model_dir).iterdir())
    sources = [p for p in sources if p.is_file()]  # a missing GGUF shard fails the load, by name
    return {
        "tandem": __version__, "format": FORMAT_VERSION, "model": str(Path(model_dir).resolve()),
        "dtype": str(dtype), "quant": quant,
        "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in sources],
    }


@dataclass
class SharedWeights:
    """Published weights, mapped: `layers` are views of `buffer`, the whole file."""

    path: Path
    buffer: torch.Tensor  # uint8 [nbytes], the file mapped shared
    manifest: dict
    layers: dict[int, ExpertWeights]  # stored weights (Stored), views of buffer

    @property
    def generation(self) -> str:
        return self.manifest["generation"]

    @property
    def quant(self) -> str:
        """The executor's quantization the weights were stored for ("none", "int8", "int4")."""
        return self.manifest["quant"]


def share(executor, path: str | Path, key: dict) -> SharedWeights:
    """Move a CPU executor's stored weights into the shared-memory file at `path` and serve them
    from there: layer by layer, each layer's own memory freed (`replace_weights`) once copied.

    One process publishes at a time (an exclusive lock on PATH.lock): two experts processes
    started on one path take turns, each manifest describing the file published with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _publishing(path):
        return _publish(executor, path, key)


@contextlib.contextmanager
def _publishing(path: Path):
    """Held while this process publishes at `path`: a lock on PATH.lock, which the kernel lets go
    of when the process dies. Temporary files left there by a process that died publishing go."""
    with open(lock_path(path), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for published in (data_path(path), manifest_path(path)):
                for stale in path.parent.glob(f"{glob.escape(published.name)}.*{TMP_SUFFIX}"):
                    stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _publish(executor, path: Path, key: dict) -> SharedWeights:
    manifest_path(path).unlink(missing_ok=True)  # first: no reader takes what follows for whole
    data_path(path).unlink(missing_ok=True)  # its memory goes once no process maps it
    layers, nbytes = _layout({i: (p.gate_up, p.down) for i, p in executor.layers.items()})
    tmp = _tmp_path(data_path(path))
    # A tmpfs file is sparse until written, and a write past the volume's size kills the process
    # (SIGBUS): refuse up front. Reserving the space (fallocate) would hold a second copy at once.
    free = shutil.disk_usage(path.parent).free
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"--experts-shm: {path.parent} has {free / 1e9:.2f} GB free, the routed "
                                    f"experts' weights need {nbytes / 1e9:.2f} GB (weights published there "
                                    f"before stay in memory while an attention process maps them; it lets them "
                                    f"go when its next call finds this process down)")
    with open(tmp, "wb") as f:
        f.truncate(nbytes)
    try:
        buffer = torch.from_file(str(tmp), shared=True, size=nbytes, dtype=torch.uint8)
        _move_into(executor, layers, buffer)
        os.replace(tmp, data_path(path))
    finally:
        tmp.unlink(missing_ok=True)  # nothing left when the copy failed
    mapped = {i: ExpertWeights(p.gate_up, p.down) for i, p in executor.layers.items()}  # views of buffer now
    manifest = {"version": FORMAT_VERSION, "generation": uuid.uuid4().hex, "key": key, "quant": executor.quant,
                "nbytes": nbytes, "layers": layers}
    _write_atomically(manifest_path(path), json.dumps(manifest, indent=1))
    log.info("routed experts' weights shared at %s (%.2f GB, generation %s)", data_path(path), nbytes / 1e9,
             manifest["generation"])
    return SharedWeights(path, buffer, manifest, mapped)


def open_shared(path: str | Path, key: dict | None = None) -> SharedWeights:
    """Map the weights published at `path`; with `key`, only if they were made from it.
    SharedWeightsError says why not."""
    path = Path(path)
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except FileNotFoundError:
        raise SharedWeightsError(f"no expert weights published at {manifest_path(path)}") from None
    except (OSError, ValueError) as exc:
        raise SharedWeightsError(f"{manifest_path(path)}: unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("version") != FORMAT_VERSION:
        raise SharedWeightsError(f"{manifest_path(path)}: not a version {FORMAT_VERSION} manifest")
    if key is not None and manifest.get("key") != key:
        raise SharedWeightsError(f"{manifest_path(path)}: made from other inputs (model files, dtype, quantization "
                                 f"or version) than this process's")
    try:
        nbytes = int(manifest["nbytes"])
        size = data_path(path).stat().st_size
        if size < nbytes:
            raise SharedWeightsError(f"{data_path(path)}: {size} bytes, its manifest describes {nbytes}")
        buffer = torch.from_file(str(data_path(path)), shared=True, size=nbytes, dtype=torch.uint8)
        layers = {int(i): _weights(buffer, entry) for i, entry in manifest["layers"].items()}
    except SharedWeightsError:
        raise
    except FileNotFoundError:
        raise SharedWeightsError(f"{data_path(path)} is missing") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SharedWeightsError(f"{manifest_path(path)}: damaged manifest ({type(exc).__name__}: {exc})") from None
    return SharedWeights(path, buffer, manifest, layers)


def give_pages_of_their_own(executor) -> torch.Tensor | None:
    """Move a CPU executor's stored tensors under PAGE_LOCK_MIN_BYTES (scales, small models'
    weights) into one anonymous mapping of their own, layer by layer, so that every storage it
    computes with can be page-locked without locking other memory (see device_prefill.page_lock).
    Returns the mapping, or None when there was nothing to move."""
    layers, nbytes = _layout({i: (p.gate_up, p.down) for i, p in executor.layers.items()}, align=64,
                             move=lambda t: t.untyped_storage().nbytes() < device_prefill.PAGE_LOCK_MIN_BYTES)
    if not nbytes:
        return None
    buffer = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # the tensor holds the mapping
    _move_into(executor, layers, buffer, align=64)
    return buffer


def _layout(weights: dict[int, tuple[Stored, Stored]], align: int = _ALIGN,
            move=lambda t: True) -> tuple[dict, int]:
    """Where each stored tensor `move` takes lies in one buffer (a part None: stays where it is),
    as the manifest's layers, and the buffer's size. Each starts at a multiple of `align`."""
    offset, layers = 0, {}
    for index, pair in sorted(weights.items()):
        entry = {}
        for name, w in zip(("gate_up", "down"), pair):
            parts = []
            for t in stored_parts(w):
                if not move(t):
                    parts.append(None)
                    continue
                if not t.is_contiguous():
                    raise ValueError(f"layer {index} {name}: stored tensors must be contiguous to share")
                offset = _round_up(offset, align)
                parts.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                              "offset": offset})
                offset += t.numel() * t.element_size()
            entry[name] = {"format": stored_format(w), "group_size": getattr(w, "group_size", 0), "parts": parts}
        layers[str(index)] = entry
    return layers, _round_up(offset, align)


def _move_into(executor, layers: dict, buffer: torch.Tensor, align: int = _ALIGN) -> None:
    """Copy the executor's stored tensors into `buffer` where `layers` (a _layout) places them,
    layer by layer, each layer served from there once copied (`replace_weights` frees its own)."""
    for index, entry in layers.items():
        p = executor.layers[int(index)]
        stored = []
        for name in ("gate_up", "down"):
            parts = list(stored_parts(getattr(p, name)))
            for k, part in enumerate(entry[name]["parts"]):
                if part is not None:
                    parts[k] = _view(buffer, part, align).copy_(parts[k])
            stored.append(from_parts(entry[name]["format"], tuple(parts), entry[name]["group_size"]))
        executor.replace_weights(int(index), *stored)


def _view(buffer: torch.Tensor, part: dict, align: int = _ALIGN) -> torch.Tensor:
    """The tensor a layout's part describes, a view of `buffer`; ValueError when it lies outside."""
    dtype = _DTYPES[part["dtype"]]
    shape = [int(n) for n in part["shape"]]
    size = torch.empty((), dtype=dtype).element_size()
    for n in shape:
        size *= n
    start = int(part["offset"])
    if start < 0 or start % align or start + size > buffer.numel():
        raise ValueError(f"a tensor at {start}..{start + size} outside the file's {buffer.numel()} bytes")
    return buffer[start:start + size].view(dtype).view(shape)


def _views(buffer: torch.Tensor, entry: dict) -> list[torch.Tensor]:
    return [_view(buffer, part) for part in entry["parts"]]


def _weights(buffer: torch.Tensor, entry: dict) -> ExpertWeights:
    stored = []
    for name in ("gate_up", "down"):
        if entry[name]["format"] not in FORMATS:
            raise ValueError(f"unknown format {entry[name]['format']!r}")
        stored.append(from_parts(entry[name]["format"], tuple(_views(buffer, entry[name])),
                                 int(entry[name]["group_size"])))
    return ExpertWeights(*stored)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _tmp_path(path: Path) -> Path:
    """A temporary name next to `path` that no other process or thread picks."""
    return path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def _write_atomically(path: Path, text: str) -> None:
    tmp = _tmp_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class SharedPrefill:
    """The attention process's expert executor when its experts process shares its weights.

    `forward` is the client's (decode, and chunks under `min_tokens`). `forward_on_device` maps
    the weights the experts process advertises (ExpertsInfo's experts_shm_path and generation, as
    its client last saw them) and computes the chunk on the GPU with `DevicePrefill` over them,
    page-locked if `pin`; a newer generation is mapped afresh. Where there is nothing to map (no
    file advertised, or not visible from here: another host) it declines, and the experts
    process computes the chunk, as without sharing; why is logged once.
    """

    def __init__(self, client, min_tokens: int, pin: bool):
        self.inner, self.min_tokens, self.pin = client, min_tokens, pin
        self.prefill: DevicePrefill | None = None
        self.shared: SharedWeights | None = None
        self.calls = 0  # layer calls computed on the GPU, across mappings
        self._declined: tuple | None = None  # (path, generation) found unusable, warned about

    def forward(self, layer, hidden, topk_ids, topk_weights):
        try:
            return self.inner.forward(layer, hidden, topk_ids, topk_weights)
        except ExpertsUnavailable:
            # The experts process is down, and its successor may publish other weights: let go of
            # these, so that their memory is not held twice (it comes back when that one answers).
            self.release()
            raise

    def forward_on_device(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] < self.min_tokens:
            return None
        prefill = self._prefill(x.device)
        out = None if prefill is None else prefill.forward_on_device(layer, x, ids, weights)
        self.calls += out is not None
        return out

    def prepare(self, device: torch.device) -> bool:
        """Map (and page-lock) what the experts process advertises now, rather than in the first
        large prefill: locking a large model's pages takes seconds. Whether there is a mapping."""
        return self._prefill(torch.device(device)) is not None

    def _prefill(self, device: torch.device) -> DevicePrefill | None:
        info = getattr(self.inner, "last_info", None)
        advertised = (info.experts_shm_path, info.experts_shm_generation) if info is not None else ("", "")
        if self.shared is not None and (str(self.shared.path), self.shared.generation) == advertised:
            return self.prefill
        self.release()
        if not advertised[0] or advertised == self._declined:
            return None
        try:
            shared = open_shared(advertised[0])
            if shared.generation != advertised[1]:
                raise SharedWeightsError(f"{manifest_path(advertised[0])} holds generation {shared.generation}, the "
                                         f"experts process serves {advertised[1]}")
        except SharedWeightsError as exc:
            self._declined = advertised
            log.warning("large prefill chunks' experts stay on the experts process: %s", exc)
            return None
        self.shared = shared
        self.prefill = DevicePrefill(self.inner, device, self.min_tokens, pin=self.pin, own_pages=True,
                                     weights={i: (w.gate_up, w.down) for i, w in shared.layers.items()})
        log.info("large prefill chunks' experts run on %s, from the experts process's weights mapped at %s%s",
                 device, data_path(shared.path), " (page-locked)" if self.prefill.pinned else "")
        return self.prefill

    def release(self) -> None:
        """Unmap the weights (unlocking them first)."""
        if self.prefill is not None:
            self.prefill.unlock()
        self.prefill = self.shared = None
