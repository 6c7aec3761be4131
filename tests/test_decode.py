"""Short queries against long keys (decode): packed GQA and split-KV.

Packed GQA (a K/V head's group of query heads as the rows of one tile) is chosen by the
plan for seqlen_q < 64 with GQA, on the CPU as on the GPU. Split-KV (slices of the keys
in separate programs, merged by a combine kernel) is chosen from the GPU's SM count, so
on the CPU these tests force it through the plan's ``num_splits``; on the GPU the public
calls below split by themselves (the test checks that they do).
"""
import numpy as np
import pytest
import torch

from fa_kernels import plan as fa_plan

from .common import (DEVICE, ON_GPU, assert_close_to_reference, check_against_reference,
                     check_with_every_option, forward_plan_jax, forward_plan_torch, from_numpy,
                     launch_arrays, random_qkv, reference_grads, to_numpy)


@pytest.mark.parametrize("seqlen_q, heads_q, heads_k", [(1, 8, 2), (5, 6, 2), (1, 4, 4),
                                                        (3, 4, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128] if ON_GPU else [64])  # 128: a tuned few-rows entry
def test_decode_against_reference(run, seqlen_q, heads_q, heads_k, causal, head_dim):
    # On the GPU, 2 x heads_k programs over 4000 keys leave the SMs idle: split-KV.
    seqlen_k = 4000 if ON_GPU else 150
    check_against_reference(run, 2, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
                            "bfloat16", causal)


def test_decode_with_every_option(run):
    seqlen_k = 3000 if ON_GPU else 140
    check_with_every_option(run, 2, 3, seqlen_k, 8, 2, 40, "float16", seed=5,
                            window_left=100, softcap=4.0, dropout_p=0.2)


@pytest.mark.skipif(not ON_GPU, reason="the SM count decides split-KV on the GPU only")
def test_public_decode_call_splits_on_the_gpu():
    from fa_torch import _launch

    problem = fa_plan.check_problem((2, 1, 8, 64), (2, 4000, 2, 64), (2, 4000, 2, 64),
                                    "bfloat16", "bfloat16", "bfloat16")
    fwd = fa_plan.forward_plan(problem, capability=_launch.capability(DEVICE),
                               num_sms=_launch.num_sms(DEVICE))
    assert fwd.pack_gqa and fwd.num_splits > 1


# ---------------------------------------------------------------- split-KV, forced


CASES = {
    "decode-gqa": dict(shape=(2, 1, 200, 8, 2), options={}),
    "causal-odd": dict(shape=(1, 37, 150, 2, 2), options=dict(causal=True)),
    "window": dict(shape=(2, 20, 180, 4, 2), options=dict(causal=True, window_size=(40, 0))),
    # causal with more queries than keys: the first 10 rows see no key in any split
    "rows-see-nothing": dict(shape=(1, 140, 130, 2, 1), options=dict(causal=True)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_forward(case, num_splits):
    batch, seqlen_q, seqlen_k, heads_q, heads_k = CASES[case]["shape"]
    options = CASES[case]["options"]
    dtype = "bfloat16"
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, 32, dtype, seed=7)
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, dtype, dtype, dtype, **options)
    fwd = fa_plan.forward_plan(problem, capability=None if not ON_GPU else
                               torch.cuda.get_device_capability(), num_splits=num_splits)
    assert fwd.num_splits == num_splits and len(fwd.launches) == 2
    arrays = launch_arrays(q, k, v)
    out, lse = forward_plan_torch(fwd, arrays)
    causal = options.get("causal", False)
    window = options.get("window_size", (-1, -1))
    dout = torch.zeros_like(q)
    t_out, t_lse, _ = reference_grads(q, k, v, dout, causal, None, torch.float64,
                                      window_size=window)
    f_out, f_lse, _ = reference_grads(q, k, v, dout, causal, None, q.dtype, window_size=window)
    assert_close_to_reference("out", out, t_out, f_out, dtype)
    assert_close_to_reference("lse", lse, t_lse, f_lse, dtype)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(t_lse.cpu()))
    if case == "rows-see-nothing":
        empty = torch.isinf(lse).transpose(1, 2).cpu()  # (B, Sq, Hq)
        assert empty.sum() == 10 * 2 and not out.cpu()[empty].any()
    # The same kernels from jax: the same bits.
    j_out, j_lse = forward_plan_jax(fwd, arrays)
    assert torch.equal(out.cpu(), j_out) and torch.equal(lse.cpu(), j_lse)


def test_split_kv_varlen():
    from fa_torch import _launch

    lengths_q, lengths_k = [1, 3, 0, 2], [90, 150, 40, 0]
    heads_q, heads_k, dim, dtype = 4, 2, 32, "float16"
    cu_q = torch.tensor(np.cumsum([0] + lengths_q), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor(np.cumsum([0] + lengths_k), dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lengths_q), heads_q, dim, generator=gen).half().to(DEVICE)
    k = torch.randn(sum(lengths_k), heads_k, dim, generator=gen).half().to(DEVICE)
    v = torch.randn(sum(lengths_k), heads_k, dim, generator=gen).half().to(DEVICE)
    problem = fa_plan.check_problem(
        q.shape, k.shape, v.shape, dtype, dtype, dtype, causal=True,
        varlen=dict(cu_seqlens_q_shape=cu_q.shape, cu_seqlens_k_shape=cu_k.shape,
                    cu_seqlens_q_dtype="int32", cu_seqlens_k_dtype="int32",
                    max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k)))
    fwd = fa_plan.forward_plan(problem, capability=_launch.capability(DEVICE), num_splits=3)
    assert fwd.num_splits == 3 and fwd.pack_gqa
    out, lse = forward_plan_torch(fwd, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q,
                                    "cu_seqlens_k": cu_k})
    for b in range(len(lengths_q)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lengths_q[b] == 0:
            continue
        qb, kb, vb = q[None, sq], k[None, sk], v[None, sk]
        zeros = torch.zeros_like(qb)
        t_out, t_lse, _ = reference_grads(qb, kb, vb, zeros, True, None, torch.float64)
        f_out, f_lse, _ = reference_grads(qb, kb, vb, zeros, True, None, q.dtype)
        assert_close_to_reference(f"out[{b}]", out[sq][None], t_out, f_out, dtype)
        assert_close_to_reference(f"lse[{b}]", lse[:, sq][None], t_lse, f_lse, dtype)
    assert torch.equal(out[int(cu_q[3]):].cpu(), torch.zeros_like(out[int(cu_q[3]):].cpu()))


def test_split_kv_chosen_by_the_plan_with_every_option(run, monkeypatch):
    # The interpreter never splits by itself; as a 132-SM GPU would, the plan splits this
    # small grid (2 x 2 programs over 300 keys), and forward and backward stay right.
    from fa_jax import _launch as jax_launch
    from fa_torch import _launch as torch_launch

    monkeypatch.setattr(torch_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(jax_launch, "num_sms", lambda: 132)
    problem = fa_plan.check_problem((2, 5, 4, 40), (2, 300, 2, 40), (2, 300, 2, 40),
                                    "bfloat16", "bfloat16", "bfloat16")
    assert fa_plan.forward_plan(problem, capability=None, num_sms=132).num_splits > 1
    check_with_every_option(run, 2, 5, 300, 4, 2, 40, "bfloat16", seed=21,
                            window_left=200, softcap=3.0, dropout_p=0.25)
