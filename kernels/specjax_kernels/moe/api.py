"""Public routed-experts entry point; ``implementation=`` picks the backend.

    moe_experts(x_td, expert_ids_tk, weights_tk, up_edf=..., down_efd=..., gate_edf=None,
                down_bias_ed=None, activation="silu", implementation=None) -> [T, D]
    moe_experts(x_td, expert_ids_tk, weights_tk, gate_up_edf=..., down_efd=..., gate_up_bias_ef=None,
                down_bias_ed=None, activation="silu")

Gated experts take either separate gate/up [E, D, F] or one fused [E, D, 2F] (gate columns first, as
vLLM's w13 and transformers' gate_up_proj): the fused form runs one grouped GEMM of width 2F instead
of two of width F, reading the expert-sorted rows once.

Biases (gpt-oss's experts have them): ``gate_up_bias_ef`` [E, 2F], laid out as the fused weight's
columns, only with ``gate_up_edf`` (a ValueError names the fix for the separate and ungated forms);
``down_bias_ed`` [E, D] with any form. They are added in fp32 outside the grouped GEMMs, the same code
for every backend (common.grouped_experts; xla.py's block loop).

``activation`` is an elementwise name (ACTIVATIONS: act(gate) * up for gated experts, act(up) for
ungated ones) or a hashable tuple naming an activation of the whole gated unit (common.GLU_ACTIVATIONS,
gated experts only): ("clamped_swiglu", alpha, limit) is gpt-oss's
    g = min(gate, limit); u = clip(up, -limit, limit); h = (u + 1) * g * sigmoid(alpha * g)
computed in fp32.

The router (softmax / sigmoid, top-k, renormalisation, scaling) belongs to the model; this op gets
its result: for each token k expert ids and k weights. See reference.py for the math.
  reference  jax.lax.ragged_dot grouped GEMMs (the definition; native on TPU)
  xla        block-sparse grouped GEMM via lax.scan (exact; the CPU/GPU path, see xla.py)
  mgpu       JAX's Hopper grouped GEMM, ragged_dot_mgpu (forward only; bf16/fp16; see mgpu.py); auto
             on one Hopper GPU
  pallas_tpu JAX's TPU grouped GEMM, megablox gmm (interpret mode off TPU; see pallas_tpu.py)
  pallas_gpu a Pallas grouped GEMM through the Triton lowering, for any NVIDIA GPU (forward + VJP;
             interpret mode on CPU; see pallas_gpu.py); auto on one non-Hopper GPU (bf16/fp16)
"""
from __future__ import annotations

import logging
from typing import Optional

import jax
import jax.numpy as jnp

from specjax_kernels.selection import log_once_fallback, select
from specjax_kernels.moe.common import ACTIVATIONS, GLU_ACTIVATIONS  # noqa: F401  (re-exported)
from specjax_kernels.moe.common import check_activation, check_biases


def _reference():
    from specjax_kernels.moe.reference import moe_experts as fn
    return fn


def _xla():
    from specjax_kernels.moe.xla import moe_experts as fn
    return fn


def _mgpu():
    from specjax_kernels.selection import Unavailable
    from specjax_kernels.moe import mgpu

    why = mgpu.available()
    if why:
        raise Unavailable(why)
    return mgpu.moe_experts


def _pallas_tpu():
    from specjax_kernels.moe.pallas_tpu import moe_experts as fn
    return fn


def _pallas_gpu():
    import functools

    from specjax_kernels import selection
    from specjax_kernels.selection import Unavailable

    # the platform kernels are chosen for (a TPU step lowered on a CPU host is not CPU)
    backend = getattr(selection, "target_platform", jax.default_backend)()
    if backend not in ("gpu", "cpu"):
        raise Unavailable(f"Pallas GPU kernels need an NVIDIA GPU (or CPU interpret mode), not {backend}")
    from specjax_kernels.moe.pallas_gpu import moe_experts as fn
    return functools.partial(fn, interpret=backend == "cpu")


IMPLEMENTATIONS = {"reference": _reference, "xla": _xla, "mgpu": _mgpu, "pallas_tpu": _pallas_tpu,
                   "pallas_gpu": _pallas_gpu}
# Off TPU, ragged_dot is expanded into a dense masked product over all experts (E x the FLOPs), so
# the blocked path is preferred there: 9x faster on an H200 for a Qwen3-30B-A3B layer (see xla.py),
# 5-45x on CPU (`benchmarks/kernel_speed.py --small --ops moe` times both). TPU keeps ragged_dot, which XLA:TPU lowers to
# a grouped matmul (not measured here).
# mgpu (JAX's ragged_dot_mgpu) runs one Qwen3-30B-A3B layer (bf16, 8192 tokens) in 1.99-2.01 ms with its
# blocks tuned per projection, against 2.27 ms for pallas_gpu and 11.6 ms for xla on an H200
# (2026-12-02, one process; benchmarks/results/kernels.md, "MoE: per-projection blocks"), and the whole
# train step on that target shape 2.23x faster than xla (0.61 s against 1.36 s per 4 x 4096 tokens;
# benchmarks/results/train_throughput.md, "MoE expert kernel in the train step"). So on a GPU auto
# takes mgpu on a Hopper GPU, else pallas_gpu (the Triton kernel runs on any NVIDIA GPU; 5.1x xla on the
# H200), for bf16/fp16 on ONE device: neither custom call is partitioned by XLA nor measured in a
# sharded step, so with several devices auto keeps xla (kernels.moe=mgpu / pallas_gpu forces them),
# and fp32 keeps xla (mgpu multiplies bf16/fp16 only; pallas_gpu's IEEE fp32 path is not timed).
# See `gpu_choice`. TPU: pallas_tpu (megablox) lowers for a TPU (tests/kernels/test_moe_tpu_lowering.py)
# but is not measured on one, so ragged_dot stays first.
PREFERENCE = {"cpu": ["xla", "reference"], "gpu": ["mgpu", "pallas_gpu", "xla", "reference"],
              "tpu": ["reference", "pallas_tpu", "xla"]}


def gpu_choice(name: str, *, auto: bool, dtype, n_devices: int, mgpu_shape_issue: str | None) -> tuple[str, str | None]:
    """(implementation, why it replaced `name`) for a GPU grouped-GEMM pick: auto keeps mgpu /
    pallas_gpu only for bf16/fp16 on one device (see the note above PREFERENCE); mgpu's shape limits
    send auto to pallas_gpu (which pads any width) and an explicit mgpu to xla."""
    if name not in ("mgpu", "pallas_gpu"):
        return name, None
    if auto and n_devices > 1:
        return "xla", (f"{n_devices} devices: the kernel is not partitioned across devices (set "
                       f"kernels.moe={name} to use it anyway)")
    if auto and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla", f"dtype {jnp.dtype(dtype)} (auto takes the grouped-GEMM kernels for bf16/fp16)"
    if name == "mgpu":
        why = mgpu_shape_issue
        if why is None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            why = f"dtype {jnp.dtype(dtype)} (the kernel multiplies bf16/fp16)"
        if why:
            return ("pallas_gpu" if auto else "xla"), why
    return name, None


def moe_experts(x_td, expert_ids_tk, weights_tk, *, up_edf=None, down_efd, gate_edf=None, gate_up_edf=None,
                gate_up_bias_ef=None, down_bias_ed=None, activation: str | tuple = "silu",
                implementation: Optional[str] = None):
    """Weighted sum over each token's k experts of FFN_e(x); shapes x [T, D], ids/weights [T, k],
    up/gate [E, D, F] or gate_up [E, D, 2F], down [E, F, D], biases gate_up [E, 2F] (fused form only)
    and down [E, D]; activation a name or ("clamped_swiglu", alpha, limit) (module docstring).
    Forward-only use in frozen targets; differentiable anyway (reverse mode). Under jax.vmap with shared
    expert weights the vmapped axes join T: one call on all rows (`per_token`)."""
    if x_td.ndim != 2 or expert_ids_tk.ndim != 2 or expert_ids_tk.shape != weights_tk.shape:
        raise ValueError(
            f"moe_experts: expected x [T, D] and ids/weights [T, k], got {x_td.shape}, "
            f"{expert_ids_tk.shape}, {weights_tk.shape}"
        )
    if (up_edf is None) == (gate_up_edf is None) or (gate_up_edf is not None and gate_edf is not None):
        raise ValueError("moe_experts: pass up_edf (with gate_edf for gated experts) or gate_up_edf, not both")
    n_experts, d, f = down_efd.shape[0], x_td.shape[1], down_efd.shape[1]
    want = (n_experts, d, 2 * f) if gate_up_edf is not None else (n_experts, d, f)
    given = gate_up_edf if gate_up_edf is not None else up_edf
    if given.shape != want or down_efd.shape != (n_experts, f, d) or (
            gate_edf is not None and gate_edf.shape != up_edf.shape):
        raise ValueError(
            f"moe_experts: weight shapes do not fit x {x_td.shape}: "
            f"{'gate_up' if gate_up_edf is not None else 'up'} {given.shape}, down {down_efd.shape}, "
            f"gate {None if gate_edf is None else gate_edf.shape} (want up/gate [E, D, F] or gate_up "
            f"[E, D, 2F], down [E, F, D])"
        )
    if gate_up_edf is not None:  # backends read the fused form from its shape (common.is_fused_gate_up)
        up_edf = gate_up_edf
    check_biases(up_edf, down_efd, gate_edf, gate_up_bias_ef, down_bias_ed)
    activation = check_activation(activation, gated=gate_edf is not None or gate_up_edf is not None)
    auto = implementation in (None, "auto")
    name, fn = select("moe", IMPLEMENTATIONS, PREFERENCE, implementation)
    if name in ("mgpu", "pallas_gpu"):
        from specjax_kernels.moe import mgpu

        new, why = gpu_choice(name, auto=auto, dtype=x_td.dtype, n_devices=jax.device_count(),
                              mgpu_shape_issue=mgpu.supports(x_td, up_edf, down_efd) if name == "mgpu" else None)
        if why:  # shapes, dtype or devices the kernel does not take
            log_once_fallback("moe", name, why, new, level=logging.INFO if auto else logging.WARNING)
            name, fn = select("moe", IMPLEMENTATIONS, PREFERENCE, new)
    # the optional expert arrays travel as per_token's positional weights (shared under vmap); the biases
    # reach the backend as keywords only when given, so a bias-free call is the one it always was
    optional = {"gate": gate_edf, "gate_up_bias": gate_up_bias_ef, "down_bias": down_bias_ed}
    present = [key for key, a in optional.items() if a is not None]

    def one(x, ids, w, up, down, *rest):
        got = dict(zip(present, rest))
        return fn(x, ids, w, up, down, got.pop("gate", None), activation, **got)

    return per_token(one)(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, *(optional[key] for key in present))


def per_token(fn):
    """``fn(x [T, D], ids [T, k], w [T, k], *expert_weights) -> [T, D]``, a per-token op, with a vmap rule:
    when only x / ids / w are batched the vmapped axes fold into the token axis (one call on [V*T] rows,
    as the batched decoders need: one grouped GEMM per layer instead of one per batch row); when an
    expert weight is batched each member runs on its own (lax.map).

    JAX cannot differentiate a custom_vmap in reverse mode (no transpose rule), so a custom_vjp around it
    hands reverse mode to ``fn`` itself (jax.vjp): grad, vmap-of-grad and grad-of-vmap see the plain
    function and its own rules; only undifferentiated vmaps take the fold. Forward mode (jax.jvp) is
    lost with custom_vjp; nothing here uses it (a custom_jvp instead broke grad-of-vmap)."""
    @jax.custom_batching.custom_vmap
    def batched(x, ids, w, *weights):
        return fn(x, ids, w, *weights)

    @batched.def_vmap
    def _rule(axis_size, in_batched, x, ids, w, *weights):
        if any(in_batched[3:]):  # per-member expert weights: no shared grouped GEMM to fold into
            mapped = [a for a, b in zip((x, ids, w, *weights), in_batched) if b]

            def one(xs):
                it = iter(xs)
                return batched(*[next(it) if b else a for a, b in zip((x, ids, w, *weights), in_batched)])

            return jax.lax.map(one, mapped), True
        x, ids, w = (a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                     for a, b in zip((x, ids, w), in_batched))
        v, t = x.shape[:2]
        out = batched(x.reshape(v * t, -1), ids.reshape(v * t, -1), w.reshape(v * t, -1), *weights)
        return out.reshape(v, t, -1), True

    @jax.custom_vjp
    def op(x, ids, w, *weights):
        return batched(x, ids, w, *weights)

    # the residual is fn's own pullback (a pytree of its residual arrays): nothing is recomputed
    op.defvjp(lambda *args: jax.vjp(fn, *args), lambda pullback, g: pullback(g))
    return op
