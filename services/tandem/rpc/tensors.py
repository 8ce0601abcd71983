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
# A message is at most 1 GiB, so no tensor it carries has more elements than this. The bound
# counts zero dimensions as 1: torch sizes a tensor's storage from its shape before it looks
# for a zero, and a shape like [2**62, 2**62, 0] overflows that computation.
MAX_ELEMENTS = 1 << 32


class BadTensor(ValueError):
    """A Tensor message that cannot be decoded; `field` names the request field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def to_proto(tensor: torch.Tensor) -> experts_pb2.Tensor:
    """Encodes a tensor (any device) as C-order bytes; the byte order is the host's (little-endian)."""
    if tensor.dtype not in _NAMES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor; supported: {sorted(DTYPES)}")
    return experts_pb2.Tensor(dtype=_NAMES[tensor.dtype], shape=list(tensor.shape), data=tensor_bytes(tensor))


def from_proto(msg: experts_pb2.Tensor, field_name: str = "tensor") -> torch.Tensor:
    """Decodes a Tensor message into a new CPU tensor, checking its dtype and byte count."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadTensor(field_name, f"unknown dtype {msg.dtype!r}; expected one of {sorted(DTYPES)}")
    shape = tuple(msg.shape)
    check_shape(shape, field_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise BadTensor(
            field_name, f"{len(msg.data)} bytes of data for shape {list(shape)} {msg.dtype} "
            f"(expected {expected})")
    try:
        # bytearray: torch.frombuffer wants a writable buffer, and the result must own its memory.
        return tensor_from_bytes(bytearray(msg.data), dtype, shape)
    except RuntimeError as exc:  # a shape torch refuses that the checks above let through
        raise BadTensor(field_name, f"shape {list(shape)}: {exc}") from None


def check_shape(shape: tuple[int, ...], field_name: str) -> None:
    """BadTensor for a negative dimension, or dimensions no message can carry (MAX_ELEMENTS)."""
    if any(d < 0 for d in shape):
        raise BadTensor(field_name, f"negative dimension in shape {list(shape)}")
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise BadTensor(field_name, f"shape {list(shape)} is too large: its dimensions, zeros counted as 1, "
                                    f"multiply to more than {MAX_ELEMENTS} elements")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor (any device) as C-order bytes in the host's byte order (little-endian)."""
    t = tensor.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensor_from_bytes(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over `data` (a fresh bytearray it keeps: no copy), which must hold exactly its bytes."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)
