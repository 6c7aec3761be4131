"""The language model of examples/torch_lm.py in Flax (linen), trained with optax under
one jitted step (params and optimizer state donated), with our attention
(``fa_jax.attention``) or jax's own (``jax.nn.dot_product_attention``).

    python examples/flax_lm.py                        # our attention; tiny on the CPU
    python examples/flax_lm.py --attention native     # jax.nn.dot_product_attention
    python examples/flax_lm.py --size gpu --steps 300

On the GPU the model computes in bf16 with fp32 parameters; ``native`` lets jax pick
its implementation (cuDNN where it can), ``xla`` and ``cudnn`` force one.
"""
from __future__ import annotations

import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import fa_kernels  # noqa: E402,F401  (interpreter on without a GPU, before triton loads)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fa_jax  # noqa: E402
from fa_kernels import runtime  # noqa: E402
from lm_common import (VOCAB, LMConfig, batches, command_line, learning_rate,  # noqa: E402
                       load_text, progress, report)

INIT = nn.initializers.normal(0.02)


def attend(q, k, v, attention: str):
    """(batch, seqlen, heads, head_dim) causal attention, GQA by fewer K/V heads."""
    if attention == "ours":
        return fa_jax.attention(q, k, v, causal=True)
    implementation = None if attention == "native" else attention
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


class Part(nn.Module):
    """A piece of the model: its sizes, which attention, the compute dtype."""
    config: LMConfig
    attention: str
    dtype: jnp.dtype


class SelfAttention(Part):
    """Fused qkv projection (as fa_torch.nn.MultiheadAttention), attention, output."""

    @nn.compact
    def __call__(self, x):
        c = self.config
        batch, seqlen, _ = x.shape
        kv = c.kv_heads * c.head_dim
        qkv = nn.Dense(c.embed + 2 * kv, kernel_init=INIT, dtype=self.dtype, name="qkv_proj")(x)
        q, k, v = jnp.split(qkv, [c.embed, c.embed + kv], axis=-1)
        q = q.reshape(batch, seqlen, c.heads, c.head_dim)
        k = k.reshape(batch, seqlen, c.kv_heads, c.head_dim)
        v = v.reshape(batch, seqlen, c.kv_heads, c.head_dim)
        out = attend(q, k, v, self.attention).reshape(batch, seqlen, c.embed)
        return nn.Dense(c.embed, kernel_init=INIT, dtype=self.dtype, name="out_proj")(out)


class Block(Part):
    @nn.compact
    def __call__(self, x):
        c = self.config
        norm = functools.partial(nn.LayerNorm, epsilon=1e-5, dtype=self.dtype)
        x = x + SelfAttention(c, self.attention, self.dtype, name="attn")(norm(name="ln1")(x))
        h = nn.Dense(4 * c.embed, kernel_init=INIT, dtype=self.dtype, name="fc")(norm(name="ln2")(x))
        h = nn.gelu(h, approximate=False)
        return x + nn.Dense(c.embed, kernel_init=INIT, dtype=self.dtype, name="proj")(h)


class LanguageModel(nn.Module):
    config: LMConfig
    attention: str = "ours"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        x = (nn.Embed(VOCAB, c.embed, embedding_init=INIT, name="tok_emb")(tokens)
             + nn.Embed(c.seqlen, c.embed, embedding_init=INIT, name="pos_emb")(
                 jnp.arange(tokens.shape[1])))
        x = x.astype(self.dtype)
        for i in range(c.layers):
            x = Block(c, self.attention, self.dtype, name=f"blocks_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(VOCAB, kernel_init=INIT, dtype=self.dtype, name="head")(x)


def make_step(model: LanguageModel):
    """(init(key) -> (params, opt_state), step(params, opt_state, inputs, targets, lr))."""
    c = model.config
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=c.lr, b1=0.9, b2=0.95,
                                              weight_decay=0.1))

    def loss_fn(params, inputs, targets):
        logits = model.apply(params, inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, inputs, targets, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init(key):
        params = model.init(key, jnp.zeros((1, c.seqlen), jnp.int32))
        return params, optimizer.init(params)

    return init, step, jax.jit(loss_fn)


def train(config: LMConfig, attention: str = "ours", seed: int = 0, quiet: bool = False):
    """Train from seed; returns (losses, validation loss, seconds)."""
    dtype = jnp.float32 if runtime.interpreting() else jnp.bfloat16
    model = LanguageModel(config, attention, dtype)
    init, step, loss_fn = make_step(model)
    params, opt_state = init(jax.random.PRNGKey(seed))
    train_data, val_data = load_text()
    data = batches(train_data, config, seed)
    losses, start = [], time.perf_counter()
    steps = range(config.steps) if quiet else progress(config.steps, f"flax {attention}")
    for i in steps:
        inputs, targets = next(data)
        params, opt_state, loss = step(params, opt_state, inputs, targets,
                                       jnp.float32(learning_rate(config, i)))
        losses.append(float(loss))
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - start
    val = [float(loss_fn(params, x, y))
           for (x, y), _ in zip(batches(val_data, config, seed=1234), range(4))]
    return losses, float(np.mean(val)), seconds


def main(argv=None):
    args, config = command_line(__doc__, ["ours", "native", "xla", "cudnn"], argv)
    losses, val_loss, seconds = train(config, args.attention, args.seed)
    report("flax_lm", args.attention, config, losses, val_loss, seconds)
    return losses


if __name__ == "__main__":
    main()
