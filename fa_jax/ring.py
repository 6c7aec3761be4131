"""Ring attention (context parallelism): the sequence sharded over a mesh axis.

Inside ``shard_map``, each of the ``n`` devices on ``axis_name`` holds a slice of the
sequence of q, k and v. The K/V slices travel around the ring (``lax.ppermute``), one
hop per step; at each step a device attends its queries to the K/V slice it holds with
the ordinary kernels and merges the partial result with its LSE:

    lse = logaddexp(lse_a, lse_b)      out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

The backward runs the ring again: with the merged (global) out and LSE, the kernels'
backward on one K/V slice gives exactly that slice's share of dq, dk and dv; dq stays,
and dk, dv travel with their K/V slice and reach its owner after the last hop. Memory
per device stays one slice of q, k, v (no device ever holds the whole sequence).

Causal attention with the sequence cut into ``n`` contiguous slices leaves device 0
one block of work and device n-1 n blocks. The ``"zigzag"`` layout balances it: the
sequence is cut into ``2n`` chunks and device i holds chunks i and 2n-1-i, so every
step costs every device the same (``zigzag`` / ``unzigzag`` reorder a global array).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fa_kernels import plan as fa_plan

from . import ops


def zigzag(x, n: int, axis: int = 1):
    """Global sequence order -> zigzag order for ``n`` devices (chunks i, 2n-1-i)."""
    chunks = jnp.split(x, 2 * n, axis=axis)
    order = [c for i in range(n) for c in (chunks[i], chunks[2 * n - 1 - i])]
    return jnp.concatenate(order, axis=axis)


def unzigzag(x, n: int, axis: int = 1):
    """Inverse of ``zigzag``."""
    chunks = jnp.split(x, 2 * n, axis=axis)
    out = [None] * (2 * n)
    for i in range(n):
        out[i], out[2 * n - 1 - i] = chunks[2 * i], chunks[2 * i + 1]
    return jnp.concatenate(out, axis=axis)


def ring_attention(q, k, v, axis_name, *, causal: bool = False, softmax_scale=None,
                   layout: str = "zigzag"):
    """Attention of this device's slice of q against the whole sequence of k and v.

    Call inside ``shard_map`` (or see ``ring_attention_sharded``). q ``(B, S_local, Hq, D)``,
    k and v ``(B, S_local, Hk, D)``: this device's slice of a sequence sharded over
    ``axis_name``, in ``layout`` order ("contiguous" slices, or "zigzag", which balances
    causal work). Differentiable. Returns this device's slice of the output.
    """
    causal, scale, layout = fa_plan.check_ring(q.shape, k.shape, v.shape, causal, layout,
                                               softmax_scale)
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"ring_attention needs the mesh axis {axis_name!r} bound: call it "
                         f"inside jax.shard_map over that axis, or use "
                         f"ring_attention_sharded") from None
    return _ring(axis_name, causal, scale, layout)(q, k, v)


def ring_attention_sharded(q, k, v, mesh, axis_name, *, causal: bool = False,
                           softmax_scale=None, layout: str = "zigzag", batch_axis=None,
                           head_axis=None):
    """``ring_attention`` over global arrays whose sequence (dim 1) is sharded over
    ``axis_name`` of ``mesh`` (already in ``layout`` order: see ``zigzag``); batch and
    heads may be sharded over other mesh axes too."""
    fa_plan.check_ring(q.shape, k.shape, v.shape, causal, layout, softmax_scale)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh "
                         f"{tuple(mesh.axis_names)}")
    spec = P(batch_axis, axis_name, head_axis, None)
    fn = functools.partial(ring_attention, axis_name=axis_name, causal=causal,
                           softmax_scale=softmax_scale, layout=layout)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)


# ----------------------------------------------------------------------------- the ring


def _merge(out, lse, out_b, lse_b):
    """Merge two partial attentions by their LSEs (fp32; -inf rows contribute nothing)."""
    new = jnp.logaddexp(lse, lse_b)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)
    wa = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))
    wb = jnp.where(jnp.isneginf(lse_b), 0.0, jnp.exp(lse_b - safe))
    to_rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # (B, H, S) -> (B, S, H, 1)  # noqa: E731
    return out * to_rows(wa) + out_b.astype(jnp.float32) * to_rows(wb), new


def _attend(q, k, v, causal, scale):
    out, lse = ops.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    return out.astype(jnp.float32), lse


def _grads(q, k, v, out, lse, dout, causal, scale):
    return ops.attention_backward(q, k, v, out, lse, dout, causal=causal, softmax_scale=scale)


def _part(x, which: str, axis: int = 1):
    """The "all", "first" or "second" half of a slice along ``axis``."""
    if which == "all":
        return x
    half = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0 if which == "first" else half,
                                half if which == "first" else x.shape[axis], axis=axis)


def _placed(x, which: str, fill, axis: int = 1):
    """A result for half of a slice as one for all of it (``fill`` in the other half)."""
    if which == "all":
        return x
    other = jnp.full_like(x, fill)
    return jnp.concatenate([x, other] if which == "first" else [other, x], axis=axis)


def _by_source(parts, step, source, me, compute):
    """``compute(part)`` for the part of the source's slice this step sees (the device
    index is traced: both sides are compiled, one runs)."""
    own, earlier, later = parts
    if step == 0:
        return compute(own)
    if earlier == later:
        return compute(earlier)
    return jax.lax.cond(source < me, lambda: compute(earlier), lambda: compute(later))


def _step_forward(q, k, v, part, scale):
    """(out, lse) of the local queries against the visible ``part`` of a K/V slice."""
    if part is None:
        return (jnp.zeros(q.shape, jnp.float32),
                jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32))
    out, lse = _attend(_part(q, part.queries), _part(k, part.keys), _part(v, part.keys),
                       part.causal, scale)
    return _placed(out, part.queries, 0.0), _placed(lse, part.queries, -jnp.inf, axis=2)


def _step_backward(q, k, v, out, lse, dout, part, scale):
    """(dq, dk, dv) shares, fp32, of the visible ``part`` of a K/V slice."""
    if part is None:
        return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                jnp.zeros(v.shape, jnp.float32))
    rows, keys = part.queries, part.keys
    dq, dk, dv = _grads(_part(q, rows), _part(k, keys), _part(v, keys), _part(out, rows),
                        _part(lse, rows, axis=2), _part(dout, rows), part.causal, scale)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return (_placed(f32(dq), rows, 0.0), _placed(f32(dk), keys, 0.0),
            _placed(f32(dv), keys, 0.0))


@functools.lru_cache(maxsize=None)
def _ring(axis_name, causal, scale, layout):
    parts = fa_plan.ring_schedule(causal, layout)

    def forward(q, k, v):
        n = jax.lax.axis_size(axis_name)
        me = jax.lax.axis_index(axis_name)
        to_next = [(j, (j + 1) % n) for j in range(n)]
        out = jnp.zeros(q.shape, jnp.float32)
        lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
        k_here, v_here = k, v
        for step in range(n):
            source = (me - step) % n
            out, lse = _merge(out, lse, *_by_source(
                parts, step, source, me, lambda part: _step_forward(q, k_here, v_here, part,
                                                                    scale)))
            if step < n - 1:
                k_here, v_here = jax.lax.ppermute((k_here, v_here), axis_name, to_next)
        return out.astype(q.dtype), lse

    @jax.custom_vjp
    def ring(q, k, v):
        return forward(q, k, v)[0]

    def ring_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def ring_bwd(residuals, dout):
        q, k, v, out, lse = residuals
        n = jax.lax.axis_size(axis_name)
        me = jax.lax.axis_index(axis_name)
        to_next = [(j, (j + 1) % n) for j in range(n)]
        dq = jnp.zeros(q.shape, jnp.float32)
        dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
        k_here, v_here = k, v
        for step in range(n):
            source = (me - step) % n
            dq_s, dk_s, dv_s = _by_source(
                parts, step, source, me,
                lambda part: _step_backward(q, k_here, v_here, out, lse, dout, part, scale))
            dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
            # dk, dv travel with their K/V slice; the last hop takes them home.
            if step < n - 1:
                k_here, v_here, dk, dv = jax.lax.ppermute((k_here, v_here, dk, dv), axis_name,
                                                          to_next)
            else:
                dk, dv = jax.lax.ppermute((dk, dv), axis_name, to_next)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring
