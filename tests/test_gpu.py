"""GPU-only checks: bitwise repeatability, 64-bit offsets, jax on the GPU."""
import pytest
import torch

import fa_torch

from .common import random_qkv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_bitwise_repeatable(causal):
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, "bfloat16")
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    first = fa_torch.attention(*leaves, causal=causal)
    first.backward(dout)
    grads = [x.grad.clone() for x in leaves]
    for _ in range(100):
        for x in leaves:
            x.grad = None
        out = fa_torch.attention(*leaves, causal=causal)
        assert torch.equal(out, first)
        out.backward(dout)
        for a, b in zip(leaves, grads):
            assert torch.equal(a.grad, b)


@pytest.mark.large
def test_more_than_2_to_31_elements():
    # q has 1 * 131072 * 160 * 128 = 2.7e9 elements: offsets must be 64-bit.
    batch, seqlen, heads, head_dim = 1, 131072, 160, 128
    assert batch * seqlen * heads * head_dim > 2 ** 31
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for _ in range(3))
    out = fa_torch.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    rows = torch.tensor([0, 1, 4097, 70000, seqlen - 1], device="cuda")
    for head in (0, 77, heads - 1):
        qs = q[0, rows, head].double()
        ks, vs = k[0, :, head].double(), v[0, :, head].double()
        scores = qs @ ks.T * head_dim ** -0.5
        cols = torch.arange(seqlen, device="cuda")
        scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        expected = torch.softmax(scores, dim=-1) @ vs
        err = (out[0, rows, head].double() - expected).abs().max().item()
        assert err < 2e-2, (head, err)
    del q, k, v, out
    torch.cuda.empty_cache()
