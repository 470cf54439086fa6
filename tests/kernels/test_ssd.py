"""Mamba-2 SSD scan: sequential reference vs chunked xla, and both vs transformers' PyTorch path.

Tolerance: rel = max|a - b| / max|b| <= 1e-5 in fp32 (the two JAX forms differ only in summation
order; transformers' torch_forward chunk scan is the same math in float32).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels.ssd import ssd

REL_TOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _inputs(b=2, t=37, h=4, p=3, g=2, n=5, seed=0):
    rng = np.random.RandomState(seed)
    f = lambda *s: rng.randn(*s).astype(np.float32)  # noqa: E731
    return dict(
        x=f(b, t, h, p),
        dt=np.log1p(np.exp(f(b, t, h) - 1.0)),  # softplus: positive steps around 0.3
        A=-(rng.rand(h).astype(np.float32) + 0.2),
        B=f(b, t, g, n), C=f(b, t, g, n), D=f(h),
        h0=f(b, h, p, n),
    )


# Packed rows: segment starts inside chunks and on a chunk edge (t = 16 for Q = 8 / 16), a
# one-token segment, trailing padding (id 0).
SEGMENTS = np.array([[1] * 7 + [2] * 9 + [3] + [4] * 14 + [0] * 6,
                     [5] * 16 + [6] * 21], np.int32)


_ssd = jax.jit(ssd, static_argnames=("chunk_size", "implementation", "return_final_state"))


def _run(impl, inp, chunk=8, **kw):
    # the reference ignores chunk_size: pin it so its compilations are shared
    return _ssd(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"], implementation=impl,
                chunk_size=chunk if impl == "xla" else 1, return_final_state=True, **kw)


def test_chunked_matches_sequential_reference():
    inp = _inputs()
    seg = jnp.asarray(SEGMENTS)
    h0 = jnp.asarray(inp["h0"])
    for kw in ({}, {"segment_ids": seg, "initial_state": h0}):
        y_ref, s_ref = _run("reference", inp, **kw)
        # T = 37: chunks of 3 and 8 leave a partial last chunk, 16 puts a segment start on a chunk
        # edge, 64 > T is one padded chunk
        for chunk in (3, 8, 16, 64):
            y, s = _run("xla", inp, chunk, **kw)
            assert y.dtype == jnp.float32 and y.shape == inp["x"].shape and s.shape == h0.shape
            assert rel_err(y, y_ref) <= REL_TOL, (chunk, list(kw))
            assert rel_err(s, s_ref) <= REL_TOL, (chunk, list(kw))
    # the initial state must matter (else the comparison above could not see it mishandled)
    y0, _ = _run("xla", inp, 8, segment_ids=seg)
    assert rel_err(y0[:, :3], _run("xla", inp, 8, segment_ids=seg, initial_state=h0)[0][:, :3]) > 1e-2


def test_packed_segments_equal_separate_documents():
    """A segment start drops the carried state: each packed document equals its solo run."""
    inp = _inputs()
    seg = jnp.asarray(SEGMENTS)
    y_packed = {impl: _run(impl, inp, segment_ids=seg)[0] for impl in ("reference", "xla")}
    # every document alone at the start of its own row (what follows it cannot reach it: causal)
    docs = [(row, np.flatnonzero(SEGMENTS[row] == sid)) for row in range(2) for sid in np.unique(SEGMENTS[row])]
    t = SEGMENTS.shape[1]
    solo = {k: np.zeros((len(docs), t) + v.shape[2:], np.float32) for k, v in inp.items() if k not in ("A", "D", "h0")}
    for j, (row, pos) in enumerate(docs):
        for k in solo:
            solo[k][j, : len(pos)] = inp[k][row, pos]
    y_solo, _ = _run("reference", dict(solo, A=inp["A"], D=inp["D"]))
    for j, (row, pos) in enumerate(docs):
        for impl, y in y_packed.items():
            assert rel_err(y[row, pos], y_solo[j, : len(pos)]) <= REL_TOL, (impl, row, pos[0])
    # not vacuous: without the reset, the later documents see the earlier ones
    y_leaky, _ = _run("xla", inp)
    assert rel_err(y_leaky[0, 7:16], y_packed["reference"][0, 7:16]) > 1e-2


@pytest.mark.parametrize("chunk", [8, 16])
def test_matches_transformers_torch_chunk_scan(chunk):
    """Both JAX paths vs transformers' mamba2_chunk_scan (the torch fallback NemotronH runs on CPU),
    including its dt handling: dt_raw + dt_bias -> softplus -> clamp to the limits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    inp = _inputs(t=29, seed=1)
    rng = np.random.RandomState(2)
    dt_raw = (2 * rng.randn(*inp["dt"].shape) - 2).astype(np.float32)  # some steps hit the 0.05 floor
    dt_bias = rng.randn(inp["A"].shape[0]).astype(np.float32)
    limit = (0.05, 2.0)
    t = lambda a: torch.tensor(a)  # noqa: E731
    y_hf, s_hf = mamba2_chunk_scan(
        t(inp["x"]), t(dt_raw), t(inp["A"]), t(inp["B"]), t(inp["C"]), chunk_size=chunk, D=t(inp["D"]),
        dt_bias=t(dt_bias), dt_softplus=True, dt_limit=limit, initial_states=t(inp["h0"]), return_final_states=True,
    )
    dt = np.clip(np.asarray(jax.nn.softplus(dt_raw + dt_bias)), *limit)
    assert (dt == limit[0]).mean() > 0.05 and (dt == limit[1]).any()  # the clamp matters here
    for impl in ("reference", "xla"):
        y, s = _run(impl, dict(inp, dt=dt), chunk, initial_state=jnp.asarray(inp["h0"]))
        assert rel_err(y, y_hf.numpy()) <= REL_TOL, impl
        assert rel_err(s, s_hf.numpy()) <= REL_TOL, impl


def test_bf16_inputs_and_errors():
    inp = _inputs(t=12)
    bf = {k: jnp.asarray(v, jnp.bfloat16) for k, v in inp.items()}
    y = _ssd(bf["x"], bf["dt"], bf["A"], bf["B"], bf["C"], D=bf["D"], chunk_size=4)
    y32 = _ssd(*(bf[k].astype(jnp.float32) for k in ("x", "dt", "A", "B", "C")), D=bf["D"].astype(jnp.float32),
               chunk_size=4, implementation="reference")
    assert y.dtype == jnp.float32 and rel_err(y, y32) <= REL_TOL  # upcast once, then fp32 math
    x, dt, A, B, C = (inp[k] for k in ("x", "dt", "A", "B", "C"))
    with pytest.raises(ValueError, match=r"dt must be \[B, T, H\]"):
        ssd(x, dt[:, :, :2], A, B, C)
    with pytest.raises(ValueError, match="split evenly"):
        ssd(x, dt, A, B[:, :, :1].repeat(3, axis=2), C[:, :, :1].repeat(3, axis=2))
    with pytest.raises(ValueError, match="segment_ids must be"):
        ssd(x, dt, A, B, C, segment_ids=np.ones((2, 5), np.int32))
    with pytest.raises(ValueError, match="unknown implementation 'pallas'"):
        ssd(x, dt, A, B, C, implementation="pallas")
