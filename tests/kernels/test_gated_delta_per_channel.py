"""Gated delta rule with a per-key-channel decay (g [B, T, Hv, Dk]: Kimi Delta Attention, Kimi Linear):
the chunked xla form vs the sequential reference, the per-head rule as its special case, packed
documents, state chaining, cached decoding (chains, rollback, tree chunks), context parallelism on fake
CPU devices, transformers' KDA torch functions, and decays far stronger than a chunk's float range.

Tolerances: rel = max|a - b| / max|b|. In fp64 (the two JAX forms differ only in summation order) <=
1e-12; in fp32 <= 1e-5 (against transformers' chunk_kimi_delta_attention / recurrent_kimi_delta_attention,
the same math in float32, and for the decoding and context-parallel paths).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from specjax_kernels.gated_delta import gated_delta_rule
from specjax_kernels.gated_delta import xla as gd_xla
from specjax_kernels.gated_delta.conv import gated_delta_rule_update

FP64_TOL = 1e-12
REL_TOL = 1e-5
NAMES = ("q", "k", "v", "g", "beta")
# Packed rows: segment starts inside chunks and on a chunk edge (t = 16 for C = 8 / 16), a one-token
# segment, trailing padding (id 0)
SEGMENTS = np.array([[1] * 7 + [2] * 9 + [3] + [4] * 14 + [0] * 6,
                     [5] * 16 + [6] * 21], np.int32)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _inputs(b=2, t=37, hk=2, hv=4, dk=8, dv=6, seed=0, dtype=np.float32):
    """Random q/k/v, beta = sigmoid(N), and a per-channel g = -exp(A_log) * softplus(N) as Kimi Linear
    builds it, with per-head rates exp(A_log) in 0.05..0.5 (channels decay at visibly different speeds)."""
    rng = np.random.RandomState(seed)
    f = lambda *s: rng.randn(*s)  # noqa: E731
    rate = rng.uniform(0.05, 0.5, (hv, 1))
    g = -rate * np.log1p(np.exp(f(b, t, hv, dk) - 1.0))
    out = dict(q=f(b, t, hk, dk), k=f(b, t, hk, dk), v=f(b, t, hv, dv), g=g, beta=1.0 / (1.0 + np.exp(-f(b, t, hv))),
               h0=f(b, hv, dk, dv))
    return {n: x.astype(dtype) for n, x in out.items()}


_gdr = jax.jit(gated_delta_rule, static_argnames=("chunk_size", "implementation", "return_final_state",
                                                   "use_qk_l2norm", "scale"))


def _run(impl, inp, chunk=8, **kw):
    # the reference ignores chunk_size: pin it so its compilations are shared
    return _gdr(*(inp[x] for x in NAMES), implementation=impl, chunk_size=chunk if impl == "xla" else 1,
                return_final_state=True, **kw)


def test_chunked_matches_sequential_reference_fp64():
    """T = 37 in chunks of 3 and 8 (one sub-chunk of decayed_scores), 20 (two, the second padded) and
    64 > T (four), with GQA heads (4 value heads over 2 q/k heads), packed segments, an initial state and
    the final state; also the lax triangular solve."""
    with jax.enable_x64(True):
        inp = _inputs(dtype=np.float64)
        seg, h0 = jnp.asarray(SEGMENTS), jnp.asarray(inp["h0"])
        for kw, chunks in (({}, (8, 64)), ({"segment_ids": seg, "initial_state": h0}, (3, 20, 64))):
            o_ref, s_ref = _run("reference", inp, **kw)
            assert o_ref.dtype == jnp.float64
            for chunk in chunks:
                o, s = _run("xla", inp, chunk, **kw)
                assert o.shape == inp["v"].shape and s.shape == h0.shape
                assert rel_err(o, o_ref) <= FP64_TOL, (chunk, list(kw))
                assert rel_err(s, s_ref) <= FP64_TOL, (chunk, list(kw))
        o_lax, s_lax = jax.jit(lambda *a: gd_xla.gated_delta_rule(*a, segment_ids=seg, initial_state=h0, chunk_size=20,
                                                                  solve="lax"))(*(inp[x] for x in NAMES))
        assert rel_err(o_lax, o_ref) <= FP64_TOL and rel_err(s_lax, s_ref) <= FP64_TOL
        # not vacuous: the per-channel decays matter (their per-channel mean as one per-head decay differs)
        mean_g = dict(inp, g=inp["g"].mean(-1))
        assert rel_err(_run("reference", mean_g, **kw)[0], o_ref) > 1e-2


def test_decayed_scores_is_the_pairwise_definition():
    """decayed_scores (sub-chunks + reference rows) == sum_c x_i y_j exp(gam_i - gam_j) for j <= i, formed
    pair by pair in NumPy, at C = 37 with sub-chunks of 16 (the last one padded) and of 5."""
    rng = np.random.RandomState(2)
    c, dk = 37, 6
    x, y = rng.randn(3, c, dk), rng.randn(3, c, dk)
    gam = np.cumsum(-rng.uniform(0.0, 0.7, (3, c, dk)), axis=1)
    want = np.einsum("bic,bjc,bijc->bij", x, y, np.exp(gam[:, :, None, :] - gam[:, None, :, :]))
    want = want * np.tril(np.ones((c, c)))
    with jax.enable_x64(True):
        for sub in (16, 5):
            got = gd_xla.decayed_scores(jnp.asarray(x), jnp.asarray(y), jnp.asarray(gam), sub=sub)
            assert rel_err(got, want) <= FP64_TOL, sub


def test_constant_over_channels_equals_per_head_rule():
    """A per-channel g equal on every key channel is the per-head rule (both implementations, packed
    segments, initial and final state)."""
    with jax.enable_x64(True):
        inp = _inputs(dtype=np.float64, seed=3)
        per_head = dict(inp, g=inp["g"][..., 0])
        per_channel = dict(inp, g=np.repeat(per_head["g"][..., None], inp["k"].shape[-1], axis=-1))
        kw = dict(segment_ids=jnp.asarray(SEGMENTS), initial_state=jnp.asarray(inp["h0"]))
        o_head, s_head = _run("reference", per_head, **kw)
        for impl, chunk in (("reference", 1), ("xla", 16)):
            o, s = _run(impl, per_channel, chunk, **kw)
            assert rel_err(o, o_head) <= FP64_TOL and rel_err(s, s_head) <= FP64_TOL, impl


def test_packed_segments_equal_separate_documents():
    """A segment start drops the carried state: each packed document equals its solo run (fp32)."""
    inp = _inputs()
    seg = jnp.asarray(SEGMENTS)
    o_packed = {impl: _run(impl, inp, segment_ids=seg)[0] for impl in ("reference", "xla")}
    docs = [(row, np.flatnonzero(SEGMENTS[row] == sid)) for row in range(2) for sid in np.unique(SEGMENTS[row])]
    t = SEGMENTS.shape[1]
    solo = {x: np.zeros((len(docs), t) + inp[x].shape[2:], np.float32) for x in NAMES}
    for j, (row, pos) in enumerate(docs):
        for x in solo:
            solo[x][j, : len(pos)] = inp[x][row, pos]
    o_solo, _ = _run("reference", solo)
    for j, (row, pos) in enumerate(docs):
        for impl, o in o_packed.items():
            assert rel_err(o[row, pos], o_solo[j, : len(pos)]) <= REL_TOL, (impl, row, pos[0])
    # not vacuous: without the reset, the later documents see the earlier ones
    assert rel_err(_run("xla", inp)[0][0, 7:16], o_packed["reference"][0, 7:16]) > 1e-2


def test_initial_and_final_state_chain():
    """Two halves chained through the final state == the whole; the initial state matters."""
    inp = _inputs(t=36, seed=4)
    h0 = jnp.asarray(inp["h0"])
    first = {x: v[:, :13] for x, v in inp.items() if x != "h0"}
    second = {x: v[:, 13:] for x, v in inp.items() if x != "h0"}
    for impl in ("reference", "xla"):
        o_all, s_all = _run(impl, inp, initial_state=h0)
        o1, s1 = _run(impl, first, initial_state=h0)
        o2, s2 = _run(impl, second, initial_state=s1)
        assert rel_err(jnp.concatenate([o1, o2], axis=1), o_all) <= REL_TOL, impl
        assert rel_err(s2, s_all) <= REL_TOL, impl
        assert rel_err(_run(impl, inp)[0][:, :4], o_all[:, :4]) > 1e-2, impl


_update = jax.jit(gated_delta_rule_update, static_argnames=("return_states",))


def _chunk(inp, lo, hi):
    return [jnp.asarray(inp[x][:, lo:hi]) for x in NAMES]


def test_decoding_chunks_equal_one_shot():
    """Cached decoding (conv.gated_delta_rule_update): chunks of 1 and 3 tokens chained through the state
    == one chunked call over the whole sequence; a verified chunk with valid_len keeps the accepted
    prefix's state; return_states gives every row's; a tree chunk follows each root-to-node path."""
    inp = _inputs(t=12, seed=5)
    h0 = jnp.asarray(inp["h0"])
    o_all, s_all = _run("xla", inp, 4, initial_state=h0)
    for step in (1, 3):
        state, outs = h0, []
        for lo in range(0, 12, step):
            o, state = _update(*_chunk(inp, lo, lo + step), state)
            outs.append(o)
        assert rel_err(jnp.concatenate(outs, axis=1), o_all) <= REL_TOL, step
        assert rel_err(state, s_all) <= REL_TOL, step
    # verify 5 draft tokens at once; row 0 accepts 2, row 1 accepts 0 (keeps the state it started from)
    _, s_first = _run("xla", {x: v[:, :4] for x, v in inp.items()}, 4, initial_state=h0)
    o5, after, states = _update(*_chunk(inp, 4, 9), s_first, valid_len=jnp.array([2, 0]), return_states=True)
    _, s_acc = _run("xla", {x: v[:, :6] for x, v in inp.items()}, 4, initial_state=h0)
    assert rel_err(after[0], s_acc[0]) <= REL_TOL and rel_err(after[1], s_first[1]) <= REL_TOL
    assert rel_err(states[0, 1], s_acc[0]) <= REL_TOL
    assert rel_err(o5, o_all[:, 4:9]) <= REL_TOL
    # a tree chunk: row i continues from parent[i]
    tree = {x: v[:1, :6] for x, v in inp.items()}
    parent = jnp.asarray([[-1, 0, 0, 1, -1, 2]], jnp.int32)
    o, _, states = _update(*_chunk(tree, 0, 6), h0[:1], parent=parent, return_states=True)
    for node, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [4], [0, 2, 5]]):
        o_p, s_p = _update(*(jnp.asarray(tree[x][:, path]) for x in NAMES), h0[:1])
        assert rel_err(o[:, node], o_p[:, -1]) <= REL_TOL and rel_err(states[:, node], s_p) <= REL_TOL, node


def test_matches_transformers_kda_torch_functions():
    """Both JAX paths vs transformers' chunk_kimi_delta_attention and recurrent_kimi_delta_attention (Kimi
    Linear's CPU fallbacks: Hk = Hv, q/k L2-normalised inside, scale Dk ** -0.5), with an initial state
    and the final state."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    inp = _inputs(t=29, hk=3, hv=3, seed=6)
    tt = lambda x: torch.tensor(x)  # noqa: E731
    args = [tt(inp[x]) for x in NAMES]
    common = dict(initial_state=tt(inp["h0"]), output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_rec, s_rec = hf.recurrent_kimi_delta_attention(*args, **common)
    o_chk, s_chk = hf.chunk_kimi_delta_attention(*args, chunk_size=8, **common)
    for impl in ("reference", "xla"):
        o, s = _run(impl, inp, 8, initial_state=jnp.asarray(inp["h0"]))
        for o_hf, s_hf in ((o_rec, s_rec), (o_chk, s_chk)):
            assert rel_err(o, o_hf.numpy()) <= REL_TOL, impl
            assert rel_err(s, s_hf.numpy()) <= REL_TOL, impl


def test_strong_decays_stay_finite():
    """Log decays 600 times Kimi-like ones (cumulative sums below -1000 within the one chunk of 64, where
    fp32's exp overflows past 88): the chunked form takes only exps of differences <= 0, so it stays
    finite and equals the reference; splitting the decay as exp(gam_i) * exp(-gam_j) would overflow."""
    inp = _inputs(t=40, seed=7)
    inp["g"] = inp["g"] * 600.0
    assert float(np.cumsum(inp["g"], axis=1).min()) < -1000
    h0 = jnp.asarray(inp["h0"])
    o_ref, s_ref = _run("reference", inp, initial_state=h0)
    o, s = _run("xla", inp, 64, initial_state=h0)
    assert bool(jnp.isfinite(o).all() and jnp.isfinite(s).all())
    assert rel_err(o, o_ref) <= REL_TOL and rel_err(s, s_ref) <= REL_TOL


def test_context_parallel_per_channel():
    """T split over 4 shards (documents start inside shards and on the shard edge t = 16) with a
    per-channel g, an initial state and the final state, within 1e-5 of the single-device reference."""
    from specjax_kernels.gated_delta.context_parallel import gated_delta_rule_context_parallel

    inp = _inputs(t=32, seed=8)
    seg = jnp.asarray(np.array([[1] * 5 + [2] * 11 + [3] * 9 + [4] * 7, [7] * 32], np.int32))
    h0 = jnp.asarray(inp["h0"])
    want, want_s = _run("reference", inp, segment_ids=seg, initial_state=h0)
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    got, got_s = jax.jit(lambda *xs: gated_delta_rule_context_parallel(
        *xs, segment_ids=seg, initial_state=h0, chunk_size=4, return_final_state=True, mesh=mesh))(
        *(jnp.asarray(inp[x]) for x in NAMES))
    assert rel_err(got, want) <= REL_TOL and rel_err(got_s, want_s) <= REL_TOL


def test_shape_errors_name_both_forms():
    inp = _inputs(t=5)
    q, k, v, g, beta = (inp[x] for x in NAMES)
    with pytest.raises(ValueError, match=r"g must be \[B, T, Hv\] = \(2, 5, 4\) .* or \[B, T, Hv, Dk\] = "
                                         r"\(2, 5, 4, 8\) .*got \(2, 5, 4, 3\)"):
        gated_delta_rule(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, Hv\]"):
        gated_delta_rule(q, k, v, g, g)
    with pytest.raises(ValueError, match=r"g must be \[B, T, Hv\]"):
        gated_delta_rule_update(q, k, v, g[:, :, :2], beta, inp["h0"])


def test_per_channel_path_lowers_for_tpu():
    """The chunked per-channel path at a Kimi-Linear-48B KDA layer (32 heads, Dk = Dv = 128, T = 4096,
    bf16 q/k/v, fp32 g) lowers for a TPU through jax.export from this CPU host: plain StableHLO, no
    custom calls, no triangular_solve."""
    s = jax.ShapeDtypeStruct
    b, t, h, d = 1, 4096, 32, 128
    args = (s((b, t, h, d), jnp.bfloat16), s((b, t, h, d), jnp.bfloat16), s((b, t, h, d), jnp.bfloat16),
            s((b, t, h, d), jnp.float32), s((b, t, h), jnp.bfloat16), s((b, t), jnp.int32))
    fn = lambda q, k, v, g, beta, seg: gated_delta_rule(q, k, v, g, beta, segment_ids=seg,  # noqa: E731
                                                          implementation="xla", return_final_state=True)
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert "custom_call" not in text and "triangular_solve" not in text and "dot_general" in text
