"""Plan kernel names -> Triton kernels. Importing this imports triton."""
from . import runtime

if runtime.interpreting():
    from . import interpreter

    interpreter.apply()

from .backward import (attention_backward, attention_backward_dkdv_ws,  # noqa: E402
                       attention_backward_preprocess)
from .dropout import dropout_mask  # noqa: E402
from .forward import (attention_forward, attention_forward_combine,  # noqa: E402
                      attention_forward_ws)

KERNELS = {
    "attention_forward": attention_forward,
    "attention_forward_combine": attention_forward_combine,
    "attention_forward_ws": attention_forward_ws,
    "attention_backward_preprocess": attention_backward_preprocess,
    "attention_backward": attention_backward,
    "attention_backward_dkdv_ws": attention_backward_dkdv_ws,
    "dropout_mask": dropout_mask,
}

# Gluon kernels: compiled only (Gluon has no interpreter: the plan never chooses them
# there). Their host descriptors carry the shared-memory layout (launcher, offline).
GLUON_KERNELS = frozenset({"attention_forward_gluon"})
if not runtime.interpreting():
    from .gluon_forward import attention_forward_gluon  # noqa: E402

    KERNELS["attention_forward_gluon"] = attention_forward_gluon


def scalar_arguments(launch) -> tuple:
    """``launch.scalars`` in its kernel's parameter order (they follow the inputs and the
    ``*Blocks`` parameters, and precede the outputs). A name the kernel does not take, or one it takes that the
    launch lacks, is a TypeError here rather than a shifted argument in the kernel."""
    kernel = KERNELS[launch.kernel]
    names = [n for n in kernel.arg_names if n not in launch.constexprs]
    names = names[len(launch.inputs) + len(launch.blocks):len(names) - len(launch.outputs)]
    if set(names) != set(launch.scalars) or len(names) != len(launch.scalars):
        raise TypeError(f"{launch.kernel} takes the scalars {names}; the launch has "
                        f"{list(launch.scalars)}")
    return tuple(launch.scalars[n] for n in names)
