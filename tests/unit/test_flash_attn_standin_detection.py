"""cpdoctor's flash-attn stand-in on sys.path is told apart from the real package: never reported as the
installed flash-attn, and named as the stand-in where the fix runs its functions."""

from __future__ import annotations

import pathlib
import sys
import types

import pytest

from cpdoctor.compat import diffusers as compat
from cpdoctor.compat.packages import NOT_INSTALLED, STANDIN_MARK, installed_version, is_standin

STANDIN = pathlib.Path(__file__).resolve().parents[2] / "cpdoctor" / "cpu_kernels" / "flash_attn_standin"


def test_the_standin_carries_the_mark_in_its_dist_info_and_its_module():
    (dist_info,) = STANDIN.glob("flash_attn-*.dist-info")
    version = next(
        line.split(":", 1)[1].strip() for line in (dist_info / "METADATA").read_text().splitlines() if line.startswith("Version:")
    )
    assert is_standin(version)
    assert f'__version__ = "{version}"' in (STANDIN / "flash_attn" / "__init__.py").read_text()


def test_the_standin_on_the_path_is_not_the_installed_flash_attn(monkeypatch):
    if installed_version("flash-attn", "flash_attn") != NOT_INSTALLED:
        pytest.skip("a real flash-attn is installed here: it would be reported, rightly")
    monkeypatch.syspath_prepend(str(STANDIN))
    found = installed_version("flash-attn", "flash_attn", module="flash_attn")
    assert found.startswith(NOT_INSTALLED) and "stand-in" in found, found


@pytest.mark.parametrize(("version", "standin"), [("2.6.3" + STANDIN_MARK, True), ("2.7.4.post1", False), (None, False)])
def test_the_imported_flash_attn_is_told_apart(monkeypatch, version, standin):
    if version is None:
        monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__=version))
    assert compat.flash_attn_is_standin() is standin
