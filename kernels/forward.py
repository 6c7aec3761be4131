"""FlashAttention-2 forward: one program per (query block, query head, batch entry).

For a query block, loop over key blocks keeping a running max ``m``, a running sum
``l`` and an unnormalised output ``acc`` (the online softmax), then write
``O = acc / l`` and ``LSE = (m + log2 l) * ln 2``. Key blocks wholly visible to the
block are visited without any mask work; only blocks that cross a window edge (the
causal diagonal is one) or the end of the keys are masked, and blocks wholly outside
the window are not visited at all.

Options are constexpr flags (softcap, bias, ALiBi, dropout, window, varlen): the plain
path compiles to the loop above and nothing else.
"""
import triton
import triton.language as tl

from .helpers import (LN2, aligned, dropout_keep, key_blocks, load_seed, load_tile, scores,
                      sequence_bounds, softmax_step, store_tile, visible)


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, bias_base, start_n, rows, offs_n, offs_d,
            stride_kn, stride_vn, stride_bm, stride_bn, seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_log2, slope, window_left, window_right,
            seed_lo, seed_hi, dropout_p, batch, head,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
            LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """Fold the key block starting at ``start_n`` into the running softmax."""
    cols = start_n + offs_n
    k = load_tile(k_base + tl.cast(start_n, tl.int64) * stride_kn, offs_n, offs_d, stride_kn,
                  seqlen_k - start_n, HEAD_DIM, BLOCK_D, MASKED)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = scores(qk, rows[:, None], cols[None, :], seqlen_q, seqlen_k, qk_scale, softcap_scale,
               softcap_log2, bias_base, stride_bm, stride_bn, slope,
               HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI)
    if MASKED:
        s = tl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                             window_right, LIMIT_LEFT, LIMIT_RIGHT), s, float("-inf"))
    m_i, l_i, p, alpha = softmax_step(m_i, l_i, s, MASKED)
    if HAS_DROPOUT:  # l keeps the undropped sum: dropout acts on normalised probabilities
        p = tl.where(dropout_keep(seed_lo, seed_hi, batch, head, rows[:, None], cols[None, :],
                                  dropout_p), p, 0.0)
    v = load_tile(v_base + tl.cast(start_n, tl.int64) * stride_vn, offs_n, offs_d, stride_vn,
                  seqlen_k - start_n, HEAD_DIM, BLOCK_D, MASKED)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def attention_forward(
    Q, K, V, Bias, Slopes, Seed, CuSeqlensQ, CuSeqlensK,
    qk_scale, softcap_scale, softcap_log2, dropout_p, dropout_scale, window_left, window_right,
    seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_sb,
    Out, LSE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
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
    stride_ob = aligned(stride_ob, STRIDES_ALIGNED)
    stride_om = aligned(stride_om, STRIDES_ALIGNED)
    stride_oh = aligned(stride_oh, STRIDES_ALIGNED)
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    head_k = tl.cast(head // GROUP_SIZE, tl.int64)  # GQA: a group of query heads shares K/V
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(batch, CuSeqlensQ, CuSeqlensK,
                                                           seqlen_q, seqlen_k, IS_VARLEN)
    batch64 = tl.cast(batch, tl.int64)
    head64 = tl.cast(head, tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m

    # int64 base offsets: batch * heads * seqlen * head_dim can pass 2^31.
    q_row0 = q_start + tl.cast(start_m, tl.int64)
    q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_row0 * stride_qm
    k_base = K + batch64 * stride_kb + head_k * stride_kh + k_start * stride_kn
    v_base = V + batch64 * stride_vb + head_k * stride_vh + k_start * stride_vn
    bias_base = Bias + batch64 * stride_bb + head64 * stride_bh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + batch64 * stride_sb + head64)
    seed_lo = 0
    seed_hi = 0
    mask_batch = batch
    mask_head = head
    if HAS_DROPOUT:
        seed_lo, seed_hi, mask_batch, mask_head = load_seed(Seed, batch, head)
    q = load_tile(q_base, offs_m, offs_d, stride_qm, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                          BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
    for start_n in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, k_base, v_base, bias_base, start_n, rows, offs_n, offs_d,
            stride_kn, stride_vn, stride_bm, stride_bn, seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_log2, slope, window_left, window_right,
            seed_lo, seed_hi, dropout_p, mask_batch, mask_head, HEAD_DIM, BLOCK_D, True,
            LIMIT_LEFT, LIMIT_RIGHT, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, k_base, v_base, bias_base, start_n, rows, offs_n, offs_d,
            stride_kn, stride_vn, stride_bm, stride_bn, seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_log2, slope, window_left, window_right,
            seed_lo, seed_hi, dropout_p, mask_batch, mask_head, HEAD_DIM, BLOCK_D, False,
            LIMIT_LEFT, LIMIT_RIGHT, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, k_base, v_base, bias_base, start_n, rows, offs_n, offs_d,
            stride_kn, stride_vn, stride_bm, stride_bn, seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_log2, slope, window_left, window_right,
            seed_lo, seed_hi, dropout_p, mask_batch, mask_head, HEAD_DIM, BLOCK_D, True,
            LIMIT_LEFT, LIMIT_RIGHT, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)

    # A row that saw no key (l == 0) gets output 0 and LSE -inf, never 0/0.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    if HAS_DROPOUT:
        l_safe = l_safe * (1.0 / dropout_scale)  # kept probabilities scaled by 1 / (1 - p)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))

    o_base = Out + batch64 * stride_ob + head64 * stride_oh + q_row0 * stride_om
    store_tile(o_base, out, offs_m, offs_d, stride_om, seqlen_q - start_m, HEAD_DIM, BLOCK_D)
    lse_base = LSE + batch64 * stride_lb + head64 * stride_lh + q_start
    tl.store(lse_base + rows, lse, mask=rows < seqlen_q)
