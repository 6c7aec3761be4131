"""``fa_jax.attention_with_kvcache``: flash-attn's ``flash_attn_with_kvcache`` for jax.

Functional: the new k/v are scattered into the cache at ``cache_seqlens`` and the
updated caches are returned; under ``jit`` with the caches donated, XLA writes them in
place. The attention reads each entry's filled rows only (the kernels' ``seqused_k``).
"""
from __future__ import annotations

import numbers

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
    values are clamped so the new rows land inside the cache). ``cache_leftpad`` and
    ``block_table`` are not supported yet."""
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported yet")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not supported yet")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) \
            or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the plan chooses); got "
                         f"{num_splits!r}")
    return_softmax_lse = fa_plan.check_bool("return_softmax_lse", return_softmax_lse)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                    ("cache_batch_idx", cache_batch_idx)):
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be a jax or numpy array; got {type(x).__name__}")
    seqlens_array = hasattr(cache_seqlens, "shape")
    if not (cache_seqlens is None or seqlens_array or (
            isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool))):
        raise TypeError(f"cache_seqlens must be None, an int or an int32 array; got "
                        f"{type(cache_seqlens).__name__}")
    name = lambda x: None if x is None else jnp.dtype(x.dtype).name  # noqa: E731
    call = fa_plan.check_kvcache(
        q.shape, k_cache.shape, v_cache.shape, None if k is None else k.shape,
        None if v is None else v.shape,
        cache_seqlens_shape=tuple(cache_seqlens.shape) if seqlens_array else None,
        cache_seqlens_dtype=name(cache_seqlens) if seqlens_array else None,
        cache_batch_idx_shape=None if cache_batch_idx is None else tuple(cache_batch_idx.shape),
        cache_batch_idx_dtype=name(cache_batch_idx),
        rotary_cos_shape=None if rotary_cos is None else tuple(rotary_cos.shape),
        rotary_sin_shape=None if rotary_sin is None else tuple(rotary_sin.shape),
        causal=causal, window_size=window_size)
    if call.seqlen_new and cache_seqlens is None:
        raise ValueError("appending k and v needs cache_seqlens (where the new rows go)")
    for label, x in (("k", k), ("v", v)):
        if x is not None and jnp.dtype(x.dtype) != jnp.dtype(k_cache.dtype):
            raise TypeError(f"{label} must have the cache's dtype {name(k_cache)}; got "
                            f"{name(x)}")
    if cache_seqlens is None:
        seqlens = jnp.full((call.batch,), call.seqlen_cache, jnp.int32)
    elif not seqlens_array:
        seqlens = jnp.full((call.batch,), int(cache_seqlens), jnp.int32)
        fa_plan.check_cache_seqlens([int(cache_seqlens)] * call.batch, call,
                                    None if rotary_cos is None else rotary_cos.shape[0])
    else:
        if _concrete(cache_seqlens):
            fa_plan.check_cache_seqlens(np.asarray(cache_seqlens).tolist(), call,
                                        None if rotary_cos is None else rotary_cos.shape[0])
        seqlens = jnp.asarray(cache_seqlens)
    if _concrete(cache_batch_idx):
        fa_plan.check_cache_batch_idx(np.asarray(cache_batch_idx).tolist(), k_cache.shape[0])
    k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)
    start = jnp.clip(seqlens, 0, call.seqlen_cache - call.seqlen_new)
    rows = (jnp.arange(call.batch) if cache_batch_idx is None
            else jnp.clip(jnp.asarray(cache_batch_idx), 0, k_cache.shape[0] - 1))
    if call.seqlen_new:
        where = start[:, None] + jnp.arange(call.seqlen_new)
        k = jnp.asarray(k)
        if call.rotary_dim:
            k = rotary(k, rotary_cos, rotary_sin, where, rotary_interleaved)
        k_cache = k_cache.at[rows[:, None], where].set(k)
        v_cache = v_cache.at[rows[:, None], where].set(jnp.asarray(v))
    q = jnp.asarray(q)
    if call.rotary_dim:
        rows_q = jnp.arange(q.shape[1]) if call.rotate_q_per_row else jnp.zeros((1,), jnp.int32)
        q = rotary(q, rotary_cos, rotary_sin, start[:, None] + rows_q, rotary_interleaved)
    keys, values = ((k_cache, v_cache) if cache_batch_idx is None
                    else (k_cache[rows], v_cache[rows]))
    out, lse = attention(q, keys, values, causal=causal, softmax_scale=softmax_scale,
                         alibi_slopes=alibi_slopes, window_size=window_size, softcap=softcap,
                         return_lse=True, seqused_k=(start + call.seqlen_new).astype(jnp.int32))
    return (out, lse, k_cache, v_cache) if return_softmax_lse else (out, k_cache, v_cache)
