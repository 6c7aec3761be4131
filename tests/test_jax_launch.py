"""fa_jax's launch path: errors reach the caller, no torch is needed, and a jitted call
survives jax.export and jax's persistent compilation cache across processes."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_jax
from fa_jax import _launch
from fa_kernels import registry

from .common import ON_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inputs(seed=0, shape=(2, 40, 2, 32), dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys]


def run_python(code: str, env=None, timeout=600) -> str:
    """Run ``code`` in a fresh interpreter from the repo root; its stdout, or the failure."""
    env = dict(os.environ, **(env or {}))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


class Broken:
    """A kernel whose launch fails, as an interpreter error inside a kernel would."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("forced failure inside the launch")
        return launch


@pytest.mark.skipif(ON_GPU, reason="the CPU path: on the GPU jaxlib launches (jax_triton)")
@pytest.mark.parametrize("kernel", ["attention_forward", "attention_backward"])
def test_failed_launch_raises_and_returns_nothing(monkeypatch, kernel):
    q, k, v = inputs()
    loss = lambda q, k, v: fa_jax.attention(q, k, v, causal=True).astype(jnp.float32).sum()  # noqa: E731
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    good = jax.block_until_ready(step(q, k, v))
    monkeypatch.setitem(registry.KERNELS, kernel, Broken(registry.KERNELS[kernel]))
    for call in (step, jax.value_and_grad(loss, argnums=(0, 1, 2))):
        with pytest.raises(Exception, match="forced failure inside the launch") as failure:
            jax.block_until_ready(call(q, k, v))
        assert "attention" in str(failure.value) or "fa_jax" in str(failure.value)
    monkeypatch.undo()
    again = step(q, k, v)  # nothing stale: the next call computes as before
    for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_no_torch_in_a_jax_process():
    # A JAX user installs jax, jax-triton and triton: with every import of torch refused,
    # fa_jax imports, computes and differentiates (GPU: jax_triton; CPU: the interpreter).
    out = run_python("""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError(f"No module named {name!r}")

        sys.meta_path.insert(0, NoTorch())
        import jax, jax.numpy as jnp, numpy as np
        import fa_jax

        q, k, v = (jax.random.normal(jax.random.key(i), (1, 37, 2, 32)) for i in range(3))
        loss = lambda f: lambda q: f(q, k, v).sum()
        ours = fa_jax.attention(q, k, v, causal=True)
        grad = jax.grad(loss(lambda *a: fa_jax.attention(*a, causal=True)))(q)
        with jax.default_matmul_precision("highest"):  # fp32 products on the GPU, as ours
            theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            grad_ref = jax.grad(loss(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)))(q)
        np.testing.assert_allclose(ours, theirs, atol=2e-5)
        np.testing.assert_allclose(grad, grad_ref, atol=2e-5)
        print("torch" in sys.modules)
    """)
    assert out.split()[-1] == "False"


def test_export_round_trip():
    q, k, v = inputs(1)
    step = jax.jit(lambda q, k, v: fa_jax.attention(q, k, v, causal=True, return_lse=True))
    exported = jax.export.export(step, disabled_checks=fa_jax.export_checks())(q, k, v)
    restored = jax.export.deserialize(exported.serialize())
    for a, b in zip(step(q, k, v), restored.call(q, k, v)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="custom call"):  # jax's check, without ours lifted
        jax.export.export(step)(q, k, v)


def test_export_and_compilation_cache_across_processes(tmp_path):
    # Process one exports a jitted forward+backward and fills jax's persistent cache;
    # process two (a fresh interpreter that imports fa_jax) runs the deserialised export
    # and the same jitted function, which compiles nothing new: the same bits each way.
    script = f"""
        import os, sys
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path / "cache")!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        import fa_jax

        keys = jax.random.split(jax.random.key(3), 3)
        q, k, v = (jax.random.normal(key, (2, 40, 2, 32)).astype(jnp.bfloat16) for key in keys)

        def loss(q, k, v):
            return (fa_jax.attention(q, k, v, causal=True).astype(jnp.float32) ** 2).sum()

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float32))
                                            for x in jax.tree.leaves(tree)])
        blob = {str(tmp_path / "step.bin")!r}
        if sys.argv[-1] == "first":
            exported = jax.export.export(step, disabled_checks=fa_jax.export_checks())
            open(blob, "wb").write(exported(q, k, v).serialize())
            np.save({str(tmp_path / "first.npy")!r}, flat(step(q, k, v)))
        else:
            # The export runs first: nothing but the import has registered fa_jax's target.
            restored = jax.export.deserialize(bytearray(open(blob, "rb").read()))
            again = flat(restored.call(q, k, v))
            first = np.load({str(tmp_path / "first.npy")!r})
            np.testing.assert_array_equal(again, first)
            np.testing.assert_array_equal(flat(step(q, k, v)), first)
        print(sorted(f for f in os.listdir({str(tmp_path / "cache")!r}) if f.startswith("jit_loss")))
    """
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    listings = []
    for which in ("first", "second"):
        result = subprocess.run([sys.executable, str(path), which], cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        listings.append(result.stdout.strip().splitlines()[-1])
    assert listings[0] != "[]"  # the jitted step's entry
    assert listings[1] == listings[0], "the second process compiled the step again (no cache hit)"


@pytest.mark.skipif(not ON_GPU, reason="the GPU path")
def test_gpu_launch_builds_no_descriptors_on_the_device():
    # Descriptors built inside a kernel need global scratch, which jaxlib allocates inside
    # the launch, where XLA's command buffers cannot capture it. jax-triton 0.4 passes
    # descriptors made on the host (no scratch), 0.3.1 passes none: the plan reads tiles
    # through those or through pointers, and a launch that would build descriptors on the
    # device is refused before lowering.
    from fa_kernels import plan as fa_plan

    shape = (1, 4096, 2, 128)  # long enough for the table to read K/V through descriptors
    problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16")
    capability = _launch.capability()
    fwd = fa_plan.forward_plan(problem, capability=capability, **_launch.plan_options())
    constexprs = fwd.launch.constexprs
    assert not constexprs["USE_TMA"] or constexprs["HOST_TMA"]
    if capability < (9, 0):
        return
    release = _launch.jax_triton_release()
    assert bool(constexprs["HOST_TMA"]) == release.host_descriptors
    assert [b.host_descriptor for b in fwd.launch.blocks] == [release.host_descriptors] * 2
    device = fa_plan.forward_plan(problem, capability=capability, tma=True,
                                  host_descriptors=False)
    assert device.launch.constexprs["USE_TMA"] and not device.launch.constexprs["HOST_TMA"]
    q, k, v = inputs(shape=shape)
    with pytest.raises(ValueError, match="descriptors"):
        _launch.run(device.launch, {"q": q, "k": k, "v": v, **{
            n: _launch.placeholder() for n in device.launch.inputs if n not in "qkv"}})


@pytest.mark.skipif(not ON_GPU, reason="XLA's command buffers (CUDA graphs) are on the GPU")
def test_jitted_training_loop_in_xla_command_buffers():
    # A loop body with several kernels and fusions is what XLA turns into a CUDA graph.
    # With jax-triton 0.4 and device-built descriptors this failed: "Failed to create a
    # child graph node ... CUDA_ERROR_NOT_SUPPORTED". The loop must give what the same
    # steps give one jitted call at a time.
    q, k, v = inputs(shape=(2, 2048, 4, 128))

    def step(q, _):
        out, vjp = jax.vjp(lambda q: fa_jax.attention(q, k, v, causal=True), q)
        (dq,) = vjp(out)
        return (q.astype(jnp.float32) - 1e-2 * dq.astype(jnp.float32)).astype(q.dtype), \
            out.astype(jnp.float32).sum()

    looped_q, looped_sums = jax.jit(lambda q: jax.lax.scan(step, q, None, length=3))(q)
    one_step = jax.jit(step)
    sums = []
    for _ in range(3):
        q, total = one_step(q, None)
        sums.append(total)
    np.testing.assert_array_equal(np.asarray(looped_q, np.float32), np.asarray(q, np.float32))
    # (XLA may order a reduction differently inside the loop)
    np.testing.assert_allclose(np.asarray(looped_sums), np.asarray(jnp.stack(sums)), rtol=1e-5)


def test_ptx_is_written_for_the_oldest_ptxas_xla_may_use(tmp_path, monkeypatch):
    # jax-triton hands XLA PTX, and XLA's ptxas (CUDA 13.0 beside jaxlib 0.11) refuses the
    # PTX 9.4 that Triton 3.9 writes for its own ptxas. Fake ptxas binaries of three CUDA
    # releases, where XLA looks: the flag, $PATH and $CUDA_HOME.
    for release in ("13.0", "12.8", "11.8"):
        folder = tmp_path / release / "bin"
        folder.mkdir(parents=True)
        ptxas = folder / "ptxas"
        ptxas.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, "
                         f"V{release}.41'\n")
        ptxas.chmod(0o755)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_gpu_cuda_data_dir={tmp_path / '13.0'}")
    monkeypatch.setenv("PATH", f"{tmp_path / '12.8' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "11.8"))
    releases = _launch.ptxas_releases()
    assert releases[0] == "13.0" and {"12.8", "11.8"} <= set(releases)
    _launch.xla_ptx_version.cache_clear()
    try:
        # 12.8 takes PTX 8.7 at most; 11.8 is older than XLA accepts and does not count.
        assert 80 <= _launch.xla_ptx_version(90) <= 87
    finally:
        _launch.xla_ptx_version.cache_clear()
