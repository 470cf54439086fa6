"""Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (``specjax.targets.qwen3_next``) vs transformers (PyTorch, CPU
fallback paths, fp32), and their cached decoding.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state (HF
``hidden_states[-1]``) and three aux states (aux id k = the output of transformers' layer k, read with a
forward hook: the last layer's is before the final norm) on taps in both mixer types (0: Gated
DeltaNet, 1 and 4: gated attention; layers 2-4 then run as one scan holding both mixers, and for
Qwen3-Next both feed-forward kinds). The tiny models have what makes the family
differ from Qwen3-MoE: DeltaNet and gated-attention layers ([linear, full, linear, linear, full]),
twice as many value heads as key heads with a value width unlike the key width, partial RoPE (a
quarter of each head), (1 + w) RMSNorms, and for Qwen3-Next a dense layer (mlp_only_layers) among MoE
layers with a gated shared expert. transformers' weights are redrawn (parity._hf_weights.randomize_,
then the (1 + w) norms' weights 0.2 N(0, 1) so the scale is 1 + 0.2 N rather than about 2, and the
DeltaNet decay rates exp(A_log) spread over 0.05..0.5).
Packed documents restart the DeltaNet state and conv window: each document's rows equal
transformers on that document alone.

Cached decoding (Qwen3-Next, decode_state_window 12 so a 20-token prefill takes the long-chunk path)
equals the uncached forward (rel 1e-5, same metric; the forward runs the chunked rule, decoding the
sequential one: ~5e-6 apart here): a left-padded row, a stale chunk rolled back, single
tokens and chunks; resuming after every accepted position; a prefill longer than the window resuming
after its logits_index rows (an unkept start gives NaN); a tree chunk per root-to-node path, and after
committing any path (commit_path_fn). Configs round-trip through transformers' config classes; the
three published shapes in configs/targets count their published parameters.
"""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.targets import load_target  # noqa: E402
from specjax.targets import qwen3_next as qn  # noqa: E402

from parity._hf_weights import randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
DECODE_TOL = 1e-5
VOCAB = 128
AUX = (0, 1, 4)
TYPES = [qn.LINEAR, qn.FULL, qn.LINEAR, qn.LINEAR, qn.FULL]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_num_key_heads=2, linear_num_value_heads=4, layer_types=TYPES, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
MOE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2)
HF = {  # architecture -> (model class, config class, its own keys)
    qn.QWEN3_NEXT: ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(intermediate_size=96, mlp_only_layers=[3], **MOE)),
    qn.QWEN3_5: ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(intermediate_size=96)),
    qn.QWEN3_5_MOE: ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", MOE),
}


def _hf_config(arch=qn.QWEN3_NEXT, **kw):
    _, config_class, own = HF[arch]
    return getattr(transformers, config_class)(**{**COMMON, **own, **kw})


_CHECKPOINTS: dict = {}


def _checkpoint(arch, tmp_path_factory):
    """(transformers model, saved folder) of the tiny model of ``arch``, built once per session."""
    if arch not in _CHECKPOINTS:
        torch.manual_seed(0)
        model = getattr(transformers, HF[arch][0])(_hf_config(arch)).eval()
        model.config._attn_implementation = "eager"
        randomize_(model, seed=1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and "linear_attn.norm" not in name:
                    p.sub_(1.0)  # the (1 + w) norms: scale 1 + 0.2 N(0, 1); the DeltaNet output norm keeps its w
                elif name.endswith("A_log"):  # decay rates exp(A_log) in 0.05..0.5 (slow to fast memory)
                    p.copy_(torch.linspace(0.05, 0.5, p.numel()).log())
        path = str(tmp_path_factory.mktemp(arch))
        model.save_pretrained(path)
        _CHECKPOINTS[arch] = (model, path)
    return _CHECKPOINTS[arch]


def _hf_outputs(model, ids):
    """transformers' logits, final (post-norm) hidden and every layer's output (forward hooks)."""
    layers = []
    def keep(mod, args, out):
        layers.append(out[0] if isinstance(out, tuple) else out)

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():
            ref = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return ref.logits.numpy(), ref.hidden_states[-1].numpy(), [x.numpy() for x in layers]


def _errs(logits, final, aux, ref):
    """rel errors of (logits, final hidden, aux states at AUX) against _hf_outputs' ``ref``."""
    errs = {"logits": rel_err(logits, ref[0]), "final": rel_err(final, ref[1])}
    errs.update({f"aux{k}": rel_err(a, ref[2][k]) for k, a in zip(AUX, aux)})
    return errs


@pytest.mark.parametrize("arch", sorted(HF))
def test_forward_matches_transformers(arch, tmp_path_factory):
    model, path = _checkpoint(arch, tmp_path_factory)
    target = load_target(path, dtype="float32")
    assert type(target).__name__ == ("Qwen3_5Target" if arch == qn.QWEN3_5 else "Qwen3NextTarget")
    ids = np.random.RandomState(0).randint(0, VOCAB, (2, 19)).astype(np.int32)
    ref = _hf_outputs(model, ids)
    out = target(ids, aux_layer_ids=AUX)
    errs = _errs(out.logits, out.final_hidden, out.aux_hidden, ref)
    print(f"\n{arch}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= REL_TOL, f"{arch} {k}: rel err {v:.3e} > {REL_TOL}"
    assert np.abs(ref[0]).max() > 1.0  # O(1) logits: the tolerance is not vacuous


def test_packed_documents_restart_the_deltanet_state(tmp_path_factory):
    """Two documents and trailing padding in one row (segment ids 1, 2, 0; positions restart): each
    document's rows equal transformers on that document alone."""
    model, path = _checkpoint(qn.QWEN3_NEXT, tmp_path_factory)
    target = load_target(path, dtype="float32")
    rng = np.random.RandomState(1)
    docs = [rng.randint(0, VOCAB, 7), rng.randint(0, VOCAB, 12)]
    ids = np.concatenate(docs + [np.zeros(3, int)])[None].astype(np.int32)
    seg = np.asarray([[1] * 7 + [2] * 12 + [0] * 3], np.int32)
    pos = np.asarray([list(range(7)) + list(range(12)) + [0] * 3], np.int32)
    out = target(jnp.asarray(ids), aux_layer_ids=AUX, positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
    at = 0
    for doc in docs:
        ref = _hf_outputs(model, doc[None])
        rows = slice(at, at + len(doc))
        errs = _errs(out.logits[:, rows], out.final_hidden[:, rows], [a[:, rows] for a in out.aux_hidden], ref)
        for k, v in errs.items():
            assert v <= REL_TOL, f"document at {at}: {k} rel err {v:.3e}"
        at += len(doc)


# =============================================================================================
# Cached decoding
# =============================================================================================
WINDOW = 12  # decode_state_window: a tree of 9 nodes fits, a prefill of 20 takes the long-chunk path
REF_SHAPE = (8, 32)  # every reference forward runs at one padded shape (causal: the pad is unseen)
ZERO2 = jnp.zeros((2,), jnp.int32)
CAUSAL9 = jnp.asarray(np.broadcast_to(np.tril(np.ones((9, 9), bool)), (2, 9, 9)))


_DECODERS: dict = {}


def _dec_target(tmp_path_factory, rule=None):
    """(Qwen3-Next target with decode_state_window WINDOW, its jitted decode_chunk), one per forward rule
    (gated_delta_implementation; None = the default, chunked)."""
    if rule not in _DECODERS:
        target = load_target(_checkpoint(qn.QWEN3_NEXT, tmp_path_factory)[1], dtype="float32",
                             decode_state_window=WINDOW, gated_delta_implementation=rule)
        decode = jax.jit(lambda c, i, p, s, m=None, vf=None, li=None: target.decode_chunk(
            target.params, c, i, p, s, aux_layer_ids=AUX, chunk_mask=m, valid_from=vf, logits_index=li))
        _DECODERS[rule] = (target, decode)
    return _DECODERS[rule]


@pytest.fixture(scope="module")
def dec_target(tmp_path_factory):
    return _dec_target(tmp_path_factory)


def _pos(start, t, pad=(0, 0)):
    """RoPE positions of a chunk of t rows at slots start[b].. of rows left-padded by pad[b]."""
    return jnp.asarray(np.maximum(np.asarray(start)[:, None] + np.arange(t)[None] - np.asarray(pad)[:, None], 0),
                       jnp.int32)


def _reference(target, seqs):
    ids = np.zeros(REF_SHAPE, np.int32)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    return jax.tree.map(np.asarray, target(jnp.asarray(ids), aux_layer_ids=AUX))


def _check(out, r, t, ref, ref_row, ref_t):
    """Decode output rows r, chunk rows t (a slice) vs reference row ref_row at positions ref_t."""
    pairs = [(out[0], ref.logits), (out[2], ref.final_hidden)] + list(zip(out[1], ref.aux_hidden))
    worst = 0.0
    for got, want in pairs:
        err = rel_err(np.asarray(got)[r, t], want[ref_row, ref_t])
        assert err <= DECODE_TOL, f"rel err {err:.2e}"
        worst = max(worst, err)
    return worst


def test_cache_layout(dec_target):
    target, _ = dec_target
    cache = target.init_cache(2, 40)
    cfg = target.config
    assert cache["k"].shape == (2, 2, 256, 2, 16)  # the two attention layers
    assert cache["conv"].shape == (3, 2, WINDOW, 3, cfg.conv_dim)  # three DeltaNet layers: K-1 inputs per entry
    assert cache["delta"].shape == (3, 2, WINDOW, 4, 8, 12) and cache["delta"].dtype == jnp.float32
    assert cache["state_slot"].shape == (2, WINDOW)
    hf = json.load(open(os.path.join(_REPO, "configs", "targets", "qwen3_next_80b_a3b", "config.json")))
    big = qn.Qwen3NextTargetConfig.from_hf(hf)
    shapes = jax.eval_shape(lambda: qn.init_cache(big, 1, 4096, jnp.bfloat16))
    assert shapes["delta"].shape == (36, 1, 24, 32, 128, 128) and shapes["k"].shape[0] == 12


def test_cached_decoding_equals_forward_left_padded(dec_target):
    target, decode = dec_target
    rng = np.random.RandomState(0)
    seq = [rng.randint(0, VOCAB, 18).astype(np.int32), rng.randint(0, VOCAB, 15).astype(np.int32)]
    pad = 3  # row 1: 3 pads at slots 0..2, its tokens at slots 3..; row 0 unpadded
    ref = _reference(target, seq)
    vf = jnp.asarray([0, pad], jnp.int32)
    causal = np.tril(np.ones((9, 9), bool))
    mask = jnp.asarray(np.stack([causal, causal & ((np.arange(9)[None, :] >= pad) | np.eye(9, dtype=bool))]))
    chunk0 = np.stack([seq[0][:9], np.concatenate([[7, 7, 7], seq[1][:6]])]).astype(np.int32)
    cache = target.init_cache(2, 40)
    cache = decode(cache, jnp.asarray(chunk0[:, ::-1].copy()), _pos(ZERO2, 9, (0, pad)), ZERO2, mask, vf)[3]
    out = decode(cache, jnp.asarray(chunk0), _pos(ZERO2, 9, (0, pad)), ZERO2, mask, vf)  # rolled back to 0
    worst = max(_check(out, 0, slice(0, 9), ref, 0, slice(0, 9)), _check(out, 1, slice(pad, 9), ref, 1, slice(0, 6)))
    cache, a = out[3], 9
    for n in (1, 1, 3, 1, 3):  # single tokens and chunks, both rows at slot a (row 1 is `pad` tokens behind)
        chunk = np.stack([seq[0][a: a + n], seq[1][a - pad: a - pad + n]])
        start = jnp.full((2,), a, jnp.int32)
        out = decode(cache, jnp.asarray(chunk), _pos(start, n, (0, pad)), start, None, vf)
        worst = max(worst, _check(out, 0, slice(0, n), ref, 0, slice(a, a + n)),
                    _check(out, 1, slice(0, n), ref, 1, slice(a - pad, a - pad + n)))
        cache, a = out[3], a + n
    assert a == len(seq[0]) and a - pad == len(seq[1])
    print(f"\nQwen3-Next: max rel |cached - uncached| {worst:.1e}")


def test_rollback_every_position(dec_target):
    # prefix of 9, then a chunk [last token, d1, d2] at slot 9; decoding resumes at 9 + kept after
    # keeping 0..3 of its tokens (row 1 at the mirrored point: per-row window lookup), 3 new tokens
    target, decode = dec_target
    rng = np.random.RandomState(4)
    prefix = rng.randint(0, VOCAB, (2, 9)).astype(np.int32)
    chunk = rng.randint(0, VOCAB, (2, 3)).astype(np.int32)
    nxt = rng.randint(0, VOCAB, (2, 3)).astype(np.int32)
    cache = decode(target.init_cache(2, 24), jnp.asarray(prefix), _pos(ZERO2, 9), ZERO2, CAUSAL9, ZERO2)[3]
    at9 = jnp.full((2,), 9, jnp.int32)
    cache = decode(cache, jnp.asarray(chunk), _pos(at9, 3), at9, None, ZERO2)[3]
    keeps = [(j, 3 - j) for j in range(4)]
    ref = _reference(target, [np.concatenate([prefix[r], chunk[r, : kp[r]], nxt[r]]) for kp in keeps for r in (0, 1)])
    for q, kp in enumerate(keeps):
        start = jnp.asarray([9 + kp[0], 9 + kp[1]], jnp.int32)
        out = decode(cache, jnp.asarray(nxt), _pos(start, 3), start, None, ZERO2)
        for r in (0, 1):
            _check(out, r, slice(0, 3), ref, 2 * q + r, slice(9 + kp[r], 12 + kp[r]))


@pytest.mark.parametrize("rule", ["reference", None])
def test_prefill_longer_than_window(rule, tmp_path_factory):
    # A right-padded prefill of 20 > WINDOW rows (as generate / SpecDecoder run it): the states after
    # the logits_index rows are kept, so each row continues after its own prompt; a start whose
    # states were not kept gives NaN, not a silently wrong state. Both rules: the long chunk runs the
    # forward's rule (the default: chunked) for its head and its logits rows' states.
    target, decode = _dec_target(tmp_path_factory, rule)
    rng = np.random.RandomState(3)
    seq = [rng.randint(0, VOCAB, 11).astype(np.int32), rng.randint(0, VOCAB, 16).astype(np.int32)]
    lens = [8, 13]
    ref = _reference(target, seq)
    chunk = np.zeros((2, 20), np.int32)
    for r in (0, 1):
        chunk[r, : lens[r]] = seq[r][: lens[r]]
    li = jnp.asarray([[lens[0] - 1], [lens[1] - 1]], jnp.int32)
    out = decode(target.init_cache(2, 40), jnp.asarray(chunk), _pos(ZERO2, 20), ZERO2, None, None, li)
    for r in (0, 1):
        assert rel_err(out[0][r, 0], ref.logits[r, lens[r] - 1]) <= DECODE_TOL
    cache = out[3]
    nxt = jnp.asarray(np.stack([seq[0][8:11], seq[1][13:16]]))
    start = jnp.asarray(lens, jnp.int32)
    out = decode(cache, nxt, _pos(start, 3), start, None, ZERO2)
    for r in (0, 1):
        _check(out, r, slice(0, 3), ref, r, slice(lens[r], lens[r] + 3))
    start = jnp.asarray([3, lens[1]], jnp.int32)  # slot 3: inside the prefill, neither a logits row nor a last row
    logits = np.asarray(decode(cache, nxt, _pos(start, 3), start, None, ZERO2)[0])
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()


def test_tree_chunk_and_commit(dec_target):
    # prefix x0..x8 cached; a 9-node tree (parents before children, depth 3) at slot 9, node 0 = x9,
    # positions by depth. Each node equals the forward of its root-to-node path; committing the path
    # to any node (as _verify_tree does, commit_path_fn) continues as the forward of that path.
    target, decode = dec_target
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
    depth = np.asarray([len(p) - 1 for p in paths], np.int32)
    cache = decode(target.init_cache(2, 24), jnp.asarray(np.broadcast_to(x[:9], (2, 9))), _pos(ZERO2, 9), ZERO2,
                   CAUSAL9, ZERO2)[3]
    at9 = jnp.full((2,), 9, jnp.int32)
    out = decode(cache, jnp.asarray(np.broadcast_to(nodes, (2, 9))), jnp.asarray(np.broadcast_to(9 + depth, (2, 9))),
                 at9, jnp.asarray(np.broadcast_to(anc, (2, 9, 9))), ZERO2)
    tcache = out[3]
    nxt = rng.randint(0, VOCAB, 3).astype(np.int32)
    seqs = [np.concatenate([x[:9], nodes[path], nxt]) for path in paths]
    refs = [_reference(target, seqs[:8]), _reference(target, seqs[8:])]
    ref_of = lambda i: (refs[i // 8], i % 8)  # noqa: E731
    for i, path in enumerate(paths):
        ref, row = ref_of(i)
        for r in (0, 1):
            _check(out, r, slice(i, i + 1), ref, row, slice(9 + depth[i], 10 + depth[i]))
    commit = jax.jit(type(target).commit_path_fn)
    for i, path in enumerate(paths):
        a = len(path) - 1
        c = commit(tcache, jnp.int32(9), jnp.asarray(path + [0] * (4 - len(path)), jnp.int32), jnp.int32(a))
        start = jnp.full((2,), 10 + a, jnp.int32)
        res = decode(c, jnp.asarray(np.broadcast_to(nxt, (2, 3))), _pos(start, 3), start, None, ZERO2)
        ref, row = ref_of(i)
        _check(res, 0, slice(0, 3), ref, row, slice(10 + a, 13 + a))  # commit moves batch row 0


# =============================================================================================
# Configs
# =============================================================================================
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("arch", sorted(HF))
def test_config_round_trips_through_transformers(arch):
    config_class = getattr(transformers, HF[arch][1])
    cfg = qn.Qwen3NextTargetConfig.from_hf({**_hf_config(arch).to_dict(), "architectures": [arch]})
    assert cfg.layer_types == tuple(TYPES) and cfg.rope.partial_rotary_factor == 0.25
    assert cfg.linear_value_head_dim == 12 and cfg.num_experts == (0 if arch == qn.QWEN3_5 else 6)
    written = cfg.to_hf()
    assert qn.Qwen3NextTargetConfig.from_hf(written) == cfg
    assert not [row.key for row in qn.HF_KEYS[arch] if row.key not in written], "a key of the table is not written"
    through = config_class(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")}).to_dict()
    assert qn.Qwen3NextTargetConfig.from_hf({**through, "architectures": [arch]}) == cfg


def test_config_defaults_and_refusals():
    base = {**_hf_config().to_dict(), "architectures": [qn.QWEN3_NEXT]}
    # transformers' defaults: 0.25 rotary when no factor is named; every 4th layer full attention
    bare = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")}
    cfg = qn.Qwen3NextTargetConfig.from_hf({**bare, "num_hidden_layers": 8})
    assert cfg.rope.partial_rotary_factor == 0.25 and cfg.rope.theta == 10000.0
    assert cfg.layer_types == (qn.LINEAR,) * 3 + (qn.FULL,) + (qn.LINEAR,) * 3 + (qn.FULL,)
    assert qn.Qwen3NextTargetConfig.from_hf({**bare, "partial_rotary_factor": 0.5}).rope.partial_rotary_factor == 0.5
    bad = [({"attention_bias": True}, "attention_bias=true is not supported"),
           ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
           ({"layer_types": TYPES[:4]}, "layer_types must list 5 entries"),
           ({"layer_types": ["sliding_attention"] * 5}, "layer_types must list 5 entries"),
           ({"linear_num_value_heads": 3}, "must be a multiple of linear_num_key_heads"),
           ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in 1..num_experts=6"),
           ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
            "partial_rotary_factor=0.25 with rope type 'yarn' is not supported")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            qn.Qwen3NextTargetConfig.from_hf({**base, **change})
    moe = {**_hf_config(qn.QWEN3_5_MOE).to_dict(), "architectures": [qn.QWEN3_5_MOE]}
    with pytest.raises(ValueError, match="always renormalises"):
        qn.Qwen3NextTargetConfig.from_hf({**moe, "norm_topk_prob": False})
    # Qwen3.5-MoE has no dense width: the draft's default MLP width is the one a token activates
    assert qn.Qwen3NextTargetConfig.from_hf(moe).intermediate_size == 2 * 24 + 40
    with pytest.raises(ValueError, match="handles"):
        qn.Qwen3NextTargetConfig.from_hf({**base, "architectures": ["Qwen3_5ForConditionalGeneration"]})
    cfg = qn.Qwen3NextTargetConfig.from_hf(base)
    assert qn.Qwen3NextTarget.ignored_hf_names(cfg, "mtp.layers.0.mlp.gate.weight")
    assert not qn.Qwen3NextTarget.ignored_hf_names(cfg, "model.layers.0.mlp.gate.weight")
    qn.check_draft_compat(cfg, None)
    qn.check_draft_compat(cfg, 2)
    with pytest.raises(ValueError, match="draft.num_key_value_heads=2"):
        qn.check_draft_compat(cfg, 4)


# published totals (model cards): Qwen3-Next-80B-A3B "80B in total, 79B non-embedding, 3B activated"
# (NVIDIA's NIM card: 3.9B active); Qwen3.5-27B "27B"; Qwen3.5-35B-A3B "35B, 3B activated". These
# text configs leave out the vision encoder and the MTP layer, which the published totals of the
# multimodal Qwen3.5 checkpoints include. Exact values from the weight table, then the published rounding.
PUBLISHED = {  # folder: (exact total, published total (B), exact active incl. embeddings, published active)
    "qwen3_next_80b_a3b": (79_674_391_296, 80, 3_874_929_408, 3.9),
    "qwen3_5_27b": (26_895_998_464, 27, None, None),
    "qwen3_5_35b_a3b": (34_660_610_688, 35, 3_454_988_928, 3.5),
}


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_real_configs_count_the_published_parameters(folder):
    from specjax.targets.loading import read_hf_config
    from specjax.targets.registry import get_target_class

    hf = read_hf_config(os.path.join(_REPO, "configs", "targets", folder))
    cls = get_target_class(hf)
    cfg = cls.config_from_hf(hf)
    total, published, active, published_active = PUBLISHED[folder]
    specs = cls.weight_specs(cfg)
    assert sum(s.num_params for s in specs) == total
    assert round(total / 1e9) == published
    assert cfg.rope.partial_rotary_factor == 0.25 and cfg.rope.theta == 1e7 and cfg.layer_types[3] == qn.FULL
    target = cls(cfg, hf, {})
    assert target.active_params_per_token() == active
    if active is not None:
        assert round(active / 1e8) / 10 == published_active
    if folder == "qwen3_next_80b_a3b":  # "79B non-embedding"
        embed = math.prod(next(s for s in specs if s.path[0] == "embed_tokens").shape)
        assert round((total - 2 * embed) / 1e9) == 79
