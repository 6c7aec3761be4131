"""Reference attention in plain torch: float64 for truth, or the inputs' own dtype to
measure how much error that dtype costs a straightforward implementation (the
yardstick of flash-attn's tests). Every option of the public API is here."""
from __future__ import annotations

import torch


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), device="cpu"):
    """(Sq, Sk) bool: row i sees key j (bottom-right aligned diagonal)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    diagonal = seqlen_k - seqlen_q
    left, right = window_size
    if causal:
        right = 0
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= cols <= rows + diagonal + right
    if left >= 0:
        mask &= cols >= rows + diagonal - left
    return mask


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, bias=None,
                        alibi_slopes=None, window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
                        dropout_keep=None, compute_dtype=torch.float64):
    """(out, lse) for q (B, Sq, Hq, D), k and v (B, Sk, Hk, D); differentiable.

    ``compute_dtype`` float64 gives the truth; the inputs' dtype gives the framework's
    own low-precision answer (scores and products in that dtype, softmax in fp32).
    ``dropout_keep`` is the (B, Hq, Sq, Sk) keep mask the kernel drew.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    q, k, v = (x.to(compute_dtype) for x in (q, k, v))
    group = heads_q // heads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    accum = torch.float64 if compute_dtype == torch.float64 else torch.float32
    scores = (torch.einsum("bqhd,bkhd->bhqk", q, k) * scale).to(accum)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(accum)
    diagonal = seqlen_k - seqlen_q
    if alibi_slopes is not None:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        distance = (rows + diagonal - cols).abs().to(accum)
        slopes = alibi_slopes.to(accum)
        slopes = slopes.reshape(-1 if slopes.dim() == 2 else 1, heads_q, 1, 1)
        scores = scores - slopes * distance
    visible = visible_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    # A row with no visible key (by the mask, or a -inf bias on every key): output 0,
    # lse -inf, no gradient. Its scores are replaced before the softmax so that no
    # -inf - -inf reaches autograd. Every other row is exp(s - max) / sum, the max
    # subtracted first: with a finite mask as large as -1e30 on every key, max + log(sum)
    # would lose the log(sum) even in float64.
    zero = torch.zeros((), dtype=accum, device=q.device)
    seen = (scores > float("-inf")).any(dim=-1)
    safe = torch.where(seen[..., None], scores, zero)
    row_max = (safe.detach().amax(dim=-1, keepdim=True) if seqlen_k else
               safe.new_zeros((*safe.shape[:-1], 1)))
    weights = torch.exp(safe - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    lse = torch.where(seen, (row_max + torch.log(total)).squeeze(-1), float("-inf"))
    probs = torch.where(seen[..., None], weights / total, zero)
    if dropout_p > 0:
        probs = probs * dropout_keep.to(probs.device) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(compute_dtype), v)
    return out, lse


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, compute_dtype=torch.float64, **options):
    """Packed (total, H, D) inputs: each sequence through attention_reference on its own.
    Returns (out (total_q, Hq, D), lse (Hq, total_q))."""
    outs, lses = [], []
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]][None]
        ks, vs = k[cu_k[b]:cu_k[b + 1]][None], v[cu_k[b]:cu_k[b + 1]][None]
        per = dict(options)
        if per.get("alibi_slopes") is not None and per["alibi_slopes"].dim() == 2:
            per["alibi_slopes"] = per["alibi_slopes"][b]
        out, lse = attention_reference(qs, ks, vs, compute_dtype=compute_dtype, **per)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)
