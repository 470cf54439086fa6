"""Block skipping by segment in the `pallas_gpu` TTT attention (block 0 of the target's and the draft's
attention over packed rows): `common.segment_block_bounds` against a brute-force search, and proof that
the kernels never read the tiles it rules out. CPU, Pallas interpret mode, fp32.

The proof: NaN in the keys/values of a tile that only another segment's queries could skip (and NaN in
the queries/output gradients of a tile that a key tile can skip). A tile the kernel reads contributes
0 * NaN = NaN, even though its probabilities are masked to 0; a skipped tile contributes nothing. So
the rows that must not depend on the poisoned tile are finite and equal the reference run on zeros in
its place (tolerance 2e-5, as the other interpret-mode tests)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels.ttt_attention import pallas_gpu, ttt_attention
from specjax_kernels.ttt_attention.common import segment_block_bounds

BLOCK = 16


@pytest.mark.parametrize("seed", range(4))
def test_segment_block_bounds_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        bm, bn = (int(x) for x in rng.choice([4, 8, 16], 2))
        T = int(np.lcm(bm, bn)) * int(rng.integers(1, 6))
        # packed rows (ids 1..n in order, then padding 0) and scattered ids (equal ids far apart): the
        # bounds must be exact for any layout
        if rng.random() < 0.5:
            seg = np.sort(rng.integers(1, 5, (3, T)), 1)
            seg[:, T - int(rng.integers(0, T // 2 + 1)):] = 0
        else:
            seg = rng.integers(-1, 4, (3, T))
        lo, hi = (np.asarray(x) for x in segment_block_bounds(jnp.asarray(seg, jnp.int32), bm, bn))
        for b in range(3):
            qb = [seg[b, i * bm:(i + 1) * bm] for i in range(T // bm)]
            kb = [seg[b, j * bn:(j + 1) * bn] for j in range(T // bn)]
            for i, q in enumerate(qb):
                assert lo[b, i] == min(j for j, k in enumerate(kb) if np.isin(k, q).any())
            for j, k in enumerate(kb):
                assert hi[b, j] == 1 + max(i for i, q in enumerate(qb) if np.isin(q, k).any())


def test_packed_row_with_padding_skips_most_tiles():
    """A 4,096-token row as the packer lays it out: four documents of 960 tokens (ids 1..4), then 256
    padding tokens (id 0); 64-wide tiles. Each query tile starts at its first row's document, each key
    tile stops at its last row's document end: 490 of the triangle's 2,080 tiles, forward and dk/dv."""
    seg = np.zeros(4096, np.int32)
    seg[:3840] = np.repeat(np.arange(1, 5), 960)
    lo, hi = (np.asarray(x)[0] for x in segment_block_bounds(jnp.asarray(seg[None]), 64, 64))
    first = np.flatnonzero(np.diff(seg, prepend=-1))  # where each run of equal ids starts
    run_of = np.searchsorted(first, np.arange(4096), side="right") - 1
    np.testing.assert_array_equal(lo, [first[run_of[i * 64]] // 64 for i in range(64)])
    last = np.append(first[1:], 4096) - 1
    np.testing.assert_array_equal(hi, [last[run_of[j * 64 + 63]] // 64 + 1 for j in range(64)])
    assert sum(i - lo[i] + 1 for i in range(64)) == sum(hi[j] - j for j in range(64)) == 490


def _inputs(T, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    B, Hq, Hkv, D = 1, 4, 2, 16
    return (jax.random.normal(ks[0], (B, T, Hq, D)), jax.random.normal(ks[1], (B, T, Hkv, D)),
            jax.random.normal(ks[2], (B, T, Hkv, D)), jax.random.normal(ks[3], (B, T, Hq, D)))


# four 16-row tiles: segment 1 fills tile 0, segment 2 tile 1, segment 3 tiles 2-3
SEG = jnp.asarray([[1] * 16 + [2] * 16 + [3] * 32], jnp.int32)


def _run(impl, q, k, v, cot):
    f = lambda q, k, v: ttt_attention(q, k, v, None, None, SEG, implementation=impl, block_size=BLOCK)  # noqa: E731
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(cot))


def test_forward_and_dq_never_read_key_tiles_of_other_segments():
    q, k, v, cot = _inputs(64)
    poison = jnp.zeros(64, bool).at[:16].set(True)[None, :, None, None]  # tile 0: segment 1 alone
    out, dq, _, _ = jax.jit(lambda: _run("pallas_gpu", q, jnp.where(poison, jnp.nan, k),
                                         jnp.where(poison, jnp.nan, v), cot))()
    ref, rdq, _, _ = jax.jit(lambda: _run("reference", q, jnp.where(poison, 0.0, k),
                                          jnp.where(poison, 0.0, v), cot))()
    # rows 16.. (segments 2 and 3) must not have touched tile 0
    assert np.isfinite(np.asarray(out[:, 16:])).all() and np.isfinite(np.asarray(dq[:, 16:])).all()
    np.testing.assert_allclose(out[:, 16:], ref[:, 16:], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dq[:, 16:], rdq[:, 16:], rtol=2e-5, atol=2e-5)


def test_dkdv_never_reads_query_tiles_of_other_segments():
    q, k, v, cot = _inputs(64, seed=1)
    poison = jnp.zeros(64, bool).at[48:].set(True)[None, :, None, None]  # tile 3: segment 3 alone
    _, _, dk, dv = jax.jit(lambda: _run("pallas_gpu", jnp.where(poison, jnp.nan, q), k, v,
                                        jnp.where(poison, jnp.nan, cot)))()
    _, _, rdk, rdv = jax.jit(lambda: _run("reference", jnp.where(poison, 0.0, q), k, v,
                                          jnp.where(poison, 0.0, cot)))()
    # keys of segments 1 and 2 (rows :32) are attended by no row of tile 3
    assert np.isfinite(np.asarray(dk[:, :32])).all() and np.isfinite(np.asarray(dv[:, :32])).all()
    np.testing.assert_allclose(dk[:, :32], rdk[:, :32], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dv[:, :32], rdv[:, :32], rtol=2e-5, atol=2e-5)


def test_scattered_ids_stay_exact():
    """An id that comes back after another (not how packing lays rows out, but allowed): nothing may
    be skipped that the reference attends to."""
    q, k, v, cot = _inputs(64, seed=2)
    seg = jnp.asarray([[1] * 16 + [2] * 16 + [1] * 16 + [2] * 16], jnp.int32)
    f = lambda impl: jax.vjp(lambda q, k, v: ttt_attention(  # noqa: E731
        q, k, v, None, None, seg, implementation=impl, block_size=BLOCK), q, k, v)
    (out, vjp), (ref, rvjp) = f("pallas_gpu"), f("reference")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    for g, r in zip(vjp(cot), rvjp(cot)):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)


def test_lowers_for_cuda_on_cpu():
    """The kernels with their bounds inputs go through Pallas' Triton lowering without a GPU: forward,
    dq and dk/dv = 3 Triton calls (compiling the Triton IR needs the GPU: the `gpu` tests)."""
    sds = jax.ShapeDtypeStruct
    T, Hq, Hkv, D = 256, 4, 2, 64

    def loss(q, k, v, seg):
        return jnp.sum(pallas_gpu.ttt_attention(q, k, v, None, None, seg, block_size=64).astype(jnp.float32))
    for dt in (jnp.bfloat16, jnp.float32):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
            sds((2, T, Hq, D), dt), sds((2, T, Hkv, D), dt), sds((2, T, Hkv, D), dt), sds((2, T), jnp.int32)
        ).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("xla.gpu.triton") == 3
