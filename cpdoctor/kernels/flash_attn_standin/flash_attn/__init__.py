"""cpdoctor's CPU stand-in of flash-attn 2 (NOT the real package). Only on sys.path when cpdoctor emulates the
CUDA kernels (`--emulate`); see cpdoctor/kernels/standins.py and flash_attn_interface.py here."""

__version__ = "2.6.3+cpdoctor.standin"

from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402,F401
