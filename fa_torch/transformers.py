"""transformers integration: ``attn_implementation="fa_torch"`` for any model that looks its
attention up in ``AttentionInterface`` (Llama, Mistral, Qwen2, Gemma-2 and most others).

    import fa_torch.transformers
    fa_torch.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa_torch")

``register`` adds two entries under one name: the attention function, and a mask function
in ``AttentionMaskInterface`` (without one, transformers hands every attention function
``attention_mask=None``, and padded batches come out silently wrong). For transformers'
causal and sliding-window causal masks the mask is, as for its flash-attention
implementations, the 2-D padding mask ``(B, Sk)`` (None without padding: the kernels'
causal flag): each entry's real tokens, contiguous (left or right padding), are packed
and attended through ``attention_varlen`` (no ``Sq x Sk`` mask or bias; padded query rows
give 0), and a batch whose real tokens have gaps is masked exactly through a bias. Any
other mask (bidirectional, packed sequences, overlays such as image tokens) is
transformers' own sdpa mask, a boolean ``(B, 1, Sq, Sk)``. Where it is exactly causal
attention within packed sequences (``position_ids`` that restart at each sequence, as
``DataCollatorWithFlattening`` makes them), the sequences are read off the mask once per
forward and attended through ``attention_varlen``: no bias, and no work across
sequences. Any other such mask reaches the kernels as a bias of 0 / -inf (a masked key
is invisible: weight and gradient 0). What each model
passes maps to the kernels' options: ``scaling`` to ``softmax_scale``,
``sliding_window`` to ``window_size=(sliding_window - 1, 0)`` (transformers' window holds
the key itself and the ``sliding_window - 1`` before it; both sides without causality), ``softcap`` (Gemma-2's
``attn_logit_softcapping``) to ``softcap``, ``dropout`` (training) to ``dropout_p`` with a
seed from torch's generator. GQA heads are never expanded. ``output_attentions=True`` is
refused: the kernels never form the attention matrix.

transformers is an optional dependency (``pip install .[transformers]``), imported only by
``register``.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch

from .ops import attention, attention_varlen, autocast_inputs, window_visible

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
    options = dict(softmax_scale=scaling, softcap=float(softcap or 0.0),
                   dropout_p=float(dropout or 0.0))
    # In the kernels' dtype from here on (under autocast Llama's rotary hands over fp32 q
    # and k beside a bf16 v): every path then returns that dtype.
    q, k, v = autocast_inputs(query.transpose(1, 2), key.transpose(1, 2),
                              value.transpose(1, 2))
    if attention_mask is not None and attention_mask.ndim == 2:  # our mask function's
        return _padded_attention(q, k, v, attention_mask.bool(), bool(causal), sliding_window,
                                 options), None
    if causal and attention_mask is not None and attention_mask.dtype == torch.bool:
        window = _window(sliding_window, True)
        cu_seqlens = _packed_sequences(attention_mask, window[0])
        if cu_seqlens is not None:  # packed sequences (position_ids that restart)
            return _packed_attention(q, k, v, cu_seqlens, window, options), None
    bias = None
    if attention_mask is not None:
        bias = _bias(attention_mask, query.dtype)
        causal = False  # the mask holds the causal pattern (and any window) itself
    out = attention(q, k, v, causal=bool(causal), bias=bias,
                    window_size=_window(sliding_window, causal), **options)
    return out, None


_LAST_PACKED: list = [None, None, None]  # [weakref to a mask, its version, its cu_seqlens]
_CHECK_ELEMENTS = 1 << 26  # elements of the expected mask built at once


def _packed_sequences(mask: torch.Tensor, window_left: int) -> torch.Tensor | None:
    """``cu_seqlens`` over the flattened batch when a boolean ``(B, 1, S, S)`` mask is
    exactly causal attention (within ``window_left``) inside consecutive sequences that
    fill each row: transformers' mask for packed sequences (``position_ids`` that restart,
    no padding mask). Else None. A sequence starts where a token does not see the one
    before it; the mask must then equal the one those sequences make. Each layer gets the
    same mask: it is read once."""
    if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3] \
            or mask.shape[2] < 2 or window_left == 0:
        return None
    ref, version, cu_seqlens = _LAST_PACKED
    if ref is not None and ref() is mask and version == mask._version:
        return cu_seqlens
    batch, seqlen = mask.shape[0], mask.shape[2]
    visible = mask[:, 0]
    rows = torch.arange(seqlen, device=mask.device)
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=mask.device)
    starts[:, 1:] = ~visible[:, rows[1:], rows[:-1]]
    sequence = starts.cumsum(1)
    # Compared a slab of rows at a time: the mask expected is as large as the mask.
    chunk = max(1, _CHECK_ELEMENTS // (batch * seqlen))
    exact = all(torch.equal((sequence[:, lo:lo + chunk, None] == sequence[:, None, :])
                            & window_visible(rows[None, :] - rows[lo:lo + chunk, None],
                                             window_left, 0),
                            visible[:, lo:lo + chunk])
                for lo in range(0, seqlen, chunk))
    cu_seqlens = None
    if exact:
        firsts = starts.flatten().nonzero()[:, 0]
        cu_seqlens = torch.cat([firsts, firsts.new_tensor([batch * seqlen])]).int()
    _LAST_PACKED[:] = [weakref.ref(mask), mask._version, cu_seqlens]
    return cu_seqlens


def _packed_attention(q, k, v, cu_seqlens, window, options):
    """Every token of q ``(B, S, Hq, D)``, k and v ``(B, S, Hk, D)`` in the packed sequences
    ``cu_seqlens`` (over the flattened batch): one varlen call, no mask."""
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    out = attention_varlen(*flat, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True,
                           window_size=window, **options)
    return out.view(q.shape)


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` (|i - j| < sliding_window) as ``window_size``."""
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    return (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as a 0 / -inf bias; an additive float mask (finfo.min
    where masked) as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask,
                                                                               float("-inf"))


def _padded_attention(q, k, v, padding, causal: bool, sliding_window, options):
    """q ``(B, Sq, Hq, D)``, k and v ``(B, Sk, Hk, D)``, ``padding`` ``(B, Sk)`` (True: a real
    token); the queries are the last Sq positions. Returns ``(B, Sq, Hq, D)``."""
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    if padding.shape != (batch, kv_len):
        raise ValueError(f"a 2-D attention_mask must have shape (batch, kv_length) = ({batch}, "
                         f"{kv_len}); got {tuple(padding.shape)}")
    window = _window(sliding_window, causal)
    positions = torch.arange(kv_len, device=padding.device)
    counts = padding.sum(1)
    starts = torch.where(counts > 0, padding.int().argmax(1), 0)
    ends = starts + counts
    spans = (positions >= starts[:, None]) & (positions < ends[:, None])
    # One copy to the host: every entry's span and whether the real tokens fill it.
    host = torch.cat([starts, ends, (spans == padding).all().long()[None]]).tolist()
    starts, ends, contiguous = host[:batch], host[batch:2 * batch], bool(host[-1])
    if not contiguous:  # gaps: the exact mask, as a bias
        rows = torch.arange(q_len, device=padding.device)[:, None] + (kv_len - q_len)
        band = window_visible(positions[None, :] - rows, window[0], 0 if causal else window[1])
        visible = padding[:, None, None, :] & band
        return attention(q, k, v, bias=_bias(visible, q.dtype), **options)
    # Entry b's real tokens are keys starts[b]:ends[b] and, of the queries (positions
    # kv_len - q_len on), those up to ends[b]: packed, each is its own varlen sequence, and
    # its bottom-right causal/window diagonal is the batch's.
    first_query = kv_len - q_len
    q_starts = [max(start, first_query) for start in starts]
    q_counts = [max(0, end - q_start) for q_start, end in zip(q_starts, ends)]
    q_rows = torch.cat([torch.arange(b * q_len + q_start - first_query,
                                     b * q_len + q_start - first_query + count)
                        for b, (q_start, count) in enumerate(zip(q_starts, q_counts))])
    k_rows = torch.cat([torch.arange(b * kv_len + start, b * kv_len + end)
                        for b, (start, end) in enumerate(zip(starts, ends))])
    out = q.new_zeros(batch * q_len, *q.shape[2:])
    if not q_rows.numel():
        return out.view(q.shape)
    q_rows, k_rows = q_rows.to(q.device), k_rows.to(q.device)

    def packed(x, rows):
        return x.reshape(-1, *x.shape[2:]).index_select(0, rows)

    def cumulative(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                            device=q.device)

    kv_counts = [end - start for start, end in zip(starts, ends)]
    result = attention_varlen(packed(q, q_rows), packed(k, k_rows), packed(v, k_rows),
                              cumulative(q_counts), cumulative(kv_counts), max(q_counts),
                              max(kv_counts), causal=causal, window_size=window, **options)
    return out.index_copy(0, q_rows, result).view(q.shape)


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
    AttentionMaskInterface.register(name, functools.partial(mask_interface, sdpa_mask=sdpa_mask))
    return name


def _same_function(a, b) -> bool:
    """Whether two mask functions are the same code over equal captured values (transformers
    builds its sliding-window mask function anew for each call)."""
    if a is b:
        return True
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_a is not code_b:
        return False
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    return len(cells_a) == len(cells_b) and all(
        _same_value(x.cell_contents, y.cell_contents) for x, y in zip(cells_a, cells_b))


def _same_value(a, b) -> bool:
    if callable(a) and callable(b):
        return _same_function(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b


def mask_interface(*, batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=None, attention_mask=None, local_size=None, sdpa_mask=None,
                   **kwargs):
    """transformers' mask interface: the 2-D padding mask ``(B, kv_length)`` (None when
    nothing is padded) for its causal and sliding-window causal masks with the queries at
    the end of the keys, else ``sdpa_mask``'s boolean ``(B, 1, Sq, Sk)`` mask."""
    from transformers.masking_utils import (causal_mask_function,
                                            sliding_window_causal_mask_function)

    arguments = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     local_size=local_size, **kwargs)
    if mask_function is not None:
        arguments["mask_function"] = mask_function
    causal = mask_function is None or mask_function is causal_mask_function
    sliding = local_size is not None and _same_function(
        mask_function, sliding_window_causal_mask_function(local_size))
    at_the_end = all(isinstance(n, int) for n in (q_offset, kv_offset)) \
        and q_offset + q_length == kv_offset + kv_length
    if not ((causal and local_size is None) or sliding) or not at_the_end \
            or attention_mask is None or attention_mask.ndim != 2 \
            or attention_mask.shape[-1] < kv_length:
        return sdpa_mask(**arguments)
    padding = attention_mask[:, -kv_length:].bool()
    return None if bool(padding.all()) else padding
