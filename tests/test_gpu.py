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


def test_cuda_graph_capture_of_forward_and_backward():
    # Capture fwd+bwd once, replay on new inputs copied into the static tensors: the
    # results equal an eager run on those inputs, bit for bit.
    q, k, v = random_qkv(2, 300, 300, 8, 2, 64, "bfloat16", seed=1)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) outside the capture
        for _ in range(2):
            fa_torch.attention(*leaves, causal=True).backward(dout)
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fa_torch.attention(*leaves, causal=True)
        static_out.backward(dout)
    new = random_qkv(2, 300, 300, 8, 2, 64, "bfloat16", seed=2)
    with torch.no_grad():
        for x, n in zip(leaves, new):
            x.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    eager = [x.clone().requires_grad_() for x in new]
    out = fa_torch.attention(*eager, causal=True)
    out.backward(dout)
    assert torch.equal(static_out, out)
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad)


def test_torch_compile_reduce_overhead_matches_eager():
    # inductor with CUDA graphs (mode="reduce-overhead") around our custom op.
    q, k, v = random_qkv(2, 128, 128, 4, 4, 64, "float16", seed=3)

    def layer(q, k, v):
        return fa_torch.attention(q * 2.0, k, v, causal=True) + 1.0

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = compiled(q, k, v)
    assert torch.equal(got, layer(q, k, v))
