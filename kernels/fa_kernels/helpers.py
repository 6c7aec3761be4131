"""Small Triton helpers, one idea each: tile loads and stores, visibility masks,
the key/query block ranges of a tile, and the online-softmax step.

Conventions shared by every kernel:
* ``s`` are scores in base 2: ``dot(q, k) * softmax_scale * log2(e)``, so the
  softmax is ``exp2(s - max)``; the stored LSE is in natural log (times ln 2 on
  the way out, times log2(e) on the way back in).
* With a bias (HAS_BIAS) scores stay in natural log and the softmax is ``exp(s - max)``:
  frameworks mask with finite biases down to ``finfo(float32).min``, whose base-2 value
  would overflow to -inf. Such a bias also makes the LSE too large for fp32 to hold its
  ``log(sum)`` part (-1e30 + log 8 is -1e30), so the LSE travels as ``lse + lse_lo``:
  ``lse`` the fp32 value users get, ``lse_lo`` the remainder the backward needs.
* Causal attention is bottom-right aligned: query row ``i`` sees key ``j`` when
  ``j <= i + seqlen_k - seqlen_q`` (flash-attn >= 2.1).
"""
import inspect

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


# Integer arguments Triton's JIT must not specialise on their value (divisible by 16,
# equal to 1): jax_triton marks no scalar, so a kernel specialised on them would differ
# between the front ends. The strides' divisibility comes from ``aligned`` instead.
UNSPECIALISED = ("seqlen_q", "seqlen_k", "total_q", "total_k", "window_left", "window_right",
                 "stride_lb", "stride_lh", "stride_ls", "num_splits", "page_size", "num_pages",
                 "stride_tb")


def kernel(fn):
    """``triton.jit`` for a kernel the front ends launch: one compiled code for Triton's JIT
    (fa_torch) and jax_triton (fa_jax), so the same PTX and the same bits."""
    names = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[n for n in UNSPECIALISED if n in names])


@triton.jit
def aligned(stride, STRIDES_ALIGNED: tl.constexpr):
    """Tell the compiler a stride (or a length) is a multiple of 16 elements when the
    plan knows it.

    Triton's JIT (fa_torch) marks every integer argument divisible by 16 so; jax_triton
    (fa_jax) marks only the arrays, and without the strides' divisibility tile loads are
    neither asynchronous nor vectorised (10x slower on the H200). ``tl.multiple_of`` did
    not reach the compiler's analysis the way the argument attribute does; rounding down
    to a multiple of 16 (a no-op here: the plan sets the flag only when every stride is
    one) does, so both front ends compile the same code (benchmarks/NOTES.md). The
    lengths and the row statistics' strides are ``UNSPECIALISED`` for the same reason;
    the backward rounds them with ``ROWS_ALIGNED``.
    """
    if STRIDES_ALIGNED:
        stride = (stride // 16) * 16
    return stride


@triton.jit
def aligned_strides(stride_b, stride_row, stride_h, STRIDES_ALIGNED: tl.constexpr):
    """``aligned`` for one array's (batch, row, head) strides."""
    return (aligned(stride_b, STRIDES_ALIGNED), aligned(stride_row, STRIDES_ALIGNED),
            aligned(stride_h, STRIDES_ALIGNED))


@triton.jit
def tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's offsets along query rows, key rows and the head dimension."""
    return tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)


@triton.jit
def load_tile(base, offs_row, offs_d, stride_row, num_rows,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows >= num_rows and columns >= HEAD_DIM read as 0."""
    if CHECK_ROWS:
        return load_rows(base, offs_row * stride_row, offs_row < num_rows, offs_d, HEAD_DIM,
                         BLOCK_D)
    ptrs = base + offs_row[:, None] * stride_row + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def store_tile(base, tile, offs_row, offs_d, stride_row, num_rows,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store rows < num_rows and columns < HEAD_DIM of a tile, cast to the target dtype."""
    store_rows(base, tile, offs_row * stride_row, offs_row < num_rows, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def load_rows(base, row_offsets, row_ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (rows, BLOCK_D) tile whose rows sit at any offsets (packed GQA: rows of several
    heads); rows not ``row_ok`` and columns >= HEAD_DIM read as 0."""
    ptrs = base + row_offsets[:, None] + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def store_rows(base, tile, row_offsets, row_ok, offs_d, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Store the ``row_ok`` rows of a tile at their offsets (see load_rows), cast."""
    ptrs = base + row_offsets[:, None] + offs_d[None, :]
    value = tile.to(base.dtype.element_ty)
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, value, mask=row_ok[:, None])
    else:
        tl.store(ptrs, value, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def block_source(base, blocks, batch, head, num_rows, stride_row, HEAD_DIM: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr,
                 HOST_TMA: tl.constexpr):
    """Where a loop's blocks of one (rows, head_dim) slab come from (K and V in the forward
    and dQ, Q and dO in dK/dV): a tensor descriptor (TMA on Hopper: the copy engine
    fetches a block, and rows past ``num_rows`` or columns past HEAD_DIM arrive as 0)
    or the plain base pointer. With HOST_TMA the descriptor came from the host, over the
    whole (batch, seqlen, heads, head_dim) array (``blocks``): the source is it and the
    slab's (batch, head); made on the device, it needs scratch memory for each program."""
    if USE_TMA:
        if HOST_TMA:
            source = (blocks, tl.cast(batch, tl.int32), tl.cast(head, tl.int32))
        else:
            source = tl.make_tensor_descriptor(base, shape=[num_rows, HEAD_DIM],
                                               strides=[stride_row, 1],
                                               block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        source = base
    return source


@triton.jit
def block_source_pair(first_base, first_blocks, first_stride, second_base, second_blocks,
                      second_stride, batch, head, num_rows, HEAD_DIM: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr,
                      HOST_TMA: tl.constexpr):
    """The ``block_source`` of the two slabs a loop streams side by side (K and V in the
    forward and dQ, Q and dO in dK/dV)."""
    first_source = block_source(first_base, first_blocks, batch, head, num_rows, first_stride,
                                HEAD_DIM, BLOCK_ROWS, BLOCK_D, USE_TMA, HOST_TMA)
    second_source = block_source(second_base, second_blocks, batch, head, num_rows,
                                 second_stride, HEAD_DIM, BLOCK_ROWS, BLOCK_D, USE_TMA, HOST_TMA)
    return first_source, second_source


@triton.jit
def held_block_source(array, offset, blocks, batch, head, num_rows, stride_row,
                      HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                      HOLD_TMA: tl.constexpr, HOST_TMA: tl.constexpr):
    """``block_source`` of the block a backward program holds for its whole loop (K/V in
    dK/dV, Q/dO in dQ), ``offset`` elements into ``array``. A host descriptor for it is
    2-D, over the array's rows as memory lays them out (row ``offset // stride_row``,
    column ``offset % stride_row``): a 4-D block reshaped to 2-D reaches the matmuls
    through registers, a 2-D one stays in shared memory. Its rows past ``num_rows`` are
    the next rows in memory, not 0, which a held block may take: each of its rows reaches
    only its own rows of the outputs, and those are not stored."""
    if HOLD_TMA and HOST_TMA:
        tl.static_assert(len(blocks.block_shape) == 2, "held blocks: a 2-D host descriptor")
        return (blocks, tl.cast(offset // stride_row, tl.int32),
                tl.cast(offset % stride_row, tl.int32))
    return block_source(array + offset, blocks, batch, head, num_rows, stride_row, HEAD_DIM,
                        BLOCK_ROWS, BLOCK_D, HOLD_TMA, HOST_TMA)


@triton.jit
def load_held_pair(first, first_offset, first_blocks, first_stride, second, second_offset,
                   second_blocks, second_stride, start, batch, head, num_rows,
                   HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                   HOLD_TMA: tl.constexpr, HOST_TMA: tl.constexpr, WANT_SECOND: tl.constexpr):
    """The two blocks of rows from ``start`` that a backward program holds for its whole
    loop (K and V, or Q and dO), each ``offset`` elements into its array and read once
    (``held_block_source``). Without ``WANT_SECOND`` (dV alone needs no V) the second is
    not read: the first stands in for it."""
    offs_row = tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    first_source = held_block_source(first, first_offset, first_blocks, batch, head, num_rows,
                                     first_stride, HEAD_DIM, BLOCK_ROWS, BLOCK_D, HOLD_TMA,
                                     HOST_TMA)
    if WANT_SECOND:
        second_source = held_block_source(second, second_offset, second_blocks, batch, head,
                                          num_rows, second_stride, HEAD_DIM, BLOCK_ROWS,
                                          BLOCK_D, HOLD_TMA, HOST_TMA)
    first_block = load_block(first_source, start, offs_row, offs_d, first_stride, num_rows,
                             HEAD_DIM, BLOCK_D, True, HOLD_TMA, HOST_TMA)
    second_block = first_block
    if WANT_SECOND:
        second_block = load_block(second_source, start, offs_row, offs_d, second_stride,
                                  num_rows, HEAD_DIM, BLOCK_D, True, HOLD_TMA, HOST_TMA)
    return first_block, second_block


@triton.jit
def load_block(source, start, offs_row, offs_d, stride_row, num_rows, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr,
               HOST_TMA: tl.constexpr):
    """The (rows, BLOCK_D) block of a ``block_source`` from row ``start``, 0 past the end
    (a held block through a 2-D host descriptor: the next rows, ``held_block_source``)."""
    if USE_TMA:
        if HOST_TMA:
            blocks, first, second = source
            if len(blocks.block_shape) == 2:
                block = blocks.load([first + start, second])
            else:
                block = blocks.load([first, start, second, 0]).reshape(
                    [offs_row.shape[0], BLOCK_D])
        else:
            block = source.load([start, 0])
    else:
        block = load_tile(source + tl.cast(start, tl.int64) * stride_row, offs_row, offs_d,
                          stride_row, num_rows - start, HEAD_DIM, BLOCK_D, CHECK_ROWS)
    return block


@triton.jit
def paged_source(base, table, page_size, num_pages, stride_page):
    """Where a paged slab's blocks come from (``load_paged_block``): ``base`` at the
    slab's head in page 0, and entry b's row of the block table."""
    return base, table, page_size, num_pages, stride_page


@triton.jit
def load_paged_block(source, start, offs_row, offs_d, stride_row, num_rows,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr,
                     WHOLE_PAGES: tl.constexpr):
    """Rows ``start ...`` of a paged slab (``paged_source``): row j lives in row
    ``j % page_size`` of page ``table[j // page_size]``. With ``WHOLE_PAGES`` (the page
    size a multiple of the block's rows) a block lies in one page: one lookup, then a
    plain tile; else a block may span pages of any size and each row is looked up. Page
    numbers are clamped into the pool (a table on the device cannot be checked before
    the launch); rows >= num_rows are not looked up and read as 0."""
    base, table, page_size, num_pages, stride_page = source
    if WHOLE_PAGES:  # (start < num_rows: a visited block starts inside the sequence)
        page = tl.minimum(tl.maximum(tl.load(table + start // page_size), 0), num_pages - 1)
        first = tl.cast(page, tl.int64) * stride_page + tl.cast(start % page_size,
                                                                tl.int64) * stride_row
        return load_tile(base + first, offs_row, offs_d, stride_row, num_rows - start,
                         HEAD_DIM, BLOCK_D, CHECK_ROWS)
    rows = start + offs_row
    in_range = rows < num_rows
    pages = tl.load(table + rows // page_size, mask=in_range, other=0)
    pages = tl.minimum(tl.maximum(pages, 0), num_pages - 1)
    offsets = tl.cast(pages, tl.int64) * stride_page + tl.cast(rows % page_size, tl.int64) * stride_row
    return load_rows(base, offsets, in_range, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def load_kv_block(source, start, offs_row, offs_d, stride_row, num_rows, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr,
                  HOST_TMA: tl.constexpr, PAGED_KV: tl.constexpr, WHOLE_PAGES: tl.constexpr):
    """A K or V block from wherever the forward's keys live: pages or one slab."""
    if PAGED_KV:
        block = load_paged_block(source, start, offs_row, offs_d, stride_row, num_rows, HEAD_DIM,
                                 BLOCK_D, CHECK_ROWS, WHOLE_PAGES)
    else:
        block = load_block(source, start, offs_row, offs_d, stride_row, num_rows, HEAD_DIM,
                           BLOCK_D, CHECK_ROWS, USE_TMA, HOST_TMA)
    return block


@triton.jit
def sequence_bounds(batch, CuSeqlensQ, CuSeqlensK, SequsedK, seqlen_q, seqlen_k, total_q,
                    total_k, IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr):
    """(first query token, first key token, seqlen_q, seqlen_k) of one batch entry.

    Varlen batches pack sequences back to back: entry b holds tokens
    [cu_seqlens[b], cu_seqlens[b + 1]), at most max_seqlen (the ``seqlen_*`` given) of
    them. Otherwise every entry starts at token 0. cu_seqlens on the device cannot be
    checked before the launch: they are clamped into [0, total] and each length into
    [0, max_seqlen], so that no value steers a program outside the packed arrays.
    ``seqused_k[b]`` (HAS_SEQUSED_K) keeps the first keys of entry b only, clamped the
    same way into [0, its seqlen_k]: the keys past it are never read.
    """
    if IS_VARLEN:
        q_start = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + batch), 0), total_q)
        k_start = tl.minimum(tl.maximum(tl.load(CuSeqlensK + batch), 0), total_k)
        q_end = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + batch + 1), q_start), total_q)
        k_end = tl.minimum(tl.maximum(tl.load(CuSeqlensK + batch + 1), k_start), total_k)
        seqlen_q = tl.minimum(q_end - q_start, seqlen_q)
        seqlen_k = tl.minimum(k_end - k_start, seqlen_k)
        q_start = tl.cast(q_start, tl.int64)
        k_start = tl.cast(k_start, tl.int64)
    else:
        q_start = 0
        k_start = 0
    if HAS_SEQUSED_K:
        seqlen_k = tl.minimum(tl.maximum(tl.load(SequsedK + batch), 0), seqlen_k)
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def visible(rows_q, cols_k, seqlen_q, seqlen_k, window_left, window_right,
            LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr):
    """Which (query row, key column) pairs take part in the softmax.

    Row i sees key j when j < seqlen_k and, with the diagonal bottom-right aligned
    (d = seqlen_k - seqlen_q), i + d - window_left <= j <= i + d + window_right.
    Causal is window_right = 0. ``rows_q`` and ``cols_k`` are broadcastable index
    arrays: the same helper serves (query, key) tiles and transposed (key, query) tiles.
    """
    mask = cols_k < seqlen_k
    if LIMIT_RIGHT:
        mask = mask & (cols_k <= rows_q + (seqlen_k - seqlen_q) + window_right)
    if LIMIT_LEFT:
        mask = mask & (cols_k >= rows_q + (seqlen_k - seqlen_q) - window_left)
    return mask


@triton.jit
def key_blocks(row_lo, row_hi, seqlen_q, seqlen_k, window_left, window_right,
               BLOCK_N: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr):
    """Key blocks the query rows [row_lo, row_hi) need.

    Returns (lo, full_lo, full_hi, hi): blocks in [full_lo, full_hi) are visible to
    every row and need no mask; those in [lo, full_lo) and [full_hi, hi) cross the
    window's edges or the end of the keys and are masked. Blocks outside [lo, hi) are
    skipped: a sliding window costs time in proportion to its size.
    """
    diagonal = seqlen_k - seqlen_q
    hi = seqlen_k
    full_hi = seqlen_k
    if LIMIT_RIGHT:
        hi = tl.minimum(hi, row_hi - 1 + diagonal + window_right + 1)
        full_hi = tl.minimum(full_hi, row_lo + diagonal + window_right + 1)
    lo = 0
    full_lo = 0
    if LIMIT_LEFT:
        lo = tl.maximum(row_lo + diagonal - window_left, 0)
        full_lo = tl.maximum(row_hi - 1 + diagonal - window_left, 0)
    hi = tl.where(row_lo < seqlen_q, tl.maximum(hi, 0), 0)  # varlen: past this sequence
    lo = lo // BLOCK_N * BLOCK_N
    full_lo = (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N
    split = full_lo < full_hi  # else no block is wholly visible: mask all from lo
    full_lo = tl.where(split, full_lo, lo)
    full_hi = tl.where(split, full_hi, lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def split_blocks(lo, full_lo, full_hi, hi, split, num_splits, seqlen_k, BLOCK_N: tl.constexpr):
    """The part of key_blocks' ranges in split ``split`` of ``num_splits`` equal slices of
    the keys (whole blocks each). Clamping keeps the order lo <= full_lo <= full_hi <= hi,
    so a block keeps its masked or unmasked kind."""
    blocks = (seqlen_k + BLOCK_N - 1) // BLOCK_N
    per_split = (blocks + num_splits - 1) // num_splits * BLOCK_N
    first = split * per_split
    last = first + per_split
    lo = tl.minimum(tl.maximum(lo, first), last)
    full_lo = tl.minimum(tl.maximum(full_lo, first), last)
    full_hi = tl.minimum(tl.maximum(full_hi, first), last)
    hi = tl.minimum(tl.maximum(hi, first), last)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_blocks(start_n, seqlen_q, seqlen_k, window_left, window_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr):
    """Query blocks that see a key block [start_n, start_n + BLOCK_N).

    Returns (lo, full_lo, full_hi, hi) as ``key_blocks``. Query rows past the end
    read as zeros with LSE +inf and contribute nothing, so the unmasked range may
    run to the last (partial) query block.
    """
    diagonal = seqlen_k - seqlen_q
    last_block_end = (seqlen_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    lo = 0
    full_lo = 0
    if LIMIT_RIGHT:  # key j is seen by rows i >= j - diagonal - window_right
        lo = tl.maximum(start_n - diagonal - window_right, 0)
        full_lo = tl.maximum(start_n + BLOCK_N - 1 - diagonal - window_right, 0)
    hi = seqlen_q
    full_hi = last_block_end
    if LIMIT_LEFT:  # ... and rows i <= j - diagonal + window_left
        hi = tl.minimum(seqlen_q, start_n + BLOCK_N - 1 - diagonal + window_left + 1)
        full_hi = tl.minimum(full_hi, start_n - diagonal + window_left + 1)
    hi = tl.where(start_n < seqlen_k, tl.maximum(hi, 0), 0)  # varlen: past this sequence
    lo = lo // BLOCK_M * BLOCK_M
    full_lo = (full_lo + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_hi = tl.maximum(full_hi, 0) // BLOCK_M * BLOCK_M
    split = full_lo < full_hi
    full_lo = tl.where(split, full_lo, lo)
    full_hi = tl.where(split, full_hi, lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def block_run(run: tl.constexpr, lo, full_lo, full_hi, hi):
    """[first, last) of run ``run`` (0, 1, 2) of a loop over the blocks ``key_blocks`` or
    ``query_blocks`` bound: masked, unmasked, masked. Each run is its own specialised loop."""
    if run == 0:
        return lo, full_lo
    elif run == 1:
        return full_lo, full_hi
    else:
        return full_hi, hi


@triton.jit
def tanh(x):
    """tanh from exp2, in fp32 (the same formula on the GPU and in the interpreter)."""
    e = tl.exp2(-2.0 * LOG2E * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def scores(qk, rows_q, cols_k, seqlen_q, seqlen_k, qk_scale, softcap_scale, softcap_out,
           bias_base, stride_bm, stride_bn, slope,
           HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Logits of a tile from its q·k products, in the kernel's unit (``score_unit``).

    z = softcap * tanh(scale * qk / softcap) (or scale * qk), + bias, - slope * |i + d - j|;
    returned as z * unit (the plan folds the unit into ``qk_scale`` and ``softcap_out``).
    Every option is a constexpr: the plain path is one multiply.
    """
    if HAS_SOFTCAP:
        s = tanh(qk * softcap_scale) * softcap_out
    else:
        s = qk * qk_scale
    if HAS_BIAS:
        bias = tl.load(bias_base + tl.cast(rows_q, tl.int64) * stride_bm + cols_k * stride_bn,
                       mask=(rows_q < seqlen_q) & (cols_k < seqlen_k), other=0.0)
        if bias.dtype == tl.float64:  # a finite fp64 bias stays finite: fp32's extremes
            bias = tl.where((bias < -FLOAT32_MAX) & (bias != float("-inf")), -FLOAT32_MAX, bias)
            bias = tl.where((bias > FLOAT32_MAX) & (bias != float("inf")), FLOAT32_MAX, bias)
        s += bias.to(tl.float32)  # natural unit: no scaling that could overflow
    if HAS_ALIBI:
        distance = tl.abs(rows_q + (seqlen_k - seqlen_q) - cols_k).to(tl.float32)
        if HAS_BIAS:
            s -= slope * distance
        else:
            s -= (slope * LOG2E) * distance
    return s


@triton.jit
def softcap_slope(qk, softcap_scale):
    """d(softcap * tanh(scale * qk / softcap)) / d(scale * qk) = 1 - tanh^2."""
    t = tanh(qk * softcap_scale)
    return 1.0 - t * t


@triton.jit
def dropout_keep(seed_lo, seed_hi, batch, head, rows_q, cols_k, dropout_p):
    """The keep mask: Philox keyed by the seed, counter (key, query row, head, batch).

    A pure function of (seed, batch, head, i, j), never of the tiling, so torch and
    jax, GPU and CPU, every block size draw the same mask.
    """
    c0 = (cols_k + 0 * rows_q).to(tl.uint32)
    c1 = (rows_q + 0 * cols_k).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tl.cast(head, tl.uint32)
    c3 = tl.zeros_like(c0) + tl.cast(batch, tl.uint32)
    k0 = tl.zeros_like(c0) + seed_lo
    k1 = tl.zeros_like(c0) + seed_hi
    r0, _, _, _ = tl.random.philox_impl(c0, c1, c2, c3, k0, k1)
    return tl.random.uint_to_uniform_float(r0) >= dropout_p


@triton.jit
def load_seed(Seed, batch, head, HAS_DROPOUT: tl.constexpr):
    """The dropout key and the global (batch, head) of this program's rows.

    ``Seed`` holds four int32: the two 32-bit halves of the seed, then the global index
    of the launch's first batch entry and first head. Those are 0 unless a sharded
    caller runs the kernel on a slice of the batch or heads; with them a shard draws
    exactly the rows of the unsharded mask. Without dropout nothing is read.
    """
    seed_lo = 0
    seed_hi = 0
    mask_batch = batch
    mask_head = head
    if HAS_DROPOUT:
        seed_lo = tl.load(Seed).to(tl.uint32, bitcast=True)
        seed_hi = tl.load(Seed + 1).to(tl.uint32, bitcast=True)
        mask_batch = batch + tl.load(Seed + 2)
        mask_head = head + tl.load(Seed + 3)
    return seed_lo, seed_hi, mask_batch, mask_head


@triton.jit
def exp_unit(x, NATURAL: tl.constexpr):
    """exp of a logit in the kernel's unit: exp2 for base 2, exp for natural log."""
    if NATURAL:
        return tl.exp(x)
    return tl.exp2(x)


@triton.jit
def softmax_step(m_i, l_i, s, qk_scale, MASKED: tl.constexpr, FOLD_SCALE: tl.constexpr,
                 NATURAL: tl.constexpr):
    """One online-softmax step over a block of scores ``s`` (base 2, or natural log with
    ``NATURAL``: a bias).

    With ``FOLD_SCALE``, ``s`` is the raw q·k and ``qk_scale`` (> 0, so it commutes with
    the max) is applied inside exp2's argument, one FMA an element where scaling first
    took a multiply and a subtract. Returns the new running max, the new running sum,
    the block's unnormalised probabilities and the factor that rescales what was
    accumulated before.
    """
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED or NATURAL:
        # A row may have seen no key yet (all -inf, from a mask or a -inf bias):
        # exp(-inf - -inf) would be NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    if FOLD_SCALE:
        p = tl.exp2(s * qk_scale - m_ref[:, None])
    else:
        p = exp_unit(s - m_ref[:, None], NATURAL)
    alpha = exp_unit(m_i - m_ref, NATURAL)
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, p, alpha


@triton.jit
def final_lse(m_i, l_i, NATURAL: tl.constexpr):
    """(lse, lse_lo) of rows with running max ``m_i`` and sum ``l_i``: the natural-log
    LSE as fp32 holds it, and (with ``NATURAL``) what it lost, ``m + log l - lse``,
    so that ``exp((s - lse) - lse_lo)`` is the probability even where ``|m|`` is so
    large that ``lse == m``. A row that saw no key (l == 0) gets -inf; a NaN stays NaN."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if NATURAL:
        log_l = tl.log(l_safe)
        lse = m_i + log_l
        lse_lo = tl.where(empty, 0.0, (m_i - lse) + log_l)
    else:
        lse = (m_i + tl.log2(l_safe)) * LN2
        lse_lo = tl.zeros_like(lse)
    return tl.where(empty, float("-inf"), lse), lse_lo


@triton.jit
def load_row_stats(lse_base, lse_lo_base, delta_base, offs_row, num_rows, NATURAL: tl.constexpr):
    """Per-row (LSE, its low part, D = rowsum(dO * O)) for the backward, the LSE in the
    kernel's unit (base 2, or natural with ``NATURAL``; only then is ``lse_lo`` read).

    A row that saw no key has LSE -inf; it becomes +inf here so that its
    probabilities exp(s - lse) are 0 rather than inf. Rows past the end read
    the same way and contribute nothing.
    """
    in_range = offs_row < num_rows
    lse = tl.load(lse_base + offs_row, mask=in_range, other=float("-inf"))
    if NATURAL:  # (a row that saw no key has lse_lo 0: final_lse)
        lse_lo = tl.load(lse_lo_base + offs_row, mask=in_range, other=0.0)
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
    else:
        lse_lo = tl.zeros_like(lse)
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(delta_base + offs_row, mask=in_range, other=0.0)
    return lse, lse_lo, delta


@triton.jit
def probabilities(s, lse, lse_lo, NATURAL: tl.constexpr):
    """P = exp(s - LSE) recomputed in the backward (``lse``, ``lse_lo`` broadcast to s)."""
    if NATURAL:
        return tl.exp((s - lse) - lse_lo)
    return tl.exp2(s - lse)
