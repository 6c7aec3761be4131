"""``flash_attn`` backed by fa_torch, for running flash-attn's own test file
(scripts/flash_attn_tests.sh). Not installed with the package."""
from fa_torch import (flash_attn_func, flash_attn_kvpacked_func,  # noqa: F401
                      flash_attn_qkvpacked_func, flash_attn_varlen_func,
                      flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                      flash_attn_with_kvcache)
