"""Reference attention in plain torch: float64 for truth, or the inputs' own dtype to
measure how much error that dtype costs a straightforward implementation (the
yardstick of flash-attn's tests)."""
from __future__ import annotations

import torch


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, compute_dtype=torch.float64):
    """(out, lse) for q (B, Sq, Hq, D), k and v (B, Sk, Hk, D); differentiable.

    ``compute_dtype`` float64 gives the truth; the inputs' dtype gives the
    framework's own low-precision answer (scores and products in that dtype,
    softmax in fp32, as a typical eager implementation).
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    q, k, v = (x.to(compute_dtype) for x in (q, k, v))
    group = heads_q // heads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        visible = cols <= rows + (seqlen_k - seqlen_q)
    accum = torch.float64 if compute_dtype == torch.float64 else torch.float32
    scores = scores.to(accum).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = visible.any(dim=-1)  # rows with no visible key: output 0, lse -inf
    probs = torch.where(seen[:, None], torch.exp(scores - torch.where(seen, lse, 0.0)[..., None]),
                        torch.zeros((), dtype=accum, device=q.device))
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(compute_dtype), v)
    return out, lse
