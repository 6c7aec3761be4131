"""fa_jax as a JAX user installs it (``pip install '.[jax]'``: jax, jax-triton, triton; no
PyTorch). Nothing here imports torch: CI also runs this file in a venv without it."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_jax
from fa_kernels import registry, runtime

JAX_ONLY = os.environ.get("FA_JAX_ONLY") == "1"  # set by .ci/run in the venv without torch


def qkv(shape=(2, 37, 4, 32), heads_k=2, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    kv_shape = shape[:2] + (heads_k,) + shape[3:]
    return [jax.random.normal(key, s, jnp.float32).astype(dtype)
            for key, s in zip(keys, (shape, kv_shape, kv_shape))]


@pytest.mark.skipif(not JAX_ONLY, reason="the venv without torch (.ci/run)")
def test_torch_is_not_installed():
    assert importlib.util.find_spec("torch") is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_match_jax(causal, dtype):
    q, k, v = qkv(dtype=dtype)
    tolerance = 2e-5 if dtype == jnp.float32 else 2e-2

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v).astype(jnp.float32) ** 2).sum()

    ours = lambda q, k, v: fa_jax.attention(q, k, v, causal=causal)  # noqa: E731
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    with jax.default_matmul_precision("highest"):  # fp32 products on the GPU (not TF32), as ours
        expected_out = theirs(q, k, v)
        expected = jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(np.asarray(ours(q, k, v), np.float32),
                               np.asarray(expected_out, np.float32), atol=tolerance)
    for name, a, b in zip("qkv", grads, expected):
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=tolerance * max(scale, 1.0), err_msg=f"d{name}")


def test_softcap_and_window_match_a_reference():
    # Softcap runs constexpr * tensor arithmetic (tanh), which each Triton interpreter
    # release has handled differently (fa_kernels.interpreter); GQA and a sliding window.
    q, k, v = qkv()
    cap, (left, right) = 5.0, (9, 3)

    def reference(q, k, v):
        k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / q.shape[-1] ** 0.5
        scores = cap * jnp.tanh(scores / cap)
        rows, cols = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
        scores = jnp.where((cols >= rows - left) & (cols <= rows + right), scores, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v,
                          precision="highest")

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v) ** 2).sum()

    ours = lambda q, k, v: fa_jax.attention(q, k, v, softcap=cap,  # noqa: E731
                                            window_size=(left, right))
    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), atol=2e-5)
    for a, b in zip(jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=2e-5 * max(float(jnp.abs(b).max()), 1.0))


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v: fa_jax.attention(q, k[:, :, :1, :7], v), ValueError, "same shape"),
    (lambda q, k, v: fa_jax.attention(q[..., :3, :], k, v), ValueError, "heads"),
    (lambda q, k, v: fa_jax.attention(q.astype(jnp.int32), k, v), TypeError, "dtype"),
    (lambda q, k, v: fa_jax.attention(q, k, v, softmax_scale="x"), TypeError, "softmax_scale"),
    (lambda q, k, v: fa_jax.attention(q, k, v, window_size=(1,)), (TypeError, ValueError),
     "window_size"),
    (lambda q, k, v: fa_jax.attention(q, k, v, dropout_p=0.1), ValueError, "dropout_seed"),
    (lambda q, k, v: fa_jax.attention([[1.0]], k, v), TypeError, "q"),
])
def test_bad_input_is_refused_before_any_launch(monkeypatch, call, error, match):
    launched = []
    for name, kernel in list(registry.KERNELS.items()):
        monkeypatch.setitem(registry.KERNELS, name, launched.append)
    with pytest.raises(error, match=match):
        call(*qkv())
    assert launched == []


@pytest.mark.skipif(not runtime.interpreting(), reason="the CPU launch path")
def test_error_inside_a_launch_reaches_the_caller(monkeypatch):
    class Broken:
        arg_names = registry.KERNELS["attention_forward"].arg_names

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("forced failure inside the launch")
            return launch

    monkeypatch.setitem(registry.KERNELS, "attention_forward", Broken())
    with pytest.raises(Exception, match="forced failure inside the launch"):
        jax.block_until_ready(jax.jit(fa_jax.attention)(*qkv()))
