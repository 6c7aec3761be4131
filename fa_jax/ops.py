"""fa_jax.attention: a ``jax.custom_vjp`` over the shared Triton kernels.

The forward and the backward are each one ``custom_vmap`` function (jax_triton's
primitive refuses vmap): its rule folds the mapped axis into the batch axis and calls
the kernels once, so ``vmap`` (nested too) costs one launch per step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa_kernels import plan as fa_plan

from . import _launch


def _dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def _check_arrays(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be a jax or numpy array; got {type(x).__name__}")
    wanted = ("gpu", "cuda", "rocm") if _launch.on_gpu() else ("cpu",)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            platforms = {d.platform for d in x.devices()}
            if not platforms <= set(wanted):
                where = "a CUDA GPU" if _launch.on_gpu() else "the CPU (Triton's interpreter)"
                raise ValueError(
                    f"{name} is on platform {sorted(platforms)}, but the kernels run on "
                    f"{where} in this process; move the array there")


def problem_of(q, k, v, causal, softmax_scale) -> fa_plan.AttentionProblem:
    _check_arrays(q, k, v)
    return fa_plan.check_problem(q.shape, k.shape, v.shape, _dtype_name(q), _dtype_name(k),
                                 _dtype_name(v), causal=causal, softmax_scale=softmax_scale)


def _fold_batch(fn):
    """custom_vmap rule: move every mapped axis into the batch axis (axis 0)."""

    def rule(axis_size, in_batched, *args):
        folded = []
        for x, batched in zip(args, in_batched):
            if not batched:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            folded.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
        outs = fn(*folded)
        outs = tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)

    fn.def_vmap(rule)
    return fn


@functools.lru_cache(maxsize=None)
def forward_op(causal: bool, softmax_scale: float):
    """(q, k, v) -> (out, lse) for fixed options."""

    @jax.custom_batching.custom_vmap
    def forward(q, k, v):
        problem = problem_of(q, k, v, causal, softmax_scale)
        fwd = fa_plan.forward_plan(problem, capability=_launch.capability())
        outputs = _launch.run(fwd.launch, {"q": q, "k": k, "v": v})
        return outputs["out"], outputs["lse"]

    return _fold_batch(forward)


@functools.lru_cache(maxsize=None)
def backward_op(causal: bool, softmax_scale: float):
    """(q, k, v, out, lse, dout, dlse) -> (dq, dk, dv) for fixed options."""

    @jax.custom_batching.custom_vmap
    def backward(q, k, v, out, lse, dout, dlse):
        problem = problem_of(q, k, v, causal, softmax_scale)
        bwd = fa_plan.backward_plan(problem, capability=_launch.capability())
        arrays = {"q": q, "k": k, "v": v, "out": out, "lse": lse,
                  "dout": dout.astype(out.dtype), "dlse": dlse.astype(jnp.float32)}
        for launch in bwd.launches:
            _launch.run(launch, arrays)
        return arrays["dq"], arrays["dk"], arrays["dv"]

    return _fold_batch(backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, causal, softmax_scale):
    return forward_op(causal, softmax_scale)(q, k, v)


def _attention_fwd(q, k, v, causal, softmax_scale):
    out, lse = forward_op(causal, softmax_scale)(q, k, v)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(causal, softmax_scale, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    return backward_op(causal, softmax_scale)(q, k, v, out, lse, dout, dlse)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              bias=None, alibi_slopes=None, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, dropout_p: float = 0.0, dropout_seed=None,
              return_lse: bool = False, deterministic: bool = False):
    """Softmax attention with the FlashAttention-2 kernels; same API as fa_torch.attention.

    q ``(batch, seqlen_q, heads_q, head_dim)``, k and v ``(batch, seqlen_k, heads_k,
    head_dim)``, ``heads_q % heads_k == 0``; fp16, bf16 or fp32. Works under ``jit``,
    ``grad`` and ``vmap``. Returns ``out``, or ``(out, lse)`` with ``return_lse`` (lse
    ``(batch, heads_q, seqlen_q)`` fp32, natural log, -inf for a row with no key;
    differentiable). The backward never uses atomics: it is always deterministic.
    """
    fa_plan.check_unbuilt(bias=bias, alibi_slopes=alibi_slopes, window_size=window_size,
                   softcap=softcap, dropout_p=dropout_p)
    problem = problem_of(q, k, v, causal, softmax_scale)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    out, lse = _attention(q, k, v, problem.causal, problem.softmax_scale)
    return (out, lse) if return_lse else out
