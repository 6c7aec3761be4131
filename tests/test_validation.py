"""Bad input: a clear ValueError/TypeError naming the argument, before any launch."""
import numpy as np
import pytest
import torch

from .common import DEVICE, to_numpy


def torch_call(q, k, v, **kw):
    import fa_torch

    return fa_torch.attention(q, k, v, **kw)


def jax_call(q, k, v, **kw):
    import fa_jax

    conv = (lambda x: to_numpy(x) if isinstance(x, torch.Tensor) else x)
    return fa_jax.attention(conv(q), conv(k), conv(v), **kw)


FRONTS = {"torch": torch_call, "jax": jax_call}


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype).to(DEVICE)


CASES = [
    # (description, q, k, v, options, error type, message fragment)
    ("q rank", lambda: (t(2, 8, 2), t(2, 8, 2, 16), t(2, 8, 2, 16)), {}, ValueError,
     r"q must have 4 dimensions .*got shape \(2, 8, 2\)"),
    ("k rank", lambda: (t(2, 8, 2, 16), t(8, 2, 16), t(2, 8, 2, 16)), {}, ValueError,
     r"k must have 4 dimensions"),
    ("v rank", lambda: (t(2, 8, 2, 16), t(2, 8, 2, 16), t(2, 8, 2, 16, 1)), {}, ValueError,
     r"v must have 4 dimensions"),
    ("k v shapes", lambda: (t(2, 8, 2, 16), t(2, 8, 2, 16), t(2, 9, 2, 16)), {}, ValueError,
     r"k and v must have the same shape"),
    ("batch", lambda: (t(2, 8, 2, 16), t(3, 8, 2, 16), t(3, 8, 2, 16)), {}, ValueError,
     r"same batch size"),
    ("head dim", lambda: (t(2, 8, 2, 16), t(2, 8, 2, 32), t(2, 8, 2, 32)), {}, ValueError,
     r"same head_dim"),
    ("head dim > 256", lambda: (t(1, 4, 1, 257), t(1, 4, 1, 257), t(1, 4, 1, 257)), {},
     ValueError, r"head_dim must be between 1 and 256; got 257"),
    ("gqa", lambda: (t(2, 8, 3, 16), t(2, 8, 2, 16), t(2, 8, 2, 16)), {}, ValueError,
     r"heads_q \(3\) must be a multiple of heads_k \(2\)"),
    ("int dtype", lambda: (t(2, 8, 2, 16).to(torch.int32), t(2, 8, 2, 16), t(2, 8, 2, 16)), {},
     TypeError, r"q has dtype int32; expected one of float16, bfloat16, float32"),
    ("mixed dtype", lambda: (t(2, 8, 2, 16), t(2, 8, 2, 16, dtype=torch.bfloat16),
                             t(2, 8, 2, 16)), {}, TypeError,
     r"same dtype; got q float16, k bfloat16, v float16"),
    ("float64", lambda: (t(1, 4, 1, 16, dtype=torch.float64),) * 3, {}, TypeError,
     r"q has dtype float64"),
    ("scale type", lambda: (t(1, 4, 1, 16),) * 3, {"softmax_scale": "0.1"}, TypeError,
     r"softmax_scale must be a real number"),
    ("scale inf", lambda: (t(1, 4, 1, 16),) * 3, {"softmax_scale": float("inf")}, ValueError,
     r"softmax_scale must be finite"),
    ("causal type", lambda: (t(1, 4, 1, 16),) * 3, {"causal": "yes"}, TypeError,
     r"causal must be a bool"),
]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(front, case):
    _, make, options, error, message = case
    with pytest.raises(error, match=message):
        FRONTS[front](*make(), **options)


@pytest.mark.parametrize("front", FRONTS)
def test_not_an_array(front):
    with pytest.raises(TypeError, match=r"q must be a"):
        FRONTS[front]([[1.0]], t(1, 4, 1, 16), t(1, 4, 1, 16))


def test_torch_devices_differ():
    import fa_torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU to have two devices")
    with pytest.raises(ValueError, match=r"same device; got q cuda:0, k cpu"):
        fa_torch.attention(t(1, 4, 1, 16), torch.randn(1, 4, 1, 16).half(), t(1, 4, 1, 16))


def test_jax_wrong_platform():
    import jax

    import fa_jax

    if len(jax.devices("cpu")) == 0 or not torch.cuda.is_available():
        pytest.skip("needs a GPU process with a CPU jax array")
    q = jax.device_put(np.zeros((1, 4, 1, 16), np.float16), jax.devices("cpu")[0])
    with pytest.raises(ValueError, match=r"q is on platform \['cpu'\]"):
        fa_jax.attention(q, q, q)


OPTION_CASES = [
    ("window type", {"window_size": (1.5, 0)}, TypeError, r"window_size left must be an int"),
    ("window value", {"window_size": (-2, 0)}, ValueError, r"window_size left must be >= -1"),
    ("window shape", {"window_size": 3}, TypeError, r"window_size must be a pair"),
    ("softcap", {"softcap": -1.0}, ValueError, r"softcap must be >= 0"),
    ("dropout", {"dropout_p": 1.0, "dropout_seed": 1}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ("bias shape", {"bias": "bias_bad"}, ValueError, r"bias of shape \(3, 8\) does not broadcast"),
    ("bias dtype", {"bias": "bias_int"}, TypeError, r"bias has dtype int32"),
    ("alibi shape", {"alibi_slopes": "alibi_bad"}, ValueError, r"alibi_slopes must have shape \(heads_q,\)"),
    ("alibi dtype", {"alibi_slopes": "alibi_half"}, TypeError, r"alibi_slopes must be float32"),
    ("deterministic type", {"deterministic": "yes"}, TypeError,
     r"deterministic must be a bool; got str"),
    ("return_lse type", {"return_lse": "yes"}, TypeError, r"return_lse must be a bool; got str"),
    ("scale list", {"softmax_scale": [0.5]}, TypeError,
     r"softmax_scale must be a real number or None; got list"),
    ("softcap list", {"softcap": [1.0]}, TypeError, r"softcap must be a real number; got list"),
    ("dropout list", {"dropout_p": [0.1]}, TypeError, r"dropout_p must be a real number; got list"),
    ("dropout None", {"dropout_p": None}, TypeError, r"dropout_p must be a real number"),
    ("causal list", {"causal": [True]}, TypeError, r"causal must be a bool; got list"),
    ("window dict", {"window_size": {0: 1, 1: 0}}, TypeError, r"window_size must be a pair"),
    ("seed garbage without dropout", {"dropout_seed": "garbage"}, TypeError,
     r"dropout_seed must be"),
    ("seed bool", {"dropout_p": 0.1, "dropout_seed": True}, TypeError, r"dropout_seed must be"),
    ("seed negative", {"dropout_p": 0.1, "dropout_seed": -1}, ValueError,
     r"dropout_seed must be in \[0, 2\*\*64\)"),
]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("seed", [np.int64(7), np.uint32(7), 7])
def test_numpy_int_seeds(front, seed):
    """Both front ends take Python and numpy ints as seeds, with the same mask."""
    q = t(1, 8, 2, 16, dtype=torch.float32)
    out = FRONTS[front](q, q, q, dropout_p=0.5, dropout_seed=seed)
    want = FRONTS[front](q, q, q, dropout_p=0.5, dropout_seed=7)
    np.testing.assert_array_equal(np.asarray(out if front == "jax" else out.cpu()),
                                  np.asarray(want if front == "jax" else want.cpu()))


@pytest.mark.parametrize("seed", [torch.tensor(1 + 2j), torch.tensor(True), torch.tensor(0.5)],
                         ids=["complex", "bool", "float"])
def test_torch_seed_tensor_dtype(seed):
    q = t(1, 8, 2, 16)
    with pytest.raises(TypeError, match=r"dropout_seed tensor must hold 1 or 2 integers"):
        torch_call(q, q, q, dropout_p=0.1, dropout_seed=seed)


def test_jax_seed_must_be_one_key():
    import jax

    q = t(1, 8, 2, 16)
    with pytest.raises(TypeError, match=r"dropout_seed must be one PRNG key; got an array of "
                                        r"keys of shape \(4,\)"):
        jax_call(q, q, q, dropout_p=0.1, dropout_seed=jax.random.split(jax.random.key(0), 4))


@pytest.mark.parametrize("front", FRONTS)
def test_scalar_like_options_are_taken(front):
    """A 0-d numpy scale, a 0-d bias, a float64 bias and empty inputs are fine."""
    q = t(1, 8, 2, 16, dtype=torch.float32)
    bias64 = torch.zeros(8, 8, dtype=torch.float64, device=DEVICE)
    bias64[:, 0] = -1e300  # finite in fp64, beyond fp32: a finite mask, not -inf
    plain = FRONTS[front](q, q, q, softmax_scale=0.25)
    conv = (lambda x: to_numpy(x)) if front == "jax" else (lambda x: x)
    for options in ({"softmax_scale": np.array(0.25)},
                    {"softmax_scale": 0.25, "bias": conv(torch.tensor(3.0, device=DEVICE))}):
        got = FRONTS[front](q, q, q, **options)
        np.testing.assert_allclose(np.asarray(got if front == "jax" else got.cpu()),
                                   np.asarray(plain if front == "jax" else plain.cpu()),
                                   rtol=1e-6, atol=1e-6)
    if front == "torch":  # (jax without x64 has no float64 arrays)
        got = torch_call(q, q, q, softmax_scale=0.25, bias=bias64)
        want = torch_call(q, q, q, softmax_scale=0.25, bias=bias64.float().clamp(min=-3e38))
        assert torch.equal(got, want)
    empty = torch.from_numpy(np.empty((0, 8, 2, 16), np.float32)).to(DEVICE)
    assert tuple(FRONTS[front](empty, empty, empty).shape) == (0, 8, 2, 16)


def _option_value(value):
    made = {"bias_bad": lambda: torch.zeros(3, 8), "bias_int": lambda: torch.zeros(1, 8, dtype=torch.int32),
            "alibi_bad": lambda: torch.zeros(3), "alibi_half": lambda: torch.zeros(2).half()}
    if isinstance(value, str) and value in made:
        return made[value]().to(DEVICE)
    return value


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("case", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_bad_options(front, case):
    _, options, error, message = case
    q = t(1, 8, 2, 16)
    options = {n: _option_value(v) for n, v in options.items()}
    if front == "jax":
        options = {n: to_numpy(v) if isinstance(v, torch.Tensor) else v for n, v in options.items()}
    with pytest.raises(error, match=message):
        FRONTS[front](q, q, q, **options)


VARLEN_CASES = [
    ("rank", lambda cu: (t(8, 2, 16)[None], t(8, 2, 16), t(8, 2, 16), cu, cu), ValueError,
     r"q must have 3 dimensions \(total_q, heads_q, head_dim\)"),
    ("cu dtype", lambda cu: (t(8, 2, 16), t(8, 2, 16), t(8, 2, 16), cu.long(), cu), TypeError,
     r"cu_seqlens_q must be int32; got int64"),
    ("cu shape", lambda cu: (t(8, 2, 16), t(8, 2, 16), t(8, 2, 16), cu[:, None], cu), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
    ("cu end", lambda cu: (t(9, 2, 16), t(8, 2, 16), t(8, 2, 16), cu, cu), ValueError,
     r"cu_seqlens_q must end at the number of tokens \(9\); got 8"),
    ("cu order", lambda cu: (t(8, 2, 16), t(8, 2, 16), t(8, 2, 16),
                             torch.tensor([0, 6, 3, 8], dtype=torch.int32, device=cu.device), cu),
     ValueError, r"cu_seqlens_q must be non-decreasing"),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_bad_varlen(front, case):
    _, make, error, message = case
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    if front == "torch" and DEVICE.type == "cuda" and case[0] in ("cu end", "cu order"):
        pytest.skip("cu_seqlens on the GPU are trusted (checking needs a device sync)")
    q, k, v, cu_q, cu_k = make(cu.to(DEVICE) if front == "torch" else cu)
    with pytest.raises(error, match=message):
        if front == "torch":
            import fa_torch

            fa_torch.attention_varlen(q, k, v, cu_q, cu_k, 8, 8)
        else:
            import fa_jax

            fa_jax.attention_varlen(*(to_numpy(x) for x in (q, k, v, cu_q.cpu(), cu_k.cpu())), 8, 8)


FLASH_ATTN_CASES = [
    ("dropout str", lambda q: fa().flash_attn_func(q, q, q, dropout_p="0.1"), TypeError,
     r"dropout_p must be a real number; got str"),
    ("qkv rank", lambda q: fa().flash_attn_qkvpacked_func(q), ValueError,
     r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\); got \(1, 8, 2, 16\)"),
    ("kv list", lambda q: fa().flash_attn_kvpacked_func(q, [q, q]), TypeError,
     r"kv must be a torch.Tensor"),
    ("varlen qkv rank", lambda q: fa().flash_attn_varlen_qkvpacked_func(
        q[0], torch.tensor([0, 8], dtype=torch.int32, device=DEVICE), 8), ValueError,
     r"qkv must have shape \(total, 3, nheads, headdim\)"),
    ("mha heads", lambda q: fa().nn.MultiheadAttention(32, 0), ValueError,
     r"num_heads must be >= 1; got 0"),
    ("mha dropout", lambda q: fa().nn.MultiheadAttention(32, 4, dropout=1.5), ValueError,
     r"dropout_p must be in \[0, 1\); got 1.5"),
    ("dropout_mask negative", lambda q: fa().dropout_mask(1, -1, 2, 3, 4, 0.1), ValueError,
     r"batch must be >= 0; got -1"),
    ("dropout_mask float", lambda q: fa().dropout_mask(1, 1, 2.5, 3, 4, 0.1), TypeError,
     r"heads must be an int; got float"),
]


def fa():
    import fa_torch

    return fa_torch


@pytest.mark.parametrize("case", FLASH_ATTN_CASES, ids=[c[0] for c in FLASH_ATTN_CASES])
def test_torch_api_errors(case):
    _, call, error, message = case
    with pytest.raises(error, match=message):
        call(t(1, 8, 2, 16))


JAX_API_CASES = [
    ("flax rank 2", lambda jx: jx.flax.attention_fn(np.zeros((8, 16), np.float32),
                                                     np.zeros((8, 16), np.float32),
                                                     np.zeros((8, 16), np.float32)),
     ValueError, r"query must have shape \(batch..., length, heads, depth\); got shape \(8, 16\)"),
    ("ring outside shard_map", lambda jx: jx.ring.ring_attention(*(np.zeros((1, 8, 2, 16),
                                                                             np.float32),) * 3,
                                                                 "x"),
     ValueError, r"ring_attention needs the mesh axis 'x' bound"),
    ("ring causal str", lambda jx: jx.ring.ring_attention(*(np.zeros((1, 8, 2, 16),
                                                                      np.float32),) * 3, "x",
                                                          causal="no"),
     TypeError, r"causal must be a bool; got str"),
    ("ring scale str", lambda jx: jx.ring.ring_attention(*(np.zeros((1, 8, 2, 16),
                                                                     np.float32),) * 3, "x",
                                                         softmax_scale="abc"),
     TypeError, r"softmax_scale must be a real number or None; got str"),
    ("ring sharded rank", lambda jx: jx.ring.ring_attention_sharded(
        *(np.zeros((8, 2, 16), np.float32),) * 3, _mesh(), "x"),
     ValueError, r"q must have 4 dimensions"),
    ("dropout_mask negative", lambda jx: jx.dropout_mask(1, 1, 2, -3, 4, 0.1), ValueError,
     r"seqlen_q must be >= 0; got -3"),
]


def _mesh():
    import jax

    return jax.make_mesh((len(jax.devices()),), ("x",))


@pytest.mark.parametrize("case", JAX_API_CASES, ids=[c[0] for c in JAX_API_CASES])
def test_jax_api_errors(case):
    import fa_jax

    _, call, error, message = case
    with pytest.raises(error, match=message):
        call(fa_jax)


def test_torch_ring_options():
    import fa_torch.ring

    q = t(1, 8, 2, 16)
    with pytest.raises(TypeError, match=r"causal must be a bool; got str"):
        fa_torch.ring.ring_attention(q, q, q, causal="no")
    with pytest.raises(TypeError, match=r"softmax_scale must be a real number or None"):
        fa_torch.ring.ring_attention(q, q, q, softmax_scale="abc")


@pytest.mark.parametrize("mode", ["forward", "forward+backward", "dropout, jitted"])
def test_one_validation_per_call(monkeypatch, front, mode):
    # A call is validated once; every later step (plans, shards, vmap, the backward)
    # derives from that problem. (fa_torch caches it: a repeated call validates nothing.)
    from fa_kernels import plan as fa_plan

    calls = []
    check = fa_plan.check_problem
    monkeypatch.setattr(fa_plan, "check_problem",
                        lambda *a, **kw: calls.append(1) or check(*a, **kw))
    shape = (1, 24 + len(mode) + len(front), 2, 16)  # a shape no other test cached
    options = dict(causal=True)
    if "dropout" in mode:
        options.update(dropout_p=0.1, dropout_seed=3)
    if front == "torch":
        import fa_torch

        q = torch.randn(shape, device=DEVICE, requires_grad=mode != "forward")
        out = fa_torch.attention(q, q, q, **options)
        if mode != "forward":
            out.sum().backward()
    else:
        import jax
        import jax.numpy as jnp

        import fa_jax

        q = jnp.ones(shape)
        attend = lambda q: fa_jax.attention(q, q, q, **options).sum()  # noqa: E731
        if mode == "forward":
            jax.block_until_ready(attend(q))
        else:
            step = jax.jit(jax.grad(attend)) if "jitted" in mode else jax.grad(attend)
            jax.block_until_ready(step(q))
    assert len(calls) == 1
