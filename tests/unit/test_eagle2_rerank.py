"""EAGLE-2's re-ranking (eagle3_decoding.rerank_tree): of an expanded draft tree keep the `total` nodes of
highest cumulative draft log-prob. Checked against a brute force written from the definition: the kept
set is the top-`total` scores (ties to the earlier node), every kept node's parent is kept, nodes stay in
their order and parent indices point at the same tokens as before."""
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts.eagle3_decoding import rerank_tree


def random_tree(rng, widths, top_k, tie_every=0):
    """Level-by-level nodes as tree_walk builds them: each level's nodes pick parents in the level above
    and add a log-prob <= 0 to the parent's score (some exactly 0 when tie_every: ties with the parent)."""
    toks, parents, scores = [], [], []
    prev = None
    offset = 0
    for d, w in enumerate(widths):
        lp = -rng.exponential(1.0, w)
        if tie_every:
            lp[::tie_every] = 0.0
        if d == 0:
            par = np.full(w, -1)
            sc = lp
        else:
            local = rng.integers(0, widths[d - 1], w)
            par = offset - widths[d - 1] + local
            sc = prev[local] + lp
        toks.append(rng.integers(0, 1000, w))
        parents.append(par)
        scores.append(sc.astype(np.float32))
        prev = scores[-1]
        offset += w
    return np.concatenate(toks), np.concatenate(parents), np.concatenate(scores)


@pytest.mark.parametrize("seed,tie_every", [(0, 0), (1, 0), (2, 3), (3, 2)])
def test_rerank_keeps_the_best_nodes_with_their_ancestors(seed, tie_every):
    rng = np.random.default_rng(seed)
    widths = (4, 8, 8, 8)
    toks, parents, scores = random_tree(rng, widths, 2, tie_every)
    n = len(toks)
    for total in (1, 5, 13, n - 1, n):
        got_t, got_p = map(np.asarray, rerank_tree(jnp.asarray(toks), jnp.asarray(parents, jnp.int32),
                                                   jnp.asarray(scores), total))
        want = sorted(sorted(range(n), key=lambda i: (-scores[i], i))[:total])  # brute force, ties: earlier
        assert got_t.tolist() == toks[want].tolist()
        for j, i in enumerate(want):  # same parent token as before, and the parent is kept, above its child
            if parents[i] < 0:
                assert got_p[j] == -1
            else:
                assert 0 <= got_p[j] < j and want[got_p[j]] == parents[i]
