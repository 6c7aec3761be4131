"""fa_jax.attention: a ``jax.custom_vjp`` over the shared Triton kernels.

The forward and the backward are each one ``custom_vmap`` function (jax_triton's
primitive refuses vmap). Its rule folds the mapped axis into the batch axis and
calls the kernels once; where that would change the meaning (a mapped dropout seed,
packed varlen inputs) it maps sequentially instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa_kernels import plan as fa_plan

from . import _launch, _sharding

ARRAY_NAMES = fa_plan.ATTENTION_INPUTS  # the forward's operands, absent ones as placeholders


def _dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def _check_arrays(named: dict) -> None:
    for name, x in named.items():
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be a jax or numpy array; got {type(x).__name__}")
    wanted = ("gpu", "cuda", "rocm") if _launch.on_gpu() else ("cpu",)
    for name, x in named.items():
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            platforms = {d.platform for d in x.devices()}
            if not platforms <= set(wanted):
                where = "a CUDA GPU" if _launch.on_gpu() else "the CPU (Triton's interpreter)"
                raise ValueError(
                    f"{name} is on platform {sorted(platforms)}, but the kernels run on "
                    f"{where} in this process; move the array there")


def validate(arrays: dict, *, causal, softmax_scale, window_size=(-1, -1), softcap=0.0,
             dropout_p=0.0, max_seqlen_q=0, max_seqlen_k=0) -> fa_plan.AttentionProblem:
    """The one validation of a call: the problem every later step derives from. Arrays
    by name (q, k, v, and bias, slopes, cu_seqlens_q/k, seqused_k, block_table when
    given)."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    bias, slopes, used = arrays.get("bias"), arrays.get("slopes"), arrays.get("seqused_k")
    table = arrays.get("block_table")
    varlen = None
    if arrays.get("cu_seqlens_q") is not None:
        cu_q, cu_k = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
        varlen = dict(cu_seqlens_q_shape=cu_q.shape, cu_seqlens_k_shape=cu_k.shape,
                      cu_seqlens_q_dtype=_dtype_name(cu_q), cu_seqlens_k_dtype=_dtype_name(cu_k),
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return fa_plan.check_problem(
        q.shape, k.shape, v.shape, _dtype_name(q), _dtype_name(k), _dtype_name(v),
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        dropout_p=dropout_p, bias_shape=None if bias is None else bias.shape,
        bias_dtype=None if bias is None else _dtype_name(bias),
        alibi_shape=None if slopes is None else slopes.shape,
        alibi_dtype=None if slopes is None else _dtype_name(slopes), varlen=varlen,
        seqused_k_shape=None if used is None else used.shape,
        seqused_k_dtype=None if used is None else _dtype_name(used),
        block_table_shape=None if table is None else table.shape,
        block_table_dtype=None if table is None else _dtype_name(table))


def _at(problem: fa_plan.AttentionProblem, arrays: dict) -> fa_plan.AttentionProblem:
    """The call's problem on these arrays: one shard of it, or a folded vmap batch."""
    return fa_plan.resized(
        problem, arrays["q"].shape, arrays["k"].shape,
        arrays["bias"].shape if problem.bias_shape is not None else None,
        arrays["slopes"].shape if problem.alibi_shape is not None else None)


# --------------------------------------------------------------------------- vmap rules


def _batch_rule(fn, kinds, problem: fa_plan.AttentionProblem):
    """A custom_vmap rule for ``fn`` whose arguments are of the given kinds.

    * "batch": a leading batch axis; the mapped axis folds into it.
    * "batchable": bias (4-D) or ALiBi slopes: folded by broadcasting their batch
      axis to the problem's batch first (kept as is when unmapped and unbatched).
    * "fixed": seed, cu_seqlens, placeholders (and seqused_k with varlen inputs): must
      be the same for every mapped element, else (and for varlen inputs and paged K/V,
      whose block table numbers pages of one pool) the map runs sequentially.
    """

    def rule(axis_size, in_batched, *args):
        sequential = problem.varlen or problem.paged or any(
            b and kind == "fixed" for b, kind in zip(in_batched, kinds))
        if sequential:
            def one(mapped):
                it = iter(mapped)
                return fn(*(next(it) if b else x for x, b in zip(args, in_batched)))
            outs = jax.lax.map(one, tuple(x for x, b in zip(args, in_batched) if b))
            return outs, tuple(True for _ in outs)
        q_batched = in_batched[0]
        batch = args[0].shape[1] if q_batched else args[0].shape[0]
        folded = []
        for x, b, kind in zip(args, in_batched, kinds):
            if kind == "batch":
                x = x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
                x = x.reshape(axis_size * x.shape[1], *x.shape[2:])
            elif kind == "batchable":
                element = x.shape[1:] if b else x.shape
                has_batch_axis = len(element) >= 2  # (B, Hq) slopes, (B, H, Sq, Sk) bias
                if b or (has_batch_axis and element[0] != 1):
                    rest = element[1:] if has_batch_axis else element
                    x = x if b else x[None]
                    if not has_batch_axis:
                        x = x[:, None]
                    x = jnp.broadcast_to(x, (axis_size, batch, *rest))
                    x = x.reshape(axis_size * batch, *rest)
            folded.append(x)
        outs = fn(*folded)
        outs = tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)

    return rule


def _kinds(names, problem: fa_plan.AttentionProblem):
    row_kind = "fixed" if problem.varlen else "batch"
    table = {"bias": "batchable", "slopes": "batchable", "seed": "fixed",
             "cu_seqlens_q": "fixed", "cu_seqlens_k": "fixed",
             "seqused_k": row_kind if problem.seqused_k else "fixed"}
    return tuple(table.get(n, row_kind) for n in names)


# ------------------------------------------------------------------------------- the ops


FORWARD_OUTPUTS = ("out", "lse", "lse_lo")  # lse_lo: fa_kernels.helpers.final_lse
BACKWARD_NAMES = ARRAY_NAMES + ("out", "lse", "lse_lo", "dout", "dlse")
OPERANDS = {"forward": ARRAY_NAMES, "backward": BACKWARD_NAMES}


def _kernel_body(kind: str, whole: fa_plan.AttentionProblem, bias_grad: bool):
    """The op on arrays of any size (the whole problem, or one shard of it)."""
    names = OPERANDS[kind]

    def body(*args):
        arrays = dict(zip(names, args))
        if whole.dropout_p > 0:
            arrays["seed"] = _sharding.with_offsets(arrays["seed"], *args[len(names):])
        problem = _at(whole, arrays)
        if kind == "forward":
            fwd = fa_plan.forward_plan(problem, capability=_launch.capability(),
                                       num_sms=_launch.num_sms(),
                                       launches_gluon=_launch.LAUNCHES_GLUON,
                                       **_launch.plan_options())
            for launch in fwd.launches:
                _launch.run(launch, arrays)
            return tuple(arrays[name] for name in FORWARD_OUTPUTS)
        bwd = fa_plan.backward_plan(problem, capability=_launch.capability(),
                                    bias_grad=bias_grad, **_launch.plan_options())
        arrays["dout"] = arrays["dout"].astype(arrays["out"].dtype)
        arrays["dlse"] = arrays["dlse"].astype(jnp.float32)
        for launch in bwd.launches:
            _launch.run(launch, arrays)
        grads = (arrays["dq"], arrays["dk"], arrays["dv"])
        return grads + ((arrays["dbias"],) if bias_grad else ())

    return body


@functools.lru_cache(maxsize=1024)
def _partitioned_op(kind: str, whole: fa_plan.AttentionProblem, signature: tuple,
                    bias_grad: bool):
    """The kernel op of one kind, problem and operand signature, as a custom_partitioning
    function (cached: jax re-traces a new one on every eager call)."""
    names = OPERANDS[kind]
    shapes = [shape for shape, _ in signature]
    arrays = {n: jax.ShapeDtypeStruct(shape, dtype) for n, (shape, dtype) in zip(names, signature)}
    problem = _at(whole, arrays)
    in_names = names + (("batch_index", "head_index") if problem.dropout_p > 0 else ())
    if kind == "forward":
        out_names = FORWARD_OUTPUTS
        out_shapes = [problem.out_shape, problem.lse_shape, problem.lse_shape]
    else:
        out_names = ("dq", "dk", "dv") + (("dbias",) if bias_grad else ())
        out_shapes = [problem.q_shape, problem.kv_shape, problem.kv_shape, problem.dbias_shape]
    return _sharding.partitioned(_kernel_body(kind, whole, bias_grad), in_names, shapes, out_names,
                                 out_shapes[:len(out_names)], problem)


def _call_op(kind: str, whole: fa_plan.AttentionProblem, args, bias_grad: bool):
    extras = ()
    if whole.dropout_p > 0:
        extras = _sharding.global_index_operands(_at(whole, dict(zip(OPERANDS[kind], args))))
    operands = (*args, *extras)
    signature = tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in operands)
    return tuple(_partitioned_op(kind, whole, signature, bias_grad)(*operands))


@functools.lru_cache(maxsize=2048)
def _op(kind: str, problem: fa_plan.AttentionProblem, bias_grad: bool = False):
    """The forward or backward of one problem as a function of its arrays (OPERANDS[kind]),
    with its own vmap rule; the backward gives the bias's gradient when ``bias_grad``."""

    @jax.custom_batching.custom_vmap
    def op(*args):
        return _call_op(kind, problem, args, bias_grad)

    op.def_vmap(_batch_rule(op, _kinds(OPERANDS[kind], problem), problem))
    return op


def forward_op(problem: fa_plan.AttentionProblem):
    """(q, k, v, bias, slopes, seed, cu_seqlens_q, cu_seqlens_k) -> (out, lse, lse_lo)."""
    return _op("forward", problem)


def backward_op(problem: fa_plan.AttentionProblem, bias_grad: bool | None = None):
    """(... the forward's arrays, out, lse, lse_lo, dout, dlse) -> (dq, dk, dv[, dense
    dbias]); dbias when ``bias_grad`` (by default: when the problem has a bias)."""
    if bias_grad is None:
        bias_grad = problem.bias_shape is not None
    return _op("backward", problem, bool(bias_grad))


def _materialized(cotangent, like):
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(like.shape, like.dtype)
    return cotangent


@functools.lru_cache(maxsize=1024)
def _differentiable(problem: fa_plan.AttentionProblem):
    @jax.custom_vjp
    def attend(*args):
        return forward_op(problem)(*args)[:2]

    # Symbolic zeros tell the forward which inputs are differentiated: a bias that is not
    # (a mask made into a bias, a constant) costs no dense (B, Hq, Sq, Sk) gradient buffer,
    # as in fa_torch, where the bias's requires_grad decides.
    def attend_fwd(*primals):
        args = tuple(p.value for p in primals)
        out, lse, lse_lo = forward_op(problem)(*args)
        bias_grad = problem.bias_shape is not None and primals[3].perturbed
        # (A static flag, carried as the residuals' structure: () for yes, None for no.)
        return (out, lse), (args, out, lse, lse_lo, () if bias_grad else None)

    def attend_bwd(residuals, cotangents):
        args, out, lse, lse_lo, bias_grad = residuals
        bias_grad = bias_grad is not None
        dout, dlse = (_materialized(c, x) for c, x in zip(cotangents, (out, lse)))
        grads = backward_op(problem, bias_grad)(*args, out, lse, lse_lo, dout, dlse)
        cotangent = [*grads[:3]] + [None] * len(args[3:])  # (None: a zero cotangent)
        if bias_grad:
            bias = args[3]
            dbias = jnp.sum(grads[3], axis=problem.bias_reduce_axes, keepdims=True)
            cotangent[3] = dbias.reshape(bias.shape).astype(bias.dtype)
        return tuple(cotangent)

    attend.defvjp(attend_fwd, attend_bwd, symbolic_zeros=True)
    return attend


# --------------------------------------------------------------------------- public API


def check_dropout_seed(dropout_seed) -> str:
    """What kind of seed fa_jax was given ("none", "int", "key" or "scalar"), or a
    TypeError/ValueError naming it: an int (numpy's too) in [0, 2**64), an integer scalar
    array (traced is fine) or one PRNG key (typed, or a legacy uint32 (2,) key)."""
    if dropout_seed is None:
        return "none"
    if isinstance(dropout_seed, (int, np.integer)) and not isinstance(dropout_seed,
                                                                       (bool, np.bool_)):
        if not 0 <= int(dropout_seed) < 2 ** 64:
            raise ValueError(f"dropout_seed must be in [0, 2**64); got {dropout_seed}")
        return "int"
    if not hasattr(dropout_seed, "dtype") or not hasattr(dropout_seed, "shape"):
        raise TypeError(f"dropout_seed must be an int, an integer array or a PRNG key; got "
                        f"{type(dropout_seed).__name__}")
    dtype, shape = dropout_seed.dtype, tuple(dropout_seed.shape)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if shape != ():
            raise TypeError(f"dropout_seed must be one PRNG key; got an array of keys of "
                            f"shape {shape}")
        return "key"
    if dtype == jnp.uint32 and shape == (2,):
        return "key"
    if not jnp.issubdtype(dtype, jnp.integer) or shape != ():
        raise TypeError(f"dropout_seed array must be an integer scalar or a PRNG key; got "
                        f"{dtype} of shape {shape}")
    return "scalar"


def dropout_seed_array(dropout_seed):
    """The seed as the kernels take it: (2,) int32, low and high 32 bits.

    An int (< 2**64), a uint32/int32 scalar array (traced is fine) or a PRNG key
    (typed, or a legacy uint32 (2,) key, from which two words are drawn).
    """
    kind = check_dropout_seed(dropout_seed)
    if kind == "none":
        raise ValueError("dropout_p > 0 needs dropout_seed in fa_jax: an int, a uint32 array "
                         "or a PRNG key (jax has no global random state)")
    if kind == "int":
        return jnp.asarray(fa_plan.seed_words(dropout_seed), jnp.int32)
    seed = jnp.asarray(dropout_seed)
    if kind == "key":
        words = jax.random.bits(seed, (2,), jnp.uint32)
        return jax.lax.bitcast_convert_type(words, jnp.int32)
    low = jax.lax.bitcast_convert_type(seed.astype(jnp.uint32), jnp.int32)
    return jnp.stack([low, jnp.zeros((), jnp.int32)])


def _call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal,
          softmax_scale, bias, alibi_slopes, window_size, softcap, dropout_p, dropout_seed,
          return_lse, deterministic, seqused_k=None, block_table=None):
    fa_plan.check_bool("deterministic", deterministic)  # (the backward is deterministic anyway)
    return_lse = fa_plan.check_bool("return_lse", return_lse)
    given = dict(q=q, k=k, v=v, bias=bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table)
    named = {name: x for name, x in given.items() if x is not None}
    _check_arrays(named)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k")
    varlen = cu_seqlens_q is not None
    arrays = {"q": q, "k": k, "v": v, "bias": bias, "slopes": alibi_slopes,
              "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "seqused_k": seqused_k,
              "block_table": block_table}
    problem = validate(arrays, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    # Concrete index arrays are checked; traced ones are trusted (the kernels clamp them).
    key_counts = [problem.seqlen_k] * problem.batch
    if varlen:
        for name, total, longest in (
                ("cu_seqlens_q", problem.total_q, problem.seqlen_q),
                ("cu_seqlens_k", None if problem.paged else problem.total_k, problem.seqlen_k)):
            values = arrays[name]
            if not isinstance(values, jax.core.Tracer):
                fa_plan.check_cu_seqlens(name, np.asarray(values).tolist(), total, longest)
        key_counts = (None if isinstance(cu_seqlens_k, jax.core.Tracer)
                      else np.diff(np.asarray(cu_seqlens_k)).tolist())
    if seqused_k is not None and key_counts is not None and not isinstance(
            seqused_k, jax.core.Tracer):
        fa_plan.check_seqused_k(np.asarray(seqused_k).tolist(), key_counts)
    if block_table is not None and not isinstance(block_table, jax.core.Tracer):
        fa_plan.check_block_table(np.asarray(block_table).tolist(), problem.num_pages)
    check_dropout_seed(dropout_seed)  # checked with dropout off too
    seed = dropout_seed_array(dropout_seed) if problem.dropout_p > 0 else None
    if bias is not None:
        bias = jnp.asarray(bias)
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    args = [jnp.asarray(x) if x is not None else _launch.placeholder()
            for x in (q, k, v, bias, alibi_slopes, seed, cu_seqlens_q, cu_seqlens_k, seqused_k,
                      block_table)]
    out, lse = _differentiable(problem)(*args)
    return (out, lse) if return_lse else out


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              bias=None, alibi_slopes=None, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, dropout_p: float = 0.0, dropout_seed=None,
              return_lse: bool = False, deterministic: bool = False, seqused_k=None,
              block_table=None):
    """Softmax attention with the FlashAttention-2 kernels; same API as fa_torch.attention.

    q ``(batch, seqlen_q, heads_q, head_dim)``, k and v ``(batch, seqlen_k, heads_k,
    head_dim)``, ``heads_q % heads_k == 0``; fp16, bf16 or fp32. Works under ``jit``,
    ``grad`` and ``vmap``. Options as in fa_torch: ``bias`` (broadcastable to
    (B, Hq, Sq, Sk), differentiable), ``alibi_slopes`` ((Hq,) or (B, Hq) fp32),
    ``window_size`` (left, right; -1 unbounded), ``softcap``, ``dropout_p`` with
    ``dropout_seed`` (an int, a uint32 array, possibly traced, or a PRNG key; required).
    Returns ``out``, or ``(out, lse)`` with ``return_lse`` (lse ``(batch, heads_q,
    seqlen_q)`` fp32, natural log, -inf for a row with no key; differentiable). The
    backward never uses atomics: it is always deterministic. ``seqused_k`` ``(batch,)``
    int32 (may be traced): entry b attends to its first ``seqused_k[b]`` keys only, as if
    k and v held those alone (the causal/window alignment and ALiBi use that count); the
    other key rows are never read and get a zero gradient. Concrete values are checked
    to lie in [0, seqlen_k]; traced ones are clamped into it by the kernels.
    ``block_table`` ``(batch, pages_per_entry)`` int32: a paged K/V cache (forward only),
    k and v a pool ``(num_pages, page_size, heads_k, head_dim)`` of pages of any size;
    entry b's key j is row ``j % page_size`` of page ``block_table[b, j // page_size]``.
    Concrete page numbers are checked; traced ones are clamped into the pool.
    """
    return _call(q, k, v, None, None, 0, 0, causal=causal, softmax_scale=softmax_scale,
                 bias=bias, alibi_slopes=alibi_slopes, window_size=window_size, softcap=softcap,
                 dropout_p=dropout_p, dropout_seed=dropout_seed, return_lse=return_lse,
                 deterministic=deterministic, seqused_k=seqused_k, block_table=block_table)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     *, causal: bool = False, softmax_scale: float | None = None,
                     alibi_slopes=None, window_size: tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, dropout_p: float = 0.0, dropout_seed=None,
                     return_lse: bool = False, deterministic: bool = False, bias=None,
                     seqused_k=None, block_table=None):
    """Attention over packed sequences: q ``(total_q, heads_q, head_dim)``, k and v
    ``(total_k, heads_k, head_dim)``, int32 ``cu_seqlens`` of shape (batch + 1,).
    ``max_seqlen_*`` are static Python ints that bound the lengths. Concrete cu_seqlens
    are checked; traced ones are trusted. lse is ``(heads_q, total_q)``. ``seqused_k``
    ``(batch,)`` int32: sequence b uses only its first ``seqused_k[b]`` keys.
    ``block_table``: k and v are a paged pool, as in ``attention``; cu_seqlens_k then give
    the key counts only."""
    return _call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                 softmax_scale=softmax_scale, bias=bias, alibi_slopes=alibi_slopes,
                 window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                 dropout_seed=dropout_seed, return_lse=return_lse, deterministic=deterministic,
                 seqused_k=seqused_k, block_table=block_table)


def dropout_mask(dropout_seed, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float):
    """The keep mask ``(batch, heads, seqlen_q, seqlen_k)`` bool that attention with this
    seed and dropout_p applies (for tests and debugging)."""
    launch = fa_plan.dropout_mask_plan(batch, heads, seqlen_q, seqlen_k, dropout_p,
                                       capability=_launch.capability())
    seed = _sharding.with_offsets(dropout_seed_array(dropout_seed), jnp.zeros(1, jnp.int32),
                                  jnp.zeros(1, jnp.int32))
    return _launch.run(launch, {"seed": seed})["mask"].astype(bool)


def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False,
                       softmax_scale: float | None = None):
    """The kernels' backward on its own: (dq, dk, dv) of attention(q, k, v) for the
    output gradient ``dout``, given ``out`` and ``lse`` of the forward.

    ``out`` and ``lse`` may belong to a larger attention of which (k, v) is one part:
    with the merged output and LSE, the result is that part's share of the gradients
    (ring attention, ``fa_jax.ring``, sums these shares around the ring).
    """
    _check_arrays({"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout})
    problem = validate({"q": q, "k": k, "v": v}, causal=causal, softmax_scale=softmax_scale)
    for name, x, shape in (("out", out, problem.out_shape), ("dout", dout, problem.out_shape),
                           ("lse", lse, problem.lse_shape)):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {shape}; got {tuple(x.shape)}")
    unused = [_launch.placeholder() for _ in ARRAY_NAMES[3:]]
    lse = lse.astype(jnp.float32)  # (no bias: the kernels read no lse_lo)
    grads = backward_op(problem)(q, k, v, *unused, out, lse, lse, dout,
                                 jnp.zeros(lse.shape, jnp.float32))
    return grads[:3]
