"""Lossless speculative decoding (specjax.eval.spec_decode).

Bars: greedy speculative output == the target's own greedy output token for token (chain and tree,
random and oracle drafts, EOS and max_new_tokens edges, and the real SmolLM2); tau and per-position
acceptance equal hand-computed values where the test controls acceptance; rejection sampling
reproduces the target's distribution (total-variation bounds stated below)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts.eagle3 import (config_from_target, decoder_layer, draft_logits, draft_step, init_draft_params,
                                   next_step_hidden, project_aux)
from specjax.drafts.vocab import DraftVocab
from specjax.drafts import eagle3_decoding as proposers
from specjax.eval import verify
from specjax.eval import spec_decode as sd
from specjax.eval.generate import generate
from specjax.eval.spec_decode import Draft, SpecDecoder
from specjax.targets.loading import load_target

from eval._models import build_target, target_draft_and_reference

PROMPT = [5, 17, 3, 9, 11, 2, 40]
MAX_NEW = 13


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    def make_draft(target, vocab):
        dcfg = config_from_target(target.config, draft_vocab_size=48, aux_layer_ids=target.default_aux_layer_ids())
        return Draft(init_draft_params(dcfg, jax.random.key(0)), dcfg, vocab)

    # the greedy reference, long enough that an oracle can always look K tokens ahead
    return target_draft_and_reference(tmp_path_factory.mktemp("spec"), make_draft, PROMPT, MAX_NEW + 8)


class OracleChain(SpecDecoder):
    """Proposes the target's own greedy continuation (a perfect draft)."""

    ref: list

    def _override_chain(self, drafts, q, tokens, prompt):
        n = len(tokens)
        return jnp.asarray(self.ref[n: n + self.k], jnp.int32), q


class OracleTree(SpecDecoder):
    """Puts the target's greedy continuation on one root-to-leaf path: the LAST node of each level
    whose parent is on the path (so the accepted K/V must be moved), and keeps siblings off it."""

    ref: list

    def _override_tree(self, nodes, parents, tokens, prompt):
        nodes, parents = np.array(nodes), np.asarray(parents)
        truth = self.ref[len(tokens): len(tokens) + self.k]
        offs = np.cumsum((0,) + self.widths)
        chosen = -1
        for d, tok in enumerate(truth):
            level = np.arange(offs[d], offs[d + 1])
            kids = level[parents[level] == chosen]
            if kids.size == 0:
                break
            nodes[kids[nodes[kids] == tok]] = (tok + 1) % 96  # siblings must not match
            chosen = int(kids[-1])
            nodes[chosen] = tok
        return jnp.asarray(nodes), jnp.asarray(parents)


def oracle(cls, target, draft, ref, **kw):
    dec = cls(target, draft, **kw)
    dec.ref = ref
    return dec


def split_lengths(total, per_step):
    """accept_lengths of a perfect draft emitting `total` tokens after the prefill's one."""
    return [per_step] * (total // per_step) + ([total % per_step] if total % per_step else [])


def _two_layer(draft):
    """The setup's draft with a second decoder layer (draft.num_layers = 2), random as the first."""
    import dataclasses

    cfg = dataclasses.replace(draft.config, num_layers=2)
    return Draft(init_draft_params(cfg, jax.random.key(3), std=0.05), cfg, draft.vocab)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_draft_cache_matches_ttt_layer(setup, num_layers):
    # The cached draft layers must be the trained function: rows written from the target aux states
    # equal TTT step 0, and a chained step equals TTT step 1 at the same row (1e-5, fp32); with two
    # layers each keeps its own cache.
    target, draft, _ = setup
    draft = draft if num_layers == 1 else _two_layer(draft)
    cfg = draft.config
    ids = jnp.asarray([[4, 8, 15, 16, 23, 42, 7, 9, 30]], jnp.int32)
    aux = target(ids, aux_layer_ids=cfg.aux_layer_ids).aux_hidden
    embed = target.embed_table(target.params)
    T, t = 7, 6

    @jax.jit
    def both(p, aux):
        pos = jnp.arange(T)[None]
        h0 = project_aux(p, tuple(a[:, :T] for a in aux), cfg)
        emb0, emb1 = embed[ids[:, 1:T + 1]], embed[ids[:, 2:T + 2]]
        ref0, kv0 = draft_step(p, cfg, emb0, h0, pos, None, [[] for _ in range(cfg.num_layers)])
        # TTT step 1 at row t reads token x[t+2] and the step-0 output of row t, at position t+1
        ref1, _ = draft_step(p, cfg, emb1, next_step_hidden(p, cfg, ref0), pos, None, [[kv] for kv in kv0])
        cache = proposers.init_draft_cache(cfg, 16)
        S = cache["k"].shape[2]
        mask = jnp.tril(jnp.ones((T, S), bool))[None]
        got0, cache = proposers.draft_layer_cached(p, cfg, cache, emb0, h0, pos, pos, mask)
        slot = jnp.array([[t + 1]])
        got1, _ = proposers.draft_layer_cached(p, cfg, cache, emb1[:, t:t + 1], next_step_hidden(p, cfg, got0[:, t:t + 1]),
                                        slot, slot, (jnp.arange(S) <= t + 1)[None, None])
        return ref0, got0, ref1[:, t], got1[:, 0]

    ref0, got0, ref1, got1 = both(draft.params, aux)
    np.testing.assert_allclose(got0, ref0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got1, ref1, rtol=1e-5, atol=1e-5)


class Capture(SpecDecoder):
    """Records every chain proposal (target ids) before verification."""

    def _override_chain(self, drafts, q, tokens, prompt):
        self.seen.append((list(tokens), [int(x) for x in np.asarray(drafts)]))
        return drafts, q


def test_chain_drafts_follow_ttt_semantics(setup):
    # Each proposal must be what the trained (TTT) draft predicts: step j at the last accepted row
    # reads token x[t+1+j] and, from step 1 on, its own previous hidden; the rows before it come
    # from the target's aux states of the accepted tokens. Checked for the first two proposals
    # (the second after a verification) against an uncached TTT unroll of the same tokens: the
    # proposed token's draft logit must be the reference maximum (1e-4).
    target, draft, _ = setup
    cfg, p = draft.config, draft.params
    K = 3
    cap = Capture(target, draft, num_spec_tokens=K)
    cap.seen = []
    cap.generate(PROMPT, max_new_tokens=6)
    embed = target.embed_table(target.params)
    d2t = np.asarray(draft.vocab.d2t)

    T = len(PROMPT) + 1  # rows computed (one shape for both proposals: rows past `row` cannot affect it)

    @jax.jit
    def ttt_logits(x, aux, row):
        pos = jnp.arange(T)[None]
        h, kv, out = project_aux(p, tuple(a[:, :T] for a in aux), cfg), [], []
        for j in range(K):
            h, kvj = decoder_layer(p, cfg, embed[x[:, 1 + j: T + 1 + j]], h, pos, None, kv)
            kv.append(kvj)
            out.append(draft_logits(p, cfg, h)[0, row])
            h = next_step_hidden(p, cfg, h)
        return jnp.stack(out)

    for tokens, drafts in cap.seen[:2]:
        seq = PROMPT + tokens + drafts[: K - 1]
        row = len(PROMPT) + len(tokens) - 2  # the last accepted row (its token input is the newest token)
        assert row < T
        x = jnp.asarray([seq + [0] * (T + K - len(seq))], jnp.int32)
        logits = np.asarray(ttt_logits(x, target(x, aux_layer_ids=cfg.aux_layer_ids).aux_hidden, row))
        for j in range(K):
            did = drafts[j] - d2t  # draft row that maps to the proposed target id
            row_d = int(np.flatnonzero(did == np.arange(len(d2t)))[0])
            assert logits[j, row_d] >= logits[j].max() - 1e-4, (tokens, j)


@pytest.mark.parametrize("mode,k", [("chain", 1), ("chain", 3), ("tree", 3)])
def test_lossless_random_draft(setup, mode, k):
    target, draft, ref = setup
    dec = SpecDecoder(target, draft, num_spec_tokens=k, mode=mode, tree_top_k=2)
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW]
    assert sum(res.accept_lengths) == MAX_NEW - 1 and res.num_steps == len(res.accept_lengths)
    assert len(res.accepted_per_position) == k and res.draft_time_s > 0 and res.target_time_s > 0
    assert res.wall_s >= res.draft_time_s + res.target_time_s
    # EOS: stop before it (EOS not kept); max_new_tokens 0/1/2
    eos = ref[7]
    assert dec.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[eos]).tokens == ref[: ref.index(eos)]
    assert dec.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[ref[0]]).tokens == []
    for n in (0, 1, 2):
        assert dec.generate(PROMPT, max_new_tokens=n).tokens == ref[:n]
    assert dec.greedy(PROMPT, max_new_tokens=MAX_NEW).tokens == ref[:MAX_NEW]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_two_layer_draft(setup, mode):
    target, draft, ref = setup
    dec = SpecDecoder(target, _two_layer(draft), num_spec_tokens=3, mode=mode, tree_top_k=2)
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW]
    assert sum(res.accept_lengths) == MAX_NEW - 1


def test_oracle_chain_tau(setup):
    target, draft, ref = setup
    k = 3
    dec = oracle(OracleChain, target, draft, ref, num_spec_tokens=k)
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW]
    # 1 token from the prefill, then 12 = 4 + 4 + 4: every step accepts all K drafts + the bonus
    assert res.accept_lengths == [4, 4, 4] and res.tau == 4.0
    assert res.accepted_per_position == [3, 3, 3]
    # 14 new tokens: 13 after the prefill = 4+4+4+1; the last step keeps only its first token, but
    # the target accepted all 3 drafts there, and vLLM counts them (before its stop check)
    res = dec.generate(PROMPT, max_new_tokens=14)
    assert res.tokens == ref[:14] and res.accept_lengths == [4, 4, 4, 1]
    assert res.accepted_per_position == [4, 4, 4]
    assert res.tau == 1 + 12 / 4 and res.tokens_per_step == 13 / 4
    # EOS inside a step: emitted up to and including the EOS; accepted counts every accepted draft
    i = 6
    eos = ref[i]
    cut = ref.index(eos)
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[eos])
    assert res.tokens == ref[:cut] and res.accept_lengths == split_lengths(cut, k + 1)
    assert res.accepted_per_position == [res.num_steps] * k  # the oracle's drafts are always accepted
    assert res.tau == 1 + k


def test_tau_counts_as_vllm_does():
    """A hand-built case: K=3, three verification steps accepting 3, 1 and 2 drafts, where step 3
    accepts an EOS at draft position 0 (so the output keeps 1 token of it). vLLM's
    `1 + num_accepted_tokens / num_drafts` is 1 + 6/3 = 3.0; tokens emitted per step (4, 2, 1) give
    7/3, the figure specjax printed as tau before. Both, through the CLI's per-dataset summary."""
    from specjax.eval.report import summarize_dataset

    per_pos = [3, 2, 1]  # steps whose draft i was accepted: a = 3, 1, 2
    res = sd.SpecResult(tokens=list(range(8)), accept_lengths=[4, 2, 1], accepted_per_position=per_pos,
                        num_steps=3, draft_time_s=0.0, target_time_s=0.0, wall_s=1.0)
    assert res.tau == 3.0 and res.tokens_per_step == pytest.approx(7 / 3)
    rec = {"totals": {"steps": 3, "emitted": 7, "accepted_per_position": per_pos, "spec_tokens": 8,
                      "spec_wall_s": 1.0, "draft_time_s": 0.0, "target_time_s": 0.0, "mismatched_turns": 0},
           "turns": [{}]}
    s = summarize_dataset([rec, rec], 3)
    assert s["tau"]["value"] == pytest.approx(3.0, rel=1e-12) and s["accepted"] == 12
    assert s["tokens_per_step"]["value"] == pytest.approx(7 / 3, rel=1e-12)
    assert [e["value"] for e in s["acceptance"]["unconditional"]] == pytest.approx([1.0, 2 / 3, 1 / 3])


def test_oracle_tree(setup):
    target, draft, ref = setup
    k = 3
    full = oracle(OracleTree, target, draft, ref, num_spec_tokens=k, mode="tree", tree_top_k=2, tree_max_width=8)
    assert full.widths == (2, 4, 8) and full.verify_len == 15
    res = full.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW] and res.accept_lengths == [4, 4, 4]
    assert res.accepted_per_position == [3, 3, 3]
    # a pruned tree (widths 2, 4, 4: the default cap top_k**2) may lose the path: still lossless
    pruned = oracle(OracleTree, target, draft, ref, num_spec_tokens=k, mode="tree", tree_top_k=2)
    assert pruned.widths == (2, 4, 4)
    res = pruned.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW] and sum(res.accept_lengths) == MAX_NEW - 1


def test_tau_one_when_draft_cannot_match(setup):
    # a draft vocab made only of tokens the target never emits here: every draft token is rejected
    target, draft, ref = setup
    V = target.config.vocab_size
    unused = [i for i in range(V) if i not in set(ref)][:48]
    vocab = DraftVocab.from_ids(unused, V)
    bad = Draft(draft.params, draft.config, vocab)
    for mode in ("chain", "tree"):
        res = SpecDecoder(target, bad, num_spec_tokens=3, mode=mode).generate(PROMPT, max_new_tokens=MAX_NEW)
        assert res.tokens == ref[:MAX_NEW]
        assert res.tau == 1.0 and res.accept_lengths == [1] * (MAX_NEW - 1)
        assert res.accepted_per_position == [0, 0, 0]


def _tv(a, b):
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def test_speculative_sample_distribution():
    # p rows are the target's distributions, q rows the draft's (far from p: TV(p0, q0) > 0.3).
    # With N = 40000 draws over V = 6 the sampling noise of the empirical TV is ~0.006; the bound
    # 0.02 fails for any method that, e.g., keeps every draft (TV >= 0.3) or resamples from p.
    V, N = 6, 40000  # K = 2 draft positions (rows of q)
    p = jnp.asarray([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.1, 0.1, 0.2, 0.5], [1 / 6] * 6])
    q = jnp.asarray([[0.05, 0.05, 0.1, 0.1, 0.2, 0.5], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    assert _tv(p[0], q[0]) > 0.3

    def one(key):
        kd, ks = jax.random.split(key)
        drafts = jax.random.categorical(kd, jnp.log(q), axis=-1).astype(jnp.int32)
        a, tok = verify.speculative_sample(p, q, drafts, ks)
        first = jnp.where(a >= 1, drafts[0], tok)
        second = jnp.where(a >= 2, drafts[1], tok)  # meaningful when a >= 1
        return a, first, second

    a, first, second = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(0), N))
    a, first, second = map(np.asarray, (a, first, second))
    assert _tv(np.bincount(first, minlength=V) / N, p[0]) < 0.02
    sec = second[a >= 1]
    assert sec.size > 5000 and _tv(np.bincount(sec, minlength=V) / sec.size, p[1]) < 0.03
    # acceptance rate of draft 0 is sum_x min(p, q) = 1 - TV(p0, q0)
    assert abs((a >= 1).mean() - (1 - _tv(p[0], q[0]))) < 0.01


def test_spec_sampling_end_to_end(setup):
    from eval._sampling import assert_second_token_follows_target

    target = setup[0]
    assert_second_token_follows_target(target, lambda seqs: target(jnp.asarray(seqs)).logits)


def test_errors(setup):
    target, draft, _ = setup
    with pytest.raises(ValueError, match="tree mode verifies greedily"):
        SpecDecoder(target, draft, mode="tree").generate(PROMPT, max_new_tokens=3, temperature=1.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        SpecDecoder(target, draft, mode="beam")
    other = Draft(draft.params, draft.config, DraftVocab.from_ids(np.arange(48), 200))
    with pytest.raises(ValueError, match="trained for another target"):
        SpecDecoder(target, other)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        SpecDecoder(target, draft).generate([], max_new_tokens=3)


def test_smollm2_lossless(smollm2_dir):
    # the real SmolLM2-135M (fp32) with a random-init draft: 2 prompts x 24 new tokens
    import transformers

    target = load_target(smollm2_dir, dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
               for c in ("What is the capital of France?", "Write a haiku about the sea.")]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    V = target.config.vocab_size
    dcfg = config_from_target(target.config, draft_vocab_size=4096, aux_layer_ids=target.default_aux_layer_ids(),
                              intermediate_size=256)
    draft = Draft(init_draft_params(dcfg, jax.random.key(0)), dcfg, DraftVocab.from_ids(np.arange(4096), V))
    ref = generate(target, prompts, max_new_tokens=24)
    dec = SpecDecoder(target, draft, num_spec_tokens=4)
    for p, r in zip(prompts, ref):
        assert len(r) == 24
        res = dec.generate(p, max_new_tokens=24)
        assert res.tokens == r
        assert 1.0 <= res.tau <= 5.0


def test_load_draft_round_trip(setup, tmp_path):
    # an exported head loads back to the same draft: same params, vocab, and the same decoding
    from specjax_converters.eagle3_export import export_eagle3

    target, draft, ref = setup
    out = export_eagle3(draft.params, draft.config, draft.vocab, target.hf_config, str(tmp_path / "head"),
                        dtype="float32")
    loaded = sd.load_draft(out)
    assert loaded.config == draft.config
    np.testing.assert_array_equal(loaded.vocab.d2t, draft.vocab.d2t)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded.params, draft.params)
    a = SpecDecoder(target, loaded, num_spec_tokens=3).generate(PROMPT, max_new_tokens=MAX_NEW)
    assert a.tokens == ref[:MAX_NEW]


def test_matmul_precision_follows_the_target_dtype(setup, monkeypatch, tmp_path):
    """A float32 target decodes with true fp32 matmuls ("highest"): on GPU the f32 default is TF32,
    and then verification (K+1 tokens) and 1-token greedy steps round near-ties differently (an H200
    run of the SmolLM2 eval diverged in 39 of 324 turns). Every jitted call must run under it."""
    from jax._src import config as jax_config

    from specjax.eval import spec_decode

    target, draft, ref = setup
    assert SpecDecoder(target, draft).matmul_precision == "highest"
    assert SpecDecoder(target, draft, matmul_precision=None).matmul_precision is None
    with pytest.raises(ValueError, match="matmul_precision"):
        SpecDecoder(target, draft, matmul_precision="fast")
    bf16 = load_target(build_target(tmp_path, "LlamaForCausalLM", False, seed=1), dtype="bfloat16")
    assert SpecDecoder(bf16, draft).matmul_precision is None  # bf16 targets keep the fast default

    seen = []
    # the target calls spec_decode makes, and the draft call the EAGLE-3 family makes for it
    for module, name in ((spec_decode, "prefill"), (spec_decode, "greedy_step"), (spec_decode, "verify_chain"),
                         (proposers, "draft_chain")):
        real = getattr(module, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append((_name, jax_config.default_matmul_precision.value))
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, spy)
    dec = SpecDecoder(target, draft, num_spec_tokens=2)
    # an outer setting unlike "highest" (the test suite may set highest globally), so the check can fail
    with jax.default_matmul_precision("bfloat16"):
        dec.generate(PROMPT, max_new_tokens=6)
        dec.greedy(PROMPT, max_new_tokens=6)
        assert jax_config.default_matmul_precision.value == "bfloat16"  # restored after the calls
        assert {n for n, _ in seen} == {"prefill", "greedy_step", "verify_chain", "draft_chain"}
        assert all(p == "highest" for _, p in seen), seen
        seen.clear()
        SpecDecoder(target, draft, num_spec_tokens=2, matmul_precision=None).generate(PROMPT, max_new_tokens=4)
        assert seen and all(p == "bfloat16" for _, p in seen), seen
    assert dec.generate(PROMPT, max_new_tokens=6).tokens == ref[:6]
