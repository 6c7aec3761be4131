"""fa_jax under JAX transformations: jit, grad, vmap (nested), remat, scan, eval_shape."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_jax

from .common import jaxpr_avals, random_qkv, to_numpy


def qkv(shape=(2, 33, 40, 4, 2, 32), dtype="float32", seed=0):
    return [jnp.asarray(to_numpy(x.cpu())) for x in random_qkv(*shape, dtype, seed=seed)]


def loss(q, k, v, causal=True):
    return jnp.sum(fa_jax.attention(q, k, v, causal=causal).astype(jnp.float32) ** 2)


def test_jit_equals_eager():
    q, k, v = qkv()
    assert jnp.array_equal(jax.jit(fa_jax.attention)(q, k, v), fa_jax.attention(q, k, v))


def test_value_and_grad_matches_reference():
    import torch

    from .reference import attention_reference

    q, k, v = qkv()
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [torch.from_numpy(np.asarray(x, np.float64)).requires_grad_() for x in (q, k, v)]
    out, _ = attention_reference(*leaves, causal=True)
    reference_loss = (out ** 2).sum()
    reference_loss.backward()
    np.testing.assert_allclose(value, reference_loss.item(), rtol=1e-5)
    for g, leaf in zip(grads, leaves):
        np.testing.assert_allclose(np.asarray(g), leaf.grad.numpy(), atol=1e-4, rtol=1e-4)


def test_vmap_equals_loop():
    q, k, v = qkv()
    stack = [jnp.stack([x, x * 0.5, -x]) for x in (q, k, v)]
    batched = jax.vmap(lambda q, k, v: fa_jax.attention(q, k, v, causal=True))(*stack)
    for i in range(3):
        single = fa_jax.attention(stack[0][i], stack[1][i], stack[2][i], causal=True)
        assert jnp.array_equal(batched[i], single)


def test_vmap_unbatched_kv_and_nested():
    q, k, v = qkv()
    qs = jnp.stack([q, 2 * q])
    out = jax.vmap(fa_jax.attention, in_axes=(0, None, None))(qs, k, v)
    assert jnp.array_equal(out[1], fa_jax.attention(2 * q, k, v))
    qss = jnp.stack([qs, -qs])
    nested = jax.vmap(jax.vmap(fa_jax.attention, in_axes=(0, None, None)),
                      in_axes=(0, None, None))(qss, k, v)
    assert nested.shape == (2, 2, *q.shape)
    assert jnp.array_equal(nested[1, 0], fa_jax.attention(-q, k, v))


def test_grad_of_vmap():
    q, k, v = qkv()
    stack = [jnp.stack([x, x]) for x in (q, k, v)]
    g = jax.grad(lambda q, k, v: jnp.sum(jax.vmap(loss)(q, k, v)))(*stack)
    g1 = jax.grad(loss)(q, k, v)
    assert jnp.array_equal(g[0], g1) and jnp.array_equal(g[1], g1)


def test_remat_and_scan():
    q, k, v = qkv()

    def layers(x):
        def step(h, _):
            return jax.checkpoint(lambda h: fa_jax.attention(h, k, v, causal=True))(h), None
        h, _ = jax.lax.scan(step, x, None, length=2)
        return jnp.sum(h ** 2)

    def plain(x):
        h = fa_jax.attention(fa_jax.attention(x, k, v, causal=True), k, v, causal=True)
        return jnp.sum(h ** 2)

    np.testing.assert_allclose(jax.grad(layers)(q), jax.grad(plain)(q), rtol=1e-6, atol=1e-7)


def test_eval_shape():
    q, k, v = qkv()
    shapes = jax.eval_shape(lambda q, k, v: fa_jax.attention(q, k, v, return_lse=True), q, k, v)
    assert shapes[0].shape == q.shape and shapes[1].shape == (2, 4, 33)
    assert shapes[1].dtype == jnp.float32


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_dtypes_kept(dtype):
    q, k, v = qkv(dtype=dtype)
    out = jax.jit(fa_jax.attention)(q, k, v)
    assert out.dtype == q.dtype
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(g.dtype == q.dtype for g in grads)


def test_vmap_with_bias_slopes_and_seeds():
    q, k, v = qkv(shape=(2, 20, 24, 2, 1, 16))
    bias = jax.random.normal(jax.random.PRNGKey(1), (3, 1, 2, 20, 24))
    slopes = jnp.array([0.1, 0.2], jnp.float32)
    qs = jnp.stack([q, -q, 0.5 * q])
    fn = lambda q, b: fa_jax.attention(q, k, v, bias=b, alibi_slopes=slopes)  # noqa: E731
    batched = jax.vmap(fn)(qs, bias)
    for i in range(3):
        np.testing.assert_array_equal(batched[i], fn(qs[i], bias[i]))
    grads = jax.grad(lambda b: jnp.sum(jax.vmap(fn)(qs, b) ** 2))(bias)
    single = jax.grad(lambda b: jnp.sum(fn(qs[1], b) ** 2))(bias[1])
    np.testing.assert_allclose(grads[1], single, rtol=1e-6, atol=1e-6)
    # A mapped dropout seed maps sequentially: element i equals the unmapped call.
    seeds = jnp.arange(3, dtype=jnp.uint32)
    drop = jax.vmap(lambda s: fa_jax.attention(q, k, v, dropout_p=0.5, dropout_seed=s))(seeds)
    np.testing.assert_array_equal(drop[2], fa_jax.attention(q, k, v, dropout_p=0.5,
                                                            dropout_seed=jnp.uint32(2)))


@pytest.mark.parametrize("bias_shape", [(2, 4, 33, 40), (1, 1, 33, 40)])
def test_bias_gradient_only_where_the_bias_is_differentiated(bias_shape):
    # A bias that is not differentiated (a mask made into a bias, a constant) costs no
    # dense fp32 (B, Hq, Sq, Sk) gradient, as in fa_torch; the other gradients are the
    # same bits either way, and the bias's own is there when asked for.
    q, k, v = qkv()
    bias = jax.random.normal(jax.random.PRNGKey(3), bias_shape).astype(jnp.float16)

    def f(q, k, v, bias):
        return jnp.sum(fa_jax.attention(q, k, v, bias=bias, causal=True) ** 2)

    dense = ((2, 4, 33, 40), "float32")
    without = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v, bias)
    assert dense not in set(jaxpr_avals(without))
    with_bias = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert dense in set(jaxpr_avals(with_bias))
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v, bias)
    *all_grads, dbias = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for g, h in zip(grads, all_grads):
        np.testing.assert_array_equal(g, h)
    assert dbias.shape == bias_shape and dbias.dtype == jnp.float16
    assert float(jnp.abs(dbias.astype(jnp.float32)).sum()) > 0
    # Through stop_gradient too: no dense gradient.
    held = jax.make_jaxpr(jax.grad(lambda q: f(q, k, v, jax.lax.stop_gradient(bias))))(q)
    assert dense not in set(jaxpr_avals(held))
