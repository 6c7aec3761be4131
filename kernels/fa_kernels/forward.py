"""FlashAttention-2 forward: one program per (query block, query head, batch entry).

For a query block, loop over key blocks keeping a running max ``m``, a running sum
``l`` and an unnormalised output ``acc`` (the online softmax), then write
``O = acc / l`` and ``LSE = (m + log2 l) * ln 2`` (natural log throughout with a bias,
and the part of the LSE fp32 cannot hold in ``LSELo``: helpers.final_lse). Key blocks
wholly visible to the block are visited without any mask work; only blocks that cross a window edge (the
causal diagonal is one) or the end of the keys are masked, and blocks wholly outside
the window are not visited at all.

Options are constexpr flags (softcap, bias, ALiBi, dropout, window, varlen, paged K/V):
the plain path compiles to the loop above and nothing else.
"""
import triton
import triton.language as tl

from .helpers import (aligned, aligned_strides, block_run, block_source_pair, dropout_keep,
                      final_lse, kernel, key_blocks, load_block, load_kv_block, load_rows,
                      load_seed, load_tile, paged_source, scores, sequence_bounds, softmax_step,
                      split_blocks, store_rows, store_tile, tile_offsets, visible)


@triton.jit
def _attend(acc, m_i, l_i, q, k_source, v_source, bias_base, start_n, rows, offs_n, offs_d,
            stride_kn, stride_vn, stride_bm, stride_bn, seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_out, slope, window_left, window_right,
            seed_lo, seed_hi, dropout_p, batch, head,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
            LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
            DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, HOST_TMA: tl.constexpr,
            FOLD_SCALE: tl.constexpr, PAGED_KV: tl.constexpr, WHOLE_PAGES: tl.constexpr):
    """Fold the key block starting at ``start_n`` into the running softmax."""
    cols = start_n + offs_n
    k = load_kv_block(k_source, start_n, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM, BLOCK_D,
                      MASKED, USE_TMA, HOST_TMA, PAGED_KV, WHOLE_PAGES)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if FOLD_SCALE:  # plain scores, scale > 0: softmax_step applies it
        s = qk
    else:
        s = scores(qk, rows[:, None], cols[None, :], seqlen_q, seqlen_k, qk_scale, softcap_scale,
                   softcap_out, bias_base, stride_bm, stride_bn, slope,
                   HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI)
    if MASKED:
        s = tl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                             window_right, LIMIT_LEFT, LIMIT_RIGHT), s, float("-inf"))
    m_i, l_i, p, alpha = softmax_step(m_i, l_i, s, qk_scale, MASKED, FOLD_SCALE, HAS_BIAS)
    if HAS_DROPOUT:  # l keeps the undropped sum: dropout acts on normalised probabilities
        p = tl.where(dropout_keep(seed_lo, seed_hi, batch, head, rows[:, None], cols[None, :],
                                  dropout_p), p, 0.0)
    v = load_kv_block(v_source, start_n, offs_n, offs_d, stride_vn, seqlen_k, HEAD_DIM, BLOCK_D,
                      MASKED, USE_TMA, HOST_TMA, PAGED_KV, WHOLE_PAGES)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@kernel
def attention_forward(
    Q, K, V, Bias, Slopes, Seed, CuSeqlensQ, CuSeqlensK, SequsedK, BlockTable, KBlocks, VBlocks,
    qk_scale, softcap_scale, softcap_out, dropout_p, dropout_scale, window_left, window_right,
    seqlen_q, seqlen_k, total_q, total_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_sb,
    page_size, num_pages, stride_tb,
    num_splits, stride_os, stride_ls,
    Out, LSE, LSELo,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
    PACK_GQA: tl.constexpr, SPLIT_KV: tl.constexpr, USE_TMA: tl.constexpr,
    HOST_TMA: tl.constexpr, FOLD_SCALE: tl.constexpr, PAGED_KV: tl.constexpr,
    WHOLE_PAGES: tl.constexpr,
):
    stride_qb, stride_qm, stride_qh = aligned_strides(stride_qb, stride_qm, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_kn, stride_kh = aligned_strides(stride_kb, stride_kn, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vn, stride_vh = aligned_strides(stride_vb, stride_vn, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_om, stride_oh = aligned_strides(stride_ob, stride_om, stride_oh, STRIDES_ALIGNED)
    stride_os = aligned(stride_os, STRIDES_ALIGNED)  # (a whole number of outputs)
    # Split-KV: programs (block, split) share a query block, each over a slice of the keys,
    # and write partial results that attention_forward_combine merges.
    block = tl.program_id(0)
    split = 0
    if SPLIT_KV:
        split = block % num_splits
        block = block // num_splits
    batch = tl.program_id(2)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        batch, CuSeqlensQ, CuSeqlensK, SequsedK, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN,
        HAS_SEQUSED_K)
    batch64 = tl.cast(batch, tl.int64)

    offs_m, offs_n, offs_d = tile_offsets(BLOCK_M, BLOCK_N, BLOCK_D)
    if PACK_GQA:
        # The rows of a block are (query, head) pairs of one K/V head's group: short
        # queries (decode) fill a tile, and K/V are read once per group, not per head.
        head_k = tl.cast(tl.program_id(1), tl.int64)
        slots = block * BLOCK_M + offs_m
        rows = slots // GROUP_SIZE
        head = head_k * GROUP_SIZE + slots % GROUP_SIZE
        row_lo = block * BLOCK_M // GROUP_SIZE
        row_hi = ((block + 1) * BLOCK_M - 1) // GROUP_SIZE + 1
    else:
        head = tl.program_id(1)
        head_k = tl.cast(head // GROUP_SIZE, tl.int64)  # GQA: a group of query heads shares K/V
        rows = block * BLOCK_M + offs_m
        row_lo = block * BLOCK_M
        row_hi = row_lo + BLOCK_M
    head64 = tl.cast(head, tl.int64)

    # int64 base offsets: batch * heads * seqlen * head_dim can pass 2^31.
    q_row0 = q_start + tl.cast(row_lo, tl.int64)
    k_base = K + batch64 * stride_kb + head_k * stride_kh + k_start * stride_kn
    v_base = V + batch64 * stride_vb + head_k * stride_vh + k_start * stride_vn
    if PACK_GQA:
        row_offsets = tl.cast(rows, tl.int64) * stride_qm + head64 * stride_qh
        q = load_rows(Q + batch64 * stride_qb + q_start * stride_qm, row_offsets, rows < seqlen_q,
                      offs_d, HEAD_DIM, BLOCK_D)
        bias_base = (Bias + batch64 * stride_bb + head64 * stride_bh)[:, None]
    else:
        q = load_tile(Q + batch64 * stride_qb + head64 * stride_qh + q_row0 * stride_qm,
                      offs_m, offs_d, stride_qm, seqlen_q - row_lo, HEAD_DIM, BLOCK_D, True)
        bias_base = Bias + batch64 * stride_bb + head64 * stride_bh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + batch64 * stride_sb + head64)
        if PACK_GQA:
            slope = slope[:, None]
    seed_lo, seed_hi, mask_batch, mask_head = load_seed(Seed, batch, head, HAS_DROPOUT)
    if PACK_GQA:
        mask_head = mask_head[:, None]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = key_blocks(row_lo, row_hi, seqlen_q, seqlen_k, window_left,
                                          window_right, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
    if SPLIT_KV:
        lo, full_lo, full_hi, hi = split_blocks(lo, full_lo, full_hi, hi, split, num_splits,
                                                seqlen_k, BLOCK_N)
    if PAGED_KV:  # K/V (num_pages, page_size, heads_k, head_dim): b's pages in its table row
        table = BlockTable + batch64 * stride_tb
        k_source = paged_source(K + head_k * stride_kh, table, page_size, num_pages, stride_kb)
        v_source = paged_source(V + head_k * stride_vh, table, page_size, num_pages, stride_vb)
    else:
        k_source, v_source = block_source_pair(k_base, KBlocks, stride_kn, v_base, VBlocks,
                                               stride_vn, batch, head_k, seqlen_k, HEAD_DIM,
                                               BLOCK_N, BLOCK_D, USE_TMA, HOST_TMA)
    # The key blocks in three runs: masked ones where the first rows' diagonal or window
    # edge cuts them, unmasked ones in the middle, masked ones again at the far edge.
    for run in tl.static_range(3):
        first, last = block_run(run, lo, full_lo, full_hi, hi)
        for start_n in range(first, last, BLOCK_N):
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, k_source, v_source, bias_base, start_n, rows, offs_n, offs_d,
                stride_kn, stride_vn, stride_bm, stride_bn, seqlen_q, seqlen_k,
                qk_scale, softcap_scale, softcap_out, slope, window_left, window_right,
                seed_lo, seed_hi, dropout_p, mask_batch, mask_head, HEAD_DIM, BLOCK_D, run != 1,
                LIMIT_LEFT, LIMIT_RIGHT, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT,
                DOT_PRECISION, USE_TMA, HOST_TMA, FOLD_SCALE, PAGED_KV, WHOLE_PAGES)

    # A row that saw no key (l == 0) gets output 0 and LSE -inf, never 0/0; a NaN in
    # its inputs stays NaN in both.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if HAS_DROPOUT:
        l_safe = l_safe * (1.0 / dropout_scale)  # kept probabilities scaled by 1 / (1 - p)
    out = acc / l_safe[:, None]
    lse, lse_lo = final_lse(m_i, l_i, HAS_BIAS)

    # Split-KV writes this split's (fp32) slice of the partial buffers.
    split64 = tl.cast(split, tl.int64)
    o_batch = Out + split64 * stride_os + batch64 * stride_ob
    lse_offset = split64 * stride_ls + batch64 * stride_lb + q_start
    if PACK_GQA:
        store_rows(o_batch + q_start * stride_om, out,
                   tl.cast(rows, tl.int64) * stride_om + head64 * stride_oh, rows < seqlen_q,
                   offs_d, HEAD_DIM, BLOCK_D)
    else:
        store_tile(o_batch + head64 * stride_oh + q_row0 * stride_om, out, offs_m, offs_d,
                   stride_om, seqlen_q - row_lo, HEAD_DIM, BLOCK_D)
    lse_rows = lse_offset + head64 * stride_lh + rows
    tl.store(LSE + lse_rows, lse, mask=rows < seqlen_q)
    if HAS_BIAS:
        tl.store(LSELo + lse_rows, lse_lo, mask=rows < seqlen_q)


@kernel
def attention_forward_combine(
    OutPartial, LSEPartial, LSELoPartial, CuSeqlensQ, CuSeqlensK,
    seqlen_q, total_q, num_splits,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_os, stride_ls,
    Out, LSE, LSELo,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    """Merge split-KV partial results: LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s.

    One pass over the splits, ``SPLIT_CHUNK`` of them loaded at once (their loads are in
    flight together: decode has tens of splits, and one at a time the merge waits on
    memory that often), rescaling what it has summed whenever the largest LSE so far
    grows: the online softmax again, over whole splits. With a bias each LSE_s is
    ``lse + lse_lo`` (helpers.final_lse), and so is the merged one.

    The partial buffers have the layout of Out and LSE (fp32) with a leading split axis.
    """
    stride_ob, stride_om, stride_oh = aligned_strides(stride_ob, stride_om, stride_oh, STRIDES_ALIGNED)
    stride_os = aligned(stride_os, STRIDES_ALIGNED)
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.cast(tl.program_id(1), tl.int64)
    batch = tl.program_id(2)
    q_start, _, seqlen_q, _ = sequence_bounds(batch, CuSeqlensQ, CuSeqlensK, CuSeqlensK,
                                              seqlen_q, 0, total_q, 0, IS_VARLEN, False)
    batch64 = tl.cast(batch, tl.int64)
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m
    lse_base = LSEPartial + batch64 * stride_lb + head * stride_lh + q_start
    lse_lo_base = LSELoPartial + batch64 * stride_lb + head * stride_lh + q_start
    o_base = (OutPartial + batch64 * stride_ob + head * stride_oh
              + (q_start + tl.cast(start_m, tl.int64)) * stride_om)
    tile = offs_m[None, :, None] * stride_om + offs_d[None, None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the largest LSE_s so far
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for first in range(0, num_splits, SPLIT_CHUNK):
        splits = first + offs_s
        ok = (splits[:, None] < num_splits) & (rows[None, :] < seqlen_q)  # (chunk, rows)
        lse_offsets = tl.cast(splits, tl.int64)[:, None] * stride_ls + rows[None, :]
        lse_s = tl.load(lse_base + lse_offsets, mask=ok, other=float("-inf"))
        parts = tl.load(o_base + tl.cast(splits, tl.int64)[:, None, None] * stride_os + tile,
                        mask=ok[:, :, None] & (offs_d[None, None, :] < HEAD_DIM), other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse_s, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split saw a key yet
        alpha = tl.exp(m_i - m_ref)
        if HAS_BIAS:  # (an empty split's lse_lo is 0: final_lse)
            lo_s = tl.load(lse_lo_base + lse_offsets, mask=ok, other=0.0)
            weights = tl.exp((lse_s - m_ref[None, :]) + lo_s)
        else:
            weights = tl.exp(lse_s - m_ref[None, :])  # 0 for an empty split (LSE -inf)
        total = total * alpha + tl.sum(weights, 0)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * parts, 0)
        m_i = m_new
    seen = m_i > float("-inf")  # else no split saw a key: output 0, LSE -inf
    acc = acc / tl.where(seen, total, 1.0)[:, None]
    lse, lse_lo = final_lse(tl.where(seen, m_i, 0.0), total, True)  # (natural log)

    out_base = (Out + batch64 * stride_ob + head * stride_oh
                + (q_start + tl.cast(start_m, tl.int64)) * stride_om)
    store_tile(out_base, acc, offs_m, offs_d, stride_om, seqlen_q - start_m, HEAD_DIM, BLOCK_D)
    lse_rows = batch64 * stride_lb + head * stride_lh + q_start + rows
    tl.store(LSE + lse_rows, lse, mask=rows < seqlen_q)
    if HAS_BIAS:
        tl.store(LSELo + lse_rows, lse_lo, mask=rows < seqlen_q)


@triton.jit
def _fold(acc, m_i, l_i, q, k, v, rows, cols, seqlen_q, seqlen_k, qk_scale, window_left,
          window_right, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr,
          MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """_attend's plain-score step on blocks already loaded (one K and V block serves both
    halves of attention_forward_ws's tile)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                             window_right, LIMIT_LEFT, LIMIT_RIGHT), s, float("-inf"))
    m_i, l_i, p, alpha = softmax_step(m_i, l_i, s, qk_scale, MASKED, True, False)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _store_half(Out, LSE, acc, m_i, l_i, o_base, lse_base, row0, rows, offs_m, offs_d,
                stride_om, seqlen_q, HEAD_DIM: tl.constexpr):
    """Write one half tile's output rows and LSE, as attention_forward does."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse, _ = final_lse(m_i, l_i, False)
    store_tile(Out + o_base + tl.cast(row0, tl.int64) * stride_om, out, offs_m, offs_d,
               stride_om, seqlen_q - row0, HEAD_DIM, HEAD_DIM)
    tl.store(LSE + lse_base + rows, lse, mask=rows < seqlen_q)


@kernel
def attention_forward_ws(
    Q, K, V, QBlocks, KBlocks, VBlocks,
    qk_scale, window_left, window_right, seqlen_q, seqlen_k,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    Out, LSE, LSELo,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """attention_forward's plain path (scores q·k only: no softcap, bias, ALiBi, dropout,
    varlen, paging or split) in the shape Triton's Hopper warp specialisation takes
    (benchmarks/NOTES.md 35): one loop, 4 warps, every block into a matmul through a
    descriptor made on the host. The compiler then gives the loads to a producer
    warpgroup and the rows to two consumer warpgroups (FA3's shape), so one block's
    softmax runs while the other's matmuls do. The pass cannot split a host descriptor's
    block, so the tile's rows come as two halves with a running max, sum and accumulator
    each; and one loop means no unmasked run: with a window or keys that end inside a
    block, every block is masked (a select on scores the unmasked blocks keep).

    The same blocks in the same order with the same operations as attention_forward
    with this BLOCK_N; only the matmuls' tiles differ, which may round the last bit of
    a sum otherwise. WARP_SPECIALIZE False compiles the same loop unspecialised (the plan
    always sets it; benchmarks/warp_specialized.py compares the two)."""
    stride_ob, stride_om, stride_oh = aligned_strides(stride_ob, stride_om, stride_oh, STRIDES_ALIGNED)
    HALF: tl.constexpr = BLOCK_M // 2
    row_lo = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    head_k = head // GROUP_SIZE
    offs_m, offs_n, offs_d = tile_offsets(HALF, BLOCK_N, HEAD_DIM)
    rows_a = row_lo + offs_m
    rows_b = rows_a + HALF
    q_source = (QBlocks, batch, head)
    q_a = load_block(q_source, row_lo, offs_m, offs_d, 0, seqlen_q, HEAD_DIM, HEAD_DIM, False,
                     True, True)
    q_b = load_block(q_source, row_lo + HALF, offs_m, offs_d, 0, seqlen_q, HEAD_DIM, HEAD_DIM,
                     False, True, True)
    k_source = (KBlocks, batch, head_k)
    v_source = (VBlocks, batch, head_k)

    m_a = tl.full([HALF], float("-inf"), tl.float32)
    l_a = tl.zeros([HALF], tl.float32)
    acc_a = tl.zeros([HALF, HEAD_DIM], tl.float32)
    m_b, l_b, acc_b = m_a, l_a, acc_a
    lo, _, _, hi = key_blocks(row_lo, row_lo + BLOCK_M, seqlen_q, seqlen_k, window_left,
                              window_right, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        cols = start_n + offs_n
        k = load_block(k_source, start_n, offs_n, offs_d, 0, seqlen_k, HEAD_DIM, HEAD_DIM,
                       False, True, True)
        v = load_block(v_source, start_n, offs_n, offs_d, 0, seqlen_k, HEAD_DIM, HEAD_DIM,
                       False, True, True)
        acc_a, m_a, l_a = _fold(acc_a, m_a, l_a, q_a, k, v, rows_a, cols, seqlen_q, seqlen_k,
                                qk_scale, window_left, window_right, LIMIT_LEFT, LIMIT_RIGHT,
                                MASKED, DOT_PRECISION)
        acc_b, m_b, l_b = _fold(acc_b, m_b, l_b, q_b, k, v, rows_b, cols, seqlen_q, seqlen_k,
                                qk_scale, window_left, window_right, LIMIT_LEFT, LIMIT_RIGHT,
                                MASKED, DOT_PRECISION)

    batch64 = tl.cast(batch, tl.int64)
    head64 = tl.cast(head, tl.int64)
    o_base = batch64 * stride_ob + head64 * stride_oh
    lse_base = batch64 * stride_lb + head64 * stride_lh
    _store_half(Out, LSE, acc_a, m_a, l_a, o_base, lse_base, row_lo, rows_a, offs_m, offs_d,
                stride_om, seqlen_q, HEAD_DIM)
    _store_half(Out, LSE, acc_b, m_b, l_b, o_base, lse_base, row_lo + HALF, rows_b, offs_m,
                offs_d, stride_om, seqlen_q, HEAD_DIM)
