"""flash-attn's calling convention (``flash_attn.flash_attn_interface``), on our kernels.

Same names, argument order, defaults and return values, so that swapping
``from flash_attn import flash_attn_func`` for ``from fa_torch import flash_attn_func``
is all a flash-attn user has to do. With ``return_attn_probs=True`` and dropout the third
value is flash-attn's debug tensor ``S_dmask`` ``(batch, heads, seqlen_q, seqlen_k)``
(padded layout for varlen): the unnormalised probabilities as flash-attn's kernels keep
them, ``exp(s - m)`` with ``m`` the row's maximum over that key block of
``_get_block_size_n`` columns and every later one (those kernels walk the key blocks last
to first), negative where dropout dropped the entry, 0 where masked. flash-attn's tests
normalise it back with the LSE. Without dropout it is None. The exact keep mask is
``fa_torch.dropout_mask``.
"""
from __future__ import annotations

import torch

from fa_kernels import plan as fa_plan

from .kvcache import flash_attn_with_kvcache  # noqa: F401  (flash-attn's name, here too)
from .ops import _attention, dropout_seed_tensor, window_visible
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
    probs = None
    if dropout_p > 0:
        if block_table is not None:
            raise ValueError("return_attn_probs with dropout needs k and v as arrays, not "
                             "pages (block_table)")
        probs = _attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_k, seed, dropout_p, softmax_scale, causal, window_size,
                            softcap, alibi_slopes)
    return out, lse, probs


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block width of flash-attn's CUDA kernels for these options (flash-attn's
    tests normalise ``S_dmask`` block by block with it): its table, sm86/sm89 apart."""
    if not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256]; got {head_dim}")
    device = torch.device(device)
    sm8x = device.type == "cuda" and torch.cuda.get_device_capability(device) in (
        (8, 6), (8, 7), (8, 9))
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32 if is_dropout or (sm8x and not is_causal) else 64
    return 64


def _padded(x, cu_seqlens, max_seqlen):
    """Packed ``(total, heads, dim)`` rows as ``(batch, max_seqlen, heads, dim)``, zeros past
    each sequence, and the lengths; a padded ``x`` as it is."""
    if cu_seqlens is None:
        return x, torch.full((x.shape[0],), x.shape[1], device=x.device)
    bounds = cu_seqlens.tolist()
    out = x.new_zeros(len(bounds) - 1, max_seqlen, *x.shape[1:])
    for b, (start, end) in enumerate(zip(bounds, bounds[1:])):
        out[b, :end - start] = x[start:end]
    return out, torch.tensor([end - start for start, end in zip(bounds, bounds[1:])],
                             device=x.device)


def _attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, seed,
                dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """flash-attn's ``S_dmask`` for this call (see the module's docstring), in q's dtype."""
    q, lengths_q = _padded(q, cu_seqlens_q, max_seqlen_q)
    k, lengths_k = _padded(k, cu_seqlens_k, max_seqlen_k)
    if seqused_k is not None:
        lengths_k = torch.minimum(lengths_k, seqused_k.to(lengths_k.device))
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    keys = k.float().repeat_interleave(heads // k.shape[2], dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(seqlen_q, device=q.device)[:, None]
    cols = torch.arange(seqlen_k, device=q.device)[None, :]
    # A key's offset from its row's diagonal (bottom-right, per sequence).
    offset = cols - rows - (lengths_k - lengths_q)[:, None, None, None]
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(-1, heads)[:, :, None, None]
        scores = scores - slopes * offset.abs()
    left, right = fa_plan.window_pair(window_size)
    right = 0 if causal else right
    visible = (rows < lengths_q[:, None, None, None]) & (cols < lengths_k[:, None, None, None])
    visible = visible & window_visible(offset, left, right)
    scores = scores.masked_fill(~visible, float("-inf"))
    width = _get_block_size_n(q.device, head_dim, True, causal)
    blocks = -(-seqlen_k // width)
    padded = torch.nn.functional.pad(scores, (0, blocks * width - seqlen_k), value=float("-inf"))
    block_max = padded.view(*padded.shape[:-1], blocks, width).amax(-1)
    running = block_max.flip(-1).cummax(-1).values.flip(-1)  # blocks j .. last
    running = running.repeat_interleave(width, dim=-1)[..., :seqlen_k]
    probs = torch.where(visible, torch.exp(scores - running), 0.0)
    keep = _dropout_mask(seed, batch, heads, seqlen_q, seqlen_k, dropout_p, device=q.device)
    tiny = torch.finfo(q.dtype).tiny  # (a dropped entry stays negative where p underflows)
    probs = torch.where(keep | ~visible, probs, -probs.clamp_min(tiny))
    return probs.to(q.dtype)


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
