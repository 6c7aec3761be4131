"""Plan kernel names -> Triton kernels. Importing this imports triton."""
from . import runtime

if runtime.interpreting():
    from . import interpreter

    interpreter.apply()

from .backward import (  # noqa: E402
    attention_backward_dkdv,
    attention_backward_dq,
    attention_backward_preprocess,
)
from .dropout import dropout_mask  # noqa: E402
from .forward import attention_forward, attention_forward_combine  # noqa: E402

KERNELS = {
    "attention_forward": attention_forward,
    "attention_forward_combine": attention_forward_combine,
    "attention_backward_preprocess": attention_backward_preprocess,
    "attention_backward_dkdv": attention_backward_dkdv,
    "attention_backward_dq": attention_backward_dq,
    "dropout_mask": dropout_mask,
}
