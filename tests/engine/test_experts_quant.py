"""The int8 and int4 weight formats on their own: codes, layout and per-weight error."""

from __future__ import annotations

import pytest
import torch

from tandem.experts.quant import (
    INT4_ISCALE_MAX,
    Int4Weight,
    dequantize_int4,
    dequantize_int8,
    quantize,
    quantize_int4,
    quantize_int8,
    to_integer_scales,
    unpack_int4,
)


@pytest.fixture
def w():
    return torch.randn(3, 40, 128, generator=torch.Generator().manual_seed(0))


def test_int8_error_is_at_most_half_a_step(w):
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (3, 40)
    assert q.q.abs().max() == 127  # the largest weight of each row uses the full range
    err = (dequantize_int8(q) - w).abs()
    assert (err <= q.scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(w, group):
    q = quantize_int4(w, group)
    assert q.packed.shape == (3, 40, 64) and q.scale.shape == (3, 40, 128 // group)
    codes = unpack_int4(q)
    assert codes.max() <= 15 and codes.min() == 0  # each group's minimum maps to code 0
    step = q.scale.float().repeat_interleave(group, dim=-1)
    assert ((dequantize_int4(q) - w).abs() <= step / 2 + 1e-3 * step).all()


def test_int4_block_layout_puts_weight_j_and_j_plus_16_in_one_byte():
    # A ramp 0..15 then 15..0 per 32-block: codes are the ramp itself (scale 1, min 0).
    block = torch.cat([torch.arange(16.0), torch.arange(15.0, -1, -1)])
    q = quantize_int4(block.repeat(1, 1, 2), 32)  # [1, 1, 64]
    first = q.packed[0, 0, :16]
    assert first[0].item() == 0 | (15 << 4) and first[15].item() == 15 | (0 << 4)
    assert torch.equal(unpack_int4(q)[0, 0], block.repeat(2).to(torch.uint8))


@pytest.mark.parametrize("group", [32, 128])
def test_integer_scales_hold_the_same_weights(w, group):
    q = quantize_int4(w * torch.linspace(0.01, 3.0, 128), group)  # group scales spread 300x along a row
    iq = to_integer_scales(q)
    g = 128 // group
    assert iq.scale.dtype == torch.int16 and iq.scale.shape == (3, 40, g + 2)
    assert iq.packed is q.packed and iq.min is q.min and to_integer_scales(iq) is iq
    assert iq.scale[..., :g].abs().amax(-1).eq(INT4_ISCALE_MAX).all()  # each row's largest scale uses the range
    top = q.scale.float().amax(-1, keepdim=True)
    assert ((iq.group_scales() - q.scale.float()).abs() <= top / INT4_ISCALE_MAX / 2 * 1.001).all()
    step = top.repeat_interleave(128, dim=-1)  # a weight moves by at most 15 x the scale's rounding
    assert ((dequantize_int4(iq) - dequantize_int4(q)).abs() <= 15 * step / INT4_ISCALE_MAX / 2 * 1.001).all()


def test_integer_scales_keep_signs_and_zero_rows():
    # Q4_0 from a GGUF file: w = d * (q - 8) with d of either sign, min = -8 d; and an all-zero row.
    d = torch.tensor([[[0.5, -0.25], [0.0, 0.0]]], dtype=torch.float16)  # [1, 2, 2]
    q = Int4Weight(packed=torch.full((1, 2, 32), 0x9A, dtype=torch.uint8), scale=d, min=-8 * d, group_size=32)
    iq = to_integer_scales(q)
    assert iq.scale[0, 0, :2].tolist() == [INT4_ISCALE_MAX, -8192]  # -8191.5 rounds to even
    assert torch.equal(iq.scale[0, 1, :2], torch.zeros(2, dtype=torch.int16))
    assert (dequantize_int4(iq) - dequantize_int4(q)).abs().max() <= 15 * 0.5 / INT4_ISCALE_MAX / 2 * 1.001


def test_all_zero_rows_stay_zero():
    z = torch.zeros(1, 4, 64)
    assert torch.equal(dequantize_int8(quantize_int8(z)), z)
    assert torch.equal(dequantize_int4(quantize_int4(z)), z)


def test_none_keeps_bf16_and_converts_fp16():
    assert quantize(torch.zeros(1, 2, 32, dtype=torch.bfloat16), "none").dtype == torch.bfloat16
    assert quantize(torch.zeros(1, 2, 32, dtype=torch.float16), "none").dtype == torch.float32


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.zeros(4, 32), "3-d tensor"),
        (torch.zeros(1, 4, 32, dtype=torch.int32), "floating point"),
        (torch.full((1, 4, 32), float("nan")), "NaN or infinity"),
        (torch.zeros(1, 4, 48), "multiple of the group size"),
    ],
)
def test_bad_weights_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize(bad, "int4")
