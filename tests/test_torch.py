"""fa_torch specifics: strided inputs, masked rows, the LSE gradient, torch.compile."""
import pytest
import torch

import fa_torch

from .common import DEVICE, assert_close_to_reference, random_qkv, reference_grads
from .reference import attention_reference


def test_strided_inputs_used_in_place():
    # q, k, v as views of one packed (B, S, 3, H, D) tensor: strides are not contiguous.
    packed = torch.randn(2, 50, 3, 4, 64).half().to(DEVICE)
    q, k, v = packed.unbind(2)
    assert not q.is_contiguous()
    out = fa_torch.attention(q, k, v, causal=True)
    expected = fa_torch.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, expected)


def test_non_unit_last_stride():
    q, k, v = random_qkv(1, 33, 33, 2, 2, 32, "float16")
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    assert qt.stride(-1) != 1
    assert torch.equal(fa_torch.attention(qt, k, v), fa_torch.attention(q, k, v))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rows_without_keys_are_zero(dtype):
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see nothing.
    q, k, v = random_qkv(1, 40, 10, 2, 1, 32, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fa_torch.attention(*leaves, causal=True, return_lse=True)
    out.float().sum().backward()
    assert torch.all(out[:, :30] == 0) and torch.all(torch.isneginf(lse[:, :, :30]))
    assert torch.isfinite(lse[:, :, 30:]).all()
    for x in leaves:
        assert torch.isfinite(x.grad).all()
    assert torch.all(leaves[0].grad[:, :30] == 0)


def test_empty_keys():
    q, k, v = random_qkv(1, 5, 0, 2, 2, 16, "float16")
    out, lse = fa_torch.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_lse_gradient():
    # A loss through the LSE (as ring attention uses it) gets the right gradient.
    q, k, v = random_qkv(2, 37, 45, 4, 2, 32, "float32")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fa_torch.attention(*leaves, causal=True, return_lse=True)
    (out.sum() + (lse * torch.linspace(-1, 1, lse.shape[-1], device=lse.device)).sum()).backward()
    ref = [x.double().clone().requires_grad_() for x in (q, k, v)]
    r_out, r_lse = attention_reference(*ref, causal=True)
    (r_out.sum() + (r_lse * torch.linspace(-1, 1, lse.shape[-1], device=lse.device,
                                           dtype=torch.float64)).sum()).backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=1e-4)


def test_torch_compile_fullgraph():
    q, k, v = random_qkv(1, 33, 33, 2, 2, 32, "float16")

    def layer(q, k, v):
        return fa_torch.attention(q * 1.0, k, v, causal=True).float().sum()

    backend = "inductor" if DEVICE.type == "cuda" else "aot_eager"
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    compiled(*leaves).backward()
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    layer(*eager).backward()
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad)


def test_bf16_matches_reference_rule_for_large_values():
    # Scores in the hundreds: the online softmax must not overflow.
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, "bfloat16")
    q = q * 8
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fa_torch.attention(*leaves)
    out.backward(dout)
    t_out, _, t_grads = reference_grads(q, k, v, dout, False, None, torch.float64)
    f_out, _, f_grads = reference_grads(q, k, v, dout, False, None, torch.bfloat16)
    assert_close_to_reference("out", out, t_out, f_out, "bfloat16")
    for name, g, t, f in zip("qkv", leaves, t_grads, f_grads):
        assert_close_to_reference("d" + name, g.grad, t, f, "bfloat16", factor=3.0)


def test_eager_path_and_custom_op_agree():
    # Plain eager calls take an autograd.Function over the launches; compile, torch.func
    # and dispatch modes take the custom op. Same kernels, same formula: same bits.
    from torch.utils._python_dispatch import TorchDispatchMode

    from fa_torch import ops

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = random_qkv(2, 45, 60, 4, 2, 32, "bfloat16")
    dout = torch.randn_like(q)
    results = []
    for mode in (None, Recorder()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if mode is None:
            out, lse = fa_torch.attention(*leaves, causal=True, return_lse=True)
            assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
            out.backward(dout)
        else:
            with mode:
                out, lse = fa_torch.attention(*leaves, causal=True, return_lse=True)
                out.backward(dout)
            assert any("fa_torch.attention_forward" in name for name in mode.ops)
            assert any("fa_torch.attention_backward" in name for name in mode.ops)
        results.append([out, lse] + [x.grad for x in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert ops._eager([q, k, v]) and not ops._eager([q.as_subclass(torch.nn.Parameter)])


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_jit_trace_records_the_op():
    # torch.jit.trace (and ONNX export through it) must see the custom op, not the
    # eager Function's launches. The plan's shape checks read traced sizes, so the trace
    # warns that it holds for these shapes only, as every traced shape-dependent op does.
    # torch 2.13 deprecates jit.trace; it is still what older ONNX exports run.
    q, k, v = random_qkv(1, 20, 20, 2, 2, 16, "float32")
    traced = torch.jit.trace(lambda q, k, v: fa_torch.attention(q, k, v, causal=True),
                             (q, k, v), check_trace=False)
    assert any(node.kind() == "fa_torch::attention_forward" for node in traced.graph.nodes())
    assert torch.equal(traced(q, k, v), fa_torch.attention(q, k, v, causal=True))
