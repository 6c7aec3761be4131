"""transformers models with attn_implementation="fa_torch" against transformers' own
attention (sdpa; eager for Gemma-2, whose softcap sdpa refuses): tiny random models built
from config classes (no downloads), fp32, no padding, right padding and left padding;
logits at the real tokens, every parameter's gradient, and greedy generation."""
import pytest
import torch

from .common import DEVICE, ON_GPU

transformers = pytest.importorskip("transformers")

import fa_torch.transformers as fa_transformers  # noqa: E402


def _configs():
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attention_dropout=0.0)
    return {
        "llama": (transformers.LlamaConfig(**common), "sdpa"),
        "mistral": (transformers.MistralConfig(**common, sliding_window=5), "sdpa"),
        "qwen2": (transformers.Qwen2Config(**common), "sdpa"),
        "gemma2": (transformers.Gemma2Config(**common, head_dim=16, sliding_window=5,
                                             attn_logit_softcapping=20.0,
                                             final_logit_softcapping=None,
                                             query_pre_attn_scalar=24), "eager"),
    }


def _model(name, implementation):
    config, _ = _configs()[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation=implementation)
    return model.to(DEVICE).float()


def _batch(padding, batch=2, seqlen=12):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    if padding == "right":
        mask[1, -5:] = 0
    elif padding == "left":
        mask[1, :5] = 0
    elif padding == "gap":  # real tokens with a hole: no contiguous span to pack
        mask[1, 4:7] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert fa_transformers.register() == "fa_torch"


@pytest.mark.parametrize("padding", ["none", "right", "left", "gap"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2"])
def test_logits_and_gradients_match(name, padding):
    ids, mask = _batch(padding)
    real = mask.bool()
    results = {}
    for implementation in ("fa_torch", _configs()[name][1]):
        model = _model(name, implementation).train()  # (attention dropout is 0)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = (logits.float().log_softmax(-1)[real].square().mean())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[implementation] = (logits[real].detach(), grads)
    (ours, our_grads), (theirs, their_grads) = results.values()
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert our_grads.keys() == their_grads.keys()
    for n in our_grads:
        torch.testing.assert_close(our_grads[n], their_grads[n], atol=2e-5, rtol=1e-3, msg=n)


def test_padding_reaches_the_kernels_as_lengths():
    # Causal and sliding-window causal masks come as the 2-D padding mask (packed through
    # attention_varlen: no (B, 1, Sq, Sk) mask), None without padding; any other mask
    # function is transformers' sdpa mask.
    from transformers.masking_utils import (and_masks, causal_mask_function,
                                            sliding_window_causal_mask_function)

    _, mask = _batch("left")
    mask = mask.bool()
    common = dict(batch_size=2, q_length=12, kv_length=12, attention_mask=mask, device=DEVICE)
    interface = transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["fa_torch"]
    got = interface(mask_function=causal_mask_function, **common)
    assert got.shape == (2, 12) and torch.equal(got, mask)
    got = interface(mask_function=sliding_window_causal_mask_function(5), local_size=5, **common)
    assert got.shape == (2, 12)
    assert interface(mask_function=causal_mask_function,
                     **dict(common, attention_mask=torch.ones_like(mask))) is None
    overlay = and_masks(causal_mask_function, lambda b, h, q, kv: kv % 2 == 0)
    assert interface(mask_function=overlay, **common).shape == (2, 1, 12, 12)
    # a sliding window other than the one the interface is told of is not taken for it
    other = interface(mask_function=sliding_window_causal_mask_function(4), local_size=5,
                      **common)
    assert other.shape == (2, 1, 12, 12)


def _packed_positions(lengths_per_row, seqlen=12):
    """position_ids restarting at each packed sequence, as DataCollatorWithFlattening
    makes them (no attention mask)."""
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row]
    assert all(len(r) == seqlen for r in rows)
    return torch.stack(rows).to(DEVICE)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2"])
def test_packed_sequences_match_and_run_as_varlen(name, monkeypatch):
    # Two rows of packed sequences (one a single sequence): transformers builds a
    # block-causal mask from position_ids; fa_torch reads the sequences off it and runs
    # attention_varlen (once per layer), with sdpa's / eager's logits and gradients.
    # (transformers looks for packing only without a cache: use_cache=False, as in training.)
    ids, _ = _batch("none")
    positions = _packed_positions([[5, 4, 3], [12]])
    calls = []
    varlen = fa_transformers.attention_varlen
    monkeypatch.setattr(fa_transformers, "attention_varlen",
                        lambda *a, **o: calls.append(a[3].tolist()) or varlen(*a, **o))
    results = {}
    for implementation in ("fa_torch", _configs()[name][1]):
        model = _model(name, implementation).train()
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        logits.float().log_softmax(-1).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[implementation] = (logits.detach(), grads)
    assert calls == [[0, 5, 9, 12, 24]] * _configs()[name][0].num_hidden_layers
    (ours, our_grads), (theirs, their_grads) = results.values()
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    for n in our_grads:
        torch.testing.assert_close(our_grads[n], their_grads[n], atol=2e-5, rtol=1e-3, msg=n)


@pytest.mark.parametrize("check_elements", [1 << 26, 16])  # one slab, or a row or two a slab
def test_packed_sequences_are_read_only_off_an_exact_mask(check_elements, monkeypatch):
    monkeypatch.setattr(fa_transformers, "_CHECK_ELEMENTS", check_elements)
    positions = torch.arange(8)
    causal = positions[None, :] <= positions[:, None]
    sequence = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    packed = causal & (sequence[:, None] == sequence[None, :])
    read = fa_transformers._packed_sequences
    assert read(packed[None, None].to(DEVICE), -1).tolist() == [0, 3, 5, 8]
    assert read(causal[None, None].expand(2, 1, 8, 8).to(DEVICE), -1).tolist() == [0, 8, 16]
    windowed = packed & (positions[None, :] > positions[:, None] - 2)
    assert read(windowed[None, None].to(DEVICE), 1).tolist() == [0, 3, 5, 8]
    assert read(windowed[None, None].to(DEVICE), -1) is None  # not the window it is told of
    overlay = packed.clone()
    overlay[6, 1] = True  # one key beyond its sequence: not packed sequences, a bias
    assert read(overlay[None, None].to(DEVICE), -1) is None
    hole = packed.clone()
    hole[7, 6] = False  # a key missing inside a sequence
    assert read(hole[None, None].to(DEVICE), -1) is None


@pytest.mark.parametrize("padding", ["none", "left", "gap"])
def test_autocast_inputs_of_mixed_dtypes(padding):
    # Under bf16 autocast Llama's rotary hands the attention fp32 q and k beside a bf16 v:
    # every path (causal flag, packed varlen, exact bias) runs in bf16 and returns bf16.
    _, mask = _batch(padding)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, heads, 12, 16, generator=gen).to(DEVICE)
               for heads in (4, 2, 2))
    v = v.bfloat16()
    module = torch.nn.Module()
    module.is_causal = True
    interface = transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["fa_torch"]
    from transformers.masking_utils import causal_mask_function
    attention_mask = interface(batch_size=2, q_length=12, kv_length=12,
                               attention_mask=mask.bool(), device=DEVICE,
                               mask_function=causal_mask_function)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        out, weights = fa_transformers.attention_forward(module, q, k, v, attention_mask,
                                                         scaling=0.25)
    assert weights is None and out.dtype == torch.bfloat16 and out.shape == (2, 12, 4, 16)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.bfloat16().float(), k.bfloat16().float().repeat_interleave(2, 1),
        v.float().repeat_interleave(2, 1), scale=0.25,
        attn_mask=torch.ones(12, 12, dtype=torch.bool, device=DEVICE).tril()
        & mask.bool()[:, None, None, :]).transpose(1, 2)
    real = mask.bool()
    torch.testing.assert_close(out.float()[real], reference[real], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_greedy_generation_matches(name):
    ids, mask = _batch("left")
    tokens = {}
    for implementation in ("fa_torch", _configs()[name][1]):
        model = _model(name, implementation).eval()
        with torch.no_grad():
            tokens[implementation] = model.generate(input_ids=ids, attention_mask=mask,
                                                    max_new_tokens=8, do_sample=False,
                                                    pad_token_id=0)
    ours, theirs = tokens.values()
    assert torch.equal(ours, theirs)


def test_output_attentions_is_refused():
    ids, mask = _batch("none")
    model = _model("llama", "fa_torch")
    with pytest.raises(ValueError, match=r"does not return attention weights"):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)


@pytest.mark.skipif(not ON_GPU, reason="bf16 at a real size: GPU only")
@pytest.mark.gpu
def test_bf16_llama_on_the_gpu():
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    ids = torch.randint(0, 1000, (4, 1024), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :300] = 0
    logits = {}
    for implementation in ("fa_torch", "sdpa"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=implementation, torch_dtype=torch.bfloat16).to(DEVICE)
        logits[implementation] = model(input_ids=ids, attention_mask=mask).logits.float()
    ours, theirs = logits.values()
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() < 0.1
