"""fa_jax.flax: the attention_fn of Flax's attention modules, against Flax's own."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_jax.flax as fa_flax

from .common import jaxpr_avals


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


@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(window_size=(5, 3))],
                         ids=["plain", "causal", "window"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["lengths", "lengths_and_mask"])
def test_key_lengths_under_jit(options, with_mask):
    # Lengths are data: traced under jit they still say "entry b's first n_b keys", as
    # Flax's padding mask; plain, they reach the kernels as seqused_k (no bias is built).
    q, k, v = inputs(kv_len=24)
    lengths = jnp.array([24, 0], jnp.int32)  # (a whole entry, and one with no key)
    extra = jax.random.uniform(jax.random.PRNGKey(4), (2, 1, 24, 24)) > 0.3 if with_mask \
        else None
    padding = nn.make_attention_mask(jnp.ones((2, 24)), jnp.arange(24)[None] < lengths[:, None],
                                     dtype=bool)
    mask = padding if extra is None else padding & extra
    if options.get("causal"):
        mask = mask & nn.make_causal_mask(jnp.ones((2, 24)), dtype=bool)
    if "window_size" in options:
        rows, cols = jnp.arange(24)[:, None], jnp.arange(24)[None, :]
        mask = mask & ((cols >= rows - 5) & (cols <= rows + 3))[None, None]
    dout = jax.random.normal(jax.random.PRNGKey(3), q.shape)

    @jax.jit
    def ours(q, k, v, lengths):
        fn = fa_flax.make_attention_fn(key_value_seq_lengths=lengths, **options)
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask=extra), q, k, v)
        return (out, *vjp(dout))

    out, vjp = jax.vjp(lambda q, k, v: nn.dot_product_attention(q, k, v, mask=mask), q, k, v)
    for got, want in zip(ours(q, k, v, lengths), (out, *vjp(dout))):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    if not options and extra is None:
        fn = fa_flax.make_attention_fn(key_value_seq_lengths=lengths)
        jaxpr = jax.make_jaxpr(lambda q, k, v: fn(q, k, v))(q, k, v)
        shapes = [shape for shape, _ in jaxpr_avals(jaxpr)]
        assert shapes and not any(shape[-2:] == (24, 24) for shape in shapes), shapes


def test_key_lengths_are_checked():
    q, k, v = inputs()
    for lengths in (jnp.array([3.0, 4.0]), jnp.array([3], jnp.int32)):
        with pytest.raises(ValueError, match="key_value_seq_lengths must be an int32 array"):
            fa_flax.make_attention_fn(key_value_seq_lengths=lengths)(q, k, v)


def test_key_lengths_inside_a_jitted_model():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, lengths):
            attention_fn = fa_flax.make_attention_fn(key_value_seq_lengths=lengths)
            return nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=attention_fn)(x)

    class Reference(nn.Module):
        @nn.compact
        def __call__(self, x, lengths):
            mask = nn.make_attention_mask(jnp.ones(x.shape[:2]),
                                          jnp.arange(x.shape[1])[None] < lengths[:, None])
            return nn.MultiHeadDotProductAttention(num_heads=4)(x, mask=mask)

    x = jax.random.normal(jax.random.PRNGKey(1), (2, 20, 32))
    lengths = jnp.array([20, 7], jnp.int32)
    params = Reference().init(jax.random.PRNGKey(0), x, lengths)
    loss = lambda model: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda p, x, n: jnp.sum(model.apply(p, x, n) ** 2)))
    value, grads = loss(Model())(params, x, lengths)
    want, want_grads = loss(Reference())(params, x, lengths)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4),
                 grads, want_grads)


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


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_per_call_in_nnx(causal):
    # nnx (and a linen module made once) take per-call lengths as the mask,
    # mask=key_padding(lengths): under jit, outputs and gradients equal Flax's with the
    # padding mask, and without causality no (Sq, Sk) array is built.
    from flax import nnx

    x = jax.random.normal(jax.random.PRNGKey(2), (2, 18, 32))
    lengths = jnp.array([18, 5], jnp.int32)
    kwargs = dict(num_heads=4, in_features=32, decode=False)
    ours = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0), attention_fn=fa_flax.attention_fn)
    theirs = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))  # the same weights

    @nnx.jit
    def our_loss(model, x, lengths):
        out = model(x, mask=fa_flax.key_padding(lengths), is_causal=causal)
        return jnp.sum(out[0] ** 2) + jnp.sum(out[1, :5] ** 2)

    @nnx.jit
    def their_loss(model, x, lengths):
        mask = nnx.make_attention_mask(jnp.ones((2, 18)), jnp.arange(18)[None] < lengths[:, None])
        if causal:
            mask = nnx.combine_masks(mask, nnx.make_causal_mask(jnp.ones((2, 18))))
        out = model(x, mask=mask)
        return jnp.sum(out[0] ** 2) + jnp.sum(out[1, :5] ** 2)

    value, grads = nnx.value_and_grad(our_loss)(ours, x, lengths)
    want, want_grads = nnx.value_and_grad(their_loss)(theirs, x, lengths)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4),
                 nnx.state(grads), nnx.state(want_grads))
    if not causal:
        jaxpr = jax.make_jaxpr(lambda x, n: ours(x, mask=fa_flax.key_padding(n)))(x, lengths)
        shapes = [shape for shape, _ in jaxpr_avals(jaxpr)]
        assert not any(shape[-2:] == (18, 18) for shape in shapes), shapes


def test_key_padding_is_checked_and_meets_the_other_lengths():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"key_padding\(lengths\) must be an int32 array"):
        fa_flax.attention_fn(q, k, v, mask=fa_flax.key_padding(jnp.array([3.0, 4.0])))
    both = fa_flax.make_attention_fn(key_value_seq_lengths=jnp.array([20, 9], jnp.int32))(
        q, k, v, mask=fa_flax.key_padding(jnp.array([7, 24], jnp.int32)))
    want = fa_flax.make_attention_fn(key_value_seq_lengths=jnp.array([7, 9], jnp.int32))(q, k, v)
    np.testing.assert_array_equal(both, want)
