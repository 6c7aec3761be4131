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


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("option,value", [("bias", "x"), ("alibi_slopes", "x"),
                                          ("window_size", (4, 0)), ("softcap", 5.0),
                                          ("dropout_p", 0.1)])
def test_unbuilt_options_refused(front, option, value):
    q = t(1, 4, 1, 16)
    with pytest.raises(NotImplementedError, match=option):
        FRONTS[front](q, q, q, **{option: value})
