"""``fa_jax.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature and
semantics on the shared kernels, plus the kernels' extras as keyword-only arguments.

jax.nn's semantics, as its XLA implementation computes them:

* ``logits = scale * q·k + bias``, then ``where(mask, logits, big_negative)`` for the
  boolean ``mask``, ``is_causal`` (``tril``: query i sees keys j <= i, aligned top-left
  whatever the lengths), ``local_window_size`` (query i sees keys i - left .. i + right)
  and the padding of ``query_seq_lengths`` / ``key_value_seq_lengths``;
* a row with every key masked attends uniformly to all keys (the mean of the values), and
  as ``where`` passes no gradient to replaced logits, its query gets none;
* output rows past a sequence's ``query_seq_lengths`` are zero.

Here a masked key is invisible (-inf: weight and gradient exactly 0, as jax.nn's), a fully
masked row's output is the mean of the values, and padded query rows are zeroed. Without
a mask or lengths, causal and window options become the kernels' own flags where they
align (the kernels align the diagonal bottom-right; with Sq == Sk that is jax's);
without a mask, causality or a window the lengths need none either (the key lengths
become the kernels' ``seqused_k``, rows past the query lengths are zeroed); else the
combined mask reaches the kernels as a 0 / -inf bias.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fa_kernels import plan as fa_plan

from .ops import attention


def uniform_where_fully_masked(out, value, empty):
    """jax.nn's and Flax's answer for rows whose every key is masked: all their logits
    equal the big negative, so they attend uniformly to every key (the mean of the
    values). ``out`` ``(batch..., Sq, Hq, D)``, ``value`` ``(batch..., Sk, Hk, D)``,
    ``empty`` broadcastable to ``(batch..., Hq, Sq)`` (True: the row sees no key)."""
    heads, heads_kv = out.shape[-2], value.shape[-2]
    mean = jnp.mean(value.astype(jnp.float32), axis=-3)     # (batch..., heads_kv, depth)
    mean = jnp.repeat(mean, heads // heads_kv, axis=-2).astype(out.dtype)
    rows = jnp.swapaxes(jnp.broadcast_to(empty, (*out.shape[:-3], heads, out.shape[-3])), -1, -2)
    return jnp.where(rows[..., None], mean[..., None, :, :], out)


def no_visible_key(visible, heads: int):
    """(batch..., Hq, Sq): rows of a mask broadcastable to (batch..., Hq, Sq, Sk) with no
    True."""
    empty = ~jnp.any(visible, axis=-1)
    return jnp.broadcast_to(empty, (*empty.shape[:-2], heads, empty.shape[-1]))


def window_mask(q_len: int, kv_len: int, left: int, right: int, diagonal: int = 0):
    """(Sq, Sk) bool: query i sees keys i + diagonal - left .. i + diagonal + right
    (-1: unbounded)."""
    rows = jnp.arange(q_len)[:, None] + diagonal
    cols = jnp.arange(kv_len)[None, :]
    visible = jnp.ones((q_len, kv_len), bool)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def _ensure_4d(x):
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def sequence_lengths(name, lengths, batch_shape: tuple, layout: str = "(batch,)"):
    """Per-entry lengths checked: None, or an int32 array of ``batch_shape``."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.dtype != np.int32 or lengths.shape != tuple(batch_shape):
        raise ValueError(f"{name} must be an int32 array of shape {layout} = "
                         f"{tuple(batch_shape)}; got {lengths.dtype} of shape {lengths.shape}")
    return lengths


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual: bool = False,
                          softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
                          dropout_seed=None):
    """``jax.nn.dot_product_attention`` on the kernels (see the module's docstring).

    query ``(B, T, N, H)`` or ``(T, N, H)``; key, value ``(B, S, K, H)`` (GQA when
    ``N % K == 0``); ``bias`` and ``mask`` 4-D (or fewer) broadcastable to
    ``(B, N, T, S)``; ``query_seq_lengths`` / ``key_value_seq_lengths`` int32 ``(B,)``.
    ``implementation`` is accepted for the signature and ignored (the kernels run).
    ``return_residual``: also the LSE, ``(B, T, N)`` in the key's dtype (-inf for a row
    with every key masked, where jax.nn gives a big negative). Extras, keyword-only:
    ``softcap``, ``alibi_slopes``, ``dropout_p`` with ``dropout_seed`` (as
    ``fa_jax.attention``)."""
    del implementation
    is_causal = fa_plan.check_bool("is_causal", is_causal)
    return_residual = fa_plan.check_bool("return_residual", return_residual)
    unbatched = jnp.ndim(query) == 3
    q, k, v = (_ensure_4d(x) for x in (query, key, value))
    if unbatched and (jnp.ndim(key) != 3 or jnp.ndim(value) != 3):
        raise ValueError("an unbatched query (T, N, H) needs unbatched key and value (S, K, H)")
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    q_lengths = sequence_lengths("query_seq_lengths", query_seq_lengths, (batch,))
    kv_lengths = sequence_lengths("key_value_seq_lengths", key_value_seq_lengths, (batch,))
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size,
                                                                            bool):
        local_window_size = (int(local_window_size), int(local_window_size))
    if local_window_size is not None:
        if (not isinstance(local_window_size, (tuple, list)) or len(local_window_size) != 2
                or not all(isinstance(w, (int, np.integer)) and w >= 0
                           for w in local_window_size)):
            raise ValueError(f"local_window_size must be an int or a pair of ints >= 0; got "
                             f"{local_window_size!r}")
    if mask is not None:
        mask = _ensure_4d(mask)
        if mask.dtype != np.bool_:
            raise ValueError(f"mask must be boolean (True: attend; an additive mask goes in "
                             f"bias); got {mask.dtype}")
    if bias is not None:
        bias = _ensure_4d(bias)
    options = dict(softmax_scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                   dropout_p=dropout_p, dropout_seed=dropout_seed)

    # Causality and windows as the kernels' flags where they fit: the kernels align the
    # diagonal bottom-right (at Sk - Sq), jax top-left (at 0).
    diagonal = kv_len - q_len
    left, right = (-1, -1) if local_window_size is None else local_window_size
    if is_causal:
        right = 0
    fits = (left < 0 or left + diagonal >= 0) and (right < 0 or right - diagonal >= 0)
    if mask is None and q_lengths is None and kv_lengths is None and fits:
        window = (left + diagonal if left >= 0 else -1, right - diagonal if right >= 0 else -1)
        result = attention(q, k, v, bias=bias, window_size=window, return_lse=return_residual,
                           **options)
        # (a row sees no key only when a left window ends before the keys start)
        empty = (jnp.arange(q_len) - left > kv_len - 1)[None, None] if left >= 0 else None
    elif mask is None and left < 0 and right < 0 and alibi_slopes is None:
        # Padding without a mask or a diagonal: the key lengths are the kernels' seqused_k,
        # and rows past the query lengths are zeroed below (what they saw is moot), so no
        # (B, 1, Sq, Sk) mask is built (not with ALiBi, whose distances seqused_k would
        # measure from its count).
        used = None if kv_lengths is None else jnp.clip(kv_lengths, 0, kv_len)
        result = attention(q, k, v, bias=bias, seqused_k=used, return_lse=return_residual,
                           **options)
        empty = None if used is None else (used == 0)[:, None, None]
    else:
        visible = jnp.ones((1, 1, 1, 1), bool) if mask is None else mask
        if left >= 0 or right >= 0:
            visible = visible & window_mask(q_len, kv_len, left, right)[None, None]
        if q_lengths is not None:
            visible = visible & (jnp.arange(q_len)[None, None, :, None]
                                 < q_lengths[:, None, None, None])
        if kv_lengths is not None:
            visible = visible & (jnp.arange(kv_len)[None, None, None, :]
                                 < kv_lengths[:, None, None, None])
        masked = jnp.where(visible, 0.0, -jnp.inf).astype(jnp.float32)
        total = masked if bias is None else bias.astype(jnp.float32) + masked
        result = attention(q, k, v, bias=total, return_lse=return_residual, **options)
        empty = no_visible_key(visible, q.shape[2])
    out, lse = result if return_residual else (result, None)
    if empty is not None:
        out = uniform_where_fully_masked(out, v, empty)
    if q_lengths is not None:
        keep = jnp.arange(q_len)[None, :] < q_lengths[:, None]
        out = out * keep[:, :, None, None].astype(out.dtype)
        if lse is not None:  # (a padded row sees no key, as in the masked path)
            lse = jnp.where(keep[:, None, :], lse, -jnp.inf)
    if unbatched:
        out = out[0]
    if not return_residual:
        return out
    lse = jnp.swapaxes(lse, 1, 2).astype(k.dtype)  # (B, N, T) -> (B, T, N)
    return out, (lse[0] if unbatched else lse)
