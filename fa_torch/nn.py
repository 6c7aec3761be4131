"""``fa_torch.nn.MultiheadAttention``: qkv projection, our attention, output projection.

Batch-first, like flash-attn's layers: ``x`` is ``(batch, seqlen, embed_dim)``. GQA by
``num_kv_heads`` (K/V projections with fewer heads; never expanded in memory).
"""
from __future__ import annotations

import torch
from torch import nn

from fa_kernels import plan as fa_plan

from .ops import attention


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *,
                 bias: bool = True, causal: bool = False, dropout: float = 0.0,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        dropout = fa_plan.check_dropout_p(dropout)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads})")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.dropout, self.window_size, self.softcap = causal, dropout, window_size, softcap
        factory = dict(device=device, dtype=dtype)
        kv_dim = num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(embed_dim, embed_dim + 2 * kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
        batch, seqlen, _ = x.shape
        kv_dim = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.embed_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(batch, seqlen, self.num_heads, self.head_dim)
        k = k.view(batch, seqlen, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seqlen, self.num_kv_heads, self.head_dim)
        out = self.attend(q, k, v, bias)
        return self.out_proj(out.reshape(batch, seqlen, self.embed_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seqlen, heads, head_dim) in, the same out; override to compare with
        another attention (examples/torch_lm.py puts torch SDPA here)."""
        return attention(q, k, v, causal=self.causal, bias=bias, window_size=self.window_size,
                         softcap=self.softcap, dropout_p=self.dropout if self.training else 0.0)
