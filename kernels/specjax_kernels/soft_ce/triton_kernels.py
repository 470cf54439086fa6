"""Native Triton kernels for the fused linear + soft-target CE (no jax import: runs under TRITON_INTERPRET=1).

stats_kernel: grid (row blocks, vocab splits). Each program computes draft logit tiles
  d = h[rows] @ w[tile].T (f32 accumulation over H in BLOCK_K chunks) and teacher tiles (loaded
  logits, or th[rows] @ tw[tile].T), and keeps per-row online statistics over its vocab split:
  (m_d, l_d) for lse(d), (m_t, l_t, s = sum exp(t - m_t) d) for the teacher, and the running argmax.
  The splits' partials ([NSPLIT, N] each) are combined in JAX (a few O(N) ops). Splitting the vocab
  keeps all SMs busy when N / BLOCK_N alone is small.
dlogits_kernel: grid (row blocks, vocab tiles). Recomputes the two tiles and writes
  dd = g * (exp(d - lse_d) - exp(t - lse_t)) in the input dtype; dh and dW are then two plain
  GEMMs on dd in JAX. Nothing of size [N, Vd] is ever stored in f32.
"""
import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # Triton kernels may only read constexpr globals


@triton.jit
def _mm_tile(a_ptr, b_ptr, offs_n, offs_v, row_ok, col_ok, K: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """a[offs_n, :K] @ b[offs_v, :K].T in f32 (a [*,K], b [*,K] row-major)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_n[:, None] * K + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + offs_v[None, :] * K + offs_k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    return acc


@triton.jit
def _teacher_tile(t_ptr, th_ptr, tw_ptr, offs_n, offs_v, row_ok, col_ok, V: tl.constexpr, HT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, T_LOGITS: tl.constexpr,
                  IEEE: tl.constexpr):
    if T_LOGITS:
        t = tl.load(t_ptr + offs_n[:, None].to(tl.int64) * V + offs_v[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    else:
        t = _mm_tile(th_ptr, tw_ptr, offs_n, offs_v, row_ok, col_ok, HT, BLOCK_N, BLOCK_V, BLOCK_K, IEEE)
    return t


@triton.jit
def stats_kernel(h_ptr, w_ptr, t_ptr, th_ptr, tw_ptr, md_ptr, ld_ptr, mt_ptr, lt_ptr, s_ptr, bval_ptr, bidx_ptr,
                 N: tl.constexpr, V: tl.constexpr, H: tl.constexpr, HT: tl.constexpr, VSPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, T_LOGITS: tl.constexpr,
                 IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    md = tl.zeros([BLOCK_N], tl.float32) + NEG
    ld = tl.zeros([BLOCK_N], tl.float32)
    mt = tl.zeros([BLOCK_N], tl.float32) + NEG
    lt = tl.zeros([BLOCK_N], tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    bval = tl.zeros([BLOCK_N], tl.float32) + NEG
    bidx = tl.zeros([BLOCK_N], tl.int32)
    v_lo = pid_s * VSPLIT
    v_hi = tl.minimum(v_lo + VSPLIT, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        col_ok = offs_v < V
        d = _mm_tile(h_ptr, w_ptr, offs_n, offs_v, row_ok, col_ok, H, BLOCK_N, BLOCK_V, BLOCK_K, IEEE)
        t = _teacher_tile(t_ptr, th_ptr, tw_ptr, offs_n, offs_v, row_ok, col_ok, V, HT, BLOCK_N, BLOCK_V,
                          BLOCK_K, T_LOGITS, IEEE)
        d = tl.where(col_ok[None, :], d, NEG)
        t = tl.where(col_ok[None, :], t, NEG)
        # argmax of this tile (first index on ties), then keep the earlier tile on ties
        tmax = tl.max(d, 1)
        targ = tl.argmax(d, 1)
        better = tmax > bval
        bidx = tl.where(better, v0 + targ, bidx)
        bval = tl.where(better, tmax, bval)
        md_new = tl.maximum(md, tmax)
        ld = ld * tl.exp(md - md_new) + tl.sum(tl.exp(d - md_new[:, None]), 1)
        md = md_new
        mt_new = tl.maximum(mt, tl.max(t, 1))
        a = tl.exp(mt - mt_new)
        pt = tl.exp(t - mt_new[:, None])
        s = s * a + tl.sum(tl.where(col_ok[None, :], pt * d, 0.0), 1)
        lt = lt * a + tl.sum(pt, 1)
        mt = mt_new
    out = pid_s * N + offs_n
    tl.store(md_ptr + out, md, mask=row_ok)
    tl.store(ld_ptr + out, ld, mask=row_ok)
    tl.store(mt_ptr + out, mt, mask=row_ok)
    tl.store(lt_ptr + out, lt, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(bval_ptr + out, bval, mask=row_ok)
    tl.store(bidx_ptr + out, bidx, mask=row_ok)


@triton.jit
def dlogits_kernel(h_ptr, w_ptr, t_ptr, th_ptr, tw_ptr, g_ptr, lsed_ptr, lset_ptr, dd_ptr,
                   N: tl.constexpr, V: tl.constexpr, H: tl.constexpr, HT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, T_LOGITS: tl.constexpr,
                   IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    col_ok = offs_v < V
    d = _mm_tile(h_ptr, w_ptr, offs_n, offs_v, row_ok, col_ok, H, BLOCK_N, BLOCK_V, BLOCK_K, IEEE)
    t = _teacher_tile(t_ptr, th_ptr, tw_ptr, offs_n, offs_v, row_ok, col_ok, V, HT, BLOCK_N, BLOCK_V, BLOCK_K,
                      T_LOGITS, IEEE)
    g = tl.load(g_ptr + offs_n, mask=row_ok, other=0.0)
    lse_d = tl.load(lsed_ptr + offs_n, mask=row_ok, other=0.0)
    lse_t = tl.load(lset_ptr + offs_n, mask=row_ok, other=0.0)
    dd = g[:, None] * (tl.exp(d - lse_d[:, None]) - tl.exp(t - lse_t[:, None]))
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(dd_ptr + offs_n[:, None].to(tl.int64) * V + offs_v[None, :], dd.to(dd_ptr.dtype.element_ty), mask=ok)
