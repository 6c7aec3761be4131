"""The launch plan: validation, grid, block sizes, strides and constexprs.

Pure Python on ints and strings, shared by fa_torch, fa_jax and the tests; nothing
else computes a grid or a stride. A front end converts its arrays, asks for a plan
and launches each ``Launch`` in order:

    kernel(name)[grid](*inputs, *blocks, *scalars, *outputs, **constexprs,
                       num_warps=..., num_stages=...)

which is also the argument order ``jax_triton.triton_call`` uses (arrays and
scalars positionally, outputs appended, constexprs as keywords). Inputs and outputs
follow the kernel's array parameters in order; ``blocks`` are the kernel's ``*Blocks``
parameters (``Blocks``: an input array, or a tensor descriptor over it that the front
end builds on the host); ``scalars`` are named by the kernel's parameter names, and
``registry.scalar_arguments`` puts them in its order. Inputs a problem
does not use (no bias, no dropout...) are still passed, as any 1-element array:
their constexpr flag is off, so the kernel never touches them.

The dropout ``seed`` input is (4,) int32: the low and high halves of the 64-bit seed,
then the global index of the launch's first batch entry and first head (0, 0 unless
a sharded caller launches on a slice), so that the keep mask stays a function of
(seed, batch, head, i, j) alone.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import numbers
import operator
from dataclasses import dataclass, field, replace

import numpy as np

from . import configs
from .configs import ITEMSIZE, TileConfig, seqlen_bucket, tile_config

DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
INT32_MAX = 2**31 - 1
LOG2E = 1.4426950408889634
# Every array argument of the attention kernels, in signature order.
ATTENTION_INPUTS = ("q", "k", "v", "bias", "slopes", "seed", "cu_seqlens_q", "cu_seqlens_k",
                    "seqused_k", "block_table")
BACKWARD_INPUTS = ("q", "k", "v", "dout", "lse", "lse_lo", "delta", "bias", "slopes", "seed",
                   "cu_seqlens_q", "cu_seqlens_k", "seqused_k")

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Output:
    """An array a launch writes: allocate it with this shape and dtype (contiguous);
    ``zeroed`` outputs must start as zeros (the kernel writes only part of them)."""
    name: str
    shape: Shape
    dtype: str
    zeroed: bool = False


@dataclass(frozen=True)
class Blocks:
    """What a kernel's ``*Blocks`` parameter receives: the input ``array`` itself (no
    ``block_shape``: the kernel reads it through pointers or builds descriptors on the
    device), or a tensor descriptor over it made on the host with this shape, element
    strides and block: for the blocks a loop streams, (batch, seqlen, heads, head_dim)
    read (1, rows, 1, BLOCK_D) at a time; for the blocks a backward program holds, the
    array's rows as memory lays them out, (rows, row pitch) read (rows, BLOCK_D) at a time
    (``_flat_rows``). Host descriptors need no device scratch; jax-triton 0.4 encodes them
    per launch."""
    array: str
    shape: Shape = ()
    strides: Shape = ()
    block_shape: Shape | None = None

    @property
    def host_descriptor(self) -> bool:
        return self.block_shape is not None

    def plain(self) -> "Blocks":
        return Blocks(self.array)


def block_arguments(launch: "Launch", inputs: list, descriptor) -> list:
    """A kernel's ``*Blocks`` arguments for ``inputs`` (in ``launch.inputs`` order): each
    input array, or ``descriptor(array, shape, strides, block_shape)`` over it, the
    front end's host descriptor type."""
    arrays = dict(zip(launch.inputs, inputs))
    return [descriptor(arrays[b.array], b.shape, b.strides, b.block_shape)
            if b.host_descriptor else arrays[b.array] for b in launch.blocks]


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    inputs: tuple[str, ...]
    scalars: dict = field(hash=False)  # by the kernel's parameter names
    outputs: tuple[Output, ...]
    constexprs: dict = field(hash=False)
    num_warps: int
    num_stages: int
    blocks: tuple[Blocks, ...] = ()  # the kernel's *Blocks parameters, in order
    # Registers a thread at launch, where the kernel's partitions share them out
    # themselves (a Gluon kernel's warp_specialize); None: the compiler's choice.
    maxnreg: int | None = None

    @property
    def empty(self) -> bool:
        """True when the grid has no program (some dimension is 0): skip the launch."""
        return math.prod(self.grid) == 0

    def to_json(self) -> str:
        """The launch as text, for a host callback to rebuild it (``Launch.from_json``)."""
        return json.dumps(dict(kernel=self.kernel, grid=self.grid, inputs=self.inputs,
                               scalars=self.scalars,
                               outputs=[[o.name, o.shape, o.dtype, o.zeroed] for o in self.outputs],
                               constexprs=self.constexprs, num_warps=self.num_warps,
                               num_stages=self.num_stages,
                               blocks=[[b.array, b.shape, b.strides, b.block_shape]
                                       for b in self.blocks],
                               maxnreg=self.maxnreg), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Launch":
        d = json.loads(text)
        return cls(kernel=d["kernel"], grid=tuple(d["grid"]), inputs=tuple(d["inputs"]),
                   scalars=d["scalars"],
                   outputs=tuple(Output(n, tuple(shape), dtype, zeroed)
                                 for n, shape, dtype, zeroed in d["outputs"]),
                   constexprs=d["constexprs"], num_warps=d["num_warps"],
                   num_stages=d["num_stages"],
                   blocks=tuple(Blocks(a, tuple(shape), tuple(strides),
                                       None if block is None else tuple(block))
                                for a, shape, strides, block in d["blocks"]),
                   maxnreg=d["maxnreg"])


@dataclass(frozen=True)
class AttentionProblem:
    """One validated attention call. Layout (batch, seqlen, heads, head_dim); for varlen,
    (total_tokens, heads, head_dim) with ``batch`` sequences of at most seqlen_q/k."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim: int
    dtype: str
    causal: bool
    softmax_scale: float
    window_left: int = -1   # effective window: causal already folded into window_right = 0
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    bias_shape: Shape | None = None      # padded to 4-D, broadcastable to (B, Hq, Sq, Sk)
    alibi_shape: Shape | None = None     # (Hq,) or (B, Hq)
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0
    bias_dtype: str | None = None
    seqused_k: bool = False  # a (batch,) int32 count of the keys each entry uses
    # Paged K/V (block_table): k and v are a pool (num_pages, page_size, heads_k, head_dim);
    # entry b's key j is row j % page_size of page block_table[b, j // page_size].
    page_size: int = 0       # 0: not paged
    num_pages: int = 0
    pages_per_entry: int = 0  # block_table's (batch, pages_per_entry)

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def bias_item(self) -> int:
        """Bytes of one bias element; 0 without a bias."""
        return ITEMSIZE[self.bias_dtype] if self.bias_shape is not None else 0

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_k

    @property
    def block_d(self) -> int:
        return max(16, 1 << (self.head_dim - 1).bit_length())

    @property
    def q_shape(self) -> Shape:
        if self.varlen:
            return (self.total_q, self.heads_q, self.head_dim)
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim)

    @property
    def kv_shape(self) -> Shape:
        if self.paged:
            return (self.num_pages, self.page_size, self.heads_k, self.head_dim)
        if self.varlen:
            return (self.total_k, self.heads_k, self.head_dim)
        return (self.batch, self.seqlen_k, self.heads_k, self.head_dim)

    out_shape = q_shape

    @property
    def lse_shape(self) -> Shape:
        if self.varlen:
            return (self.heads_q, self.total_q)
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def dbias_shape(self) -> Shape:
        return (self.batch, self.heads_q, self.seqlen_q, self.seqlen_k)

    @property
    def bias_reduce_axes(self) -> tuple[int, ...]:
        """Axes of the dense (B, Hq, Sq, Sk) bias gradient to sum for a broadcast bias."""
        full = self.dbias_shape
        return tuple(i for i, (n, m) in enumerate(zip(self.bias_shape, full)) if n == 1 and m != 1)

    @property
    def dot_precision(self) -> str:
        # fp32 inputs get true fp32 products, not tf32.
        return "ieee" if self.dtype == "float32" else "tf32"


@dataclass(frozen=True)
class ForwardPlan:
    """The forward kernel, and with split-KV (``num_splits > 1``) the kernel that merges
    its partial results (``combine``). Run ``launches`` in order."""
    problem: AttentionProblem
    launch: Launch
    combine: Launch | None = None
    num_splits: int = 1
    pack_gqa: bool = False

    @property
    def launches(self) -> tuple[Launch, ...]:
        return (self.launch,) if self.combine is None else (self.launch, self.combine)


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


def _check_rank(name: str, shape: Shape, rank: int, layout: str) -> None:
    if len(shape) != rank:
        raise ValueError(
            f"{name} must have {rank} dimensions {layout}; got shape {tuple(shape)} "
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


def _real(name: str, value, expected: str = "a real number") -> float:
    """A Python or numpy real scalar (a 0-d numpy array too) as a finite float."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "fiu":
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}; got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return value


FLOAT32_TINY = 2.0 ** -126  # the smallest normal fp32


def resized(problem: AttentionProblem, q_shape: Shape, kv_shape: Shape,
            bias_shape: Shape | None = None, alibi_shape: Shape | None = None) -> AttentionProblem:
    """The validated ``problem`` on arrays with other batch or head counts: one shard of
    it, or a vmapped batch folded into it. Nothing is validated again: only what the
    arrays' shapes say changes (lengths, head dim, dtypes and options stay)."""
    if problem.paged:  # k, v: the page pool
        changes = dict(heads_k=kv_shape[2], num_pages=kv_shape[0])
        changes.update(dict(total_q=q_shape[0], heads_q=q_shape[1]) if problem.varlen
                       else dict(batch=q_shape[0], heads_q=q_shape[2]))
    elif problem.varlen:
        changes = dict(total_q=q_shape[0], total_k=kv_shape[0], heads_q=q_shape[1],
                       heads_k=kv_shape[1])
    else:
        changes = dict(batch=q_shape[0], heads_q=q_shape[2], heads_k=kv_shape[2])
    if problem.bias_shape is not None:
        changes["bias_shape"] = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    if problem.alibi_shape is not None:
        changes["alibi_shape"] = tuple(alibi_shape)
    return replace(problem, **changes)

def normalize_softmax_scale(softmax_scale, head_dim: int) -> float:
    """``None`` means head_dim ** -0.5; 0.0 is a legal scale (all scores equal). A scale
    below fp32's normal range is 0.0: GPUs and XLA's CPU threads flush such fp32 values to
    zero, and so every path takes it the same way."""
    if softmax_scale is None:
        return head_dim ** -0.5 if head_dim > 0 else 1.0
    value = _real("softmax_scale", softmax_scale, "a real number or None")
    return 0.0 if abs(value) < FLOAT32_TINY else value


def _describe(value) -> str:
    """A value's type, and its shape when it has one, for error messages."""
    shape = getattr(value, "shape", None)
    text = type(value).__name__
    if shape is not None:
        text += f" of shape {tuple(shape)}"
    return text


def window_pair(window_size) -> tuple[int, int]:
    """``window_size`` as two ints: a pair of ints, or two integer scalars of an array
    library (flash-attn's tests pass a 2-element integer tensor)."""
    array = tuple(getattr(window_size, "shape", ())) == (2,)
    sides = list(window_size) if isinstance(window_size, (tuple, list)) or array else None
    if sides is None or len(sides) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints; got "
                        f"{window_size!r}")
    pair = []
    for side, value in zip(("left", "right"), sides):
        if isinstance(value, (bool, np.bool_)) or "bool" in str(getattr(value, "dtype", "")):
            raise TypeError(f"window_size {side} must be an int; got {type(value).__name__}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"window_size {side} must be an int; got "
                            f"{type(value).__name__}") from None
        if value < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1: unbounded); got {value}")
        pair.append(value)
    return pair[0], pair[1]


def _window(window_size, causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(left, right) with causal folded in (right = 0). A side as wide as the sequences
    bounds nothing and becomes -1: a window of any size (2**63 too) reaches no kernel."""
    left, right = window_pair(window_size)
    # Row i sees keys i + (seqlen_k - seqlen_q) - left .. + right (per sequence with varlen,
    # where these are the max lengths): left >= seqlen_k or right >= seqlen_q bounds nothing.
    left = -1 if left >= seqlen_k else int(left)
    right = 0 if causal else (-1 if right >= seqlen_q else int(right))
    return left, right


BIAS_DTYPES = DTYPES + ("float64",)  # read as fp32 (helpers.scores)


def _check_bias(bias_shape, bias_dtype, full: Shape) -> Shape:
    shape = tuple(bias_shape)
    if bias_dtype not in BIAS_DTYPES:
        raise TypeError(f"bias has dtype {bias_dtype}; expected one of {', '.join(BIAS_DTYPES)}")
    if len(shape) > 4:
        raise ValueError(f"bias must have at most 4 dimensions (batch, heads_q, seqlen_q, "
                         f"seqlen_k); got shape {shape}")
    padded = (1,) * (4 - len(shape)) + shape
    if any(n not in (1, m) for n, m in zip(padded, full)):
        raise ValueError(f"bias of shape {shape} does not broadcast to (batch, heads_q, "
                         f"seqlen_q, seqlen_k) = {full}")
    return padded


def _check_alibi(alibi_shape, alibi_dtype, batch: int, heads_q: int) -> Shape:
    shape = tuple(alibi_shape)
    if alibi_dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32; got {alibi_dtype}")
    if shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or "
                         f"(batch, heads_q) = ({batch}, {heads_q}); got {shape}")
    return shape


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit dropout seed as the kernels read it: its low and high 32 bits, each as a
    signed int32 (the first two words of the ``seed`` input; both front ends use this)."""
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"dropout_seed must be in [0, 2**64); got {seed}")
    return tuple(w - 2 ** 32 if w >= 2 ** 31 else w for w in (seed & 0xFFFFFFFF, seed >> 32))


def seed_from_words(low: int, high: int) -> int:
    """The 64-bit seed of two int32 words (``seed_words`` inverted)."""
    return (int(low) & 0xFFFFFFFF) | ((int(high) & 0xFFFFFFFF) << 32)


def check_dropout_p(dropout_p) -> float:
    """The dropout probability as a float in [0, 1), or an error naming it."""
    dropout_p = _real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    return dropout_p


def check_bool(name: str, value) -> bool:
    """A bool option (numpy's bool too), or a TypeError naming it."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return bool(value)


def check_problem(q_shape: Shape, k_shape: Shape, v_shape: Shape,
                  q_dtype: str, k_dtype: str, v_dtype: str, *,
                  causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                  softcap: float = 0.0, dropout_p: float = 0.0,
                  bias_shape: Shape | None = None, bias_dtype: str | None = None,
                  alibi_shape: Shape | None = None, alibi_dtype: str | None = None,
                  varlen: dict | None = None, seqused_k_shape: Shape | None = None,
                  seqused_k_dtype: str | None = None, block_table_shape: Shape | None = None,
                  block_table_dtype: str | None = None) -> AttentionProblem:
    """Validate q, k, v and the options; raise ValueError/TypeError before any launch.

    ``varlen``, for packed inputs, holds ``cu_seqlens_q_shape``, ``cu_seqlens_k_shape``,
    their dtypes ``cu_seqlens_q_dtype``/``cu_seqlens_k_dtype`` and ``max_seqlen_q``,
    ``max_seqlen_k``. ``seqused_k_shape``/``seqused_k_dtype`` describe ``seqused_k``, the
    number of keys each batch entry uses (its first ones): (batch,) int32.
    ``block_table_shape``/``block_table_dtype`` describe a paged K/V cache's block table,
    (batch, pages_per_entry) int32; k and v are then the page pool (num_pages, page_size,
    heads_k, head_dim), padded or varlen q alike (forward only).
    """
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    paged = block_table_shape is not None
    if varlen is None:
        _check_rank("q", q_shape, 4, "(batch, seqlen_q, heads_q, head_dim)")
    else:
        _check_rank("q", q_shape, 3, "(total_q, heads_q, head_dim)")
    if paged:
        for name, shape in (("k", k_shape), ("v", v_shape)):
            _check_rank(name, shape, 4, "(num_pages, page_size, heads_k, head_dim) with "
                        "block_table")
    elif varlen is None:
        _check_rank("k", k_shape, 4, "(batch, seqlen_k, heads_k, head_dim)")
        _check_rank("v", v_shape, 4, "(batch, seqlen_k, heads_k, head_dim)")
    else:
        _check_rank("k", k_shape, 3, "(total_k, heads_k, head_dim)")
        _check_rank("v", v_shape, 3, "(total_k, heads_k, head_dim)")
    dtype = check_dtypes(q_dtype, k_dtype, v_dtype)
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape; got k {k_shape}, v {v_shape}")
    heads_q, head_dim = q_shape[-2:]
    heads_k, head_dim_k = k_shape[-2:]
    if varlen is None:
        batch, seqlen_q = q_shape[:2]
        batch_k, seqlen_k = k_shape[:2]
        if batch_k != batch and not paged:
            raise ValueError(
                f"q and k must have the same batch size; got q {q_shape}, k {k_shape}")
        total_q = total_k = 0
    else:
        batch, seqlen_q, seqlen_k = _check_varlen(varlen)
        total_q, total_k = q_shape[0], k_shape[0]
        sides = (("q", seqlen_q, total_q),) if paged else (("q", seqlen_q, total_q),
                                                            ("k", seqlen_k, total_k))
        for side, longest, total in sides:
            if longest > total:  # the grid grows with it: never past what the arrays hold
                raise ValueError(f"max_seqlen_{side} ({longest}) is larger than the number of "
                                 f"packed tokens ({total}); pass at most {total}")
    pages = (0, 0, 0)
    if paged:
        pages = _check_block_table(tuple(block_table_shape), block_table_dtype, batch, k_shape)
        num_pages, page_size, pages_per_entry = pages
        if varlen is None:
            seqlen_k = pages_per_entry * page_size
        elif seqlen_k > pages_per_entry * page_size:
            raise ValueError(f"max_seqlen_k ({seqlen_k}) is more keys than block_table's "
                             f"{pages_per_entry} pages of {page_size} rows address")
        else:  # cu_seqlens_k give the lengths only: the table places the keys
            total_k = INT32_MAX
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
    causal = check_bool("causal", causal)
    window_left, window_right = _window(window_size, causal, seqlen_q, seqlen_k)
    softcap = _real("softcap", softcap)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: off); got {softcap}")
    dropout_p = check_dropout_p(dropout_p)
    if bias_shape is not None:
        if varlen is not None:
            raise ValueError("bias is not supported with varlen inputs (use alibi_slopes or "
                             "the padded layout)")
        bias_shape = _check_bias(bias_shape, bias_dtype, (batch, heads_q, seqlen_q, seqlen_k))
    if alibi_shape is not None:
        alibi_shape = _check_alibi(alibi_shape, alibi_dtype, batch, heads_q)
    if seqused_k_shape is not None:
        _check_seqused_k(tuple(seqused_k_shape), seqused_k_dtype, batch)
    return AttentionProblem(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype,
                            causal, normalize_softmax_scale(softmax_scale, head_dim),
                            window_left, window_right, softcap, dropout_p, bias_shape,
                            alibi_shape, varlen is not None, total_q, total_k,
                            bias_dtype if bias_shape is not None else None,
                            seqused_k_shape is not None, pages[1], pages[0], pages[2])


def _check_block_table(shape: Shape, dtype: str, batch: int, k_shape: Shape) -> tuple:
    """(num_pages, page_size, pages_per_entry) of a paged cache: any page size."""
    if dtype != "int32":
        raise TypeError(f"block_table must be int32; got {dtype}")
    if len(shape) != 2 or shape[0] != batch or shape[1] < 1:
        raise ValueError(f"block_table must have shape (batch, pages_per_entry) = ({batch}, "
                         f">= 1); got {shape}")
    num_pages, page_size = k_shape[:2]
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"k and v with block_table are a pool (num_pages, page_size, heads_k, "
                         f"head_dim) of at least one page of one row; got k {k_shape}")
    return num_pages, page_size, shape[1]


def check_block_table(values, num_pages: int) -> None:
    """Check block_table values where they are on the host: page numbers in the pool (the
    kernels clamp those they cannot check)."""
    for b, row in enumerate(values):
        for i, page in enumerate(row):
            if not 0 <= page < num_pages:
                raise ValueError(f"block_table[{b}, {i}] = {page} is outside the pool of "
                                 f"{num_pages} pages")


def _check_seqused_k(shape: Shape, dtype: str, batch: int) -> None:
    if dtype != "int32":
        raise TypeError(f"seqused_k must be int32; got {dtype}")
    if shape != (batch,):
        raise ValueError(f"seqused_k must have shape (batch,) = ({batch},); got {shape}")


def check_seqused_k(values, seqlens) -> None:
    """Check seqused_k values where they are on the host: entry b in [0, seqlens[b]]
    (the kernels clamp values they cannot check into that range)."""
    for b, (used, seqlen) in enumerate(zip(values, seqlens)):
        if not 0 <= used <= seqlen:
            raise ValueError(f"seqused_k[{b}] must be in [0, {seqlen}] (the keys entry {b} "
                             f"has); got {used}")


def _check_varlen(varlen: dict) -> tuple[int, int, int]:
    """(batch, max_seqlen_q, max_seqlen_k) from the varlen arguments' shapes and dtypes."""
    shapes = []
    for side in ("q", "k"):
        shape = tuple(varlen[f"cu_seqlens_{side}_shape"])
        dtype = varlen[f"cu_seqlens_{side}_dtype"]
        if dtype != "int32":
            raise TypeError(f"cu_seqlens_{side} must be int32; got {dtype}")
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"cu_seqlens_{side} must have shape (batch + 1,); got {shape}")
        shapes.append(shape)
    if shapes[0] != shapes[1]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same shape (batch + 1,); "
                         f"got {shapes[0]} and {shapes[1]}")
    maxes = []
    for side in ("q", "k"):
        value = varlen[f"max_seqlen_{side}"]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise TypeError(f"max_seqlen_{side} must be a non-negative Python int (static); "
                            f"got {value!r}")
        maxes.append(int(value))
    return shapes[0][0] - 1, maxes[0], maxes[1]


def check_cu_seqlens(name: str, values, total: int | None,
                     max_seqlen: int | None = None) -> None:
    """Check cu_seqlens values where they are on the host: start 0, non-decreasing, end
    ``total`` (None: anywhere, as cu_seqlens_k over a paged cache), and no sequence longer
    than ``max_seqlen`` (the kernels would leave its tail out)."""
    values = [int(x) for x in values]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing; got {values}")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name} must end at the number of tokens ({total}); got {values[-1]}")
    longest = max((b - a for a, b in zip(values, values[1:])), default=0)
    if max_seqlen is not None and longest > max_seqlen:
        side = name.rsplit("_", 1)[-1]
        raise ValueError(f"max_seqlen_{side} ({max_seqlen}) is smaller than the longest sequence "
                         f"in {name} ({longest} tokens); pass max_seqlen_{side} >= {longest}")


class CacheOverflowError(ValueError, RuntimeError):
    """``cache_seqlens`` (plus the new rows) past the rows the cache, or its block table,
    addresses: a ValueError, and the RuntimeError flash-attn raises for it."""


@dataclass(frozen=True)
class KVCacheCall:
    """What a validated ``flash_attn_with_kvcache`` call appends and rotates."""
    batch: int
    seqlen_cache: int     # rows of a cache entry
    seqlen_new: int       # rows of new k/v appended at cache_seqlens (0: none)
    rotary_dim: int       # leading head-dim channels rotated (0: no rotary)
    rotate_q_per_row: bool  # q row i at position cache_seqlens + i (causal or local), else
                            # every row at cache_seqlens
    seqlen_q: int = 0
    seqlen_ro: int = 0    # positions in the rotary tables
    cache_seqlens: int | None = None  # the value when given as an int (None: an array, or
                                      # every entry full)
    return_lse: bool = False
    paged: bool = False   # block_table: seqlen_cache is what its columns address

    @property
    def rotary_positions(self) -> int:
        """Positions past cache_seqlens[b] that the rotary tables must hold."""
        return max(self.seqlen_new, self.seqlen_q if self.rotate_q_per_row else 1)


def check_kvcache(arrays: dict, *, cache_seqlens=None, causal=False, window_size=(-1, -1),
                  num_splits=0, return_softmax_lse=False) -> KVCacheCall:
    """Validate what the KV-cache call adds to attention (the attention itself is checked
    by ``check_problem``). ``arrays``: (shape, dtype name) by name of the arrays given
    (q, k_cache, v_cache; k, v, cache_seqlens, cache_batch_idx, cache_leftpad, rotary_cos,
    rotary_sin, block_table when given); ``cache_seqlens`` is the value when it is not an
    array (None or an int). With ``block_table`` (batch, pages_per_entry) the caches are a
    page pool (num_pages, page_size, heads_k, head_dim), any page size, and an entry holds
    ``pages_per_entry * page_size`` rows.
    """
    def shape(name):
        return tuple(arrays[name][0]) if name in arrays else None

    def dtype(name):
        return arrays[name][1] if name in arrays else None

    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) \
            or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the plan chooses); got "
                         f"{num_splits!r}")
    q_shape, k_cache_shape = shape("q"), shape("k_cache")
    _check_rank("q", q_shape, 4, "(batch, seqlen_q, heads_q, head_dim)")
    paged = "block_table" in arrays
    _check_rank("k_cache", k_cache_shape, 4, "(num_pages, page_size, heads_k, head_dim) with "
                "block_table" if paged else "(batch_cache, seqlen_cache, heads_k, head_dim)")
    if shape("v_cache") != k_cache_shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got k_cache "
                         f"{k_cache_shape}, v_cache {shape('v_cache')}")
    batch = q_shape[0]
    _, seqlen_cache, heads_k, head_dim = k_cache_shape
    if paged:
        _, page_size, _ = _check_block_table(shape("block_table"), dtype("block_table"), batch,
                                             k_cache_shape)
        seqlen_cache = shape("block_table")[1] * page_size
        for name in ("cache_batch_idx", "cache_leftpad"):
            if name in arrays:  # (flash-attn refuses both with a paged cache too)
                raise ValueError(f"{name} cannot be used with block_table: the block table "
                                 f"already says where each entry's rows are")
    if ("k" in arrays) != ("v" in arrays):
        raise ValueError("k and v are appended together: pass both or neither")
    seqlen_new = 0
    if "k" in arrays:
        k_shape, v_shape = shape("k"), shape("v")
        _check_rank("k", k_shape, 4, "(batch, seqlen_new, heads_k, head_dim)")
        if k_shape != v_shape or k_shape[0] != batch or k_shape[2:] != (heads_k, head_dim):
            raise ValueError(f"k and v must have shape (batch, seqlen_new, heads_k, head_dim) = "
                             f"({batch}, seqlen_new, {heads_k}, {head_dim}); got k {k_shape}, "
                             f"v {v_shape}")
        for name in ("k", "v"):
            if dtype(name) != dtype("k_cache"):
                raise TypeError(f"{name} must have the cache's dtype {dtype('k_cache')}; got "
                                f"{dtype(name)}")
        seqlen_new = k_shape[1]
        if seqlen_new > seqlen_cache:
            raise ValueError(f"k has {seqlen_new} new rows, more than the cache holds "
                             f"({seqlen_cache})")
    if "cache_seqlens" in arrays:
        if dtype("cache_seqlens") != "int32":
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor; got "
                            f"{dtype('cache_seqlens')}")
        if shape("cache_seqlens") != (batch,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},); got "
                             f"{shape('cache_seqlens')}")
    elif cache_seqlens is not None and (isinstance(cache_seqlens, bool) or not isinstance(
            cache_seqlens, numbers.Integral)):
        raise TypeError(f"cache_seqlens must be None, an int or an int32 tensor; got "
                        f"{type(cache_seqlens).__name__}")
    elif cache_seqlens is None and seqlen_new:
        raise ValueError("appending k and v needs cache_seqlens (where the new rows go)")
    for name in ("cache_batch_idx", "cache_leftpad"):
        if name not in arrays:
            continue
        if dtype(name) != "int32":
            raise TypeError(f"{name} must be int32; got {dtype(name)}")
        if shape(name) != (batch,):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},); got {shape(name)}")
    if "cache_batch_idx" not in arrays and not paged and k_cache_shape[0] != batch:
        raise ValueError(f"k_cache must hold one entry per batch entry ({batch}) without "
                         f"cache_batch_idx; got k_cache {k_cache_shape}")
    rotary_dim = seqlen_ro = 0
    if ("rotary_cos" in arrays) != ("rotary_sin" in arrays):
        raise ValueError("rotary_cos and rotary_sin come together: pass both or neither")
    if "rotary_cos" in arrays:
        if seqlen_new == 0:
            raise ValueError("rotary_cos/rotary_sin rotate the new keys: pass k and v too")
        cos, sin = shape("rotary_cos"), shape("rotary_sin")
        if len(cos) != 2 or cos != sin or not 0 < 2 * cos[1] <= head_dim:
            raise ValueError(f"rotary_cos and rotary_sin must both have shape (seqlen_ro, "
                             f"rotary_dim / 2) with rotary_dim <= head_dim ({head_dim}); got "
                             f"{cos} and {sin}")
        seqlen_ro, rotary_dim = cos[0], 2 * cos[1]
    causal = check_bool("causal", causal)
    per_row = causal or window_pair(window_size) != (-1, -1)
    call = KVCacheCall(batch, seqlen_cache, seqlen_new, rotary_dim, per_row, q_shape[1],
                       seqlen_ro, None if cache_seqlens is None else int(cache_seqlens),
                       check_bool("return_softmax_lse", return_softmax_lse), paged)
    if call.cache_seqlens is not None:
        check_cache_seqlens([call.cache_seqlens] * batch, call)
    return call


def check_cache_seqlens(values, call: KVCacheCall) -> None:
    """Host values of cache_seqlens: the new rows fit, and the rotary tables cover every
    position rotated."""
    for b, used in enumerate(values):
        if not 0 <= used <= call.seqlen_cache - call.seqlen_new:
            holder = (f"the {call.seqlen_cache} rows block_table addresses (its columns times "
                      f"the page size; give it more columns)" if call.paged
                      else f"the cache of {call.seqlen_cache} rows")
            error = CacheOverflowError if used > 0 else ValueError
            raise error(f"cache_seqlens[{b}] = {used}: with {call.seqlen_new} new rows "
                        f"{holder} takes values in [0, {call.seqlen_cache - call.seqlen_new}]")
        if call.rotary_dim and used + call.rotary_positions > call.seqlen_ro:
            raise ValueError(f"rotary_cos/rotary_sin have {call.seqlen_ro} positions; "
                             f"cache_seqlens[{b}] = {used} needs {used + call.rotary_positions}")


def check_cache_leftpad(values, cache_seqlens) -> None:
    """Host values of cache_leftpad: entry b's first used row, at most its filled rows
    (``cache_seqlens``: their values, or None where they are not on the host)."""
    for b, pad in enumerate(values):
        filled = None if cache_seqlens is None else cache_seqlens[b]
        if pad < 0 or (filled is not None and pad > filled):
            raise ValueError(f"cache_leftpad[{b}] = {pad} must be in [0, cache_seqlens[{b}]"
                             f"{'' if filled is None else f' = {filled}'}]")


def check_cache_batch_idx(values, batch_cache: int) -> None:
    for b, index in enumerate(values):
        if not 0 <= index < batch_cache:
            raise ValueError(f"cache_batch_idx[{b}] = {index} is outside the cache's "
                             f"{batch_cache} entries")


RING_LAYOUTS = ("contiguous", "zigzag")


def check_ring(q_shape: Shape, k_shape: Shape, v_shape: Shape, causal, layout: str,
               softmax_scale=None) -> tuple[bool, float, str]:
    """Validate one rank's slices and options for ring attention; returns (causal,
    softmax_scale, layout), the layout to use (the layout only matters for causal
    attention: without it every slice is alike)."""
    causal = check_bool("causal", causal)
    if layout not in RING_LAYOUTS:
        raise ValueError(f"layout must be one of {RING_LAYOUTS}; got {layout!r}")
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        _check_rank(name, tuple(shape), 4, "(batch, seqlen_local, heads, head_dim)")
    if q_shape[1] != k_shape[1]:
        raise ValueError(f"q and k must hold the same sequence slice length; got q "
                         f"{tuple(q_shape)}, k {tuple(k_shape)}")
    if layout == "zigzag" and causal and q_shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two chunks per device: the local seqlen "
                         f"must be even; got {q_shape[1]}")
    scale = normalize_softmax_scale(softmax_scale, q_shape[-1])
    return causal, scale, layout if causal else "contiguous"


@dataclass(frozen=True)
class RingPart:
    """What the local queries compute against one K/V slice at a ring step: the part of
    the local queries and of the slice's keys taking part ("all", or the "first" or
    "second" half of the slice: zigzag's two chunks) and whether the causal mask applies
    (only to a device's own slice: elsewhere a part is all visible or not computed)."""
    queries: str = "all"
    keys: str = "all"
    causal: bool = False


def ring_schedule(causal: bool, layout: str) -> tuple:
    """(own, earlier, later): the ``RingPart`` of a K/V slice the local queries see, when
    the slice is this device's own, an earlier device's or a later one's; None: none of
    it (that step computes nothing). Both ring front ends step through this."""
    if not causal:
        return RingPart(), RingPart(), RingPart()
    if layout == "contiguous":
        return RingPart(causal=True), RingPart(), None
    # zigzag: device i holds chunks i and 2n-1-i. Of an earlier device j < i, chunk j
    # precedes both local chunks and chunk 2n-1-j follows both; both chunks of a later
    # device lie after the local first chunk and before the local second.
    return RingPart(causal=True), RingPart(keys="first"), RingPart(queries="second")


def contiguous_strides(shape: Shape) -> Shape:
    """Row-major element strides of a shape (what jax arrays and new outputs have)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _strides(name: str, shape: Shape, strides: Shape | None) -> Shape:
    if strides is None or math.prod(shape) == 0:  # an empty array is read nowhere
        return contiguous_strides(shape)
    strides = tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise ValueError(f"{name}: {len(strides)} strides for shape {tuple(shape)}")
    if shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1); got strides {strides}")
    return strides


def _bsh(strides: Shape, varlen: bool) -> tuple[int, int, int]:
    """(batch, seq, head) strides; packed varlen arrays have no batch stride."""
    if varlen:
        return 0, strides[0], strides[1]
    return strides[0], strides[1], strides[2]


def bias_strides(bias_shape: Shape, strides: Shape | None) -> tuple[int, int, int, int]:
    """Element strides of a bias broadcast to (B, Hq, Sq, Sk): 0 on size-1 dimensions."""
    padded = tuple(bias_shape)
    given = contiguous_strides(padded) if strides is None else (0,) * (4 - len(strides)) + tuple(strides)
    return tuple(0 if n == 1 else s for n, s in zip(padded, given))


def _aligned(*strides: tuple[int, int, int]) -> bool:
    """All (batch, seq, head) strides multiples of 16 elements (see helpers.aligned)."""
    return all(s % 16 == 0 for st in strides for s in st)


def _descriptors_allowed(capability, dtype: str, *strides: tuple[int, int, int]) -> bool:
    """Tensor descriptors can read these arrays: from Hopper on (the interpreter has them
    too), with every (batch, seq, head) stride a whole number of 16 bytes."""
    return ((capability is None or capability >= (9, 0))
            and all(s * ITEMSIZE[dtype] % 16 == 0 for st in strides for s in st))


def _use_tma(cfg, override: bool | None, capability, dtype: str,
             *strides: tuple[int, int, int]) -> bool:
    """Tensor descriptors for a kernel's streamed blocks, as the table entry says unless
    ``override`` is given, where they can read them."""
    wanted = cfg.tma if override is None else override
    return bool(wanted) and _descriptors_allowed(capability, dtype, *strides)


def _host_descriptors_allowed(p: "AttentionProblem", host: bool, *strides) -> bool:
    """Descriptors over whole (batch, seqlen, heads, head_dim) arrays, made on the host,
    can stand for the device-made ones: not for packed varlen batches nor with seqused_k
    (a sequence's blocks must end at its own last (used) row: the rows past it may hold
    anything, NaN included, and 0 * NaN would reach the sums) nor broadcast arrays (a
    stride of 0)."""
    return (host and not p.varlen and not p.seqused_k and not p.paged
            and all(s > 0 for st in strides for s in st))


def _flat_rows(shape: Shape, strides: tuple[int, int, int], block_d: int) -> tuple | None:
    """(rows, width) of the 2-D view that a held block's host descriptor takes of a
    (batch, seqlen, heads, head_dim) array with these (batch, seq, head) strides: rows one
    seq stride apart, each (batch, head) slab starting at a whole row, its head_dim
    columns inside the row (heads a whole number of rows apart, as (B, H, S, D) memory
    lays them, or side by side in a row, as (B, S, H, D) does). The view ends at the
    array's last element. None where the slabs do not fit it, or where a block's BLOCK_D
    columns would run into the next head's (a held block takes the next rows, which only
    reach rows that are not stored, but a column reaches every row)."""
    batch, seqlen, heads, head_dim = shape
    stride_batch, stride_row, stride_head = strides
    if block_d != head_dim or stride_row < head_dim or stride_batch % stride_row:
        return None
    rows = (batch - 1) * (stride_batch // stride_row) + seqlen
    if stride_head % stride_row == 0:
        return rows + (heads - 1) * (stride_head // stride_row), head_dim
    if (heads - 1) * stride_head + head_dim <= stride_row:
        return rows, (heads - 1) * stride_head + head_dim
    return None


def _descriptor_flags(use: bool, hold: bool, host: bool, device: bool,
                      flat_held: bool = False) -> dict:
    """USE_TMA / HOLD_TMA (streamed / held blocks through descriptors) and HOST_TMA (the
    descriptors come as arguments), where the caller allows the kind they need. Through
    host descriptors held blocks need the 2-D view (``flat_held``): a 4-D block reshaped
    to 2-D reaches its matmuls through registers in Triton 3.6-3.9 and spills more than
    a pointer load, so without that view they come through pointers
    (benchmarks/NOTES.md 25)."""
    if not (host or device):
        use = hold = False
    return dict(USE_TMA=use, HOLD_TMA=hold and (flat_held or not host),
                HOST_TMA=host and use)


def _tma_flags(cfg, override: bool | None, capability, dtype: str, streamed: tuple,
               held: tuple, host: bool, device: bool, flat_held: bool) -> dict:
    """A backward kernel's descriptor flags: USE_TMA for the blocks it streams, HOLD_TMA
    for those it holds (only with USE_TMA, as the entry's ``hold_tma`` says, and where
    their strides allow it too), HOST_TMA when they are made on the host."""
    use = _use_tma(cfg, override, capability, dtype, *streamed)
    hold = use and cfg.hold_tma and _descriptors_allowed(capability, dtype, *held)
    return _descriptor_flags(use, hold, host, device, flat_held)


def _blocks(on: bool, block_d: int, *arrays) -> tuple:
    """A kernel's ``*Blocks`` arguments: per (name, shape, (batch, seq, head) strides,
    rows a block), a host descriptor where ``on``, else the array itself."""
    if not on:
        return tuple(Blocks(name) for name, *_ in arrays)
    return tuple(Blocks(name, tuple(shape), (*st, 1), (1, rows, 1, block_d))
                 for name, shape, st, rows in arrays)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def score_unit(p: AttentionProblem) -> float:
    """What the kernels multiply natural-log logits by: log2(e) (they work in base 2), or
    1 with a bias, whose finite masks (down to finfo.min) would overflow in base 2."""
    return 1.0 if p.bias_shape is not None else LOG2E


def _feature_scalars(p: AttentionProblem) -> dict:
    """The options' scalars, 0 for an option that is off (jax_triton would fold a 1 into
    the kernel as a constant, where Triton's JIT keeps a float: two codes for one kernel)."""
    softcap_scale = p.softmax_scale / p.softcap if p.softcap else 0.0
    dropout_scale = 1.0 / (1.0 - p.dropout_p) if p.dropout_p > 0 else 0.0
    return dict(softcap_scale=softcap_scale, softcap_out=p.softcap * score_unit(p),
                dropout_p=p.dropout_p, dropout_scale=dropout_scale,
                window_left=p.window_left, window_right=p.window_right)


def _lengths(p: AttentionProblem) -> dict:
    """seqlen_q, seqlen_k, total_q, total_k: with varlen, the max lengths and the packed
    token counts that the kernels clamp device-side cu_seqlens to."""
    return dict(seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, total_q=p.total_q, total_k=p.total_k)


def _named(array: str, strides: tuple, axes: str) -> dict:
    """``stride_<array><axis>`` for each stride, as the kernels name them."""
    return {f"stride_{array}{axis}": stride for axis, stride in zip(axes, strides)}


def _unused(*arrays: str) -> tuple:
    """Placeholders for outputs a launch's kernel takes and never writes (the other
    backward pass's, a bias gradient nobody asked for): one float each, named apart from
    the arrays they stand in for."""
    return tuple(Output(f"unused_{array}", (1,), "float32") for array in arrays)


def _feature_constexprs(p: AttentionProblem) -> dict:
    return dict(GROUP_SIZE=p.group_size, LIMIT_LEFT=p.window_left >= 0,
                LIMIT_RIGHT=p.window_right >= 0, HAS_SOFTCAP=p.softcap > 0,
                HAS_BIAS=p.bias_shape is not None, HAS_ALIBI=p.alibi_shape is not None,
                HAS_DROPOUT=p.dropout_p > 0)


def fold_scale(p: AttentionProblem) -> bool:
    """The forward may take the row max over raw q·k and scale inside exp2 (one FMA an
    element): the scores are plain (no softcap, bias or ALiBi) and the scale is > 0."""
    return (p.softmax_scale > 0 and not p.softcap and p.bias_shape is None
            and p.alibi_shape is None)


def _bias_alibi_scalars(p: AttentionProblem, bias_st) -> dict:
    bias = bias_strides(p.bias_shape, bias_st) if p.bias_shape is not None else (0, 0, 0, 0)
    slopes = p.heads_q if p.alibi_shape is not None and len(p.alibi_shape) == 2 else 0
    return {**_named("b", bias, "bhmn"), "stride_sb": slopes}


# ---------------------------------------------------------------------------
# Plans


PACK_GQA_BELOW = 64  # the smallest query tile of the tuned table


def pack_gqa(problem: AttentionProblem) -> bool:
    """Pack a K/V head's group of query heads into the rows of one tile when the queries
    alone would leave a tile mostly empty (decode: seqlen_q of 1 to a few): K and V are
    then read once per group rather than once per query head."""
    return problem.group_size > 1 and problem.seqlen_q < PACK_GQA_BELOW


def num_splits_for(programs: int, key_blocks: int, num_sms: int | None) -> int:
    """Split-KV: how many slices of the keys to give each query block, so that a grid of
    ``programs`` fills ``num_sms`` multiprocessors (two programs each). flash-attn's
    rule, tightened: no split once the grid fills 80% of the slots; else the fewest
    splits whose wave efficiency is within 95% of the best (flash-attn: 85%), with at
    least two key blocks a split. A decode step is one wave: at 85% a part of the SMs
    runs one program where the rest run two, and idles for the last part of the step."""
    if num_sms is None or num_sms < 1 or programs < 1:
        return 1
    slots = 2 * num_sms
    if programs >= 0.8 * slots:
        return 1
    max_splits = min(128, slots, max(1, key_blocks // 2))

    def distinct(splits):  # a count that changes the blocks per split
        return splits == 1 or _cdiv(key_blocks, splits) != _cdiv(key_blocks, splits - 1)

    efficiency = {}
    for splits in range(1, max_splits + 1):
        if distinct(splits):
            waves = programs * splits / slots
            efficiency[splits] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= 0.95 * best)


# Both warp-specialised kernels came out wrong (NaN or off) and 2-3x slower on an H100
# under Triton 3.6, while the same loops unspecialised were right (benchmarks/NOTES.md
# 36): until a GPU run shows them right, the plan takes them in the interpreter only,
# whatever the table or the caller asks.
WARP_SPECIALIZED_ON_GPU = False


def _warp_specialized_tile(kernel: str, p: AttentionProblem, wanted: bool, capability,
                           host: bool, *strides: tuple) -> TileConfig | None:
    """The (``kernel``, D) tile when a warp-specialised kernel (attention_forward_ws,
    attention_backward_dkdv_ws) serves the call, else None: the table entry asks for it
    (``wanted``), on Hopper (or in the interpreter), for 16-bit plain scores (no softcap,
    bias, ALiBi or dropout) with every block through host descriptors (``host``: so not
    varlen, paged or with seqused_k, and these ``strides`` fit them), head dim 64, 128
    or 256 (no padding columns), and 64-row blocks on the GPU (wgmma's rows; the tile
    shrinks to short sequences), 16 in the interpreter. The forward's 64 rows are each
    half of its query tile."""
    on_device = capability is None or (capability[0] == 9 and WARP_SPECIALIZED_ON_GPU)
    if not (bool(wanted) and on_device and host
            and fold_scale(p) and p.dropout_p == 0 and p.dtype != "float32"
            and p.block_d == p.head_dim >= 64  # (the tables' ws entries: 64, 128, 256)
            and _descriptors_allowed(capability, p.dtype, *strides)
            and _host_descriptors_allowed(p, True, *strides)):
        return None
    ws = tile_config(kernel, p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability,
                     causal=p.causal)
    rows = ws.block_m // 2 if kernel == "forward_ws" else min(ws.block_m, ws.block_n)
    return ws if rows >= (16 if capability is None else 64) else None


def _descriptor_forward_launch(kernel: str, p: AttentionProblem, tile: TileConfig,
                               q_rows: int, q_st, k_st, v_st, o_st, l_st, outputs: tuple,
                               constexprs: dict, **fields) -> Launch:
    """A launch of a forward for plain scores with every block through host descriptors
    (attention_forward_ws, attention_forward_gluon): a program per (query block of
    ``tile.block_m`` rows, query head, batch entry), Q read ``q_rows`` rows at a time,
    K and V ``tile.block_n``; the kernel's own ``constexprs`` and Launch ``fields`` besides."""
    features = _feature_constexprs(p)
    return Launch(
        kernel=kernel,
        grid=(_cdiv(p.seqlen_q, tile.block_m), p.heads_q, p.batch),
        inputs=("q", "k", "v"),
        scalars=dict(qk_scale=p.softmax_scale * score_unit(p), window_left=p.window_left,
                     window_right=p.window_right, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
                     **_named("o", o_st, "bmh"), **_named("l", l_st, "bh")),
        outputs=outputs,
        constexprs=dict(HEAD_DIM=p.head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                        GROUP_SIZE=p.group_size, LIMIT_LEFT=features["LIMIT_LEFT"],
                        LIMIT_RIGHT=features["LIMIT_RIGHT"], **constexprs),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        blocks=_blocks(True, p.block_d, ("q", p.q_shape, q_st, q_rows),
                       ("k", p.kv_shape, k_st, tile.block_n),
                       ("v", p.kv_shape, v_st, tile.block_n)),
        **fields,
    )


def _forward_ws_launch(p: AttentionProblem, ws, q_st, k_st, v_st, o_st, l_st,
                       outputs: tuple) -> Launch:
    """The launch of attention_forward_ws with the tile ``ws``: Q in halves of
    ``ws.block_m // 2`` rows, K and V in blocks of ``ws.block_n``, all three through host
    descriptors. Every block masked where a window limits the keys or they end inside a
    block (one loop: no unmasked run)."""
    masked = p.window_left >= 0 or p.window_right >= 0 or p.seqlen_k % ws.block_n != 0
    return _descriptor_forward_launch(
        "attention_forward_ws", p, ws, ws.block_m // 2, q_st, k_st, v_st, o_st, l_st, outputs,
        dict(MASKED=masked, DOT_PRECISION=p.dot_precision, STRIDES_ALIGNED=_aligned(o_st),
             WARP_SPECIALIZE=True))


def _dkdv_ws_launch(p: AttentionProblem, ws: TileConfig, common_scalars: dict, q_st: tuple,
                    k_st: tuple, v_st: tuple, do_st: tuple, dkv_st: tuple) -> Launch:
    """The launch of attention_backward_dkdv_ws with the tile ``ws``: a program per key
    block of ``ws.block_n`` rows, Q and dO streamed in blocks of ``ws.block_m``, all four
    through host descriptors. Every block masked under causal or a window (one loop)."""
    features = _feature_constexprs(p)
    names = ("softmax_scale", "qk_scale", "window_left", "window_right", "seqlen_q",
             "seqlen_k", "stride_lb", "stride_lh")
    return Launch(
        kernel="attention_backward_dkdv_ws",
        grid=(_cdiv(p.seqlen_k, ws.block_n), p.heads_k, p.batch),
        inputs=("q", "k", "v", "dout", "lse", "delta"),
        scalars=dict({name: common_scalars[name] for name in names},
                     **_named("dk", dkv_st, "bnh"), **_named("dv", dkv_st, "bnh")),
        outputs=(Output("dk", p.kv_shape, p.dtype), Output("dv", p.kv_shape, p.dtype)),
        constexprs=dict(HEAD_DIM=p.head_dim, BLOCK_M=ws.block_m, BLOCK_N=ws.block_n,
                        GROUP_SIZE=p.group_size, LIMIT_LEFT=features["LIMIT_LEFT"],
                        LIMIT_RIGHT=features["LIMIT_RIGHT"],
                        MASKED=features["LIMIT_LEFT"] or features["LIMIT_RIGHT"],
                        DOT_PRECISION=p.dot_precision, STRIDES_ALIGNED=_aligned(dkv_st),
                        WARP_SPECIALIZE=True),
        num_warps=ws.num_warps,
        num_stages=ws.num_stages,
        blocks=_blocks(True, p.block_d, ("q", p.q_shape, q_st, ws.block_m),
                       ("k", p.kv_shape, k_st, ws.block_n), ("v", p.kv_shape, v_st, ws.block_n),
                       ("dout", p.out_shape, do_st, ws.block_m)),
    )


REGISTERS_PER_SM = 65536
MAX_REGISTERS = 255  # a thread's
LOAD_WARP_REGISTERS = 24  # the Gluon forward's load warp: TMA copies and mbarriers only


def _gluon_tile(p: AttentionProblem, wanted: bool, capability, launches_gluon: bool,
                host: bool, *strides: tuple) -> TileConfig | None:
    """The ("forward_gluon", D) tile when attention_forward_gluon serves the call, else
    None: the forward entry asks for it (``wanted``), on an sm_90 GPU (Gluon has no
    interpreter) and a front end that launches Gluon kernels (``launches_gluon``), for 16-bit plain scores (no softcap, bias, ALiBi or dropout;
    any window), head dim 64, 128 or 256 (no padding columns), every block through host
    descriptors (``host``: so not varlen, paged or with seqused_k, and these ``strides``
    fit them), and sequences as long as the entry's tile (its rows are 64 a warpgroup)."""
    if not (bool(wanted) and launches_gluon and capability == (9, 0)
            and fold_scale(p) and p.dropout_p == 0 and p.dtype != "float32"
            and p.block_d == p.head_dim >= 64
            and _descriptors_allowed(capability, p.dtype, *strides)
            and _host_descriptors_allowed(p, host, *strides)):
        return None
    entry = configs.table_entry("forward_gluon", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k)
    cfg = tile_config("forward_gluon", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability,
                      causal=p.causal)
    fits = (cfg.block_m, cfg.block_n) == (entry.block_m, entry.block_n)
    turns = not cfg.ping_pong or cfg.num_warps == 8  # two warpgroups to take turns
    return cfg if fits and cfg.block_m == 16 * cfg.num_warps and turns else None


def _forward_gluon_launch(p: AttentionProblem, cfg: TileConfig, q_st, k_st, v_st, o_st, l_st,
                          outputs: tuple) -> Launch:
    """The launch of attention_forward_gluon with the tile ``cfg``: Q in blocks of
    ``cfg.block_m`` rows, K and V in ``cfg.block_n``, all three through host descriptors,
    ``cfg.num_stages`` slots of K and V. The registers of an SM are shared out between the
    programs it runs at once (``gluon_programs_per_sm``), and within one program between
    its partitions. With ``cfg.ping_pong`` the kernel's own warps are the first compute
    warpgroup's, and the second's registers are a constexpr."""
    registers = REGISTERS_PER_SM // (gluon_programs_per_sm(p, cfg) * _gluon_threads(cfg))
    maxnreg = min(registers, MAX_REGISTERS) // 8 * 8
    # What the load warp's warpgroup leaves of the program's registers, shared evenly by
    # the compute warpgroups (setmaxnreg takes multiples of 8, at most 256).
    compute = min((maxnreg * _gluon_threads(cfg) - LOAD_WARP_REGISTERS * 128)
                  // (cfg.num_warps * 32) // 8 * 8, 256)
    launched = replace(cfg, num_warps=4) if cfg.ping_pong else cfg
    return _descriptor_forward_launch(
        "attention_forward_gluon", p, launched, cfg.block_m, q_st, k_st, v_st, o_st, l_st,
        outputs, dict(NUM_STAGES=cfg.num_stages, PING_PONG=cfg.ping_pong,
                      COMPUTE_REGISTERS=compute, LOAD_REGISTERS=LOAD_WARP_REGISTERS),
        maxnreg=maxnreg)


def _gluon_threads(cfg: TileConfig) -> int:
    """A Gluon forward program's threads: the load warp comes on top of ``cfg.num_warps``
    with a warpgroup's registers (warps are given registers four at a time)."""
    return (cfg.num_warps + 4) * 32


def gluon_programs_per_sm(p: AttentionProblem, cfg: TileConfig) -> int:
    """How many programs of attention_forward_gluon with tile ``cfg`` an SM runs at once,
    so how many share its registers: two where two fit its shared memory and the registers
    leave each thread at least 128, which holds a 64-row warpgroup's fp32 accumulator of
    D / 2 to D = 128; else one. Two programs of one compute warpgroup each run out of
    step, so one's softmax meets the other's matmuls, as the Triton forward's programs do;
    one program's two warpgroups run in step."""
    shared = configs.shared_memory("forward_gluon", cfg, p.block_d, configs.ITEMSIZE[p.dtype])
    # 2 KB a program besides its tiles: the 1 KB the SM keeps for each, and the mbarriers
    # and what the estimate leaves out (a few hundred bytes, fa_kernels.offline)
    two = (2 * (shared + 2048) <= configs.shared_memory_per_sm((9, 0))
           and REGISTERS_PER_SM // (2 * _gluon_threads(cfg)) >= 128 and p.block_d <= 128)
    return 2 if two else 1


# A plan is a pure function of a validated problem, the device and the strides (all
# hashable): cache it, so that a call with a known shape does not rebuild it (tens of
# microseconds of Python per call, which small problems would otherwise wait on).
@functools.lru_cache(maxsize=4096)
def forward_plan(problem: AttentionProblem, *, capability: tuple[int, int] | None,
                 q_strides: Shape | None = None, k_strides: Shape | None = None,
                 v_strides: Shape | None = None, bias_strides: Shape | None = None,
                 num_sms: int | None = None, num_splits: int | None = None,
                 tma: bool | None = None, host_descriptors: bool = True,
                 device_descriptors: bool = True,
                 warp_specialize: bool | None = None, gluon: bool | None = None,
                 launches_gluon: bool = True) -> ForwardPlan:
    """How to launch the forward. ``capability`` is the GPU's (major, minor), None
    for the CPU interpreter. Strides are in elements; None means contiguous.

    ``num_sms`` (the GPU's multiprocessor count) lets a grid too small for the GPU split
    the keys across programs (split-KV, then a combine kernel); None never splits.
    ``num_splits`` forces a split count (tests; 1: none). ``tma`` overrides the table's
    choice of tensor-descriptor K/V loads (tests run that path in the interpreter too);
    either way they need K/V strides of whole 16-byte units. Descriptors are made on the
    host where they can be (``_host_descriptors_allowed``) and ``host_descriptors``
    allows, else on the device where ``device_descriptors`` allows (that needs scratch
    memory from the launcher), else the blocks come through pointers.
    ``warp_specialize`` overrides the table's choice of attention_forward_ws where the
    problem allows it (``_warp_specialized_tile``), ``gluon`` its choice of
    attention_forward_gluon (``_gluon_tile``), which a front end that cannot launch Gluon
    kernels refuses with ``launches_gluon`` False."""
    p = problem
    q_st = _bsh(_strides("q", p.q_shape, q_strides), p.varlen)
    k_st = _bsh(_strides("k", p.kv_shape, k_strides), p.varlen and not p.paged)
    v_st = _bsh(_strides("v", p.kv_shape, v_strides), p.varlen and not p.paged)
    o_st = _bsh(contiguous_strides(p.out_shape), p.varlen)
    l_st = (0, p.total_q) if p.varlen else contiguous_strides(p.lse_shape)[:2]
    host = _host_descriptors_allowed(p, host_descriptors, k_st, v_st)
    packed = pack_gqa(p)
    rows, heads = (p.seqlen_q * p.group_size, p.heads_k) if packed else (p.seqlen_q, p.heads_q)
    cfg = tile_config("forward", p.block_d, p.dtype, rows, p.seqlen_k, capability,
                      bias_item=p.bias_item, causal=p.causal,
                      descriptors=tma is not False and (host or device_descriptors))
    blocks = _cdiv(rows, cfg.block_m)
    key_blocks = _cdiv(p.seqlen_k, cfg.block_n) if cfg.block_n else 0
    if num_splits is None:
        num_splits = num_splits_for(blocks * heads * p.batch, key_blocks, num_sms)
    num_splits = max(1, min(int(num_splits), max(1, key_blocks)))
    split = num_splits > 1
    if p.paged:  # a block's rows may lie on several pages: pointer loads
        tma = False
    if tma is None and key_blocks <= 1:
        # One key block: nothing to stream, so no descriptors unless a caller asks
        # (ptxas 12.8 crashes on the D = 256 causal forward with seqlen_k = 1 through them).
        tma = False
    flags = _descriptor_flags(_use_tma(cfg, tma, capability, p.dtype, k_st, v_st), False,
                              host, device_descriptors)
    # Varlen: rows that device-side cu_seqlens leave uncovered (bad values, clamped in the
    # kernels) read as zeros, never as uninitialised memory.
    results = (Output("out", p.out_shape, p.dtype, zeroed=p.varlen),
               Output("lse", p.lse_shape, "float32", zeroed=p.varlen),
               Output("lse_lo", p.lse_shape, "float32"))  # written and read with a bias only
    fast = (None if split or packed else _gluon_tile(
        p, cfg.gluon if gluon is None else gluon, capability, launches_gluon, host,
        q_st, k_st, v_st, o_st))
    if fast is not None:
        return ForwardPlan(problem, _forward_gluon_launch(p, fast, q_st, k_st, v_st, o_st,
                                                          l_st, results))
    ws = (None if split or packed else _warp_specialized_tile(
        "forward_ws", p, cfg.warp_specialize if warp_specialize is None else warp_specialize,
        capability, flags["HOST_TMA"], q_st, k_st, v_st))
    if ws is not None:
        return ForwardPlan(problem, _forward_ws_launch(p, ws, q_st, k_st, v_st, o_st, l_st,
                                                       results))
    if split:  # fp32 partial results, a leading split axis, merged by the combine kernel
        outputs = (Output("out_partial", (num_splits, *p.out_shape), "float32"),
                   Output("lse_partial", (num_splits, *p.lse_shape), "float32"),
                   Output("lse_lo_partial", (num_splits, *p.lse_shape), "float32"))
        split_strides = (math.prod(p.out_shape), math.prod(p.lse_shape))
    else:
        outputs, split_strides = results, (0, 0)
    launch = Launch(
        kernel="attention_forward",
        grid=(blocks * num_splits, heads, p.batch),
        inputs=ATTENTION_INPUTS,
        scalars=dict(qk_scale=p.softmax_scale * score_unit(p), **_feature_scalars(p),
                     **_lengths(p), **_named("q", q_st, "bmh"), **_named("k", k_st, "bnh"),
                     **_named("v", v_st, "bnh"), **_named("o", o_st, "bmh"),
                     **_named("l", l_st, "bh"), **_bias_alibi_scalars(p, bias_strides),
                     page_size=p.page_size, num_pages=p.num_pages, stride_tb=p.pages_per_entry,
                     # (0 unsplit: jax_triton would fold a 1 into the code, the JIT not)
                     num_splits=num_splits if split else 0, stride_os=split_strides[0],
                     stride_ls=split_strides[1]),
        outputs=outputs,
        constexprs=dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=cfg.block_m,
                        BLOCK_N=cfg.block_n, **_feature_constexprs(p), IS_VARLEN=p.varlen,
                        HAS_SEQUSED_K=p.seqused_k, DOT_PRECISION=p.dot_precision,
                        STRIDES_ALIGNED=_aligned(q_st, k_st, v_st, o_st),
                        PACK_GQA=packed, SPLIT_KV=split, USE_TMA=flags["USE_TMA"],
                        HOST_TMA=flags["HOST_TMA"], FOLD_SCALE=fold_scale(p),
                        PAGED_KV=p.paged,
                        WHOLE_PAGES=p.paged and p.page_size % cfg.block_n == 0),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        blocks=_blocks(flags["HOST_TMA"], p.block_d, ("k", p.kv_shape, k_st, cfg.block_n),
                       ("v", p.kv_shape, v_st, cfg.block_n)),
    )
    combine = None
    if split:
        # Rows a program merges (1 for decode), and splits loaded at once: 16 tiles' rows.
        block_m = min(64, 1 << max(0, p.seqlen_q - 1).bit_length())
        split_chunk = max(1, min(1 << (num_splits - 1).bit_length(), 16 // block_m))
        combine = Launch(
            kernel="attention_forward_combine",
            grid=(_cdiv(p.seqlen_q, block_m), p.heads_q, p.batch),
            inputs=("out_partial", "lse_partial", "lse_lo_partial", "cu_seqlens_q",
                    "cu_seqlens_k"),
            scalars=dict(seqlen_q=p.seqlen_q, total_q=p.total_q, num_splits=num_splits,
                         **_named("o", o_st, "bmh"), **_named("l", l_st, "bh"),
                         stride_os=split_strides[0], stride_ls=split_strides[1]),
            outputs=results,
            constexprs=dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=block_m,
                            SPLIT_CHUNK=split_chunk, IS_VARLEN=p.varlen,
                            HAS_BIAS=p.bias_shape is not None, STRIDES_ALIGNED=_aligned(o_st)),
            num_warps=4,
            num_stages=1,
        )
    return ForwardPlan(problem, launch, combine, num_splits, packed)


@functools.lru_cache(maxsize=4096)
def backward_plan(problem: AttentionProblem, *, capability: tuple[int, int] | None,
                  q_strides: Shape | None = None, k_strides: Shape | None = None,
                  v_strides: Shape | None = None, out_strides: Shape | None = None,
                  dout_strides: Shape | None = None, bias_strides: Shape | None = None,
                  bias_grad: bool = False, has_dlse: bool = True,
                  tma: bool | None = None, apart: bool | None = None,
                  host_descriptors: bool = True,
                  device_descriptors: bool = True,
                  warp_specialize: bool | None = None) -> BackwardPlan:
    """How to launch the backward: D = rowsum(dO * O) - dLSE, then dK/dV, then dQ.

    Inputs by name: q, k, v, out, dout (shapes of the forward), lse and dlse (the LSE's
    shape, fp32, contiguous), bias, slopes, seed, cu_seqlens_*; ``delta`` is made by
    the preprocess. ``has_dlse`` False: the LSE got no gradient (dlse is not read;
    the same D as a zero dlse, bit for bit). With ``bias_grad``, dq also writes
    ``dbias``, dense (B, Hq, Sq, Sk) fp32: sum it over ``problem.bias_reduce_axes``.
    ``tma`` overrides the table's choice of tensor-descriptor loads for the blocks the
    dK/dV and dQ kernels stream; the blocks they hold come through descriptors too where
    the entry's ``hold_tma`` says so. Either way a block read through descriptors needs
    strides of whole 16-byte units; ``host_descriptors`` and ``device_descriptors`` say
    where they may be made, as in ``forward_plan``. ``apart`` overrides the dK/dV entry's choice of
    programs apart for dK and dV (two a key block). ``warp_specialize`` overrides the
    dK/dV entry's choice of attention_backward_dkdv_ws where the problem allows it
    (``_warp_specialized_tile``).
    """
    p = problem
    if p.paged:
        raise NotImplementedError("block_table (a paged K/V cache) is forward-only, as in "
                                  "flash-attn: no gradient flows through it")
    q_st = _bsh(_strides("q", p.q_shape, q_strides), p.varlen)
    k_st = _bsh(_strides("k", p.kv_shape, k_strides), p.varlen)
    v_st = _bsh(_strides("v", p.kv_shape, v_strides), p.varlen)
    o_st = _bsh(_strides("out", p.out_shape, out_strides), p.varlen)
    do_st = _bsh(_strides("dout", p.out_shape, dout_strides), p.varlen)
    l_st = (0, p.total_q) if p.varlen else contiguous_strides(p.lse_shape)[:2]
    dq_st = _bsh(contiguous_strides(p.q_shape), p.varlen)
    dkv_st = _bsh(contiguous_strides(p.kv_shape), p.varlen)

    # The preprocess is row-wise: a packed varlen batch is one long sequence to it.
    pre_rows, pre_batch = (p.total_q, 1) if p.varlen else (p.seqlen_q, p.batch)
    pre = tile_config("preprocess", p.block_d, p.dtype, pre_rows, p.seqlen_k, capability)
    preprocess = Launch(
        kernel="attention_backward_preprocess",
        grid=(_cdiv(pre_rows, pre.block_m), p.heads_q, pre_batch),
        inputs=("out", "dout", "dlse"),
        scalars=dict(seqlen_q=pre_rows, **_named("o", o_st, "bmh"),
                     **_named("do", do_st, "bmh"), **_named("l", l_st, "bh")),
        outputs=(Output("delta", p.lse_shape, "float32"),),
        constexprs=dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=pre.block_m,
                        HAS_DLSE=bool(has_dlse), STRIDES_ALIGNED=_aligned(o_st, do_st)),
        num_warps=pre.num_warps,
        num_stages=pre.num_stages,
    )

    common_scalars = dict(softmax_scale=p.softmax_scale,
                          qk_scale=p.softmax_scale * score_unit(p), **_feature_scalars(p),
                          **_lengths(p), **_named("q", q_st, "bmh"), **_named("k", k_st, "bnh"),
                          **_named("v", v_st, "bnh"), **_named("do", do_st, "bmh"),
                          **_named("l", l_st, "bh"), **_bias_alibi_scalars(p, bias_strides))
    aligned = _aligned(q_st, k_st, v_st, do_st, dq_st, dkv_st)
    host = _host_descriptors_allowed(p, host_descriptors, q_st, k_st, v_st, do_st)

    arrays = dict(q=(p.q_shape, q_st), k=(p.kv_shape, k_st), v=(p.kv_shape, v_st),
                  dout=(p.out_shape, do_st))
    # The 2-D views through which host descriptors may hold blocks (None: they may not).
    views = {name: _flat_rows(shape, st, p.block_d) if host else None
             for name, (shape, st) in arrays.items()}

    def flat_held(*names):
        return all(views[name] for name in names)

    def blocks(flags, streamed, block_q, block_k):  # (q, k, v, dout): streamed or held
        out = []
        for name, (shape, st) in arrays.items():
            rows = block_k if name in ("k", "v") else block_q
            if name in streamed:
                out += _blocks(flags["HOST_TMA"], p.block_d, (name, shape, st, rows))
            elif flags["HOST_TMA"] and flags["HOLD_TMA"]:
                out.append(Blocks(name, views[name], (st[1], 1), (rows, p.block_d)))
            else:
                out.append(Blocks(name))
        return tuple(out)

    def constexprs(cfg, **extra):
        return dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n, **_feature_constexprs(p), **extra, IS_VARLEN=p.varlen,
                    HAS_SEQUSED_K=p.seqused_k, DOT_PRECISION=p.dot_precision, STRIDES_ALIGNED=aligned,
                    ROWS_ALIGNED=_aligned((p.seqlen_q, p.seqlen_k), l_st))

    bias_grad = bool(bias_grad and p.bias_shape is not None)
    kv = tile_config("dkdv", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability,
                     bias_item=p.bias_item, causal=p.causal,
                     descriptors=tma is not False and (host or device_descriptors))
    parts = 2 if (kv.apart if apart is None else apart) else 1  # dV and dK apart: two
    kv_flags = _tma_flags(kv, tma, capability, p.dtype, streamed=(q_st, do_st),
                          held=(k_st, v_st), host=host, device=device_descriptors,
                          flat_held=flat_held("k", "v"))
    ws = _warp_specialized_tile(
        "dkdv_ws", p, kv.warp_specialize if warp_specialize is None else warp_specialize,
        capability, host and tma is not False, q_st, k_st, v_st, do_st)
    dkdv = Launch(
        kernel="attention_backward",
        grid=(_cdiv(p.seqlen_k, kv.block_n) * parts, p.heads_k, p.batch),
        inputs=BACKWARD_INPUTS,
        scalars=dict(common_scalars, **_named("dk", dkv_st, "bnh"), **_named("dv", dkv_st, "bnh"),
                     **_named("dq", (0, 0, 0), "bmh"), **_named("db", (0, 0, 0), "bhm")),
        # Key rows no sequence uses (past seqused_k, or between packed sequences) get 0.
        outputs=(Output("dk", p.kv_shape, p.dtype, zeroed=p.varlen or p.seqused_k),
                 Output("dv", p.kv_shape, p.dtype, zeroed=p.varlen or p.seqused_k),
                 *_unused("dq", "dbias")),
        constexprs=constexprs(kv, **kv_flags, HAS_DBIAS=False, DKDV_PARTS=parts,
                              DQ_PASS=False),
        num_warps=kv.num_warps,
        num_stages=kv.num_stages,
        blocks=blocks(kv_flags, ("q", "dout"), kv.block_m, kv.block_n),
    )
    if ws is not None:
        dkdv = _dkdv_ws_launch(p, ws, common_scalars, q_st, k_st, v_st, do_st, dkv_st)
    dbias = (Output("dbias", p.dbias_shape, "float32", zeroed=True) if bias_grad
             else _unused("dbias")[0])
    dbias_st = contiguous_strides(p.dbias_shape)[:3] if bias_grad else (0, 0, 0)
    qc = tile_config("dq", p.block_d, p.dtype, p.seqlen_q, p.seqlen_k, capability,
                     bias_item=p.bias_item, bias_grad=bias_grad, causal=p.causal,
                     descriptors=tma is not False and (host or device_descriptors))
    q_flags = _tma_flags(qc, tma, capability, p.dtype, streamed=(k_st, v_st),
                         held=(q_st, do_st), host=host, device=device_descriptors,
                         flat_held=flat_held("q", "dout"))
    dq = Launch(
        kernel="attention_backward",
        grid=(_cdiv(p.seqlen_q, qc.block_m), p.heads_q, p.batch),
        inputs=BACKWARD_INPUTS,
        scalars=dict(common_scalars, **_named("dk", (0, 0, 0), "bnh"),
                     **_named("dv", (0, 0, 0), "bnh"), **_named("dq", dq_st, "bmh"),
                     **_named("db", dbias_st, "bhm")),
        outputs=(*_unused("dk", "dv"), Output("dq", p.q_shape, p.dtype, zeroed=p.varlen), dbias),
        constexprs=constexprs(qc, **q_flags, HAS_DBIAS=bias_grad, DKDV_PARTS=1, DQ_PASS=True),
        num_warps=qc.num_warps,
        num_stages=qc.num_stages,
        blocks=blocks(q_flags, ("k", "v"), qc.block_m, qc.block_n),
    )
    return BackwardPlan(problem, preprocess, dkdv, dq)


def _drop_cached_plans() -> None:
    forward_plan.cache_clear()
    backward_plan.cache_clear()


configs.on_change(_drop_cached_plans)


@contextlib.contextmanager
def warp_specialized_on_gpu(allowed: bool = True):
    """Within: the plan takes the warp-specialised kernels on Hopper GPUs too (or not),
    as the table asks; for offline compiles and GPU tests of those kernels."""
    global WARP_SPECIALIZED_ON_GPU
    before, WARP_SPECIALIZED_ON_GPU = WARP_SPECIALIZED_ON_GPU, allowed
    _drop_cached_plans()
    try:
        yield
    finally:
        WARP_SPECIALIZED_ON_GPU = before
        _drop_cached_plans()


def dropout_mask_plan(batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                      *, capability: tuple[int, int] | None) -> Launch:
    """The keep mask (batch, heads, seqlen_q, seqlen_k) int8 that attention draws for
    this seed; input ``seed`` (4,) int32 as the attention kernels take it."""
    dropout_p = check_dropout_p(dropout_p)
    for name, value in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q),
                        ("seqlen_k", seqlen_k)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int; got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0; got {value}")
    batch, heads, seqlen_q, seqlen_k = map(int, (batch, heads, seqlen_q, seqlen_k))
    shape = (batch, heads, seqlen_q, seqlen_k)
    st = contiguous_strides(shape)
    cfg = tile_config("forward", 16, "float32", seqlen_q, seqlen_k, capability)
    return Launch(
        kernel="dropout_mask", grid=(_cdiv(seqlen_q, cfg.block_m), heads, batch),
        inputs=("seed",),
        scalars=dict(dropout_p=dropout_p, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     **_named("m", st[:3], "bhm")),
        outputs=(Output("mask", shape, "int8"),),
        constexprs=dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n),
        num_warps=4, num_stages=1)
