"""fa_torch.attention: torch.library custom ops (forward, backward) with autograd.

Registered with ``torch.library.custom_op`` with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` keeps the call in its graph; the autograd formula
is registered on the op. Plain eager calls (no compile or jit tracing, no torch.func
transform, no dispatch mode, plain tensors) skip the op's dispatch through an
``autograd.Function`` over the same launches and the same formula: the same kernels, the
same bits, less host time per call.
"""
from __future__ import annotations

import functools
import inspect
import typing
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fa_kernels import plan as fa_plan
from fa_kernels import runtime

from . import _launch


def _check_tensors(named: dict) -> torch.device:
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    q = named["q"]
    for name, x in named.items():
        if x.device != q.device:
            raise ValueError(f"q, k, v and the other tensor arguments must be on the same "
                             f"device; got q {q.device}, {name} {x.device}")
    if q.device.type == "cpu" and not runtime.interpreting():
        raise ValueError(
            "q is a CPU tensor, but the kernels are compiled for the GPU here; move the "
            "tensors to CUDA, or set TRITON_INTERPRET=1 before importing fa_torch to run "
            "them in Triton's interpreter")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q is on device {q.device}; expected a CUDA device or the CPU")
    return q.device


def _dense(x: Optional[Tensor]) -> Optional[Tensor]:
    """Small index-like inputs (cu_seqlens, ALiBi slopes) are read as contiguous arrays."""
    return x if x is None else x.contiguous()


def _unit_last_stride(x: Optional[Tensor]) -> Optional[Tensor]:
    """The kernels index the head dim with stride 1; other strides are used in place."""
    if x is None or x.dim() == 0 or x.stride(-1) == 1 or x.shape[-1] == 1:
        return x
    return x.contiguous()


def problem_of(q, k, v, bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
               seqused_k=None, max_seqlen_q=0, max_seqlen_k=0, causal=False,
               softmax_scale=None, window_size=(-1, -1), softcap=0.0,
               dropout_p=0.0, block_table=None) -> fa_plan.AttentionProblem:
    """Validate torch inputs and options (raises before any launch)."""
    given = dict(q=q, k=k, v=v, bias=bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table)
    named = {name: x for name, x in given.items() if x is not None}
    _check_tensors(named)
    name = _launch.dtype_name
    varlen = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k")
        varlen = dict(cu_seqlens_q_shape=cu_seqlens_q.shape, cu_seqlens_k_shape=cu_seqlens_k.shape,
                      cu_seqlens_q_dtype=name(cu_seqlens_q.dtype),
                      cu_seqlens_k_dtype=name(cu_seqlens_k.dtype),
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    arrays = (tuple(q.shape), tuple(k.shape), tuple(v.shape), name(q.dtype), name(k.dtype),
              name(v.dtype))
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, dropout_p=dropout_p,
                   bias_shape=None if bias is None else tuple(bias.shape),
                   bias_dtype=None if bias is None else name(bias.dtype),
                   alibi_shape=None if alibi_slopes is None else tuple(alibi_slopes.shape),
                   alibi_dtype=None if alibi_slopes is None else name(alibi_slopes.dtype),
                   seqused_k_shape=None if seqused_k is None else tuple(seqused_k.shape),
                   seqused_k_dtype=None if seqused_k is None else name(seqused_k.dtype),
                   block_table_shape=None if block_table is None else tuple(block_table.shape),
                   block_table_dtype=None if block_table is None else name(block_table.dtype))
    # (Under torch.compile the checks are traced once into the graph: no cache there.)
    if varlen is None and type(window_size) is tuple and not torch.compiler.is_compiling():
        types = tuple(map(type, (*options.values(), *window_size)))
        key = (arrays, tuple(options.items()), types)
        try:
            hash(key)
        except TypeError:  # an unhashable option: check_problem names it
            pass
        else:
            return _checked_problem(*key)
    return fa_plan.check_problem(*arrays, **options, varlen=varlen)


@functools.lru_cache(maxsize=4096)
def _checked_problem(arrays, options, option_types) -> fa_plan.AttentionProblem:
    """check_problem, remembered: a shape seen before costs a lookup, not a validation.
    ``option_types`` keeps apart values that compare equal but validate differently
    (True and 1, 2 and 2.0); a call that fails validation raises and is not remembered."""
    del option_types
    return fa_plan.check_problem(*arrays, **dict(options))


def _bias_strides(bias: Optional[Tensor]):
    if bias is None:
        return None
    return (0,) * (4 - bias.dim()) + tuple(bias.stride())


# problem_of's parameters that an op's arguments give by name (the window comes as two ints).
_PROBLEM_NAMES = tuple(n for n in inspect.signature(problem_of).parameters if n != "window_size")
# The op arguments the kernels read a row at a time, and those they read as dense arrays.
_ROWS = frozenset(("q", "k", "v", "bias", "out", "dout"))
_DENSE = frozenset(("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table",
                    "lse", "lse_lo"))


def _op_problem(named: dict) -> fa_plan.AttentionProblem:
    """problem_of for an op's arguments by name."""
    return problem_of(**{n: named[n] for n in _PROBLEM_NAMES if n in named},
                      window_size=(named["window_left"], named["window_right"]))


def _as_kernels_read(named: dict) -> dict:
    """An op's arguments as the kernels take them: unit last stride where they read rows,
    dense index arrays."""
    return {n: _unit_last_stride(x) if n in _ROWS else _dense(x) if n in _DENSE else x
            for n, x in named.items()}


def _forward_impl(named: dict, problem=None):
    """(out, lse, lse_lo): the forward launches for attention_forward's arguments by name.
    ``problem``: the call's validated problem when the caller has it already (the eager
    path)."""
    from fa_kernels import launcher  # (Triton loads with the first launch, not with fa_torch)

    arrays = _as_kernels_read(named)
    problem = problem or _op_problem(arrays)
    q = arrays["q"]
    fwd = fa_plan.forward_plan(problem, capability=_launch.capability(q.device),
                               q_strides=q.stride(), k_strides=arrays["k"].stride(),
                               v_strides=arrays["v"].stride(),
                               bias_strides=_bias_strides(arrays["bias"]),
                               num_sms=_launch.num_sms(q.device),
                               host_descriptors=launcher.starts_aligned(q, arrays["k"],
                                                                        arrays["v"]))
    arrays["slopes"] = arrays["alibi_slopes"]  # (the kernels' name)
    for launch in fwd.launches:
        _launch.run(launch, arrays, q.device)
    return arrays["out"], arrays["lse"], arrays["lse_lo"]


@torch.library.custom_op("fa_torch::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float,
                      bias: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                      seed: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                      cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                      block_table: Optional[Tensor] = None, max_seqlen_q: int = 0,
                      max_seqlen_k: int = 0, causal: bool = False, window_left: int = -1,
                      window_right: int = -1, softcap: float = 0.0,
                      dropout_p: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse, lse_lo); out like q, lse (B, Hq, Sq) fp32 ((Hq, total_q) for varlen);
    lse_lo, shaped like lse, is what the backward needs of the LSE beyond lse (with a
    bias; kernels/fa_kernels/helpers.py: final_lse). Call it by name: its arguments
    are the table the autograd glue below reads."""
    return _forward_impl(locals())


_FORWARD = inspect.signature(attention_forward._init_fn)


def _by_name(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """An op's arguments by name, defaults filled in (TypeError for an unknown name)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


@attention_forward.register_fake
def _(*args, **kwargs):
    named = _by_name(_FORWARD, args, kwargs)
    problem, q = _op_problem(named), named["q"]
    return (q.new_empty(problem.out_shape), q.new_empty(problem.lse_shape, dtype=torch.float32),
            q.new_empty(problem.lse_shape, dtype=torch.float32))


def _backward_impl(named: dict, problem=None):
    """(dq, dk, dv, dbias): the backward launches for attention_backward's arguments by
    name."""
    from fa_kernels import launcher

    arrays = _as_kernels_read(named)
    problem = problem or _op_problem(arrays)
    q, bias, dlse = arrays["q"], arrays["bias"], arrays["dlse"]
    bias_grad = named["bias_grad"]
    bwd = fa_plan.backward_plan(problem, capability=_launch.capability(q.device),
                                q_strides=q.stride(), k_strides=arrays["k"].stride(),
                                v_strides=arrays["v"].stride(),
                                out_strides=arrays["out"].stride(),
                                dout_strides=arrays["dout"].stride(),
                                bias_strides=_bias_strides(bias), bias_grad=bias_grad,
                                has_dlse=dlse is not None,
                                host_descriptors=launcher.starts_aligned(
                                    q, arrays["k"], arrays["v"], arrays["dout"]))
    if dlse is not None:
        arrays["dlse"] = dlse.to(torch.float32).contiguous()
    arrays["slopes"] = arrays["alibi_slopes"]  # (the kernels' name)
    for launch in bwd.launches:
        _launch.run(launch, arrays, q.device)
    if bias_grad and bias is not None:
        dbias = arrays["dbias"]
        if problem.bias_reduce_axes:  # (sum over dim=() would sum over everything)
            dbias = dbias.sum(dim=problem.bias_reduce_axes, keepdim=True)
        dbias = dbias.reshape(bias.shape).to(bias.dtype)
    else:
        dbias = q.new_empty(0)
    return arrays["dq"], arrays["dk"], arrays["dv"], dbias


@torch.library.custom_op("fa_torch::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       lse_lo: Tensor, softmax_scale: float, dlse: Optional[Tensor] = None,
                       bias: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                       seed: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                       cu_seqlens_k: Optional[Tensor] = None,
                       seqused_k: Optional[Tensor] = None, max_seqlen_q: int = 0,
                       max_seqlen_k: int = 0, causal: bool = False, window_left: int = -1,
                       window_right: int = -1, softcap: float = 0.0, dropout_p: float = 0.0,
                       bias_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias); dbias is bias-shaped when ``bias_grad``, else empty. Without a
    bias, ``lse_lo`` is not read (pass ``lse``)."""
    return _backward_impl(locals())


_BACKWARD = inspect.signature(attention_backward._init_fn)


@attention_backward.register_fake
def _(*args, **kwargs):
    named = _by_name(_BACKWARD, args, kwargs)
    q, k, v, bias = (named[n] for n in ("q", "k", "v", "bias"))
    dbias = torch.empty_like(bias) if named["bias_grad"] and bias is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _is_tensor(annotation) -> bool:
    return annotation in (Tensor, Optional[Tensor])


_FORWARD_TYPES = typing.get_type_hints(attention_forward._init_fn)
# The forward's options (not tensors) go to the backward as they came; its tensors that
# the backward takes are saved for it.
_OPTIONS = tuple(n for n in _FORWARD.parameters if not _is_tensor(_FORWARD_TYPES[n]))
_SAVED = tuple(n for n in _FORWARD.parameters
               if _is_tensor(_FORWARD_TYPES[n]) and n in _BACKWARD.parameters)
_BIAS_INDEX = list(_FORWARD.parameters).index("bias")
_FORWARD_DEFAULTS = tuple((n, p.default) for n, p in _FORWARD.parameters.items())


def forward_arguments(**named) -> tuple:
    """attention_forward's positional arguments from their names, defaults filled in
    (a plain loop: Signature.bind would cost every eager call several microseconds)."""
    args = tuple(named.pop(n) if n in named else default for n, default in _FORWARD_DEFAULTS)
    if named or any(x is inspect.Parameter.empty for x in args):
        missing = [n for (n, _), x in zip(_FORWARD_DEFAULTS, args) if x is inspect.Parameter.empty]
        raise TypeError(f"attention_forward: unknown arguments {sorted(named)}, missing "
                        f"{missing}")
    return args


def _setup_context(ctx, inputs, output):
    _save_for_backward(ctx, dict(zip(_FORWARD.parameters, inputs)), output)


def _save_for_backward(ctx, named: dict, output):
    out, lse, lse_lo = output
    ctx.save_for_backward(out, lse, lse_lo, *(named[n] for n in _SAVED))
    ctx.options = {n: named[n] for n in _OPTIONS}
    ctx.paged = named["block_table"] is not None
    ctx.mark_non_differentiable(lse_lo)
    # An unused output's gradient stays None, not a zero tensor to allocate and fill
    # (the LSE's, usually): the backward plan then skips reading it.
    ctx.set_materialize_grads(False)


def _backward_with(backward):
    def _backward(ctx, dout, dlse, _dlse_lo):
        out, lse, lse_lo, *saved = ctx.saved_tensors
        inputs = dict(zip(_SAVED, saved))
        if ctx.paged:
            raise NotImplementedError("block_table (a paged K/V cache) is forward-only, as in "
                                      "flash-attn: no gradient flows through it")
        if dout is None:
            dout = torch.zeros_like(out)
        bias_grad = inputs["bias"] is not None and ctx.needs_input_grad[_BIAS_INDEX]
        dq, dk, dv, dbias = backward(ctx, dout=dout, out=out, lse=lse, lse_lo=lse_lo,
                                     dlse=dlse, bias_grad=bias_grad, **inputs, **ctx.options)
        grads = dict(q=dq, k=dk, v=dv, bias=dbias if bias_grad else None)
        return tuple(grads.get(n) for n in _FORWARD.parameters)
    return _backward


# The op's backward is the backward op (what torch.compile traces); the eager Function's
# calls the launches directly. One formula for both.
torch.library.register_autograd(
    "fa_torch::attention_forward",
    _backward_with(lambda ctx, **named: attention_backward(**named)),  # looked up per call
    setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path: the same launches and the same backward formula as the custom op,
    without the op's dispatch and its autograd wrapper (which rebuilds the argument list
    on every call): about half the host time of a small fwd+bwd (benchmarks/NOTES.md)."""

    @staticmethod
    def forward(ctx, *inputs):
        *inputs, problem = inputs  # the op's inputs, then the validated problem
        named = dict(zip(_FORWARD.parameters, inputs))
        output = _forward_impl(named, problem=problem)
        _save_for_backward(ctx, named, output)
        ctx.problem = problem
        return output

    @staticmethod
    def backward(ctx, dout, dlse, dlse_lo):
        return _eager_backward(ctx, dout, dlse, dlse_lo) + (None,)


_eager_backward = _backward_with(
    lambda ctx, **named: _backward_impl(named, problem=ctx.problem))


def _eager(tensors) -> bool:
    """True when plain eager torch runs this call: no torch.compile or torch.jit tracing,
    no torch.func transform, no dispatch mode (fake tensors, flop counters...), no tensor
    subclass. Those see the custom op, as they must; everything else takes the shorter
    path."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch._C._are_functorch_transforms_active()):
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    return all(type(x) is torch.Tensor for x in tensors)


def _call_forward(problem, **named):
    """attention_forward(**named), by the eager path when it may (``problem``: the
    arguments' validated problem, which the op would validate again)."""
    args = forward_arguments(**named)
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    if not _eager(tensors):
        return attention_forward(*args)
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return _EagerAttention.apply(*args, problem)
    return _forward_impl(dict(zip(_FORWARD.parameters, args)), problem=problem)


def check_dropout_seed(dropout_seed):
    """The seed as given, if fa_torch takes it: None, an int (numpy's too) in [0, 2**64),
    or an integer tensor of 1 or 2 elements; else a TypeError/ValueError naming it."""
    if dropout_seed is None:
        return None
    if isinstance(dropout_seed, torch.Tensor):
        dtype = dropout_seed.dtype
        if (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
                or dropout_seed.numel() not in (1, 2)):
            raise TypeError(f"dropout_seed tensor must hold 1 or 2 integers; got "
                            f"{dtype} of shape {tuple(dropout_seed.shape)}")
        return dropout_seed
    if isinstance(dropout_seed, (int, np.integer)) and not isinstance(dropout_seed, bool):
        if not 0 <= int(dropout_seed) < 2 ** 64:
            raise ValueError(f"dropout_seed must be in [0, 2**64); got {dropout_seed}")
        return int(dropout_seed)
    raise TypeError(f"dropout_seed must be None, an int or an integer tensor; got "
                    f"{type(dropout_seed).__name__}")


def dropout_seed_tensor(dropout_seed, device: torch.device) -> Tensor:
    """The seed as the kernels take it: (4,) int32, the low and high 32 bits of the
    seed, then the batch and head offsets (0: this call holds the whole batch).

    None draws one from torch's default generator (so ``torch.manual_seed`` makes runs
    repeatable); an int is used as is; a tensor of 1 or 2 integers also.
    """
    dropout_seed = check_dropout_seed(dropout_seed)
    if dropout_seed is None:
        halves = torch.randint(-2 ** 31, 2 ** 31, (2,), dtype=torch.int64)
    elif isinstance(dropout_seed, torch.Tensor):
        halves = dropout_seed.reshape(-1).to(torch.int64)
        if halves.numel() == 1:
            return dropout_seed_tensor(int(halves[0]), device)
        halves = (halves & 0xFFFFFFFF)
        halves = torch.where(halves >= 2 ** 31, halves - 2 ** 32, halves)
    else:
        halves = torch.tensor(fa_plan.seed_words(dropout_seed))
    offsets = torch.zeros(2, dtype=torch.int64)
    return torch.cat([halves.cpu(), offsets]).to(torch.int32).to(device)


def autocast_inputs(q, k, v):
    """Under torch.autocast, q, k, v meet the kernels in the autocast dtype (the user's
    choice, bf16 or fp16); bias, slopes and the LSE keep their dtypes."""
    if not isinstance(q, torch.Tensor) or q.device.type not in ("cuda", "cpu"):
        return q, k, v
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                 for x in (q, k, v))


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal,
               softmax_scale, bias, alibi_slopes, window_size, softcap, dropout_p, dropout_seed,
               return_lse, deterministic=False, seqused_k=None, block_table=None):
    fa_plan.check_bool("deterministic", deterministic)  # (the backward is deterministic anyway)
    return_lse = fa_plan.check_bool("return_lse", return_lse)
    check_dropout_seed(dropout_seed)
    q, k, v = autocast_inputs(q, k, v)
    problem = problem_of(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, softcap,
                         dropout_p, block_table)
    # Index arrays on the CPU are checked; on the GPU they are trusted (and clamped by the
    # kernels): checking would need a device sync.
    key_counts = [problem.seqlen_k] * problem.batch
    if problem.varlen and not (cu_seqlens_q.is_cuda or cu_seqlens_k.is_cuda):
        fa_plan.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q.tolist(), problem.total_q,
                                 problem.seqlen_q)
        fa_plan.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k.tolist(),
                                 None if problem.paged else problem.total_k, problem.seqlen_k)
        key_counts = torch.diff(cu_seqlens_k).tolist()
    if seqused_k is not None and not seqused_k.is_cuda and not (
            problem.varlen and cu_seqlens_k.is_cuda):
        fa_plan.check_seqused_k(seqused_k.tolist(), key_counts)
    if block_table is not None and not block_table.is_cuda:
        fa_plan.check_block_table(block_table.tolist(), problem.num_pages)
    seed = dropout_seed_tensor(dropout_seed, q.device) if problem.dropout_p > 0 else None
    p = problem
    out, lse, _ = _call_forward(
        p, q=q, k=k, v=v, bias=bias, alibi_slopes=alibi_slopes, seed=seed,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        block_table=block_table, max_seqlen_q=p.seqlen_q if p.varlen else 0,
        max_seqlen_k=p.seqlen_k if p.varlen else 0, causal=p.causal,
        softmax_scale=p.softmax_scale, window_left=p.window_left,
        window_right=p.window_right, softcap=p.softcap, dropout_p=p.dropout_p)
    return (out, lse) if return_lse else out


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, bias: Tensor | None = None,
              alibi_slopes: Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, dropout_p: float = 0.0, dropout_seed=None,
              return_lse: bool = False, deterministic: bool = False,
              seqused_k: Tensor | None = None, block_table: Tensor | None = None):
    """Softmax attention with the FlashAttention-2 kernels.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``; k, v: ``(batch, seqlen_k, heads_k,
            head_dim)`` with ``heads_q % heads_k == 0`` (GQA/MQA). fp16, bf16 or fp32,
            CUDA (or CPU, in Triton's interpreter). head_dim <= 256, any value.
        causal: bottom-right aligned causal mask: row i sees keys j <= i + seqlen_k - seqlen_q.
        softmax_scale: scale of q·k; None means head_dim ** -0.5; 0.0 is legal.
        bias: additive, broadcastable to ``(batch, heads_q, seqlen_q, seqlen_k)``, any
            float dtype; gets a gradient (summed over broadcast dims) when it requires one.
        alibi_slopes: ``(heads_q,)`` or ``(batch, heads_q)`` fp32: adds
            ``-slope * |i + seqlen_k - seqlen_q - j|``.
        window_size: ``(left, right)``: row i sees keys in
            ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; -1 is unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` before softmax.
        dropout_p, dropout_seed: dropout on the attention probabilities; the mask is a pure
            function of (seed, batch, head, i, j). None draws the seed from torch's generator.
        return_lse: also return the log-sum-exp ``(batch, heads_q, seqlen_q)`` fp32
            (natural log; -inf for a row that sees no key). It is differentiable.
        deterministic: accepted for flash-attn compatibility; the backward never uses
            atomics, so it is always deterministic.
        seqused_k: ``(batch,)`` int32: entry b attends to its first ``seqused_k[b]`` keys
            only, as if k and v held those alone (so ``seqlen_k`` above is
            ``seqused_k[b]`` for the causal and window alignment and ALiBi). The other key
            rows are never read and get a zero gradient (a KV cache's unfilled tail).
            Values on the CPU are checked to lie in [0, seqlen_k]; on the GPU the kernels
            clamp them into that range.
        block_table: ``(batch, pages_per_entry)`` int32, a paged K/V cache (forward only):
            k and v are then a pool ``(num_pages, page_size, heads_k, head_dim)`` of pages
            of any size, and entry b's key j is row ``j % page_size`` of page
            ``block_table[b, j // page_size]`` (``seqlen_k`` is ``pages_per_entry *
            page_size``; pass ``seqused_k`` for the filled part). Page numbers on the CPU
            are checked; on the GPU the kernels clamp them into the pool.

    Returns ``out`` (like q), or ``(out, lse)`` with ``return_lse``.
    """
    return _attention(q, k, v, None, None, 0, 0, causal=causal, softmax_scale=softmax_scale,
                      bias=bias, alibi_slopes=alibi_slopes, window_size=window_size,
                      softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed,
                      return_lse=return_lse, deterministic=deterministic, seqused_k=seqused_k,
                      block_table=block_table)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: float | None = None, alibi_slopes: Tensor | None = None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     dropout_p: float = 0.0, dropout_seed=None, return_lse: bool = False,
                     deterministic: bool = False, bias: Tensor | None = None,
                     seqused_k: Tensor | None = None, block_table: Tensor | None = None):
    """Attention over packed variable-length sequences.

    q ``(total_q, heads_q, head_dim)``, k and v ``(total_k, heads_k, head_dim)``; sequence b
    holds tokens ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, shape (batch + 1,)). Each
    sequence is attended on its own (causal bottom-right aligned per sequence; a length
    of 0 is fine). ``max_seqlen_*`` must bound the lengths. lse is ``(heads_q, total_q)``.
    cu_seqlens on the CPU are checked (start 0, non-decreasing, end = total); on the GPU
    they are trusted (checking would need a device sync). ``bias`` is not supported.
    ``seqused_k`` ``(batch,)`` int32: sequence b uses only its first ``seqused_k[b]`` keys
    (as in ``attention``). ``block_table`` ``(batch, pages_per_entry)`` int32: k and v are a
    paged pool ``(num_pages, page_size, heads_k, head_dim)`` (as in ``attention``);
    ``cu_seqlens_k`` then give the key counts only (their end is not checked).
    """
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      causal=causal, softmax_scale=softmax_scale, bias=bias,
                      alibi_slopes=alibi_slopes, window_size=window_size, softcap=softcap,
                      dropout_p=dropout_p, dropout_seed=dropout_seed, return_lse=return_lse,
                      deterministic=deterministic, seqused_k=seqused_k, block_table=block_table)


def window_visible(offset: Tensor, left: int, right: int) -> Tensor:
    """Where a key ``offset`` positions from its row's (bottom-right) diagonal lies inside
    the window ``(left, right)`` (-1: that side unbounded; causal is ``right = 0``)."""
    visible = torch.ones_like(offset, dtype=torch.bool)
    if left >= 0:
        visible = visible & (offset >= -left)
    if right >= 0:
        visible = visible & (offset <= right)
    return visible


def dropout_mask(dropout_seed, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float, device=None) -> Tensor:
    """The keep mask ``(batch, heads, seqlen_q, seqlen_k)`` bool that attention with this
    seed and dropout_p applies (for tests and debugging). ``dropout_seed`` must be given."""
    if dropout_seed is None:
        raise ValueError("dropout_mask needs the dropout_seed the attention call used")
    device = torch.device(device or ("cpu" if runtime.interpreting() else "cuda"))
    launch = fa_plan.dropout_mask_plan(batch, heads, seqlen_q, seqlen_k, dropout_p,
                                       capability=_launch.capability(device))
    arrays = {"seed": dropout_seed_tensor(dropout_seed, device)}
    return _launch.run(launch, arrays, device)["mask"].bool()
