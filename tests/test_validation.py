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
]


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


@pytest.mark.parametrize("front", ["torch", "jax"])
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
