"""Property test: random shapes and option combinations against the float64 reference."""
import os

import torch
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from .common import ON_GPU, check_against_reference, run_torch

EXAMPLES = int(os.environ.get("FA_HYPOTHESIS_EXAMPLES", 25 if ON_GPU else 12))
# On the GPU each example compiles its own kernels: split the examples into shards that
# pytest-xdist can run side by side. Each shard draws from its own fixed seed.
SHARDS = 5 if ON_GPU else 1


@st.composite
def problems(draw):
    heads_k = draw(st.sampled_from([1, 2]))
    heads_q = heads_k * draw(st.sampled_from([1, 2, 3]))
    options = dict(
        batch=draw(st.integers(1, 2)), seqlen_q=draw(st.integers(1, 90)),
        seqlen_k=draw(st.integers(1, 90)), heads_q=heads_q, heads_k=heads_k,
        head_dim=draw(st.sampled_from([16, 24, 64, 72])),
        dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])),
        causal=draw(st.booleans()),
        window_size=(draw(st.sampled_from([-1, 0, 7, 30])), draw(st.sampled_from([-1, 0, 5]))),
        softcap=draw(st.sampled_from([0.0, 3.0])),
    )
    if draw(st.booleans()):
        options["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
        options["dropout_seed"] = draw(st.integers(0, 2 ** 63))
    if draw(st.booleans()):
        options["alibi_slopes"] = torch.rand(heads_q) * 0.5
    if draw(st.booleans()):
        options["bias_shape"] = (1, heads_q, options["seqlen_q"], options["seqlen_k"])
    return options


@pytest.mark.parametrize("shard", range(SHARDS))
def test_random_problems(shard):
    from .common import DEVICE

    @seed(shard)
    @settings(max_examples=max(1, EXAMPLES // SHARDS), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(problems())
    def check(options):
        if "alibi_slopes" in options:
            options["alibi_slopes"] = options["alibi_slopes"].to(DEVICE)
        shape = [options.pop(n) for n in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_k",
                                          "head_dim", "dtype", "causal")]
        check_against_reference(run_torch, *shape, **options)

    check()
