"""Ring attention (context parallelism) over ``torch.distributed``.

Each rank of a process group holds a slice of the sequence of q, k and v. The K/V
slices travel around the ring of ranks (point-to-point ``isend``/``irecv``, the next
slice in flight while the current one is computed); each rank attends its queries to
every slice with the ordinary kernels and merges the partial results by their LSEs:

    lse = logaddexp(lse_a, lse_b)      out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

The backward runs the ring again: given the merged out and LSE, the kernels' backward
on one K/V slice yields exactly its share of dq, dk, dv; dq stays, dk and dv travel
with their slice and arrive at its owner after the last hop. The same algorithm as
``fa_jax.ring`` (which uses ``shard_map`` and ``lax.ppermute``).

Layouts, for causal attention: "contiguous" (rank r holds slice r; unbalanced: the
last rank does n times the work of the first) or "zigzag" (the sequence in 2n chunks,
rank r holds chunks r and 2n-1-r: every rank does the same work). ``shard`` cuts a
rank's slice out of a global tensor in either layout, ``unshard`` puts slices back.
Works with NCCL (one GPU per rank) and gloo (CPU tensors, Triton's interpreter).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fa_kernels import plan as fa_plan

from . import ops


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag",
          dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of a global tensor whose sequence is dimension ``dim``."""
    if layout == "contiguous":
        return x.chunk(world_size, dim=dim)[rank]
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def unshard(slices: list[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The global tensor from every rank's slice (inverse of ``shard``)."""
    if layout == "contiguous":
        return torch.cat(slices, dim=dim)
    n = len(slices)
    chunks = [None] * (2 * n)
    for rank, piece in enumerate(slices):
        chunks[rank], chunks[2 * n - 1 - rank] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                   causal: bool = False, softmax_scale: float | None = None,
                   layout: str = "zigzag") -> torch.Tensor:
    """Attention of this rank's slice of q against the whole sequence of k and v.

    q ``(B, S_local, Hq, D)``, k and v ``(B, S_local, Hk, D)``: this rank's slice (see
    ``shard``) of a sequence split over the ranks of ``group`` (default: the world), in
    ring order. Differentiable. Returns this rank's slice of the output.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    causal, scale, layout = fa_plan.check_ring(q.shape, k.shape, v.shape, causal, layout,
                                               softmax_scale)
    return _RingAttention.apply(q, k, v, group, causal, scale, layout)


# ----------------------------------------------------------------------------- the ring


class _Ring:
    """This rank's place in the ring and the point-to-point hop to the next rank."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.size)
        self.prev = to_global((self.rank - 1) % self.size)

    def start_hop(self, tensors):
        """Send ``tensors`` to the next rank and receive the previous rank's; returns
        (pending, received): ``finish_hop(pending)`` before using ``received``."""
        received = [torch.empty_like(t) for t in tensors]
        p2p = []
        for t, r in zip(tensors, received):
            p2p.append(dist.P2POp(dist.isend, t.contiguous(), self.next, self.group))
            p2p.append(dist.P2POp(dist.irecv, r, self.prev, self.group))
        return (dist.batch_isend_irecv(p2p), p2p), received  # p2p keeps the buffers alive

    @staticmethod
    def finish_hop(pending):
        for request in pending[0]:
            request.wait()


def _attend(q, k, v, causal, scale):
    out, lse, _ = ops.attention_forward(q, k, v, softmax_scale=scale, causal=causal)
    return out.float(), lse


def _grads(q, k, v, out, lse, dout, causal, scale):
    # No bias here: the kernels read no lse_lo (fa_kernels.helpers.final_lse).
    dq, dk, dv, _ = ops.attention_backward(dout, q, k, v, out, lse, lse_lo=lse,
                                           softmax_scale=scale, causal=causal)
    return dq.float(), dk.float(), dv.float()


def _merge(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    wa = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - safe))
    wb = torch.where(torch.isneginf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_b - safe))
    return out * wa.transpose(1, 2)[..., None] + out_b * wb.transpose(1, 2)[..., None], new


def _part(x, which: str, dim: int = 1):
    """The "all", "first" or "second" half of a slice along ``dim``."""
    if which == "all":
        return x
    first, second = x.chunk(2, dim=dim)
    return (first if which == "first" else second).contiguous()


def _placed(x, which: str, fill, dim: int = 1):
    """A result for half of a slice as one for all of it (``fill`` in the other half)."""
    if which == "all":
        return x
    other = torch.full_like(x, fill)
    return torch.cat([x, other] if which == "first" else [other, x], dim=dim)


def _visible(parts, step, source, me):
    """The part of the source's K/V slice this step sees (None: nothing)."""
    own, earlier, later = parts
    return own if step == 0 else earlier if source < me else later


def _step_forward(q, k, v, part, scale):
    """(out, lse) of the local queries against the visible ``part`` of a K/V slice."""
    out, lse = _attend(_part(q, part.queries), _part(k, part.keys), _part(v, part.keys),
                       part.causal, scale)
    return _placed(out, part.queries, 0.0), _placed(lse, part.queries, float("-inf"), dim=2)


def _step_backward(q, k, v, out, lse, dout, part, scale):
    """(dq, dk, dv) shares, fp32, of the visible ``part`` of a K/V slice."""
    rows, keys = part.queries, part.keys
    dq, dk, dv = _grads(_part(q, rows), _part(k, keys), _part(v, keys), _part(out, rows),
                        _part(lse, rows, dim=2), _part(dout, rows), part.causal, scale)
    return _placed(dq, rows, 0.0), _placed(dk, keys, 0.0), _placed(dv, keys, 0.0)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout):
        ring = _Ring(group)
        parts = fa_plan.ring_schedule(causal, layout)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"),
                         dtype=torch.float32, device=q.device)
        k_here, v_here = k, v
        for step in range(ring.size):
            hop = ring.start_hop([k_here, v_here]) if step < ring.size - 1 else None
            source = (ring.rank - step) % ring.size
            part = _visible(parts, step, source, ring.rank)
            if part is not None:
                out, lse = _merge(out, lse, *_step_forward(q, k_here, v_here, part, scale))
            if hop is not None:
                ring.finish_hop(hop[0])
                k_here, v_here = hop[1]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring_options = (group, parts, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, parts, scale = ctx.ring_options
        ring = _Ring(group)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        k_here, v_here = k, v
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            part = _visible(parts, step, source, ring.rank)
            if part is not None:
                shares = _step_backward(q, k_here, v_here, out, lse, dout, part, scale)
                dq += shares[0]
                dk += shares[1]
                dv += shares[2]
            # dk, dv travel with their K/V slice; the last hop takes them home.
            last = step == ring.size - 1
            if ring.size == 1:
                break
            pending, received = ring.start_hop([dk, dv] if last else [k_here, v_here, dk, dv])
            ring.finish_hop(pending)
            if last:
                dk, dv = received
            else:
                k_here, v_here, dk, dv = received
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
