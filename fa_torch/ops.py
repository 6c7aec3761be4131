"""fa_torch.attention: torch.library custom ops (forward, backward) with autograd.

Registered with ``torch.library.custom_op`` with a fake (meta) implementation, so
``torch.compile(fullgraph=True)`` keeps the call in its graph; the autograd formula
is registered on the op, so eager and compiled code share one backward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fa_kernels import plan as fa_plan
from fa_kernels import runtime

from . import _launch


def _check_tensors(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on the same device; got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type == "cuda":
        if runtime.interpreting():
            return  # the interpreter copies CUDA tensors to the host and back: slow but right
    elif q.device.type == "cpu":
        if not runtime.interpreting():
            raise ValueError(
                "q is a CPU tensor, but the kernels are compiled for the GPU here; move the "
                "tensors to CUDA, or set TRITON_INTERPRET=1 before importing fa_torch to run "
                "them in Triton's interpreter")
    else:
        raise ValueError(f"q is on device {q.device}; expected a CUDA device or the CPU")


def _unit_last_stride(x: Tensor) -> Tensor:
    """The kernels index the head dim with stride 1; other strides are used in place."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def problem_of(q: Tensor, k: Tensor, v: Tensor, causal, softmax_scale) -> fa_plan.AttentionProblem:
    """Validate torch inputs and options (raises before any launch)."""
    _check_tensors(q, k, v)
    return fa_plan.check_problem(q.shape, k.shape, v.shape, _launch.dtype_name(q.dtype),
                                 _launch.dtype_name(k.dtype), _launch.dtype_name(v.dtype),
                                 causal=causal, softmax_scale=softmax_scale)


@torch.library.custom_op("fa_torch::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                      softmax_scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of softmax attention; shapes (B, Sq, Hq, D) and (B, Hq, Sq) fp32."""
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    problem = problem_of(q, k, v, causal, softmax_scale)
    fwd = fa_plan.forward_plan(problem, capability=_launch.capability(q.device),
                               q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride())
    arrays = {"q": q, "k": k, "v": v}
    with torch.cuda.device(q.device) if q.is_cuda else _nullcontext():
        out = _launch.run(fwd.launch, arrays, q.device)
    return out["out"], out["lse"]


@attention_forward.register_fake
def _(q, k, v, causal, softmax_scale):
    problem = problem_of(q, k, v, causal, softmax_scale)
    return (q.new_empty(problem.out_shape),
            q.new_empty(problem.lse_shape, dtype=torch.float32))


@torch.library.custom_op("fa_torch::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       dlse: Optional[Tensor], causal: bool,
                       softmax_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) given dout (and dlse, the gradient of the LSE, when it has one)."""
    q, k, v, out, dout = (_unit_last_stride(x) for x in (q, k, v, out, dout))
    problem = problem_of(q, k, v, causal, softmax_scale)
    bwd = fa_plan.backward_plan(problem, capability=_launch.capability(q.device),
                                q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(),
                                out_strides=out.stride(), dout_strides=dout.stride())
    if dlse is None:
        dlse = torch.zeros(problem.lse_shape, dtype=torch.float32, device=q.device)
    arrays = {"q": q, "k": k, "v": v, "out": out, "dout": dout,
              "lse": lse.contiguous(), "dlse": dlse.to(torch.float32).contiguous()}
    with torch.cuda.device(q.device) if q.is_cuda else _nullcontext():
        for launch in bwd.launches:
            _launch.run(launch, arrays, q.device)
    return arrays["dq"], arrays["dk"], arrays["dv"]


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.softmax_scale)
    return dq, dk, dv, None, None


torch.library.register_autograd("fa_torch::attention_forward", _backward,
                                setup_context=_setup_context)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, bias: Tensor | None = None,
              alibi_slopes: Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, dropout_p: float = 0.0, dropout_seed: int | None = None,
              return_lse: bool = False, deterministic: bool = False):
    """Softmax attention with the FlashAttention-2 kernels.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``; k, v: ``(batch, seqlen_k, heads_k,
            head_dim)`` with ``heads_q % heads_k == 0`` (GQA/MQA). fp16, bf16 or fp32,
            CUDA (or CPU, in Triton's interpreter). head_dim <= 256, any value.
        causal: bottom-right aligned causal mask: row i sees keys j <= i + seqlen_k - seqlen_q.
        softmax_scale: scale of q·k; None means head_dim ** -0.5; 0.0 is legal.
        return_lse: also return the log-sum-exp ``(batch, heads_q, seqlen_q)`` fp32
            (natural log; -inf for a row that sees no key). It is differentiable.
        deterministic: accepted for flash-attn compatibility; the backward never uses
            atomics, so it is always deterministic.

    Returns ``out`` (like q), or ``(out, lse)`` with ``return_lse``.
    """
    fa_plan.check_unbuilt(bias=bias, alibi_slopes=alibi_slopes, window_size=window_size,
                   softcap=softcap, dropout_p=dropout_p)
    problem = problem_of(q, k, v, causal, softmax_scale)
    out, lse = attention_forward(q, k, v, problem.causal, problem.softmax_scale)
    return (out, lse) if return_lse else out
