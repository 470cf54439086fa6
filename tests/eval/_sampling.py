"""The rejection-sampling check shared by the decoding tests: at temperature 2 the 2nd new token
(the first one a verification step emits, after a rollback whenever the draft is rejected) must
follow the target's marginal sum_t1 p(t1) p(t2 | t1).

N independent draws come from one batched device-loop call (specjax.eval.spec_loop; row r uses
seed r) with a peaked random draft over the full vocab that disagrees with p. Tolerance: the 99th
percentile of the total-variation distance between the exact marginal and N samples drawn from it
(simulated), plus 0.005. With the rejection residual max(p - q, 0) replaced by p itself, the Llama
target and 3 of the 4 families in test_decoding_families.py fail at N = 2000."""
import jax
import numpy as np

from specjax.eval.spec_decode import SpecDecoder, random_draft
from specjax.eval.spec_loop import SpecLoop


def _tv(a, b):
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def assert_second_token_follows_target(target, logits_fn, *, n=2000, temp=2.0, prompt=(3, 1, 4), draft=None):
    """`logits_fn(seqs)`: uncached fp32 logits [len(seqs), T, V] of equal-length token lists. `draft`:
    the drafter (default: a random EAGLE-3 head); its lm_head kernel is scaled by 10 (peaked, so that it
    disagrees with p)."""
    prompt = list(prompt)
    V = target.config.vocab_size
    draft = random_draft(target, seed=1) if draft is None else draft
    draft.params["lm_head"]["kernel"] = draft.params["lm_head"]["kernel"] * 10.0
    dec = SpecDecoder(target, draft, num_spec_tokens=2)
    p1 = np.asarray(jax.nn.softmax(np.asarray(logits_fn([prompt + [0]]))[0, len(prompt) - 1] / temp))
    nxt = np.asarray(logits_fn([prompt + [t] for t in range(V)]))[:, len(prompt)]
    marginal = p1 @ np.asarray(jax.nn.softmax(nxt / temp, axis=-1))
    rows = SpecLoop(dec).generate([prompt] * n, max_new_tokens=2, temperature=temp, seed=0)
    emp = np.bincount([r.tokens[1] for r in rows], minlength=V) / n
    rng = np.random.RandomState(0)
    null = [_tv(np.bincount(rng.choice(V, n, p=marginal / marginal.sum()), minlength=V) / n, marginal)
            for _ in range(300)]
    tv = _tv(emp, marginal)
    assert tv < np.percentile(null, 99) + 0.005, (tv, np.percentile(null, 99))
    accepted = sum(r.accepted_per_position[0] for r in rows)
    assert 0 < accepted < n  # both paths: accepted drafts and rejections (a rollback) were exercised
