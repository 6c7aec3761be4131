"""Masks as frameworks pass them: a finite "big negative" bias (finfo.min of the dtype,
-1e9, -1e30, BERT's -1e4) or -inf, on whole rows, parts of rows and none, in outputs,
LSE and every gradient; and Flax's boolean masks through the Flax adapter."""
import numpy as np
import pytest
import torch

from .common import DEVICE, TORCH_DTYPES, check_against_reference, run_jax, run_torch

MASK_VALUES = {"finfo.min": None, "-1e4": -1e4, "-1e9": -1e9, "-1e30": -1e30, "-inf": float("-inf")}


def masked_bias(batch, heads, seqlen_q, seqlen_k, dtype, value, seed=3):
    """A random bias where rows 0-2 are masked on every key, odd rows >= 5 on every other
    key, key 1 for the rest (padding-like), and the others not at all."""
    torch_dtype = TORCH_DTYPES[dtype]
    if value is None:
        value = torch.finfo(torch_dtype).min
    elif value != float("-inf") and abs(value) > torch.finfo(torch_dtype).max:
        pytest.skip(f"{value} is beyond {dtype}'s range")
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(batch, heads, seqlen_q, seqlen_k, generator=gen)
    bias[:, :, :3, :] = value
    bias[:, :, 5::2, ::2] = value
    bias[:, :, 5:, 1] = value
    return bias.to(torch_dtype)


# Every dtype with blocks that cross the ends (33 x 20); fp32 also with whole blocks
# (16 x 16: the path with no mask work).
SHAPES = [("float16", (33, 20)), ("bfloat16", (33, 20)), ("float32", (33, 20)),
          ("float32", (16, 16))]


@pytest.mark.parametrize("value", MASK_VALUES, ids=str)
@pytest.mark.parametrize("dtype,seqlens", SHAPES, ids=[f"{d}-{s[0]}x{s[1]}" for d, s in SHAPES])
def test_masked_rows_against_reference(run, dtype, value, seqlens):
    """Fully masked rows by a finite bias attend uniformly (every framework's softmax of
    equal logits); by -inf they see no key (zeros, LSE -inf, no gradient)."""
    seqlen_q, seqlen_k = seqlens
    bias = masked_bias(2, 2, seqlen_q, seqlen_k, dtype, MASK_VALUES[value])
    check_against_reference(run, 2, seqlen_q, seqlen_k, 2, 1, 16, dtype, False,
                            bias_values=bias)


@pytest.mark.parametrize("value", [-1e30, float(torch.finfo(torch.float32).min)], ids=str)
def test_finite_mask_on_every_key_gives_uniform_rows(run, value):
    """The exact case: fp32, every key of rows 0-2 masked. Probabilities 1/S, so the
    output is the mean of V, the LSE is the bias + log S, and dV gets dO / S from them."""
    seqlen = 32
    bias = torch.zeros(1, 1, seqlen, seqlen)
    bias[..., :3, :] = value
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seqlen, 1, 16, generator=gen) for _ in range(4))
    dout[:, 3:] = 0  # only the masked rows send a gradient
    out, lse, (dq, dk, dv, _) = run(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                               dout.to(DEVICE), bias=bias.to(DEVICE))
    out, lse, dq, dk, dv = (x.cpu() for x in (out, lse, dq, dk, dv))
    torch.testing.assert_close(out[0, :3], v[0].mean(0).expand(3, 1, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, 0, :3], torch.full((3,), value, dtype=torch.float32)
                               + float(np.log(seqlen)), rtol=1e-6, atol=0)
    torch.testing.assert_close(dv[0], dout[0, :3].sum(0).expand(seqlen, 1, 16) / seqlen,
                               rtol=1e-5, atol=1e-6)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()


@pytest.mark.parametrize("seqlen", [8, 16, 17, 32])
def test_minus_inf_on_every_key_is_zero_not_nan(run, seqlen):
    """-inf on every key of a row: output 0, LSE -inf, zero gradients, at lengths that
    fill whole blocks (no masked block) and at lengths that do not."""
    bias = torch.zeros(1, 2, seqlen, seqlen)
    bias[:, :, :3] = float("-inf")
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, seqlen, 2, 16, generator=gen).to(DEVICE) for _ in range(4))
    out, lse, (dq, dk, dv, dbias) = run(q, k, v, dout, bias=bias.to(DEVICE))
    assert torch.equal(out[:, :3].cpu(), torch.zeros(1, 3, 2, 16))
    assert torch.isneginf(lse[:, :, :3].cpu()).all()
    assert torch.equal(dq[:, :3].cpu(), torch.zeros(1, 3, 2, 16))
    assert torch.equal(dbias[:, :, :3].cpu(), torch.zeros(1, 2, 3, seqlen))
    for x in (out, lse[:, :, 3:], dq, dk, dv, dbias):
        assert not torch.isnan(x).any()


def test_nan_input_gives_nan_lse(run):
    """A NaN in a row's inputs makes its output and its LSE NaN: -inf would claim that the
    row saw no key."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 8, 1, 16, generator=gen) for _ in range(4))
    q[0, 2, 0, 0] = float("nan")
    out, lse, _ = run(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), dout.to(DEVICE))
    assert torch.isnan(lse[0, 0, 2]).item() and torch.isnan(out[0, 2]).all()
    assert torch.isfinite(lse[0, 0, torch.arange(8) != 2]).all()


# ------------------------------------------------------------------------------ Flax


def _flax_masks():
    import flax.linen as nn
    import jax.numpy as jnp

    batch, seqlen = 2, 9
    valid = jnp.array([[1] * 9, [1] * 5 + [0] * 4], bool)
    left = valid[:, ::-1]
    causal = nn.make_causal_mask(jnp.ones((batch, seqlen)))
    return {"none": None,
            "padding": nn.make_attention_mask(valid, valid),
            "causal+left padding": nn.combine_masks(causal, nn.make_attention_mask(left, left)),
            "query padding only": nn.make_attention_mask(valid, jnp.ones((batch, seqlen), bool))}


@pytest.mark.parametrize("mask_name", ["none", "padding", "causal+left padding",
                                       "query padding only"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_flax_adapter_gives_flax_results(mask_name, with_bias):
    """Outputs and gradients (q, k, v, bias) equal Flax's own attention for boolean masks,
    fully masked rows included, where Flax's ``where`` passes no gradient."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import fa_jax.flax as fa_flax

    mask = _flax_masks()[mask_name]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(key, (2, 9, 2, 16)) for key in keys[:3])
    bias = jax.random.normal(keys[3], (2, 2, 9, 9)) if with_bias else None

    def loss(fn, q, k, v, bias):
        out = fn(q, k, v, bias=bias, mask=mask)
        return jnp.sum(out * jnp.cos(out)), out

    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    ours = jax.value_and_grad(lambda *a: loss(fa_flax.attention_fn, *a), argnums, has_aux=True)
    theirs = jax.value_and_grad(lambda *a: loss(nn.dot_product_attention, *a), argnums,
                                has_aux=True)
    (_, out), grads = jax.jit(ours)(q, k, v, bias)
    with jax.default_matmul_precision("highest"):  # (not TF32 on the GPU: the fp32 truth)
        (_, want), want_grads = theirs(q, k, v, bias)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)
    for name, g, w in zip("q k v bias".split(), grads, want_grads):
        np.testing.assert_allclose(g, w, atol=5e-6, rtol=1e-5, err_msg=f"d{name}")


def test_flax_nnx_padding_mask_gradients():
    """nnx.MultiHeadAttention with our attention_fn and a padding mask: the parameters'
    gradients equal those of nnx's own attention."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import fa_jax.flax as fa_flax

    x = jax.random.normal(jax.random.PRNGKey(2), (2, 9, 32))
    mask = _flax_masks()["causal+left padding"]
    kwargs = dict(num_heads=2, in_features=32, decode=False)
    ours = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0), attention_fn=fa_flax.attention_fn)
    theirs = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))

    def loss(model):
        return jnp.sum(jnp.sin(model(x, mask=mask)))

    with jax.default_matmul_precision("highest"):  # (fp32 products on the GPU too)
        got, want = nnx.grad(loss)(ours), nnx.grad(loss)(theirs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_torch_and_jax_agree_on_finite_masks():
    """The same masked bias through both front ends: the same forward bits."""
    bias = masked_bias(1, 2, 24, 24, "float32", -1e30)
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 24, 2, 16, generator=gen).to(DEVICE) for _ in range(4))
    t_out, t_lse, _ = run_torch(q, k, v, dout, bias=bias.to(DEVICE))
    j_out, j_lse, _ = run_jax(q, k, v, dout, bias=bias.to(DEVICE))
    assert torch.equal(t_out.cpu(), j_out) and torch.equal(t_lse.cpu(), j_lse)

