"""Backend requirements read from diffusers' source without importing it (compat/requirements.py)."""

from __future__ import annotations

from cpdoctor.compat.requirements import parse_requirements

SOURCE = """
_REQUIRED_FLASH_VERSION = "2.6.3"

class AttentionBackendName(str, Enum):
    FLASH = "flash"
    FLASH_VARLEN = "flash_varlen"
    FLASH_HUB = "flash_hub"
    NATIVE = "native"

def _check_attention_backend_requirements(backend: AttentionBackendName) -> None:
    if backend in [AttentionBackendName.FLASH, AttentionBackendName.FLASH_VARLEN]:
        if not _CAN_USE_FLASH_ATTN:
            raise RuntimeError(
                f"Flash Attention backend '{backend.value}' is not usable. Please install `flash-attn>={_REQUIRED_FLASH_VERSION}`."
            )
    elif backend in [AttentionBackendName.FLASH_HUB]:
        if not is_kernels_available():
            raise RuntimeError(f"Backend '{backend.value}' needs `kernels`. Please install it with `pip install kernels`.")
"""


def test_branches_map_backends_to_packages_and_versions():
    reqs = parse_requirements(SOURCE)
    assert (reqs["flash"].package, reqs["flash"].minimum) == ("flash-attn", "2.6.3")
    assert reqs["flash_varlen"].package == "flash-attn" and "2.6.3" in reqs["flash_varlen"].message
    assert (reqs["flash_hub"].package, reqs["flash_hub"].minimum) == ("kernels", None)
    assert "native" not in reqs


def test_unreadable_code_says_nothing():
    assert parse_requirements("def _check_attention_backend_requirements(backend):\n    pass\n") == {}
