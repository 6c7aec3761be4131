"""fa_torch and fa_jax run the same kernels with the same plan: the same bits."""
import pytest
import torch

from .common import random_qkv, run_jax, run_torch


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 113, 70, 4, 2, 40), (1, 64, 129, 2, 1, 128),
                                   (2, 1, 17, 3, 3, 256)])
def test_torch_jax_bitwise(dtype, causal, shape):
    q, k, v = random_qkv(*shape, dtype, seed=3)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype).to(q.device)
    t_out, t_lse, t_grads = run_torch(q, k, v, dout, causal=causal)
    j_out, j_lse, j_grads = run_jax(q, k, v, dout, causal=causal)
    assert torch.equal(t_out.cpu(), j_out), "forward output differs"
    assert torch.equal(t_lse.cpu(), j_lse), "lse differs"
    # The backward has no atomics and jax_triton compiles the JIT's PTX: the gradients
    # are bitwise equal too.
    for name, a, b in zip(("dq", "dk", "dv"), t_grads, j_grads):
        assert torch.equal(a.cpu(), b), f"{name} differs"


@pytest.mark.large
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_torch_jax_bitwise_at_the_main_tiles(causal, head_dim):
    # Lengths that the main table serves: fa_torch's descriptor tiles against fa_jax's,
    # host descriptors under jax-triton 0.4 or pointer tiles under 0.3.1
    # (configs._GPU_16BIT_POINTER), which differ only in tile sizes a program: the same
    # sums in the same order, the same bits.
    test_torch_jax_bitwise("bfloat16", causal, (1, 2048, 2048, 4, 2, head_dim))
