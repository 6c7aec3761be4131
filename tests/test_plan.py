"""The launch plan alone: pure Python, no kernel runs."""
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


@pytest.mark.parametrize("capability", [None, (9, 0), (8, 0)])
def test_forward_grid_and_strides(capability):
    p = problem()
    fwd = plan.forward_plan(p, capability=capability, q_strides=(100 * 8 * 72 * 3, 8 * 72 * 3, 72, 1))
    launch = fwd.launch
    block_m = launch.constexprs["BLOCK_M"]
    assert launch.grid == (-(-100 // block_m), 8, 2)
    # scalars: qk_scale, softcap_scale, softcap*log2e, dropout_p, 1/(1-p), window left/right,
    # seqlen_q, seqlen_k, then (batch, seq, head) strides of q, k, v, out; lse; bias; slopes.
    assert launch.scalars[0] == pytest.approx(72 ** -0.5 * 1.4426950408889634)
    assert launch.scalars[5:9] == (-1, -1, 100, 300)
    assert launch.scalars[9:12] == (100 * 8 * 72 * 3, 8 * 72 * 3, 72)
    assert launch.scalars[12:15] == (300 * 2 * 72, 2 * 72, 72)
    assert launch.scalars[18:21] == (100 * 8 * 72, 8 * 72, 72)
    assert launch.scalars[21:23] == (8 * 100, 100)
    assert launch.scalars[23:] == (0, 0, 0, 0, 0)
    assert [o.shape for o in launch.outputs] == [(2, 100, 8, 72), (2, 8, 100)]
    assert launch.constexprs["GROUP_SIZE"] == 4 and launch.constexprs["HEAD_DIM"] == 72


def test_backward_plan_grids():
    p = problem()
    bwd = plan.backward_plan(p, capability=(9, 0))
    block_n = bwd.dkdv.constexprs["BLOCK_N"]
    assert bwd.dkdv.grid == (-(-300 // block_n), 2, 2)  # one program per key block and K/V head
    assert bwd.dq.grid[1:] == (8, 2)
    assert [o.name for o in bwd.dkdv.outputs] == ["dk", "dv"]
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


def test_same_plan_for_both_front_ends():
    # The plan depends only on shapes, dtype, options and the target: both front ends
    # ask with the same values, so they launch the same kernels with the same configs.
    a = plan.forward_plan(problem(), capability=(9, 0))
    b = plan.forward_plan(problem(), capability=(9, 0), q_strides=plan.contiguous_strides((2, 100, 8, 72)))
    assert a == b


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
    assert bwd.dq.outputs[1].shape == (2, 8, 100, 300) and bwd.dq.outputs[1].zeroed


def test_varlen_layout():
    p = plan.check_problem((50, 8, 64), (70, 2, 64), (70, 2, 64), "float16", "float16", "float16",
                           varlen=dict(cu_seqlens_q_shape=(4,), cu_seqlens_k_shape=(4,),
                                       cu_seqlens_q_dtype="int32", cu_seqlens_k_dtype="int32",
                                       max_seqlen_q=30, max_seqlen_k=40))
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q) == (3, 30, 40, 50)
    assert p.lse_shape == (8, 50) and p.out_shape == (50, 8, 64)
    launch = plan.forward_plan(p, capability=None).launch
    assert launch.grid[1:] == (8, 3) and launch.constexprs["IS_VARLEN"]
    assert launch.scalars[9:12] == (0, 8 * 64, 64)  # no batch stride in a packed array
