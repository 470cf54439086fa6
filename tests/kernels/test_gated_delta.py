"""Gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5): sequential reference vs chunked xla, both
vs transformers' PyTorch functions, packed documents, state chaining, cached decoding with rollback
and tree chunks, the short causal conv, context parallelism on fake CPU devices, TPU lowering.

Tolerance: rel = max|a - b| / max|b| <= 1e-5 in fp32 (the JAX forms differ only in summation order;
transformers' torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule are the same math in
float32). bf16 inputs are rounded once and then computed in fp32, so the xla path on bf16 inputs
matches the fp32 reference on the rounded inputs to the same 1e-5; against transformers on bf16
inputs (it returns bf16) the bound is 1e-2 (bf16 output rounding, 2^-8).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from specjax_kernels.gated_delta import gated_delta_rule
from specjax_kernels.gated_delta.conv import causal_conv1d, causal_conv1d_update, gated_delta_rule_update
from specjax_kernels.selection import recording_choices

REL_TOL = 1e-5
BF16_HF_TOL = 1e-2


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _inputs(b=2, t=37, hk=2, hv=4, dk=8, dv=6, seed=0):
    rng = np.random.RandomState(seed)
    f = lambda *s: rng.randn(*s).astype(np.float32)  # noqa: E731
    # g as Qwen3-Next builds it: -exp(A_log) * softplus(a + dt_bias); slow enough that state matters far away
    a_log = np.log(rng.uniform(0.05, 0.5, hv)).astype(np.float32)
    g = -np.exp(a_log) * np.log1p(np.exp(f(b, t, hv) - 1.0))
    return dict(q=f(b, t, hk, dk), k=f(b, t, hk, dk), v=f(b, t, hv, dv), g=g.astype(np.float32),
                beta=(1.0 / (1.0 + np.exp(-f(b, t, hv)))).astype(np.float32), h0=f(b, hv, dk, dv))


# Packed rows: segment starts inside chunks and on a chunk edge (t = 16 for C = 8 / 16), a one-token
# segment, trailing padding (id 0).
SEGMENTS = np.array([[1] * 7 + [2] * 9 + [3] + [4] * 14 + [0] * 6,
                     [5] * 16 + [6] * 21], np.int32)

_gdr = jax.jit(gated_delta_rule, static_argnames=("chunk_size", "implementation", "return_final_state",
                                                   "use_qk_l2norm", "scale"))


def _run(impl, inp, chunk=8, **kw):
    # the reference ignores chunk_size: pin it so its compilations are shared
    return _gdr(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], implementation=impl,
                chunk_size=chunk if impl == "xla" else 1, return_final_state=True, **kw)


def test_chunked_matches_sequential_reference():
    inp = _inputs()
    seg = jnp.asarray(SEGMENTS)
    h0 = jnp.asarray(inp["h0"])
    # T = 37: chunks of 3 and 8 leave a partial last chunk, 16 puts a segment start on a chunk edge,
    # 64 > T is one padded chunk (each is a compilation: few combinations)
    for kw, chunks in (({}, (8,)), ({"segment_ids": seg, "initial_state": h0}, (3, 16, 64))):
        o_ref, s_ref = _run("reference", inp, **kw)
        for chunk in chunks:
            o, s = _run("xla", inp, chunk, **kw)
            assert o.dtype == jnp.float32 and o.shape == inp["v"].shape and s.shape == h0.shape
            assert rel_err(o, o_ref) <= REL_TOL, (chunk, list(kw))
            assert rel_err(s, s_ref) <= REL_TOL, (chunk, list(kw))
    # the initial state must matter (else the comparison above could not see it mishandled)
    o0, _ = _run("reference", inp, segment_ids=seg)
    assert rel_err(o0[:, :3], _run("xla", inp, 16, segment_ids=seg, initial_state=h0)[0][:, :3]) > 1e-2
    # the lax.linalg.triangular_solve form of the UT solve (GPU alternative) gives the same
    from specjax_kernels.gated_delta import xla as gd_xla
    lax_solve = jax.jit(lambda *a: gd_xla.gated_delta_rule(*a, segment_ids=seg, initial_state=h0, chunk_size=16,
                                                          solve="lax"))
    o_lax, s_lax = lax_solve(*(inp[x] for x in ("q", "k", "v", "g", "beta")))
    o_ref, s_ref = _run("reference", inp, segment_ids=seg, initial_state=h0)
    assert rel_err(o_lax, o_ref) <= REL_TOL and rel_err(s_lax, s_ref) <= REL_TOL
    # auto = xla, recorded for recording_choices
    with recording_choices() as chosen:  # traced only (eager dispatch of the xla path is slow to compile)
        jax.jit(gated_delta_rule).trace(*(inp[x] for x in ("q", "k", "v", "g", "beta")))
    assert chosen["gated_delta"] == {"xla"}


def test_packed_segments_equal_separate_documents():
    """A segment start drops the carried state: each packed document equals its solo run."""
    inp = _inputs()
    seg = jnp.asarray(SEGMENTS)
    o_packed = {impl: _run(impl, inp, segment_ids=seg)[0] for impl in ("reference", "xla")}
    o_packed["xla, initial state"] = _run("xla", inp, 16, segment_ids=seg, initial_state=jnp.zeros_like(inp["h0"]))[0]
    docs = [(row, np.flatnonzero(SEGMENTS[row] == sid)) for row in range(2) for sid in np.unique(SEGMENTS[row])]
    t = SEGMENTS.shape[1]
    solo = {x: np.zeros((len(docs), t) + inp[x].shape[2:], np.float32) for x in ("q", "k", "v", "g", "beta")}
    for j, (row, pos) in enumerate(docs):
        for x in solo:
            solo[x][j, : len(pos)] = inp[x][row, pos]
    o_solo, _ = _run("reference", solo)
    for j, (row, pos) in enumerate(docs):
        for impl, o in o_packed.items():
            assert rel_err(o[row, pos], o_solo[j, : len(pos)]) <= REL_TOL, (impl, row, pos[0])
    # not vacuous: without the reset, the later documents see the earlier ones
    o_leaky, _ = _run("xla", inp)
    assert rel_err(o_leaky[0, 7:16], o_packed["reference"][0, 7:16]) > 1e-2


def test_state_chaining_two_halves_equal_whole():
    inp = _inputs(t=36)
    h0 = jnp.asarray(inp["h0"])
    first = {x: v[:, :13] for x, v in inp.items() if x != "h0"}
    second = {x: v[:, 13:] for x, v in inp.items() if x != "h0"}
    for impl in ("reference", "xla"):
        o_all, s_all = _run(impl, inp, initial_state=h0)
        o1, s1 = _run(impl, first, initial_state=h0)
        o2, s2 = _run(impl, second, initial_state=s1)
        assert rel_err(jnp.concatenate([o1, o2], axis=1), o_all) <= REL_TOL, impl
        assert rel_err(s2, s_all) <= REL_TOL, impl


@pytest.mark.parametrize("l2norm", [True, False])
def test_matches_transformers_torch_functions(l2norm):
    """Both JAX paths vs transformers' torch_recurrent_gated_delta_rule and torch_chunk_gated_delta_rule
    (Qwen3-Next's CPU fallbacks): GQA heads (4 value heads over 2 q/k heads), an initial state, the
    final state."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    inp = _inputs(t=29, seed=1)
    if not l2norm:  # un-normalised keys: keep |k| ~ 1 so the delta rule stays contractive
        inp = dict(inp, q=inp["q"] / 3, k=inp["k"] / 3)
    tt = lambda x: torch.tensor(x)  # noqa: E731
    args = [tt(inp[x]) for x in ("q", "k", "v", "g", "beta")]
    common = dict(initial_state=tt(inp["h0"]), output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    o_rec, s_rec = hf.torch_recurrent_gated_delta_rule(*args, **common)
    o_chk, s_chk = hf.torch_chunk_gated_delta_rule(*args, chunk_size=8, **common)
    for impl in ("reference", "xla"):
        o, s = _run(impl, inp, 8, initial_state=jnp.asarray(inp["h0"]), use_qk_l2norm=l2norm)
        for o_hf, s_hf in ((o_rec, s_rec), (o_chk, s_chk)):
            assert rel_err(o, o_hf.numpy()) <= REL_TOL, impl
            assert rel_err(s, s_hf.numpy()) <= REL_TOL, impl


def test_bf16_inputs_and_errors():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    inp = _inputs(t=12)
    names = ("q", "k", "v", "g", "beta")
    bf = [jnp.asarray(inp[x], jnp.bfloat16) for x in names]
    o = _gdr(*bf, chunk_size=4)
    o32 = _gdr(*(x.astype(jnp.float32) for x in bf), chunk_size=4, implementation="reference")
    assert o.dtype == jnp.float32 and rel_err(o, o32) <= REL_TOL  # upcast once, then fp32 math
    o_hf, _ = hf.torch_chunk_gated_delta_rule(
        *(torch.tensor(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16) for x in bf), chunk_size=4,
        use_qk_l2norm_in_kernel=True)
    assert o_hf.dtype == torch.bfloat16 and rel_err(o, o_hf.float().numpy()) <= BF16_HF_TOL

    q, k, v, g, beta = (inp[x] for x in names)
    with pytest.raises(ValueError, match=r"g must be \[B, T, Hv\]"):
        gated_delta_rule(q, k, v, g[:, :, :2], beta)
    with pytest.raises(ValueError, match="split evenly"):
        gated_delta_rule(q[:, :, :1].repeat(3, axis=2), k[:, :, :1].repeat(3, axis=2), v, g, beta)
    with pytest.raises(ValueError, match="segment_ids must be"):
        gated_delta_rule(q, k, v, g, beta, segment_ids=np.ones((2, 5), np.int32))
    with pytest.raises(ValueError, match=r"the state must be \[B, Hv, Dk, Dv\]"):
        gated_delta_rule(q, k, v, g, beta, initial_state=inp["h0"][:, :2])
    with pytest.raises(ValueError, match="unknown implementation 'pallas'"):
        gated_delta_rule(q, k, v, g, beta, implementation="pallas")


# ------------------------------------------------------------------------------------------
# cached decoding
# ------------------------------------------------------------------------------------------
_update = jax.jit(gated_delta_rule_update, static_argnames=("return_states",))
_conv_update = jax.jit(causal_conv1d_update)


def _chunk(inp, lo, hi):
    return [jnp.asarray(inp[x][:, lo:hi]) for x in ("q", "k", "v", "g", "beta")]


def test_decode_chain_equals_whole_and_rollback():
    """Chunks of 1 and 3 tokens chained through the state == the whole sequence; a chunk verified with
    valid_len (per row) leaves the state of the accepted prefix; return_states gives every row's state."""
    inp = _inputs(t=12)
    h0 = jnp.asarray(inp["h0"])
    o_all, s_all = _run("reference", inp, initial_state=h0)
    for step in (1, 3):
        state, outs = h0, []
        for lo in range(0, 12, step):
            o, state = _update(*_chunk(inp, lo, lo + step), state)
            outs.append(o)
        assert rel_err(jnp.concatenate(outs, axis=1), o_all) <= REL_TOL, step
        assert rel_err(state, s_all) <= REL_TOL, step
    # verify 5 draft tokens at once; row 0 accepts 2, row 1 accepts 0 (keeps the state it started from)
    _, s_first = _run("reference", {x: v[:, :4] for x, v in inp.items()}, initial_state=h0)
    o5, after, states = _update(*_chunk(inp, 4, 9), s_first, valid_len=jnp.array([2, 0]), return_states=True)
    _, s_acc = _run("reference", {x: v[:, :6] for x, v in inp.items()}, initial_state=h0)
    assert rel_err(after[0], s_acc[0]) <= REL_TOL and rel_err(after[1], s_first[1]) <= REL_TOL
    assert rel_err(states[0, 1], s_acc[0]) <= REL_TOL  # the state after row 1 = after 6 tokens
    assert rel_err(o5, o_all[:, 4:9]) <= REL_TOL
    assert bool(jnp.isnan(_update(*_chunk(inp, 4, 9), s_first, valid_len=6)[1]).all())  # > T: NaN, not wrong


def test_decode_tree_chunk_follows_each_path():
    """parent[i]: row i continues from row parent[i]; each node's output and state equal a chain run
    over its root-to-node path (conv taps follow the same path)."""
    inp = _inputs(b=1, t=6)
    h0 = jnp.asarray(inp["h0"])
    parent = np.array([[-1, 0, 0, 1, -1, 2]], np.int32)  # two roots; node 5 hangs under node 2
    paths = [[0], [0, 1], [0, 2], [0, 1, 3], [4], [0, 2, 5]]
    o, after, states = _update(*_chunk(inp, 0, 6), h0, parent=jnp.asarray(parent), valid_len=jnp.array([6]),
                               return_states=True)
    rng = np.random.RandomState(3)
    x = rng.randn(1, 6, 5).astype(np.float32)
    conv_state = rng.randn(1, 3, 5).astype(np.float32)
    kern = rng.randn(4, 5).astype(np.float32)
    cout, cstate = _conv_update(x, conv_state, kern, parent=jnp.asarray(parent), valid_len=jnp.array([6]))
    for node, path in enumerate(paths):
        sub = {n: np.asarray(v)[:, path] for n, v in inp.items() if n != "h0"}
        o_p, s_p = _update(*(jnp.asarray(sub[n]) for n in ("q", "k", "v", "g", "beta")), h0)
        assert rel_err(o[:, node], o_p[:, -1]) <= REL_TOL, node
        assert rel_err(states[:, node], s_p) <= REL_TOL, node
        c_p, cs_p = _conv_update(x[:, path], conv_state, kern)
        assert rel_err(cout[:, node], c_p[:, -1]) <= REL_TOL, node
    assert rel_err(after, states[:, 5]) <= REL_TOL
    assert rel_err(cstate, cs_p) <= REL_TOL  # the conv state after node 5 (the last path)


# ------------------------------------------------------------------------------------------
# the short causal conv
# ------------------------------------------------------------------------------------------
def _np_conv(x, kernel, seg, state):
    """Direct loop: out[b, t] = sum_j kernel[K-1-j] * x[b, t-j], taps from the same segment only
    (state rows stand for t < 0 and belong to the first segment); then SiLU."""
    b, t, c = x.shape
    kk = kernel.shape[0]
    out = np.zeros((b, t, c), np.float64)
    for bi in range(b):
        for ti in range(t):
            for j in range(kk):
                s = ti - j
                if s >= 0 and seg[bi, s] == seg[bi, ti]:
                    out[bi, ti] += kernel[kk - 1 - j] * x[bi, s]
                elif s < 0 and np.all(seg[bi, : ti + 1] == seg[bi, 0]):
                    out[bi, ti] += kernel[kk - 1 - j] * state[bi, kk - 1 + s]
    return out / (1.0 + np.exp(-out))


def test_causal_conv_segments_state_and_transformers():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    rng = np.random.RandomState(4)
    b, t, c, kk = 2, 13, 6, 4
    x = rng.randn(b, t, c).astype(np.float32)
    kern = rng.randn(kk, c).astype(np.float32)
    state = rng.randn(b, kk - 1, c).astype(np.float32)
    seg = np.array([[1] * 5 + [2] + [3] * 5 + [0] * 2, [4] * 13], np.int32)
    conv = jax.jit(causal_conv1d, static_argnames=("return_conv_state",))
    out, tail = conv(x, kern, segment_ids=seg, conv_state=state, return_conv_state=True)
    assert rel_err(out, _np_conv(x, kern, seg, state)) <= REL_TOL
    # the conv state continuing the last segment: row 0's is the 2-token padding run, zero-padded in front
    assert np.array_equal(np.asarray(tail[0]), np.concatenate([np.zeros((1, c), np.float32), x[0, -2:]]))
    assert np.array_equal(np.asarray(tail[1]), x[1, -3:])
    # transformers' torch conv (the Qwen3-Next layer's causal_conv1d_fn / causal_conv1d_update), [B, C, T]
    w = torch.tensor(kern.T.copy())  # the Conv1d weight [C, 1, K] squeezed
    ref = hf.causal_conv1d_fn(torch.tensor(x).transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    assert rel_err(causal_conv1d(x, kern), ref.numpy()) <= REL_TOL
    hf_state = torch.tensor(np.concatenate([np.zeros((b, 1, c), np.float32), state], 1)).transpose(1, 2).contiguous()
    ref = hf.causal_conv1d_update(torch.tensor(x[:, :3]).transpose(1, 2), hf_state, w, None, activation="silu")
    out3, st3 = causal_conv1d_update(x[:, :3], state, kern)
    assert rel_err(out3, ref.transpose(1, 2).numpy()) <= REL_TOL
    assert np.array_equal(np.asarray(st3), hf_state.transpose(1, 2).numpy()[:, -(kk - 1):])  # rolled the same way
    # chained updates (chunks of 1, then 5, with a per-row valid length) == the whole sequence
    whole = causal_conv1d(x, kern, conv_state=state)
    st, outs = jnp.asarray(state), []
    for lo in range(0, 3):
        o, st = causal_conv1d_update(x[:, lo:lo + 1], st, kern)
        outs.append(o)
    o, st_rb = causal_conv1d_update(x[:, 3:8], st, kern, valid_len=jnp.array([5, 2]))
    outs.append(o)
    assert rel_err(jnp.concatenate(outs, axis=1), whole[:, :8]) <= REL_TOL
    assert np.array_equal(np.asarray(st_rb[0]), x[0, 5:8]) and np.array_equal(np.asarray(st_rb[1]), x[1, 2:5])


def test_composes_into_transformers_qwen3_5_layer():
    """The kernel contract against a real transformers Qwen3_5GatedDeltaNet (random weights): its
    in_proj_qkv, our causal_conv1d with kernel = conv1d.weight[:, 0, :].T, the [q | k | v] split into
    2 q/k heads and 4 value heads, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), then our
    gated_delta_rule equals what the layer feeds its gated norm (captured by a hook), within 1e-5."""
    torch = pytest.importorskip("torch")
    cfg_mod = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    torch.manual_seed(0)
    hk, hv, dk, dv, t = 2, 4, 8, 6, 11
    cfg = cfg_mod.Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=hk, linear_num_value_heads=hv,
                                    linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4,
                                    num_hidden_layers=1, layer_types=["linear_attention"])
    layer = hf.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
    seen = {}
    layer.norm.register_forward_hook(lambda mod, args, out: seen.update(core=args[0].numpy()))
    x = torch.randn(2, t, 32)
    with torch.no_grad():
        layer(x)
    xn = x.numpy()
    proj = lambda lin: xn @ lin.weight.detach().numpy().T  # noqa: E731
    qkv = np.asarray(causal_conv1d(proj(layer.in_proj_qkv), layer.conv1d.weight.detach().numpy()[:, 0, :].T))
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk], axis=-1)
    a_log, dt_bias = layer.A_log.detach().numpy(), layer.dt_bias.detach().numpy()
    g = -np.exp(a_log) * np.log1p(np.exp(proj(layer.in_proj_a) + dt_bias))
    beta = 1.0 / (1.0 + np.exp(-proj(layer.in_proj_b)))
    o = _gdr(q.reshape(2, t, hk, dk), k.reshape(2, t, hk, dk), v.reshape(2, t, hv, dv), g.astype(np.float32),
             beta.astype(np.float32), chunk_size=4)
    assert rel_err(o, seen["core"].reshape(2, t, hv, dv)) <= REL_TOL


# ------------------------------------------------------------------------------------------
# context parallelism (8 fake CPU devices, tests/conftest.py) and TPU lowering
# ------------------------------------------------------------------------------------------
def test_context_parallel_matches_single_device():
    """T split over 4 shards (documents start inside shards and exactly on the shard edge t = 16, a
    9-row document spans two edges), with an initial state and the final state, within 1e-5."""
    from specjax_kernels.gated_delta.context_parallel import gated_delta_rule_context_parallel

    inp = _inputs(t=32, seed=5)
    seg = jnp.asarray(np.array([[1] * 5 + [2] * 11 + [3] * 9 + [4] * 7, [7] * 32], np.int32))
    args = [jnp.asarray(inp[x]) for x in ("q", "k", "v", "g", "beta")]
    h0 = jnp.asarray(inp["h0"])
    want, want_s = _run("reference", inp, segment_ids=seg, initial_state=h0)
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    got, got_s = jax.jit(lambda *xs: gated_delta_rule_context_parallel(
        *xs, segment_ids=seg, initial_state=h0, chunk_size=4, return_final_state=True, mesh=mesh))(*args)
    assert rel_err(got, want) <= REL_TOL and rel_err(got_s, want_s) <= REL_TOL
    with pytest.raises(ValueError, match="not divisible by the 4 shards"):
        gated_delta_rule_context_parallel(*(a[:, :30] for a in args), mesh=mesh)


def test_xla_path_lowers_for_tpu():
    """The chunked path at a Qwen3.5-35B-A3B linear-attention layer (16 q/k heads, 32 value heads,
    Dk = Dv = 128, T = 4096, bf16) lowers for a TPU through jax.export from this CPU host: plain
    StableHLO, no custom calls; the blocked UT inverse is matmuls (no triangular_solve op)."""
    s = jax.ShapeDtypeStruct
    b, t, hk, hv, d = 1, 4096, 16, 32, 128
    args = (s((b, t, hk, d), jnp.bfloat16), s((b, t, hk, d), jnp.bfloat16), s((b, t, hv, d), jnp.bfloat16),
            s((b, t, hv), jnp.float32), s((b, t, hv), jnp.bfloat16), s((b, t), jnp.int32))
    fn = lambda q, k, v, g, beta, seg: gated_delta_rule(q, k, v, g, beta, segment_ids=seg,  # noqa: E731
                                                          implementation="xla", return_final_state=True)
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert "custom_call" not in text and "triangular_solve" not in text and "dot_general" in text
