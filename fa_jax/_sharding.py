"""Sharding: under ``jit``, q, k, v sharded over batch and/or heads run per shard.

Each kernel op (the forward; the whole backward) is a ``custom_partitioning`` function.
Its rule names every dimension of every operand and result by its role:

    b batch   h query heads = (k g)   k key/value heads   g query heads per K/V head
    s, t query and key positions   d head dim   n, m packed (varlen) tokens

Batch and heads may be sharded (query head ``h`` of shard i belongs to K/V head
``h // g`` of the same shard, since heads are grouped contiguously); positions, the
head dim and everything else are replicated (the partitioner gathers them if a caller
sharded them). The shard's kernels then see an ordinary smaller problem; dropout gets
the shard's global batch and head offsets (from iota operands sharded like the batch
and heads), so its mask is the unsharded one.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SHARDABLE = ("b", "k")  # factors that may be sharded ("h" follows "k")


def _qkv_roles(name: str, varlen: bool):
    if name in ("q", "out", "dout", "dq"):
        return ("n", "h", "d") if varlen else ("b", "s", "h", "d")
    if name in ("k", "v", "dk", "dv"):
        return ("m", "k", "d") if varlen else ("b", "t", "k", "d")
    if name in ("lse", "lse_lo", "dlse"):
        return ("h", "n") if varlen else ("b", "h", "s")
    return None


def roles(name: str, shape, problem) -> tuple:
    """The role of each dimension of one operand or result (None: replicated)."""
    if problem.paged and name in ("k", "v"):  # the page pool: heads may be sharded
        return (None, None, "k", "d")
    if name == "block_table" and problem.paged and not problem.varlen:
        return ("b", None)
    fixed = _qkv_roles(name, problem.varlen)
    if fixed is not None:
        return fixed
    full = {"b": problem.batch, "h": problem.heads_q, "s": problem.seqlen_q,
            "t": problem.seqlen_k}
    if name in ("bias", "dbias") and len(shape) == 4 and not problem.varlen:
        return tuple(r if n == full[r] else None for r, n in zip("bhst", shape))
    if name == "slopes" and problem.alibi_shape is not None:
        return ("h",) if len(shape) == 1 else ("b", "h")
    if name == "batch_index" and not problem.varlen:
        return ("b",)
    if name == "seqused_k" and problem.seqused_k and not problem.varlen:
        return ("b",)
    if name == "head_index":
        return ("h",)
    return (None,) * len(shape)


def _rule(in_roles, out_roles, group: int, heads_k: int):
    """The Shardy rule string, with q heads as the compound factor (k g) (just k without
    GQA; just g for MQA, where Shardy refuses a compound with a size-1 factor)."""
    heads = "k" if group == 1 else ("g" if heads_k == 1 else "(k g)")
    unique = iter(range(1_000_000))

    def dims(rs):
        out = []
        for r in rs:
            if r is None:
                out.append(f"r{next(unique)}")
            elif r == "h":
                out.append(heads)
            else:
                out.append(r)
        return " ".join(out)

    text = (", ".join(dims(r) for r in in_roles) + " -> "
            + ", ".join(dims(r) for r in out_roles))
    # in order of first appearance: Shardy wants the special factors sorted by index
    words = text.replace("(", " ").replace(")", " ").replace(",", " ").split()
    factors = list(dict.fromkeys(w for w in words if w != "->"))
    replicated = tuple(f for f in factors if f not in SHARDABLE)
    sizes = {"g": group} if heads == "(k g)" else {}
    return text, replicated, sizes


def _axes_size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes)


def _placement(mesh, q_sharding, problem):
    """Mesh axes for the batch and the heads, read off q's sharding where valid."""
    if not isinstance(q_sharding, NamedSharding):
        return {}
    spec = tuple(q_sharding.spec) + (None,) * 4
    batch_axes = None if problem.varlen else spec[0]
    head_axes = spec[1] if problem.varlen else spec[2]
    if batch_axes is not None and problem.batch % _axes_size(mesh, batch_axes):
        batch_axes = None
    if head_axes is not None and problem.heads_k % _axes_size(mesh, head_axes):
        head_axes = None
    return {"b": batch_axes, "h": head_axes, "k": head_axes}


def _shardings(mesh, roles_list, placement):
    return [NamedSharding(mesh, P(*(placement.get(r) for r in rs))) for rs in roles_list]


def partitioned(body, in_names, in_shapes, out_names, out_shapes, problem):
    """``body`` (arrays -> tuple of arrays, any sizes) as a custom_partitioning op."""
    in_roles = [roles(n, s, problem) for n, s in zip(in_names, in_shapes)]
    out_roles = [roles(n, s, problem) for n, s in zip(out_names, out_shapes)]
    rule, replicated, sizes = _rule(in_roles, out_roles, problem.group_size, problem.heads_k)

    op = custom_partitioning(body)

    def partition(mesh, arg_shapes, result_shape):
        placement = _placement(mesh, arg_shapes[0].sharding, problem)
        return (mesh, body, tuple(_shardings(mesh, out_roles, placement)),
                tuple(_shardings(mesh, in_roles, placement)))

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        placement = _placement(mesh, arg_shapes[0].sharding, problem)
        return tuple(_shardings(mesh, out_roles, placement))

    op.def_partition(partition=partition,
                     infer_sharding_from_operands=infer_sharding_from_operands,
                     propagate_user_sharding=None, sharding_rule=rule,
                     need_replication_factors=replicated, **sizes)
    return op


def global_index_operands(problem):
    """The iota operands that tell a shard its first global batch entry and head."""
    batch = jnp.arange(1 if problem.varlen else problem.batch, dtype=jnp.int32)
    return batch, jnp.arange(problem.heads_q, dtype=jnp.int32)


def with_offsets(seed, batch_index, head_index):
    """The kernels' (4,) seed: the seed's two words, then this shard's offsets."""
    return jnp.concatenate([seed[:2], batch_index[:1], head_index[:1]]).astype(jnp.int32)

