"""The same language model, with the same weights, in PyTorch and in Flax: same logits.

Builds examples/torch_lm.py's model, copies its weights into examples/flax_lm.py's
(the parameter names match; a torch Linear's weight is the transpose of a Flax Dense
kernel), runs both on the same tokens and prints the largest difference of the logits.
Both call the same Triton kernels for attention; the rest is each framework's own fp32
arithmetic, so they agree to rounding, not bit for bit.

    python examples/parity.py [--size tiny]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import fa_kernels  # noqa: E402,F401  (interpreter on without a GPU, before triton loads)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import flax_lm  # noqa: E402
import torch_lm  # noqa: E402
from fa_kernels import runtime  # noqa: E402
from lm_common import SIZES, VOCAB  # noqa: E402


def flax_params_from_torch(model: torch_lm.LanguageModel) -> dict:
    """torch state dict -> Flax params: same names, Linear weights transposed."""
    params: dict = {}
    for name, tensor in model.state_dict().items():
        value = tensor.detach().float().cpu().numpy()
        *path, leaf = name.split(".")
        if path[0] == "blocks":  # blocks.3.attn.qkv_proj -> blocks_3 / attn / qkv_proj
            path = [f"blocks_{path[1]}", *path[2:]]
        module = path[-1]
        if module in ("tok_emb", "pos_emb"):
            leaf = "embedding"
        elif module.startswith("ln"):
            leaf = {"weight": "scale", "bias": "bias"}[leaf]
        elif leaf == "weight":
            leaf, value = "kernel", value.T
        node = params
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(value)
    return {"params": params}


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args(argv)
    config = SIZES[args.size]
    device = "cpu" if runtime.interpreting() else "cuda"
    torch.manual_seed(0)
    model = torch_lm.LanguageModel(config).to(device).eval()
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, config.seqlen), dtype=np.int32)
    with torch.no_grad():
        logits_torch = model(torch.from_numpy(tokens).to(device)).float().cpu().numpy()
    flax_model = flax_lm.LanguageModel(config)
    with jax.default_matmul_precision("float32"):  # (not tf32 on the GPU, as torch)
        logits_flax = np.asarray(jax.jit(flax_model.apply)(flax_params_from_torch(model), tokens))
    diff = float(np.abs(logits_torch - logits_flax).max())
    print(f"same weights, {config.layers}-layer LM (embed {config.embed}, {config.heads} heads "
          f"over {config.kv_heads} K/V heads), tokens {tokens.shape}, fp32 on {device}")
    print(f"max |logits torch - logits flax| = {diff:.2e}  "
          f"(max |logit| = {np.abs(logits_torch).max():.2f})")
    return diff


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-3 else "torch and flax disagree")
