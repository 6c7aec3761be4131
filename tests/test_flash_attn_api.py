"""fa_torch's flash-attn aliases: flash-attn's names, argument order and returns."""
import torch

import fa_torch

from .common import DEVICE, random_qkv


def test_flash_attn_func_is_attention():
    q, k, v = random_qkv(2, 40, 50, 4, 2, 32, "float16")
    gen_args = dict(softmax_scale=0.2, causal=True, window_size=(9, -1), softcap=4.0)
    out = fa_torch.flash_attn_func(q, k, v, 0.0, 0.2, True, (9, -1), 4.0)
    assert torch.equal(out, fa_torch.attention(q, k, v, **gen_args))
    out2, lse, mask = fa_torch.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert lse.shape == (2, 4, 40) and mask is None
    assert torch.equal(out2, fa_torch.attention(q, k, v, causal=True))


def _normalised(s_dmask, q, k, lse, causal, window, lengths_q=None, lengths_k=None):
    """flash-attn's tests' inverse of S_dmask: each key block's |p| times exp(m_j - lse),
    m_j the row max over that block and the later ones (float64 scores here)."""
    from fa_torch.flash_attn_interface import _get_block_size_n

    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    lengths_q = torch.full((batch,), seqlen_q) if lengths_q is None else torch.tensor(lengths_q)
    lengths_k = torch.full((batch,), seqlen_k) if lengths_k is None else torch.tensor(lengths_k)
    scores = torch.einsum("bihd,bjhd->bhij", q.double().cpu(),
                          k.double().cpu().repeat_interleave(heads // k.shape[2], 2))
    scores = scores * head_dim ** -0.5
    rows, cols = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)[None, :]
    offset = cols - rows - (lengths_k - lengths_q)[:, None, None, None]
    visible = (rows < lengths_q[:, None, None, None]) & (cols < lengths_k[:, None, None, None])
    visible &= (offset >= -window[0]) if window[0] >= 0 else True
    visible &= offset <= (0 if causal else window[1]) if causal or window[1] >= 0 else True
    visible = visible.expand(-1, heads, -1, -1)
    scores = scores.masked_fill(~visible, float("-inf"))
    width = _get_block_size_n(q.device, head_dim, True, causal)
    maxima = torch.stack([b.amax(-1) for b in scores.split(width, -1)], -1)
    running = maxima.flip(-1).cummax(-1).values.flip(-1).repeat_interleave(width, -1)
    lse = lse.double().cpu()
    probs = s_dmask.abs().double().cpu() * torch.exp(running[..., :seqlen_k] - lse[..., None])
    want = torch.where(visible, torch.exp(scores - lse[..., None]), 0.0)
    return probs.masked_fill(~visible, 0.0), want, visible


def test_attn_probs_as_flash_attn_encodes_them():
    # return_attn_probs with dropout: flash-attn's S_dmask (unnormalised per key block,
    # negative where dropped), which its tests normalise back with the LSE.
    q, k, v = random_qkv(2, 70, 150, 4, 2, 32, "float16", seed=4)
    out, lse, s_dmask = fa_torch.flash_attn_func(q, k, v, dropout_p=0.4, causal=True,
                                                 window_size=(60, -1), return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 70, 150) and s_dmask.dtype == torch.float16
    probs, want, visible = _normalised(s_dmask, q, k, lse, True, (60, -1))
    torch.testing.assert_close(probs, want, atol=2e-3, rtol=2e-2)
    dropped = (s_dmask.cpu() < 0) & visible
    assert 0.3 < dropped.sum() / visible.sum() < 0.5
    assert not ((s_dmask.cpu() != 0) & ~visible).any()


def test_varlen_attn_probs_in_the_padded_layout():
    lengths = [37, 90]
    cu = torch.tensor([0, 37, 127], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(127, 4, 16, device=DEVICE).half() for _ in range(3))
    out, lse, s_dmask = fa_torch.flash_attn_varlen_func(q, k, v, cu, cu, 90, 90, dropout_p=0.2,
                                                        return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 90, 90)
    padded = torch.zeros(2, 90, 4, 16, dtype=q.dtype, device=DEVICE)
    padded[0, :37], padded[1] = q[:37], q[37:]
    keys = torch.zeros_like(padded)
    keys[0, :37], keys[1] = k[:37], k[37:]
    lse_padded = torch.zeros(2, 4, 90, device=DEVICE)
    lse_padded[0, :, :37], lse_padded[1] = lse[:, :37], lse[:, 37:]
    probs, want, visible = _normalised(s_dmask, padded, keys, lse_padded, False, (-1, -1),
                                       lengths, lengths)
    torch.testing.assert_close(probs, want, atol=2e-3, rtol=2e-2)


def test_packed_variants():
    qkv = torch.randn(2, 33, 3, 4, 32).half().to(DEVICE)
    q, k, v = qkv.unbind(2)
    expected = fa_torch.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(fa_torch.flash_attn_qkvpacked_func(qkv, causal=True), expected)
    kv = qkv[:, :, 1:]
    assert torch.equal(fa_torch.flash_attn_kvpacked_func(q, kv, causal=True), expected)


def test_varlen_variants():
    lengths = [10, 23]
    cu = torch.tensor([0, 10, 33], dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(33, 3, 2, 16).half().to(DEVICE)
    q, k, v = qkv.unbind(1)
    expected = fa_torch.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert torch.equal(fa_torch.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True),
                       expected)
    assert torch.equal(fa_torch.flash_attn_varlen_qkvpacked_func(qkv, cu, 23, causal=True),
                       expected)
    assert torch.equal(fa_torch.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, 23, 23,
                                                                causal=True), expected)
