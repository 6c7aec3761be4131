"""``fa_jax.attention_with_kvcache``: flash-attn's ``flash_attn_with_kvcache`` for jax.

Functional: the new k/v are scattered into the cache at ``cache_seqlens`` and the
updated caches are returned; under ``jit`` with the caches donated, XLA writes them in
place. The attention reads each entry's filled rows only (the kernels' ``seqused_k``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa_kernels import plan as fa_plan

from .ops import attention


def rotary(x, cos, sin, positions, interleaved: bool):
    """``x`` (B, S, H, D) with its first ``2 * cos.shape[1]`` channels rotated by the
    angles of ``positions`` (B, S) (clamped into the tables), computed in fp32: pairs
    (0, 1), (2, 3), ... when ``interleaved`` (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX)."""
    half = cos.shape[1]
    rows = jnp.clip(positions, 0, cos.shape[0] - 1)
    c, s = (jnp.asarray(t, jnp.float32)[rows][:, :, None, :] for t in (cos, sin))
    part = x[..., :2 * half].astype(jnp.float32)
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(part.shape)
    else:
        x1, x2 = part[..., :half], part[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    return jnp.concatenate([out.astype(x.dtype), x[..., 2 * half:]], axis=-1)


def _concrete(x) -> bool:
    return x is not None and not isinstance(x, jax.core.Tracer)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None,
                           rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0,
                           rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                           return_softmax_lse=False):
    """``fa_torch.flash_attn_with_kvcache``'s semantics, functional: returns
    ``(out, k_cache, v_cache)``, or ``(out, softmax_lse, k_cache, v_cache)`` with
    ``return_softmax_lse``; the caches hold the new rows. Same shapes and options as
    there (``cache_seqlens`` an int or a (batch,) int32 array, possibly traced: traced
    values are clamped so the new rows land inside the cache). ``block_table`` ``(batch,
    pages_per_entry)`` int32: the caches are a page pool ``(num_pages, page_size, heads_k,
    head_dim)``, any page size (traced page numbers are clamped into the pool)."""
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_batch_idx=cache_batch_idx,
                 cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 block_table=block_table)
    seqlens_given = hasattr(cache_seqlens, "shape")
    if seqlens_given:
        named["cache_seqlens"] = cache_seqlens
    for name, x in named.items():
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be a jax or numpy array; got {type(x).__name__}")
    call = fa_plan.check_kvcache(
        {n: (tuple(x.shape), jnp.dtype(x.dtype).name) for n, x in named.items()
         if x is not None},
        cache_seqlens=None if seqlens_given else cache_seqlens, causal=causal,
        window_size=window_size, num_splits=num_splits, return_softmax_lse=return_softmax_lse)
    if seqlens_given:
        seqlens = jnp.asarray(cache_seqlens)
        if _concrete(cache_seqlens):  # checked (traced: clamped below)
            fa_plan.check_cache_seqlens(np.asarray(cache_seqlens).tolist(), call)
    else:
        filled = call.seqlen_cache if call.cache_seqlens is None else call.cache_seqlens
        seqlens = jnp.full((call.batch,), filled, jnp.int32)
    if _concrete(block_table):
        fa_plan.check_block_table(np.asarray(block_table).tolist(), k_cache.shape[0])
    if _concrete(cache_batch_idx):
        fa_plan.check_cache_batch_idx(np.asarray(cache_batch_idx).tolist(), k_cache.shape[0])
    if _concrete(cache_leftpad):
        fa_plan.check_cache_leftpad(np.asarray(cache_leftpad).tolist(),
                                    np.asarray(seqlens).tolist() if _concrete(seqlens) else None)
    k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)
    start = jnp.clip(seqlens, 0, call.seqlen_cache - call.seqlen_new)
    rows = (jnp.arange(call.batch) if cache_batch_idx is None
            else jnp.clip(jnp.asarray(cache_batch_idx), 0, k_cache.shape[0] - 1))
    if call.seqlen_new:
        where = start[:, None] + jnp.arange(call.seqlen_new)
        k = jnp.asarray(k)
        if call.rotary_dim:
            k = rotary(k, rotary_cos, rotary_sin, where, rotary_interleaved)
        entries, where_in = rows[:, None], where
        if block_table is not None:  # row t: row t % page_size of page block_table[b, t // page_size]
            page_size = k_cache.shape[1]
            pages = jnp.take_along_axis(jnp.asarray(block_table), where // page_size, axis=1)
            entries, where_in = jnp.clip(pages, 0, k_cache.shape[0] - 1), where % page_size
        k_cache = k_cache.at[entries, where_in].set(k)
        v_cache = v_cache.at[entries, where_in].set(jnp.asarray(v))
    q = jnp.asarray(q)
    if call.rotary_dim:
        rows_q = jnp.arange(q.shape[1]) if call.rotate_q_per_row else jnp.zeros((1,), jnp.int32)
        q = rotary(q, rotary_cos, rotary_sin, start[:, None] + rows_q, rotary_interleaved)
    keys, values, used = k_cache, v_cache, start + call.seqlen_new
    if cache_leftpad is not None:  # the rows from cache_leftpad[b] on, gathered to the front
        pad = jnp.minimum(jnp.maximum(jnp.asarray(cache_leftpad), 0), start)
        index = jnp.minimum(pad[:, None] + jnp.arange(call.seqlen_cache), call.seqlen_cache - 1)
        keys, values = (cache[rows[:, None], index] for cache in (k_cache, v_cache))
        used = used - pad
    elif cache_batch_idx is not None:
        keys, values = (cache[rows] for cache in (k_cache, v_cache))
    out, lse = attention(q, keys, values, causal=causal, softmax_scale=softmax_scale,
                         alibi_slopes=alibi_slopes, window_size=window_size, softcap=softcap,
                         return_lse=True, seqused_k=used.astype(jnp.int32),
                         block_table=None if block_table is None else jnp.asarray(block_table))
    return (out, lse, k_cache, v_cache) if call.return_lse else (out, k_cache, v_cache)
