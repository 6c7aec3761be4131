"""flash-attn's rotary helper as its tests call it (the reference side of the kvcache test)."""
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """x (batch, seqlen, heads, dim): the first 2 * cos.shape[1] channels of row i rotated
    by the angles of position i + seqlen_offsets (an int or (batch,)), in fp32."""
    if cu_seqlens is not None:
        raise NotImplementedError("this helper covers the padded layout only")
    batch, seqlen = x.shape[:2]
    offsets = seqlen_offsets[:, None] if torch.is_tensor(seqlen_offsets) else seqlen_offsets
    positions = (torch.arange(seqlen, device=x.device)[None, :] + offsets).expand(batch, seqlen)
    c, s = (t[positions][:, :, None, :].float() for t in (cos, sin))
    rotary_dim = 2 * cos.shape[1]
    part = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
    else:
        x1, x2 = part.chunk(2, -1)
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], -1)
