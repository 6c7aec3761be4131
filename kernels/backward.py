"""FlashAttention-2 backward, in three kernels and without atomics.

With P = exp(z - LSE) recomputed from the saved LSE (z the natural-log scores),
dP = dO V^T and D = rowsum(dO * O) (minus dLSE when the LSE itself has a gradient):

    dS = P * (dP - D)      dV = P^T dO      dK = scale * dS^T Q      dQ = scale * dS K

* ``attention_backward_preprocess``: D, one program per (query block, head, batch).
* ``attention_backward_dkdv``: one program per (key block, K/V head, batch) loops over
  the query blocks that see it, for every query head of its GQA group, summing in
  fp32 registers: dK and dV are written once, so the result is deterministic.
* ``attention_backward_dq``: one program per (query block, query head, batch) loops
  over the key blocks it sees, like the forward.

The outflow rule: the scores are scaled once in fp32 (``qk_scale`` = scale * log2 e),
and the one remaining factor, ``softmax_scale``, is applied to dK and dQ on the way out.
"""
import triton
import triton.language as tl

from .helpers import aligned, key_range, load_row_stats, load_tile, query_range, store_tile, visible


@triton.jit
def attention_backward_preprocess(
    Out, dOut, dLSE,
    seqlen_q,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh,
    Delta,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    stride_ob = aligned(stride_ob, STRIDES_ALIGNED)
    stride_om = aligned(stride_om, STRIDES_ALIGNED)
    stride_oh = aligned(stride_oh, STRIDES_ALIGNED)
    stride_dob = aligned(stride_dob, STRIDES_ALIGNED)
    stride_dom = aligned(stride_dom, STRIDES_ALIGNED)
    stride_doh = aligned(stride_doh, STRIDES_ALIGNED)
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m
    o = load_tile(Out + batch * stride_ob + head * stride_oh + tl.cast(start_m, tl.int64) * stride_om,
                  offs_m, offs_d, stride_om, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    do = load_tile(dOut + batch * stride_dob + head * stride_doh + tl.cast(start_m, tl.int64) * stride_dom,
                   offs_m, offs_d, stride_dom, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    row_base = batch * stride_lb + head * stride_lh
    dlse = tl.load(dLSE + row_base + rows, mask=rows < seqlen_q, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) - dlse
    tl.store(Delta + row_base + rows, delta, mask=rows < seqlen_q)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, cols,
               offs_m, offs_d, stride_qm, stride_dom, qk_scale, seqlen_q, seqlen_k,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one query block's share to dK and dV (tiles kept transposed: keys x queries)."""
    rows = start_m + offs_m
    q = load_tile(q_base + tl.cast(start_m, tl.int64) * stride_qm, offs_m, offs_d, stride_qm,
                  seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    do = load_tile(do_base + tl.cast(start_m, tl.int64) * stride_dom, offs_m, offs_d, stride_dom,
                   seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    lse2, delta = load_row_stats(lse_base, delta_base, rows, seqlen_q)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    p_t = tl.exp2(s_t - lse2[None, :])
    if MASKED:
        p_t = tl.where(visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, IS_CAUSAL), p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attention_backward_dkdv(
    Q, K, V, dOut, LSE, Delta,
    softmax_scale, qk_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    dK, dV,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    stride_qb = aligned(stride_qb, STRIDES_ALIGNED)
    stride_qm = aligned(stride_qm, STRIDES_ALIGNED)
    stride_qh = aligned(stride_qh, STRIDES_ALIGNED)
    stride_kb = aligned(stride_kb, STRIDES_ALIGNED)
    stride_kn = aligned(stride_kn, STRIDES_ALIGNED)
    stride_kh = aligned(stride_kh, STRIDES_ALIGNED)
    stride_vb = aligned(stride_vb, STRIDES_ALIGNED)
    stride_vn = aligned(stride_vn, STRIDES_ALIGNED)
    stride_vh = aligned(stride_vh, STRIDES_ALIGNED)
    stride_dob = aligned(stride_dob, STRIDES_ALIGNED)
    stride_dom = aligned(stride_dom, STRIDES_ALIGNED)
    stride_doh = aligned(stride_doh, STRIDES_ALIGNED)
    stride_dkb = aligned(stride_dkb, STRIDES_ALIGNED)
    stride_dkn = aligned(stride_dkn, STRIDES_ALIGNED)
    stride_dkh = aligned(stride_dkh, STRIDES_ALIGNED)
    stride_dvb = aligned(stride_dvb, STRIDES_ALIGNED)
    stride_dvn = aligned(stride_dvn, STRIDES_ALIGNED)
    stride_dvh = aligned(stride_dvh, STRIDES_ALIGNED)
    start_n = tl.program_id(0) * BLOCK_N
    head_k = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    cols = start_n + offs_n

    # Key rows past seqlen_k read as 0. They are never masked here: a key column of
    # dS only reaches its own rows of dK and dV, and those rows are not stored.
    kv_offset = tl.cast(start_n, tl.int64)
    k = load_tile(K + batch * stride_kb + tl.cast(head_k, tl.int64) * stride_kh + kv_offset * stride_kn,
                  offs_n, offs_d, stride_kn, seqlen_k - start_n, HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + batch * stride_vb + tl.cast(head_k, tl.int64) * stride_vh + kv_offset * stride_vn,
                  offs_n, offs_d, stride_vn, seqlen_k - start_n, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    begin, full_begin = query_range(start_n, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for g in range(GROUP_SIZE):
        head = (head_k * GROUP_SIZE + g).to(tl.int64)
        q_base = Q + batch * stride_qb + head * stride_qh
        do_base = dOut + batch * stride_dob + head * stride_doh
        lse_base = LSE + batch * stride_lb + head * stride_lh
        delta_base = Delta + batch * stride_lb + head * stride_lh
        for start_m in range(begin, full_begin, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, cols,
                                offs_m, offs_d, stride_qm, stride_dom, qk_scale, seqlen_q, seqlen_k,
                                HEAD_DIM, BLOCK_D, True, IS_CAUSAL, DOT_PRECISION)
        for start_m in range(full_begin, seqlen_q, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, cols,
                                offs_m, offs_d, stride_qm, stride_dom, qk_scale, seqlen_q, seqlen_k,
                                HEAD_DIM, BLOCK_D, False, IS_CAUSAL, DOT_PRECISION)

    dk = dk * softmax_scale
    store_tile(dK + batch * stride_dkb + tl.cast(head_k, tl.int64) * stride_dkh + kv_offset * stride_dkn,
               dk, offs_n, offs_d, stride_dkn, seqlen_k - start_n, HEAD_DIM, BLOCK_D)
    store_tile(dV + batch * stride_dvb + tl.cast(head_k, tl.int64) * stride_dvh + kv_offset * stride_dvn,
               dv, offs_n, offs_d, stride_dvn, seqlen_k - start_n, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_base, v_base, start_n, rows, offs_n, offs_d,
             stride_kn, stride_vn, qk_scale, seqlen_q, seqlen_k,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
             IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one key block's share to dQ."""
    cols = start_n + offs_n
    k = load_tile(k_base + tl.cast(start_n, tl.int64) * stride_kn, offs_n, offs_d, stride_kn,
                  seqlen_k - start_n, HEAD_DIM, BLOCK_D, MASKED)
    v = load_tile(v_base + tl.cast(start_n, tl.int64) * stride_vn, offs_n, offs_d, stride_vn,
                  seqlen_k - start_n, HEAD_DIM, BLOCK_D, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, IS_CAUSAL), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def attention_backward_dq(
    Q, K, V, dOut, LSE, Delta,
    softmax_scale, qk_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh,
    stride_dqb, stride_dqm, stride_dqh,
    dQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    stride_qb = aligned(stride_qb, STRIDES_ALIGNED)
    stride_qm = aligned(stride_qm, STRIDES_ALIGNED)
    stride_qh = aligned(stride_qh, STRIDES_ALIGNED)
    stride_kb = aligned(stride_kb, STRIDES_ALIGNED)
    stride_kn = aligned(stride_kn, STRIDES_ALIGNED)
    stride_kh = aligned(stride_kh, STRIDES_ALIGNED)
    stride_vb = aligned(stride_vb, STRIDES_ALIGNED)
    stride_vn = aligned(stride_vn, STRIDES_ALIGNED)
    stride_vh = aligned(stride_vh, STRIDES_ALIGNED)
    stride_dob = aligned(stride_dob, STRIDES_ALIGNED)
    stride_dom = aligned(stride_dom, STRIDES_ALIGNED)
    stride_doh = aligned(stride_doh, STRIDES_ALIGNED)
    stride_dqb = aligned(stride_dqb, STRIDES_ALIGNED)
    stride_dqm = aligned(stride_dqm, STRIDES_ALIGNED)
    stride_dqh = aligned(stride_dqh, STRIDES_ALIGNED)
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    head_k = (head // GROUP_SIZE).to(tl.int64)
    head = tl.cast(head, tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m
    m_offset = tl.cast(start_m, tl.int64)

    q = load_tile(Q + batch * stride_qb + head * stride_qh + m_offset * stride_qm,
                  offs_m, offs_d, stride_qm, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    do = load_tile(dOut + batch * stride_dob + head * stride_doh + m_offset * stride_dom,
                   offs_m, offs_d, stride_dom, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    row_base = batch * stride_lb + head * stride_lh
    lse2, delta = load_row_stats(LSE + row_base, Delta + row_base, rows, seqlen_q)
    k_base = K + batch * stride_kb + head_k * stride_kh
    v_base = V + batch * stride_vb + head_k * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    full_end, end = key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for start_n in range(0, full_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, start_n, rows, offs_n, offs_d,
                      stride_kn, stride_vn, qk_scale, seqlen_q, seqlen_k,
                      HEAD_DIM, BLOCK_D, False, IS_CAUSAL, DOT_PRECISION)
    for start_n in range(full_end, end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, start_n, rows, offs_n, offs_d,
                      stride_kn, stride_vn, qk_scale, seqlen_q, seqlen_k,
                      HEAD_DIM, BLOCK_D, True, IS_CAUSAL, DOT_PRECISION)

    dq = dq * softmax_scale
    store_tile(dQ + batch * stride_dqb + head * stride_dqh + m_offset * stride_dqm,
               dq, offs_m, offs_d, stride_dqm, seqlen_q - start_m, HEAD_DIM, BLOCK_D)
