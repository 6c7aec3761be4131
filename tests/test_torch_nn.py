"""fa_torch.nn.MultiheadAttention and autocast."""
import pytest
import torch

import fa_torch

from .common import DEVICE
from .reference import attention_reference


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_layer_matches_reference(num_kv_heads):
    torch.manual_seed(0)
    layer = fa_torch.nn.MultiheadAttention(64, 4, num_kv_heads, causal=True).to(DEVICE)
    x = torch.randn(2, 30, 64, device=DEVICE, requires_grad=True)
    out = layer(x)
    q, k, v = layer.qkv_proj(x).split([64, 16 * num_kv_heads, 16 * num_kv_heads], dim=-1)
    ref, _ = attention_reference(q.view(2, 30, 4, 16), k.view(2, 30, num_kv_heads, 16),
                                 v.view(2, 30, num_kv_heads, 16), causal=True,
                                 compute_dtype=torch.float32)
    expected = layer.out_proj(ref.reshape(2, 30, 64))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and layer.qkv_proj.weight.grad is not None


def test_layer_validates_heads():
    with pytest.raises(ValueError, match="num_heads \\(4\\) must be a multiple of num_kv_heads"):
        fa_torch.nn.MultiheadAttention(64, 4, 3)


def test_autocast_runs_in_the_autocast_dtype():
    q = torch.randn(1, 24, 2, 32, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = fa_torch.attention(q, q, q, causal=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32  # the cast is differentiable, back to the leaf's dtype
    expected = fa_torch.attention(*(q.detach().bfloat16(),) * 3, causal=True)
    assert torch.equal(out.detach(), expected)
