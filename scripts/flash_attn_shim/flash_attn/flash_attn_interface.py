"""flash-attn's interface module: fa_torch's names, and what its tests import from it."""
from fa_torch.flash_attn_interface import *  # noqa: F401,F403
from fa_torch.flash_attn_interface import _get_block_size_n  # noqa: F401

USE_TRITON_ROCM = False
