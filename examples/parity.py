"""The same attention layer, with the same weights, in PyTorch and in Flax.

fa_torch.nn.MultiheadAttention and flax.linen.MultiHeadDotProductAttention (with
``attention_fn=fa_jax.flax.make_attention_fn(causal=True)``) get identical weights;
both call the same Triton kernels. The outputs agree to fp32 rounding (the
projections are the frameworks' own matmuls, so not bit for bit).

    python examples/parity.py [--seqlen 64] [--embed 64] [--heads 4]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_kernels  # noqa: E402,F401  (interpreter on without a GPU, before triton loads)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fa_jax.flax  # noqa: E402
import fa_torch  # noqa: E402
from fa_kernels import runtime  # noqa: E402


def flax_params_from_torch(layer: fa_torch.nn.MultiheadAttention) -> dict:
    """Map the torch layer's fused qkv and out projections onto Flax's DenseGenerals."""
    heads, head_dim, embed = layer.num_heads, layer.head_dim, layer.embed_dim
    w = layer.qkv_proj.weight.detach().cpu().numpy()  # (3 * embed, embed), y = x @ w.T
    b = layer.qkv_proj.bias.detach().cpu().numpy()
    params = {}
    for i, name in enumerate(("query", "key", "value")):
        rows = slice(i * embed, (i + 1) * embed)
        params[name] = {"kernel": w[rows].T.reshape(embed, heads, head_dim),
                        "bias": b[rows].reshape(heads, head_dim)}
    wo = layer.out_proj.weight.detach().cpu().numpy()  # (embed, embed)
    params["out"] = {"kernel": wo.T.reshape(heads, head_dim, embed),
                     "bias": layer.out_proj.bias.detach().cpu().numpy()}
    return {"params": params}


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=64)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args(argv)
    device = "cpu" if runtime.interpreting() else "cuda"
    torch.manual_seed(0)
    layer = fa_torch.nn.MultiheadAttention(args.embed, args.heads, causal=True).to(device)
    x = torch.randn(2, args.seqlen, args.embed)
    with torch.no_grad():
        out_torch = layer(x.to(device)).cpu().numpy()
    module = nn.MultiHeadDotProductAttention(
        num_heads=args.heads, attention_fn=fa_jax.flax.make_attention_fn(causal=True))
    params = flax_params_from_torch(layer)
    out_flax = np.asarray(jax.jit(module.apply)(params, jnp.asarray(x.numpy())))
    diff = float(np.abs(out_torch - out_flax).max())
    print(f"same weights, causal attention layer, x {tuple(x.shape)}, on {device}")
    print(f"max |torch - flax| = {diff:.2e}  (max |output| = {np.abs(out_torch).max():.2f})")
    return diff


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-4 else "torch and flax disagree")
