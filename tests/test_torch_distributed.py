"""fa_torch across processes: ring attention over torch.distributed, and a layer under
DistributedDataParallel. Two processes over gloo on the CPU (Triton's interpreter), or
NCCL with one GPU each where there are two GPUs."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fa_kernels import runtime

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, check):
    on_gpu = not runtime.interpreting()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD)
    try:
        check(rank, device)
    finally:
        dist.destroy_process_group()


def _spawn(check):
    if not runtime.interpreting() and torch.cuda.device_count() < WORLD:
        pytest.skip("needs 2 GPUs (NCCL), or the CPU (gloo)")
    mp.spawn(_worker, args=(_free_port(), check), nprocs=WORLD, join=True)


def _check_ring(rank, device):
    import fa_torch
    from fa_torch import ring

    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        q = torch.randn(2, 32, 4, 16, generator=gen).to(dtype).to(device)
        k, v = (torch.randn(2, 32, 2, 16, generator=gen).to(dtype).to(device) for _ in range(2))
        dout = torch.randn(q.shape, generator=gen).to(dtype).to(device)
        for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag")):
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            expected = fa_torch.attention(*full, causal=causal)
            expected.backward(dout)
            local = [ring.shard(x, rank, WORLD, layout).detach().requires_grad_()
                     for x in (q, k, v)]
            out = ring.ring_attention(*local, causal=causal, layout=layout)
            out.backward(ring.shard(dout, rank, WORLD, layout))
            pairs = [(out, ring.shard(expected, rank, WORLD, layout))]
            pairs += [(x.grad, ring.shard(f.grad, rank, WORLD, layout))
                      for x, f in zip(local, full)]
            for got, want in pairs:
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                                           msg=f"{dtype} causal={causal} {layout}")


def _check_ddp(rank, device):
    import fa_torch
    from torch.nn.parallel import DistributedDataParallel

    def make():
        torch.manual_seed(0)  # the same weights on every rank, and for the reference
        return fa_torch.nn.MultiheadAttention(32, 4, 2, causal=True).to(device)

    inputs = [torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(r)).to(device)
              for r in range(WORLD)]
    model = DistributedDataParallel(make())
    model(inputs[rank]).square().mean().backward()
    reference = make()
    for x in inputs:  # DDP averages the ranks' gradients
        (reference(x).square().mean() / WORLD).backward()
    for p, r in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=1e-5)


def test_ring_attention_equals_unsharded():
    _spawn(_check_ring)


def test_layer_under_distributed_data_parallel():
    _spawn(_check_ddp)


def test_ring_validates_before_any_communication():
    from fa_torch import ring

    q = torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="local seqlen must be even"):
        ring.ring_attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring.ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        ring.ring_attention(q[0], q, q)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        ring.ring_attention(q, q.numpy(), q)
