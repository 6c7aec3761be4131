"""The padding helpers flash-attn's tests use, written for fa_torch's runs of them."""
import torch


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(tokens where the mask is set, their flat indices, cu_seqlens, max length, used
    lengths): hidden_states (batch, seqlen, ...) packed to (total, ...)."""
    present = attention_mask if unused_mask is None else attention_mask + unused_mask
    lengths = present.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(present.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return (flat[indices], indices, cu_seqlens, int(lengths.max()),
            attention_mask.sum(-1, dtype=torch.int32))


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse: (total, ...) rows back to (batch, seqlen, ...), zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
