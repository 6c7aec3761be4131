"""Flax adapter: ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` (and
the nnx ``MultiHeadAttention``), with the signature of ``flax.linen.dot_product_attention``.

    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=fa_jax.flax.attention_fn)
    nn.MultiHeadDotProductAttention(..., attention_fn=fa_jax.flax.make_attention_fn(causal=True))

Linen passes only the arguments an attention_fn declares, so every one is declared.

* ``mask`` (True = attend), broadcastable to (batch..., heads, q_len, kv_len), with
  Flax's semantics, gradients included: Flax replaces a masked logit by a big negative
  (``where(mask, logits, finfo.min)``), so no gradient flows through it, and a row with
  every key masked attends uniformly to all keys (its output is the mean of the values,
  and its query gets no gradient). Here a masked key is invisible (-inf: weight and
  gradient exactly 0, as in Flax), and a fully masked row's output is the mean of the
  values. A concrete causal mask (``nn.make_causal_mask`` outside jit) with q_len ==
  kv_len becomes the causal flag, and a concrete key padding mask (every row of entry b
  sees its first n_b keys, as ``nn.make_attention_mask(ones, key_is_real)`` makes)
  becomes per-entry key counts (the kernels' ``seqused_k``): no dense bias either way.
  Under jit a mask is a tracer and cannot be inspected: it becomes a 0 / -inf bias; say
  ``make_attention_fn(causal=True)`` for the fast causal path, and pass key padding as
  lengths, ``make_attention_fn(key_value_seq_lengths=lengths)`` (traced arrays welcome),
  which become ``seqused_k`` as a concrete padding mask does. Per call (nnx, or a linen
  module made once), pass ``mask=key_padding(lengths)``: the module hands it to the
  attention_fn as it is, and it means the same lengths.
* ``dropout_rng`` seeds our dropout (the mask is drawn per batch entry and head;
  ``broadcast_dropout`` is accepted, the mask is not broadcast over batch dims).
* ``dtype`` casts q, k, v for the computation; the softmax is always in fp32
  (``force_fp32_for_softmax`` and nnx's ``promote_dtype`` are accepted). ``is_causal``
  (nnx) sets the causal flag. ``precision`` and ``module`` are accepted and unused
  (there are no attention weights to sow).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .jax_nn import (no_visible_key, sequence_lengths, uniform_where_fully_masked,
                     window_mask)
from .ops import attention


@jax.tree_util.register_pytree_node_class
class KeyPadding:
    """A key padding mask as per-entry lengths: entry b's keys are its first
    ``lengths[b]`` (int32 of the batch shape; traced is fine), for every query.
    ``mask=key_padding(lengths)`` to a Flax attention module whose attention_fn is ours
    (not with ``decode=True``, whose cache mask Flax combines with the given one).
    A pytree: it crosses jit and vmap boundaries as its lengths."""

    def __init__(self, lengths):
        self.lengths = lengths

    def tree_flatten(self):
        return (self.lengths,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __repr__(self):
        return f"KeyPadding(lengths={self.lengths!r})"


def key_padding(lengths) -> KeyPadding:
    """``mask=key_padding(lengths)``: what ``nn.make_attention_mask(ones,
    arange(kv_len) < lengths[..., None])`` means, as lengths (the kernels' ``seqused_k``,
    no dense mask or bias)."""
    return KeyPadding(lengths)


def _is_causal_mask(mask, q_len: int, kv_len: int) -> bool:
    if mask is None or isinstance(mask, jax.core.Tracer) or q_len != kv_len:
        return False
    mask = np.asarray(mask)
    if mask.shape[-2:] != (q_len, kv_len):
        return False
    causal = np.tril(np.ones((q_len, kv_len), dtype=bool))
    return bool(np.all(mask.reshape(-1, q_len, kv_len) == causal))


def _key_counts(mask, batch_dims, q_len: int, kv_len: int):
    """(prod(batch_dims),) int32: n_b where a concrete mask shows every row of entry b its
    first n_b keys and no other (a key padding mask); None for any other or traced mask."""
    if mask is None or isinstance(mask, jax.core.Tracer):
        return None
    mask = np.asarray(mask, bool)
    rank = len(batch_dims) + 3
    if mask.ndim > rank:
        return None
    mask = mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
    if mask.shape[-1] != kv_len:
        return None
    counts = mask.sum(axis=-1)
    if not np.array_equal(mask, np.arange(kv_len) < counts[..., None]):
        return None  # not a prefix of the keys in every row
    try:
        counts = np.broadcast_to(counts, (*batch_dims, counts.shape[-2], counts.shape[-1]))
    except ValueError:
        return None
    counts = counts.reshape(max(1, int(np.prod(batch_dims))), -1)
    if not np.all(counts == counts[:, :1]):
        return None  # rows of one entry see different keys
    return jnp.asarray(counts[:, 0], jnp.int32)


def _attention_fn(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                  deterministic, dtype, is_causal, options):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", 0) < 3:
            raise ValueError(f"{name} must have shape (batch..., length, heads, depth); got "
                             f"shape {tuple(getattr(x, 'shape', ()))}")
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    *batch_dims, q_len, heads, depth = query.shape
    kv_len = key.shape[-3]
    lead = int(np.prod(batch_dims)) if batch_dims else 1

    def fold(x):
        return x.reshape(lead, *x.shape[-3:])

    causal = options.pop("causal", False) or bool(is_causal)
    lengths = options.pop("key_value_seq_lengths", None)
    lengths = sequence_lengths("key_value_seq_lengths", lengths, batch_dims, "(batch...)")
    if isinstance(mask, KeyPadding):  # (the same lengths, given per call)
        given = sequence_lengths("key_padding(lengths)", mask.lengths, batch_dims,
                                 "(batch...)")
        lengths = given if lengths is None else jnp.minimum(lengths, given)
        mask = None
    if lengths is not None:
        lengths = jnp.clip(lengths, 0, kv_len)
    if mask is not None and _is_causal_mask(mask, q_len, kv_len):
        causal, mask = True, None
    # (Counts move the causal/window diagonal and ALiBi's distances to n_b: not with those.)
    plain = not causal and tuple(options.get("window_size", (-1, -1))) == (-1, -1) \
        and options.get("alibi_slopes") is None
    # Key padding: True where a key is one of its entry's first n_b (batch..., 1, 1, Sk).
    padding = None if lengths is None else \
        jnp.arange(kv_len) < lengths.reshape(*batch_dims, 1, 1, 1)
    if padding is not None and not plain:  # (then the lengths reach the kernels as a bias)
        mask = padding if mask is None else jnp.asarray(mask, bool) & padding
        padding = None  # (in the mask now)
    key_counts = _key_counts(mask, batch_dims, q_len, kv_len) if plain else None
    mask_in_counts = key_counts is not None
    if plain and lengths is not None:
        key_counts = lengths.reshape(lead) if key_counts is None \
            else jnp.minimum(key_counts, lengths.reshape(lead))
    if key_counts is not None:
        options["seqused_k"] = key_counts
    parts = [jnp.asarray(bias, jnp.float32)] if bias is not None else []
    if mask is not None and not mask_in_counts:
        mask = jnp.asarray(mask, bool)
        parts.append(jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32))
    total_bias = sum(parts[1:], parts[0]) if parts else None
    if total_bias is not None and (len(batch_dims) > 1 or total_bias.ndim > 4):
        # Several batch dims fold into one: give the bias them all, then fold.
        total_bias = jnp.broadcast_to(total_bias, (*batch_dims, heads, q_len, kv_len))
        total_bias = total_bias.reshape(lead, heads, q_len, kv_len)
    dropout = {}
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_rate > 0 with deterministic=False needs dropout_rng")
        dropout = dict(dropout_p=float(dropout_rate), dropout_seed=dropout_rng)
    out = attention(fold(query), fold(key), fold(value), causal=causal, bias=total_bias,
                    **dropout, **options)
    out = out.reshape(*batch_dims, q_len, heads, out.shape[-1]) if batch_dims else out[0]
    if mask is not None or padding is not None:
        visible = padding if mask is None else mask if padding is None else mask & padding
        window = tuple(options.get("window_size", (-1, -1)))
        if causal or window != (-1, -1):  # (the kernels' diagonal: bottom-right)
            visible = visible & window_mask(q_len, kv_len, window[0], 0 if causal else window[1],
                                            kv_len - q_len)
        out = uniform_where_fully_masked(out, value, no_visible_key(visible, heads))
    return out


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None, force_fp32_for_softmax: bool = False,
                 promote_dtype=None, is_causal: bool = False):
    """Drop-in for ``flax.linen.dot_product_attention`` (and ``flax.nnx``'s, which also
    passes ``is_causal``) on our kernels.

    query ``(batch..., q_len, heads, depth)``, key and value ``(batch..., kv_len,
    heads_kv, depth)``. Returns ``(batch..., q_len, heads, depth)``.
    """
    return _attention_fn(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                         dropout_rate, deterministic, dtype, is_causal, {})


def make_attention_fn(**options):
    """An ``attention_fn`` with fixed options of ``fa_jax.attention`` (``causal``,
    ``window_size``, ``softcap``, ``alibi_slopes``, ``softmax_scale``...), and
    ``key_value_seq_lengths``: int32 of the query's batch shape, entry b's keys are its
    first n_b (as ``nn.make_attention_mask(ones, arange(kv_len) < n_b)``, and with any
    ``mask`` too). Lengths are data, so they work under jit: make the fn where they are
    at hand, e.g. in a ``@nn.compact`` ``__call__``. Without causal, window or ALiBi
    options they reach the kernels as ``seqused_k`` (no dense bias); with those, as a
    bias."""

    def fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
           dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
           dtype=None, precision=None, module=None, force_fp32_for_softmax: bool = False,
           promote_dtype=None, is_causal: bool = False):
        return _attention_fn(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                             dropout_rate, deterministic, dtype, is_causal, dict(options))

    return fn
