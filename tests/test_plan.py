"""The launch plan alone: pure Python, no kernel runs."""
import dataclasses
import itertools

import pytest

from fa_kernels import plan
from fa_kernels.configs import seqlen_bucket, tile_config


def problem(**kw):
    args = dict(q_shape=(2, 100, 8, 72), k_shape=(2, 300, 2, 72), v_shape=(2, 300, 2, 72),
                q_dtype="bfloat16", k_dtype="bfloat16", v_dtype="bfloat16")
    args.update(kw)
    return plan.check_problem(**args)


def test_problem_fields():
    p = problem(causal=True)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_k, p.head_dim) == (2, 100, 300, 8, 2, 72)
    assert p.group_size == 4 and p.block_d == 128 and p.causal
    assert p.softmax_scale == pytest.approx(72 ** -0.5)
    assert problem(softmax_scale=0.0).softmax_scale == 0.0
    assert p.out_shape == (2, 100, 8, 72) and p.lse_shape == (2, 8, 100)
    assert p.dot_precision == "tf32"
    assert problem(q_dtype="float32", k_dtype="float32", v_dtype="float32").dot_precision == "ieee"


def strides(scalars: dict, array: str) -> tuple:
    """(batch, seq, head) strides of one array (q, k, v, o...) from a launch's scalars."""
    return tuple(scalars[f"stride_{array}{axis}"] for axis in ("b", "m" if array in "qo" else "n",
                                                               "h"))


@pytest.mark.parametrize("capability", [None, (9, 0), (8, 0)])
def test_forward_grid_and_strides(capability):
    p = problem()
    fwd = plan.forward_plan(p, capability=capability, q_strides=(100 * 8 * 72 * 3, 8 * 72 * 3, 72, 1))
    launch = fwd.launch
    block_m = launch.constexprs["BLOCK_M"]
    assert launch.grid == (-(-100 // block_m), 8, 2)
    scalars = launch.scalars
    assert scalars["qk_scale"] == pytest.approx(72 ** -0.5 * 1.4426950408889634)
    assert [scalars[n] for n in ("window_left", "window_right", "seqlen_q", "seqlen_k",
                                 "total_q", "total_k")] == [-1, -1, 100, 300, 0, 0]
    assert strides(scalars, "q") == (100 * 8 * 72 * 3, 8 * 72 * 3, 72)
    assert strides(scalars, "k") == (300 * 2 * 72, 2 * 72, 72)
    assert strides(scalars, "o") == (100 * 8 * 72, 8 * 72, 72)
    assert (scalars["stride_lb"], scalars["stride_lh"]) == (8 * 100, 100)
    assert [scalars[n] for n in ("stride_bb", "stride_bh", "stride_bm", "stride_bn",
                                 "stride_sb", "num_splits", "stride_os", "stride_ls")] == [
        0, 0, 0, 0, 0, 0, 0, 0]  # no bias, no slopes, no split-KV (0: jax_triton folds a 1)
    assert [o.shape for o in launch.outputs] == [(2, 100, 8, 72), (2, 8, 100), (2, 8, 100)]
    assert launch.constexprs["GROUP_SIZE"] == 4 and launch.constexprs["HEAD_DIM"] == 72


def test_backward_plan_grids():
    p = problem()
    bwd = plan.backward_plan(p, capability=(9, 0))
    block_n = bwd.dkdv.constexprs["BLOCK_N"]
    assert bwd.dkdv.grid == (-(-300 // block_n), 2, 2)  # one program per key block and K/V head
    assert bwd.dq.grid[1:] == (8, 2)
    # One kernel, two passes: each writes its own outputs, the other pass's are placeholders.
    assert bwd.dkdv.kernel == bwd.dq.kernel == "attention_backward"
    assert [o.name for o in bwd.dkdv.outputs] == ["dk", "dv", "unused_dq", "unused_dbias"]
    assert [o.name for o in bwd.dq.outputs] == ["unused_dk", "unused_dv", "dq", "unused_dbias"]
    assert all(o.shape == (1,) for o in bwd.dq.outputs if o.name.startswith("unused_"))
    assert not bwd.dkdv.constexprs["DQ_PASS"] and bwd.dq.constexprs["DQ_PASS"]
    assert bwd.preprocess.outputs[0].shape == (2, 8, 100)


def test_empty_launch():
    p = problem(q_shape=(2, 0, 8, 72))
    assert plan.forward_plan(p, capability=None).launch.empty


def test_last_stride_must_be_one():
    with pytest.raises(ValueError, match=r"q must be contiguous in its last dimension"):
        plan.forward_plan(problem(), capability=None, q_strides=(1, 1, 1, 2))


def test_seqlen_buckets():
    assert [seqlen_bucket(s) for s in (0, 1, 16, 17, 113, 128, 129)] == [16, 16, 16, 32, 128, 128, 256]
    cfg = tile_config("forward", 128, "bfloat16", 17, 5000, (9, 0))
    assert cfg.block_m == 32 and cfg.block_n == 64
    assert tile_config("forward", 64, "float16", 4096, 4096, None).block_m == 64


@pytest.mark.parametrize("kernel, streamed_by_q", [("forward", False), ("dq", False),
                                                    ("dkdv", True)])
def test_pipeline_no_deeper_than_the_loop(kernel, streamed_by_q):
    # Stages beyond the number of streamed blocks would only take shared memory.
    from fa_kernels.configs import table_entry

    for seqlen in (1, 64, 128, 200, 4096):
        cfg = tile_config(kernel, 128, "bfloat16", seqlen, seqlen, (9, 0))
        entry = table_entry(kernel, 128, "bfloat16", seqlen, seqlen)
        block = cfg.block_m if streamed_by_q else cfg.block_n
        assert cfg.num_stages == min(entry.num_stages, max(2, -(-seqlen // block)))
    assert tile_config("forward", 128, "bfloat16", 128, 128, (9, 0)).num_stages == 2
    assert tile_config("forward", 128, "bfloat16", 128, 128, None).num_stages == 1


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 6)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiles_fit_shared_memory(capability, dtype):
    # Every entry, with a bias and its gradient or without, fits the device's shared
    # memory (fa_kernels.offline compiles them and checks Triton's own numbers).
    from fa_kernels import configs

    limit = configs.shared_memory_limit(capability)
    item = configs.ITEMSIZE[dtype]
    for kernel in ("forward", "dkdv", "dq"):
        for block_d in (16, 32, 64, 128, 256):
            for (bias_item, bias_grad), causal in itertools.product(
                    ((0, False), (2, False), (4, True)), (False, True)):
                cfg = tile_config(kernel, block_d, dtype, 4096, 4096, capability,
                                  bias_item=bias_item, bias_grad=bias_grad, causal=causal)
                assert configs.shared_memory(kernel, cfg, block_d, item, bias_item,
                                             bias_grad) <= limit, (kernel, block_d, cfg)


def test_a_bias_takes_a_stage_where_it_must():
    # D = 256 dQ holds Q and dO (128 KB) and streams K/V: with the bias tiles and the
    # dBias tile, three stages pass the H200's 227 KB; two fit. Without a bias: three.
    plain = tile_config("dq", 256, "bfloat16", 4096, 4096, (9, 0))
    biased = tile_config("dq", 256, "bfloat16", 4096, 4096, (9, 0), bias_item=2,
                         bias_grad=True)
    assert (plain.num_stages, biased.num_stages) == (3, 2)
    assert (plain.block_m, plain.block_n) == (biased.block_m, biased.block_n)
    shape = (1, 4096, 2, 256)
    p = plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16",
                           bias_shape=(1, 2, 4096, 4096), bias_dtype="bfloat16")
    assert plan.backward_plan(p, capability=(9, 0), bias_grad=True).dq.num_stages == 2


def test_same_plan_for_both_front_ends():
    # The plan depends only on shapes, dtype, options and the target: both front ends
    # ask with the same values, so they launch the same kernels with the same configs.
    a = plan.forward_plan(problem(), capability=(9, 0))
    b = plan.forward_plan(problem(), capability=(9, 0), q_strides=plan.contiguous_strides((2, 100, 8, 72)))
    assert a == b


@pytest.mark.parametrize("options, folded", [
    ({}, True), (dict(causal=True, window_size=(8, 0)), True), (dict(softmax_scale=2.0), True),
    (dict(softmax_scale=0.0), False), (dict(softmax_scale=-0.5), False),
    (dict(softcap=30.0), False), (dict(bias_shape=(1, 1, 100, 300), bias_dtype="float32"), False),
    (dict(alibi_shape=(8,), alibi_dtype="float32"), False)])
def test_scale_folded_into_exp2_only_where_it_commutes_with_the_max(options, folded):
    # max(c * s) = c * max(s) needs c > 0, and the scores must be q·k times the scale.
    launch = plan.forward_plan(problem(**options), capability=None).launch
    assert launch.constexprs["FOLD_SCALE"] is folded


def test_causal_is_window_right_zero():
    p = problem(causal=True, window_size=(5, 7))
    assert (p.window_left, p.window_right) == (5, 0)
    c = plan.forward_plan(p, capability=None).launch.constexprs
    assert c["LIMIT_LEFT"] and c["LIMIT_RIGHT"] and not c["HAS_DROPOUT"]


def test_bias_broadcast_strides_and_reduction():
    p = problem(bias_shape=(8, 1, 300), bias_dtype="float32")
    assert p.bias_shape == (1, 8, 1, 300)
    assert plan.bias_strides(p.bias_shape, None) == (0, 300, 0, 1)
    assert p.bias_reduce_axes == (0, 2)
    bwd = plan.backward_plan(p, capability=None, bias_grad=True)
    dbias = {o.name: o for o in bwd.dq.outputs}["dbias"]
    assert dbias.shape == (2, 8, 100, 300) and dbias.zeroed


def test_varlen_layout():
    p = plan.check_problem((50, 8, 64), (70, 2, 64), (70, 2, 64), "float16", "float16", "float16",
                           varlen=dict(cu_seqlens_q_shape=(4,), cu_seqlens_k_shape=(4,),
                                       cu_seqlens_q_dtype="int32", cu_seqlens_k_dtype="int32",
                                       max_seqlen_q=30, max_seqlen_k=40))
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q) == (3, 30, 40, 50)
    assert p.lse_shape == (8, 50) and p.out_shape == (50, 8, 64)
    launch = plan.forward_plan(p, capability=None).launch
    # 30 queries of 4 heads a group: one tile of (query, head) rows per K/V head (packed GQA)
    assert launch.grid == (-(-120 // launch.constexprs["BLOCK_M"]), 2, 3)
    assert launch.constexprs["IS_VARLEN"] and launch.constexprs["PACK_GQA"]
    scalars = launch.scalars
    assert strides(scalars, "q") == (0, 8 * 64, 64)  # no batch stride in a packed array
    assert (scalars["total_q"], scalars["total_k"]) == (50, 70)


@pytest.mark.parametrize("group, seqlen_q, packed", [(1, 1, False), (4, 1, True), (4, 63, True),
                                                     (4, 64, False), (8, 16, True)])
def test_pack_gqa_for_short_queries(group, seqlen_q, packed):
    p = problem(q_shape=(2, seqlen_q, 2 * group, 64), k_shape=(2, 300, 2, 64),
                v_shape=(2, 300, 2, 64))
    fwd = plan.forward_plan(p, capability=(9, 0))
    assert fwd.pack_gqa == packed == fwd.launch.constexprs["PACK_GQA"]
    rows, heads = (seqlen_q * group, 2) if packed else (seqlen_q, 2 * group)
    assert fwd.launch.grid == (-(-rows // fwd.launch.constexprs["BLOCK_M"]), heads, 2)


def test_split_kv_heuristic():
    # flash-attn's rule (tightened to 95% of the best wave efficiency): a grid that fills
    # 80% of two programs per SM is not split; a small one is split so that the waves
    # come out nearly full.
    assert plan.num_splits_for(512, 128, 132) == 1
    assert plan.num_splits_for(128, 128, 132) == 2      # decode, packed GQA: 16 x 8 K/V heads
    assert plan.num_splits_for(32, 128, 132) == 8       # one query, 32 heads: 256 of 264 slots
    assert plan.num_splits_for(8, 256, 132) == 32       # 8 K/V heads, packed GQA, Sk 32k
    assert plan.num_splits_for(32, 3, 132) == 1         # too few key blocks to split
    assert plan.num_splits_for(32, 128, None) == 1      # no SM count (interpreter): no split
    assert plan.num_splits_for(0, 128, 132) == 1        # an empty grid (seqlen_q or batch 0)
    empty = problem(q_shape=(2, 0, 8, 72))
    assert plan.forward_plan(empty, capability=(9, 0), num_sms=132).launches[0].empty
    for programs in range(1, 300, 7):
        for blocks in (1, 2, 9, 64, 1000):
            splits = plan.num_splits_for(programs, blocks, 132)
            assert 1 <= splits <= max(1, blocks // 2)


def test_split_kv_plan():
    p = problem(q_shape=(2, 1, 8, 64), k_shape=(2, 5000, 8, 64), v_shape=(2, 5000, 8, 64))
    fwd = plan.forward_plan(p, capability=(9, 0), num_sms=132)
    assert fwd.num_splits > 1 and [x.kernel for x in fwd.launches] == [
        "attention_forward", "attention_forward_combine"]
    assert fwd.launch.grid == (fwd.num_splits, 8, 2) and fwd.launch.constexprs["SPLIT_KV"]
    assert [o.shape for o in fwd.launch.outputs] == [(fwd.num_splits, 2, 1, 8, 64),
                                                     (fwd.num_splits, 2, 8, 1),
                                                     (fwd.num_splits, 2, 8, 1)]
    assert [fwd.launch.scalars[n] for n in ("num_splits", "stride_os", "stride_ls")] == [
        fwd.num_splits, 2 * 8 * 64, 2 * 8]
    assert fwd.combine.inputs[:3] == ("out_partial", "lse_partial", "lse_lo_partial")
    assert [o.name for o in fwd.combine.outputs] == ["out", "lse", "lse_lo"]
    assert plan.forward_plan(p, capability=(9, 0)).launches == (
        plan.forward_plan(p, capability=(9, 0)).launch,)


def test_short_sequence_entries():
    # A short entry serves problems whose longer side falls in its bucket or below;
    # longer problems take the main table.
    from fa_kernels import configs

    short = configs.tables("bfloat16")[1]
    for (kernel, block_d, bucket), cfg in short.items():
        for seqlen in (bucket // 2 + 1, bucket):
            got = tile_config(kernel, block_d, "bfloat16", seqlen, seqlen, (9, 0))
            assert (got.block_m, got.block_n, got.num_warps) == (cfg.block_m, cfg.block_n,
                                                                 cfg.num_warps)
        main = configs.tables("bfloat16")[0][(kernel, block_d)]
        longer = tile_config(kernel, block_d, "bfloat16", 2 * bucket, 2 * bucket, (9, 0))
        assert (longer.block_m, longer.block_n) == (main.block_m, main.block_n)
    assert configs.table_entry("forward", 128, "bfloat16", 64, 8192) == \
        configs.tables("bfloat16")[0][("forward", 128)]


def test_causal_entries():
    # A causal entry serves causal problems of the main table's lengths, and the plan
    # launches with it; non-causal problems and short sequences keep their entries.
    from fa_kernels import configs

    assert configs.causal_table("bfloat16"), "no causal entry to test"
    for (kernel, block_d), cfg in configs.causal_table("bfloat16").items():
        main = configs.tables("bfloat16")[0][(kernel, block_d)]
        assert cfg != main
        assert configs.table_entry(kernel, block_d, "bfloat16", 4096, 4096, True) == cfg
        assert configs.table_entry(kernel, block_d, "bfloat16", 4096, 4096, False) == main
        if any(k == kernel and d == block_d and bucket >= 512
               for (k, d, bucket) in configs.tables("bfloat16")[1]):  # a short entry
            short = configs.table_entry(kernel, block_d, "bfloat16", 512, 512, False)
            assert configs.table_entry(kernel, block_d, "bfloat16", 512, 512, True) == short
        shape = (1, 4096, 2, block_d)
        for causal, want in ((True, cfg), (False, main)):
            p = plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16",
                                   causal=causal)
            launches = ({"forward": plan.forward_plan(p, capability=(9, 0)).launch}
                        if kernel == "forward" else vars(plan.backward_plan(p, capability=(9, 0))))
            launch = launches[kernel]
            assert (launch.constexprs["BLOCK_M"], launch.constexprs["BLOCK_N"],
                    launch.num_warps, launch.num_stages) == (
                        want.block_m, want.block_n, want.num_warps, want.num_stages)


def test_few_rows_entries(monkeypatch):
    # Query tiles of at most 16 rows (decode, packed GQA groups) take the few-rows table.
    from fa_kernels import configs

    entry = configs.TileConfig(16, 128, 4, 2)
    monkeypatch.setitem(configs._GPU_16BIT_FEW_ROWS, ("forward", 128), entry)
    assert tile_config("forward", 128, "bfloat16", 4, 8192, (9, 0)) == entry
    assert tile_config("forward", 128, "bfloat16", 17, 8192, (9, 0)).block_m == 32
    assert tile_config("forward", 128, "float32", 4, 8192, (9, 0)).block_n != 128
    plan.forward_plan.cache_clear()
    p = problem(q_shape=(2, 1, 8, 128), k_shape=(2, 8192, 2, 128), v_shape=(2, 8192, 2, 128))
    launch = plan.forward_plan(p, capability=(9, 0)).launch  # 4 packed rows
    assert (launch.constexprs["BLOCK_N"], launch.num_warps) == (128, 4)
    plan.forward_plan.cache_clear()


def test_held_blocks_through_descriptors_as_the_entry_says():
    # USE_TMA: the streamed blocks; HOLD_TMA: the held ones, only with USE_TMA and as the
    # entry's hold_tma says (the D = 128 dQ pass keeps Q/dO in registers). Host
    # descriptors hold them through a 2-D view of the rows, streamed ones are 4-D.
    from fa_kernels import configs

    for head_dim in (64, 128, 256):
        shape = (2, 4096, 4, head_dim)
        p = plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16")
        for host in (False, True):
            bwd = plan.backward_plan(p, capability=(9, 0), host_descriptors=host)
            for kernel in ("dkdv", "dq"):
                entry = configs.table_entry(kernel, head_dim, "bfloat16", 4096, 4096)
                flags = getattr(bwd, kernel).constexprs
                assert flags["USE_TMA"] == entry.tma and flags["HOST_TMA"] == (host and entry.tma)
                assert flags["HOLD_TMA"] == (entry.tma and entry.hold_tma)
                held = ("k", "v") if kernel == "dkdv" else ("q", "dout")
                for blocks in getattr(bwd, kernel).blocks:
                    if not flags["HOST_TMA"] or (blocks.array in held and not flags["HOLD_TMA"]):
                        assert not blocks.host_descriptor
                    elif blocks.array in held:  # (B·S, H·D), one row per token
                        assert blocks.shape == (2 * 4096, 4 * head_dim)
                        assert blocks.strides == (4 * head_dim, 1)
                        assert blocks.block_shape[1] == head_dim
                    else:
                        assert blocks.shape == shape and len(blocks.block_shape) == 4
        ampere = plan.backward_plan(p, capability=(8, 0))
        assert not ampere.dkdv.constexprs["HOLD_TMA"] and not ampere.dq.constexprs["HOLD_TMA"]
    assert not configs.table_entry("dq", 128, "bfloat16", 4096, 4096).hold_tma


@pytest.mark.parametrize("layout, expected", [
    # (B, S, H, D): heads side by side in a row of H·D; rows B·S
    ((2, 100, 4, 64), (200, 256)),
    # (B, H, S, D) memory seen as (B, S, H, D): one head's rows after another's
    ((2, 100, 4, 64, "bhsd"), (800, 64)),
    # K of a fused (B, S, 3, H, D) QKV: row pitch 3·H·D, the view H·D wide
    ((2, 100, 4, 64, "qkv"), (200, 256)),
    ((2, 100, 4, 80), None),  # BLOCK_D 128 > 80: a block would take the next head's columns
])
def test_held_blocks_view_the_rows_as_memory_lays_them(layout, expected):
    batch, seqlen, heads, head_dim, *kind = layout
    strides = {(): (seqlen * heads * head_dim, heads * head_dim, head_dim),
               ("bhsd",): (heads * seqlen * head_dim, head_dim, seqlen * head_dim),
               ("qkv",): (seqlen * 3 * heads * head_dim, 3 * heads * head_dim, head_dim)}
    st = strides[tuple(kind)]
    block_d = 128 if head_dim == 80 else head_dim
    view = plan._flat_rows((batch, seqlen, heads, head_dim), st, block_d)
    assert view == expected
    if view is not None:  # the view ends at the array's last element
        rows, width = view
        last = (batch - 1) * st[0] + (seqlen - 1) * st[1] + (heads - 1) * st[2] + head_dim - 1
        assert (rows - 1) * st[1] + width - 1 == last


def test_held_blocks_need_their_own_strides_aligned():
    # K with a sequence stride of 260 bf16 values (520 bytes, not whole 16-byte units):
    # dK/dV still streams Q/dO through descriptors but holds K/V through pointer loads,
    # and dQ, which streams K/V, uses none.
    shape = (1, 4096, 4, 64)
    p = plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16")
    odd_k = (4096 * 260, 260, 64, 1)
    bwd = plan.backward_plan(p, capability=(9, 0), k_strides=odd_k, tma=True)
    assert bwd.dkdv.constexprs["USE_TMA"] and not bwd.dkdv.constexprs["HOLD_TMA"]
    assert not bwd.dq.constexprs["USE_TMA"] and not bwd.dq.constexprs["HOLD_TMA"]


@pytest.mark.parametrize("build", ["forward", "split", "backward", "dropout"])
def test_every_launch_names_exactly_its_kernels_scalars(build):
    # Launches carry scalars by the kernel's parameter names: a name too many, too few or
    # misspelt is a TypeError before any launch, never a shifted argument.
    from fa_kernels import registry

    p = problem(bias_shape=(2, 8, 100, 300), bias_dtype="bfloat16", dropout_p=0.1)
    launches = {
        "forward": lambda: plan.forward_plan(p, capability=(9, 0)).launches,
        "split": lambda: plan.forward_plan(p, capability=(9, 0), num_splits=2).launches,
        "backward": lambda: plan.backward_plan(p, capability=(9, 0), bias_grad=True).launches,
        "dropout": lambda: (plan.dropout_mask_plan(2, 8, 100, 300, 0.1, capability=None),),
    }[build]()
    for launch in launches:
        kernel = registry.KERNELS[launch.kernel]
        ordered = registry.scalar_arguments(launch)
        names = [n for n in kernel.arg_names if n in launch.scalars]
        assert ordered == tuple(launch.scalars[n] for n in names)
        broken = dataclasses.replace(launch, scalars={**launch.scalars, "stride_zz": 1})
        with pytest.raises(TypeError, match="takes the scalars"):
            registry.scalar_arguments(broken)
        missing = dict(launch.scalars)
        missing.pop(next(iter(missing)))
        with pytest.raises(TypeError, match="takes the scalars"):
            registry.scalar_arguments(dataclasses.replace(launch, scalars=missing))


def test_config_override_is_scoped_and_remakes_plans():
    # configs.override: entries by (kernel, block_d, dtype) on a GPU, fields on every entry
    # of some kernels (the interpreter's too); cached plans follow it in and out.
    from fa_kernels import configs

    p = problem(q_shape=(2, 4096, 8, 128), k_shape=(2, 4096, 2, 128), v_shape=(2, 4096, 2, 128))
    before = plan.forward_plan(p, capability=(9, 0)).launch
    entry = configs.TileConfig(64, 32, 4, 3)
    with configs.override(entries={("forward", 128, "bfloat16"): entry}):
        inside = plan.forward_plan(p, capability=(9, 0)).launch
        assert (inside.constexprs["BLOCK_M"], inside.constexprs["BLOCK_N"], inside.num_warps,
                inside.num_stages) == (64, 32, 4, 3)
        assert not inside.constexprs["USE_TMA"]
        other = plan.forward_plan(problem(q_dtype="float16", k_dtype="float16", v_dtype="float16",
                                          q_shape=(2, 4096, 8, 128), k_shape=(2, 4096, 2, 128),
                                          v_shape=(2, 4096, 2, 128)), capability=(9, 0)).launch
        assert other.constexprs["BLOCK_N"] != 32  # another dtype keeps the table's entry
        with configs.override(("forward", "dq"), num_stages=1, tma=True):
            nested = plan.forward_plan(p, capability=(9, 0)).launch
            assert nested.num_stages == 1 and nested.constexprs["USE_TMA"]
            assert plan.forward_plan(p, capability=None).launch.num_stages == 1
            assert plan.backward_plan(p, capability=(9, 0)).dq.num_stages == 1
        assert plan.forward_plan(p, capability=(9, 0)).launch == inside
    assert plan.forward_plan(p, capability=(9, 0)).launch == before


@pytest.mark.parametrize("seed", [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63,
                                  2 ** 64 - 1, 0x123456789ABCDEF0])
def test_seed_words(seed):
    low, high = plan.seed_words(seed)
    assert all(-2 ** 31 <= w < 2 ** 31 for w in (low, high))
    assert plan.seed_from_words(low, high) == seed


@pytest.mark.parametrize("seed", [-1, 2 ** 64])
def test_seed_words_refuses_out_of_range(seed):
    with pytest.raises(ValueError, match="dropout_seed"):
        plan.seed_words(seed)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_without_descriptors_the_best_pointer_tile(head_dim, causal):
    # A launch that cannot make tensor descriptors (tma=False: fa_jax on jax-triton 0.3.1)
    # gets pointer loads everywhere, and the pointer table's tile where one was measured.
    from fa_kernels import configs

    shape = (2, 4096, 4, head_dim)
    p = problem(q_shape=shape, k_shape=shape, v_shape=shape, causal=causal)
    forward = plan.forward_plan(p, capability=(9, 0), tma=False).launch
    backward = plan.backward_plan(p, capability=(9, 0), tma=False)
    for launch, kernel in ((forward, "forward"), (backward.dkdv, "dkdv"), (backward.dq, "dq")):
        assert not launch.constexprs["USE_TMA"]
        entry = configs.table_entry(kernel, head_dim, "bfloat16", 4096, 4096, causal)
        want = configs._GPU_16BIT_POINTER.get((kernel, head_dim), entry)
        assert (launch.constexprs["BLOCK_M"], launch.constexprs["BLOCK_N"], launch.num_warps,
                launch.num_stages) == (want.block_m, want.block_n, want.num_warps,
                                       want.num_stages)
    served = plan.forward_plan(p, capability=(9, 0)).launch
    assert served.constexprs["USE_TMA"] == configs.table_entry("forward", head_dim, "bfloat16",
                                                              4096, 4096, causal).tma


@pytest.mark.parametrize("layout", plan.RING_LAYOUTS)
@pytest.mark.parametrize("devices", [2, 3, 4])
def test_ring_schedule_sees_what_the_causal_mask_shows(layout, devices):
    # Each device's slice in chunks of its layout, their global positions, and the causal
    # mask between them: a part of the schedule must cover exactly the visible pairs.
    chunks_per_device = 2 if layout == "zigzag" else 1
    chunk = 4

    def positions(device):
        if layout == "contiguous":
            ids = [device]
        else:
            ids = [device, 2 * devices - 1 - device]
        return [c * chunk + i for c in ids for i in range(chunk)]

    def rows(which, n):
        return {"all": range(n), "first": range(n // 2), "second": range(n // 2, n)}[which]

    own, earlier, later = plan.ring_schedule(True, layout)
    n = chunk * chunks_per_device
    for me, source in itertools.product(range(devices), repeat=2):
        part = own if me == source else earlier if source < me else later
        q_pos, k_pos = positions(me), positions(source)
        visible = {(i, j) for i in range(n) for j in range(n) if k_pos[j] <= q_pos[i]}
        if part is None:
            assert not visible, (me, source)
            continue
        covered = {(i, j) for i in rows(part.queries, n) for j in rows(part.keys, n)
                   if not part.causal or j <= i}
        assert covered == visible, (me, source, part)
    assert plan.ring_schedule(False, layout) == (plan.RingPart(),) * 3
