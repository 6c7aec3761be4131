"""A small byte-level Llama from transformers (``LlamaConfig``, random weights, no
downloads), trained on Shakespeare's Sonnets through ``attn_implementation="fa_torch"``
(our kernels, after ``fa_torch.transformers.register()``) or transformers' own ``"sdpa"``.

    python examples/transformers_lm.py                       # our attention; tiny on the CPU
    python examples/transformers_lm.py --attention native    # transformers' sdpa, to compare
    python examples/transformers_lm.py --attention eager     # transformers' eager attention
    python examples/transformers_lm.py --size gpu --steps 300

Every batch is left-padded, as batches for a decoder usually are: each sequence starts
with a random number of pad tokens (attention_mask 0, labels -100 there; the same for the
same seed), so the adapter's padding path (the 2-D padding mask, each entry's real tokens
packed through ``attention_varlen``) is what trains. Position ids count the real tokens
from 0. Prints the loss with a progress bar, then the first and last losses and the
validation loss. On the GPU the model computes in bf16 (autocast). Sizes, data, batches
and learning-rate schedule are those of examples/torch_lm.py (examples/lm_common.py); the
model is a Llama (RMSNorm, rotary positions, SwiGLU MLP, GQA heads as the size gives).
"""
from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import fa_kernels  # noqa: E402,F401  (interpreter on without a GPU, before triton loads)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import fa_torch.transformers  # noqa: E402
from fa_kernels import runtime  # noqa: E402
from lm_common import (VOCAB, LMConfig, batches, command_line, learning_rate,  # noqa: E402
                       load_text, progress, report)
from torch_lm import adamw_step  # noqa: E402

PAD = 0  # byte 0 never occurs in the text
IGNORE = -100  # labels the loss skips (torch's and transformers' ignore_index)
IMPLEMENTATIONS = {"ours": fa_torch.transformers.NAME, "native": "sdpa", "eager": "eager"}


def llama_config(config: LMConfig) -> transformers.LlamaConfig:
    """The size's Llama: its width, depth and heads (GQA: ``kv_heads`` K/V heads), a SwiGLU
    MLP of 8/3 the width rounded up to a multiple of 64 (the parameters of a 4x GELU MLP),
    the byte vocabulary and untied embeddings."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=config.embed, num_hidden_layers=config.layers,
        num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
        intermediate_size=64 * math.ceil(8 * config.embed / 3 / 64),
        max_position_embeddings=config.seqlen, attention_dropout=0.0,
        tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
        use_cache=False)


def make_model(config: LMConfig, attention: str, device: torch.device):
    if attention == "ours":
        fa_torch.transformers.register()
    model = transformers.AutoModelForCausalLM.from_config(
        llama_config(config), attn_implementation=IMPLEMENTATIONS[attention])
    return model.to(device=device, dtype=torch.float32)


def left_padded(data, config: LMConfig, seed: int):
    """Endless (input_ids, attention_mask, position_ids, labels) int64 arrays (batch,
    seqlen): lm_common's batches with each sequence's first n tokens (n random in [0,
    seqlen / 2), from the seed) replaced by pad tokens."""
    rng = np.random.default_rng([seed, 1])
    for inputs, targets in batches(data, config, seed):
        pads = rng.integers(0, config.seqlen // 2, size=config.batch)
        mask = np.arange(config.seqlen)[None, :] >= pads[:, None]
        input_ids = np.where(mask, inputs, PAD).astype(np.int64)
        labels = np.where(mask, targets, IGNORE).astype(np.int64)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        yield input_ids, mask.astype(np.int64), positions, labels


def loss_of(model, batch, device):
    input_ids, mask, positions, labels = (torch.from_numpy(a).to(device) for a in batch)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1),
                           ignore_index=IGNORE)


def make_step(model, config: LMConfig, device: torch.device):
    """(optimizer, step(batch, lr) -> loss): one AdamW training step, as torch_lm's."""
    return adamw_step(model, config.lr, lambda batch: loss_of(model, batch, device))


@torch.no_grad()
def validation_loss(model, data, config, device, batches_=4) -> float:
    model.eval()
    losses = [loss_of(model, batch, device).item()
              for batch, _ in zip(left_padded(data, config, seed=1234), range(batches_))]
    model.train()
    return sum(losses) / len(losses)


def train(config: LMConfig, attention: str = "ours", seed: int = 0, quiet: bool = False):
    """Train from seed; returns (losses, validation loss, seconds)."""
    device = torch.device("cpu" if runtime.interpreting() else "cuda")
    torch.manual_seed(seed)
    model = make_model(config, attention, device)
    model.train()
    _, step = make_step(model, config, device)
    train_data, val_data = load_text()
    data = left_padded(train_data, config, seed)
    losses, start = [], time.perf_counter()
    steps = range(config.steps) if quiet else progress(config.steps, f"transformers {attention}")
    for i in steps:
        loss = step(next(data), learning_rate(config, i)).item()
        losses.append(loss)
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{loss:.3f}")
    seconds = time.perf_counter() - start
    return losses, validation_loss(model, val_data, config, device), seconds


def main(argv=None):
    args, config = command_line(__doc__, ["ours", "native", "eager"], argv)
    losses, val_loss, seconds = train(config, args.attention, args.seed)
    report("transformers_lm", args.attention, config, losses, val_loss, seconds)
    return losses


if __name__ == "__main__":
    main()
