"""Small Triton helpers, one idea each: tile loads and stores, visibility masks,
the key/query block ranges of a tile, and the online-softmax step.

Conventions shared by every kernel:
* ``s`` are scores in base 2: ``dot(q, k) * softmax_scale * log2(e)``, so the
  softmax is ``exp2(s - max)``; the stored LSE is in natural log (times ln 2 on
  the way out, times log2(e) on the way back in).
* Causal attention is bottom-right aligned: query row ``i`` sees key ``j`` when
  ``j <= i + seqlen_k - seqlen_q`` (flash-attn >= 2.1).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def aligned(stride, STRIDES_ALIGNED: tl.constexpr):
    """Tell the compiler a stride is a multiple of 16 elements when the plan knows it.

    torch's launcher infers that from the values; jax_triton does not for scalar
    arguments, and without it tile loads are not vectorised (3-4x slower). The plan
    sets the flag for both front ends alike, so both compile the same kernel.
    """
    if STRIDES_ALIGNED:
        stride = tl.multiple_of(stride, 16)
    return stride


@triton.jit
def load_tile(base, offs_row, offs_d, stride_row, num_rows,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows >= num_rows and columns >= HEAD_DIM read as 0."""
    ptrs = base + offs_row[:, None] * stride_row + offs_d[None, :]
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=offs_row[:, None] < num_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_row[:, None] < num_rows) & (offs_d[None, :] < HEAD_DIM),
                           other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def store_tile(base, tile, offs_row, offs_d, stride_row, num_rows,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store rows < num_rows and columns < HEAD_DIM of a tile, cast to the target dtype."""
    ptrs = base + offs_row[:, None] * stride_row + offs_d[None, :]
    value = tile.to(base.dtype.element_ty)
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, value, mask=offs_row[:, None] < num_rows)
    else:
        tl.store(ptrs, value, mask=(offs_row[:, None] < num_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def visible(rows_q, cols_k, seqlen_q, seqlen_k, IS_CAUSAL: tl.constexpr):
    """Which (query row, key column) pairs take part in the softmax.

    ``rows_q`` and ``cols_k`` are broadcastable index arrays, so the same helper
    serves the (query, key) tiles of the forward and the transposed (key, query)
    tiles of the dk/dv kernel.
    """
    mask = cols_k < seqlen_k
    if IS_CAUSAL:
        mask = mask & (cols_k <= rows_q + (seqlen_k - seqlen_q))
    return mask


@triton.jit
def key_range(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr):
    """Keys a query block [start_m, start_m + BLOCK_M) needs.

    Returns (full_end, end): key blocks in [0, full_end) are visible to every row of
    the block and need no mask; those in [full_end, end) cross the causal diagonal
    or the end of the sequence and do. Keys past ``end`` are never visited.
    """
    if IS_CAUSAL:
        diagonal = seqlen_k - seqlen_q
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + diagonal)
        full = tl.minimum(seqlen_k, start_m + diagonal + 1)
    else:
        end = seqlen_k
        full = seqlen_k
    end = tl.maximum(end, 0)
    full_end = tl.maximum(full, 0) // BLOCK_N * BLOCK_N
    return full_end, end


@triton.jit
def query_range(start_n, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                IS_CAUSAL: tl.constexpr):
    """Query blocks that see a key block [start_n, start_n + BLOCK_N).

    Returns (begin, full_begin): query blocks in [begin, full_begin) cross the causal
    diagonal and need a mask; those from full_begin to the end of the sequence see
    every key of the block. Query blocks before ``begin`` see none of it.
    """
    if IS_CAUSAL:
        diagonal = seqlen_k - seqlen_q
        last_q_block = (seqlen_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        begin = tl.maximum(start_n - diagonal, 0) // BLOCK_M * BLOCK_M
        full = tl.maximum(start_n + BLOCK_N - 1 - diagonal, 0)
        full_begin = (full + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        full_begin = tl.maximum(tl.minimum(full_begin, last_q_block), begin)
        begin = tl.minimum(begin, full_begin)
    else:
        begin = 0
        full_begin = 0
    return begin, full_begin


@triton.jit
def softmax_step(m_i, l_i, s, MASKED: tl.constexpr):
    """One online-softmax step in base 2 over a block of scores ``s``.

    Returns the new running max, the new running sum, the block's unnormalised
    probabilities and the factor that rescales what was accumulated before.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row may have seen no key yet (all -inf): exp2(-inf - -inf) would be NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, p, alpha


@triton.jit
def load_row_stats(lse_base, delta_base, offs_row, num_rows):
    """Per-row LSE (as base 2) and D = rowsum(dO * O) for the backward.

    A row that saw no key has LSE -inf; it becomes +inf here so that its
    probabilities exp2(s - lse) are 0 rather than inf. Rows past the end read
    the same way and contribute nothing.
    """
    in_range = offs_row < num_rows
    lse = tl.load(lse_base + offs_row, mask=in_range, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(delta_base + offs_row, mask=in_range, other=0.0)
    return lse2, delta
