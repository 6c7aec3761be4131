"""Values the host cannot or does not check stay inside the arrays: varlen bounds (on the
host they are errors; traced or on the device they are clamped in the kernels), windows of
any size, subnormal scales, non-contiguous small inputs."""
import numpy as np
import pytest
import torch

from .common import DEVICE, ON_GPU, random_qkv, run_jax, run_torch, to_numpy
from .reference import varlen_reference


def _varlen(front, q, k, v, cu_q, cu_k, max_q, max_k, **options):
    if front == "torch":
        import fa_torch

        return fa_torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    import fa_jax

    out = fa_jax.attention_varlen(*(to_numpy(x) for x in (q, k, v, cu_q.cpu(), cu_k.cpu())),
                                  max_q, max_k, **options)
    return torch.from_numpy(np.asarray(out).copy())


@pytest.mark.parametrize("side", ["q", "k"])
def test_max_seqlen_shorter_than_a_sequence_is_an_error(front, side):
    q, k, v = (x[0] for x in random_qkv(1, 28, 28, 2, 2, 16, "float32"))
    cu = torch.tensor([0, 24, 28], dtype=torch.int32)
    max_q, max_k = (2, 24) if side == "q" else (24, 2)
    if front == "torch" and ON_GPU:
        pytest.skip("cu_seqlens on the GPU are trusted (checking needs a device sync): "
                    "test_traced_cu_seqlens_stay_in_bounds covers the kernels' clamp")
    with pytest.raises(ValueError, match=rf"max_seqlen_{side} \(2\) is smaller than the longest "
                                         rf"sequence in cu_seqlens_{side} \(24 tokens\)"):
        _varlen(front, q, k, v, cu.to(q.device), cu.to(q.device), max_q, max_k)


def test_max_seqlen_above_the_token_count_is_an_error(front):
    q, k, v = (x[0] for x in random_qkv(1, 8, 8, 1, 1, 16, "float32"))
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(1000000000\) is larger than the "
                                         r"number of packed tokens \(8\)"):
        _varlen(front, q, k, v, cu, cu, 10 ** 9, 8)


def test_traced_cu_seqlens_stay_in_bounds():
    """Traced cu_seqlens that point past the tokens (or backwards) are clamped in the
    kernels: finite results, every row either a real sequence's or zero, no crash."""
    import jax
    import jax.numpy as jnp

    import fa_jax

    q, k, v = (to_numpy(x[0]) for x in random_qkv(1, 8, 8, 2, 2, 16, "float32"))

    def loss(q, k, v, cu):
        out = fa_jax.attention_varlen(q, k, v, cu, cu, 8, 8)
        return jnp.sum(out * out), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    for cu in ([0, 4, 50], [0, 6, 3], [-5, 4, 8], [0, 2**31 - 1, 8]):
        (_, out), grads = step(q, k, v, jnp.array(cu, jnp.int32))
        for x in (out, *grads):
            assert np.isfinite(np.asarray(x)).all(), cu
    # [0, 4, 50]: the first sequence is right, the second is clamped to tokens 4..7.
    (_, out), _ = step(q, k, v, jnp.array([0, 4, 50], jnp.int32))
    want, _ = varlen_reference(*(torch.from_numpy(np.asarray(x)) for x in (q, k, v)),
                               torch.tensor([0, 4, 8]), torch.tensor([0, 4, 8]))
    np.testing.assert_allclose(np.asarray(out), want.numpy(), atol=1e-5)


@pytest.mark.gpu
def test_device_cu_seqlens_stay_in_bounds():
    """fa_torch with CUDA cu_seqlens (trusted, not checked): bad values are clamped, and
    rows they leave uncovered read as zeros, not as uninitialised memory."""
    import fa_torch

    q, k, v = (x[0].requires_grad_() for x in random_qkv(1, 28, 28, 2, 2, 16, "float32"))
    for cu, max_seqlen in (([0, 24, 28], 2), ([0, 4, 50], 28), ([0, 6, 3], 28)):
        cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        out = fa_torch.attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        for x in (out, *grads):
            assert torch.isfinite(x).all()
    torch.cuda.synchronize()


def test_non_contiguous_cu_seqlens_and_slopes():
    """cu_seqlens and ALiBi slopes are read by value, whatever their strides."""
    import fa_torch

    q, k, v = (x[0] for x in random_qkv(1, 8, 8, 2, 2, 16, "float32"))
    cu = torch.tensor([0, 1, 4, 6, 8, 7], dtype=torch.int32, device=DEVICE)[::2]
    slopes = torch.tensor([[0.5, 0.1], [0.25, 0.3]], device=DEVICE).T[0]  # [0.5, 0.25], stride 2
    got = fa_torch.attention_varlen(q, k, v, cu, cu, 4, 4, alibi_slopes=slopes)
    want = fa_torch.attention_varlen(q, k, v, cu.contiguous(), cu.contiguous(), 4, 4,
                                     alibi_slopes=slopes.contiguous())
    assert torch.equal(got, want)


@pytest.mark.parametrize("window,same_as", [((2 ** 63, 0), dict(causal=True)),
                                            ((2 ** 64 - 1, -1), {}),
                                            ((2 ** 64, 2 ** 64), {}),
                                            ((3, 2 ** 70), dict(window_size=(3, -1)))],
                         ids=str)
def test_huge_windows_bound_nothing(run, window, same_as):
    """A window side as wide as the sequence is no bound at all: the same answer as
    without it, and never a read outside the arrays (the H200 faulted on 2**63)."""
    q, k, v = random_qkv(1, 20, 24, 2, 1, 16, "float32")
    dout = torch.randn_like(q)
    out, lse, grads = run(q, k, v, dout, window_size=window)
    want_out, want_lse, want_grads = run(q, k, v, dout, **same_as)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)


def test_subnormal_scale_is_zero_in_both_front_ends():
    """A softmax_scale below fp32's normal range acts as 0 (uniform rows) in both front
    ends alike: GPUs and XLA's CPU flush it to zero."""
    q, k, v = random_qkv(1, 8, 8, 1, 1, 16, "float32")
    dout = torch.randn_like(q)
    t_out, t_lse, _ = run_torch(q, k, v, dout, softmax_scale=1e-39)
    j_out, j_lse, _ = run_jax(q, k, v, dout, softmax_scale=1e-39)
    z_out, z_lse, _ = run_torch(q, k, v, dout, softmax_scale=0.0)
    assert torch.equal(t_out, z_out) and torch.equal(t_lse, z_lse)
    assert torch.equal(j_out, z_out.cpu()) and torch.equal(j_lse, z_lse.cpu())
    torch.testing.assert_close(t_out[0, 0], v[0].mean(0))


@pytest.mark.parametrize("seqlens", [(239, 1), (1, 239)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_head_dim_256_causal_short(run, seqlens):
    """flash-attn's test_flash_attn_causal[1-239-True-256-...]: the table's D = 256 entry
    once crashed ptxas at seqlen_k = 1 (fa_kernels.offline compiles it on the CPU)."""
    from .common import check_against_reference

    check_against_reference(run, 2, *seqlens, 2, 2, 256, "bfloat16", True)
