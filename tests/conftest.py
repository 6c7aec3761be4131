import os

# Four host devices for the sharding tests; must be set before jax initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# Several pytest workers share one GPU: no process may grab 75% of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import fa_kernels  # noqa: E402,F401  (interpreter on before anything imports triton)
import pytest  # noqa: E402

from fa_kernels import runtime  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not runtime.interpreting():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU-sized or GPU-only test)")
    for item in items:
        if "gpu" in item.keywords or "large" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["torch", "jax"])
def front(request):
    """A test that takes ``front`` runs once per front end ("torch", "jax")."""
    return request.param


@pytest.fixture
def run(front):
    """That front end's runner: ``run(q, k, v, dout, **options)`` -> out, lse, grads."""
    from .common import RUNNERS

    return RUNNERS[front]
