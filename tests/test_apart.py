"""dK and dV by programs apart (two a key block, each recomputing P; the D = 256 table
entry): the same values as one program summing both, every option, both front ends.
On the CPU the interpreter's config is switched to it; on the GPU every dK/dV entry."""
import pytest
import torch

from fa_kernels import plan as fa_plan

from .common import (DEVICE, ON_GPU, check_against_reference, check_with_every_option,
                     forward_plan_torch, launch_arrays, random_qkv, replace_entries)

CAPABILITY = torch.cuda.get_device_capability() if ON_GPU else None


@pytest.fixture
def apart_table(replace_entries):
    replace_entries(("dkdv",), apart=True)


CASES = {  # (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, causal)
    "causal-odd-d40": (1, 37, 150, 2, 2, 40, "float16", True),
    "gqa": (2, 70, 45, 4, 2, 64, "bfloat16", False),
    "d256": (1, 33, 80, 2, 1, 256, "bfloat16", True),
}


@pytest.mark.parametrize("case", CASES)
def test_apart_against_reference(apart_table, run, case):
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, causal = CASES[case]
    problem = fa_plan.check_problem((batch, seqlen_q, heads_q, head_dim),
                                    (batch, seqlen_k, heads_k, head_dim),
                                    (batch, seqlen_k, heads_k, head_dim), dtype, dtype, dtype,
                                    causal=causal)
    assert fa_plan.backward_plan(problem, capability=CAPABILITY).dkdv.constexprs["DKDV_PARTS"] == 2
    check_against_reference(run, batch, seqlen_q, seqlen_k, heads_q, heads_k,
                            head_dim, dtype, causal)


def test_apart_with_every_option(apart_table, run):
    check_with_every_option(run, 2, 45, 120, 4, 2, 64, "bfloat16", seed=5,
                            window_left=60, softcap=5.0, dropout_p=0.2)


@pytest.mark.parametrize("causal", [False, True])
def test_apart_gives_the_same_bits(causal):
    # The dK and dV programs run the matmuls the joint program runs, in the same order.
    from fa_torch import _launch

    seqlen = 600 if ON_GPU else 70
    q, k, v = random_qkv(2, seqlen, seqlen + 9, 4, 2, 64, "bfloat16", seed=3)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q)
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16", causal=causal, dropout_p=0.1)
    arrays = launch_arrays(q, k, v, seed=torch.tensor([7, 0, 0, 0], dtype=torch.int32,
                                                      device=DEVICE))
    out, lse = forward_plan_torch(fa_plan.forward_plan(problem, capability=CAPABILITY), arrays)
    grads = {}
    for apart in (False, True):
        bwd = fa_plan.backward_plan(problem, capability=CAPABILITY, apart=apart,
                                    has_dlse=False)
        assert bwd.dkdv.constexprs["DKDV_PARTS"] == (2 if apart else 1)
        run = dict(arrays, out=out, lse=lse, dout=dout)
        for launch in bwd.launches:
            _launch.run(launch, run, DEVICE)
        grads[apart] = (run["dk"], run["dv"])
    assert torch.equal(grads[False][0], grads[True][0]), "dK"
    assert torch.equal(grads[False][1], grads[True][1]), "dV"
