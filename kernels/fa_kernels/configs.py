"""Block sizes, warps and stages: a table, no runtime autotuning.

Autotuning at run time would let torch and jax (or two runs) pick different configs
and so give different bits; a table keeps both front ends on the same kernel.

GPU entries are keyed by (kernel, padded head dim, dtype), with entries of their own for
short sequences, causal problems and few query rows; the tile is then shrunk
to the sequence length (a seqlen bucket: the next power of two, at least 16), so
short sequences do not pay for empty rows. ``benchmarks/tune.py`` measures
candidates on the GPU; the table holds what it chose.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}  # bytes an element


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # The streamed blocks (K/V in the forward and dQ, Q/dO in dK/dV) through tensor
    # descriptors (TMA). The plan uses them from sm_90 on (and in the interpreter) where
    # those strides are whole 16-byte units; the launcher falls back to pointer loads
    # where an array does not start on 16 bytes.
    tma: bool = False
    # With ``tma``, the blocks a backward program holds through its whole loop (K/V in
    # dK/dV, Q/dO in dQ) come through descriptors too and stay in shared memory, where the
    # matmuls read them, with no register copy (the forward keeps its Q in registers).
    # That measured faster at every head dim but the dQ pass's at D = 128, where the
    # register copy is cheap.
    hold_tma: bool = True
    # dK/dV only: two programs a key block, one summing dV and one dK (each recomputes P,
    # so five matmuls where one program does four). Pays where one program cannot hold
    # both fp32 accumulators without spilling (D = 256).
    apart: bool = False
    # Forward and dK/dV: problems with plain scores (no softcap, bias, ALiBi or dropout,
    # not varlen, paged or split) go to the one-loop kernel that Triton's Hopper warp
    # specialisation splits into producer and consumer warpgroups, with the
    # ("forward_ws", block_d) entry's tile (two query halves of block_m / 2 rows; its
    # block_n the forward entry's: the same key blocks in the same order) or the
    # ("dkdv_ws", block_d) entry's (attention_backward_dkdv_ws).
    warp_specialize: bool = False
    # Forward on Hopper: problems with plain scores (as above; any window) through host
    # descriptors go to the Gluon kernel (gluon_forward), with the
    # ("forward_gluon", block_d) entry's tile: block_m rows for num_warps / 4 warpgroups of
    # 64 rows each, NUM_STAGES slots of K and V blocks of block_n rows. Off in the table
    # until a GPU run has shown it right and faster (benchmarks/NOTES.md 38).
    gluon: bool = False
    # forward_gluon only: its two compute warpgroups as partitions of their own that take
    # the tensor cores in turns (FA3's ping-pong), num_warps 8.
    ping_pong: bool = False


# (kernel, block_d) -> config for 16-bit inputs on sm_80 and newer, chosen on the H200 by
# benchmarks/tune.py (B*S = 16384 at S = 4096, causal and not; the times that decided each
# entry are in benchmarks/NOTES.md). Head dims under 64 take the 64 entries. From D = 64
# the streamed blocks come through tensor descriptors; the held ones too (but in dQ at
# D = 128), and dK/dV at D = 256 runs its two sums apart. The D = 64 dK/dV entry was
# chosen on an H100.
_GPU_16BIT = {
    ("forward", 16): TileConfig(128, 64, 8, 3),
    ("forward", 32): TileConfig(128, 64, 8, 3),
    ("forward", 64): TileConfig(64, 128, 4, 2, tma=True),
    ("forward", 128): TileConfig(128, 64, 4, 2, tma=True),
    ("forward", 256): TileConfig(128, 64, 8, 2, tma=True),
    # attention_forward_ws: 4 warps (a producer and two consumer warpgroups of 4 warps
    # each once specialised); the stages that fit the shared memory (NOTES 35).
    ("forward_ws", 64): TileConfig(128, 128, 4, 3, tma=True),
    ("forward_ws", 128): TileConfig(128, 64, 4, 3, tma=True),
    ("forward_ws", 256): TileConfig(128, 64, 4, 2, tma=True),
    # attention_forward_gluon: two compute warpgroups (8 warps; the load warp is on top),
    # the stages that fit the shared memory beside Q (offline sm_90: 112, 160, 192 KB).
    ("forward_gluon", 64): TileConfig(128, 128, 8, 3, tma=True),
    ("forward_gluon", 128): TileConfig(128, 128, 8, 2, tma=True),
    ("forward_gluon", 256): TileConfig(128, 64, 8, 2, tma=True),
    # attention_backward_dkdv_ws: a 64-row key block (the pass splits no host
    # descriptor's block; two halves' fp32 dK and dV spill at D = 128), 64 query rows a
    # step, 4 warps; the stages that fit (NOTES 35).
    ("dkdv_ws", 64): TileConfig(64, 64, 4, 3, tma=True),
    ("dkdv_ws", 128): TileConfig(64, 64, 4, 2, tma=True),
    ("dkdv_ws", 256): TileConfig(64, 64, 4, 2, tma=True),
    ("dkdv", 16): TileConfig(64, 64, 4, 2),
    ("dkdv", 32): TileConfig(64, 64, 4, 2),
    ("dkdv", 64): TileConfig(64, 64, 4, 2, tma=True),
    ("dkdv", 128): TileConfig(64, 64, 4, 2, tma=True),
    ("dkdv", 256): TileConfig(32, 128, 8, 2, tma=True, apart=True),
    ("dq", 16): TileConfig(128, 64, 8, 3),
    ("dq", 32): TileConfig(128, 64, 8, 3),
    ("dq", 64): TileConfig(128, 64, 4, 3, tma=True),
    ("dq", 128): TileConfig(128, 64, 8, 3, tma=True, hold_tma=False),
    ("dq", 256): TileConfig(128, 32, 8, 3, tma=True),
    ("preprocess", 0): TileConfig(128, 0, 4, 1),
}

# fp32 tiles take twice the shared memory and registers: halve them.
_GPU_32BIT = {
    ("forward", 16): TileConfig(64, 64, 4, 2),
    ("forward", 32): TileConfig(64, 64, 4, 2),
    ("forward", 64): TileConfig(64, 64, 4, 2),
    ("forward", 128): TileConfig(64, 32, 4, 2),
    ("forward", 256): TileConfig(32, 32, 4, 1),
    ("dkdv", 16): TileConfig(32, 64, 4, 2),
    ("dkdv", 32): TileConfig(32, 64, 4, 2),
    ("dkdv", 64): TileConfig(32, 64, 4, 2),
    ("dkdv", 128): TileConfig(16, 64, 4, 1),
    ("dkdv", 256): TileConfig(16, 32, 4, 1),
    ("dq", 16): TileConfig(64, 32, 4, 2),
    ("dq", 32): TileConfig(64, 32, 4, 2),
    ("dq", 64): TileConfig(64, 32, 4, 2),
    ("dq", 128): TileConfig(64, 16, 4, 1),
    ("dq", 256): TileConfig(32, 16, 4, 1),
    ("preprocess", 0): TileConfig(64, 0, 4, 1),
}

# Causal problems at the main table's lengths, where a causal tune's winner beats the
# main entry's causal time by more than a few percent (the causal loops skip half the
# blocks and mask the diagonal ones, which can favour another tile). Same keys as the
# main table; `tune.py` prints these lines.
_GPU_16BIT_CAUSAL = {
    # tune.py --tma-only --kernels dkdv (H200, 2026-12-03): 1.169 ms against the main
    # entry's 1.266 (non-causal 2.773 against 1.972).
    ("dkdv", 128): TileConfig(32, 64, 4, 3, tma=True),
    # tune.py --tma-only --kernels forward,dkdv --head-dims 256: 1.547 ms against the main
    # entry's 1.663.
    ("dkdv", 256): TileConfig(32, 128, 8, 3, tma=True, apart=True),
}
_GPU_32BIT_CAUSAL: dict = {}

# Where an entry reads through tensor descriptors and a launch can make neither kind (fa_jax
# on the GPU under jax-triton 0.3.1, or for packed varlen batches under 0.4: a host
# descriptor cannot stop at a sequence's end, and no jax-triton release gives device
# descriptors' global scratch inside a jitted program, fa_jax._launch.plan_options), the
# best pointer-load tile measured for that
# (kernel, block_d) serves instead (H200, S = 4096, ms non-causal / causal,
# benchmarks/NOTES.md 13 and 16); other entries keep their tile. Only the tile
# sizes per program change, never the order in which a row or a key sums: same bits.
_GPU_16BIT_POINTER = {
    # 1.167 / 0.675 against the descriptor entry's 1.083 / 0.633; that tile with pointer
    # loads (4 warps issue the addresses and the matmuls) 2.390 / 1.361.
    ("forward", 128): TileConfig(128, 64, 8, 3),
    ("dkdv", 128): TileConfig(64, 128, 8, 2),  # 2.327 / 1.305 against 1.972 / 1.266
}

# Short sequences: entries keyed (kernel, block_d, bucket) serve problems whose longer
# sequence falls in a bucket up to that one (the smallest such entry wins), chosen by
# `tune.py --seqlen N`; other problems take the entries above.
_GPU_16BIT_SHORT = {
    # tune.py --seqlen 1024 --head-dims 128 (H200, 2026-12-03): forward 0.369 / 0.223 ms
    # (causal) against 0.360 / 0.249 for the main entry, dK/dV 0.681 / 0.409 against
    # 0.699 / 0.451; dQ's main entry won.
    ("forward", 128, 1024): TileConfig(64, 64, 4, 3),
    ("dkdv", 128, 1024): TileConfig(32, 64, 4, 2),
}
_GPU_32BIT_SHORT: dict = {}

# Query tiles of at most 16 rows (decode: a few queries, or a packed GQA group), keyed by
# (kernel, block_d): memory-bound, they want other tiles than the compute-bound table
# above. Written by `tune.py --decode --write` between the markers; the comment gives the
# forward + combine time on tune.py's DECODE_SHAPES (H200, 2026-12-03).
# BEGIN few-rows
_GPU_16BIT_FEW_ROWS = {
    ("forward", 128): TileConfig(16, 128, 4, 2),  # 0.140 / 0.142 ms, main entry 0.146 / 0.228
}
# END few-rows
FEW_ROWS = 16

# The interpreter pays ~5 ms of Python per tile step, whatever its size: big tiles.
_INTERPRETER = TileConfig(64, 64, 4, 1)


def seqlen_bucket(seqlen: int) -> int:
    """The smallest power of two >= seqlen, at least 16 (the smallest tl.dot side)."""
    return max(16, 1 << max(0, seqlen - 1).bit_length())


def tables(dtype: str) -> tuple[dict, dict]:
    """The GPU table and its short-sequence table for a dtype."""
    if dtype == "float32":
        return _GPU_32BIT, _GPU_32BIT_SHORT
    return _GPU_16BIT, _GPU_16BIT_SHORT


def causal_table(dtype: str) -> dict:
    """The causal entries that take precedence over the main table for a dtype."""
    return _GPU_32BIT_CAUSAL if dtype == "float32" else _GPU_16BIT_CAUSAL


def table_entry(kernel: str, block_d: int, dtype: str, seqlen_q: int, seqlen_k: int,
                causal: bool = False) -> TileConfig:
    """The GPU table's config before it is fitted to the sequence lengths: few-rows,
    then short-sequence, then causal entries before the main table; with what
    ``override`` layers on them."""
    block_d = _table_block_d(kernel, block_d)
    entry = _table_entry(kernel, block_d, dtype, seqlen_q, seqlen_k, causal)
    return _overridden(entry, kernel, block_d, dtype, True) if _OVERRIDES else entry


def _table_block_d(kernel: str, block_d: int) -> int:
    """The head dim a kernel's entries are keyed by: the preprocess has one for all (0)."""
    return 0 if kernel == "preprocess" else block_d


def _table_entry(kernel: str, block_d: int, dtype: str, seqlen_q: int, seqlen_k: int,
                 causal: bool) -> TileConfig:
    table, short = tables(dtype)
    if dtype != "float32" and seqlen_bucket(seqlen_q) <= FEW_ROWS:
        entry = _GPU_16BIT_FEW_ROWS.get((kernel, block_d))
        if entry is not None:
            return entry
    bucket = seqlen_bucket(max(seqlen_q, seqlen_k))
    served = [b for (k, d, b) in short if k == kernel and d == block_d and b >= bucket]
    if served:
        return short[(kernel, block_d, min(served))]
    if causal and (kernel, block_d) in causal_table(dtype):
        return causal_table(dtype)[(kernel, block_d)]
    return table[(kernel, block_d)]


def shared_memory_limit(capability: tuple[int, int]) -> int:
    """The most shared memory one program may take (bytes; CUDA's opt-in limit a block)."""
    if capability[0] >= 9 and capability[0] < 12:  # Hopper, datacenter Blackwell
        return 232448
    if capability in ((8, 0), (8, 7)):  # A100, Orin
        return 166912
    return 101376 if capability[0] >= 8 else 65536  # consumer Ampere/Ada/Blackwell; older


def shared_memory_per_sm(capability: tuple[int, int]) -> int:
    """What the programs an SM runs at once share (bytes; each takes 1 KB of it besides its
    own): 228 KB on Hopper (H100 and H200 alike)."""
    return 233472 if capability == (9, 0) else shared_memory_limit(capability) + 1024


def shared_memory(kernel: str, cfg: TileConfig, block_d: int, item: int, bias_item: int = 0,
                  bias_grad: bool = False) -> int:
    """An estimate of one program's shared memory (bytes): the tiles it holds (an fp32
    dBias tile among them) plus, for each pipeline stage, the tiles it streams, and a
    bias tile of ``bias_item`` bytes an element for each stage ahead. Triton's allocation
    (``fa_kernels.offline``) matches it within a few hundred bytes for the forward and
    dQ and stays below it for dK/dV."""
    held_rows, streamed_rows = {"forward": (cfg.block_m, 2 * cfg.block_n),
                                "forward_ws": (cfg.block_m, 2 * cfg.block_n),
                                "forward_gluon": (cfg.block_m, 2 * cfg.block_n),
                                "dq": (2 * cfg.block_m, 2 * cfg.block_n),
                                "dkdv": (2 * cfg.block_n, 2 * cfg.block_m),
                                "dkdv_ws": (2 * cfg.block_n, 2 * cfg.block_m)}.get(kernel, (0, 0))
    if held_rows == 0:
        return 0
    tile = cfg.block_m * cfg.block_n
    held = held_rows * block_d * item + (tile * 4 if bias_grad else 0)
    stages = max(1, cfg.num_stages)
    # (the bias tile of the block in use is read straight into registers)
    return held + stages * streamed_rows * block_d * item + max(1, stages - 1) * tile * bias_item


# What ``override`` layers on the tables, innermost last, and who must hear of a change
# (the plan's caches: a plan is a function of the tables).
_OVERRIDES: list = []
_ON_CHANGE: list = []


def on_change(callback) -> None:
    """Call ``callback()`` whenever ``override`` changes what the tables give."""
    _ON_CHANGE.append(callback)


def _changed() -> None:
    for callback in _ON_CHANGE:
        callback()


@contextlib.contextmanager
def override(kernels: tuple = (), entries: dict | None = None, **fields):
    """The tables as a caller wants them, inside a ``with`` block (tests, tuning, trying
    a config without editing this file):

    * ``entries``: ``{(kernel, block_d, dtype): TileConfig}``, what a GPU gets for that
      kernel, padded head dim and dtype in place of every table's entry;
    * ``fields`` (``tma=True``, ``apart=True``, ``num_stages=2``...): set on every entry
      of ``kernels`` ("forward", "forward_ws", "forward_gluon", "dkdv", "dkdv_ws", "dq",
      "preprocess"), the
      interpreter's too.

    The tile is then fitted to the sequence and the device as usual. Plans made before
    are dropped on entry and on exit."""
    layer = (tuple(kernels), dict(entries or {}), fields)
    _OVERRIDES.append(layer)
    _changed()
    try:
        yield
    finally:
        _OVERRIDES.remove(layer)
        _changed()


def _overridden(base: TileConfig, kernel: str, block_d: int, dtype: str, gpu: bool) -> TileConfig:
    for kernels, entries, fields in _OVERRIDES:
        if gpu and (kernel, block_d, dtype) in entries:
            base = entries[(kernel, block_d, dtype)]
        if kernel in kernels:
            base = replace(base, **fields)
    return base


def tile_config(kernel: str, block_d: int, dtype: str, seqlen_q: int, seqlen_k: int,
                capability: tuple[int, int] | None, bias_item: int = 0,
                bias_grad: bool = False, causal: bool = False,
                descriptors: bool = True) -> TileConfig:
    """The config of one kernel; ``capability`` None means the CPU interpreter.
    ``descriptors`` False: the launch cannot make tensor descriptors, so an entry that
    reads through them gives way to the best pointer-load tile.

    On a GPU the tile then fits the device's shared memory: a bias (``bias_item`` bytes
    an element) and its gradient take room the table's entries did not count, and a GPU
    smaller than the H200 has less. Down to two stages first, then the tile's longer
    side halved, then one stage."""
    table_d = _table_block_d(kernel, block_d)
    if capability is None:
        base = _INTERPRETER
    else:
        base = _table_entry(kernel, table_d, dtype, seqlen_q, seqlen_k, causal)
        if base.tma and not descriptors:
            pointer = _GPU_16BIT_POINTER if dtype != "float32" else {}
            base = pointer.get((kernel, block_d), replace(base, tma=False))
    if _OVERRIDES:
        base = _overridden(base, kernel, table_d, dtype, capability is not None)
    block_m = min(base.block_m, seqlen_bucket(seqlen_q))
    block_n = min(base.block_n, seqlen_bucket(seqlen_k)) if base.block_n else 0
    num_warps = base.num_warps
    num_stages = base.num_stages
    if capability is not None and max(block_m, block_n) <= 32:
        num_warps = min(num_warps, 4)
    if capability is not None and block_n:
        # A pipeline deeper than the loop only takes shared memory, and with it the second
        # program an SM could run: short sequences would pay for stages they never fill.
        streamed, block = ((seqlen_q, block_m) if kernel.startswith("dkdv")
                           else (seqlen_k, block_n))
        num_stages = min(num_stages, max(2, -(-streamed // block)))
    cfg = replace(base, block_m=block_m, block_n=block_n, num_warps=num_warps,
                  num_stages=num_stages)
    if capability is None:
        return cfg
    limit = shared_memory_limit(capability)
    while shared_memory(kernel, cfg, block_d, ITEMSIZE[dtype], bias_item, bias_grad) > limit:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif max(cfg.block_m, cfg.block_n) > 16:  # halve the longer side of the tile
            side = "block_m" if cfg.block_m > cfg.block_n else "block_n"
            cfg = replace(cfg, **{side: getattr(cfg, side) // 2})
        elif cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=1)
        else:
            break
    return cfg
