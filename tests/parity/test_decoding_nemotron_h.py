"""Cached decoding and lossless speculative decoding for Nemotron-H (hybrid Mamba-2 / attention /
MoE): the Mamba layers carry recurrent state, so rollback cannot be "a shorter valid length" alone
(nemotron_h.py "Cached decoding", layers/mamba2.py "Cached decoding"). A tiny random target built
from its config (Mamba, MoE, attention, Mamba); CPU, fp32, no torch.

Bars (tolerance: 1e-5 abs + 1e-5 rel on fp32 logits of O(1), as for the other families):
  (a) ``target.decode_chunk`` equals the uncached forward: B=2 ragged prompts, one left-padded
      (valid_from + a chunk mask hiding the pads), prefilled over a stale chunk, then single tokens
      and chunks; a prefill longer than the state window resuming after its logits_index rows.
  (b) rollback: after a chunk of T tokens the next chunk may start at every slot start..start+T
      (accepted position j = -1..T-1 by the decoder's convention) and equals the forward of the
      kept prefix; a tree chunk equals the forward of each root-to-node path, and after committing
      any accepted path (commit_path_fn) decoding continues as the forward of that path.
  (c) speculative decoding (chain and tree, a random head and drafts wrong at a moving position)
      equals the target's greedy output; batched generate (ragged prompts) equals naive greedy;
      rejection sampling (temperature 2) gives the target's distribution of the 2nd token.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts.eagle3 import config_from_target, init_draft_params
from specjax.drafts.vocab import DraftVocab
from specjax.eval.generate import generate
from specjax.eval.spec_decode import Draft, SpecDecoder
from specjax.targets import nemotron_h as nh
from parity.test_decoding_families import (MAX_NEW, PROMPT, VOCAB, OneWrongChain, OneWrongTree,
                                           one_wrong_accept_lengths, random_draft)

ATOL = RTOL = 1e-5
WINDOW = 16  # decode_state_window: >= the longest verify chunk below (a tree of 1 + 2 + 4 + 8 rows)
REF_SHAPE = (8, 32)  # every reference forward runs at one padded shape (causal: the pad is unseen)
# Compiles dominate this file's time on a small CPU: every direct decode call below uses one of four
# signatures (B=2; T=9 with a chunk mask, T=1, T=3, T=20 with logits_index) and one reference shape.


def _config(vocab=VOCAB, **overrides):
    hf = dict(
        architectures=[nh.ARCHITECTURE], vocab_size=vocab, hidden_size=32,
        layers_block_type=[nh.MAMBA, nh.MOE, nh.ATTENTION, nh.MAMBA], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, conv_kernel=4, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
    return nh.NemotronHTargetConfig.from_hf(dict(hf, **overrides), decode_state_window=WINDOW)


def build(seed=0, vocab=VOCAB, **overrides):
    """HF-style init (A_log, dt_bias, D) with noise on the SSM parameters and matrices N(0, 0.15^2)
    (embeddings and lm_head 0.5), so logits are O(1) and the SSM decays differ per head. `overrides`:
    other HF config fields (head_dim=16 for the decode-attention kernel's smallest head)."""
    cfg = _config(vocab, **overrides)
    params = nh.init_params(cfg, jax.random.key(seed), std=0.15)
    key = jax.random.key(seed + 1)
    m = params["mamba"]["mixer"]
    for i, name in enumerate(("A_log", "dt_bias")):
        m[name] = m[name] + 0.3 * jax.random.normal(jax.random.fold_in(key, i), m[name].shape)
    m["conv1d"]["bias"] = 0.1 * jax.random.normal(jax.random.fold_in(key, 2), m["conv1d"]["bias"].shape)
    params["embeddings"]["embedding"] = params["embeddings"]["embedding"] * (0.5 / 0.15)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * (0.5 / 0.15)
    return nh.NemotronHTarget(cfg, cfg.to_hf(), params)


@pytest.fixture(scope="module")
def target():
    return build()


_DECODERS: dict = {}


def _decoder(target):
    """One jitted decode per target for the whole file (a new jit would compile every signature again)."""
    if id(target) not in _DECODERS:
        _DECODERS[id(target)] = _make_decoder(target)
    return _DECODERS[id(target)]


def _make_decoder(target):
    return jax.jit(lambda c, i, s, m=None, vf=None, li=None: target.decode_chunk(
        target.params, c, i, jnp.zeros_like(i), s, aux_layer_ids=target.default_aux_layer_ids(), chunk_mask=m,
        valid_from=vf, logits_index=li))


def _reference(target, seqs):
    """Uncached forward of each sequence (rows of one padded [8, 32] batch), as numpy."""
    ids = np.zeros(REF_SHAPE, np.int32)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    out = target(jnp.asarray(ids), aux_layer_ids=target.default_aux_layer_ids())
    return jax.tree.map(np.asarray, out)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)


def _check(out, r, t, ref, ref_row, ref_t):
    """Decode output rows r, chunk rows t (slice) vs reference row ref_row at positions ref_t."""
    logits, aux, final = (np.asarray(out[0]), [np.asarray(a) for a in out[1]], np.asarray(out[2]))
    _close(logits[r, t], ref.logits[ref_row, ref_t])
    _close(final[r, t], ref.final_hidden[ref_row, ref_t])
    for k in range(len(aux)):
        _close(aux[k][r, t], ref.aux_hidden[k][ref_row, ref_t])
    return float(np.abs(logits[r, t] - ref.logits[ref_row, ref_t]).max())


ZERO2 = jnp.zeros((2,), jnp.int32)
CAUSAL9 = jnp.asarray(np.broadcast_to(np.tril(np.ones((9, 9), bool)), (2, 9, 9)))


def test_registered_and_cache_layout(target):
    assert target.supports_decoding
    target.require_decoding()
    cache = target.init_cache(2, 40)
    cfg = target.config
    assert cache["k"].shape == (1, 2, 256, 2, 8)  # one attention block
    assert cache["conv"].shape == (2, 2, 256, cfg.mamba_dims.conv_dim)  # two Mamba blocks: every slot's input
    assert cache["ssm"].shape == (2, 2, WINDOW, 4, 8, 8) and cache["ssm"].dtype == jnp.float32  # a window, not S
    # the real shape: W states per Mamba layer, independent of the cache length
    nano = nh.NemotronHTargetConfig.from_hf(nh.NEMOTRON_3_NANO_30B_A3B_HF_CONFIG)
    shapes = jax.eval_shape(lambda: nh.init_cache(nano, 1, 4096, jnp.bfloat16))
    assert shapes["ssm"].shape == (23, 1, nano.decode_state_window, 64, 64, 128)


# =============================================================================================
# (a) cached decoding == uncached forward
# =============================================================================================
def test_cached_decoding_equals_forward_left_padded(target):
    rng = np.random.RandomState(0)
    seq = [rng.randint(0, VOCAB, 18).astype(np.int32), rng.randint(0, VOCAB, 15).astype(np.int32)]
    pad = 3  # row 1: 3 pads at slots 0..2, its tokens at slots 3..; row 0 unpadded
    ref = _reference(target, seq)
    assert np.abs(ref.logits).max() > 1.0  # O(1) logits: the tolerance is not vacuous
    decode = _decoder(target)
    vf = jnp.asarray([0, pad], jnp.int32)
    causal = np.tril(np.ones((9, 9), bool))
    mask = jnp.asarray(np.stack([causal, causal & ((np.arange(9)[None, :] >= pad) | np.eye(9, dtype=bool))]))
    chunk0 = np.stack([seq[0][:9], np.concatenate([[7, 7, 7], seq[1][:6]])]).astype(np.int32)
    cache = target.init_cache(2, 40)
    cache = decode(cache, jnp.asarray(chunk0[:, ::-1].copy()), ZERO2, mask, vf)[3]  # stale slots, rolled back to 0
    out = decode(cache, jnp.asarray(chunk0), ZERO2, mask, vf)
    worst = max(_check(out, 0, slice(0, 9), ref, 0, slice(0, 9)), _check(out, 1, slice(pad, 9), ref, 1, slice(0, 6)))
    cache, a = out[3], 9
    for n in (1, 1, 3, 1, 3):  # single tokens and chunks, both rows at slot a (row 1 is `pad` tokens behind)
        chunk = np.stack([seq[0][a: a + n], seq[1][a - pad: a - pad + n]])
        out = decode(cache, jnp.asarray(chunk), jnp.full((2,), a, jnp.int32), None, vf)
        worst = max(worst, _check(out, 0, slice(0, n), ref, 0, slice(a, a + n)),
                    _check(out, 1, slice(0, n), ref, 1, slice(a - pad, a - pad + n)))
        cache, a = out[3], a + n
    assert a == len(seq[0]) and a - pad == len(seq[1])
    print(f"\nNemotron-H: max |cached - uncached| logits {worst:.2e}")


def test_prefill_longer_than_window(target):
    # A right-padded prefill of 20 > WINDOW rows (as generate / SpecDecoder run it): the states after
    # the logits_index rows are kept, so each row continues after its own prompt; a start whose
    # state was not kept gives NaN, not a silently wrong state.
    rng = np.random.RandomState(3)
    seq = [rng.randint(0, VOCAB, 11).astype(np.int32), rng.randint(0, VOCAB, 16).astype(np.int32)]
    lens = [8, 13]
    ref = _reference(target, seq)
    decode = _decoder(target)
    chunk = np.zeros((2, 20), np.int32)
    for r in (0, 1):
        chunk[r, : lens[r]] = seq[r][: lens[r]]
    li = jnp.asarray([[lens[0] - 1], [lens[1] - 1]], jnp.int32)
    out = decode(target.init_cache(2, 40), jnp.asarray(chunk), ZERO2, None, None, li)
    for r in (0, 1):
        _close(out[0][r, 0], ref.logits[r, lens[r] - 1])
    cache = out[3]
    nxt = jnp.asarray(np.stack([seq[0][8:11], seq[1][13:16]]))
    out = decode(cache, nxt, jnp.asarray(lens, jnp.int32), None, ZERO2)
    for r in (0, 1):
        _check(out, r, slice(0, 3), ref, r, slice(lens[r], lens[r] + 3))
    # slot 3: inside the prefill, neither a logits row nor among its last rows
    logits = np.asarray(decode(cache, nxt, jnp.asarray([3, lens[1]], jnp.int32), None, ZERO2)[0])
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()


# =============================================================================================
# (b) rollback: resume after every accepted position; tree chunks and their commit
# =============================================================================================
def test_rollback_every_position(target):
    # prefix of 9, then a chunk [last token, d1, d2] at slot 9; the decoder resumes at 9 + j + 1 after
    # accepting j drafts (j = 0..2), and a re-write from 9 itself (j = -1) works too. Row 1 resumes
    # at the mirrored point (per-row window lookup). Next chunk: 3 new tokens.
    rng = np.random.RandomState(4)
    prefix = rng.randint(0, VOCAB, (2, 9)).astype(np.int32)
    chunk = rng.randint(0, VOCAB, (2, 3)).astype(np.int32)
    nxt = rng.randint(0, VOCAB, (2, 3)).astype(np.int32)
    decode = _decoder(target)
    cache = decode(target.init_cache(2, 24), jnp.asarray(prefix), ZERO2, CAUSAL9, ZERO2)[3]
    cache = decode(cache, jnp.asarray(chunk), jnp.full((2,), 9, jnp.int32), None, ZERO2)[3]
    keeps = [(j + 1, 2 - j) for j in range(-1, 3)]  # tokens of the chunk kept, per row
    ref = _reference(target, [np.concatenate([prefix[r], chunk[r, : kp[r]], nxt[r]]) for kp in keeps for r in (0, 1)])
    for q, kp in enumerate(keeps):
        out = decode(cache, jnp.asarray(nxt), jnp.asarray([9 + kp[0], 9 + kp[1]], jnp.int32), None, ZERO2)
        for r in (0, 1):
            _check(out, r, slice(0, 3), ref, 2 * q + r, slice(9 + kp[r], 12 + kp[r]))


def test_tree_chunk_and_commit(target):
    # prefix x0..x8 cached; a 9-node tree (parents before children, depth 3) at slot 9, node 0 = x9.
    # Each node equals the forward of its root-to-node path; committing the path to any node (as
    # _verify_tree does, target_cls.commit_path_fn) continues as the forward of that path.
    rng = np.random.RandomState(5)
    x = rng.randint(0, VOCAB, 10).astype(np.int32)
    nodes = rng.randint(0, VOCAB, 9).astype(np.int32)
    nodes[0] = x[9]
    parent = [-1, 0, 0, 1, 2, 2, 3, 5, 4]
    paths = []
    for i in range(9):
        path, p = [i], parent[i]
        while p >= 0:
            path.insert(0, p)
            p = parent[p]
        paths.append(path)
    anc = np.zeros((9, 9), bool)
    for i, path in enumerate(paths):
        anc[i, path] = True
    decode = _decoder(target)
    prefix = jnp.asarray(np.broadcast_to(x[:9], (2, 9)))
    cache = decode(target.init_cache(2, 24), prefix, ZERO2, CAUSAL9, ZERO2)[3]
    out = decode(cache, jnp.asarray(np.broadcast_to(nodes, (2, 9))), jnp.full((2,), 9, jnp.int32),
                 jnp.asarray(np.broadcast_to(anc, (2, 9, 9))), ZERO2)
    tcache = out[3]
    nxt = rng.randint(0, VOCAB, 3).astype(np.int32)
    seqs = [np.concatenate([x[:9], nodes[path], nxt]) for path in paths]
    refs = [_reference(target, seqs[:8]), _reference(target, seqs[8:])]
    ref_of = lambda i: (refs[i // 8], i % 8)  # noqa: E731
    for i, path in enumerate(paths):
        ref, row = ref_of(i)
        at = 9 + len(path) - 1
        for r in (0, 1):
            _check(out, r, slice(i, i + 1), ref, row, slice(at, at + 1))
    commit = jax.jit(nh.NemotronHTarget.commit_path_fn)
    depth = 3  # the path array: depth + 1 chunk rows, zeros past the accepted end (as _verify_tree builds it)
    for i, path in enumerate(paths):
        a = len(path) - 1
        c = commit(tcache, jnp.int32(9), jnp.asarray(path + [0] * (depth + 1 - len(path)), jnp.int32), jnp.int32(a))
        res = decode(c, jnp.asarray(np.broadcast_to(nxt, (2, 3))), jnp.full((2,), 9 + a + 1, jnp.int32), None, ZERO2)
        ref, row = ref_of(i)
        _check(res, 0, slice(0, 3), ref, row, slice(10 + a, 13 + a))  # commit moves batch row 0


# =============================================================================================
# (c) lossless speculative decoding, batched generation, rejection sampling
# =============================================================================================
GEN_PROMPTS = [PROMPT, [3, 1, 4], list(range(20, 33))]


def _naive_greedy(target, prompts, n):
    """Greedy continuations by the uncached forward, all prompts in one reference batch per step."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        logits = _reference(target, seqs).logits
        for r, s in enumerate(seqs):
            s.append(int(np.argmax(logits[r, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def spec_setup(target):
    want = _naive_greedy(target, GEN_PROMPTS, MAX_NEW + 4)  # ref[0] long enough for a K-ahead oracle
    return target, random_draft(target), want


def test_batched_generate_equals_uncached_greedy(spec_setup):
    target, _, want = spec_setup
    got = generate(target, GEN_PROMPTS, max_new_tokens=MAX_NEW, batch_size=3)  # ragged: bucket 16 > WINDOW
    assert got == [w[:MAX_NEW] for w in want]
    # in-device refill: a refilled row takes a fresh SSM / conv state and KV rows
    assert generate(target, GEN_PROMPTS, max_new_tokens=MAX_NEW, batch_size=2, refill=True) == [w[:MAX_NEW] for w in want]
    assert len(set(want[0])) > 1  # not a degenerate constant continuation


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_random_draft(spec_setup, mode):
    target, draft, want = spec_setup
    ref = want[0]
    dec = SpecDecoder(target, draft, num_spec_tokens=3, mode=mode, tree_top_k=2, tree_max_width=8)
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW]
    assert sum(res.accept_lengths) == MAX_NEW - 1


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_device_loop_equals_host_decoder(spec_setup, mode):
    # the whole generation as one device program (specjax.eval.spec_loop), vmapped over ragged rows:
    # each row equals the host-driven decoder (tokens, accept lengths, counts), so the SSM-state window
    # and the tree commit work inside the loop too
    from specjax.eval.spec_loop import SpecLoop

    target, draft, want = spec_setup
    dec = SpecDecoder(target, draft, num_spec_tokens=3, mode=mode, tree_top_k=2, tree_max_width=8)
    got = SpecLoop(dec).generate(GEN_PROMPTS, max_new_tokens=MAX_NEW)
    for row, prompt, w in zip(got, GEN_PROMPTS, want):
        ref = dec.generate(prompt, max_new_tokens=MAX_NEW)
        assert (row.tokens, row.accept_lengths, row.accepted_per_position, row.num_steps) == \
            (ref.tokens, ref.accept_lengths, ref.accepted_per_position, ref.num_steps)
        assert row.tokens == w[:MAX_NEW]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_partial_acceptance_everywhere(spec_setup, mode):
    target, draft, want = spec_setup
    k = 3
    cls = OneWrongChain if mode == "chain" else OneWrongTree
    dec = cls(target, draft, num_spec_tokens=k, mode=mode, tree_top_k=2, tree_max_width=8)  # 15 tree rows
    dec.ref, dec.calls = want[0], 0
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == want[0][:MAX_NEW]
    # every accepted count (every rollback point) was visited
    assert res.accept_lengths == one_wrong_accept_lengths(k, mode, MAX_NEW)


def test_spec_sampling_distribution(target):
    from eval._sampling import assert_second_token_follows_target

    def logits(seqs):  # _reference runs 8 rows at a time
        return np.concatenate([_reference(target, seqs[i: i + 8]).logits[: len(seqs[i: i + 8])]
                               for i in range(0, len(seqs), 8)])

    assert_second_token_follows_target(target, logits)
