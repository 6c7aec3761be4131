"""The Hopper forward in Gluon: one block's softmax overlapped with the next block's q·k.

Triton's language keeps a matmul in flight only as a loop-carried accumulator, so the
plain forward (forward.attention_forward) waits for each ``q·k`` before its softmax and
for each ``p·v`` before the next ``q·k``. Here the tensor cores are driven by hand
(FlashAttention-3's schedule, written from its paper):

- a load partition (one warp) streams K and V blocks through TMA into a ring of
  ``NUM_STAGES`` shared-memory slots, each slot with a ready and an empty mbarrier;
- the compute partition (two warpgroups, 64 query rows each) issues block j's ``q·k``,
  rescales the running sum while it runs, issues block j-1's ``p·v`` (P from registers),
  waits for the ``q·k`` only, and runs block j's online-softmax step while the ``p·v``
  runs on the tensor cores; then it waits for the ``p·v``. What ptxas makes of this is
  checked offline (``fa_kernels.offline``: no serialised wgmma, exp2s beside the
  ``p·v``), and the loop's comments say what each of those needs;
- with ``PING_PONG`` the two warpgroups are partitions of their own that take the
  tensor cores in turns (FA3's ping-pong): each issues a step's matmuls only after the
  other has issued its, so one's softmax runs while the other's matmuls do, where two
  warpgroups in step would both leave the tensor cores idle for their softmax.

The arithmetic is attention_forward's plain path (FOLD_SCALE: base 2, the scale inside
exp2's argument; windows, the causal diagonal among them, masked by helpers.visible; a
row that sees no key gets output 0 and LSE -inf). What it lacks (bias, ALiBi, softcap,
dropout, varlen, paged K/V, split-KV, fp32) stays with the Triton kernel: the plan
chooses. Gluon has no interpreter: on the CPU the plan never takes this kernel.

Q, K and V are read through tensor descriptors made on the host over the (batch, seqlen,
heads, head_dim) arrays, a block (1, rows, 1, head_dim): rows past the end of a sequence
read as zeros. O and the LSE are written through pointers, once a program.
"""
import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .helpers import LN2, key_blocks, visible

# The one name that differs between the Triton releases supported (3.6-3.9): the TMA load
# is async_copy_global_to_shared up to 3.7, async_load from 3.8 (3.9 keeps the old name
# only to raise).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@functools.lru_cache(maxsize=None)
def shared_layout(block_shape: tuple, dtype: str):
    """The shared-memory layout of a host descriptor's block (``dtype`` by name): Gluon's
    default for the block, the widest swizzle it allows. The launcher's descriptors and
    the offline compile's signature both take it from here, so they agree."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), getattr(gl, dtype))

@gluon.jit
def _key_block_range(row_lo, seqlen_q, seqlen_k, window_left, window_right,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LIMIT_LEFT: gl.constexpr,
                     LIMIT_RIGHT: gl.constexpr):
    """(first, count, full_lo, full_hi): the key blocks rows [row_lo, row_lo + BLOCK_M) see,
    in helpers.key_blocks' bounds, as a first block and a count of at least one (a program
    whose rows see no key still runs one masked block, so that both partitions run the
    same loop), and the keys [full_lo, full_hi) every row sees (blocks inside need no
    mask)."""
    lo, full_lo, full_hi, hi = key_blocks(row_lo, row_lo + BLOCK_M, seqlen_q, seqlen_k,
                                          window_left, window_right, BLOCK_N, LIMIT_LEFT,
                                          LIMIT_RIGHT)
    first = lo // BLOCK_N
    count = gl.maximum(gl.cdiv(hi, BLOCK_N) - first, 1)
    return first, count, full_lo, full_hi


@gluon.jit
def _load_partition(values, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The load warp: Q once, then K and V block by block into the ring of slots."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready,
     v_empty, batch, head, head_k, row_lo, first, count) = values
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    _tma_load(q_desc, [batch, row_lo, head, 0], q_ready, q_smem)
    for i in range(count):
        slot = i % NUM_STAGES
        phase = (i // NUM_STAGES) & 1
        start_n = (first + i) * BLOCK_N
        # A fresh mbarrier counts as having completed the phase before 0: the first pass
        # through the ring does not wait.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [batch, start_n, head_k, 0], k_ready.index(slot),
                       k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        _tma_load(v_desc, [batch, start_n, head_k, 0], v_ready.index(slot),
                       v_smem.index(slot))


@gluon.jit
def _issue_scores(q2d, k_smem, k_ready, i, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Start q·kᵀ of the i-th block once its K has landed (asynchronous)."""
    slot = i % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (i // NUM_STAGES) & 1)
    k2d = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q2d, k2d.permute((1, 0)), zeros, use_acc=False, is_async=True)


@gluon.jit
def _issue_values(p, v_smem, v_ready, acc, i, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  NUM_STAGES: gl.constexpr):
    """Start ``acc + p·v`` of the i-th block once its V has landed (asynchronous; P, the
    block's probabilities, from registers)."""
    slot = i % NUM_STAGES
    mbarrier.wait(v_ready.index(slot), (i // NUM_STAGES) & 1)
    v2d = v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    return warpgroup_mma(p, v2d, acc, is_async=True)


@gluon.jit
def _softmax_step(s, m_i, l_i, start_n, row_lo, seqlen_q, seqlen_k, qk_scale, window_left,
                  window_right, MASKED: gl.constexpr, s_layout: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LIMIT_LEFT: gl.constexpr,
                  LIMIT_RIGHT: gl.constexpr):
    """helpers.softmax_step with FOLD_SCALE (base 2, the scale inside exp2's argument) on
    the raw scores of the key block at ``start_n``, masked with ``MASKED``: returns the
    new max, sum, the block's probabilities and the factor for what came before."""
    if MASKED:  # a window edge (the causal diagonal is one) or the end of the keys cuts it
        rows = row_lo + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        cols = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        s = gl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                             window_right, LIMIT_LEFT, LIMIT_RIGHT), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row may have seen no key yet: exp2(-inf - -inf) would be NaN.
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    alpha = gl.exp2(m_i - m_ref)
    l_new = l_i * alpha + gl.sum(p, 1)
    return m_new, l_new, p, alpha


@gluon.jit
def _take_turn(turn, section, WARPGROUP: gl.constexpr, PING_PONG: gl.constexpr):
    """With PING_PONG, wait until the other warpgroup has issued its matmuls of the
    section before (warpgroup 0 opens: a fresh mbarrier counts as having completed the
    phase before 0)."""
    if PING_PONG:
        mbarrier.wait(turn.index(WARPGROUP), (section & 1) ^ (1 - WARPGROUP))


@gluon.jit
def _pass_turn(turn, WARPGROUP: gl.constexpr, PING_PONG: gl.constexpr):
    """With PING_PONG, let the other warpgroup issue its matmuls."""
    if PING_PONG:
        mbarrier.arrive(turn.index(1 - WARPGROUP), count=1)


@gluon.jit
def _compute_partition(values, HEAD_DIM: gl.constexpr, TILE_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, LIMIT_LEFT: gl.constexpr,
                       LIMIT_RIGHT: gl.constexpr, PING_PONG: gl.constexpr,
                       WARPGROUP: gl.constexpr):
    """The rows of the program's query tile that this partition computes: all of them,
    or with PING_PONG warpgroup ``WARPGROUP``'s half. Each issue of matmuls is a section
    (block 0's q·k, then one a step, then the last p·v) that PING_PONG takes in turns.
    ``values``: the kernel's run-time values every compute partition takes, in one tuple
    (the constexprs stay apart: inside a tuple they would not be constant)."""
    (Out, LSE, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn,
     qk_scale, window_left, window_right, seqlen_q, seqlen_k, stride_ob, stride_om, stride_oh,
     stride_lb, stride_lh, batch, head, tile_lo, first, count, full_lo, full_hi) = values
    # Each warp owns 16 rows; a warpgroup's four warps issue one wgmma of 64 rows.
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = TILE_M // 2 if PING_PONG else TILE_M
    row_lo = tile_lo + WARPGROUP * BLOCK_M
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    mbarrier.wait(q_ready, 0)
    q2d = q_smem.reshape([TILE_M, HEAD_DIM])
    if PING_PONG:  # (64-row halves: whole swizzle periods of the layout)
        q2d = q2d.slice(WARPGROUP * BLOCK_M, BLOCK_M)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    # Block 0's scores and probabilities (nothing to overlap with yet).
    _take_turn(turn, 0, WARPGROUP, PING_PONG)
    s_token = _issue_scores(q2d, k_smem, k_ready, 0, s_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                            NUM_STAGES)
    _pass_turn(turn, WARPGROUP, PING_PONG)
    s = warpgroup_mma_wait(0, deps=(s_token, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i, l_i, p, alpha = _softmax_step(
        s, m_i, l_i, first * BLOCK_N, row_lo, seqlen_q, seqlen_k, qk_scale, window_left,
        window_right, True, s_layout, BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
    # Step i: block i's q·k issued, the sum rescaled (alpha of block i-1) while it runs,
    # block i-1's p·v issued; block i's softmax once its q·k is done, while the p·v runs;
    # then the p·v waited for. Both matmuls end inside the step: one left in flight across
    # the loop's back edge has its accumulator copied there, and ptxas then serialises every
    # wgmma (C7514). The softmax is whole inside each arm of the masked/unmasked branch:
    # ptxas moves a wait up to the top of its basic block, so the p·v's wait must open a
    # block of its own after the exp2s, or it lands before them and nothing overlaps.
    for i in range(1, count):
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        _take_turn(turn, i, WARPGROUP, PING_PONG)
        s_token = _issue_scores(q2d, k_smem, k_ready, i, s_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                                NUM_STAGES)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        acc = _issue_values(p_op, v_smem, v_ready, acc, i - 1, BLOCK_N, HEAD_DIM, NUM_STAGES)
        _pass_turn(turn, WARPGROUP, PING_PONG)
        s = warpgroup_mma_wait(1, deps=(s_token, ))  # block i's q·k (the older of the two)
        mbarrier.arrive(k_empty.index(i % NUM_STAGES), count=1)
        start_n = (first + i) * BLOCK_N
        if (start_n < full_lo) | (start_n + BLOCK_N > full_hi):
            m_i, l_i, p, alpha = _softmax_step(
                s, m_i, l_i, start_n, row_lo, seqlen_q, seqlen_k, qk_scale, window_left,
                window_right, True, s_layout, BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
        else:
            m_i, l_i, p, alpha = _softmax_step(
                s, m_i, l_i, start_n, row_lo, seqlen_q, seqlen_k, qk_scale, window_left,
                window_right, False, s_layout, BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
        # (p_op is the p·v's operand in registers: kept alive until that matmul is done)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index((i - 1) % NUM_STAGES), count=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    _take_turn(turn, count, WARPGROUP, PING_PONG)
    acc = _issue_values(p_op, v_smem, v_ready, acc, count - 1, BLOCK_N, HEAD_DIM, NUM_STAGES)
    _pass_turn(turn, WARPGROUP, PING_PONG)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))

    # O = acc / l, LSE = (m + log2 l) ln 2 (helpers.final_lse); a row that saw no key
    # gets 0 and -inf.
    l_o = gl.convert_layout(l_i, o_rows)
    empty = l_o == 0.0
    l_safe = gl.where(empty, 1.0, l_o)
    out = acc / l_safe[:, None]
    lse = gl.where(empty, float("-inf"), (gl.convert_layout(m_i, o_rows) + gl.log2(l_safe)) * LN2)
    batch64 = batch.to(gl.int64)
    head64 = head.to(gl.int64)
    rows = row_lo + gl.arange(0, BLOCK_M, o_rows)
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
    o_base = Out + batch64 * stride_ob + head64 * stride_oh
    gl.store(o_base + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], out.to(dtype),
             mask=rows[:, None] < seqlen_q)
    gl.store(LSE + batch64 * stride_lb + head64 * stride_lh + rows, lse, mask=rows < seqlen_q)


@gluon.jit
def attention_forward_gluon(
    Q, K, V, QBlocks, KBlocks, VBlocks,
    qk_scale, window_left, window_right, seqlen_q, seqlen_k,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    Out, LSE, LSELo,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    GROUP_SIZE: gl.constexpr, LIMIT_LEFT: gl.constexpr, LIMIT_RIGHT: gl.constexpr,
    NUM_STAGES: gl.constexpr, PING_PONG: gl.constexpr, COMPUTE_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):
    """attention_forward's plain path (scores q·k only: no softcap, bias, ALiBi, dropout,
    varlen, paging or split; any window) for 16-bit Q, K, V read through host descriptors
    (``*Blocks``: Q's block is the program's BLOCK_M rows, K's and V's BLOCK_N). One
    program per (query block, query head, batch entry). ``LSELo`` (the LSE's low part,
    written only with a bias) is not written. BLOCK_M is 16 rows a warp of ``num_warps``
    (the compute partition's; the load warp comes on top); with ``PING_PONG``, 16 rows a
    warp of two warpgroups of ``num_warps`` = 4, the second a partition of
    ``COMPUTE_REGISTERS`` registers a thread (the load warp's: ``LOAD_REGISTERS``)."""
    row_lo = gl.program_id(0) * BLOCK_M
    head = gl.program_id(1)
    batch = gl.program_id(2)
    head_k = head // GROUP_SIZE  # GQA: a group of query heads shares K/V
    first, count, full_lo, full_hi = _key_block_range(row_lo, seqlen_q, seqlen_k, window_left,
                                                      window_right, BLOCK_M, BLOCK_N,
                                                      LIMIT_LEFT, LIMIT_RIGHT)

    q_smem = gl.allocate_shared_memory(QBlocks.dtype, QBlocks.block_type.shape, QBlocks.layout)
    k_smem = gl.allocate_shared_memory(KBlocks.dtype, [NUM_STAGES] + KBlocks.block_type.shape,
                                       KBlocks.layout)
    v_smem = gl.allocate_shared_memory(VBlocks.dtype, [NUM_STAGES] + VBlocks.block_type.shape,
                                       VBlocks.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    consumers: gl.constexpr = 2 if PING_PONG else 1  # (each frees every slot)
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=consumers)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=consumers)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    values = (Out, LSE, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
              turn, qk_scale, window_left, window_right, seqlen_q, seqlen_k, stride_ob,
              stride_om, stride_oh, stride_lb, stride_lh, batch, head, row_lo, first, count,
              full_lo, full_hi)
    load = (QBlocks, KBlocks, VBlocks, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty,
            v_ready, v_empty, batch, head, head_k, row_lo, first, count)
    if PING_PONG:  # (the kernel's own warps: warpgroup 0)
        gl.warp_specialize([(_compute_partition, (values, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                                                  LIMIT_LEFT, LIMIT_RIGHT, PING_PONG, 0)),
                            (_compute_partition, (values, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                                                  LIMIT_LEFT, LIMIT_RIGHT, PING_PONG, 1)),
                            (_load_partition, (load, BLOCK_N, NUM_STAGES))],
                           [4, 1], [COMPUTE_REGISTERS, LOAD_REGISTERS])
    else:
        gl.warp_specialize([(_compute_partition, (values, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                                                  LIMIT_LEFT, LIMIT_RIGHT, PING_PONG, 0)),
                            (_load_partition, (load, BLOCK_N, NUM_STAGES))],
                           [1], [LOAD_REGISTERS])
