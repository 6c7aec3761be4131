"""Ring attention (fa_jax.ring): the sequence sharded over 4 devices gives the unsharded
attention and gradients, contiguous and zigzag, causal and not, with GQA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fa_jax
from fa_jax import ring

from .common import random_qkv, to_numpy

N = 4


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N:
        pytest.skip("needs 4 devices (the CPU run sets --xla_force_host_platform_device_count=4)")
    return Mesh(np.array(jax.devices()[:N]), ("seq",))


@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "contiguous"),
                                           (True, "zigzag")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_equals_unsharded(mesh, causal, layout, dtype):
    q, k, v = (jnp.asarray(to_numpy(x.cpu())) for x in random_qkv(2, 48, 48, 4, 2, 16, dtype))
    dout = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), q.dtype)

    def reference(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: fa_jax.attention(q, k, v, causal=causal), q, k, v)
        return out, vjp(dout)

    def sharded(q, k, v, dout):
        fn = lambda q, k, v: ring.ring_attention_sharded(  # noqa: E731
            q, k, v, mesh, "seq", causal=causal, layout=layout)
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(dout)

    order = (lambda x: ring.zigzag(x, N)) if layout == "zigzag" else (lambda x: x)
    restore = (lambda x: ring.unzigzag(x, N)) if layout == "zigzag" else (lambda x: x)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(order(x), spec) for x in (q, k, v, dout)]
    out, grads = jax.jit(sharded)(*args)
    expected_out, expected_grads = jax.jit(reference)(q, k, v)
    # The merge adds one rounding of each partial output (fp32 accumulation).
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(restore(out), np.float32),
                               np.asarray(expected_out, np.float32), **tol)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(np.asarray(restore(g), np.float32), np.asarray(e, np.float32),
                                   **tol)


def test_zigzag_round_trip_and_validation(mesh):
    x = jnp.arange(2 * 16).reshape(2, 16)
    assert jnp.array_equal(ring.unzigzag(ring.zigzag(x, N), N), x)
    assert ring.zigzag(x, N)[0, :4].tolist() == [0, 1, 14, 15]  # device 0: chunks 0 and 7
    q = jnp.zeros((1, 3, 2, 8))
    with pytest.raises(ValueError, match="local seqlen must be even"):
        ring.ring_attention(q, q, q, "seq", causal=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring.ring_attention(q, q, q, "seq", layout="striped")
