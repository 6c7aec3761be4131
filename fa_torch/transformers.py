"""transformers integration: ``attn_implementation="fa_torch"`` for any model that looks its
attention up in ``AttentionInterface`` (Llama, Mistral, Qwen2, Gemma-2 and most others).

    import fa_torch.transformers
    fa_torch.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa_torch")

``register`` adds two entries under one name: the attention function, and a mask function
in ``AttentionMaskInterface`` (without one, transformers hands every attention function
``attention_mask=None``, and padded batches come out silently wrong). The mask is
transformers' own sdpa mask: None where causality alone describes the batch (no padding:
the kernels' causal flag, nothing materialised), else a boolean ``(B, 1, Sq, Sk)`` mask that
reaches the kernels as a bias of 0 / -inf (a masked key is invisible: weight and gradient
0). What each model passes maps to the kernels' options: ``scaling`` to ``softmax_scale``,
``sliding_window`` to ``window_size=(sliding_window - 1, 0)`` (transformers' window holds
the key itself and the ``sliding_window - 1`` before it; both sides without causality), ``softcap`` (Gemma-2's
``attn_logit_softcapping``) to ``softcap``, ``dropout`` (training) to ``dropout_p`` with a
seed from torch's generator. GQA heads are never expanded. ``output_attentions=True`` is
refused: the kernels never form the attention matrix.

transformers is an optional dependency (``pip install .[transformers]``), imported only by
``register``.
"""
from __future__ import annotations

import torch

from .ops import attention

NAME = "fa_torch"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract: query ``(B, Hq, Sq, D)``, key and value
    ``(B, Hk, Sk, D)``; returns ``(B, Sq, Hq, D)`` and no attention weights."""
    if kwargs.get("output_attentions", False):
        raise ValueError("attn_implementation='fa_torch' does not return attention weights "
                         "(output_attentions=True): the kernels never form them; use 'eager'")
    if kwargs.get("position_bias") is not None:
        raise ValueError("attn_implementation='fa_torch' takes no position_bias (T5-style "
                         "relative biases); use 'eager' or 'sdpa' for such models")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            bias = torch.zeros(attention_mask.shape, dtype=query.dtype,
                               device=query.device).masked_fill(~attention_mask, float("-inf"))
        else:  # an additive float mask (finfo.min where masked): used as it is
            bias = attention_mask
        causal = False  # the mask holds the causal pattern (and any window) itself
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:  # |i - j| < sliding_window
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    causal=bool(causal), softmax_scale=scaling, bias=bias,
                    window_size=window, softcap=float(softcap or 0.0),
                    dropout_p=float(dropout or 0.0))
    return out, None


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` available to every transformers model; returns
    the name. Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as error:
        raise ImportError("fa_torch.transformers needs transformers: pip install "
                          "'flash-attention-jax-torch[transformers]'") from error
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
