"""fa_jax.dot_product_attention against jax.nn.dot_product_attention(implementation="xla"),
for the argument combinations both accept: outputs and every gradient (q, k, v, bias)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fa_jax  # noqa: E402

from .common import jaxpr_avals  # noqa: E402

CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(3, 1)),
    "causal window": dict(is_causal=True, local_window_size=2),
    "bias": dict(bias=True),
    "mask": dict(mask=True),
    "mask causal bias": dict(mask=True, is_causal=True, bias=True),
    "kv lengths": dict(key_value_seq_lengths=(9, 4)),
    # an entry with no key (uniform attention) and one past kv_len (every key)
    "kv lengths bias": dict(key_value_seq_lengths=(0, 12), bias=True),
    "q and kv lengths": dict(query_seq_lengths=(7, 3), key_value_seq_lengths=(9, 4)),
    "q lengths bias": dict(query_seq_lengths=(0, 5), bias=True),
    "lengths causal": dict(query_seq_lengths=(7, 3), key_value_seq_lengths=(7, 3),
                           is_causal=True),
    "scale": dict(scale=0.3),
}


def _inputs(q_len, kv_len, heads, heads_kv, case, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (2, q_len, heads, 16))
    k = jax.random.normal(keys[1], (2, kv_len, heads_kv, 16))
    v = jax.random.normal(keys[2], (2, kv_len, heads_kv, 16))
    options = dict(CASES[case])
    bias = jax.random.normal(keys[3], (2, heads, q_len, kv_len)) if options.pop("bias",
                                                                                 False) else None
    if options.pop("mask", False):
        mask = jax.random.bernoulli(keys[4], 0.7, (2, 1, q_len, kv_len))
        options["mask"] = mask.at[1, :, 2].set(False)  # a fully masked row
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in options:
            options[name] = jnp.array(options[name], jnp.int32)
    return q, k, v, bias, options


SHAPES = {"self gqa": (9, 9, 4, 2), "Sq<Sk": (7, 9, 2, 2), "Sq>Sk mqa": (9, 7, 2, 1)}
# Every case on self-attention; where Sq != Sk the diagonals differ (jax.nn's top-left
# against the kernels' bottom-right): the cases that exercise that mapping.
GRID = ([(case, "self gqa") for case in CASES]
        + [(case, shape) for shape in ("Sq<Sk", "Sq>Sk mqa")
           for case in ("plain", "causal", "window", "causal window", "mask causal bias",
                        "kv lengths", "q and kv lengths")])


@pytest.mark.parametrize("case,shape", GRID, ids=[f"{c}-{s}" for c, s in GRID])
def test_matches_jax_nn(case, shape):
    q_len, kv_len, heads, heads_kv = SHAPES[shape]
    q, k, v, bias, options = _inputs(q_len, kv_len, heads, heads_kv, case)

    def loss(fn, q, k, v, bias):
        out = fn(q, k, v, bias, **options)
        return jnp.sum(out * jnp.cos(out)), out

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    ours = jax.jit(jax.value_and_grad(
        lambda *a: loss(fa_jax.dot_product_attention, *a), argnums, has_aux=True))
    theirs = jax.value_and_grad(
        lambda *a: loss(lambda *b, **o: jax.nn.dot_product_attention(*b, **o,
                                                                     implementation="xla"), *a),
        argnums, has_aux=True)
    (_, out), grads = ours(q, k, v, bias)
    with jax.default_matmul_precision("highest"):
        (_, want), want_grads = theirs(q, k, v, bias)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)
    for name, g, w in zip("q k v bias".split(), grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("case", ["kv lengths", "q and kv lengths"])
def test_lengths_alone_build_no_mask(case):
    # Key lengths reach the kernels as seqused_k, query lengths zero rows afterwards:
    # nothing of shape (.., Sq, Sk) is made, in the forward or the gradient.
    q, k, v, _, options = _inputs(9, 7, 2, 2, case)

    def loss(q, k, v):
        return jnp.sum(fa_jax.dot_product_attention(q, k, v, **options) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v)
    shapes = [shape for shape, _ in jaxpr_avals(jaxpr)]
    assert shapes and not any(shape[-2:] == (9, 7) for shape in shapes), shapes


def test_residual_of_padded_query_rows_is_minus_inf():
    q, k, v, _, options = _inputs(9, 9, 2, 2, "q and kv lengths")
    out, lse = fa_jax.dot_product_attention(q, k, v, return_residual=True, **options)
    assert np.all(np.asarray(lse[0, 7:]) == -np.inf) and np.all(np.isfinite(lse[0, :7]))
    assert np.all(np.asarray(out[1, 3:]) == 0)


def test_unbatched_and_residual():
    q, k, v, _, _ = _inputs(9, 9, 2, 2, "plain")
    out, lse = fa_jax.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                            return_residual=True)
    with jax.default_matmul_precision("highest"):
        want, want_lse = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                                      return_residual=True)
    assert out.shape == want.shape == (9, 2, 16) and lse.shape == want_lse.shape == (9, 2)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-6, rtol=1e-5)


def test_extras_and_errors():
    q, k, v, _, _ = _inputs(9, 9, 2, 2, "plain")
    capped = fa_jax.dot_product_attention(q, k, v, softcap=2.0)
    np.testing.assert_allclose(capped, fa_jax.attention(q, k, v, softcap=2.0), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"mask must be boolean"):
        fa_jax.dot_product_attention(q, k, v, mask=jnp.zeros((1, 1, 9, 9)))
    with pytest.raises(ValueError, match=r"query_seq_lengths must be an int32 array of shape"):
        fa_jax.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([3, 4, 5]))
    with pytest.raises(ValueError, match=r"local_window_size must be an int or a pair"):
        fa_jax.dot_product_attention(q, k, v, local_window_size=(-2, 1))
