"""Packed variable-length batches, both front ends, against per-sequence references."""
import numpy as np
import pytest
import torch

from .common import DEVICE, TORCH_DTYPES, assert_close_to_reference, from_numpy, to_numpy
from .reference import varlen_reference


def packed(lengths_q, lengths_k, heads_q, heads_k, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    make = lambda *s: torch.randn(*s, generator=gen).to(TORCH_DTYPES[dtype]).to(DEVICE)  # noqa: E731
    q, k, v = make(tq, heads_q, head_dim), make(tk, heads_k, head_dim), make(tk, heads_k, head_dim)
    cu = lambda lengths: torch.tensor(np.concatenate([[0], np.cumsum(lengths)]),  # noqa: E731
                                      dtype=torch.int32, device=DEVICE)
    dout = make(tq, heads_q, head_dim)
    return q, k, v, cu(lengths_q), cu(lengths_k), dout


def run_varlen(front, q, k, v, cu_q, cu_k, max_q, max_k, dout, **options):
    if front == "torch":
        import fa_torch

        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = fa_torch.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True,
                                             **options)
        out.backward(dout)
        return out.detach(), lse, [x.grad for x in leaves]
    import jax

    import fa_jax

    cu_qn, cu_kn = to_numpy(cu_q), to_numpy(cu_k)

    def fwd(q, k, v):
        return fa_jax.attention_varlen(q, k, v, cu_qn, cu_kn, max_q, max_k, return_lse=True,
                                       **options)

    (out, lse), vjp = jax.vjp(jax.jit(fwd), *(to_numpy(x) for x in (q, k, v)))
    grads = vjp((to_numpy(dout), np.zeros(lse.shape, np.float32)))
    return from_numpy(out), from_numpy(lse), [from_numpy(g) for g in grads]


def reference_varlen(q, k, v, cu_q, cu_k, dout, compute_dtype, **options):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = varlen_reference(*leaves, cu_q.cpu(), cu_k.cpu(), compute_dtype=compute_dtype,
                                **options)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), [x.grad for x in leaves]


CASES = [
    ([17, 1, 40, 0, 33], [17, 1, 40, 0, 33]),  # a sequence of length 0
    ([5, 30, 64], [70, 12, 64]),               # Sq != Sk per sequence, both ways
    ([100], [37]),
]


@pytest.mark.parametrize("lengths", CASES, ids=["with_empty", "uneven", "single"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_against_reference(front, lengths, causal, dtype):
    lengths_q, lengths_k = lengths
    q, k, v, cu_q, cu_k, dout = packed(lengths_q, lengths_k, 4, 2, 40, dtype)
    out, lse, grads = run_varlen(front, q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dout,
                                 causal=causal)
    t_out, t_lse, t_grads = reference_varlen(q, k, v, cu_q, cu_k, dout, torch.float64, causal=causal)
    f_out, f_lse, f_grads = reference_varlen(q, k, v, cu_q, cu_k, dout, q.dtype, causal=causal)
    assert lse.shape == (4, sum(lengths_q))
    assert_close_to_reference("out", out, t_out, f_out, dtype)
    assert_close_to_reference("lse", lse, t_lse, f_lse, dtype)
    for name, g, t, f in zip(("dq", "dk", "dv"), grads, t_grads, f_grads):
        assert_close_to_reference(name, g, t, f, dtype, factor=3.0)


def test_varlen_with_window_alibi_dropout(front):
    lengths = [30, 0, 50]
    q, k, v, cu_q, cu_k, dout = packed(lengths, lengths, 2, 1, 32, "float16", seed=2)
    slopes = torch.tensor([0.1, 0.3], device=DEVICE)
    options = dict(causal=True, window_size=(12, -1), softcap=3.0)
    front_slopes = slopes if front == "torch" else to_numpy(slopes)
    out, lse, grads = run_varlen(front, q, k, v, cu_q, cu_k, 50, 50, dout,
                                 alibi_slopes=front_slopes, **options)
    t_out, _, t_grads = reference_varlen(q, k, v, cu_q, cu_k, dout, torch.float64,
                                         alibi_slopes=slopes, **options)
    f_out, _, f_grads = reference_varlen(q, k, v, cu_q, cu_k, dout, q.dtype,
                                         alibi_slopes=slopes, **options)
    assert_close_to_reference("out", out, t_out, f_out, "float16")
    for name, g, t, f in zip(("dq", "dk", "dv"), grads, t_grads, f_grads):
        assert_close_to_reference(name, g, t, f, "float16", factor=3.0)


def test_varlen_parity_and_padded_equivalence():
    import fa_torch

    lengths = [20, 45]
    q, k, v, cu_q, cu_k, dout = packed(lengths, lengths, 2, 2, 32, "bfloat16", seed=3)
    t_out, t_lse, t_grads = run_varlen("torch", q, k, v, cu_q, cu_k, 45, 45, dout, causal=True)
    j_out, j_lse, j_grads = run_varlen("jax", q, k, v, cu_q, cu_k, 45, 45, dout, causal=True)
    assert torch.equal(t_out.cpu(), j_out) and torch.equal(t_lse.cpu(), j_lse)
    for a, b in zip(t_grads, j_grads):
        assert torch.equal(a.cpu(), b)
    # The second sequence alone, in the padded layout, gives the same numbers.
    alone = fa_torch.attention(q[None, 20:], k[None, 20:], v[None, 20:], causal=True)
    torch.testing.assert_close(alone[0], t_out[20:].to(alone.device), atol=0, rtol=0)


def test_deterministic_backward_with_gqa_and_varlen(front):
    # No atomics: the same bits every run (100 runs on the GPU, a few in the interpreter).
    from .common import ON_GPU

    lengths = [300, 0, 129, 511] if ON_GPU else [40, 0, 23]
    q, k, v, cu_q, cu_k, dout = packed(lengths, lengths, 8, 2, 64, "bfloat16", seed=6)
    runs = 100 if ON_GPU else 3
    first = run_varlen(front, q, k, v, cu_q, cu_k, max(lengths), max(lengths), dout,
                       causal=True, deterministic=True)
    for _ in range(runs - 1):
        again = run_varlen(front, q, k, v, cu_q, cu_k, max(lengths), max(lengths), dout,
                           causal=True, deterministic=True)
        assert torch.equal(again[0], first[0])
        for a, b in zip(again[2], first[2]):
            assert torch.equal(a, b)
