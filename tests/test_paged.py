"""Paged K/V (block_table): k and v a pool of pages, each entry's keys on the pages its
table row names. Through flash_attn_with_kvcache / attention_with_kvcache (appending
into pages), the padded and the packed attention, both front ends; against the
references on the dense caches, and bit for bit against the same call unpaged."""
import numpy as np
import pytest
import torch

from fa_kernels import plan as fa_plan

from .common import (DEVICE, ON_GPU, assert_close_to_reference, forward_plan_jax,
                     forward_plan_torch, from_numpy, launch_arrays, random_qkv, to_numpy)
from .test_kvcache import check_kvcache, paged, unpaged
from .test_seqused import reference_used


@pytest.mark.parametrize("page_size", [1, 8, 20, 40])
def test_paged_kvcache_append_rotary_causal(front, page_size):
    # Pages smaller than, equal to and not dividing the kernels' key block.
    check_kvcache(front, page_size=page_size, rotary_dim=32, causal=True)


@pytest.mark.parametrize("case", ["decode_mqa", "window_softcap_alibi", "read_only_page_256",
                                  "whole_pages"])
def test_paged_kvcache_options(front, case):
    if case == "whole_pages":  # pages of whole key blocks: one lookup a block
        check_kvcache(front, page_size=128, seqlen_cache=384, seqlens=(0, 200, 380),
                      rotary_dim=32, causal=True)
    elif case == "decode_mqa":
        check_kvcache(front, page_size=16, seqlen_q=1, seqlen_new=1, heads_q=8, heads_k=1,
                      seqlen_cache=48, seqlens=(47, 0, 20), rotary_dim=16, interleaved=False,
                      causal=True, dtype="float16")
    elif case == "window_softcap_alibi":
        check_kvcache(front, page_size=10, window_size=(6, 0), softcap=5.0,
                      alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.05], device=DEVICE))
    else:
        check_kvcache(front, page_size=256, seqlen_cache=256, seqlen_new=0, seqlen_q=2,
                      seqlens=(256, 1, 130), dtype="float32")


def run_paged(front, q, k_pool, v_pool, table, used, **options):
    """(out, lse) of attention over a paged pool."""
    if front == "torch":
        import fa_torch

        return fa_torch.attention(q, k_pool, v_pool, block_table=table, seqused_k=used,
                                  return_lse=True, **options)
    import fa_jax

    out, lse = fa_jax.attention(*(to_numpy(x) for x in (q, k_pool, v_pool)),
                                block_table=to_numpy(table), seqused_k=to_numpy(used),
                                return_lse=True, **options)
    return from_numpy(out), from_numpy(lse)


@pytest.mark.parametrize("causal", [False, True])
def test_paged_attention_same_bits_as_dense(front, causal):
    q, k, v = random_qkv(3, 5, 48, 4, 2, 32, "bfloat16", seed=1)
    used = torch.tensor([48, 17, 0], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    (k_pool, table), (v_pool, _) = paged(k, 12, gen), paged(v, 12, torch.Generator().manual_seed(2))
    out, lse = run_paged(front, q, k_pool, v_pool, table, used, causal=causal)
    import fa_torch

    dense = fa_torch.attention(q, k, v, seqused_k=used, causal=causal, return_lse=True)
    assert torch.equal(out.cpu(), dense[0].cpu()) and torch.equal(lse.cpu(), dense[1].cpu())
    t_out, t_lse, _ = reference_used(q, k, v, used.cpu(), torch.zeros_like(q), torch.float64,
                                     causal=causal)
    f_out, f_lse, _ = reference_used(q, k, v, used.cpu(), torch.zeros_like(q), q.dtype,
                                     causal=causal)
    assert_close_to_reference("out", out, t_out, f_out, "bfloat16")
    assert_close_to_reference("lse", lse, t_lse, f_lse, "bfloat16")


@pytest.mark.parametrize("causal", [False, True])
def test_paged_varlen_against_reference(front, causal):
    from .test_varlen import packed, reference_varlen

    lengths_q, lengths_k = [3, 1, 9], [30, 0, 41]
    q, k, v, cu_q, cu_k, _ = packed(lengths_q, lengths_k, 4, 2, 32, "bfloat16", seed=3)
    page_size, per_entry = 7, 6  # 42 rows an entry
    dense_k, dense_v = (torch.zeros(3, page_size * per_entry, 2, 32, dtype=k.dtype, device=DEVICE)
                        for _ in range(2))
    for b, (start, n) in enumerate(zip(cu_k[:-1].tolist(), lengths_k)):
        dense_k[b, :n], dense_v[b, :n] = k[start:start + n], v[start:start + n]
    (k_pool, table), (v_pool, _) = (paged(c, page_size, torch.Generator().manual_seed(4))
                                    for c in (dense_k, dense_v))
    if front == "torch":
        import fa_torch

        out = fa_torch.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 9, 41,
                                              causal=causal, block_table=table)
    else:
        import fa_jax

        out = from_numpy(fa_jax.attention_varlen(
            *(to_numpy(x) for x in (q, k_pool, v_pool, cu_q, cu_k)), 9, 41, causal=causal,
            block_table=to_numpy(table)))
    zeros = torch.zeros_like(q)
    truth = reference_varlen(q, k, v, cu_q, cu_k, zeros, torch.float64, causal=causal)
    plain = reference_varlen(q, k, v, cu_q, cu_k, zeros, q.dtype, causal=causal)
    assert_close_to_reference("out", out, truth[0], plain[0], "bfloat16")


@pytest.mark.parametrize("front_name", ["torch", "jax"])
def test_paged_with_split_kv(front_name):
    batch, seqlen_k = 2, 192 if not ON_GPU else 4096
    q, k, v = random_qkv(batch, 1, seqlen_k, 8, 2, 64, "bfloat16", seed=5)
    used = torch.tensor([seqlen_k - 5, 40], dtype=torch.int32, device=DEVICE)
    (k_pool, table), (v_pool, _) = (paged(c, 16, torch.Generator().manual_seed(6))
                                    for c in (k, v))
    problem = fa_plan.check_problem(q.shape, k_pool.shape, v_pool.shape, "bfloat16", "bfloat16",
                                    "bfloat16", seqused_k_shape=(batch,), seqused_k_dtype="int32",
                                    block_table_shape=tuple(table.shape),
                                    block_table_dtype="int32")
    capability = torch.cuda.get_device_capability() if ON_GPU else None
    fwd = fa_plan.forward_plan(problem, capability=capability, num_splits=3)
    assert fwd.num_splits == 3 and fwd.launch.constexprs["PAGED_KV"]
    runner = forward_plan_torch if front_name == "torch" else forward_plan_jax
    out, lse = runner(fwd, launch_arrays(q, k_pool, v_pool, seqused_k=used, block_table=table))
    t_out, t_lse, _ = reference_used(q, k, v, used.cpu(), torch.zeros_like(q), torch.float64)
    f_out, f_lse, _ = reference_used(q, k, v, used.cpu(), torch.zeros_like(q), q.dtype)
    assert_close_to_reference("out", out, t_out, f_out, "bfloat16")
    assert_close_to_reference("lse", lse, t_lse, f_lse, "bfloat16")


def test_paged_traced_table_is_clamped_and_jitted_cache_aliased():
    import jax
    import jax.numpy as jnp

    import fa_jax

    q, k, v = random_qkv(2, 1, 32, 4, 2, 32, "float32", seed=7)
    (k_pool, table), (v_pool, _) = (paged(c, 8, torch.Generator().manual_seed(8))
                                    for c in (k, v))
    qn, kn, vn, tn = (to_numpy(x) for x in (q, k_pool, v_pool, table))
    used = np.array([32, 9], np.int32)
    step = jax.jit(lambda q, kp, vp, t: fa_jax.attention(q, kp, vp, block_table=t,
                                                         seqused_k=used))
    bad = tn.copy()
    bad[0, 1], bad[1, 0] = 10_000, -5  # outside the pool: read as its last and first page
    clipped = np.clip(bad, 0, kn.shape[0] - 1)
    np.testing.assert_array_equal(np.asarray(step(qn, kn, vn, bad)),
                                  np.asarray(fa_jax.attention(qn, kn, vn, block_table=clipped,
                                                              seqused_k=used)))
    # Appending under jit with donated pools: the lowered module updates them in place.
    new = np.ones((2, 1, 2, 32), np.float32)
    append = jax.jit(lambda q, kp, vp, n: fa_jax.attention_with_kvcache(
        q, kp, vp, new, new, cache_seqlens=n, block_table=tn), donate_argnums=(1, 2))
    lowered = append.lower(qn, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray([4, 31], jnp.int32))
    assert "tf.aliasing_output" in lowered.as_text()


def test_paged_same_bits_in_both_front_ends():
    import fa_jax
    import fa_torch

    q, k, v = random_qkv(2, 3, 40, 4, 1, 32, "float16", seed=9)
    (k_pool, table), (v_pool, _) = (paged(c, 5, torch.Generator().manual_seed(10))
                                    for c in (k, v))
    new_k, new_v = (torch.randn(2, 3, 1, 32, generator=torch.Generator().manual_seed(s))
                    .to(q) for s in (11, 12))
    seqlens = torch.tensor([7, 37], dtype=torch.int32, device=DEVICE)
    k_torch, v_torch = k_pool.clone(), v_pool.clone()
    out = fa_torch.flash_attn_with_kvcache(q, k_torch, v_torch, new_k, new_v,
                                           cache_seqlens=seqlens, block_table=table, causal=True)
    j_out, j_k, j_v = fa_jax.attention_with_kvcache(
        *(to_numpy(x) for x in (q, k_pool, v_pool, new_k, new_v)),
        cache_seqlens=to_numpy(seqlens), block_table=to_numpy(table), causal=True)
    assert torch.equal(out.cpu(), from_numpy(j_out))
    assert np.array_equal(to_numpy(k_torch), np.asarray(j_k), equal_nan=True)
    assert np.array_equal(to_numpy(v_torch), np.asarray(j_v), equal_nan=True)
    assert torch.equal(unpaged(k_torch, table)[1, 37:40].to(q.device), new_k[1])


def test_paged_plan_reads_through_pointers_and_has_no_backward():
    problem = fa_plan.check_problem((2, 64, 4, 128), (40, 64, 2, 128), (40, 64, 2, 128),
                                    "bfloat16", "bfloat16", "bfloat16", causal=True,
                                    block_table_shape=(2, 10), block_table_dtype="int32")
    assert (problem.seqlen_k, problem.num_pages, problem.page_size) == (640, 40, 64)
    fwd = fa_plan.forward_plan(problem, capability=(9, 0), tma=True)
    assert fwd.launch.constexprs["PAGED_KV"] and not fwd.launch.constexprs["USE_TMA"]
    block_n = fwd.launch.constexprs["BLOCK_N"]
    assert fwd.launch.constexprs["WHOLE_PAGES"] == (64 % block_n == 0)
    assert fwd.launch.scalars["stride_kb"] == 64 * 2 * 128  # the page stride
    with pytest.raises(NotImplementedError, match="forward-only"):
        fa_plan.backward_plan(problem, capability=(9, 0))


def test_paged_gradient_is_refused():
    import fa_torch

    q, k, v = random_qkv(1, 2, 16, 2, 2, 16, "float32")
    (k_pool, table), (v_pool, _) = (paged(c, 8, torch.Generator().manual_seed(0))
                                    for c in (k, v))
    q.requires_grad_()
    out = fa_torch.attention(q, k_pool, v_pool, block_table=table)
    with pytest.raises(NotImplementedError, match="forward-only"):
        out.sum().backward()


@pytest.mark.parametrize("change, error, match", [
    (dict(dtype=torch.int64), TypeError, r"block_table must be int32; got int64"),
    (dict(shape=(3, 2)), ValueError, r"block_table must have shape \(batch, pages_per_entry\)"),
    (dict(page=9), ValueError, r"block_table\[1, 0\] = 9 is outside the pool of 6 pages"),
    (dict(kv_rank=3), ValueError, r"k must have 4 dimensions \(num_pages, page_size"),
    (dict(max_seqlen_k=17), ValueError, r"max_seqlen_k \(17\) is more keys than block_table's "
                                        r"2 pages of 8 rows"),
])
def test_paged_bad_input(front, change, error, match):
    q, _, _ = random_qkv(2, 3, 8, 2, 2, 16, "float32")
    pool = torch.randn(6, 8, 2, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=change.get("dtype", torch.int32))
    if "shape" in change:
        table = torch.zeros(change["shape"], dtype=torch.int32)
    if "page" in change:
        table[1, 0] = change["page"]
    if "kv_rank" in change:
        pool = pool[0]
    options = dict(block_table=table.to(DEVICE))
    if front == "torch":
        import fa_torch

        if ON_GPU and "page" in change:
            pytest.skip("a table on the GPU is clamped by the kernels: checking needs a sync")
        with pytest.raises(error, match=match):
            if "max_seqlen_k" in change:
                cu = torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE)
                fa_torch.attention_varlen(q.reshape(6, 2, 16), pool, pool, cu, cu, 3,
                                          change["max_seqlen_k"], **options)
            else:
                fa_torch.attention(q, pool, pool, **options)
    else:
        import fa_jax

        options = {n: to_numpy(x) for n, x in options.items()}
        with pytest.raises(error, match=match):
            if "max_seqlen_k" in change:
                cu = np.array([0, 3, 6], np.int32)
                fa_jax.attention_varlen(to_numpy(q).reshape(6, 2, 16), to_numpy(pool),
                                        to_numpy(pool), cu, cu, 3, change["max_seqlen_k"],
                                        **options)
            else:
                fa_jax.attention(to_numpy(q), to_numpy(pool), to_numpy(pool), **options)


@pytest.mark.skipif(not ON_GPU, reason="a table on the host is checked, not clamped")
def test_paged_device_table_is_clamped():
    import fa_torch

    q, k, v = random_qkv(2, 1, 64, 8, 2, 64, "bfloat16", seed=13)
    (k_pool, table), (v_pool, _) = (paged(c, 16, torch.Generator().manual_seed(14), spare=0)
                                    for c in (k, v))
    bad = table.clone()
    bad[0, 2], bad[1, 0] = 1 << 30, -7  # outside the pool: read as its last and first page
    used = torch.tensor([64, 50], dtype=torch.int32, device=DEVICE)
    out = fa_torch.attention(q, k_pool, v_pool, block_table=bad, seqused_k=used)
    clipped = bad.clamp(0, k_pool.shape[0] - 1)
    assert torch.equal(out, fa_torch.attention(q, k_pool, v_pool, block_table=clipped,
                                               seqused_k=used))


@pytest.mark.parametrize("append", [False, True], ids=["read_only", "append"])
def test_paged_cache_lengths_past_the_block_table_are_refused(front, append):
    # As flash-attn (its issue 2709): cache_seqlens (+ the new rows) past the rows the
    # table's columns address raise, a RuntimeError naming block_table (and a ValueError),
    # also for lengths on the GPU; exactly at capacity runs.
    q = torch.randn(1, 1, 1, 64, device=DEVICE)
    pool = torch.randn(4, 16, 1, 64, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    new = dict(k=torch.randn(1, 1, 1, 64, device=DEVICE),
               v=torch.randn(1, 1, 1, 64, device=DEVICE)) if append else {}
    over = torch.full((1,), 16 if append else 17, dtype=torch.int32, device=DEVICE)
    full = torch.full((1,), 16, dtype=torch.int32, device=DEVICE)
    if front == "torch":
        import fa_torch

        call = fa_torch.flash_attn_with_kvcache
        convert = lambda x: x  # noqa: E731
    else:
        import fa_jax

        def call(q, k_cache, v_cache, **options):
            return fa_jax.attention_with_kvcache(q, k_cache, v_cache, **options)[0]
        convert = to_numpy
    with pytest.raises(RuntimeError, match="block_table") as raised:
        call(convert(q), convert(pool), convert(pool), cache_seqlens=convert(over),
             block_table=convert(table), **{n: convert(x) for n, x in new.items()})
    assert isinstance(raised.value, ValueError)
    out = call(convert(q), convert(pool), convert(pool), cache_seqlens=convert(full),
               block_table=convert(table))
    want = torch.softmax(q[0, 0, 0] @ pool[0, :, 0].T / 8.0, -1) @ pool[0, :, 0]
    out = to_numpy(out) if front == "torch" else np.asarray(out)
    np.testing.assert_allclose(out[0, 0, 0], to_numpy(want), atol=1e-5, rtol=1e-5)
