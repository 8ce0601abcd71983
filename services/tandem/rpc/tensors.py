"""Torch tensors to and from the `tandem.v1.Tensor` message: raw bytes plus dtype and shape."""

from __future__ import annotations

import math

import torch

from tandem.rpc.gen import experts_pb2

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class BadTensor(ValueError):
    """A Tensor message that cannot be decoded; `field` names the request field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def to_proto(tensor: torch.Tensor) -> experts_pb2.Tensor:
    """Encodes a tensor (any device) as C-order bytes; the byte order is the host's (little-endian)."""
    if tensor.dtype not in _NAMES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor; supported: {sorted(DTYPES)}")
    t = tensor.detach().to("cpu").contiguous()
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return experts_pb2.Tensor(dtype=_NAMES[t.dtype], shape=list(t.shape), data=data)


def from_proto(msg: experts_pb2.Tensor, field_name: str = "tensor") -> torch.Tensor:
    """Decodes a Tensor message into a new CPU tensor, checking its dtype and byte count."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadTensor(field_name, f"unknown dtype {msg.dtype!r}; expected one of {sorted(DTYPES)}")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise BadTensor(field_name, f"negative dimension in shape {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise BadTensor(
            field_name, f"{len(msg.data)} bytes of data for shape {list(shape)} {msg.dtype} "
            f"(expected {expected})")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer wants a writable buffer, and the result must own its memory.
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)
