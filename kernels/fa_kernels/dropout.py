"""The dropout keep mask on its own, for tests and debugging (flash-attn's
``return_attn_probs``): exactly the mask the attention kernels draw."""
import triton
import triton.language as tl

from .helpers import dropout_keep, kernel, load_seed


@kernel
def dropout_mask(
    Seed,
    dropout_p, seqlen_q, seqlen_k,
    stride_mb, stride_mh, stride_mm,
    Mask,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    seed_lo, seed_hi, mask_batch, mask_head = load_seed(Seed, batch, head, True)
    rows = start_m + tl.arange(0, BLOCK_M)
    base = (Mask + tl.cast(batch, tl.int64) * stride_mb + tl.cast(head, tl.int64) * stride_mh
            + tl.cast(rows[:, None], tl.int64) * stride_mm)
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed_lo, seed_hi, mask_batch, mask_head, rows[:, None], cols[None, :], dropout_p)
        tl.store(base + cols[None, :], keep.to(tl.int8),
                 mask=(rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))
