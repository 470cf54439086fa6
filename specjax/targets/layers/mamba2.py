"""Mamba-2 mixer for frozen targets (forward only), numerics as transformers' NemotronHMamba2Mixer.

    zxbcdt = x @ in_proj                       split [z: I | xBC: I + 2GN | dt: H]   (that order)
    xBC    = silu(causal depthwise conv1d(xBC) + conv bias)       kernel K (4) over time
    x, B, C = split(xBC, [I, GN, GN])          x -> [H, P] heads, B/C -> [G, N] groups
    dt     = clamp(softplus(dt + dt_bias), *dt_limit);  A = -exp(A_log)
    y      = SSD scan(x, dt, A, B, C) + D * x           (specjax_kernels.ssd, fp32)
    y      = grouped gated RMSNorm(y, z): (y * silu(z)) normalised per group of I / n_groups
             channels, times the weight (fp32), cast to the model dtype
    out    = y @ out_proj
with I = num_heads * head_dim. transformers 5.24 clamps dt to (time_step_min, inf), not to the
config's ``time_step_limit``; ``dt_limit`` here is whatever the target config passes.

Packed sequences: ``segment_ids`` [B, T] (0 = padding, its own segment). The conv window and the SSM
state both restart where the id changes, so each packed document sees exactly what it would see if
run alone (taps from the previous document are treated as zero padding).

Params (x@W layout): in_proj.kernel [D, I+conv_dim+H], conv1d.kernel [K, 1, conv_dim] (HF
[conv_dim, 1, K] transposed), conv1d.bias [conv_dim] (optional), dt_bias/A_log/D [H],
norm.scale [I], out_proj.kernel [I, D].
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from specjax import mesh as meshlib
from specjax_kernels.ssd import ssd
from specjax_kernels.ssd.context_parallel import previous_shard, ssd_context_parallel


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
    """Static shape/numerics of one Mamba-2 mixer (hashable; closed over by jitted code)."""

    num_heads: int  # H
    head_dim: int  # P
    n_groups: int  # G (B/C groups; also the gated-norm groups)
    state_size: int  # N
    conv_kernel: int = 4  # K
    chunk_size: int = 128  # SSD chunk length (xla implementation)
    eps: float = 1e-5  # gated RMSNorm epsilon
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    ssd_implementation: Optional[str] = None  # None/"auto" | "reference" | "xla"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.intermediate_size + self.conv_dim + self.num_heads

    def validate(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"mamba_num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups} "
                "(each group of B/C serves num_heads / n_groups heads)"
            )
        if self.conv_kernel < 1 or self.chunk_size < 1:
            raise ValueError(f"conv_kernel={self.conv_kernel} and chunk_size={self.chunk_size} must be >= 1")


def causal_depthwise_conv1d(x_btc, kernel_kc, bias_c=None, segment_ids_bt=None):
    """out[t] = bias + sum_j kernel[K-1-j] * x[t-j], j = 0..K-1; taps before t = 0 or in an earlier
    segment count as zero. Accumulates in fp32, returns x's dtype (HF runs the conv in the weight dtype)."""
    k = kernel_kc.shape[0]
    x32 = x_btc.astype(jnp.float32)
    w = kernel_kc.astype(jnp.float32)
    out = x32 * w[k - 1]
    for j in range(1, min(k, x_btc.shape[1] + 1)):
        shifted = jnp.pad(x32, [(0, 0), (j, 0), (0, 0)])[:, : x_btc.shape[1]]
        if segment_ids_bt is not None:
            prev = jnp.pad(segment_ids_bt, [(0, 0), (j, 0)], constant_values=-1)[:, : x_btc.shape[1]]
            shifted = jnp.where((prev == segment_ids_bt)[..., None], shifted, 0.0)
        out = out + shifted * w[k - 1 - j]
    if bias_c is not None:
        out = out + bias_c.astype(jnp.float32)
    return out.astype(x_btc.dtype)


def gated_group_rms_norm(y, z, scale, n_groups: int, eps: float, out_dtype):
    """(y * silu(z)) RMS-normalised over each of ``n_groups`` contiguous channel groups, times the
    weight; all fp32 (HF's scan output is fp32), then cast to ``out_dtype``."""
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    shape = h.shape
    hg = h.reshape(shape[:-1] + (n_groups, shape[-1] // n_groups))
    hg = hg * jax.lax.rsqrt(jnp.mean(jnp.square(hg), axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * hg.reshape(shape)).astype(out_dtype)


def mamba2_mixer(p: dict, dims: Mamba2Dims, x_btd, segment_ids_bt=None):
    """One Mamba-2 mixer (no residual, no pre-norm). x [B, T, D] -> [B, T, D] in x's dtype."""
    b, t, _ = x_btd.shape
    i_size, h, n, g = dims.intermediate_size, dims.num_heads, dims.state_size, dims.n_groups
    zxbcdt = x_btd @ p["in_proj"]["kernel"]
    z = zxbcdt[..., :i_size]
    xbc = zxbcdt[..., i_size : i_size + dims.conv_dim]
    dt = zxbcdt[..., i_size + dims.conv_dim :]

    conv = p["conv1d"]
    kernel = conv["kernel"].reshape(dims.conv_kernel, dims.conv_dim)
    cp_mesh = meshlib.context_mesh()
    if cp_mesh is not None:
        meshlib.check_context_divides(t, cp_mesh, "Mamba-2 mixer")
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        xbc = jax.nn.silu(_conv1d_context_parallel(xbc, kernel, conv.get("bias"), segment_ids_bt, cp_mesh))
    else:
        xbc = jax.nn.silu(causal_depthwise_conv1d(xbc, kernel, conv.get("bias"), segment_ids_bt))
    xs = xbc[..., :i_size].reshape(b, t, h, dims.head_dim)
    bm = xbc[..., i_size : i_size + g * n].reshape(b, t, g, n)
    cm = xbc[..., i_size + g * n :].reshape(b, t, g, n)

    dt = jax.nn.softplus(dt.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    lo, hi = dims.dt_limit
    dt = jnp.clip(dt, lo, hi)
    a = -jnp.exp(p["A_log"].astype(jnp.float32))
    if cp_mesh is not None:
        y = ssd_context_parallel(xs, dt, a, bm, cm, D=p["D"], chunk_size=dims.chunk_size,
                                 segment_ids=segment_ids_bt, mesh=cp_mesh, axis=meshlib.CONTEXT_AXIS,
                                 batch_spec=_batch_axes(b, cp_mesh), implementation=dims.ssd_implementation)
    else:
        y = ssd(xs, dt, a, bm, cm, D=p["D"], chunk_size=dims.chunk_size, segment_ids=segment_ids_bt,
                implementation=dims.ssd_implementation)
    y = gated_group_rms_norm(y.reshape(b, t, i_size), z, p["norm"]["scale"], g, dims.eps, x_btd.dtype)
    return y @ p["out_proj"]["kernel"]


def _batch_axes(batch: int, mesh):
    return meshlib.spec_for((batch,), ("batch",), mesh)[0]


def _conv1d_context_parallel(x_btc, kernel_kc, bias_c, segment_ids_bt, mesh):
    """The causal conv with T split over `context`: each shard prepends a halo of the previous
    shard's last K-1 rows (and their segment ids; shard 0 gets ids -1, i.e. nothing before t = 0),
    convolves locally and drops the halo rows. Exact: the window of row t only reaches t-K+1."""
    k = kernel_kc.shape[0]
    axis, n = meshlib.CONTEXT_AXIS, mesh.shape[meshlib.CONTEXT_AXIS]
    t_local = x_btc.shape[1] // n
    if k > 1 and t_local < k - 1:
        raise ValueError(f"Mamba-2 conv1d under context parallelism: each of the {n} shards holds {t_local} "
                         f"rows, fewer than the conv halo {k - 1}; use a longer sequence or lower context.")
    bs = _batch_axes(x_btc.shape[0], mesh)

    def body(x, w, seg, *bias):
        if k > 1:
            c = jax.lax.axis_index(axis)
            halo = previous_shard(x[:, t_local - (k - 1):], axis, n)
            halo_seg = jnp.where(c > 0, previous_shard(seg[:, t_local - (k - 1):], axis, n), -1)
            x = jnp.concatenate([halo, x], axis=1)
            seg = jnp.concatenate([halo_seg, seg], axis=1)
        out = causal_depthwise_conv1d(x, w, bias[0] if bias else None, seg)
        return out[:, out.shape[1] - t_local:]

    args = (x_btc, kernel_kc, segment_ids_bt) + ((bias_c,) if bias_c is not None else ())
    specs = (P(bs, axis), P(), P(bs, axis)) + ((P(),) if bias_c is not None else ())
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(bs, axis), check_vma=False)(*args)
