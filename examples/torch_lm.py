"""A small byte-level language model in PyTorch, trained on Shakespeare's Sonnets, with
our attention (``fa_torch.nn.MultiheadAttention``) or torch's own (SDPA).

    python examples/torch_lm.py                       # our attention; tiny on the CPU
    python examples/torch_lm.py --attention native    # torch SDPA, to compare the curves
    python examples/torch_lm.py --size gpu --steps 300

Prints the loss with a progress bar, then the first and last losses and the
validation loss. On the GPU the model computes in bf16 (autocast). The model is
described in examples/lm_common.py; examples/flax_lm.py is the same in Flax.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import fa_kernels  # noqa: E402,F401  (interpreter on without a GPU, before triton loads)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fa_torch  # noqa: E402
from fa_kernels import runtime  # noqa: E402
from lm_common import (VOCAB, LMConfig, batches, command_line, learning_rate,  # noqa: E402
                       load_text, progress, report)


class SdpaAttention(fa_torch.nn.MultiheadAttention):
    """The same layer (same parameters) with torch's scaled_dot_product_attention."""

    def attend(self, q, k, v, bias=None):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, config: LMConfig, attention: str):
        super().__init__()
        layer = fa_torch.nn.MultiheadAttention if attention == "ours" else SdpaAttention
        self.ln1 = nn.LayerNorm(config.embed)
        self.attn = layer(config.embed, config.heads, config.kv_heads, causal=True)
        self.ln2 = nn.LayerNorm(config.embed)
        self.fc = nn.Linear(config.embed, 4 * config.embed)
        self.proj = nn.Linear(4 * config.embed, config.embed)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class LanguageModel(nn.Module):
    def __init__(self, config: LMConfig, attention: str = "ours"):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(VOCAB, config.embed)
        self.pos_emb = nn.Embedding(config.seqlen, config.embed)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.embed)
        self.head = nn.Linear(config.embed, VOCAB)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def adamw_step(model: nn.Module, lr: float, loss_of):
    """(optimizer, step(batch, lr) -> loss): one AdamW training step on ``loss_of(batch)``
    (gradients clipped to norm 1); examples/transformers_lm.py trains with it too."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)

    def step(batch, lr):
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_of(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    return optimizer, step


def make_step(model: LanguageModel, device: torch.device):
    """(optimizer, step(inputs, targets, lr) -> loss): one AdamW training step."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def loss_of(batch):
        inputs, targets = batch
        with autocast:
            logits = model(inputs)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1).long())

    optimizer, step = adamw_step(model, model.config.lr, loss_of)
    return optimizer, lambda inputs, targets, lr: step((inputs, targets), lr)


@torch.no_grad()
def validation_loss(model, data, device, batches_=4) -> float:
    losses = []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for (inputs, targets), _ in zip(batches(data, model.config, seed=1234), range(batches_)):
        with autocast:
            logits = model(torch.from_numpy(inputs).to(device))
        losses.append(F.cross_entropy(logits.float().reshape(-1, VOCAB),
                                      torch.from_numpy(targets).to(device).reshape(-1).long()).item())
    return sum(losses) / len(losses)


def train(config: LMConfig, attention: str = "ours", seed: int = 0, quiet: bool = False):
    """Train from seed; returns (losses, validation loss, seconds)."""
    device = torch.device("cpu" if runtime.interpreting() else "cuda")
    torch.manual_seed(seed)
    model = LanguageModel(config, attention).to(device)
    _, step = make_step(model, device)
    train_data, val_data = load_text()
    data = batches(train_data, config, seed)
    losses, start = [], time.perf_counter()
    steps = range(config.steps) if quiet else progress(config.steps, f"torch {attention}")
    for i in steps:
        inputs, targets = (torch.from_numpy(a).to(device) for a in next(data))
        loss = step(inputs, targets, learning_rate(config, i)).item()
        losses.append(loss)
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{loss:.3f}")
    seconds = time.perf_counter() - start
    return losses, validation_loss(model, val_data, device), seconds


def main(argv=None):
    args, config = command_line(__doc__, ["ours", "native"], argv)
    losses, val_loss, seconds = train(config, args.attention, args.seed)
    report("torch_lm", args.attention, config, losses, val_loss, seconds)
    return losses


if __name__ == "__main__":
    main()
