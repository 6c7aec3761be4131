"""flash_attn_with_kvcache (fa_torch) and attention_with_kvcache (fa_jax): new k/v
written into the cache at cache_seqlens, rotary on q and the new k, attention over each
entry's filled rows; against a reference built from flash-attn's documented semantics
(rotary through complex numbers, the attention per entry in float64)."""
import re

import numpy as np
import pytest
import torch

from .common import DEVICE, TORCH_DTYPES, assert_close_to_reference, from_numpy, to_numpy
from .reference import attention_reference


def rotate_reference(x, angles, interleaved):
    """x (B, S, H, D), angles (B, S, rotary_dim / 2): channel pairs as complex numbers."""
    dim = 2 * angles.shape[-1]
    part = x[..., :dim].double()
    if interleaved:
        z = torch.complex(part[..., 0::2], part[..., 1::2])
    else:
        z = torch.complex(part[..., :dim // 2], part[..., dim // 2:])
    z = z * torch.polar(torch.ones_like(angles), angles)[:, :, None, :]
    out = (torch.stack([z.real, z.imag], -1).flatten(-2) if interleaved
           else torch.cat([z.real, z.imag], -1))
    return torch.cat([out.to(x.dtype), x[..., dim:]], dim=-1)


def reference(q, k_cache, v_cache, k, v, angles, cache_seqlens, batch_idx, leftpad, interleaved,
              compute_dtype, **options):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, seqlen_q = q.shape[:2]
    rows = list(range(batch)) if batch_idx is None else batch_idx.tolist()
    seqlens = cache_seqlens.tolist()
    new = 0 if k is None else k.shape[1]
    per_row = options.get("causal") or options.get("window_size", (-1, -1)) != (-1, -1)
    if angles is not None:
        at = lambda pos: angles[pos]  # noqa: E731
        positions = torch.tensor(seqlens)[:, None] + torch.arange(max(new, 1))
        if new:
            k = rotate_reference(k, at(positions[:, :new]), interleaved)
        q_pos = (torch.tensor(seqlens)[:, None] + torch.arange(seqlen_q) if per_row
                 else torch.tensor(seqlens)[:, None].expand(batch, seqlen_q))
        q = rotate_reference(q, at(q_pos), interleaved)
    for b, row in enumerate(rows):
        if new:
            k_cache[row, seqlens[b]:seqlens[b] + new] = k[b]
            v_cache[row, seqlens[b]:seqlens[b] + new] = v[b]
    outs, lses = [], []
    pads = [0] * batch if leftpad is None else leftpad.tolist()
    for b, row in enumerate(rows):  # keys [leftpad, cache_seqlens + new): positions from leftpad
        first, used = pads[b], seqlens[b] + new
        out, lse = attention_reference(q[b:b + 1], k_cache[row:row + 1, first:used],
                                       v_cache[row:row + 1, first:used],
                                       compute_dtype=compute_dtype, **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache


def run_kvcache(front, q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, batch_idx,
                leftpad=None, **options):
    """(out, lse, k_cache, v_cache) after the call (fa_torch updates its copies in place)."""
    if front == "torch":
        import fa_torch

        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        out, lse = fa_torch.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
            return_softmax_lse=True, **options)
        return out, lse, k_cache, v_cache
    import fa_jax

    arr = lambda x: None if x is None else to_numpy(x)  # noqa: E731
    options = {n: arr(x) if isinstance(x, torch.Tensor) else x for n, x in options.items()}
    results = fa_jax.attention_with_kvcache(
        arr(q), arr(k_cache), arr(v_cache), arr(k), arr(v), rotary_cos=arr(cos),
        rotary_sin=arr(sin), cache_seqlens=arr(cache_seqlens), cache_batch_idx=arr(batch_idx),
        cache_leftpad=arr(leftpad), return_softmax_lse=True, **options)
    return tuple(from_numpy(x) for x in results)


def paged(cache, page_size, gen, spare=3):
    """A (batch, seqlen, H, D) cache as a pool of pages in random order, with ``spare``
    pages of NaN that no entry owns: (pool, block_table)."""
    batch, seqlen = cache.shape[:2]
    per_entry = seqlen // page_size
    num_pages = batch * per_entry + spare
    table = torch.randperm(num_pages, generator=gen)[:batch * per_entry].reshape(batch, per_entry)
    pool = torch.full((num_pages, page_size, *cache.shape[2:]), float("nan"), dtype=cache.dtype)
    pool[table] = cache.cpu().reshape(batch, per_entry, page_size, *cache.shape[2:])
    return pool.to(cache.device), table.to(torch.int32).to(cache.device)


def unpaged(pool, table):
    """The dense (batch, pages_per_entry * page_size, H, D) cache a pool holds."""
    pages = pool.cpu()[table.cpu().long()]
    return pages.reshape(table.shape[0], -1, *pool.shape[2:])


def check_kvcache(front, *, batch=3, seqlen_q=4, seqlen_new=4, heads_q=4, heads_k=2,
                  head_dim=32, seqlen_cache=40, rotary_dim=0, interleaved=True,
                  batch_cache=None, dtype="bfloat16", seqlens=(0, 13, 36), leftpad=None, seed=0,
                  page_size=0, **options):
    """The call against the reference; with ``page_size`` through a paged copy of the
    caches (whose unowned pages hold NaN and must stay so)."""
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen).to(TORCH_DTYPES[dtype]).to(DEVICE)  # noqa: E731
    batch_cache = batch_cache or batch
    q = make(batch, seqlen_q, heads_q, head_dim)
    k_cache, v_cache = (make(batch_cache, seqlen_cache, heads_k, head_dim) for _ in range(2))
    k = v = None
    if seqlen_new:
        k, v = (make(batch, seqlen_new, heads_k, head_dim) for _ in range(2))
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    batch_idx = None
    if batch_cache != batch:
        batch_idx = torch.randperm(batch_cache, generator=gen)[:batch].to(torch.int32).to(DEVICE)
    pads = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device=DEVICE)
    cos = sin = angles = None
    if rotary_dim:
        angles = torch.rand(seqlen_cache, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6
        cos, sin = (f(angles).float().to(DEVICE) for f in (torch.cos, torch.sin))
    if page_size:
        (k_pool, table), (v_pool, _) = (paged(c, page_size, torch.Generator().manual_seed(seed))
                                        for c in (k_cache, v_cache))
        out, lse, k_pool, v_pool = run_kvcache(
            front, q, k_pool, v_pool, k, v, cos, sin, cache_seqlens, batch_idx, pads,
            rotary_interleaved=interleaved, block_table=table, **dict(options))
        owned = torch.zeros(k_pool.shape[0], dtype=torch.bool)
        owned[table.cpu().long().flatten()] = True
        assert k_pool.cpu()[~owned].isnan().all() and v_pool.cpu()[~owned].isnan().all()
        new_k_cache, new_v_cache = unpaged(k_pool, table), unpaged(v_pool, table)
    else:
        out, lse, new_k_cache, new_v_cache = run_kvcache(
            front, q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, batch_idx, pads,
            rotary_interleaved=interleaved, **dict(options))
    cpu = lambda x: None if x is None else x.cpu()  # noqa: E731
    ref_options = {n: cpu(x) if isinstance(x, torch.Tensor) else x for n, x in options.items()}
    args = (cpu(q), cpu(k_cache), cpu(v_cache), cpu(k), cpu(v), angles, cache_seqlens.cpu(),
            cpu(batch_idx), cpu(pads), interleaved)
    t_out, t_lse, t_k, t_v = reference(*args, torch.float64, **ref_options)
    f_out, f_lse, _, _ = reference(*args, q.dtype, **ref_options)
    assert_close_to_reference("out", out, t_out, f_out, dtype)
    assert_close_to_reference("lse", lse, t_lse, f_lse, dtype)
    # The new rows (rotated in fp32 here, in float64 there: one rounding apart) and nothing else.
    torch.testing.assert_close(new_k_cache.cpu(), t_k, atol=2e-2, rtol=1e-2)
    assert torch.equal(new_v_cache.cpu(), t_v)
    untouched = torch.ones(new_k_cache.shape[:2], dtype=torch.bool)
    for b, row in enumerate(range(batch) if batch_idx is None else batch_idx.tolist()):
        untouched[row, seqlens[b]:seqlens[b] + seqlen_new] = False
    assert torch.equal(new_k_cache.cpu()[untouched], k_cache.cpu()[untouched])


@pytest.mark.parametrize("rotary", ["none", "interleaved", "neox", "partial"])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_append_and_rotary(front, rotary, causal):
    check_kvcache(front, causal=causal, rotary_dim=0 if rotary == "none" else
                  (16 if rotary == "partial" else 32), interleaved=rotary != "neox")


@pytest.mark.parametrize("case", ["read_only", "batch_idx", "window_softcap_alibi", "mqa_decode",
                                  "leftpad", "leftpad_batch_idx_alibi"])
def test_kvcache_options(front, case):
    if case == "read_only":  # no new rows: attention over the filled rows only
        check_kvcache(front, seqlen_new=0, seqlens=(40, 1, 17), causal=True, dtype="float16")
    elif case == "batch_idx":  # a cache of 5 entries, 3 of them in this batch
        check_kvcache(front, batch_cache=5, rotary_dim=32, causal=True)
    elif case == "window_softcap_alibi":
        check_kvcache(front, window_size=(6, 0), softcap=5.0, rotary_dim=32,
                      alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.05], device=DEVICE))
    elif case == "mqa_decode":  # one query row, one new row, one K/V head
        check_kvcache(front, seqlen_q=1, seqlen_new=1, heads_q=8, heads_k=1, seqlens=(39, 0, 5),
                      rotary_dim=16, interleaved=False, causal=True, dtype="float32")
    elif case == "leftpad":  # keys from row cache_leftpad[b]; rotary positions stay absolute
        check_kvcache(front, leftpad=(0, 9, 30), rotary_dim=32, causal=True)
    else:
        check_kvcache(front, batch_cache=5, leftpad=(0, 13, 2), seqlen_new=0,
                      seqlens=(17, 13, 40), alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.05],
                                                                      device=DEVICE))


def test_kvcache_same_bits_in_both_front_ends():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 4, 32, generator=gen).to(DEVICE) for _ in range(3))
    k, v = k[:, :2, :2], v[:, :2, :2]
    k_cache, v_cache = (torch.randn(2, 30, 2, 32, generator=gen).to(DEVICE) for _ in range(2))
    cos, sin = (f(torch.rand(30, 16, generator=gen)).to(DEVICE) for f in (torch.cos, torch.sin))
    seqlens = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    torch_result = run_kvcache("torch", q, k_cache, v_cache, k, v, cos, sin, seqlens, None,
                               causal=True)
    jax_result = run_kvcache("jax", q, k_cache, v_cache, k, v, cos, sin, seqlens, None,
                             causal=True)
    for a, b in zip(torch_result, jax_result):
        assert torch.equal(a.cpu(), b)


def test_kvcache_jitted_with_donated_caches_and_traced_lengths():
    import jax
    import jax.numpy as jnp

    import fa_jax

    gen = np.random.default_rng(4)
    q = jnp.asarray(gen.standard_normal((2, 1, 4, 32)), jnp.float32)
    k_cache = jnp.asarray(gen.standard_normal((2, 24, 2, 32)), jnp.float32)
    v_cache = jnp.asarray(gen.standard_normal((2, 24, 2, 32)), jnp.float32)
    k = jnp.asarray(gen.standard_normal((2, 1, 2, 32)), jnp.float32)
    v = jnp.asarray(gen.standard_normal((2, 1, 2, 32)), jnp.float32)
    step = jax.jit(lambda q, kc, vc, k, v, n: fa_jax.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=n, causal=True), donate_argnums=(1, 2))
    eager = fa_jax.attention_with_kvcache(q, k_cache, v_cache, k, v,
                                          cache_seqlens=np.array([3, 23], np.int32), causal=True)
    lowered = step.lower(q, k_cache, v_cache, k, v, jnp.asarray([3, 23], jnp.int32))
    assert "tf.aliasing_output" in lowered.as_text()  # the caches are updated in place
    # ...and compiled so: both cache outputs alias their inputs, and no instruction copies a
    # cache (XLA inserts one where it cannot update in place).
    compiled = lowered.compile().as_text()
    aliases = re.search(r"input_output_alias=\{([^\n]*)\}", compiled)
    assert aliases and "{1}: (1," in aliases.group(1) and "{2}: (2," in aliases.group(1)
    cache = "f32[2,24,2,32]"
    copies = [line for line in compiled.splitlines()
              if re.search(r"= " + re.escape(cache) + r"\S* copy(-start)?\(", line)]
    assert not copies, copies
    out = step(q, jnp.array(k_cache), jnp.array(v_cache), k, v, jnp.asarray([3, 23], jnp.int32))
    for a, b in zip(out, eager):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A traced length past the cache is clamped: the new row lands in the last one.
    clamped = step(q, jnp.array(k_cache), jnp.array(v_cache), k, v,
                   jnp.asarray([3, 99], jnp.int32))
    np.testing.assert_array_equal(np.asarray(clamped[1][1, 23]), np.asarray(k[1, 0]))
    np.testing.assert_array_equal(np.asarray(clamped[1][1, :23]), np.asarray(k_cache[1, :23]))


@pytest.mark.parametrize("change, error, match", [
    (dict(cache_seqlens=[0, 38, 2]), ValueError, r"cache_seqlens\[1\] = 38: with 4 new rows"),
    (dict(cache_seqlens="int64"), TypeError, r"cache_seqlens must be an int or an int32"),
    (dict(k_shape=(3, 4, 4, 32)), ValueError, r"k and v must have shape"),
    (dict(rotary_rows=10, cache_seqlens=[0, 1, 8]), ValueError,
     r"rotary_cos/rotary_sin have 10 positions; cache_seqlens\[2\] = 8 needs 12"),
    (dict(no_v=True), ValueError, r"pass both or neither"),
    (dict(block_table=True), ValueError, r"cache_leftpad cannot be used with block_table"),
    (dict(leftpad=[0, 2, 1]), ValueError, r"cache_leftpad\[1\] = 2 must be in \[0, cache_seqlens\[1\] = 1\]"),
])
def test_kvcache_bad_input(front, change, error, match):
    q = torch.randn(3, 4, 4, 32, device=DEVICE)
    k_cache = v_cache = torch.randn(3, 40, 2, 32, device=DEVICE)
    k = torch.randn(*change.get("k_shape", (3, 4, 2, 32)), device=DEVICE)
    v = None if change.get("no_v") else torch.randn(3, 4, 2, 32, device=DEVICE)
    seqlens = change.get("cache_seqlens", [0, 1, 2])  # on the host: checked
    seqlens = (torch.tensor([0, 1, 2], dtype=torch.int64) if seqlens == "int64"
               else torch.tensor(seqlens, dtype=torch.int32))
    cos = sin = torch.rand(change.get("rotary_rows", 40), 8, device=DEVICE)
    options = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=True)
    if "leftpad" in change:
        options["cache_leftpad"] = torch.tensor(change["leftpad"], dtype=torch.int32)
    if change.get("block_table"):
        options["block_table"] = torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)
        options["cache_leftpad"] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(error, match=match):
        if front == "torch":
            import fa_torch

            fa_torch.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **options)
        else:
            import fa_jax

            arr = lambda x: x if x is None else to_numpy(x)  # noqa: E731
            fa_jax.attention_with_kvcache(arr(q), arr(k_cache), arr(v_cache), arr(k), arr(v),
                                          **{n: arr(x) if isinstance(x, torch.Tensor) else x
                                             for n, x in options.items()})
