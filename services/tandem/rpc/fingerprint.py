"""A checkpoint's fingerprint: how the two processes of a split pair know they serve one model.

The shapes (hidden size, experts, MoE layers) say whether an experts process can answer the
attention process's calls, not whether its answers are right: two checkpoints of one
architecture, or a fine-tune and its base, have the same shapes and other weights. Each process
hashes the checkpoint it was started on (`--model`); the experts process names its hash in
ExpertsInfo and on every gRPC Forward answer, and the attention process serves only from one
whose hash is its own (tandem.rpc.experts_client).

The hash covers config.json (parsed: formatting aside) and each weight file's name, size,
safetensors header (every tensor's name, dtype, shape and offset) and SAMPLES slices of its
data, spread over the file. That is a few reads a file, not the weights: cheap on both
processes, even for a checkpoint of hundreds of GB. It names no path and no time, so two
copies of a checkpoint (two volumes, two downloads) agree. Being a sample, it tells
checkpoints apart, not a checkpoint from a copy with a few bytes changed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tandem.model.config import ModelError
from tandem.model.loader import checkpoint_files

SAMPLES = 16  # slices of each weight file's data
SAMPLE_BYTES = 4096
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on the header


def model_fingerprint(model_dir: str | Path) -> str:
    """The checkpoint's fingerprint: 32 hex digits (see the module docstring)."""
    model_dir = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    config = json.loads((model_dir / "config.json").read_text())
    _add(digest, json.dumps(config, sort_keys=True).encode())
    for path in _weight_files(model_dir):
        _add(digest, path.name.encode())
        _add_weight_file(digest, path)
    return digest.hexdigest()


def _weight_files(model_dir: Path) -> list[Path]:
    try:
        return checkpoint_files(model_dir)
    except ModelError:  # an experts process whose experts all come from a GGUF file may have none
        return []


def _add(digest, data: bytes) -> None:
    digest.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two sequences hash as one
    digest.update(data)


def _add_weight_file(digest, path: Path) -> None:
    """The file's size, its safetensors header, and SAMPLES slices of what follows it."""
    size = path.stat().st_size
    _add(digest, size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        start = 8 + header_bytes if header_bytes <= min(_HEADER_LIMIT, size - 8) else 0
        _add(digest, f.read(start - 8) if start else b"")
        for offset in _sample_offsets(start, size):
            f.seek(offset)
            _add(digest, f.read(SAMPLE_BYTES))


def _sample_offsets(start: int, end: int) -> list[int]:
    """SAMPLES offsets of SAMPLE_BYTES slices spread evenly over [start, end), the last one ending at `end`."""
    last = max(start, end - SAMPLE_BYTES)
    return sorted({start + (last - start) * i // (SAMPLES - 1) for i in range(SAMPLES)})
