"""specjax_kernels.decode_attention: the pallas_gpu kernel (interpret mode on the CPU) against the
reference (the plain masked attention over the sliced cache layer), and cached decoding through it.

Bars (fp32 under `highest`): kernel == reference to 2e-5 abs for GQA groups 1 and 3, one-token and
tree-masked chunks, rows with different live lengths (its `limit` cut at and inside a key block),
bf16 to 2e-2; under vmap with the cache batched, shared, and with a batched layer index; `takes`
sends a prefill chunk and the xla choice to the slice-the-layer path. Then a target's cached decode
with `decode_attention_implementation="pallas_gpu"` equals its xla decode (logits 1e-5), and a
batched SpecLoop (one target call verifying every row) produces the same tokens and accept counts.
The mask operand prepared once per chunk (`api.prepare_mask`) gives the bool mask's output exactly, and
in every family's cached decode the int8 mask work sits outside the layer loops, once. Split-K
(`pallas_gpu_split`) meets the same 2e-5 bar for 2, 4 and 8 splits, also with splits that hold no live block."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

from specjax_kernels.decode_attention import api, pallas_gpu, reference


def _case(seed, L=3, B=3, S=128, K=2, H=16, G=3, T=1, dtype=jnp.float32, tree=False):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(L, B, S, K, H)), dtype)
    v = jnp.asarray(rng.normal(size=(L, B, S, K, H)), dtype)
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), dtype)
    start = rng.integers(0, S - T, size=B)
    start[0] = 63 - T + 1  # the chunk ends exactly at a key-block edge (block 64)
    mask = np.zeros((B, T, S), bool)
    for b in range(B):
        mask[b, :, : start[b]] = True
        chunk = np.tril(np.ones((T, T), bool))
        if tree:  # a random tree: each node sees itself and some earlier nodes
            chunk = chunk & (rng.random((T, T)) < 0.6) | np.eye(T, dtype=bool)
        mask[b, :, start[b]: start[b] + T] = chunk
    return q, k, v, jnp.asarray(mask), jnp.asarray(start + T, jnp.int32)


def _diff(a, b):
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.mark.parametrize("G,T,tree", [(1, 1, False), (3, 1, False), (3, 4, True), (2, 6, False)])
def test_kernel_equals_reference(G, T, tree):
    q, k, v, mask, limit = _case(G * 10 + T, G=G, T=T, tree=tree)
    with jax.default_matmul_precision("highest"):
        for layer in (0, 2):
            want = reference.decode_attention(q, k, v, layer, mask, limit, 0.25)
            got = pallas_gpu.decode_attention(q, k, v, layer, mask, limit, 0.25, interpret=True)
            assert _diff(got, want) < 2e-5
    # the live limit is honoured: garbage past it changes nothing
    k2 = k.at[:, :, 127].set(1e4)
    got2 = pallas_gpu.decode_attention(q, k2, v, 1, mask, jnp.minimum(limit, 127), 0.25, interpret=True)
    with jax.default_matmul_precision("highest"):
        assert _diff(got2, reference.decode_attention(q, k, v, 1, mask, limit, 0.25)) < 2e-5


@pytest.mark.parametrize("G,T,tree,S", [(3, 1, False, 512), (3, 6, False, 512), (2, 4, True, 256), (1, 1, False, 128)])
@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_kernel_equals_reference(G, T, tree, S, splits):
    """Split-K: every split count against the reference and the one-program kernel, with row 0's live
    prefix one key block long (its other splits empty) and the others anywhere in the cache."""
    q, k, v, mask, limit = _case(G * 10 + T + splits, G=G, T=T, tree=tree, S=S)
    with jax.default_matmul_precision("highest"):
        for layer in (0, 2):
            want = reference.decode_attention(q, k, v, layer, mask, limit, 0.25)
            got = pallas_gpu.decode_attention(q, k, v, layer, mask, limit, 0.25, interpret=True, splits=splits)
            one = pallas_gpu.decode_attention(q, k, v, layer, mask, limit, 0.25, interpret=True)
            assert _diff(got, want) < 2e-5 and _diff(got, one) < 2e-5
        # through the api by name, with the prepared mask rows, and vmapped (the rule folds the axis in)
        cm = api.prepare_mask(mask, q.shape[2], q.shape[3], k.shape, "pallas_gpu_split")
        assert cm.rows is not None
        got = api.decode_attention(q, k, v, 1, cm, limit, scale=0.25, implementation="pallas_gpu_split")
        assert _diff(got, reference.decode_attention(q, k, v, 1, mask, limit, 0.25)) < 2e-5
        qs, ks = jnp.stack([q, -q]), jnp.stack([k, k * 0.5])
        got_v = jax.vmap(lambda q_, k_: pallas_gpu.decode_attention(q_, k_, v, 1, mask, limit, 0.25, interpret=True,
                                                                     splits=splits))(qs, ks)
        assert _diff(got_v[1], reference.decode_attention(-q, k * 0.5, v, 1, mask, limit, 0.25)) < 2e-5
    # garbage past the live limit changes nothing
    k2 = k.at[:, :, S - 1].set(1e4)
    got2 = pallas_gpu.decode_attention(q, k2, v, 1, mask, jnp.minimum(limit, S - 1), 0.25, interpret=True,
                                       splits=splits)
    with jax.default_matmul_precision("highest"):
        assert _diff(got2, reference.decode_attention(q, k, v, 1, mask, limit, 0.25)) < 2e-5


@pytest.mark.parametrize("T", [1, 6])
def test_split_kernel_with_a_masked_live_split(T):
    """A split whose live key blocks are all masked (a short prompt padded to a longer bucket leaves such a
    hole before the generated tokens): it carries m = MASK with a nonzero sum and must weigh 0 in the merge.
    Large keys in the hole make any leak show."""
    q, k, v, mask, limit = _case(50 + T, G=3, T=T, S=512)
    hole = np.zeros((512,), bool)
    hole[64:320] = True  # key blocks 1..4: with 8 live blocks and 4 splits, split 1 (blocks 2, 3) sees nothing
    mask = jnp.asarray(np.asarray(mask) & ~hole)
    limit = jnp.full_like(limit, 512 - 12)
    mask = mask.at[:, :, 320:500].set(True)
    k = k.at[:, :, 64:320].set(k[:, :, 64:320] * 1e3)
    with jax.default_matmul_precision("highest"):
        want = reference.decode_attention(q, k, v, 1, mask, limit, 0.25)
        for splits in (2, 4, 8):
            got = pallas_gpu.decode_attention(q, k, v, 1, mask, limit, 0.25, interpret=True, splits=splits)
            assert _diff(got, want) < 2e-5, splits


def test_kernel_bf16():
    q, k, v, mask, limit = _case(7, G=3, T=2, dtype=jnp.bfloat16)
    want = reference.decode_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), 1,
                                      mask, limit, 0.25)
    got = pallas_gpu.decode_attention(q, k, v, 1, mask, limit, 0.25, interpret=True)
    assert got.dtype == jnp.bfloat16 and _diff(got, want) < 2e-2
    got = pallas_gpu.decode_attention(q, k, v, 1, mask, limit, 0.25, interpret=True, splits=2)
    assert got.dtype == jnp.bfloat16 and _diff(got, want) < 2e-2


def test_kernel_under_vmap():
    q, k, v, mask, limit = _case(3, G=3, T=2)
    qs, ks, vs = jnp.stack([q, -q]), jnp.stack([k, k * 0.5]), jnp.stack([v, v + 1])

    def run(fn, **kw):
        return lambda q_, k_, v_, layer: fn(q_, k_, v_, layer, mask, limit, 0.25, **kw)
    kern, ref = run(pallas_gpu.decode_attention, interpret=True), run(reference.decode_attention)
    with jax.default_matmul_precision("highest"):
        for axes, args in (((0, 0, 0, None), (qs, ks, vs, 1)),  # cache batched (SpecLoop's rows)
                           ((0, None, None, None), (qs, k, v, 1)),  # one shared cache
                           ((0, 0, 0, 0), (qs, ks, vs, jnp.array([0, 2])))):  # a layer per member
            assert _diff(jax.vmap(kern, axes)(*args), jax.vmap(ref, axes)(*args)) < 2e-5, axes


def test_takes_routes_prefill_and_xla():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "target_platform", lambda: "gpu")
        mp.setattr(api, "resolve_implementation", lambda op, impls, pref, impl: (impl if impl not in (None, "auto") else "pallas_gpu",
                                                                  None))
        assert api.takes((8, 1, 9, 64), (30, 8, 1536, 3, 64))  # a decode step: the kernel
        assert api.takes((8, 6, 9, 64), (30, 8, 1536, 3, 64))  # a K = 5 verification chunk
        assert not api.takes((8, 1024, 9, 64), (30, 8, 1536, 3, 64))  # a prefill: xla
        assert not api.takes((8, 1, 9, 48), (30, 8, 1536, 3, 48))  # head_dim not a power of two
        assert not api.takes((8, 1, 9, 64), (30, 8, 1536, 3, 64), "xla")
        assert api.takes((8, 1024, 9, 64), (30, 8, 1536, 3, 64), "reference")
    # on the CPU auto keeps the xla path
    assert not api.takes((8, 1, 9, 64), (30, 8, 1536, 3, 64))


# ---- cached decoding through the kernel ----------------------------------------------------------
def _with(target, impl):
    cfg = dataclasses.replace(target.config, kernels=dataclasses.replace(target.config.kernels, decode_attention=impl))
    return type(target)(cfg, target.hf_config, target.params)


@pytest.mark.parametrize("family,kernel", [("qwen3_moe", "pallas_gpu"), ("looped_llama", "pallas_gpu"),
                                           ("qwen3_moe", "pallas_gpu_split")])
def test_decoding_through_the_kernel(family, kernel, monkeypatch):
    from parity.test_decoding_families import build, random_draft

    from specjax_kernels.selection import recording_choices

    from specjax.eval.spec_decode import SpecDecoder
    from specjax.eval.spec_loop import SpecLoop

    monkeypatch.setattr(api, "PREFERENCE", {**api.PREFERENCE, "cpu": [kernel, "xla"]})  # auto = kernel
    monkeypatch.setattr(api, "SPLITS", 3)  # the 256-slot cache's 4 key blocks over 3 splits: uneven shares
    base = build(family, head_dim=16)  # the kernel's smallest head_dim
    xla, kern = _with(base, "xla"), _with(base, "auto")
    prompt = jnp.asarray([[5, 17, 3, 9, 11, 2, 40, 8]], jnp.int32)
    with jax.default_matmul_precision("highest"), recording_choices() as chosen:
        outs = []
        for t in (xla, kern):
            decode = jax.jit(t.decode_chunk, static_argnames=("aux_layer_ids",))  # eager, the scans dispatch slowly
            cache = t.init_cache(1, 64)
            pos = jnp.arange(8, dtype=jnp.int32)[None]
            _, _, _, cache = decode(t.params, cache, prompt[:, :6], pos[:, :6], jnp.array([0]))  # prefill
            tree = jnp.asarray(np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)[None])
            logits, aux, final, _ = decode(t.params, cache, prompt[:, 5:8], jnp.asarray([[6, 7, 7]]), jnp.array([6]),
                                           aux_layer_ids=t.default_aux_layer_ids(), chunk_mask=tree)
            outs.append((logits, final))
        assert _diff(outs[0][0], outs[1][0]) < 1e-5 and _diff(outs[0][1], outs[1][1]) < 1e-5
        prompts = [[5, 17, 3, 9, 11, 2, 40], [3, 1, 4], list(range(20, 33))]
        rows = [SpecLoop(SpecDecoder(t, random_draft(t), num_spec_tokens=3)).generate(prompts, max_new_tokens=10)
                for t in (xla, kern)]
    assert chosen["decode_attention"] == {"xla", kernel}  # the kernel ran (and the prefills took xla)
    for a, b in zip(*rows):
        assert (a.tokens, a.accept_lengths, a.accepted_per_position) == (b.tokens, b.accept_lengths,
                                                                         b.accepted_per_position)


@pytest.mark.parametrize("T", [1, 6])
def test_kernel_lowers_for_cuda_on_this_machine(T):
    """The Pallas (Triton) lowering runs on a CPU machine: a one-token step (its mask row broadcast
    over the G query rows, no per-layer [B, Rp, S] mask copy) and a verification chunk both lower,
    and the one-token step pads only q, not the mask; given prepared mask rows, every chunk pads only q."""
    V, B, N, H, L, S, K = 1, 4, 9, 64, 2, 256, 3
    sds = jax.ShapeDtypeStruct
    f = jax.jit(lambda q, k, v, m, lim: pallas_gpu.decode_attention_stacked(q, k, v, jnp.int32(1), m, lim, 0.125))
    low = f.trace(sds((V, B, T, N, H), jnp.bfloat16), sds((V, L, B, S, K, H), jnp.bfloat16),
                  sds((V, L, B, S, K, H), jnp.bfloat16), sds((V, B, T, S), jnp.bool_),
                  sds((V, B), jnp.int32)).lower(lowering_platforms=("cuda",))
    text = low.as_text()
    assert "decode_attention" in text
    assert text.count("stablehlo.pad") == (1 if T == 1 else 2)
    # with the mask rows prepared beforehand (api.prepare_mask, once per chunk) the layer's call pads q only
    g = jax.jit(lambda q, k, v, m, lim: pallas_gpu.decode_attention_stacked(q, k, v, jnp.int32(1), m, lim, 0.125,
                                                                           rows=True))
    rows = sds((V, B, 1 if T == 1 else pallas_gpu._rows_padded(T * 3), S), jnp.int8)
    text = g.trace(sds((V, B, T, N, H), jnp.bfloat16), sds((V, L, B, S, K, H), jnp.bfloat16),
                   sds((V, L, B, S, K, H), jnp.bfloat16), rows, sds((V, B), jnp.int32)).lower(
                       lowering_platforms=("cuda",)).as_text()
    assert "decode_attention" in text and text.count("stablehlo.pad") == 1
    # split-K lowers too: the split kernel, its three outputs merged outside it
    h = jax.jit(lambda q, k, v, m, lim: pallas_gpu.decode_attention_stacked(q, k, v, jnp.int32(1), m, lim, 0.125,
                                                                           rows=True, splits=4))
    text = h.trace(sds((V, B, T, N, H), jnp.bfloat16), sds((V, L, B, S, K, H), jnp.bfloat16),
                   sds((V, L, B, S, K, H), jnp.bfloat16), rows, sds((V, B), jnp.int32)).lower(
                       lowering_platforms=("cuda",)).as_text()
    assert "decode_attention_split" in text and "tensor<4x3x4x" in text  # [V*B, K, splits, ...] partial states


# ---- the mask operand, built once per chunk (api.prepare_mask) --------------------------------------
@pytest.mark.parametrize("G,T", [(3, 1), (3, 6), (1, 4)])
def test_prepared_mask_equals_the_bool_mask(G, T, monkeypatch):
    monkeypatch.setattr(api, "PREFERENCE", {**api.PREFERENCE, "cpu": ["pallas_gpu", "xla"]})  # auto = kernel
    q, k, v, mask, limit = _case(G * 7 + T, G=G, T=T, tree=T > 1)
    B, S = mask.shape[0], mask.shape[2]
    cm = api.prepare_mask(mask, q.shape[2], q.shape[3], k.shape)
    rp = pallas_gpu._rows_padded(T * G)
    assert cm.rows is not None and cm.rows.dtype == jnp.int8 and cm.rows.shape == (B, 1 if T == 1 else rp, S)
    with jax.default_matmul_precision("highest"):
        want = reference.decode_attention(q, k, v, 1, mask, limit, 0.25)
        got = api.decode_attention(q, k, v, 1, cm, limit, scale=0.25)
        assert _diff(got, api.decode_attention(q, k, v, 1, mask, limit, scale=0.25)) == 0
        assert _diff(got, want) < 2e-5
        # rows vmapped with the chunk (a vmapped decoder's ChunkMask is batched like its queries)
        qs, cms = jnp.stack([q, -q]), jax.tree.map(lambda x: jnp.stack([x, x]), cm)
        got_v = jax.vmap(lambda q_, m_: api.decode_attention(q_, k, v, 1, m_, limit, scale=0.25))(qs, cms)
        assert _diff(got_v[1], reference.decode_attention(-q, k, v, 1, mask, limit, 0.25)) < 2e-5
        # xla chosen: the ChunkMask holds the bool mask alone, which the reference reads
        cx = api.prepare_mask(mask, q.shape[2], q.shape[3], k.shape, "xla")
        assert cx.rows is None
        assert _diff(api.decode_attention(q, k, v, 1, cx, limit, scale=0.25, implementation="xla"), want) < 2e-5
    # a prefill chunk the kernel does not take keeps the bool mask only
    long_mask = jnp.ones((B, pallas_gpu.MAX_ROWS // G + 1, S), bool)
    assert api.prepare_mask(long_mask, q.shape[2], q.shape[3], k.shape).rows is None
    # rows of another chunk shape are refused, not misread
    with pytest.raises(ValueError, match="mask rows"):
        pallas_gpu.decode_attention(q, k, v, 1, jnp.ones((B, 2, S), jnp.int8), limit, 0.25, interpret=True,
                                    rows=True)


def _loop_mask_ops(jaxpr, in_loop=False, out=None):
    """{"inside": n, "outside": n} int8 converts / pads (the kernel's mask operand) and {"kernel_in_loop": n}
    pallas calls in a jaxpr, by whether a scan / while loop holds them (kernel bodies are not entered)."""
    out = {"inside": 0, "outside": 0, "kernels": 0, "kernel_in_loop": 0} if out is None else out
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            out["kernels"] += 1
            out["kernel_in_loop"] += in_loop
            continue
        if e.primitive.name in ("convert_element_type", "pad") and e.outvars[0].aval.dtype == jnp.int8:
            out["inside" if in_loop else "outside"] += 1
        loop = in_loop or e.primitive.name in ("scan", "while")
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, ClosedJaxpr):
                    _loop_mask_ops(sub.jaxpr, loop, out)
                elif isinstance(sub, Jaxpr):
                    _loop_mask_ops(sub, loop, out)
    return out


def _tiny(family, tmp_path):
    """The test suite's own tiny targets, at the kernel's smallest head_dim (16)."""
    if family == "qwen3":  # targets/llama.py's decode_chunk
        from eval._models import build_target

        from specjax.targets import load_target
        return load_target(build_target(tmp_path, "Qwen3ForCausalLM", False), dtype="float32")
    if family == "nemotron_h":  # one attention layer among Mamba / MoE layers
        from parity.test_decoding_nemotron_h import build
        return build(head_dim=16)
    from parity.test_decoding_families import build
    return build(family, head_dim=16)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "looped_llama", "hrm_text", "nemotron_h"])
@pytest.mark.parametrize("T", [1, 6])
def test_mask_operand_is_built_once_per_chunk(family, T, monkeypatch, tmp_path):
    """A cached chunk through the kernel converts (and for T > 1 expands and pads) its mask to the
    kernel's int8 rows once, outside the layer loops, while the kernel itself runs inside them (run 9's
    profile: that work had run once per layer, 30 times a batch-8 step)."""
    monkeypatch.setattr(api, "PREFERENCE", {**api.PREFERENCE, "cpu": ["pallas_gpu", "xla"]})
    t = _tiny(family, tmp_path)
    cache = t.init_cache(2, 64)
    ids = jnp.ones((2, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 5, (2, T))
    jaxpr = jax.make_jaxpr(lambda c: type(t).decoder.decode_chunk(t.params, t.config, c, ids, pos, jnp.array([5, 9])))(cache)
    ops = _loop_mask_ops(jaxpr.jaxpr)
    g = t.config.attention.num_heads // t.config.attention.num_kv_heads
    once = _loop_mask_ops(jax.make_jaxpr(lambda m: pallas_gpu.mask_rows(m, g))(jnp.ones((2, T, 64), bool)).jaxpr)
    # the kernel runs inside a layer loop (Nemotron-H's layers are a Python loop, so no loop holds it)
    assert ops["kernels"] >= 1 and (ops["kernel_in_loop"] >= 1 or family == "nemotron_h"), ops
    assert ops["inside"] == 0 and ops["outside"] == once["outside"] >= 1, (ops, once)
