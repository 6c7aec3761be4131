"""FlashAttention-2 forward: one program per (query block, query head, batch).

For a query block, loop over key blocks keeping a running max ``m``, a running sum
``l`` and an unnormalised output ``acc`` (the online softmax), then write
``O = acc / l`` and ``LSE = (m + log2 l) * ln 2``. Key blocks wholly visible to the
block are visited without any mask work; only the blocks that cross the causal
diagonal or the end of the sequence are masked.
"""
import triton
import triton.language as tl

from .helpers import aligned, LN2, key_range, load_tile, softmax_step, store_tile, visible


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d,
            stride_kn, stride_vn, qk_scale, seqlen_q, seqlen_k,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
            IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the key block starting at ``start_n`` into the running softmax."""
    cols = start_n + offs_n
    k = load_tile(k_base + tl.cast(start_n, tl.int64) * stride_kn, offs_n, offs_d, stride_kn,
                  seqlen_k - start_n, HEAD_DIM, BLOCK_D, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible(offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, IS_CAUSAL),
                     s, float("-inf"))
    m_i, l_i, p, alpha = softmax_step(m_i, l_i, s, MASKED)
    v = load_tile(v_base + tl.cast(start_n, tl.int64) * stride_vn, offs_n, offs_d, stride_vn,
                  seqlen_k - start_n, HEAD_DIM, BLOCK_D, MASKED)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def attention_forward(
    Q, K, V,
    qk_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    Out, LSE,
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
    stride_ob = aligned(stride_ob, STRIDES_ALIGNED)
    stride_om = aligned(stride_om, STRIDES_ALIGNED)
    stride_oh = aligned(stride_oh, STRIDES_ALIGNED)
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    head_k = (head // GROUP_SIZE).to(tl.int64)  # GQA: a group of query heads shares K/V
    head = tl.cast(head, tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m

    # int64 base offsets: batch * heads * seqlen * head_dim can pass 2^31.
    q_base = Q + batch * stride_qb + head * stride_qh + tl.cast(start_m, tl.int64) * stride_qm
    k_base = K + batch * stride_kb + head_k * stride_kh
    v_base = V + batch * stride_vb + head_k * stride_vh
    q = load_tile(q_base, offs_m, offs_d, stride_qm, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    full_end, end = key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, start_n, rows, offs_n, offs_d,
                                stride_kn, stride_vn, qk_scale, seqlen_q, seqlen_k,
                                HEAD_DIM, BLOCK_D, False, IS_CAUSAL, DOT_PRECISION)
    for start_n in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, start_n, rows, offs_n, offs_d,
                                stride_kn, stride_vn, qk_scale, seqlen_q, seqlen_k,
                                HEAD_DIM, BLOCK_D, True, IS_CAUSAL, DOT_PRECISION)

    # A row that saw no key (l == 0) gets output 0 and LSE -inf, never 0/0.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))

    o_base = Out + batch * stride_ob + head * stride_oh + tl.cast(start_m, tl.int64) * stride_om
    store_tile(o_base, out, offs_m, offs_d, stride_om, seqlen_q - start_m, HEAD_DIM, BLOCK_D)
    lse_base = LSE + batch * stride_lb + head * stride_lh
    tl.store(lse_base + rows, lse, mask=rows < seqlen_q)
