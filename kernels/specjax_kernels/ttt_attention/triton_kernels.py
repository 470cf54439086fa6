"""Native Triton kernels for TTT block 0 (causal, segment-masked GQA flash attention).

Only triton is imported here (no jax), so the kernels also run under the Triton interpreter
(TRITON_INTERPRET=1) on CPU. Layouts: q/do/o [B,T,Hq,D], k/v [B,T,Hkv,D], seg [B,T] int32,
lse/delta [B,T,Hq] f32 (natural log). T must be a multiple of the blocks (the caller pads).

Scheme (FlashAttention-2, arXiv:2307.08691; causal two-stage loop as in the Triton fused-attention
tutorial): the forward walks key blocks strictly below the diagonal without a causal mask, then the
diagonal blocks with it. Masked scores are a large finite negative (not -inf): a row whose first
key blocks are all masked (another segment) accumulates junk that the first real block wipes out
(its rescale factor exp2(MASK - m) is 0), and every row reaches a real key at its own position.
Scores run in base 2 (exp2 with scale*log2(e) folded in). With segment ids, the forward and dq loops
start at the first key block that shares a segment with the query block (lo_ptr [B, T/BLOCK_M], in key
blocks) and the dk/dv loop stops after the last query block that shares one with the key block
(hi_ptr [B, T/BLOCK_N], in query blocks): `common.segment_block_bounds`. The skipped tiles hold only
masked pairs.
"""
import triton
import triton.language as tl

MASK = tl.constexpr(-1.0e30)  # Triton kernels may only read constexpr globals
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, qseg, k_base, v_base, seg_base, offs_m, lo, hi,
               T: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, IEEE: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[None, :] * (HKV * D) + offs_d[:, None])  # [D, BLOCK_N]
        s = _dot(q, k, IEEE) * QK_SCALE
        if CAUSAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, MASK)
        if HAS_SEG:
            kseg = tl.load(seg_base + offs_n)
            s = tl.where(qseg[:, None] == kseg[None, :], s, MASK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * (HKV * D) + offs_d[None, :])  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def fwd_kernel(q_ptr, k_ptr, v_ptr, seg_ptr, lo_ptr, o_ptr, lse_ptr,
               T: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr,
               HAS_SEG: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // (HQ // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_base = q_ptr + b * T * HQ * D + h * D
    k_base = k_ptr + b * T * HKV * D + hk * D
    v_base = v_ptr + b * T * HKV * D + hk * D
    seg_base = seg_ptr + b * T
    q = tl.load(q_base + offs_m[:, None] * (HQ * D) + offs_d[None, :])
    qseg = offs_m
    if HAS_SEG:
        qseg = tl.load(seg_base + offs_m)
    lo = 0
    if HAS_SEG:  # the first key block that shares a segment with this query block (segment_block_bounds)
        lo = tl.load(lo_ptr + b * (T // BLOCK_M) + pid_m) * BLOCK_N
    m_i = tl.zeros([BLOCK_M], tl.float32) + MASK
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale: tl.constexpr = SCALE * LOG2E
    # keys strictly before this query block: no causal mask needed
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, qseg, k_base, v_base, seg_base, offs_m, lo, pid_m * BLOCK_M,
                               T, HKV, D, BLOCK_N, qk_scale, False, HAS_SEG, IEEE)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, qseg, k_base, v_base, seg_base, offs_m, pid_m * BLOCK_M,
                               (pid_m + 1) * BLOCK_M, T, HKV, D, BLOCK_N, qk_scale, True, HAS_SEG, IEEE)
    o = acc / l_i[:, None]
    tl.store(o_ptr + b * T * HQ * D + h * D + offs_m[:, None] * (HQ * D) + offs_d[None, :], o)
    tl.store(lse_ptr + b * T * HQ + offs_m * HQ + h, (m_i + tl.math.log2(l_i)) / LOG2E)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, qseg, k_base, v_base, seg_base, offs_m, lo, hi,
              HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, QK_SCALE: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, IEEE: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(k_base + offs_n[None, :] * (HKV * D) + offs_d[:, None])  # [D, BLOCK_N]
        vT = tl.load(v_base + offs_n[None, :] * (HKV * D) + offs_d[:, None])
        s = _dot(q, kT, IEEE) * QK_SCALE
        p = tl.math.exp2(s - lse2[:, None])
        if CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if HAS_SEG:
            kseg = tl.load(seg_base + offs_n)
            p = tl.where(qseg[:, None] == kseg[None, :], p, 0.0)
        dp = _dot(do, vT, IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kT.dtype), tl.trans(kT), IEEE)
    return dq


@triton.jit
def dq_kernel(q_ptr, k_ptr, v_ptr, seg_ptr, lo_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
              T: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr,
              HAS_SEG: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // (HQ // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row = b * T * HQ * D + h * D + offs_m[:, None] * (HQ * D) + offs_d[None, :]
    q = tl.load(q_ptr + row)
    do = tl.load(do_ptr + row)
    lse2 = tl.load(lse_ptr + b * T * HQ + offs_m * HQ + h) * LOG2E
    delta = tl.load(delta_ptr + b * T * HQ + offs_m * HQ + h)
    k_base = k_ptr + b * T * HKV * D + hk * D
    v_base = v_ptr + b * T * HKV * D + hk * D
    seg_base = seg_ptr + b * T
    qseg = offs_m
    if HAS_SEG:
        qseg = tl.load(seg_base + offs_m)
    lo = 0
    if HAS_SEG:
        lo = tl.load(lo_ptr + b * (T // BLOCK_M) + pid_m) * BLOCK_N
    qk_scale: tl.constexpr = SCALE * LOG2E
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    dq = _dq_inner(dq, q, do, lse2, delta, qseg, k_base, v_base, seg_base, offs_m, lo, pid_m * BLOCK_M,
                   HKV, D, BLOCK_N, qk_scale, False, HAS_SEG, IEEE)
    dq = _dq_inner(dq, q, do, lse2, delta, qseg, k_base, v_base, seg_base, offs_m, pid_m * BLOCK_M,
                   (pid_m + 1) * BLOCK_M, HKV, D, BLOCK_N, qk_scale, True, HAS_SEG, IEEE)
    tl.store(dq_ptr + row, dq * SCALE)


@triton.jit
def _dkdv_inner(dk, dv, k, v, kseg, q_base, do_base, lse_base, delta_base, seg_base, offs_n, lo, hi,
                HQ: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, QK_SCALE: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, IEEE: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = tl.load(q_base + offs_m[None, :] * (HQ * D) + offs_d[:, None])  # [D, BLOCK_M]
        do = tl.load(do_base + offs_m[:, None] * (HQ * D) + offs_d[None, :])  # [BLOCK_M, D]
        lse2 = tl.load(lse_base + offs_m * HQ) * LOG2E
        delta = tl.load(delta_base + offs_m * HQ)
        sT = _dot(k, qT, IEEE) * QK_SCALE  # [BLOCK_N, BLOCK_M]
        pT = tl.math.exp2(sT - lse2[None, :])
        if CAUSAL:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if HAS_SEG:
            qseg = tl.load(seg_base + offs_m)
            pT = tl.where(kseg[:, None] == qseg[None, :], pT, 0.0)
        dv += _dot(pT.to(do.dtype), do, IEEE)
        dpT = _dot(v, tl.trans(do), IEEE)
        dsT = pT * (dpT - delta[None, :])
        dk += _dot(dsT.to(qT.dtype), tl.trans(qT), IEEE)
    return dk, dv


@triton.jit
def dkdv_kernel(q_ptr, k_ptr, v_ptr, seg_ptr, hi_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                T: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr,
                HAS_SEG: tl.constexpr, IEEE: tl.constexpr):
    """One program = one key block of one kv head; it loops over the G query heads of the group."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = pid_bh % HKV
    G: tl.constexpr = HQ // HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kv_row = b * T * HKV * D + hk * D + offs_n[:, None] * (HKV * D) + offs_d[None, :]
    k = tl.load(k_ptr + kv_row)
    v = tl.load(v_ptr + kv_row)
    seg_base = seg_ptr + b * T
    kseg = offs_n
    if HAS_SEG:
        kseg = tl.load(seg_base + offs_n)
    qk_scale: tl.constexpr = SCALE * LOG2E
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    diag_lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # first query block that reaches this key block
    diag_hi = tl.minimum(((pid_n + 1) * BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, T)
    end = T
    if HAS_SEG:  # one past the last query block that shares a segment with this key block
        end = tl.minimum(tl.maximum(tl.load(hi_ptr + b * (T // BLOCK_N) + pid_n) * BLOCK_M, diag_hi), T)
    for g in range(G):
        h = hk * G + g
        q_base = q_ptr + b * T * HQ * D + h * D
        do_base = do_ptr + b * T * HQ * D + h * D
        lse_base = lse_ptr + b * T * HQ + h
        delta_base = delta_ptr + b * T * HQ + h
        # query blocks that straddle this key block need the causal mask, later ones do not
        dk, dv = _dkdv_inner(dk, dv, k, v, kseg, q_base, do_base, lse_base, delta_base, seg_base, offs_n,
                             diag_lo, diag_hi, HQ, D, BLOCK_M, qk_scale, True, HAS_SEG, IEEE)
        dk, dv = _dkdv_inner(dk, dv, k, v, kseg, q_base, do_base, lse_base, delta_base, seg_base, offs_n,
                             diag_hi, end, HQ, D, BLOCK_M, qk_scale, False, HAS_SEG, IEEE)
    tl.store(dk_ptr + kv_row, dk * SCALE)
    tl.store(dv_ptr + kv_row, dv)
