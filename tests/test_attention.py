"""Forward, LSE and all three gradients against the float64 reference, both front ends.

Each grid holds one axis wide and the others small, so the CPU interpreter gets
through them in CI; the ``large`` grid (GPU only) is the full product at real sizes.
"""
import itertools

import pytest

from .common import check_against_reference

DTYPES = ["float16", "bfloat16", "float32"]
HEAD_DIMS = [32, 40, 64, 80, 96, 128, 200, 256]
# (seqlen_q, seqlen_k): odd lengths, Sq != Sk both ways, single rows, Sq > Sk causal
# (rows that see no key at all).
SEQLENS = [(1, 1), (1, 113), (17, 17), (113, 70), (70, 113), (257, 129)]
HEADS = [(4, 4), (4, 2), (6, 1)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlens(run, dtype, seqlens, causal):
    check_against_reference(run, 2, *seqlens, 4, 2, 64, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(run, dtype, head_dim, causal):
    check_against_reference(run, 1, 47, 33, 2, 1, head_dim, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}k")
def test_gqa(run, heads, causal):
    check_against_reference(run, 2, 65, 80, *heads, 32, "bfloat16", causal)


@pytest.mark.parametrize("causal", [False, True])
def test_running_max_growing_along_the_keys(run, causal):
    # Scores that grow key block by key block: the running max rises by more than 2^8
    # between blocks, and what was accumulated must be rescaled each time.
    check_against_reference(run, 1, 64, 512, 2, 2, 32, "bfloat16", causal,
                            softmax_scale=1.0, key_ramp=3.0)


@pytest.mark.parametrize("softmax_scale", [-0.3, 0.0, 0.05, 1.0])
def test_softmax_scale(run, softmax_scale):
    check_against_reference(run, 1, 33, 40, 2, 2, 32, "float16", True,
                            softmax_scale=softmax_scale)


@pytest.mark.large
@pytest.mark.parametrize("dtype,causal,head_dim,seqlens", list(itertools.product(
    DTYPES, [False, True], [40, 64, 128, 256], [(1023, 512), (2048, 2048)])))
def test_full_grid(run, dtype, causal, head_dim, seqlens):
    check_against_reference(run, 2, *seqlens, 8, 2, head_dim, dtype, causal)
