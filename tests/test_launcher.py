"""fa_kernels.launcher: the JIT once per specialisation, then the compiled kernel.

On the GPU every test launches through it; here a stand-in JIT kernel checks the
bookkeeping: what is cached, what makes a new specialisation, the argument order."""
from fa_kernels import launcher, plan, registry


class Array:
    def __init__(self, address, dtype="bfloat16"):
        self.address, self.dtype = address, dtype

    def data_ptr(self):
        return self.address


class Compiled:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        def run(*args):
            self.calls.append(("compiled", grid, args))
        return run


class Jit:
    arg_names = ["A", "B", "alpha", "n", "Out", "BLOCK", "FLAG"]

    def __init__(self, calls):
        self.calls = calls
        self.compiled = Compiled(calls)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return self.compiled
        return run


def stand_in(monkeypatch, calls):
    monkeypatch.setitem(registry.KERNELS, "stand_in", Jit(calls))
    monkeypatch.setattr(launcher, "_COMPILED", {})
    return plan.Launch(kernel="stand_in", grid=(3, 2, 1), inputs=("a", "b"), scalars=dict(n=7, alpha=0.5),
                       outputs=(plan.Output("out", (4,), "bfloat16"),),
                       constexprs=dict(FLAG=True, BLOCK=64), num_warps=4, num_stages=2)


def test_compiled_kernel_reused_per_specialisation(monkeypatch):
    calls = []
    launch = stand_in(monkeypatch, calls)
    a, b, out = Array(256), Array(512), Array(1024)
    launcher.launch(launch, [a, b], [out], 0)
    assert calls[-1] == ("jit", (3, 2, 1), (a, b, 0.5, 7, out),
                         dict(num_warps=4, num_stages=2, FLAG=True, BLOCK=64))
    launcher.launch(launch, [a, b], [out], 0)
    # constexprs follow in the kernel's signature order, not the plan's dict order
    assert calls[-1] == ("compiled", (3, 2, 1), (a, b, 0.5, 7, out, 64, True))
    jit_calls = sum(c[0] == "jit" for c in calls)
    launcher.launch(launch, [Array(260), b], [out], 0)  # not 16-byte aligned: a new kernel
    launcher.launch(launch, [Array(256, "float16"), b], [out], 0)  # another dtype
    launcher.launch(launch, [a, b], [out], 1)  # another device
    assert sum(c[0] == "jit" for c in calls) == jit_calls + 3
    launcher.launch(launch, [Array(4096), Array(8192)], [Array(2048)], 0)  # same kind: reused
    assert calls[-1][0] == "compiled"


def test_interpreter_launches_every_call_one_at_a_time(monkeypatch):
    # device None is Triton's interpreter: nothing is cached (each call runs the kernel),
    # and the launch holds the lock that keeps two interpreted kernels apart.
    calls = []
    launch = stand_in(monkeypatch, calls)
    held = []
    monkeypatch.setattr(Jit, "__getitem__", lambda self, grid: lambda *args, **kwargs: (
        held.append(launcher._INTERPRETER_LOCK.locked()), calls.append(("jit", grid, args))))
    a, b, out = Array(256), Array(512), Array(1024)
    launcher.launch(launch, [a, b], [out], None)
    launcher.launch(launch, [a, b], [out], None)
    assert calls == [("jit", (3, 2, 1), (a, b, 0.5, 7, out))] * 2
    assert held == [True, True] and launcher._COMPILED == {}
