"""FlashAttention-2 backward, in three launches and without atomics.

With P = exp(z - LSE) recomputed from the saved LSE (z the natural-log logits after
softcap, bias and ALiBi), dP = dO V^T and D = rowsum(dO * O) - dLSE:

    dZ = P * (dP - D)      dV = P^T dO      dK = scale * dS^T Q      dQ = scale * dS K

where dS = dZ, times 1 - tanh^2 under softcap; dZ is also the bias gradient. Dropout
multiplies P by keep / (1 - p) on the way to dV and dP by the same on the way back.

* ``attention_backward_preprocess``: D, one program per (query block, head, batch).
* ``attention_backward``, launched once per pass, each with its own tile:
  - dK and dV: one program per (key block, K/V head, batch entry) loops over the query
    blocks that see it, for every query head of its GQA group, summing in fp32
    registers: dK and dV are written once, so the result is deterministic;
  - dQ (``DQ_PASS``): one program per (query block, query head, batch entry) loops over
    the key blocks it sees, like the forward; it also writes dZ for the bias.

The outflow rule: scores are scaled once in fp32, and the remaining factors
(``softmax_scale`` for dK and dQ, 1 / (1 - p) for dV) are applied on the way out.
"""
import triton
import triton.language as tl

from .helpers import (aligned, aligned_strides, block_run, block_source_pair, dropout_keep, kernel,
                      key_blocks, load_block, load_held_pair, load_row_stats, load_seed,
                      load_tile, probabilities, query_blocks, scores, sequence_bounds,
                      softcap_slope, store_tile, tile_offsets, visible)


@kernel
def attention_backward_preprocess(
    Out, dOut, dLSE,
    seqlen_q,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh,
    Delta,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):
    stride_ob, stride_om, stride_oh = aligned_strides(stride_ob, stride_om, stride_oh, STRIDES_ALIGNED)
    stride_dob, stride_dom, stride_doh = aligned_strides(stride_dob, stride_dom, stride_doh, STRIDES_ALIGNED)
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.cast(tl.program_id(1), tl.int64)
    batch = tl.cast(tl.program_id(2), tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m
    row0 = tl.cast(start_m, tl.int64)
    o = load_tile(Out + batch * stride_ob + head * stride_oh + row0 * stride_om,
                  offs_m, offs_d, stride_om, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    do = load_tile(dOut + batch * stride_dob + head * stride_doh + row0 * stride_dom,
                   offs_m, offs_d, stride_dom, seqlen_q - start_m, HEAD_DIM, BLOCK_D, True)
    row_base = batch * stride_lb + head * stride_lh
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:  # the LSE was used downstream: its gradient joins D
        delta -= tl.load(dLSE + row_base + rows, mask=rows < seqlen_q, other=0.0)
    tl.store(Delta + row_base + rows, delta, mask=rows < seqlen_q)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_source, do_source, lse_base, lse_lo_base, delta_base, bias_base,
               start_m, cols,
               offs_m, offs_d, stride_qm, stride_dom, stride_bm, stride_bn, seqlen_q, seqlen_k,
               qk_scale, softcap_scale, softcap_out, slope, window_left, window_right,
               seed_lo, seed_hi, dropout_p, dropout_scale, batch, head,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, HOST_TMA: tl.constexpr,
               WANT_DK: tl.constexpr, WANT_DV: tl.constexpr):
    """Add one query block's share to dK and/or dV (tiles kept transposed: keys x
    queries); ``v`` is read only for dK."""
    rows = start_m + offs_m
    q = load_block(q_source, start_m, offs_m, offs_d, stride_qm, seqlen_q, HEAD_DIM, BLOCK_D,
                   True, USE_TMA, HOST_TMA)
    do = load_block(do_source, start_m, offs_m, offs_d, stride_dom, seqlen_q, HEAD_DIM, BLOCK_D,
                    True, USE_TMA, HOST_TMA)
    lse, lse_lo, delta = load_row_stats(lse_base, lse_lo_base, delta_base, rows, seqlen_q,
                                        HAS_BIAS)
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    s_t = scores(qk_t, rows[None, :], cols[:, None], seqlen_q, seqlen_k, qk_scale, softcap_scale,
                 softcap_out, bias_base, stride_bm, stride_bn, slope,
                 HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI)
    p_t = probabilities(s_t, lse[None, :], lse_lo[None, :], HAS_BIAS)
    if MASKED:
        p_t = tl.where(visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, window_left,
                               window_right, LIMIT_LEFT, LIMIT_RIGHT), p_t, 0.0)
    if WANT_DK:  # dP first: dV's matmul, an accumulator, then runs beside dS's arithmetic
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep_t = dropout_keep(seed_lo, seed_hi, batch, head, rows[None, :], cols[:, None],
                              dropout_p)
    if WANT_DV:
        if HAS_DROPOUT:
            dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv,
                        input_precision=DOT_PRECISION)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    if WANT_DK:
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * softcap_slope(qk_t, softcap_scale)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_block(Q, K, V, dOut, QBlocks, KBlocks, VBlocks, dOBlocks, LSE, LSELo, Delta, Bias,
                Slopes, Seed, dK, dV, start_n, head_k,
                batch, batch64, q_start, k_start, seqlen_q, seqlen_k, softmax_scale,
                qk_scale, softcap_scale, softcap_out, dropout_p, dropout_scale,
                window_left, window_right, stride_qb, stride_qm, stride_qh, stride_kb,
                stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_dob,
                stride_dom, stride_doh, stride_lb, stride_lh, stride_bb, stride_bh,
                stride_bm, stride_bn, stride_sb, stride_dkb, stride_dkn, stride_dkh,
                stride_dvb, stride_dvn, stride_dvh, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_SIZE: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                HOLD_TMA: tl.constexpr, HOST_TMA: tl.constexpr, WANT_DK: tl.constexpr,
                WANT_DV: tl.constexpr):
    """dK and/or dV of the key block from ``start_n``: the loop over the query blocks that
    see it, for every query head of the GQA group, then the stores."""
    head_k64 = tl.cast(head_k, tl.int64)
    offs_m, offs_n, offs_d = tile_offsets(BLOCK_M, BLOCK_N, BLOCK_D)
    cols = start_n + offs_n

    # Key rows past seqlen_k need no mask (they read as 0, or as the next rows in memory
    # through a host descriptor): a key column of dS only reaches its own rows of dK and
    # dV, and those rows are not stored. Through a descriptor (HOLD_TMA) the held K and V
    # land in shared memory, where the matmuls read them, with no copy in registers (at
    # D = 256 that halves the spills).
    k_row0 = k_start + tl.cast(start_n, tl.int64)
    k, v = load_held_pair(
        K, batch64 * stride_kb + head_k64 * stride_kh + k_start * stride_kn, KBlocks, stride_kn,
        V, batch64 * stride_vb + head_k64 * stride_vh + k_start * stride_vn, VBlocks, stride_vn,
        start_n, batch, head_k, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, HOLD_TMA, HOST_TMA,
        WANT_DK)  # V is read for dK only
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = query_blocks(start_n, seqlen_q, seqlen_k, window_left,
                                            window_right, BLOCK_M, BLOCK_N, LIMIT_LEFT,
                                            LIMIT_RIGHT)
    for g in range(GROUP_SIZE):
        head = head_k * GROUP_SIZE + g
        head64 = tl.cast(head, tl.int64)
        seed_lo, seed_hi, mask_batch, mask_head = load_seed(Seed, batch, head, HAS_DROPOUT)
        q_source, do_source = block_source_pair(
            Q + batch64 * stride_qb + head64 * stride_qh + q_start * stride_qm, QBlocks, stride_qm,
            dOut + batch64 * stride_dob + head64 * stride_doh + q_start * stride_dom, dOBlocks,
            stride_dom, batch, head, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, HOST_TMA)
        lse_base = LSE + batch64 * stride_lb + head64 * stride_lh + q_start
        lse_lo_base = LSELo + batch64 * stride_lb + head64 * stride_lh + q_start
        delta_base = Delta + batch64 * stride_lb + head64 * stride_lh + q_start
        bias_base = Bias + batch64 * stride_bb + head64 * stride_bh
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + batch64 * stride_sb + head64)
        for run in tl.static_range(3):  # masked, unmasked, masked query blocks (query_blocks)
            first, last = block_run(run, lo, full_lo, full_hi, hi)
            for start_m in range(first, last, BLOCK_M):
                dk, dv = _dkdv_step(
                    dk, dv, k, v, q_source, do_source, lse_base, lse_lo_base, delta_base,
                    bias_base, start_m, cols, offs_m, offs_d, stride_qm, stride_dom, stride_bm,
                    stride_bn, seqlen_q, seqlen_k, qk_scale, softcap_scale, softcap_out, slope,
                    window_left, window_right, seed_lo, seed_hi, dropout_p, dropout_scale,
                    mask_batch, mask_head, HEAD_DIM, BLOCK_D, run != 1, LIMIT_LEFT, LIMIT_RIGHT,
                    HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, USE_TMA,
                    HOST_TMA, WANT_DK, WANT_DV)

    if WANT_DK:
        store_tile(dK + batch64 * stride_dkb + head_k64 * stride_dkh + k_row0 * stride_dkn,
                   dk * softmax_scale, offs_n, offs_d, stride_dkn, seqlen_k - start_n, HEAD_DIM,
                   BLOCK_D)
    if WANT_DV:
        if HAS_DROPOUT:
            dv = dv * dropout_scale
        store_tile(dV + batch64 * stride_dvb + head_k64 * stride_dvh + k_row0 * stride_dvn,
                   dv, offs_n, offs_d, stride_dvn, seqlen_k - start_n, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_step(dq, q, do, lse, lse_lo, delta, k_source, v_source, bias_base, dbias_base, start_n,
             rows, offs_n, offs_d, stride_kn, stride_vn, stride_bm, stride_bn, stride_dbm,
             seqlen_q, seqlen_k, qk_scale, softcap_scale, softcap_out, slope,
             window_left, window_right, seed_lo, seed_hi, dropout_p, dropout_scale, batch, head,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
             LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
             HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             HAS_DBIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
             HOST_TMA: tl.constexpr):
    """Add one key block's share to dQ (and write its dZ when the bias needs a gradient)."""
    cols = start_n + offs_n
    k = load_block(k_source, start_n, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM, BLOCK_D,
                   MASKED, USE_TMA, HOST_TMA)
    v = load_block(v_source, start_n, offs_n, offs_d, stride_vn, seqlen_k, HEAD_DIM, BLOCK_D,
                   MASKED, USE_TMA, HOST_TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = scores(qk, rows[:, None], cols[None, :], seqlen_q, seqlen_k, qk_scale, softcap_scale,
               softcap_out, bias_base, stride_bm, stride_bn, slope,
               HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI)
    p = probabilities(s, lse[:, None], lse_lo[:, None], HAS_BIAS)
    if MASKED:
        p = tl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                             window_right, LIMIT_LEFT, LIMIT_RIGHT), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(seed_lo, seed_hi, batch, head, rows[:, None], cols[None, :], dropout_p)
        dp = tl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_DBIAS:
        ptrs = dbias_base + tl.cast(rows[:, None], tl.int64) * stride_dbm + cols[None, :]
        tl.store(ptrs, ds, mask=(rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))
    if HAS_SOFTCAP:
        ds = ds * softcap_slope(qk, softcap_scale)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@kernel
def attention_backward(
    Q, K, V, dOut, LSE, LSELo, Delta, Bias, Slopes, Seed, CuSeqlensQ, CuSeqlensK, SequsedK,
    QBlocks, KBlocks, VBlocks, dOBlocks,
    softmax_scale, qk_scale, softcap_scale, softcap_out, dropout_p, dropout_scale,
    window_left, window_right, seqlen_q, seqlen_k, total_q, total_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_sb,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_dbb, stride_dbh, stride_dbm,
    dK, dV, dQ, dBias,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_DBIAS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STRIDES_ALIGNED: tl.constexpr, ROWS_ALIGNED: tl.constexpr,
    USE_TMA: tl.constexpr, HOLD_TMA: tl.constexpr, HOST_TMA: tl.constexpr,
    DKDV_PARTS: tl.constexpr, DQ_PASS: tl.constexpr,
):
    """One program of a backward pass: the plan launches the kernel twice, for dK and dV
    (a program per key block and K/V head) and, with ``DQ_PASS``, for dQ (a program per
    query block and query head), each pass with its own tile. A pass's outputs are the
    only arrays it writes; the other pass's are placeholders it never touches."""
    stride_qb, stride_qm, stride_qh = aligned_strides(stride_qb, stride_qm, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_kn, stride_kh = aligned_strides(stride_kb, stride_kn, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vn, stride_vh = aligned_strides(stride_vb, stride_vn, stride_vh, STRIDES_ALIGNED)
    stride_dob, stride_dom, stride_doh = aligned_strides(stride_dob, stride_dom, stride_doh, STRIDES_ALIGNED)
    stride_dkb, stride_dkn, stride_dkh = aligned_strides(stride_dkb, stride_dkn, stride_dkh, STRIDES_ALIGNED)
    stride_dvb, stride_dvn, stride_dvh = aligned_strides(stride_dvb, stride_dvn, stride_dvh, STRIDES_ALIGNED)
    stride_dqb, stride_dqm, stride_dqh = aligned_strides(stride_dqb, stride_dqm, stride_dqh, STRIDES_ALIGNED)
    # Whole 16-row units keep the row statistics' loads vectorised in the dK/dV pass.
    seqlen_q, stride_lb, stride_lh = aligned_strides(seqlen_q, stride_lb, stride_lh, ROWS_ALIGNED)
    seqlen_k = aligned(seqlen_k, ROWS_ALIGNED)
    batch = tl.program_id(2)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        batch, CuSeqlensQ, CuSeqlensK, SequsedK, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN,
        HAS_SEQUSED_K)
    if DQ_PASS:  # dQ (and dZ) of one query block of one query head
        start_m = tl.program_id(0) * BLOCK_M
        if start_m >= seqlen_q:  # past this sequence's queries (varlen): no row of dQ to
            return               # write, and a descriptor over 0 rows faults on load
        batch64 = tl.cast(batch, tl.int64)
        head = tl.program_id(1)
        head_k = tl.cast(head // GROUP_SIZE, tl.int64)
        head64 = tl.cast(head, tl.int64)
        offs_m, offs_n, offs_d = tile_offsets(BLOCK_M, BLOCK_N, BLOCK_D)
        rows = start_m + offs_m
        q_row0 = q_start + tl.cast(start_m, tl.int64)

        q, do = load_held_pair(
            Q, batch64 * stride_qb + head64 * stride_qh + q_start * stride_qm, QBlocks, stride_qm,
            dOut, batch64 * stride_dob + head64 * stride_doh + q_start * stride_dom, dOBlocks,
            stride_dom, start_m, batch, head, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, HOLD_TMA,
            HOST_TMA, True)
        row_base = batch64 * stride_lb + head64 * stride_lh + q_start
        lse, lse_lo, delta = load_row_stats(LSE + row_base, LSELo + row_base, Delta + row_base,
                                            rows, seqlen_q, HAS_BIAS)
        k_source, v_source = block_source_pair(
            K + batch64 * stride_kb + head_k * stride_kh + k_start * stride_kn, KBlocks, stride_kn,
            V + batch64 * stride_vb + head_k * stride_vh + k_start * stride_vn, VBlocks, stride_vn,
            batch, head_k, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, HOST_TMA)
        bias_base = Bias + batch64 * stride_bb + head64 * stride_bh
        dbias_base = dBias + batch64 * stride_dbb + head64 * stride_dbh
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + batch64 * stride_sb + head64)
        seed_lo, seed_hi, mask_batch, mask_head = load_seed(Seed, batch, head, HAS_DROPOUT)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        lo, full_lo, full_hi, hi = key_blocks(start_m, start_m + BLOCK_M, seqlen_q, seqlen_k,
                                              window_left, window_right, BLOCK_N, LIMIT_LEFT,
                                              LIMIT_RIGHT)
        for run in tl.static_range(3):  # masked, unmasked, masked key blocks (key_blocks)
            first, last = block_run(run, lo, full_lo, full_hi, hi)
            for start_n in range(first, last, BLOCK_N):
                dq = _dq_step(
                    dq, q, do, lse, lse_lo, delta, k_source, v_source, bias_base, dbias_base,
                    start_n, rows, offs_n, offs_d, stride_kn, stride_vn, stride_bm, stride_bn,
                    stride_dbm, seqlen_q, seqlen_k, qk_scale, softcap_scale, softcap_out, slope,
                    window_left, window_right, seed_lo, seed_hi, dropout_p, dropout_scale,
                    mask_batch, mask_head, HEAD_DIM, BLOCK_D, run != 1, LIMIT_LEFT, LIMIT_RIGHT,
                    HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, HAS_DBIAS, DOT_PRECISION,
                    USE_TMA, HOST_TMA)

        dq = dq * softmax_scale
        store_tile(dQ + batch64 * stride_dqb + head64 * stride_dqh + q_row0 * stride_dqm,
                   dq, offs_m, offs_d, stride_dqm, seqlen_q - start_m, HEAD_DIM, BLOCK_D)
    else:  # dK and dV of one key block of one K/V head, its group's query heads summed
        # DKDV_PARTS = 2: two programs a key block, the even one sums dV and the odd one dK
        # (each recomputes P), where one program cannot hold both accumulators without
        # spilling (D = 256). 1: one program sums both.
        start_n = tl.program_id(0) // DKDV_PARTS * BLOCK_N
        head_k = tl.program_id(1)
        if start_n >= seqlen_k:  # past this sequence's (used) keys: no row of dK, dV to
            return               # write, and a descriptor over 0 rows faults on load
        batch64 = tl.cast(batch, tl.int64)
        for part in tl.static_range(DKDV_PARTS):  # each part its own specialised loop
            if tl.program_id(0) % DKDV_PARTS == part:
                _dkdv_block(Q, K, V, dOut, QBlocks, KBlocks, VBlocks, dOBlocks, LSE, LSELo, Delta,
                            Bias, Slopes, Seed, dK, dV, start_n, head_k,
                            batch, batch64, q_start, k_start, seqlen_q, seqlen_k, softmax_scale,
                            qk_scale, softcap_scale, softcap_out, dropout_p, dropout_scale,
                            window_left, window_right, stride_qb, stride_qm, stride_qh, stride_kb,
                            stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_dob,
                            stride_dom, stride_doh, stride_lb, stride_lh, stride_bb, stride_bh,
                            stride_bm, stride_bn, stride_sb, stride_dkb, stride_dkn, stride_dkh,
                            stride_dvb, stride_dvn, stride_dvh, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                            GROUP_SIZE, LIMIT_LEFT, LIMIT_RIGHT, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
                            HAS_DROPOUT, DOT_PRECISION, USE_TMA, HOLD_TMA, HOST_TMA,
                            WANT_DK=part == DKDV_PARTS - 1, WANT_DV=part == 0)


@kernel
def attention_backward_dkdv_ws(
    Q, K, V, dOut, LSE, Delta, QBlocks, KBlocks, VBlocks, dOBlocks,
    softmax_scale, qk_scale, window_left, window_right, seqlen_q, seqlen_k,
    stride_lb, stride_lh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    dK, dV,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """The dK/dV pass's plain path (scores q·k only, as attention_forward_ws) in the shape
    Triton's Hopper warp specialisation takes (benchmarks/NOTES.md 35): one loop over
    every (query head of the GQA group, query block) pair that sees this key block, each
    block into a matmul through a descriptor made on the host, so that a producer
    warpgroup streams Q and dO while the consumers do the matmuls. The key block is 64
    rows (the pass cannot split a host descriptor's block). One loop means no unmasked
    run: with causal, a window or keys that end inside a query block, every block is
    masked.

    Query rows past seqlen_q read as zeros with LSE +inf and D 0 (``load_row_stats``), so
    they add nothing; key rows past seqlen_k are not stored. WARP_SPECIALIZE as in
    attention_forward_ws."""
    stride_dkb, stride_dkn, stride_dkh = aligned_strides(stride_dkb, stride_dkn, stride_dkh, STRIDES_ALIGNED)
    stride_dvb, stride_dvn, stride_dvh = aligned_strides(stride_dvb, stride_dvn, stride_dvh, STRIDES_ALIGNED)
    start_n = tl.program_id(0) * BLOCK_N
    head_k = tl.program_id(1)
    batch = tl.program_id(2)
    offs_m, offs_n, offs_d = tile_offsets(BLOCK_M, BLOCK_N, HEAD_DIM)
    cols = start_n + offs_n
    k = load_block((KBlocks, batch, head_k), start_n, offs_n, offs_d, 0, seqlen_k, HEAD_DIM,
                   HEAD_DIM, False, True, True)
    v = load_block((VBlocks, batch, head_k), start_n, offs_n, offs_d, 0, seqlen_k, HEAD_DIM,
                   HEAD_DIM, False, True, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    # (every name its own: Triton would carry a `_` reassigned in the loop as loop state)
    lo, unmasked_lo, unmasked_hi, hi = query_blocks(start_n, seqlen_q, seqlen_k, window_left,
                                                    window_right, BLOCK_M, BLOCK_N, LIMIT_LEFT,
                                                    LIMIT_RIGHT)
    per_head = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    batch64 = tl.cast(batch, tl.int64)
    for step in tl.range(0, GROUP_SIZE * per_head, warp_specialize=WARP_SPECIALIZE):
        head = head_k * GROUP_SIZE + step // per_head
        start_m = lo + step % per_head * BLOCK_M
        rows = start_m + offs_m
        q = load_block((QBlocks, batch, head), start_m, offs_m, offs_d, 0, seqlen_q, HEAD_DIM,
                       HEAD_DIM, False, True, True)
        do = load_block((dOBlocks, batch, head), start_m, offs_m, offs_d, 0, seqlen_q,
                        HEAD_DIM, HEAD_DIM, False, True, True)
        row_base = batch64 * stride_lb + tl.cast(head, tl.int64) * stride_lh
        lse, lse_lo, delta = load_row_stats(LSE + row_base, LSE + row_base, Delta + row_base,
                                            rows, seqlen_q, False)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        p_t = probabilities(s_t, lse[None, :], 0.0, False)
        if MASKED:
            p_t = tl.where(visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, window_left,
                                   window_right, LIMIT_LEFT, LIMIT_RIGHT), p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)

    head_k64 = tl.cast(head_k, tl.int64)
    k_row0 = tl.cast(start_n, tl.int64)
    store_tile(dK + batch64 * stride_dkb + head_k64 * stride_dkh + k_row0 * stride_dkn,
               dk * softmax_scale, offs_n, offs_d, stride_dkn, seqlen_k - start_n, HEAD_DIM,
               HEAD_DIM)
    store_tile(dV + batch64 * stride_dvb + head_k64 * stride_dvh + k_row0 * stride_dvn,
               dv, offs_n, offs_d, stride_dvn, seqlen_k - start_n, HEAD_DIM, HEAD_DIM)
