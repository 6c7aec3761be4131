"""fa_torch's flash-attn aliases: flash-attn's names, argument order and returns."""
import torch

import fa_torch

from .common import DEVICE, random_qkv


def test_flash_attn_func_is_attention():
    q, k, v = random_qkv(2, 40, 50, 4, 2, 32, "float16")
    gen_args = dict(softmax_scale=0.2, causal=True, window_size=(9, -1), softcap=4.0)
    out = fa_torch.flash_attn_func(q, k, v, 0.0, 0.2, True, (9, -1), 4.0)
    assert torch.equal(out, fa_torch.attention(q, k, v, **gen_args))
    out2, lse, mask = fa_torch.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert lse.shape == (2, 4, 40) and mask is None
    assert torch.equal(out2, fa_torch.attention(q, k, v, causal=True))


def test_flash_attn_dropout_mask_is_returned():
    q, k, v = random_qkv(1, 30, 30, 2, 2, 16, "float32")
    out, lse, mask = fa_torch.flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    assert mask.shape == (1, 2, 30, 30) and mask.dtype == torch.bool
    assert 0.45 < mask.float().mean().item() < 0.75


def test_packed_variants():
    qkv = torch.randn(2, 33, 3, 4, 32).half().to(DEVICE)
    q, k, v = qkv.unbind(2)
    expected = fa_torch.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(fa_torch.flash_attn_qkvpacked_func(qkv, causal=True), expected)
    kv = qkv[:, :, 1:]
    assert torch.equal(fa_torch.flash_attn_kvpacked_func(q, kv, causal=True), expected)


def test_varlen_variants():
    lengths = [10, 23]
    cu = torch.tensor([0, 10, 33], dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(33, 3, 2, 16).half().to(DEVICE)
    q, k, v = qkv.unbind(1)
    expected = fa_torch.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert torch.equal(fa_torch.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True),
                       expected)
    assert torch.equal(fa_torch.flash_attn_varlen_qkvpacked_func(qkv, cu, 23, causal=True),
                       expected)
    assert torch.equal(fa_torch.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, 23, 23,
                                                                causal=True), expected)
