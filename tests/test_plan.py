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
    # scalars: qk_scale, seqlen_q, seqlen_k, then (batch, seq, head) strides of q, k, v, out, lse.
    assert launch.scalars[1:3] == (100, 300)
    assert launch.scalars[3:6] == (100 * 8 * 72 * 3, 8 * 72 * 3, 72)
    assert launch.scalars[6:9] == (300 * 2 * 72, 2 * 72, 72)
    assert launch.scalars[12:15] == (100 * 8 * 72, 8 * 72, 72)
    assert launch.scalars[15:] == (8 * 100, 100)
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
