"""flash-attn's ``flash_attn_with_kvcache`` on the shared kernels.

New k/v are written into the cache in place at ``cache_seqlens`` (rotated first when
rotary tables are given), q is rotated at its positions, and the attention reads each
entry's filled rows only: the kernels' ``seqused_k`` (``cache_seqlens`` plus the new
rows), so the unfilled tail of the cache is never read.
"""
from __future__ import annotations

import torch

from fa_kernels import plan as fa_plan

from ._launch import dtype_name
from .ops import _attention


def rotary(x, cos, sin, positions, interleaved: bool):
    """``x`` (B, S, H, D) with its first ``2 * cos.shape[1]`` channels rotated by the
    angles of ``positions`` (B, S) (clamped into the tables), computed in fp32: pairs
    (0, 1), (2, 3), ... when ``interleaved`` (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX)."""
    half = cos.shape[1]
    rows = positions.clamp(0, cos.shape[0] - 1).long()
    c, s = (t.float()[rows][:, :, None, :] for t in (cos, sin))
    part = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., :half], part[..., half:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([out.to(x.dtype), x[..., 2 * half:]], dim=-1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn's incremental-decoding call (same names, order, defaults, returns).

    q ``(batch, seqlen_q, heads_q, head_dim)``; k_cache, v_cache ``(batch_cache,
    seqlen_cache, heads_k, head_dim)``; k, v ``(batch, seqlen_new, heads_k, head_dim)``,
    written **in place** into the cache at rows ``cache_seqlens[b] ...`` of entry
    ``cache_batch_idx[b]`` (default b). ``cache_seqlens``: an int or a (batch,) int32
    tensor, the filled rows before the new ones (None: every cache entry is full).
    ``rotary_cos``/``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)`` rotate the new k at
    their positions and q at ``cache_seqlens + i`` (causal or a window) or at
    ``cache_seqlens`` (otherwise). Causal and windows align bottom-right to the filled
    rows. ``cache_leftpad`` (batch,) int32: entry b's keys start at that row (positions
    stay absolute for rotary). ``block_table`` ``(batch, max_num_blocks_per_seq)`` int32:
    k_cache and v_cache are a page pool ``(num_blocks, page_block_size, heads_k,
    head_dim)``, any page size; row t of entry b is row ``t % page_block_size`` of page
    ``block_table[b, t // page_block_size]`` (not with cache_batch_idx or cache_leftpad,
    as in flash-attn); lengths past what the table addresses raise
    ``fa_kernels.plan.CacheOverflowError`` (a ValueError and a RuntimeError), lengths on
    the GPU included (one copy to the host, as flash-attn; not while a CUDA graph is
    captured). ``num_splits`` is accepted; the plan chooses the key splits.
    Returns ``out``, or ``(out, softmax_lse)`` with ``return_softmax_lse``.
    """
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_batch_idx=cache_batch_idx,
                 cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 block_table=block_table)
    seqlens_given = isinstance(cache_seqlens, torch.Tensor)
    if seqlens_given:
        named["cache_seqlens"] = cache_seqlens
    for name, x in named.items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    call = fa_plan.check_kvcache(
        {n: (tuple(x.shape), dtype_name(x.dtype)) for n, x in named.items() if x is not None},
        cache_seqlens=None if seqlens_given else cache_seqlens, causal=causal,
        window_size=window_size, num_splits=num_splits, return_softmax_lse=return_softmax_lse)
    device = q.device
    if seqlens_given:
        seqlens = cache_seqlens.to(device)
        # On the host: checked. On the GPU: clamped below, and with a block table also
        # checked as flash-attn does (one copy to the host), except while a CUDA graph is
        # captured (no copy can happen there; the clamp keeps the pages in bounds).
        if not cache_seqlens.is_cuda or (block_table is not None
                                         and not torch.cuda.is_current_stream_capturing()):
            fa_plan.check_cache_seqlens(cache_seqlens.tolist(), call)
    else:
        filled = call.seqlen_cache if call.cache_seqlens is None else call.cache_seqlens
        seqlens = torch.full((call.batch,), filled, dtype=torch.int32, device=device)
    if block_table is not None and not block_table.is_cuda:
        fa_plan.check_block_table(block_table.tolist(), k_cache.shape[0])
    if cache_batch_idx is not None and not cache_batch_idx.is_cuda:
        fa_plan.check_cache_batch_idx(cache_batch_idx.tolist(), k_cache.shape[0])
    if cache_leftpad is not None and not cache_leftpad.is_cuda:
        host_seqlens = None  # the lengths where the host has them
        if not seqlens_given:
            host_seqlens = seqlens.tolist() if call.cache_seqlens is None else [
                call.cache_seqlens] * call.batch
        elif not cache_seqlens.is_cuda:
            host_seqlens = cache_seqlens.tolist()
        fa_plan.check_cache_leftpad(cache_leftpad.tolist(), host_seqlens)
    # Device values are clamped: the new rows always land inside the cache. (Read-only
    # decode skips it: the kernels clamp seqused_k, and a decode step is short.)
    plain = not (call.seqlen_new or call.rotary_dim or cache_leftpad is not None)
    start = seqlens if plain else seqlens.clamp(0, call.seqlen_cache - call.seqlen_new)
    rows = None  # (batch, 1): each entry's cache row, where needed
    if cache_batch_idx is not None:
        rows = cache_batch_idx.to(device).long().clamp(0, k_cache.shape[0] - 1)[:, None]
    elif not plain:
        rows = torch.arange(call.batch, device=device)[:, None]
    if call.seqlen_new:
        offsets = torch.arange(call.seqlen_new, device=device)
        where = start[:, None].long() + offsets
        if call.rotary_dim:
            k = rotary(k, rotary_cos, rotary_sin, where, rotary_interleaved)
        if block_table is None:
            entries, where_in = rows, where
        else:  # row t of entry b: row t % page_size of page block_table[b, t // page_size]
            page_size = k_cache.shape[1]
            entries = block_table.to(device).long().gather(1, where // page_size)
            entries, where_in = entries.clamp(0, k_cache.shape[0] - 1), where % page_size
        with torch.no_grad():
            k_cache[entries, where_in] = k
            v_cache[entries, where_in] = v
    if call.rotary_dim:
        rows_q = torch.arange(q.shape[1], device=device) if call.rotate_q_per_row else 0
        q = rotary(q, rotary_cos, rotary_sin, start[:, None].long() + rows_q, rotary_interleaved)
    used = start + call.seqlen_new if call.seqlen_new else start
    if cache_leftpad is not None:
        # Entry b's keys start at row cache_leftpad[b]: its rows from there are gathered to
        # the front (a copy), so the kernels' row 0, the diagonal and ALiBi start there.
        pad = torch.minimum(cache_leftpad.to(device).clamp(min=0), start)
        index = (pad[:, None].long() + torch.arange(call.seqlen_cache, device=device)).clamp(
            max=call.seqlen_cache - 1)
        keys, values = k_cache[rows, index], v_cache[rows, index]
        used = used - pad
    elif cache_batch_idx is not None:
        keys, values = k_cache[rows[:, 0]], v_cache[rows[:, 0]]
    else:
        keys, values = k_cache, v_cache
    used = used.to(torch.int32)
    out, lse = _attention(q, keys, values, None, None, 0, 0, causal=causal,
                          softmax_scale=softmax_scale, bias=None, alibi_slopes=alibi_slopes,
                          window_size=window_size, softcap=softcap, dropout_p=0.0,
                          dropout_seed=None, return_lse=True, seqused_k=used,
                          block_table=None if block_table is None else block_table.to(device))
    return (out, lse) if call.return_lse else out
