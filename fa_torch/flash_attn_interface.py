"""flash-attn's calling convention (``flash_attn.flash_attn_interface``), on our kernels.

Same names, argument order, defaults and return values, so that swapping
``from flash_attn import flash_attn_func`` for ``from fa_torch import flash_attn_func``
is all a flash-attn user has to do. With ``return_attn_probs=True`` the third value
is the dropout keep mask (bool, (batch, heads, seqlen_q, seqlen_k)) when dropout is on,
else None (flash-attn returns an encoded debug tensor there).
"""
from __future__ import annotations

import torch

from fa_kernels import plan as fa_plan

from .kvcache import flash_attn_with_kvcache  # noqa: F401  (flash-attn's name, here too)
from .ops import _attention, dropout_seed_tensor
from .ops import dropout_mask as _dropout_mask


def _unpack(name: str, packed, rank: int, axis: int, parts: int, layout: str):
    """The ``parts`` views of a packed tensor along ``axis``, after checking its shape."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}; got {type(packed).__name__}")
    if packed.dim() != rank or packed.shape[axis] != parts:
        raise ValueError(f"{name} must have shape {layout}; got {tuple(packed.shape)}")
    return packed.unbind(dim=axis)


def _run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
         softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
         seqused_k=None, block_table=None):
    dropout_p = fa_plan.check_dropout_p(dropout_p)
    return_attn_probs = fa_plan.check_bool("return_attn_probs", return_attn_probs)
    seed = None
    if dropout_p > 0:
        # Drawn here so the debug mask below is the one the kernel used.
        seed = dropout_seed_tensor(None, torch.device("cpu"))
        seed = fa_plan.seed_from_words(*seed[:2].tolist())
    out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal=causal, softmax_scale=softmax_scale, bias=None,
                          alibi_slopes=alibi_slopes, window_size=window_size, softcap=softcap,
                          dropout_p=dropout_p, dropout_seed=seed, return_lse=True,
                          seqused_k=seqused_k, block_table=block_table)
    if not return_attn_probs:
        return out
    mask = None
    if dropout_p > 0 and cu_seqlens_q is None:
        mask = _dropout_mask(seed, q.shape[0], q.shape[2], q.shape[1], k.shape[1], dropout_p,
                             device=q.device)
    return out, lse, mask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim)."""
    return _run(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, headdim): the views are used in place."""
    q, k, v = _unpack("qkv", qkv, 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _run(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpack("kv", kv, 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _run(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, seqused_k=None):
    """q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim), int32 cu_seqlens.
    ``seqused_k`` (batch,) int32 (as flash-attn 3's): sequence b uses only its first
    ``seqused_k[b]`` keys. ``block_table`` (batch, max_num_blocks_per_seq) int32: k and v
    are a paged cache (num_blocks, page_block_size, nheads_k, headdim), any page size,
    forward only; cu_seqlens_k give each sequence's key count."""
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                seqused_k, block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, nheads, headdim)."""
    q, k, v = _unpack("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    return _run(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    k, v = _unpack("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)
