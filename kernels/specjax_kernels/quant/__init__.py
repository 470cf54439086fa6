"""Quantized weight formats that published checkpoints store, dequantized on the device.

A quantized target keeps its weights in their stored format in device memory and dequantizes one
layer's tensors where the layer runs (inside the layer scan), so a bf16 copy of the whole target is
never built. These functions are that step, in plain jnp (they fuse into the consumer's operand
under jit); tests/kernels/test_quant.py checks them against independent NumPy decoders.

MXFP4 (OCP Microscaling, E2M1 elements with an E8M0 scale per 32; gpt-oss's expert weights):
  blocks [..., G, 16] uint8: 32 FP4 values per group, two per byte, the low nibble first (the even
  index); scales [..., G] uint8: the group's power of two, biased by 127. value = lut[nibble] *
  2 ** (scale - 127) with lut the 16 E2M1 codes (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6).
  The output's last axis is the group axis times 32.

FP8 with block scales (DeepSeek-V3 / Kimi / GLM / MiniMax FP8 releases: ``weight`` float8_e4m3fn
[out, in] and ``weight_scale_inv`` float32 [ceil(out / 128), ceil(in / 128)]): value =
float(weight) * weight_scale_inv[row // 128, col // 128] (the name says "inverse": it multiplies).

Packed integers (compressed-tensors "pack-quantized", e.g. Kimi K2.5's int4 experts: ``weight_packed``
int32 [out, ceil(in * bits / 32)] and ``weight_scale`` [out, ceil(in / group)]): each int32 holds
32 / bits values, the first in the lowest bits, each stored as value + 2 ** (bits - 1) (unsigned);
value = (code - 2 ** (bits - 1)) * weight_scale[row, col // group] (symmetric: no zero point).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# E2M1 code -> value (bit 3 is the sign)
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
MXFP4_GROUP = 32
E8M0_BIAS = 127


def mxfp4_dequantize(blocks, scales, dtype=jnp.bfloat16, *, transposed: bool = False):
    """[..., R, G, 16] uint8 blocks and [..., R, G] uint8 scales -> [..., R, G * 32] in ``dtype``
    (module docstring); with ``transposed``, [..., G * 32, R] (a matmul's [in, out] operand from the
    stored [out, in] rows), written in that layout in one pass rather than transposed afterwards.

    Every E2M1 value times a power of two is exact in bf16 (two mantissa bits; fp32's exponent range),
    so the products are formed in ``dtype`` when it is bf16 or wider, with no fp32 intermediate."""
    if blocks.shape[-1] != MXFP4_GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {blocks.shape} and scales {scales.shape} do not match "
                         f"(want blocks [..., G, 16], scales [..., G])")
    exact = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))
    work = jnp.dtype(dtype) if exact else jnp.float32
    lut = jnp.asarray(FP4_E2M1, work)
    if transposed:  # move the (small, uint8) rows axis last before expanding: [..., G, 16, R]
        if blocks.ndim < 3:
            raise ValueError(f"mxfp4: transposed needs blocks [..., R, G, 16], got {blocks.shape}")
        blocks = jnp.moveaxis(blocks, -3, -1)
        scales = jnp.moveaxis(scales, -2, -1)
        b = blocks.astype(jnp.int32)
        vals = jnp.stack([lut[b & 0x0F], lut[b >> 4]], axis=-2)  # [..., G, 16, 2, R]
        scale = jnp.ldexp(jnp.ones((), work), scales.astype(jnp.int32) - E8M0_BIAS)  # [..., G, R]
        vals = vals * scale[..., :, None, None, :]
        return vals.reshape(*vals.shape[:-4], -1, vals.shape[-1]).astype(dtype)
    b = blocks.astype(jnp.int32)
    vals = jnp.stack([lut[b & 0x0F], lut[b >> 4]], axis=-1).reshape(*blocks.shape[:-1], MXFP4_GROUP)
    scale = jnp.ldexp(jnp.ones((), work), scales.astype(jnp.int32) - E8M0_BIAS)
    return (vals * scale[..., None]).reshape(*blocks.shape[:-2], -1).astype(dtype)


def fp8_block_dequantize(weight, scale_inv, block: tuple[int, int] = (128, 128), dtype=jnp.bfloat16):
    """float8 [..., O, I] with float32 block scales [..., ceil(O/bo), ceil(I/bi)] -> [..., O, I] in ``dtype``."""
    o, i = weight.shape[-2:]
    bo, bi = block
    want = (-(-o // bo), -(-i // bi))
    if tuple(scale_inv.shape[-2:]) != want or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"fp8 block scales {scale_inv.shape} do not fit weight {weight.shape} with blocks {block} "
                         f"(want [..., {want[0]}, {want[1]}])")
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), bo, axis=-2)[..., :o, :], bi, axis=-1)[..., :i]
    return (weight.astype(jnp.float32) * s).astype(dtype)


def int_pack_dequantize(packed, scale, num_bits: int, in_features: int, group_size: int, dtype=jnp.bfloat16):
    """int32 [..., O, P] packed codes and [..., O, G] scales -> [..., O, in_features] in ``dtype``
    (module docstring); group_size = in_features for one scale per row."""
    per_word = 32 // num_bits
    if num_bits not in (2, 4, 8) or packed.shape[-1] != -(-in_features // per_word):
        raise ValueError(f"int pack: {num_bits}-bit codes of {in_features} inputs need [..., O, "
                         f"{-(-in_features // per_word)}] int32 words; got {packed.shape}")
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] != -(-in_features // group_size):
        raise ValueError(f"int pack: scales {scale.shape} do not fit {packed.shape[:-1]} rows of "
                         f"{in_features} inputs in groups of {group_size}")
    words = packed.astype(jnp.uint32)
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * num_bits
    codes = (words[..., None] >> shifts) & ((1 << num_bits) - 1)
    codes = codes.reshape(*packed.shape[:-1], -1)[..., :in_features].astype(jnp.int32) - (1 << (num_bits - 1))
    s = jnp.repeat(scale.astype(jnp.float32), group_size, axis=-1)[..., :in_features]
    return (codes.astype(jnp.float32) * s).astype(dtype)
