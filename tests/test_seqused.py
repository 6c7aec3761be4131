"""seqused_k: each batch entry attends to its first seqused_k[b] keys only (a KV cache's
filled part), in the padded and the packed layout, both front ends, against per-entry
references on the sliced keys."""
import numpy as np
import pytest
import torch

from fa_kernels import plan as fa_plan

from .common import (DEVICE, ON_GPU, TORCH_DTYPES, assert_close_to_reference,
                     forward_plan_jax, forward_plan_torch, from_numpy, launch_arrays,
                     random_qkv, to_numpy)
from .reference import attention_reference


def run_used(front, q, k, v, seqused_k, dout, **options):
    """(out, lse, [dq, dk, dv]) of attention with seqused_k, forward and backward."""
    if front == "torch":
        import fa_torch

        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = fa_torch.attention(*leaves, seqused_k=seqused_k, return_lse=True, **options)
        out.backward(dout)
        return out.detach(), lse.detach(), [x.grad for x in leaves]
    import jax

    import fa_jax

    options = {n: to_numpy(x) if isinstance(x, torch.Tensor) else x for n, x in options.items()}

    def fwd(q, k, v, used):
        return fa_jax.attention(q, k, v, seqused_k=used, return_lse=True, **options)

    (out, lse), vjp = jax.vjp(jax.jit(fwd), *(to_numpy(x) for x in (q, k, v, seqused_k)))
    grads = vjp((to_numpy(dout), np.zeros(lse.shape, np.float32)))[:3]
    return from_numpy(out), from_numpy(lse), [from_numpy(g) for g in grads]


def reference_used(q, k, v, seqused_k, dout, compute_dtype, **options):
    """Each entry through the reference with its used keys alone; the unused key rows get
    a zero gradient because nothing reads them."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    for b, used in enumerate(seqused_k.tolist()):
        out, lse = attention_reference(leaves[0][b:b + 1], leaves[1][b:b + 1, :used],
                                       leaves[2][b:b + 1, :used], compute_dtype=compute_dtype,
                                       **options)
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def check_used(front, seqused_k, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype,
               seed=0, poison=False, **options):
    q, k, v = random_qkv(len(seqused_k), seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype,
                         seed)
    used = torch.tensor(seqused_k, dtype=torch.int32, device=DEVICE)
    if poison:  # what a cache may hold past its filled part: nothing of it may show
        for b, n in enumerate(seqused_k):
            k[b, n:] = float("nan")
            v[b, n:] = float("inf")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(q)
    out, lse, grads = run_used(front, q, k, v, used, dout, **options)
    t_out, t_lse, t_grads = reference_used(q, k, v, used.cpu(), dout, torch.float64, **options)
    f_out, f_lse, f_grads = reference_used(q, k, v, used.cpu(), dout, q.dtype, **options)
    assert_close_to_reference("out", out, t_out, f_out, dtype)
    assert_close_to_reference("lse", lse, t_lse, f_lse, dtype)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(t_lse.cpu())), "lse -inf rows differ"
    for name, g, t, f in zip(("dq", "dk", "dv"), grads, t_grads, f_grads):
        assert_close_to_reference(name, g, t, f, dtype, factor=3.0)
    for b, n in enumerate(seqused_k):  # exactly zero, not just small
        assert not grads[1][b, n:].any() and not grads[2][b, n:].any()


@pytest.mark.parametrize("seqused_k", [[70, 33, 0], [1, 64, 69]], ids=["full_part_none", "odd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_seqused_k_against_reference(front, seqused_k, causal, dtype):
    check_used(front, seqused_k, 45, 70, 4, 2, 40, dtype, causal=causal)


def test_seqused_k_with_window_alibi_softcap(front):
    slopes = torch.tensor([0.2, 0.05], device=DEVICE)
    check_used(front, [50, 17], 9, 64, 2, 1, 32, "float16", seed=3, causal=True,
               window_size=(20, -1), softcap=5.0, alibi_slopes=slopes)


def test_seqused_k_never_reads_the_unused_keys(front):
    # NaN keys and infinite values past each entry's count: out, lse and grads as if absent.
    check_used(front, [30, 5, 0], 7, 48, 4, 4, 64, "bfloat16", seed=4, poison=True, causal=True)


@pytest.mark.parametrize("front_name", ["torch", "jax"])
def test_seqused_k_with_split_kv(front_name):
    # Splits past an entry's used keys hold nothing; the combine must ignore them.
    batch, seqlen_k = 3, 300 if not ON_GPU else 3000
    q, k, v = random_qkv(batch, 2, seqlen_k, 8, 2, 64, "bfloat16", seed=5)
    used = torch.tensor([seqlen_k, 40, 0], dtype=torch.int32, device=DEVICE)
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16", seqused_k_shape=(batch,),
                                    seqused_k_dtype="int32")
    capability = torch.cuda.get_device_capability() if ON_GPU else None
    if front_name == "jax":  # (what fa_jax's launcher can pass: no device descriptors)
        from fa_jax import _launch

        options = _launch.plan_options()
    else:
        options = {}
    fwd = fa_plan.forward_plan(problem, capability=capability, num_splits=4, **options)
    assert fwd.num_splits == 4
    runner = forward_plan_torch if front_name == "torch" else forward_plan_jax
    out, lse = runner(fwd, launch_arrays(q, k, v, seqused_k=used))
    t_out, t_lse, _ = reference_used(q, k, v, used.cpu(), torch.zeros_like(q), torch.float64)
    f_out, f_lse, _ = reference_used(q, k, v, used.cpu(), torch.zeros_like(q), q.dtype)
    assert_close_to_reference("out", out, t_out, f_out, "bfloat16")
    assert_close_to_reference("lse", lse, t_lse, f_lse, "bfloat16")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_k_against_reference(front, causal):
    from .test_varlen import packed, reference_varlen, run_varlen

    lengths_q, lengths_k, used = [17, 1, 40, 9], [30, 12, 64, 20], [30, 0, 41, 3]
    q, k, v, cu_q, cu_k, dout = packed(lengths_q, lengths_k, 4, 2, 40, "bfloat16", seed=7)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out, lse, grads = run_varlen(front, q, k, v, cu_q, cu_k, 40, 64, dout, causal=causal,
                                 seqused_k=seqused if front == "torch" else to_numpy(seqused))
    # The reference: the same sequences with their keys cut to the used ones.
    starts = cu_k[:-1].tolist()
    keep = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, used)]).to(DEVICE)
    cu_used = torch.tensor(np.concatenate([[0], np.cumsum(used)]), dtype=torch.int32)
    truth = reference_varlen(q, k[keep], v[keep], cu_q, cu_used, dout, torch.float64,
                             causal=causal)
    plain = reference_varlen(q, k[keep], v[keep], cu_q, cu_used, dout, q.dtype, causal=causal)
    assert_close_to_reference("out", out, truth[0], plain[0], "bfloat16")
    assert_close_to_reference("lse", lse, truth[1], plain[1], "bfloat16")
    assert_close_to_reference("dq", grads[0], truth[2][0], plain[2][0], "bfloat16", factor=3.0)
    for i, name in ((1, "dk"), (2, "dv")):
        assert_close_to_reference(name, grads[i][keep.cpu()], truth[2][i], plain[2][i],
                                  "bfloat16", factor=3.0)
        unused = torch.ones(k.shape[0], dtype=torch.bool)
        unused[keep.cpu()] = False
        assert not grads[i][unused].any()


def test_seqused_k_parity_vmap_and_traced_clamp():
    import jax
    import jax.numpy as jnp

    import fa_jax
    import fa_torch

    q, k, v = random_qkv(3, 20, 50, 4, 2, 32, "bfloat16", seed=8)
    used = torch.tensor([50, 21, 0], dtype=torch.int32, device=DEVICE)
    t_out = fa_torch.attention(q, k, v, causal=True, seqused_k=used)
    qn, kn, vn, un = (to_numpy(x) for x in (q, k, v, used))
    j_out = fa_jax.attention(qn, kn, vn, causal=True, seqused_k=un)
    assert torch.equal(t_out.cpu(), from_numpy(j_out))  # the same bits in both front ends
    # vmap folds the mapped axis into the batch: seqused_k folds with it.
    mapped = jax.vmap(lambda q, k, v, u: fa_jax.attention(q, k, v, causal=True, seqused_k=u))(
        qn[:, None], kn[:, None], vn[:, None], un[:, None])
    assert torch.equal(from_numpy(mapped[:, 0]), from_numpy(j_out))
    # A traced count cannot be checked: the kernels clamp it into [0, seqlen_k].
    clamped = jax.jit(lambda u: fa_jax.attention(qn, kn, vn, causal=True, seqused_k=u))(
        jnp.asarray([500, 21, -3], jnp.int32))
    assert torch.equal(from_numpy(clamped), from_numpy(j_out))


def test_seqused_k_reads_no_host_descriptor():
    # Host descriptors span the whole seqlen_k: rows past a used count would reach the sums.
    shape = (2, 4096, 8, 128)
    problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16",
                                    seqused_k_shape=(2,), seqused_k_dtype="int32")
    fwd = fa_plan.forward_plan(problem, capability=(9, 0), tma=True)
    bwd = fa_plan.backward_plan(problem, capability=(9, 0), tma=True)
    for launch in (fwd.launch, bwd.dkdv, bwd.dq):
        assert launch.constexprs["HAS_SEQUSED_K"] and not launch.constexprs["HOST_TMA"]
        assert not any(b.host_descriptor for b in launch.blocks)
    assert all(o.zeroed for o in bwd.dkdv.outputs if o.name in ("dk", "dv"))


@pytest.mark.parametrize("seqused_k, error, match", [
    (np.array([3, 4], np.int64), TypeError, r"seqused_k must be int32; got int64"),
    (np.array([3, 4, 5], np.int32), ValueError, r"seqused_k must have shape \(batch,\) = \(2,\)"),
    (np.array([3, 11], np.int32), ValueError, r"seqused_k\[1\] must be in \[0, 10\].*got 11"),
    (np.array([-1, 4], np.int32), ValueError, r"seqused_k\[0\] must be in \[0, 10\].*got -1"),
])
def test_seqused_k_bad_input(front, seqused_k, error, match):
    q, k, v = random_qkv(2, 4, 10, 2, 2, 16, "float32")
    if front == "torch":
        import fa_torch

        if ON_GPU and "must be in" in match:
            pytest.skip("counts on the GPU are clamped by the kernels: checking needs a sync")
        with pytest.raises(error, match=match):
            fa_torch.attention(q, k, v, seqused_k=torch.from_numpy(seqused_k).to(DEVICE))
    else:
        import fa_jax

        with pytest.raises(error, match=match):
            fa_jax.attention(*(to_numpy(x) for x in (q, k, v)), seqused_k=seqused_k)
