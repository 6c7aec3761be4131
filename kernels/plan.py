"""The launch plan: validation, grid, block sizes, strides and constexprs.

Pure Python on ints and strings, shared by fa_torch, fa_jax and the tests; nothing
else computes a grid or a stride. A front end converts its arrays, asks for a plan
and launches each ``Launch`` in order:

    kernel(name)[grid](*inputs, *scalars, *outputs, **constexprs,
                       num_warps=..., num_stages=...)

which is also the argument order ``jax_triton.triton_call`` uses (arrays and
scalars positionally, outputs appended, constexprs as keywords).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .configs import tile_config

DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Output:
    """An array a launch writes: allocate it with this shape and dtype (contiguous)."""
    name: str
    shape: Shape
    dtype: str


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    inputs: tuple[str, ...]
    scalars: tuple
    outputs: tuple[Output, ...]
    constexprs: dict = field(hash=False)
    num_warps: int
    num_stages: int

    @property
    def empty(self) -> bool:
        """True when the grid has no program (some dimension is 0): skip the launch."""
        return math.prod(self.grid) == 0


@dataclass(frozen=True)
class AttentionProblem:
    """The validated shape of one attention call, layout (batch, seqlen, heads, head_dim)."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim: int
    dtype: str
    causal: bool
    softmax_scale: float

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_k

    @property
    def block_d(self) -> int:
        return max(16, 1 << (self.head_dim - 1).bit_length())

    @property
    def out_shape(self) -> Shape:
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim)

    @property
    def lse_shape(self) -> Shape:
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def dot_precision(self) -> str:
        # fp32 inputs get true fp32 products, not tf32.
        return "ieee" if self.dtype == "float32" else "tf32"


@dataclass(frozen=True)
class ForwardPlan:
    problem: AttentionProblem
    launch: Launch


@dataclass(frozen=True)
class BackwardPlan:
    problem: AttentionProblem
    preprocess: Launch
    dkdv: Launch
    dq: Launch

    @property
    def launches(self) -> tuple[Launch, ...]:
        return (self.preprocess, self.dkdv, self.dq)


# ---------------------------------------------------------------------------
# Validation


def _check_rank4(name: str, shape: Shape, layout: str) -> None:
    if len(shape) != 4:
        raise ValueError(
            f"{name} must have 4 dimensions {layout}; got shape {tuple(shape)} "
            f"({len(shape)} dimensions)")


def check_dtypes(q_dtype: str, k_dtype: str, v_dtype: str) -> str:
    """The common dtype of q, k, v as one of DTYPES, or a TypeError naming the culprit."""
    for name, dtype in (("q", q_dtype), ("k", k_dtype), ("v", v_dtype)):
        if dtype not in DTYPES:
            raise TypeError(
                f"{name} has dtype {dtype}; expected one of {', '.join(DTYPES)}")
    if not (q_dtype == k_dtype == v_dtype):
        raise TypeError(
            f"q, k and v must have the same dtype; got q {q_dtype}, k {k_dtype}, v {v_dtype}")
    return q_dtype


def normalize_softmax_scale(softmax_scale, head_dim: int) -> float:
    """``None`` means head_dim ** -0.5; 0.0 is a legal scale (all scores equal)."""
    if softmax_scale is None:
        return head_dim ** -0.5 if head_dim > 0 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be a real number or None; got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite; got {scale}")
    return scale


def check_problem(q_shape: Shape, k_shape: Shape, v_shape: Shape,
                  q_dtype: str, k_dtype: str, v_dtype: str, *,
                  causal: bool = False, softmax_scale=None) -> AttentionProblem:
    """Validate q, k, v and the options; raise ValueError/TypeError before any launch."""
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    _check_rank4("q", q_shape, "(batch, seqlen_q, heads_q, head_dim)")
    _check_rank4("k", k_shape, "(batch, seqlen_k, heads_k, head_dim)")
    _check_rank4("v", v_shape, "(batch, seqlen_k, heads_k, head_dim)")
    dtype = check_dtypes(q_dtype, k_dtype, v_dtype)
    batch, seqlen_q, heads_q, head_dim = q_shape
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape; got k {k_shape}, v {v_shape}")
    batch_k, seqlen_k, heads_k, head_dim_k = k_shape
    if batch_k != batch:
        raise ValueError(f"q and k must have the same batch size; got q {q_shape}, k {k_shape}")
    if head_dim_k != head_dim:
        raise ValueError(
            f"q and k must have the same head_dim (last dimension); got q {q_shape}, k {k_shape}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}; got {head_dim} "
                         f"(q shape {q_shape})")
    if heads_k < 1 or heads_q % heads_k != 0:
        raise ValueError(
            f"heads_q ({heads_q}) must be a multiple of heads_k ({heads_k}) for GQA/MQA; "
            f"got q {q_shape}, k {k_shape}")
    if not isinstance(causal, bool) and type(causal).__name__ != "bool_":
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    return AttentionProblem(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype,
                            bool(causal), normalize_softmax_scale(softmax_scale, head_dim))


def check_unbuilt(*, bias, alibi_slopes, window_size, softcap, dropout_p) -> None:
    """Options of the public API the kernels do not carry yet: refuse, never ignore."""
    unbuilt = []
    if bias is not None:
        unbuilt.append("bias")
    if alibi_slopes is not None:
        unbuilt.append("alibi_slopes")
    if tuple(window_size) != (-1, -1):
        unbuilt.append("window_size")
    if softcap:
        unbuilt.append("softcap")
    if dropout_p:
        unbuilt.append("dropout_p")
    if unbuilt:
        raise NotImplementedError(
            f"{', '.join(unbuilt)}: not implemented yet (README, 'Status'); the call is "
            "refused rather than the option silently ignored")


def contiguous_strides(shape: Shape) -> Shape:
    """Row-major element strides of a shape (what jax arrays and new outputs have)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _strides(name: str, shape: Shape, strides: Shape | None) -> Shape:
    if strides is None:
        return contiguous_strides(shape)
    strides = tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise ValueError(f"{name}: {len(strides)} strides for shape {tuple(shape)}")
    if shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1); got strides {strides}")
    return strides


def _bsh(strides: Shape) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (batch, seq, head, dim) array."""
    return strides[0], strides[1], strides[2]


def _aligned(*strides: Shape) -> bool:
    """All (batch, seq, head) strides multiples of 16 elements (see helpers.aligned)."""
    return all(s % 16 == 0 for st in strides for s in st[:3])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------
# Plans


def forward_plan(problem: AttentionProblem, *, capability: tuple[int, int] | None,
                 q_strides: Shape | None = None, k_strides: Shape | None = None,
                 v_strides: Shape | None = None) -> ForwardPlan:
    """How to launch the forward. ``capability`` is the GPU's (major, minor), None
    for the CPU interpreter. Strides are in elements; None means contiguous."""
    p = problem
    q_st = _strides("q", p.out_shape, q_strides)
    k_st = _strides("k", (p.batch, p.seqlen_k, p.heads_k, p.head_dim), k_strides)
    v_st = _strides("v", (p.batch, p.seqlen_k, p.heads_k, p.head_dim), v_strides)
    o_st = contiguous_strides(p.out_shape)
    l_st = contiguous_strides(p.lse_shape)
    cfg = tile_config("forward", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability)
    launch = Launch(
        kernel="attention_forward",
        grid=(_cdiv(p.seqlen_q, cfg.block_m), p.heads_q, p.batch),
        inputs=("q", "k", "v"),
        scalars=(p.softmax_scale * LOG2E, p.seqlen_q, p.seqlen_k,
                 *_bsh(q_st), *_bsh(k_st), *_bsh(v_st), *_bsh(o_st), l_st[0], l_st[1]),
        outputs=(Output("out", p.out_shape, p.dtype), Output("lse", p.lse_shape, "float32")),
        constexprs=dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=cfg.block_m,
                        BLOCK_N=cfg.block_n, GROUP_SIZE=p.group_size, IS_CAUSAL=p.causal,
                        DOT_PRECISION=p.dot_precision,
                        STRIDES_ALIGNED=_aligned(q_st, k_st, v_st, o_st)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return ForwardPlan(problem, launch)


def backward_plan(problem: AttentionProblem, *, capability: tuple[int, int] | None,
                  q_strides: Shape | None = None, k_strides: Shape | None = None,
                  v_strides: Shape | None = None, out_strides: Shape | None = None,
                  dout_strides: Shape | None = None) -> BackwardPlan:
    """How to launch the backward: D = rowsum(dO * O) - dLSE, then dK/dV, then dQ.

    Inputs by name: q, k, v, out, dout (shapes of the forward), lse and dlse
    (batch, heads_q, seqlen_q) fp32, contiguous; ``delta`` is the preprocess output.
    """
    p = problem
    kv_shape = (p.batch, p.seqlen_k, p.heads_k, p.head_dim)
    q_st = _strides("q", p.out_shape, q_strides)
    k_st = _strides("k", kv_shape, k_strides)
    v_st = _strides("v", kv_shape, v_strides)
    o_st = _strides("out", p.out_shape, out_strides)
    do_st = _strides("dout", p.out_shape, dout_strides)
    l_st = contiguous_strides(p.lse_shape)
    dq_st = contiguous_strides(p.out_shape)
    dkv_st = contiguous_strides(kv_shape)

    pre = tile_config("preprocess", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability)
    preprocess = Launch(
        kernel="attention_backward_preprocess",
        grid=(_cdiv(p.seqlen_q, pre.block_m), p.heads_q, p.batch),
        inputs=("out", "dout", "dlse"),
        scalars=(p.seqlen_q, *_bsh(o_st), *_bsh(do_st), l_st[0], l_st[1]),
        outputs=(Output("delta", p.lse_shape, "float32"),),
        constexprs=dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=pre.block_m,
                        STRIDES_ALIGNED=_aligned(o_st, do_st)),
        num_warps=pre.num_warps,
        num_stages=pre.num_stages,
    )

    common_scalars = (p.softmax_scale, p.softmax_scale * LOG2E, p.seqlen_q, p.seqlen_k,
                      *_bsh(q_st), *_bsh(k_st), *_bsh(v_st), *_bsh(do_st), l_st[0], l_st[1])
    inputs = ("q", "k", "v", "dout", "lse", "delta")

    def constexprs(cfg):
        return dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n, GROUP_SIZE=p.group_size, IS_CAUSAL=p.causal,
                    DOT_PRECISION=p.dot_precision,
                    STRIDES_ALIGNED=_aligned(q_st, k_st, v_st, do_st, dq_st, dkv_st))

    kv = tile_config("dkdv", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability)
    dkdv = Launch(
        kernel="attention_backward_dkdv",
        grid=(_cdiv(p.seqlen_k, kv.block_n), p.heads_k, p.batch),
        inputs=inputs,
        scalars=(*common_scalars, *_bsh(dkv_st), *_bsh(dkv_st)),
        outputs=(Output("dk", kv_shape, p.dtype), Output("dv", kv_shape, p.dtype)),
        constexprs=constexprs(kv),
        num_warps=kv.num_warps,
        num_stages=kv.num_stages,
    )
    qc = tile_config("dq", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability)
    dq = Launch(
        kernel="attention_backward_dq",
        grid=(_cdiv(p.seqlen_q, qc.block_m), p.heads_q, p.batch),
        inputs=inputs,
        scalars=(*common_scalars, *_bsh(dq_st)),
        outputs=(Output("dq", p.out_shape, p.dtype),),
        constexprs=constexprs(qc),
        num_warps=qc.num_warps,
        num_stages=qc.num_stages,
    )
    return BackwardPlan(problem, preprocess, dkdv, dq)
