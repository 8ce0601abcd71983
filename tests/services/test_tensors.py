"""Tensors cross the Experts API as raw bytes with dtype and shape."""

from __future__ import annotations

import pytest
import torch

from tandem.rpc.gen import experts_pb2
from tandem.rpc.tensors import BadTensor, from_proto, to_proto


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32])
def test_round_trip_is_exact(dtype):
    t = (torch.randn(5, 7) * 100).to(dtype)
    msg = to_proto(t)
    assert msg.dtype == str(dtype).removeprefix("torch.") and list(msg.shape) == [5, 7]
    back = from_proto(experts_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and torch.equal(back, t)


def test_non_contiguous_and_empty_tensors():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # [4, 3], not contiguous
    assert torch.equal(from_proto(to_proto(t)), t)
    empty = from_proto(to_proto(torch.empty(0, 64)))
    assert empty.shape == (0, 64)


def test_wrong_byte_count_names_the_field():
    msg = to_proto(torch.zeros(2, 3))
    msg.shape[:] = [2, 4]
    with pytest.raises(BadTensor, match=r"^hidden: 24 bytes of data for shape \[2, 4\]"):
        from_proto(msg, "hidden")


def test_unknown_dtype_names_the_field():
    with pytest.raises(BadTensor, match="topk_ids: unknown dtype 'complex64'"):
        from_proto(experts_pb2.Tensor(dtype="complex64", shape=[1], data=b"12345678"), "topk_ids")


def test_unsupported_dtype_cannot_be_sent():
    with pytest.raises(ValueError, match="cannot send a torch.bool tensor"):
        to_proto(torch.zeros(2, dtype=torch.bool))


@pytest.mark.parametrize("shape", [[2**62, 2**62, 0], [0, 2**40, 2**40], [2**33]])
def test_shapes_no_message_can_carry_name_the_field(shape):
    # [2**62, 2**62, 0] holds no element, but torch overflows sizing its storage
    with pytest.raises(BadTensor, match=r"^hidden: shape \[.*\] is too large"):
        from_proto(experts_pb2.Tensor(dtype="float32", shape=shape), "hidden")
