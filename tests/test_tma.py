"""Kernels reading their streamed blocks through tensor descriptors (TMA on Hopper: K/V
in the forward and dQ, Q/dO in dK/dV): the same results as plain pointer loads, every
option, both front ends, forward and backward. The interpreter runs the descriptor path
too (the plan uses it from sm_90 on; these tests turn it on through the table or the
plan)."""

import pytest
import torch

from fa_kernels import configs, launcher
from fa_kernels import plan as fa_plan

from .common import (DEVICE, ON_GPU, assert_close_to_reference, check_against_reference,
                     check_with_every_option, forward_plan_jax, forward_plan_torch,
                     launch_arrays, random_qkv, replace_entries, run_jax, run_torch)

CAPABILITY = torch.cuda.get_device_capability() if ON_GPU else None
HOPPER = CAPABILITY is None or CAPABILITY >= (9, 0)


@pytest.fixture
def descriptor_table(replace_entries):
    """Every forward, dK/dV and dQ entry with descriptors."""
    flags = dict(tma=True)
    replace_entries(("forward", "dkdv", "dq"), **flags)
    return flags


CASES = {  # (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, causal, options)
    "causal-odd-d40": (1, 37, 150, 2, 2, 40, "float16", True, {}),
    "gqa-decode": (2, 3, 170, 8, 2, 64, "bfloat16", False, {}),
    "window": (1, 90, 130, 2, 1, 32, "bfloat16", True, dict(window_size=(30, 0))),
    "fp32": (1, 33, 70, 2, 2, 32, "float32", False, {}),
}


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need sm_90")
@pytest.mark.parametrize("case", CASES)
def test_descriptor_forward_against_reference(descriptor_table, run, case):
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, causal, options = CASES[case]
    if ON_GPU:  # GPU-sized keys, so that the unmasked loop runs many blocks
        seqlen_k *= 8
    q_shape, kv_shape = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim)
    problem = fa_plan.check_problem(q_shape, kv_shape, kv_shape, dtype, dtype, dtype,
                                    causal=causal, **options)
    assert fa_plan.forward_plan(problem, capability=CAPABILITY).launch.constexprs["USE_TMA"]
    bwd = fa_plan.backward_plan(problem, capability=CAPABILITY)
    assert bwd.dkdv.constexprs["USE_TMA"] and bwd.dq.constexprs["USE_TMA"]
    check_against_reference(run, batch, seqlen_q, seqlen_k, heads_q, heads_k,
                            head_dim, dtype, causal, **options)


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need sm_90")
def test_descriptor_forward_with_every_option(descriptor_table, run):
    seqlen_k = 700 if ON_GPU else 120
    check_with_every_option(run, 2, 45, seqlen_k, 4, 2, 64, "bfloat16", seed=9,
                            window_left=200, softcap=5.0, dropout_p=0.15)


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need sm_90")
@pytest.mark.parametrize("causal", [False, True])
def test_descriptor_varlen_with_an_empty_sequence(descriptor_table, front, causal):
    # Every kernel through descriptors on a packed batch with an empty sequence: a
    # descriptor over its 0 rows must never be loaded (the H200 stops with an illegal
    # instruction; the interpreter raises), and the other sequences come out right.
    from .test_varlen import packed, reference_varlen, run_varlen

    scale = 4 if ON_GPU else 1
    lengths_q = [17 * scale, 0, 40 * scale, 1]
    lengths_k = [17 * scale, 0, 25 * scale, 33]
    q, k, v, cu_q, cu_k, dout = packed(lengths_q, lengths_k, 4, 2, 64, "bfloat16", seed=3)
    varlen = dict(cu_seqlens_q_shape=cu_q.shape, cu_seqlens_k_shape=cu_k.shape,
                  cu_seqlens_q_dtype="int32", cu_seqlens_k_dtype="int32",
                  max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16", causal=causal, varlen=varlen)
    bwd = fa_plan.backward_plan(problem, capability=CAPABILITY)
    assert bwd.dkdv.constexprs["USE_TMA"] and bwd.dq.constexprs["USE_TMA"]
    out, lse, grads = run_varlen(front, q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                 dout, causal=causal)
    truth = reference_varlen(q, k, v, cu_q, cu_k, dout, torch.float64, causal=causal)
    plain = reference_varlen(q, k, v, cu_q, cu_k, dout, q.dtype, causal=causal)
    assert_close_to_reference("out", out, truth[0], plain[0], "bfloat16")
    for name, g, t, f in zip(("dq", "dk", "dv"), grads, truth[2], plain[2]):
        assert_close_to_reference(name, g, t, f, "bfloat16", factor=3.0)


# How a plan may read its blocks: plain pointers, descriptors made on the device (scratch
# memory each program), or descriptors made on the host (kernel arguments).
READ_PATHS = {"pointers": dict(tma=False), "device": dict(tma=True, host_descriptors=False),
              "host": dict(tma=True)}


def _read_path(launch) -> str:
    flags = launch.constexprs
    assert flags["HOST_TMA"] == any(b.host_descriptor for b in launch.blocks)
    return "pointers" if not flags["USE_TMA"] else "host" if flags["HOST_TMA"] else "device"


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need sm_90")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_descriptor_loads_give_the_same_bits(causal, num_splits):
    # The same values reach the same arithmetic: the outputs are bit for bit those of
    # pointer loads whichever way the blocks are read, and fa_jax's launch (its own
    # choice of read path) gives them too.
    from fa_jax import _launch as jax_launch

    seqlen_k = 1500 if ON_GPU else 140
    q, k, v = random_qkv(2, 50, seqlen_k, 4, 2, 64, "bfloat16", seed=11)
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16", causal=causal)
    results = {}
    for path, options in READ_PATHS.items():
        fwd = fa_plan.forward_plan(problem, capability=CAPABILITY, num_splits=num_splits,
                                   **options)
        assert _read_path(fwd.launch) == path
        results[path] = forward_plan_torch(fwd, launch_arrays(q, k, v))
    for path, (out, lse) in results.items():
        assert torch.equal(out, results["pointers"][0]), path
        assert torch.equal(lse, results["pointers"][1]), path
    # (the launch path's options win: jax-triton 0.3.1 takes no descriptors)
    jax_options = {"tma": True, **jax_launch.plan_options()}
    jax_plan = fa_plan.forward_plan(problem, capability=CAPABILITY, num_splits=num_splits,
                                    **jax_options)
    j_out, j_lse = forward_plan_jax(jax_plan, launch_arrays(q, k, v))
    out, lse = results["pointers"]
    assert torch.equal(out.cpu(), j_out) and torch.equal(lse.cpu(), j_lse)


def test_host_descriptors_only_where_one_descriptor_serves_every_sequence():
    # Varlen: a sequence's blocks must stop at its own last row, which a descriptor over
    # the packed array cannot say; broadcast arrays (a stride of 0) are left to the device.
    shape = (2, 256, 4, 64)
    problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16")
    fwd = fa_plan.forward_plan(problem, capability=(9, 0), tma=True)
    assert _read_path(fwd.launch) == "host"
    assert [b.array for b in fwd.launch.blocks] == ["k", "v"]
    k_blocks = fwd.launch.blocks[0]
    assert k_blocks.shape == shape and k_blocks.strides == (256 * 4 * 64, 4 * 64, 64, 1)
    assert k_blocks.block_shape == (1, fwd.launch.constexprs["BLOCK_N"], 1, 64)
    bwd = fa_plan.backward_plan(problem, capability=(9, 0), tma=True)
    for launch in (bwd.dkdv, bwd.dq):
        assert _read_path(launch) == "host"
        assert [b.array for b in launch.blocks] == ["q", "k", "v", "dout"]
    broadcast = fa_plan.forward_plan(problem, capability=(9, 0), tma=True,
                                     k_strides=(0, 4 * 64, 64, 1))
    assert _read_path(broadcast.launch) == "device"
    assert _read_path(fa_plan.forward_plan(problem, capability=(9, 0), tma=True,
                                           k_strides=(0, 4 * 64, 64, 1),
                                           device_descriptors=False).launch) == "pointers"
    # Without device descriptors (fa_jax), host ones still serve the padded batch.
    assert _read_path(fa_plan.forward_plan(problem, capability=(9, 0), tma=True,
                                           device_descriptors=False).launch) == "host"
    packed_shape = (300, 4, 64)
    varlen = dict(cu_seqlens_q_shape=(3,), cu_seqlens_k_shape=(3,), cu_seqlens_q_dtype="int32",
                  cu_seqlens_k_dtype="int32", max_seqlen_q=200, max_seqlen_k=200)
    packed = fa_plan.check_problem(packed_shape, packed_shape, packed_shape, "bfloat16",
                                   "bfloat16", "bfloat16", varlen=varlen)
    assert _read_path(fa_plan.forward_plan(packed, capability=(9, 0), tma=True).launch) == "device"
    for launch in fa_plan.backward_plan(packed, capability=(9, 0), tma=True,
                                        device_descriptors=False).launches:
        assert "USE_TMA" not in launch.constexprs or _read_path(launch) == "pointers"
    # A launch description carries its descriptors whole (fa_jax's CPU target rebuilds it).
    assert fa_plan.Launch.from_json(fwd.launch.to_json()) == fwd.launch


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need sm_90")
@pytest.mark.parametrize("hold", [True, False], ids=["held-by-tma", "held-in-registers"])
@pytest.mark.parametrize("causal", [False, True])
def test_descriptor_backward_gives_the_same_bits(replace_entries, causal, hold):
    from fa_torch import _launch

    replace_entries(("dkdv", "dq"), tma=True, hold_tma=hold)

    seqlen = 700 if ON_GPU else 90
    q, k, v = random_qkv(2, seqlen, seqlen + 13, 4, 2, 64, "bfloat16", seed=12)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16", causal=causal)
    out, lse = forward_plan_torch(fa_plan.forward_plan(problem, capability=CAPABILITY),
                              launch_arrays(q, k, v))
    grads = {}
    for path, options in READ_PATHS.items():
        flag = options["tma"]
        bwd = fa_plan.backward_plan(problem, capability=CAPABILITY, has_dlse=False, **options)
        assert _read_path(bwd.dkdv) == path == _read_path(bwd.dq)
        held = flag and hold  # host descriptors hold blocks through their 2-D view
        assert bwd.dkdv.constexprs["HOLD_TMA"] == held == bwd.dq.constexprs["HOLD_TMA"]
        if flag:  # the launcher's fallback for unaligned arrays turns every flag off
            plain = launcher.without_tma(bwd.dkdv)
            assert _read_path(plain) == "pointers" and not plain.constexprs["HOLD_TMA"]
        arrays = launch_arrays(q, k, v, out=out, lse=lse, dout=dout)
        for launch in bwd.launches:
            _launch.run(launch, arrays, DEVICE)
        grads[path] = [arrays[name] for name in ("dq", "dk", "dv")]
    for path in READ_PATHS:
        for name, a, b in zip(("dq", "dk", "dv"), grads["pointers"], grads[path]):
            assert torch.equal(a, b), f"{name} through {path}"
    # Both front ends launch this table's kernels the same way: the same bits.
    _, _, t_grads = run_torch(q, k, v, dout, causal=causal)
    _, _, j_grads = run_jax(q, k, v, dout, causal=causal)
    for name, a, b in zip(("dq", "dk", "dv"), t_grads, j_grads):
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differs between fa_torch and fa_jax"


def _strided_views(layout, q, k, v, dout):
    """q, k, v, dout with the same values, laid out in memory as ``layout`` says."""
    if layout == "bhsd":  # (B, H, S, D) memory seen as (B, S, H, D)
        return [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, dout)]
    # "qkv": q, k, v slices of one fused (B, S, 3, H, D) tensor
    fused = torch.stack((q, k, v), dim=2)
    return [fused[:, :, 0], fused[:, :, 1], fused[:, :, 2], dout]


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need sm_90")
@pytest.mark.parametrize("layout", ["bhsd", "qkv"])
def test_held_blocks_through_host_descriptors_of_any_layout(replace_entries, layout):
    # Held blocks come through a 2-D host descriptor over the rows as memory lays them
    # out; the rows past a sequence's end are another head's or batch entry's, here
    # made infinite so that any of them reaching a stored value would show.
    from fa_torch import _launch

    replace_entries(("dkdv", "dq"), tma=True, hold_tma=True)
    seqlen = 700 if ON_GPU else 90
    q, k, v = random_qkv(2, seqlen, seqlen, 4, 4, 64, "bfloat16", seed=21)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q)
    q, k, v, dout = _strided_views(layout, q, k, v, dout)
    with torch.no_grad():  # batch entry 1, head 3: what the others' blocks run into
        for x in (q, k, v, dout):
            x[1, :, 3] = float("inf")
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16")
    strides = {f"{name}_strides": x.stride() for name, x in
               (("q", q), ("k", k), ("v", v), ("dout", dout))}
    fwd = fa_plan.forward_plan(problem, capability=CAPABILITY, q_strides=q.stride(),
                               k_strides=k.stride(), v_strides=v.stride())
    out, lse = forward_plan_torch(fwd, launch_arrays(q, k, v))
    grads = {}
    for path in ("pointers", "host"):
        bwd = fa_plan.backward_plan(problem, capability=CAPABILITY, has_dlse=False,
                                    out_strides=out.stride(), **strides, **READ_PATHS[path])
        assert _read_path(bwd.dkdv) == path
        assert bwd.dkdv.constexprs["HOLD_TMA"] == bwd.dq.constexprs["HOLD_TMA"] == (path == "host")
        arrays = launch_arrays(q, k, v, out=out, lse=lse, dout=dout)
        for launch in bwd.launches:
            _launch.run(launch, arrays, DEVICE)
        grads[path] = [arrays[name] for name in ("dq", "dk", "dv")]
    for name, a, b in zip(("dq", "dk", "dv"), grads["pointers"], grads["host"]):
        assert torch.isfinite(a[0]).all() and torch.isfinite(a[1, :, :3]).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                   msg=f"{name} through host descriptors, {layout}")


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need sm_90")
def test_unaligned_keys_fall_back_to_pointer_loads():
    # A view that starts 2 bytes into its storage: its strides are whole 16-byte units
    # (the plan allows descriptors) but its base is not (the launch falls back).
    q, k, v = random_qkv(1, 20, 300, 2, 2, 64, "bfloat16", seed=5)
    storage = torch.empty(k.numel() + 1, dtype=k.dtype, device=DEVICE)
    k_view = storage[1:].view(k.shape)
    k_view.copy_(k)
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16")
    tma = fa_plan.forward_plan(problem, capability=CAPABILITY, tma=True)
    inputs = [q, k_view, v]
    fitted = launcher.fit_to_arrays(tma.launch, inputs)
    assert not fitted.constexprs["USE_TMA"] and fitted.grid == tma.launch.grid
    assert launcher.fit_to_arrays(tma.launch, [q, k, v]) is tma.launch
    out, lse = forward_plan_torch(tma, launch_arrays(q, k_view, v))
    plain = fa_plan.forward_plan(problem, capability=CAPABILITY, tma=False)
    p_out, p_lse = forward_plan_torch(plain, launch_arrays(q, k, v))
    assert torch.equal(out, p_out) and torch.equal(lse, p_lse)


def test_descriptors_only_where_they_apply():
    q_shape = (1, 64, 2, 36)
    fp16 = fa_plan.check_problem(q_shape, q_shape, q_shape, "float16", "float16", "float16")
    # 36 fp16 values a row: 72 bytes, not whole 16-byte units
    assert not fa_plan.forward_plan(fp16, capability=(9, 0), tma=True).launch.constexprs["USE_TMA"]
    fp32 = fa_plan.check_problem(q_shape, q_shape, q_shape, "float32", "float32", "float32")
    assert fa_plan.forward_plan(fp32, capability=(9, 0), tma=True).launch.constexprs["USE_TMA"]
    # The table's flag, like the forced one, holds from sm_90 on.
    shape = (1, 4096, 2, 128)
    problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16")
    entry = configs.TileConfig(128, 64, 8, 3, tma=True)
    with configs.override(entries={("forward", 128, "bfloat16"): entry}):
        for capability, on in (((8, 0), False), ((9, 0), True)):
            flags = fa_plan.forward_plan(problem, capability=capability).launch.constexprs
            assert flags["USE_TMA"] == on and flags["BLOCK_M"] == 128
            forced = fa_plan.forward_plan(problem, capability=capability, tma=True).launch
            assert forced.constexprs["USE_TMA"] == on


# attention_forward_ws and attention_backward_dkdv_ws: the one-loop forward and dK/dV
# Triton's Hopper warp specialisation takes (plain scores; every block through host
# descriptors). The tables leave them off until measured; these tests turn them on.
WARP_SPECIALIZED = {  # (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window)
    "even-keys": (2, 128, 256, 2, 2, 64, False, (-1, -1)),
    "odd-lengths-gqa": (1, 150, 203, 4, 2, 64, False, (-1, -1)),
    "causal-gqa": (2, 130, 257, 4, 1, 64, True, (-1, -1)),
    "window": (1, 140, 190, 2, 2, 64, False, (40, 25)),
}


WARP_SPECIALIZED_KERNELS = pytest.mark.skipif(
    not HOPPER or (ON_GPU and not fa_plan.WARP_SPECIALIZED_ON_GPU),
    reason="tensor descriptors need sm_90; the warp-specialised kernels are interpreter-only "
           "until shown right on a GPU (plan.WARP_SPECIALIZED_ON_GPU)")


@pytest.fixture(params=["forward", "dkdv"])
def warp_specialized_kernel(request, replace_entries):
    """The table entry of one warp-specialised kernel turned on: (entry, kernel name)."""
    replace_entries((request.param,), tma=True, warp_specialize=True)
    return request.param, {"forward": "attention_forward_ws",
                           "dkdv": "attention_backward_dkdv_ws"}[request.param]


def _warp_specialized_problem(case, dtype="bfloat16"):
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window = WARP_SPECIALIZED[case]
    if ON_GPU:  # GPU-sized: each half sees many key blocks, and the programs fill the GPU
        seqlen_q, seqlen_k, batch = seqlen_q * 4, seqlen_k * 4, batch * 16  # (else: split)
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    kv_shape = (batch, seqlen_k, heads_k, head_dim)
    return fa_plan.check_problem(q_shape, kv_shape, kv_shape, dtype, dtype, dtype,
                                 causal=causal, window_size=window)


@WARP_SPECIALIZED_KERNELS
@pytest.mark.parametrize("case", WARP_SPECIALIZED)
def test_warp_specialized_against_reference(warp_specialized_kernel, run, case):
    problem = _warp_specialized_problem(case)
    from fa_torch import _launch as torch_launch

    # (as fa_torch plans it: with the GPU's multiprocessors, which may choose a split)
    sms = torch_launch.num_sms(torch.device(DEVICE))
    entry, kernel = warp_specialized_kernel
    chosen = (fa_plan.forward_plan(problem, capability=CAPABILITY, num_sms=sms).launch
              if entry == "forward" else fa_plan.backward_plan(problem, capability=CAPABILITY).dkdv)
    assert chosen.kernel == kernel
    batch, seqlen_q, heads_q, head_dim = problem.q_shape
    causal, window = WARP_SPECIALIZED[case][-2:]
    check_against_reference(run, batch, seqlen_q, problem.seqlen_k, heads_q, problem.heads_k,
                            head_dim, "bfloat16", causal, window_size=window)


@WARP_SPECIALIZED_KERNELS
@pytest.mark.parametrize("case", WARP_SPECIALIZED)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_warp_specialized_forward_against_the_plain_kernel(case, dtype):
    # The same key blocks in the same order and the same operations as attention_forward:
    # only the matmuls' tiles differ (two halves), which may round a sum's last bit. Both
    # front ends launch the same kernel: the same bits.
    problem = _warp_specialized_problem(case, dtype)
    q, k, v = random_qkv(problem.batch, problem.seqlen_q, problem.seqlen_k, problem.heads_q,
                         problem.heads_k, problem.head_dim, dtype, seed=5)
    plain = fa_plan.forward_plan(problem, capability=CAPABILITY, tma=True)
    ws = fa_plan.forward_plan(problem, capability=CAPABILITY, tma=True, warp_specialize=True)
    assert (plain.launch.kernel, ws.launch.kernel) == ("attention_forward", "attention_forward_ws")
    assert ws.launch.constexprs["BLOCK_N"] == plain.launch.constexprs["BLOCK_N"]
    out, lse = forward_plan_torch(plain, launch_arrays(q, k, v))
    ws_out, ws_lse = forward_plan_torch(ws, launch_arrays(q, k, v))
    unit = torch.finfo(out.dtype).eps
    assert (ws_out.float() - out.float()).abs().max().item() <= unit * out.abs().max().item()
    torch.testing.assert_close(ws_lse, lse, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    if ON_GPU:  # jax-triton launches no warp-specialised kernel whole (NOTES 41)
        return
    j_out, j_lse = forward_plan_jax(ws, launch_arrays(q, k, v))
    assert torch.equal(ws_out.cpu(), j_out) and torch.equal(ws_lse.cpu(), j_lse)


@WARP_SPECIALIZED_KERNELS
@pytest.mark.parametrize("case", WARP_SPECIALIZED)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_warp_specialized_dkdv_against_the_plain_kernel(replace_entries, case, dtype):
    # The same sums as attention_backward's dK/dV over the same queries; on the GPU the
    # query blocks may be cut otherwise (another fp32 order), so within the last bit of
    # the output dtype.
    problem = _warp_specialized_problem(case, dtype)
    q, k, v = random_qkv(problem.batch, problem.seqlen_q, problem.seqlen_k, problem.heads_q,
                         problem.heads_k, problem.head_dim, dtype, seed=7)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(q)
    causal, window = WARP_SPECIALIZED[case][-2:]
    grads = {}
    for warp_specialize in (False, True):
        replace_entries(("dkdv",), tma=True, warp_specialize=warp_specialize)
        assert fa_plan.backward_plan(problem, capability=CAPABILITY).dkdv.kernel == (
            "attention_backward_dkdv_ws" if warp_specialize else "attention_backward")
        grads[warp_specialize] = run_torch(q, k, v, dout, causal=causal, window_size=window)[2]
    unit = torch.finfo(q.dtype).eps
    for name, plain, ws in zip(("dq", "dk", "dv"), grads[False], grads[True]):
        assert (ws.float() - plain.float()).abs().max().item() <= \
            unit * plain.abs().max().item(), name


@WARP_SPECIALIZED_KERNELS
def test_warp_specialized_kernels_leave_unaligned_views_to_the_plain_ones(replace_entries):
    # The warp-specialised kernels read only through host descriptors, which need each
    # array to start on 16 bytes: fa_torch tells the plan where one does not, and the
    # plain kernels take the call (the same bits as with the table's entries off).
    import fa_torch

    q, k, v = random_qkv(1, 130, 190, 2, 2, 64, "bfloat16", seed=9)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(q)
    storage = torch.empty(k.numel() + 1, dtype=k.dtype, device=DEVICE)
    k_view = storage[1:].view(k.shape)  # (2 bytes in; whole 16-byte strides)
    k_view.copy_(k)
    leaves = (q.requires_grad_(), k_view.requires_grad_(), v.requires_grad_())
    results = {}
    for warp_specialize in (False, True):
        replace_entries(("forward", "dkdv"), tma=True, warp_specialize=warp_specialize)
        out, lse = fa_torch.attention(*leaves, causal=True, return_lse=True)
        results[warp_specialize] = (out, lse, *torch.autograd.grad(out, leaves, dout))
    for name, plain, ours in zip(("out", "lse", "dq", "dk", "dv"), results[False], results[True]):
        assert torch.equal(plain, ours), name


def test_warp_specialized_kernels_serve_only_on_gpus_allowed():
    # While plan.WARP_SPECIALIZED_ON_GPU is False a Hopper GPU keeps the plain kernels,
    # whatever the table or the caller asks; the interpreter takes them either way.
    shape = (2, 1024, 4, 128)
    problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16")
    for allowed in (False, True):
        with fa_plan.warp_specialized_on_gpu(allowed):
            for capability in (None, (9, 0)):
                expect = allowed or capability is None
                assert fa_plan.forward_plan(problem, capability=capability, tma=True,
                                            warp_specialize=True).launch.kernel == (
                    "attention_forward_ws" if expect else "attention_forward")
                assert fa_plan.backward_plan(problem, capability=capability, tma=True,
                                             warp_specialize=True).dkdv.kernel == (
                    "attention_backward_dkdv_ws" if expect else "attention_backward")


@pytest.fixture
def warp_specialized_on_gpu():
    with fa_plan.warp_specialized_on_gpu():
        yield


@pytest.mark.parametrize("capability", [None, (9, 0)])
@pytest.mark.parametrize("entry", ["forward", "dkdv"])
def test_warp_specialized_only_where_it_serves(warp_specialized_on_gpu, capability, entry):
    # Plain scores through host descriptors, on Hopper or the interpreter: everything
    # else (options, varlen, split or packed decode, fp32, D 32 or 96, sm_80, no host
    # descriptors) keeps the plain kernel, and so does the table while its entries leave
    # it off.
    shape, kv = (2, 1024, 4, 128), (2, 1024, 2, 128)

    def kernel(q=shape, k=kv, dtype="bfloat16", capability=capability, plan={}, **options):
        problem = fa_plan.check_problem(q, k, k, dtype, dtype, dtype, **options)
        plan = {"warp_specialize": True, **plan}
        if entry == "forward":
            launch = fa_plan.forward_plan(problem, capability=capability, tma=True, **plan).launch
            return launch.kernel[len("attention_forward"):] or "plain"
        if "num_splits" in plan or problem.seqlen_q == 1:
            return "plain"  # (forward-only options: the backward has no split or packing)
        launch = fa_plan.backward_plan(problem, capability=capability, tma=True, **plan).dkdv
        return {"attention_backward_dkdv_ws": "_ws", "attention_backward": "plain"}[launch.kernel]

    assert kernel() == kernel(causal=True) == kernel(window_size=(100, 0)) == "_ws"
    assert kernel(softcap=30.0) == kernel(dropout_p=0.1) == "plain"
    assert kernel(alibi_shape=(4,), alibi_dtype="float32") == "plain"
    assert kernel(bias_shape=(2, 4, 1024, 1024), bias_dtype="bfloat16") == "plain"
    assert kernel(dtype="float32") == kernel(q=(2, 1024, 4, 96), k=(2, 1024, 2, 96)) == "plain"
    assert kernel(q=(2, 1024, 4, 32), k=(2, 1024, 2, 32)) == "plain"  # (no table entry)
    assert kernel(plan=dict(host_descriptors=False)) == kernel(plan=dict(num_splits=2)) == "plain"
    assert kernel(q=(2, 1, 4, 128)) == "plain"  # packed GQA decode
    assert kernel(capability=(8, 0)) == kernel(plan=dict(warp_specialize=None)) == "plain"
    varlen = dict(cu_seqlens_q_shape=(3,), cu_seqlens_k_shape=(3,), cu_seqlens_q_dtype="int32",
                  cu_seqlens_k_dtype="int32", max_seqlen_q=512, max_seqlen_k=512)
    assert kernel(q=(1024, 4, 128), k=(1024, 2, 128), varlen=varlen) == "plain"
    if capability is not None:  # blocks of 64 rows at least (wgmma's rows)
        assert kernel(q=(2, 32, 4, 128)) == "plain"


def test_warp_specialized_entries_keep_the_forward_key_blocks():
    # Each attention_forward_ws tile reads the key blocks of the forward entry it stands
    # in for (the same sums in the same order), with 4 warps (what the pass takes) and
    # within the H200's shared memory.
    for (kernel, block_d), ws in configs._GPU_16BIT.items():
        if kernel != "forward_ws":
            continue
        assert ws.block_n == configs._GPU_16BIT[("forward", block_d)].block_n
        assert ws.num_warps == 4 and ws.block_m == 128
        assert configs.shared_memory("forward_ws", ws, block_d, 2) <= \
            configs.shared_memory_limit((9, 0))


# The Gluon forward (fa_kernels.gluon_forward): Hopper GPUs only (Gluon has no
# interpreter), chosen where the forward entry's ``gluon`` flag is on.
GLUON = pytest.mark.skipif(not ON_GPU or CAPABILITY != (9, 0),
                           reason="the Gluon forward runs on sm_90 GPUs")

# Grids of at least 0.8 x two programs an SM on every Hopper part (114 or 132 SMs), so
# that fa_torch's plan does not split the keys (split-KV keeps the Triton forward).
GLUON_CASES = {  # (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window)
    "d64": (4, 1000, 1000, 8, 8, 64, False, (-1, -1)),
    "d128-causal-gqa": (4, 1037, 1037, 8, 2, 128, True, (-1, -1)),
    "d128-odd-lengths": (5, 333, 1077, 16, 16, 128, False, (-1, -1)),
    "d128-causal-more-queries": (4, 700, 300, 16, 4, 128, True, (-1, -1)),
    "d256-causal": (4, 517, 517, 12, 12, 256, True, (-1, -1)),
    "d128-window": (4, 900, 1100, 16, 8, 128, False, (200, 50)),
}


@pytest.mark.parametrize("num_sms", [114, 132])
@pytest.mark.parametrize("case", GLUON_CASES)
def test_gluon_cases_reach_the_gluon_forward(replace_entries, case, num_sms):
    # On the CPU, what the GPU tests below take for granted: with the flag on, fa_torch's
    # plan for each case (its num_sms passed) launches the Gluon kernel, not split-KV.
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window = GLUON_CASES[case]
    replace_entries(("forward",), gluon=True)
    shape, kv = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim)
    problem = fa_plan.check_problem(shape, kv, kv, "bfloat16", "bfloat16", "bfloat16",
                                    causal=causal, window_size=window)
    launch = fa_plan.forward_plan(problem, capability=(9, 0), num_sms=num_sms).launch
    assert launch.kernel == "attention_forward_gluon"
    assert launch.grid[0] == -(-seqlen_q // 128)


# The two compute warpgroups in step, or taking the tensor cores in turns (ping_pong).
GLUON_SCHEDULES = {"in-step": False, "ping-pong": True}


@GLUON
@pytest.mark.parametrize("schedule", GLUON_SCHEDULES)
@pytest.mark.parametrize("case", GLUON_CASES)
def test_gluon_forward_against_reference(replace_entries, case, schedule):
    # Outputs, LSE and (through the Triton backward, from the Gluon forward's O and LSE)
    # gradients against float64, through fa_torch. fa_jax keeps the Triton forward
    # (jax-triton launches no warp-specialised Gluon kernel: fa_jax._launch.LAUNCHES_GLUON).
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window = GLUON_CASES[case]
    replace_entries(("forward",), gluon=True)
    replace_entries(("forward_gluon",), ping_pong=GLUON_SCHEDULES[schedule])
    from fa_torch import _launch as torch_launch

    shape, kv = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim)
    problem = fa_plan.check_problem(shape, kv, kv, "bfloat16", "bfloat16", "bfloat16",
                                    causal=causal, window_size=window)
    sms = torch_launch.num_sms(torch.device(DEVICE))
    chosen = fa_plan.forward_plan(problem, capability=CAPABILITY, num_sms=sms).launch.kernel
    assert chosen == "attention_forward_gluon"
    check_against_reference(run_torch, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
                            "bfloat16", causal, window_size=window)


@GLUON
@pytest.mark.parametrize("schedule", GLUON_SCHEDULES)
@pytest.mark.parametrize("case", GLUON_CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gluon_forward_against_the_plain_kernel(replace_entries, case, dtype, schedule):
    # The same online softmax over the same keys; the blocks and the matmuls' tiles
    # differ, so a sum's last bits may: within one unit of the dtype, the LSE within a
    # few of fp32's. In turns or in step, the warpgroups compute the same rows alike.
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window = GLUON_CASES[case]
    replace_entries(("forward_gluon",), ping_pong=GLUON_SCHEDULES[schedule])
    shape, kv = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim)
    problem = fa_plan.check_problem(shape, kv, kv, dtype, dtype, dtype, causal=causal,
                                    window_size=window)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, seed=5)
    plain = fa_plan.forward_plan(problem, capability=CAPABILITY, gluon=False)
    fast = fa_plan.forward_plan(problem, capability=CAPABILITY, gluon=True)
    assert (plain.launch.kernel, fast.launch.kernel) == ("attention_forward",
                                                         "attention_forward_gluon")
    out, lse = forward_plan_torch(plain, launch_arrays(q, k, v))
    fast_out, fast_lse = forward_plan_torch(fast, launch_arrays(q, k, v))
    assert torch.isfinite(fast_out).all()
    unit = torch.finfo(out.dtype).eps
    assert (fast_out.float() - out.float()).abs().max().item() <= 2 * unit * out.abs().max().item()
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(fast_lse))
    torch.testing.assert_close(fast_lse[finite], lse[finite],
                               rtol=8 * torch.finfo(torch.float32).eps, atol=1e-5)


def test_gluon_forward_only_where_it_serves():
    # Plain 16-bit scores (any window) with D 64/128/256 through host descriptors, on an
    # sm_90 GPU, a front end that launches Gluon, a tile's worth of rows: everything else
    # keeps the Triton kernel, and so does the table while its forward entries leave
    # ``gluon`` off.
    shape, kv = (2, 4096, 8, 128), (2, 4096, 2, 128)

    def kernel(q=shape, k=kv, dtype="bfloat16", capability=(9, 0), plan={}, **options):
        problem = fa_plan.check_problem(q, k, k, dtype, dtype, dtype, **options)
        launch = fa_plan.forward_plan(problem, capability=capability,
                                      **{"gluon": True, **plan}).launch
        return launch.kernel[len("attention_forward_"):] or "plain"

    assert kernel() == kernel(causal=True) == kernel(window_size=(100, 0)) == "gluon"
    assert kernel(dtype="float16") == "gluon"
    for d in (64, 256):
        assert kernel(q=(2, 4096, 8, d), k=(2, 4096, 2, d)) == "gluon"
    assert kernel(softcap=30.0) == kernel(dropout_p=0.1) == "plain"
    assert kernel(alibi_shape=(8,), alibi_dtype="float32") == "plain"
    assert kernel(bias_shape=(2, 8, 4096, 4096), bias_dtype="bfloat16") == "plain"
    assert kernel(dtype="float32") == kernel(q=(2, 4096, 8, 96), k=(2, 4096, 2, 96)) == "plain"
    assert kernel(plan=dict(host_descriptors=False)) == kernel(plan=dict(num_splits=2)) == "plain"
    assert kernel(plan=dict(launches_gluon=False)) == kernel(plan=dict(gluon=None)) == "plain"
    assert kernel(capability=(8, 0)) == kernel(capability=None) == "plain"
    assert kernel(q=(2, 1, 8, 128)) == kernel(q=(2, 64, 8, 128)) == "plain"  # a tile's rows
    assert kernel(plan=dict(q_strides=(4096 * 8 * 128, 8 * 128, 128, 1),
                            k_strides=(4096 * 2 * 136, 2 * 136, 136, 1))) == "gluon"
    assert kernel(plan=dict(k_strides=(4096 * 2 * 129, 2 * 129, 129, 1))) == "plain"
    varlen = dict(cu_seqlens_q_shape=(3,), cu_seqlens_k_shape=(3,), cu_seqlens_q_dtype="int32",
                  cu_seqlens_k_dtype="int32", max_seqlen_q=2048, max_seqlen_k=2048)
    assert kernel(q=(4096, 8, 128), k=(4096, 2, 128), varlen=varlen) == "plain"
    # The launch: 128 rows for two compute warpgroups, the load warp's warpgroup on top,
    # and the registers of one program a multiprocessor shared out over all twelve warps.
    problem = fa_plan.check_problem(shape, kv, kv, "bfloat16", "bfloat16", "bfloat16",
                                    causal=True)
    launch = fa_plan.forward_plan(problem, capability=(9, 0), gluon=True).launch
    assert launch.grid == (4096 // 128, 8, 2) and launch.num_warps == 8
    assert launch.maxnreg == 65536 // (12 * 32) // 8 * 8 == 168
    assert fa_plan.Launch.from_json(launch.to_json()) == launch  # (maxnreg carried too)
    assert launch.constexprs["GROUP_SIZE"] == 4 and launch.constexprs["LIMIT_RIGHT"]
    assert [b.block_shape for b in launch.blocks] == [(1, 128, 1, 128), (1, 128, 1, 128),
                                                      (1, 128, 1, 128)]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gluon_ping_pong_launch(replace_entries, head_dim):
    # In turns: the kernel's own warps are the first compute warpgroup (4), the second is a
    # partition of its own; the program keeps its 128 rows and 12 warps, and the registers
    # the partitions ask fit the program's (Triton gives the first warpgroup what is left).
    shape = (4, 4096, 16, head_dim)
    problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16",
                                    causal=True)
    in_step = fa_plan.forward_plan(problem, capability=(9, 0), gluon=True).launch
    replace_entries(("forward_gluon",), ping_pong=True)
    launch = fa_plan.forward_plan(problem, capability=(9, 0), gluon=True).launch
    assert launch.kernel == in_step.kernel == "attention_forward_gluon"
    assert (launch.num_warps, in_step.num_warps) == (4, 8)
    assert launch.constexprs["PING_PONG"] and not in_step.constexprs["PING_PONG"]
    assert launch.constexprs["BLOCK_M"] == in_step.constexprs["BLOCK_M"] == 128
    assert launch.grid == in_step.grid and launch.maxnreg == in_step.maxnreg == 168
    compute, load = launch.constexprs["COMPUTE_REGISTERS"], launch.constexprs["LOAD_REGISTERS"]
    assert (compute, load) == (240, 24) and compute % 8 == 0
    assert 2 * compute + load <= 3 * launch.maxnreg  # three warpgroups' share of the SM
    # 64-row tiles have one compute warpgroup: nothing to take turns with
    replace_entries((), entries={("forward_gluon", head_dim, "bfloat16"):
                                 configs.TileConfig(64, 64, 4, 2, tma=True, ping_pong=True)})
    assert fa_plan.forward_plan(problem, capability=(9, 0), gluon=True).launch.kernel == \
        "attention_forward"


@pytest.mark.parametrize("head_dim, tile, programs", [
    (128, None, 1),               # the table's 128-row tiles: one program an SM
    (64, None, 1),
    (256, None, 1),
    (128, (64, 64, 4, 2), 2),     # one compute warpgroup, 82 KB: two programs
    (128, (64, 64, 4, 3), 2),     # 115 KB: two just fit the SM's 228 KB
    (128, (64, 128, 4, 2), 1),    # 148 KB: one
    (64, (64, 128, 4, 2), 2),
    (256, (64, 64, 4, 2), 1),     # D / 2 accumulator registers would not fit 128
])
def test_gluon_registers_shared_by_the_programs_an_sm_runs(replace_entries, head_dim, tile,
                                                            programs):
    # The Gluon forward's register cap is the SM's registers over the warps of the programs
    # it runs at once (at most 255 a thread): 168 for one program of 12 warps, 128 for two
    # of 8 (a load warpgroup and one compute warpgroup each).
    shape = (4, 4096, 16, head_dim)
    if tile is not None:
        replace_entries((), entries={("forward_gluon", head_dim, "bfloat16"):
                                     configs.TileConfig(*tile, tma=True)})
    problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16")
    launch = fa_plan.forward_plan(problem, capability=(9, 0), gluon=True).launch
    cfg = configs.tile_config("forward_gluon", head_dim, "bfloat16", 4096, 4096, (9, 0))
    assert launch.kernel == "attention_forward_gluon"
    assert (launch.constexprs["BLOCK_M"], launch.num_warps) == (cfg.block_m, cfg.num_warps)
    assert fa_plan.gluon_programs_per_sm(problem, cfg) == programs
    warps = cfg.num_warps + 4
    assert launch.maxnreg == min(65536 // (warps * 32 * programs), 255) // 8 * 8
    if programs == 2:
        assert launch.maxnreg == 128
        assert 2 * (configs.shared_memory("forward_gluon", cfg, head_dim, 2) + 1024) <= \
            configs.shared_memory_per_sm((9, 0))


def test_gluon_entries_fit_and_stay_off():
    # Each Gluon tile: 16 rows a warp (wgmma's 64 a warpgroup), within the H100's shared
    # memory; and no forward entry takes the kernel before a GPU run has measured it.
    for (kernel, block_d), entry in configs._GPU_16BIT.items():
        if kernel == "forward_gluon":
            assert entry.block_m == 16 * entry.num_warps and entry.num_stages >= 2
            assert configs.shared_memory(kernel, entry, block_d, 2) <= \
                configs.shared_memory_limit((9, 0))
        assert not entry.gluon
