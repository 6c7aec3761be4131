"""fa_jax.flax: the attention_fn of Flax's attention modules, against Flax's own."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_jax.flax as fa_flax


@pytest.fixture(autouse=True)
def true_fp32_matmuls():
    # Flax's own attention is the yardstick here: on the GPU jax's default fp32 matmul
    # is tf32 (about 1e-3 relative), so ask for true fp32 (our fp32 kernels always are).
    with jax.default_matmul_precision("float32"):
        yield


def inputs(shape=(2, 24, 4, 16), kv_len=None, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    kv_shape = shape[:-3] + (kv_len or shape[-3],) + shape[-2:]
    return (jax.random.normal(keys[0], shape), jax.random.normal(keys[1], kv_shape),
            jax.random.normal(keys[2], kv_shape))


def test_plain_matches_flax():
    q, k, v = inputs()
    np.testing.assert_allclose(fa_flax.attention_fn(q, k, v), nn.dot_product_attention(q, k, v),
                               atol=2e-5, rtol=1e-5)


def test_causal_mask_becomes_the_causal_flag():
    q, k, v = inputs()
    mask = nn.make_causal_mask(jnp.ones(q.shape[:2]))
    assert fa_flax._is_causal_mask(mask, 24, 24)
    np.testing.assert_allclose(fa_flax.attention_fn(q, k, v, mask=mask),
                               nn.dot_product_attention(q, k, v, mask=mask), atol=2e-5, rtol=1e-5)


def test_padding_mask_and_bias_under_jit():
    q, k, v = inputs(kv_len=30)
    valid = jnp.arange(30)[None, :] < jnp.array([[30], [11]])
    mask = nn.make_attention_mask(jnp.ones((2, 24)), valid)
    bias = jax.random.normal(jax.random.PRNGKey(7), (1, 4, 24, 30))
    ours = jax.jit(fa_flax.attention_fn)(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(ours, nn.dot_product_attention(q, k, v, bias=bias, mask=mask),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [(30, 11), (0, 17)], ids=["padded", "empty_entry"])
def test_concrete_padding_mask_becomes_key_counts(lengths):
    # A key padding mask seen on the host reaches the kernels as seqused_k (no dense bias);
    # outputs and gradients as Flax's, the entry with no key attending uniformly.
    q, k, v = inputs(kv_len=30)
    valid = jnp.arange(30)[None, :] < jnp.array(lengths)[:, None]
    mask = nn.make_attention_mask(jnp.ones((2, 24)), valid)
    counts = fa_flax._key_counts(mask, (2,), 24, 30)
    assert counts is not None and counts.tolist() == list(lengths)
    assert fa_flax._key_counts(nn.make_causal_mask(jnp.ones((2, 30))), (2,), 30, 30) is None
    dout = jax.random.normal(jax.random.PRNGKey(3), q.shape)

    def grads(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask=mask), q, k, v)
        return (out, *vjp(dout))

    for ours, theirs in zip(grads(fa_flax.attention_fn), grads(nn.dot_product_attention)):
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-5)


def test_several_batch_dims():
    q, k, v = inputs(shape=(2, 3, 10, 2, 16))
    mask = jnp.tril(jnp.ones((10, 10), bool))[None, None, None]
    np.testing.assert_allclose(fa_flax.attention_fn(q, k, v, mask=mask),
                               nn.dot_product_attention(q, k, v, mask=mask), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_inside_multi_head_attention(causal):
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 20, 32))
    ours = nn.MultiHeadDotProductAttention(
        num_heads=4, attention_fn=fa_flax.make_attention_fn(causal=causal))
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = theirs.init(jax.random.PRNGKey(0), x)
    mask = nn.make_causal_mask(jnp.ones((2, 20))) if causal else None
    got = jax.jit(lambda p, x: ours.apply(p, x))(params, x)
    np.testing.assert_allclose(got, theirs.apply(params, x, mask=mask), atol=3e-5, rtol=1e-5)
    grad = jax.grad(lambda p: jnp.sum(ours.apply(p, x) ** 2))(params)
    ref = jax.grad(lambda p: jnp.sum(theirs.apply(p, x, mask=mask) ** 2))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), grad, ref)


def test_dropout_needs_and_uses_the_rng():
    q, k, v = inputs()
    a = fa_flax.attention_fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(3))
    b = fa_flax.attention_fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(3))
    assert jnp.array_equal(a, b)
    assert not jnp.array_equal(a, fa_flax.attention_fn(q, k, v))
    with pytest.raises(ValueError, match="needs dropout_rng"):
        fa_flax.attention_fn(q, k, v, dropout_rate=0.5)
    # deterministic=True turns dropout off, as in Flax.
    assert jnp.array_equal(fa_flax.attention_fn(q, k, v, dropout_rate=0.5, deterministic=True),
                           fa_flax.attention_fn(q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_inside_nnx_multi_head_attention(causal):
    from flax import nnx

    x = jax.random.normal(jax.random.PRNGKey(2), (2, 18, 32))
    kwargs = dict(num_heads=4, in_features=32, decode=False)
    ours = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0), attention_fn=fa_flax.attention_fn)
    theirs = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))  # the same weights
    mask = nnx.make_causal_mask(jnp.ones((2, 18))) if causal else None
    got = ours(x, is_causal=causal) if causal else ours(x)
    np.testing.assert_allclose(got, theirs(x, mask=mask), atol=3e-5, rtol=1e-5)
