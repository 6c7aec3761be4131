"""The flash-attn feature set, in both front ends, against the float64 reference:
sliding window, softcap, ALiBi, bias with its gradient, dropout, and their combinations."""
import numpy as np
import pytest
import torch

from .common import (DEVICE, ON_GPU, check_against_reference, check_with_every_option,
                     keep_mask, random_qkv, run_jax, run_torch)


@pytest.mark.parametrize("window_size,causal", [((8, 0), False), ((-1, 5), False),
                                                ((16, 16), False), ((0, 0), False),
                                                ((10, -1), True), ((40, 3), False)])
@pytest.mark.parametrize("seqlens", [(97, 97), (64, 130), (130, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_sliding_window(run, window_size, causal, seqlens):
    check_against_reference(run, 2, *seqlens, 4, 2, 32, "bfloat16", causal,
                            window_size=window_size)


def test_window_as_an_integer_array(front):
    # flash-attn's own tests pass window_size as a 2-element integer tensor
    # (torch.randint(0, seqlen_k, (2,))): the same window as the pair of ints.
    q, k, v = random_qkv(2, 37, 45, 2, 2, 32, "float16", seed=3)
    if front == "torch":
        import fa_torch

        got = fa_torch.flash_attn_func(q, k, v, window_size=torch.tensor([9, 4]))
        want = fa_torch.flash_attn_func(q, k, v, window_size=(9, 4))
        assert torch.equal(got, want)
    else:
        import fa_jax

        arrays = [x.cpu().numpy() for x in (q, k, v)]
        got = fa_jax.attention(*arrays, window_size=np.array([9, 4]))
        assert np.array_equal(np.asarray(got), np.asarray(fa_jax.attention(*arrays,
                                                                            window_size=(9, 4))))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        (fa_torch.flash_attn_func(q, k, v, window_size=torch.tensor([9, 4, 1])) if front == "torch"
         else fa_jax.attention(*arrays, window_size=np.array([[9, 4]])))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(run, dtype, causal):
    check_against_reference(run, 2, 70, 83, 2, 2, 64, dtype, causal, softcap=2.0,
                            softmax_scale=0.5)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(run, per_batch, causal):
    gen = torch.Generator().manual_seed(5)
    shape = (2, 4) if per_batch else (4,)
    slopes = (torch.rand(shape, generator=gen) * 0.5).to(DEVICE)
    check_against_reference(run, 2, 90, 70, 4, 1, 40, "float16", causal,
                            alibi_slopes=slopes)


@pytest.mark.parametrize("bias_shape", [(2, 4, 65, 77), (1, 4, 65, 77), (65, 77), (2, 1, 1, 77),
                                        (4, 1, 77)], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_bias_and_its_gradient(run, bias_shape, dtype):
    check_against_reference(run, 2, 65, 77, 4, 2, 32, dtype, True,
                            bias_shape=bias_shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_against_reference_with_the_kernels_mask(run, dtype, causal):
    check_against_reference(run, 2, 70, 90, 4, 2, 32, dtype, causal,
                            dropout_p=0.3, dropout_seed=1234)


def test_bias_gradient_at_head_dim_256(run):
    # The table's D = 256 dQ tile (three stages) with bias tiles passes the H200's shared
    # memory: the plan takes a stage off (test_plan), and the launch runs.
    seqlen = 300 if ON_GPU else 40
    check_against_reference(run, 1, seqlen, seqlen, 2, 2, 256, "bfloat16", False,
                            bias_shape=(1, 2, seqlen, seqlen))


def test_everything_combined(run):
    check_with_every_option(run, 2, 100, 120, 6, 2, 48, "bfloat16", seed=77,
                            window_left=30, softcap=5.0, dropout_p=0.2, bias_batch=1)


def test_keep_fraction_and_independence():
    p = 0.3
    mask = keep_mask("torch", 2024, 2, 4, 256, 256, p)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.01
    # A pure function of (seed, batch, head, i, j): a smaller problem is the corner of a
    # larger one, whatever tiles either used.
    small = keep_mask("torch", 2024, 1, 2, 17, 33, p)
    assert torch.equal(small, mask[:1, :2, :17, :33])
    assert not torch.equal(keep_mask("torch", 2025, 2, 4, 256, 256, p), mask)


def test_dropout_masks_equal_across_frameworks():
    for seed in (0, 1, 2 ** 40 + 7):
        assert torch.equal(keep_mask("torch", seed, 2, 3, 50, 70, 0.25),
                           keep_mask("jax", seed, 2, 3, 50, 70, 0.25))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dropout_outputs_equal_across_frameworks(dtype):
    q, k, v = random_qkv(2, 60, 75, 4, 2, 32, dtype, seed=4)
    dout = torch.randn_like(q)
    options = dict(causal=True, dropout_p=0.25, dropout_seed=99)
    t_out, t_lse, t_grads = run_torch(q, k, v, dout, **options)
    j_out, j_lse, j_grads = run_jax(q, k, v, dout, **options)
    assert torch.equal(t_out.cpu(), j_out) and torch.equal(t_lse.cpu(), j_lse)
    for a, b in zip(t_grads, j_grads):
        assert torch.equal(a.cpu(), b)


def test_torch_seed_from_generator():
    import fa_torch

    q, k, v = random_qkv(1, 40, 40, 2, 2, 32, "float16")
    torch.manual_seed(0)
    a = fa_torch.attention(q, k, v, dropout_p=0.5)
    b = fa_torch.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    c = fa_torch.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, c) and not torch.equal(a, b)


def test_jax_seed_forms():
    import jax
    import jax.numpy as jnp

    import fa_jax

    from .common import to_numpy

    q, k, v = (jnp.asarray(to_numpy(x.cpu())) for x in random_qkv(1, 32, 32, 2, 2, 16, "float32"))
    by_int = fa_jax.attention(q, k, v, dropout_p=0.5, dropout_seed=5)
    traced = jax.jit(lambda s: fa_jax.attention(q, k, v, dropout_p=0.5, dropout_seed=s))
    assert jnp.array_equal(traced(jnp.uint32(5)), by_int)
    key = jax.random.key(3)
    assert jnp.array_equal(fa_jax.attention(q, k, v, dropout_p=0.5, dropout_seed=key),
                           fa_jax.attention(q, k, v, dropout_p=0.5, dropout_seed=key))
    with pytest.raises(ValueError, match="needs dropout_seed"):
        fa_jax.attention(q, k, v, dropout_p=0.5)


def test_sliding_window_skips_blocks(run):
    # A window of (0, 0) sees only the diagonal: every row sees exactly one key.
    q, k, v = random_qkv(1, 200, 200, 1, 1, 16, "float32")
    out, lse, _ = run(q, k, v, torch.zeros_like(q), window_size=(0, 0))
    scores = (q[0, :, 0] * k[0, :, 0]).sum(-1).double().cpu() * 16 ** -0.5
    np.testing.assert_allclose(lse[0, 0].double().cpu().numpy(), scores.numpy(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu(), v.cpu())
