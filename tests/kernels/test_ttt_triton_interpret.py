"""The native Triton TTT kernels (triton_kernels.py) under Triton's CPU interpreter (TRITON_INTERPRET=1,
torch CPU tensors), against the plain-jnp reference (`reference.ttt_attention` with no diagonal keys is
block 0; dq/dk/dv from its VJP; lse written out in jnp from the same masked scores), with packed segment
ids, in fp32 (tolerance 2e-5, as the other interpret-mode tests).

Also the segment skip: NaN in the keys/values of a tile that later documents' queries skip, and in the
queries/output gradients of a tile that earlier documents' keys skip; the rows that must not read them
are finite and equal the reference run on zeros there (a kernel that reads a skipped tile makes them NaN).

Needs the `triton` package (the `gpu` extra; CI's test extra does not install it, so CI skips this file).
It runs in a subprocess: the interpreter is chosen when `triton.jit` decorates, from the environment."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_triton_kernels_match_the_reference_and_skip_other_segments():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "kernels"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ALL OK" in r.stdout


def _main():  # runs in the subprocess
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    jax.config.update("jax_default_matmul_precision", "highest")
    # The interpreter holds a loaded scalar as a 1-element array and turns it into a loop bound with
    # int(array), which NumPy >= 2.5 refuses for arrays of ndim > 0; compiled Triton has no such step.
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patch_lang_tensor
    from specjax_kernels.ttt_attention import reference
    from specjax_kernels.ttt_attention import triton_kernels as K
    from specjax_kernels.ttt_attention.common import segment_block_bounds

    B, T, HQ, HKV, D = 1, 128, 4, 2, 16
    scale = D ** -0.5
    FWD = dict(BLOCK_M=32, BLOCK_N=16)  # different query and key tiles, as on the GPU
    DKDV = dict(BLOCK_M=16, BLOCK_N=32)
    seg = np.asarray([[1] * 32 + [2] * 32 + [3] * 64], np.int32)
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(s).astype(np.float32)
                   for s in ((B, T, HQ, D), (B, T, HKV, D), (B, T, HKV, D), (B, T, HQ, D)))
    meta = dict(T=T, HQ=HQ, HKV=HKV, D=D, SCALE=scale, HAS_SEG=True, IEEE=True)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731

    def triton_block0(q, k, v, do):
        lo, _ = segment_block_bounds(jnp.asarray(seg), FWD["BLOCK_M"], FWD["BLOCK_N"])
        _, hi = segment_block_bounds(jnp.asarray(seg), DKDV["BLOCK_M"], DKDV["BLOCK_N"])
        lo, hi = t(np.asarray(lo)), t(np.asarray(hi))
        o, lse = torch.zeros(B, T, HQ, D), torch.zeros(B, T, HQ)
        K.fwd_kernel[(T // FWD["BLOCK_M"], B * HQ)](t(q), t(k), t(v), t(seg), lo, o, lse, **meta, **FWD)
        delta = (t(do) * o).sum(-1)
        dq = torch.zeros(B, T, HQ, D)
        K.dq_kernel[(T // FWD["BLOCK_M"], B * HQ)](t(q), t(k), t(v), t(seg), lo, t(do), lse, delta, dq,
                                                   **meta, **FWD)
        dk, dv = torch.zeros(B, T, HKV, D), torch.zeros(B, T, HKV, D)
        K.dkdv_kernel[(T // DKDV["BLOCK_N"], B * HKV)](t(q), t(k), t(v), t(seg), hi, t(do), lse, delta, dk, dv,
                                                       **meta, **DKDV)
        return [x.numpy() for x in (o, lse, dq, dk, dv)]

    def reference_block0(q, k, v, do):
        s = jnp.asarray(seg)
        f = lambda q, k, v: reference.ttt_attention(q, k, v, None, None, s, scale)  # noqa: E731
        o, vjp = jax.vjp(f, q, k, v)
        dq, dk, dv = vjp(jnp.asarray(do))
        # lse [B, T, Hq]: log-sum-exp of the causal, same-segment scores (GQA: head h reads kv head h // G)
        kg = jnp.repeat(jnp.asarray(k), HQ // HKV, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, kg) * scale
        pos = jnp.arange(T)
        keep = (pos[:, None] >= pos[None, :])[None] & (s[:, :, None] == s[:, None, :])  # [B, T, S]
        lse = jax.nn.logsumexp(jnp.where(keep[:, None], scores, -jnp.inf), axis=-1).transpose(0, 2, 1)
        return [np.asarray(x) for x in (o, lse, dq, dk, dv)]

    def close(a, b, name):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)

    names = ("o", "lse", "dq", "dk", "dv")
    for a, b, name in zip(triton_block0(q, k, v, do), reference_block0(q, k, v, do), names):
        close(a, b, name)
    print("plain: ok", flush=True)

    # forward and dq: key rows :32 (segment 1) poisoned; rows 32.. never read them
    kp, vp = k.copy(), v.copy()
    kp[:, :32], vp[:, :32] = np.nan, np.nan
    k0, v0 = k.copy(), v.copy()
    k0[:, :32], v0[:, :32] = 0.0, 0.0
    got, ref = triton_block0(q, kp, vp, do), reference_block0(q, k0, v0, do)
    for i, name in ((0, "o"), (1, "lse"), (2, "dq")):
        assert np.isfinite(got[i][:, 32:]).all(), f"{name}: a skipped key tile was read"
        close(got[i][:, 32:], ref[i][:, 32:], name)
    print("forward skip: ok", flush=True)

    # dk/dv: query rows 96.. (segment 3) poisoned; keys :64 (segments 1, 2) never read them
    qp, dop = q.copy(), do.copy()
    qp[:, 96:], dop[:, 96:] = np.nan, np.nan
    q0, do0 = q.copy(), do.copy()
    q0[:, 96:], do0[:, 96:] = 0.0, 0.0
    got, ref = triton_block0(qp, k, v, dop), reference_block0(q0, k, v, do0)
    for i, name in ((3, "dk"), (4, "dv")):
        assert np.isfinite(got[i][:, :64]).all(), f"{name}: a skipped query tile was read"
        close(got[i][:, :64], ref[i][:, :64], name)
    print("backward skip: ok", flush=True)
    print("ALL OK")


if __name__ == "__main__":
    _main()
