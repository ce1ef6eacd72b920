"""cpdoctor's CPU stand-in of flash-attn 2 (NOT the real package). Only on sys.path when cpdoctor emulates the
CUDA kernels (`--emulate`, and every peer examination on a CPU); see cpdoctor/cpu_kernels/standins.py and
flash_attn_interface.py here. Exports what flash-attn's own flash_attn/__init__.py exports (v2.7.4), less
flash_attn_with_kvcache (inference with a paged KV cache: not emulated)."""

__version__ = "2.6.3+cpdoctor.standin"

from flash_attn.flash_attn_interface import (  # noqa: E402,F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
