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
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# E2M1 code -> value (bit 3 is the sign)
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
MXFP4_GROUP = 32
E8M0_BIAS = 127


def mxfp4_dequantize(blocks, scales, dtype=jnp.bfloat16):
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] in ``dtype`` (module docstring)."""
    if blocks.shape[-1] != MXFP4_GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {blocks.shape} and scales {scales.shape} do not match "
                         f"(want blocks [..., G, 16], scales [..., G])")
    lut = jnp.asarray(FP4_E2M1)
    b = blocks.astype(jnp.int32)
    vals = jnp.stack([lut[b & 0x0F], lut[b >> 4]], axis=-1).reshape(*blocks.shape[:-1], MXFP4_GROUP)
    scale = jnp.ldexp(jnp.float32(1.0), scales.astype(jnp.int32) - E8M0_BIAS)
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
