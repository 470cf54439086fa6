"""Lossless speculative decoding with an EAGLE-3 (or DFlash) draft and the JAX target (batch size 1).

How one step runs (as vLLM / SGLang run EAGLE-3; docs/eagle3-format.md, "Speculative decoding step and
acceptance length"; drafts/eagle3.py, drafts/ttt.py):
  sequence x_0 .. x_{N-1}; the target cache holds slots 0..N-2, x_{N-1} is the newest token.
  draft row t (slot t, RoPE position t) reads [embed(x_{t+1}), fc(target aux at t)]. The rows the
    last target call produced ("pending": the accepted tokens and the bonus) are written into the
    draft's own KV cache from the TARGET's aux states; the last one predicts d_1.
  chain: draft step j >= 2 reads [embed(d_{j-1}), next_step_hidden(h of step j-1)] at the next slot
    (its own hidden; norm(h) with norm_output), so K tokens take K draft calls inside one jit.
    A P-EAGLE head (parallel drafting) instead reads [embed(mask token), fc(mask_hidden)] at slots
    +1..+K-1 and gives d_2..d_K in one forward after the pending rows (draft_parallel).
  DFlash (a block drafter, drafts/dflash.py; chain only): the pending rows are context rows, the
    target's taps at their positions (no token: the accepted tokens and the aux states of the SAME
    position) appended to the draft's context cache; then one block [x_{N-1}, mask, ..., mask] at
    positions N-1.. attends to the cache and its own slots and slots 1..K give d_1..d_K
    (K <= block_size - 1; draft_block). The newest token x_{N-1} has no target state yet: it is
    the block's slot 0, exactly where training puts the anchor.
  verify: the target runs [x_{N-1}, d_1..d_K] at positions N-1..N-1+K in one call; greedy accepts
    the longest prefix equal to the target's argmax, then the target's token after it (the bonus);
    temperature > 0 uses speculative rejection sampling (accept d_i with prob min(1, p/q), else draw
    from norm(max(p - q, 0))), so outputs are distributed exactly as the target's samples.
  rollback: both caches just treat the slots past the accepted length as stale (masked, then
    overwritten: targets.llama.decode_chunk).
  tree (greedy only): the root's top-k children, then level by level each node's top-k children,
    keeping the `tree_max_width` best by cumulative draft log-probability (depth num_spec_tokens);
    with `tree_total_tokens`, EAGLE-2's re-ranking keeps only that many best nodes of the whole tree.
    Draft tree rows attend to the prefix and their own ancestors; the target verifies all nodes in
    one call with an ancestor mask; the longest path that matches the target's argmax is accepted
    and its KV entries are moved to the slots of a linear sequence.

Draft ids map to target ids with d2t: target id = i + d2t[i]. Draft math runs in fp32.

This module holds the head (`Draft`, `load_draft`, `random_draft`), the result (`SpecResult`) and the
decoder that drives each step from the host (`SpecDecoder`); the drafting is the draft family's
(`propose_chain` / `propose_tree`: drafts.eagle3_decoding, drafts.dflash_decoding), the
target calls and the acceptance rules in `eval.verify`.

"Lossless" is exact in fp32 (tested, CPU and H200). With a bf16 target on a GPU, verifying a chunk of
K+1 tokens and decoding one token at a time round differently, so a near-tie argmax can flip and the
output can leave the one-token greedy output (measured on H200: a random bf16 1.1B-shaped target
diverged at its 4th token); serving engines have the same property.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafts.eagle3 import config_from_target, init_draft_params
from specjax.drafts.families import family_for_folder, family_of
from specjax.drafts.vocab import DraftVocab
from specjax.eval.batching import check_sampling, prompt_bucket
from specjax.eval.verify import greedy_step, prefill, tree_widths, verify_chain, verify_tree
from specjax.targets.base import validate_aux_layer_ids

MODES = ("chain", "tree")


# =============================================================================================
# Public types
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Draft:
    """A draft head: params pytree (docs/INTERFACES.md layout), its config (an Eagle3Config, or a
    DFlashConfig for a DFlash block drafter) and draft vocab."""

    params: Any
    config: Any  # Eagle3Config | dflash.DFlashConfig
    vocab: DraftVocab


def load_draft(draft_dir: str) -> Draft:
    """Read an exported head folder (specjax export, SpecForge or speculators layout; a DFlash
    export: config.json architectures ["DFlashDraftModel"])."""

    head = family_for_folder(draft_dir).load_head(draft_dir)
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float32)), head.params)
    return Draft(params=params, config=head.config, vocab=head.vocab)


def random_draft(target, seed: int = 0) -> Draft:
    """An untrained EAGLE-3 head (random init) drafting over the target's whole vocabulary, at the
    target's default aux taps: what the decoding benchmarks time or check without a trained head."""
    v = int(target.config.vocab_size)
    cfg = config_from_target(target.config, draft_vocab_size=v, aux_layer_ids=target.default_aux_layer_ids())
    return Draft(init_draft_params(cfg, jax.random.key(seed)), cfg, DraftVocab.identity(v))


@dataclasses.dataclass
class SpecResult:
    tokens: list[int]  # new tokens, cut before the first EOS
    accept_lengths: list[int]  # tokens emitted per verification step incl. the bonus, cut at EOS / the length limit
    # [num_spec_tokens]: steps whose draft token i was accepted by the target, counted as vLLM counts
    # them: every accepted draft of the step, also past an EOS or the length limit that ends the output
    accepted_per_position: list[int]
    num_steps: int  # verification steps (target calls after the prefill) = vLLM's "drafts"
    draft_time_s: float
    target_time_s: float
    wall_s: float

    @property
    def tau(self) -> float:
        """Acceptance length as vLLM reports it: 1 + accepted draft tokens / drafts (nan with no step).
        See docs/eagle3-format.md, "Speculative decoding step and acceptance length"."""
        if not self.num_steps:
            return float("nan")
        return 1.0 + sum(self.accepted_per_position) / self.num_steps

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step (the output's own count: an EOS or the length limit
        ends a step early, so this is <= tau)."""
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")


# The dtype an EAGLE-3 draft computes in: float32, or bfloat16 as a serving engine runs a head beside
# a bf16 target (SpecDecoder's draft_dtype). Its logits are accumulated in fp32 either way. "auto" takes
# the target's dtype (bf16 for a bf16 target; float32 otherwise and for a DFlash head): at batch 8 on an
# H100 the bf16 draft made a speculative loop iteration 4% cheaper at the same tau
# (benchmarks/results/decode_speed.md, run 10).
DRAFT_DTYPES = ("auto", "float32", "bfloat16")



# =============================================================================================
# The decoder
# =============================================================================================
class SpecDecoder:
    """Speculative decoding of one prompt at a time with `target` and an EAGLE-3 `draft` (or a DFlash
    block drafter: chain only, num_spec_tokens <= its block's drafted slots).

    mode "chain": K = num_spec_tokens drafted autoregressively, verified in one call of K+1 tokens.
    mode "tree": depth K, tree_top_k children per node, at most tree_max_width nodes per level
    (default tree_top_k**2), then, with tree_total_tokens, the tree_total_tokens nodes of highest
    cumulative draft log-prob (EAGLE-2's re-ranking; the target verifies those); temperature 0 only.
    """

    def __init__(self, target, draft: Draft, *, num_spec_tokens: int = 5, mode: str = "chain",
                 tree_top_k: int = 2, tree_max_width: int | None = None, tree_total_tokens: int | None = None,
                 matmul_precision: str | None = "auto", draft_dtype: str = "auto"):
        target.require_decoding()
        if draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"draft_dtype must be one of {DRAFT_DTYPES}, got {draft_dtype!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if int(num_spec_tokens) < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        cfg, vocab = draft.config, draft.vocab
        tcfg = target.config
        self.family = family_of(cfg)
        self.family.check_decoding(cfg, mode=mode, num_spec_tokens=int(num_spec_tokens))
        target_hidden = self.family.target_hidden_size(cfg)
        if cfg.hidden_size != tcfg.hidden_size or target_hidden != tcfg.hidden_size:
            raise ValueError(
                f"draft hidden_size {cfg.hidden_size} / target_hidden_size {target_hidden} must equal the "
                f"target's hidden_size {tcfg.hidden_size}: this head was trained for another target")
        if vocab.vocab_size != tcfg.vocab_size or cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(
                f"draft vocab maps into {vocab.vocab_size} target ids (config vocab_size {cfg.vocab_size}) but the "
                f"target has {tcfg.vocab_size}: this head was trained for another target")
        if vocab.draft_vocab_size != cfg.draft_vocab_size:
            raise ValueError(f"draft vocab has {vocab.draft_vocab_size} ids but the config says "
                             f"draft_vocab_size={cfg.draft_vocab_size}")
        if int(tree_top_k) < 1 or int(tree_top_k) > cfg.draft_vocab_size:
            raise ValueError(f"tree_top_k must be in [1, {cfg.draft_vocab_size}], got {tree_top_k}")

        self.aux_ids = validate_aux_layer_ids(self.family.decode_taps(cfg), target.num_layers)
        self.with_final = bool(self.family.reads_final_hidden(cfg))  # the final hidden after the taps
        self.target, self.draft = target, draft
        self.k = int(num_spec_tokens)
        self.mode = mode
        self.top_k = int(tree_top_k)
        self.widths = tree_widths(self.k, self.top_k, int(tree_max_width or self.top_k**2))
        self.tree_total = None
        if tree_total_tokens is not None:
            if mode != "tree":
                raise ValueError("tree_total_tokens re-ranks a draft tree: use it with mode='tree'")
            if not 1 <= int(tree_total_tokens) <= sum(self.widths):
                raise ValueError(f"tree_total_tokens must be in [1, {sum(self.widths)}] (the expanded tree's nodes "
                                 f"for depth {self.k}, top-k {self.top_k}: {self.widths}), got {tree_total_tokens}")
            self.tree_total = int(tree_total_tokens)
        self.embed = target.embed_table(target.params)
        # "auto": a float32 target gets true fp32 matmuls. On GPU the default for f32 dots is TF32
        # (10-bit mantissa); then the K+1-token verification call and a 1-token greedy step round
        # differently and break near-ties the other way, so speculative output stops being equal to
        # greedy output (measured on an H200: 39 of 324 SmolLM2 turns). It is not free: on the H200
        # a `highest` eval looked ~4-5x slower than a TF32 one beside it (not measured cleanly).
        if matmul_precision == "auto":
            matmul_precision = "highest" if self.embed.dtype == jnp.float32 else None
        if matmul_precision not in (None, "default", "high", "highest", "bfloat16", "tensorfloat32", "float32"):
            raise ValueError(f"matmul_precision must be 'auto', None or a jax precision name, got {matmul_precision!r}")
        self.matmul_precision = matmul_precision
        draft_dtype = self.family.resolve_draft_dtype(draft_dtype, self.embed.dtype)
        # on the device once, in the draft's compute dtype (a trainer may hand host numpy arrays; re-sent
        # every call otherwise)
        self.draft_dtype = draft_dtype
        self.draft_params = jax.tree.map(lambda a: jnp.asarray(a, jnp.dtype(draft_dtype)),
                                         self.family.decoding_params(cfg, draft.params, target))
        self.d2t = jnp.asarray(vocab.d2t, jnp.int32)
        self.draft_ids = jnp.asarray(vocab.draft_ids, jnp.int32)

    @property
    def verify_len(self) -> int:
        """Tokens per target verification call."""
        return 1 + (self.k if self.mode == "chain" else self.tree_total or sum(self.widths))

    def _tkw(self):
        return dict(target_cls=type(self.target), config=self.target.config)

    def _setup(self, prompt_ids, max_new_tokens, temperature):
        check_sampling(max_new_tokens, temperature, 1.0)
        prompt = [int(x) for x in prompt_ids]
        vsize = int(self.target.config.vocab_size)
        if not prompt:
            raise ValueError("prompt_ids is empty; the prompt needs at least one token (e.g. BOS)")
        if any(not 0 <= x < vsize for x in prompt):
            raise ValueError(f"prompt_ids has token ids outside the target vocab [0, {vsize})")
        bucket = prompt_bucket(len(prompt))
        ids = np.zeros((1, bucket), np.int32)
        ids[0, : len(prompt)] = prompt
        # > bucket: a cache never has the prefill chunk's length (attention.py treats S == T as self-attention)
        max_len = max(bucket + 1, len(prompt) + int(max_new_tokens) + self.verify_len + 2)
        return prompt, jnp.asarray(ids), max_len

    def matmul_precision_context(self):
        """A context in which jax matmuls run at this decoder's `matmul_precision` (none set: jax's default)."""
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    def greedy(self, prompt_ids: Sequence[int], *, max_new_tokens: int, eos_token_ids=()) -> SpecResult:
        """Plain greedy decoding through the same cache code: the speedup baseline."""
        with self.matmul_precision_context():
            return self._greedy(prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)

    def _greedy(self, prompt_ids: Sequence[int], *, max_new_tokens: int, eos_token_ids=()) -> SpecResult:
        t0 = time.perf_counter()
        prompt, ids, max_len = self._setup(prompt_ids, max_new_tokens, 0.0)
        eos = set(int(e) for e in eos_token_ids)
        out: list[int] = []
        steps = 0
        if max_new_tokens > 0:
            cache = self.target.init_cache(1, max_len)
            tok, _, cache = prefill(self.target.params, cache, ids, jnp.asarray([len(prompt)], jnp.int32),
                                     jax.random.PRNGKey(0)[None], jnp.float32(1.0), aux_ids=(), sample=False,
                                     **self._tkw())
            tok = int(tok[0])
            while True:
                if tok in eos:
                    break
                out.append(tok)
                if len(out) >= max_new_tokens:
                    break
                tok, cache = greedy_step(self.target.params, cache, jnp.int32(tok),
                                          jnp.int32(len(prompt) + len(out) - 1), **self._tkw())
                tok = int(tok)
                steps += 1
        wall = time.perf_counter() - t0
        return SpecResult(out, [1] * steps, [0] * self.k, steps, 0.0, wall, wall)

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids=(), seed: int = 0) -> SpecResult:
        with self.matmul_precision_context():
            return self._generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                  eos_token_ids=eos_token_ids, seed=seed)

    def _generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                  eos_token_ids=(), seed: int = 0) -> SpecResult:
        t0 = time.perf_counter()
        prompt, ids, max_len = self._setup(prompt_ids, max_new_tokens, temperature)
        sample = float(temperature) > 0.0
        if sample and self.mode == "tree":
            raise ValueError("tree mode verifies greedily; use mode='chain' for temperature > 0")
        eos = set(int(e) for e in eos_token_ids)
        k, dcfg = self.k, self.draft.config
        temp = jnp.float32(max(float(temperature), 1e-6))
        root = jax.random.PRNGKey(int(seed))
        res = SpecResult([], [], [0] * k, 0, 0.0, 0.0, 0.0)
        if max_new_tokens == 0:
            res.wall_s = time.perf_counter() - t0
            return res
        params = self.target.params

        tt = time.perf_counter()
        tcache = self.target.init_cache(1, max_len)
        first, aux, tcache = prefill(params, tcache, ids, jnp.asarray([len(prompt)], jnp.int32),
                                      jax.random.fold_in(root, 0)[None], temp, aux_ids=self.aux_ids, sample=sample,
                                      with_final=self.with_final, **self._tkw())
        first = int(first[0])
        res.target_time_s += time.perf_counter() - tt
        if first in eos:
            res.wall_s = time.perf_counter() - t0
            return res
        res.tokens.append(first)
        # pending draft rows 0..P-1 read tokens x_1..x_P (x_P = first) and the prefill's aux states
        pend = np.zeros((1, ids.shape[1]), np.int32)
        pend[0, : len(prompt)] = prompt[1:] + [first]
        pend_tok, pend_aux, pend_count, dstart = jnp.asarray(pend), aux, len(prompt), 0
        n = len(prompt) + 1  # sequence length; target cache valid for slots 0..n-2
        # max_len covers every write: the prefill's bucket, then K+1 rows after at most
        # prompt + max_new_tokens - 1 valid ones
        dcache = self.family.init_decode_cache(dcfg, max_len, jnp.dtype(self.draft_dtype))
        step = 0
        while len(res.tokens) < max_new_tokens:
            step += 1
            last = jnp.int32(res.tokens[-1])
            td = time.perf_counter()
            if self.mode == "chain":
                drafts, q, dcache = self.family.propose_chain(
                    self.draft_params, self.embed, self.d2t, dcache, pend_tok, pend_aux, jnp.int32(pend_count),
                    jnp.int32(dstart), last, jax.random.fold_in(root, 2 * step), temp, dcfg=dcfg, k=k, sample=sample)
            else:
                nodes, parents, dcache = self.family.propose_tree(
                    self.draft_params, self.embed, self.d2t, dcache, pend_tok, pend_aux, jnp.int32(pend_count),
                    jnp.int32(dstart), dcfg=dcfg, widths=self.widths, top_k=self.top_k, total=self.tree_total)
                drafts = nodes
            jax.block_until_ready(drafts)
            res.draft_time_s += time.perf_counter() - td
            tt = time.perf_counter()
            if self.mode == "chain":
                drafts, q = self._override_chain(drafts, q, res.tokens, prompt)
                a, bonus, pend_dev, aux, tcache = verify_chain(
                    params, tcache, last, drafts, jnp.int32(n - 1), q, self.draft_ids,
                    jax.random.fold_in(root, 2 * step + 1), temp, aux_ids=self.aux_ids, sample=sample,
                    with_final=self.with_final, **self._tkw())
            else:
                nodes, parents = self._override_tree(nodes, parents, res.tokens, prompt)
                a, bonus, pend_dev, aux, tcache = verify_tree(
                    params, tcache, last, nodes, parents, jnp.int32(n - 1), aux_ids=self.aux_ids, depth=k, with_final=self.with_final,
                    **self._tkw())
            a, pend_host = jax.device_get((a, pend_dev))  # the step's one device -> host read
            a = int(a)
            res.target_time_s += time.perf_counter() - tt
            new = [int(x) for x in pend_host[0, : a + 1]]
            # emit, stopping at EOS (counted, not kept) and at max_new_tokens
            emitted, stop = 0, False
            for tok in new:
                emitted += 1
                if tok in eos:
                    stop = True
                    break
                res.tokens.append(tok)
                if len(res.tokens) >= max_new_tokens:
                    stop = True
                    break
            res.accept_lengths.append(emitted)
            for i in range(a):  # vLLM counts the step's accepted drafts before its stop check
                res.accepted_per_position[i] += 1
            res.num_steps = step
            if stop:
                break
            pend_tok, pend_aux, pend_count, dstart = pend_dev, aux, a + 1, n - 1
            n += a + 1
        res.wall_s = time.perf_counter() - t0
        return res

    # Test seams: a subclass may replace the proposals before verification (e.g. an oracle draft).
    def _override_chain(self, drafts, q, tokens, prompt):
        return drafts, q

    def _override_tree(self, nodes, parents, tokens, prompt):
        return nodes, parents
