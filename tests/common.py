"""Shared test helpers: inputs, the flash-attn tolerance rule, the device."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import fa_kernels.runtime as runtime
from fa_kernels import configs
from fa_kernels import plan as fa_plan

from .reference import attention_reference

ON_GPU = not runtime.interpreting()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The absolute floor under the relative rule: for fp32 the framework's own error is
# ~1e-7 and summation order alone moves results by more than 2x of that.
FLOOR = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 2e-5}


def jaxpr_avals(jaxpr):
    """Every value a jaxpr computes, nested jaxprs' included, as (shape, dtype name):
    what a test reads to show an array is never built."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # (a ClosedJaxpr)
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(var.aval.shape), np.dtype(var.aval.dtype).name
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from jaxpr_avals(inner)


def clear_plans():
    """Drop the cached plans (made from the tables as they were)."""
    fa_plan.forward_plan.cache_clear()
    fa_plan.backward_plan.cache_clear()


@pytest.fixture
def replace_entries():
    """``replace_entries(kernels, **flags)``: every table entry of ``kernels`` (the
    interpreter's config too) with ``flags`` set, for the rest of this test
    (``configs.override``, which also remakes the cached plans)."""
    with contextlib.ExitStack() as stack:
        yield lambda kernels, **flags: stack.enter_context(configs.override(kernels, **flags))


def random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, seed=0,
               device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim),
              (batch, seqlen_k, heads_k, head_dim)]
    return [torch.randn(s, generator=gen).to(TORCH_DTYPES[dtype]).to(device) for s in shapes]


def max_err(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = torch.where(both_inf, torch.zeros((), dtype=torch.float64), (a - b).abs())
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_to_reference(name, ours, truth, framework, dtype, factor=2.0):
    """flash-attn's rule: our error vs float64 at most ``factor`` x the error of the
    same computation done plainly in ``dtype``, plus a tiny absolute floor."""
    assert not torch.isnan(ours.double().cpu()).any(), f"{name}: NaN in output"
    ours_err = max_err(ours, truth)
    framework_err = max_err(framework, truth)
    bound = factor * framework_err + FLOOR[dtype]
    assert ours_err <= bound, (
        f"{name}: max error {ours_err:.3g} vs float64 exceeds {factor} x framework "
        f"{dtype} error {framework_err:.3g} + {FLOOR[dtype]:.0e}")


def reference_grads(q, k, v, dout, causal, softmax_scale, compute_dtype, bias=None, **options):
    """Reference (out, lse, [dq, dk, dv] (+ [dbias] with a bias)) by autograd."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    out, lse = attention_reference(*leaves[:3], causal=causal, softmax_scale=softmax_scale,
                                   bias=leaves[3] if bias is not None else None,
                                   compute_dtype=compute_dtype, **options)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch -> numpy, bf16 kept as ml_dtypes bfloat16 (for jax)."""
    import ml_dtypes

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def run_torch(q, k, v, dout, bias=None, **options):
    """fa_torch forward and backward: (out, lse, [dq, dk, dv] (+ [dbias]))."""
    import fa_torch

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    out, lse = fa_torch.attention(*leaves[:3], bias=leaves[3] if bias is not None else None,
                                  return_lse=True, **options)
    out.backward(dout)
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def run_jax(q, k, v, dout, bias=None, alibi_slopes=None, **options):
    """fa_jax forward and backward under jit: (out, lse, grads) as torch tensors."""
    import jax

    import fa_jax

    slopes = None if alibi_slopes is None else to_numpy(alibi_slopes)

    def fwd(q, k, v, *bias_arg):
        return fa_jax.attention(q, k, v, bias=bias_arg[0] if bias_arg else None,
                                alibi_slopes=slopes, return_lse=True, **options)

    primals = [to_numpy(x) for x in (q, k, v)] + ([to_numpy(bias)] if bias is not None else [])
    (out, lse), vjp = jax.vjp(jax.jit(fwd), *primals)
    grads = vjp((to_numpy(dout), np.zeros(lse.shape, np.float32)))
    return from_numpy(out), from_numpy(lse), [from_numpy(g) for g in grads]


RUNNERS = {"torch": run_torch, "jax": run_jax}  # the `run` fixture (conftest.py)


def launch_arrays(q, k, v, **given):
    """The arrays a plan's launches read, by name: q, k, v, what is ``given``, and None
    for the optional inputs not given (bias, slopes, seed, cu_seqlens_*, seqused_k,
    block_table)."""
    return {"q": q, "k": k, "v": v, "bias": None, "slopes": None, "seed": None,
            "cu_seqlens_q": None, "cu_seqlens_k": None, "seqused_k": None, "block_table": None,
            **given}


def forward_plan_torch(fwd, arrays):
    """Run a forward plan's launches through fa_torch's launcher: (out, lse)."""
    from fa_torch import _launch

    arrays = dict(arrays)
    for launch in fwd.launches:
        _launch.run(launch, arrays, DEVICE)
    return arrays["out"], arrays["lse"]


def forward_plan_jax(fwd, arrays):
    """The same launches through fa_jax (custom calls), on torch inputs: (out, lse)."""
    import jax.numpy as jnp

    from fa_jax import _launch

    arrays = {n: (jnp.asarray(to_numpy(x)) if x is not None else _launch.placeholder())
              for n, x in arrays.items()}
    for launch in fwd.launches:
        _launch.run(launch, arrays)
    return from_numpy(arrays["out"]), from_numpy(arrays["lse"])


def keep_mask(front, seed, batch, heads, seqlen_q, seqlen_k, dropout_p):
    """The dropout keep mask a front end draws for this seed, as a torch bool tensor."""
    if front == "jax":
        import fa_jax

        return from_numpy(np.asarray(fa_jax.dropout_mask(seed, batch, heads, seqlen_q, seqlen_k,
                                                         dropout_p)))
    import fa_torch

    return fa_torch.dropout_mask(seed, batch, heads, seqlen_q, seqlen_k, dropout_p).cpu()


def check_with_every_option(runner, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
                           dtype, seed, window_left, softcap, dropout_p, bias_batch=None):
    """``check_against_reference``, causal with a left window, ALiBi (random slopes of
    ``seed``), softcap, dropout (seed ``seed``) and a bias, all at once. The bias has
    ``bias_batch`` entries (1: broadcast over the batch), ``batch`` by default."""
    gen = torch.Generator().manual_seed(seed)
    slopes = (torch.rand(heads_q, generator=gen) * 0.3).to(DEVICE)
    bias_shape = (batch if bias_batch is None else bias_batch, heads_q, seqlen_q, seqlen_k)
    check_against_reference(runner, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype,
                            True, window_size=(window_left, -1), alibi_slopes=slopes,
                            softcap=softcap, dropout_p=dropout_p, dropout_seed=seed,
                            bias_shape=bias_shape)


def check_against_reference(runner, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
                            dtype, causal, softmax_scale=None, seed=0, bias_shape=None,
                            key_ramp=0.0, bias_values=None, **options):
    """Our forward, LSE and gradients against float64, by flash-attn's tolerance rule.

    ``options`` go to the front end (window_size, softcap, alibi_slopes, dropout_p with
    dropout_seed); the reference gets the keep mask the kernel drew. ``key_ramp`` scales
    key j by ``1 + key_ramp * j / seqlen_k``: scores that grow along the keys.
    ``bias_values``: this bias (a mask, say) instead of a random one of ``bias_shape``.
    """
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, seed)
    if key_ramp:
        ramp = 1 + key_ramp * torch.arange(seqlen_k, dtype=torch.float32) / seqlen_k
        k = (k.float() * ramp.to(k.device)[None, :, None, None]).to(k.dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).to(q.device)
    bias = None
    if bias_values is not None:
        bias = bias_values.to(q.device)
    elif bias_shape is not None:
        bias = torch.randn(bias_shape, generator=gen).to(q.dtype).to(q.device)
    out, lse, grads = runner(q, k, v, dout, causal=causal, softmax_scale=softmax_scale,
                             bias=bias, **options)
    ref_options = {n: options[n] for n in ("window_size", "softcap", "alibi_slopes", "dropout_p")
                   if n in options}
    if options.get("dropout_p", 0) > 0:
        front = "jax" if runner is run_jax else "torch"
        ref_options["dropout_keep"] = keep_mask(front, options["dropout_seed"], batch, heads_q,
                                                seqlen_q, seqlen_k, options["dropout_p"]).to(q.device)
    t_out, t_lse, t_grads = reference_grads(q, k, v, dout, causal, softmax_scale, torch.float64,
                                            bias=bias, **ref_options)
    f_out, f_lse, f_grads = reference_grads(q, k, v, dout, causal, softmax_scale, q.dtype,
                                            bias=bias, **ref_options)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    assert_close_to_reference("out", out, t_out, f_out, dtype)
    assert_close_to_reference("lse", lse, t_lse, f_lse, dtype)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(t_lse.cpu())), "lse -inf rows differ"
    names = ("dq", "dk", "dv", "dbias")
    for name, g, t, f in zip(names, grads, t_grads, f_grads):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert_close_to_reference(name, g, t, f, dtype, factor=3.0)
