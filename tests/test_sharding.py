"""fa_jax on sharded arrays: under jit, inputs sharded over batch and/or heads run per
shard (custom_partitioning), give the unsharded bits, and compile with no gather of
q, k or v. On the CPU the 4 devices come from --xla_force_host_platform_device_count."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fa_jax

from .common import random_qkv, to_numpy

GATHERS = re.compile(r"all-gather|all-to-all|collective-permute")


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (the CPU run sets --xla_force_host_platform_device_count=4)")
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def qkv(shape, dtype="float32", seed=0):
    return [jnp.asarray(to_numpy(x.cpu())) for x in random_qkv(*shape, dtype, seed=seed)]


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def gathers(fn, *args) -> list[str]:
    hlo = fn.lower(*args).compile().as_text()
    return [line.strip()[:160] for line in hlo.splitlines() if GATHERS.search(line)]


SPECS = {"batch": P("data", None, None, None), "heads": P(None, None, "model", None),
         "both": P("data", None, "model", None)}


@pytest.mark.parametrize("where", list(SPECS))
@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(window_size=(5, 3), softcap=5.0),
    dict(dropout_p=0.3, dropout_seed=11),
    dict(alibi_slopes="per-batch", causal=True),
    dict(seqused_k="per-batch", causal=True),
], ids=["causal", "window-softcap", "dropout", "alibi", "seqused_k"])
def test_sharded_equals_unsharded_without_gathers(mesh, where, options):
    # GQA 4 query heads over 2 K/V heads: each "model" shard holds one K/V head and
    # its two query heads.
    q, k, v = qkv((4, 24, 40, 4, 2, 16))
    dout = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape, np.float32))
    options = dict(options)
    if options.get("alibi_slopes") == "per-batch":
        options["alibi_slopes"] = jnp.linspace(0.1, 0.8, 16, dtype=jnp.float32).reshape(4, 4)
    if options.get("seqused_k") == "per-batch":  # split with the batch, like q
        options["seqused_k"] = jnp.asarray([40, 17, 0, 33], jnp.int32)

    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: fa_jax.attention(q, k, v, **options), q, k, v)
        return out, vjp(dout)

    expected_out, expected_grads = jax.jit(fwd_bwd)(q, k, v, dout)
    spec = SPECS[where]
    args = [put(x, mesh, spec) for x in (q, k, v, dout)]
    step = jax.jit(fwd_bwd)
    out, grads = step(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected_out))
    for g, e in zip(grads, expected_grads):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    assert gathers(step, *args) == []


def test_sharded_bias_gets_its_gradient_per_shard(mesh):
    q, k, v = qkv((4, 16, 16, 4, 4, 16))
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((4, 4, 16, 16), np.float32))

    def loss(q, k, v, bias):
        return jnp.sum(fa_jax.attention(q, k, v, bias=bias) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 3)))
    expected = grad(q, k, v, bias)
    spec = SPECS["both"]
    args = [put(x, mesh, spec) for x in (q, k, v)] + [put(bias, mesh, P("data", "model"))]
    got = grad(*args)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    assert gathers(grad, *args) == []


def test_heads_not_divisible_fall_back_to_replicated_heads(mesh):
    # One K/V head (MQA) cannot be split over 2 shards: heads stay whole, batch still splits.
    q, k, v = qkv((4, 16, 16, 2, 1, 16))
    fn = jax.jit(lambda q, k, v: fa_jax.attention(q, k, v, causal=True))
    expected = fn(q, k, v)
    args = [put(q, mesh, SPECS["both"])] + [put(x, mesh, SPECS["batch"]) for x in (k, v)]
    out = fn(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_varlen_sharded_over_heads(mesh):
    q, k, v = (x[0] for x in qkv((1, 30, 30, 4, 2, 16)))
    cu = jnp.array([0, 7, 7, 30], jnp.int32)
    fn = jax.jit(lambda q, k, v: fa_jax.attention_varlen(q, k, v, cu, cu, 23, 23, causal=True))
    expected = fn(q, k, v)
    args = [put(x, mesh, P(None, "model", None)) for x in (q, k, v)]
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(expected))
    assert gathers(fn, *args) == []
