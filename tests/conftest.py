"""Shared helpers: run the real CLI in a subprocess, know which diffusers release is under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest


@dataclass
class CliRun:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        return json.loads(self.stdout)


def run_cli(*args: str, env: dict | None = None, timeout: float = 240) -> CliRun:
    proc = subprocess.run(
        [sys.executable, "-m", "cpdoctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return CliRun(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def diffusers_release() -> tuple[int, ...]:
    """The installed release, used only to pick the expected verdicts (the tool itself never looks)."""
    import diffusers

    return tuple(int(x) for x in diffusers.__version__.split(".")[:3] if x.isdigit())


@pytest.fixture(scope="session")
def has_stale_kv_backward(diffusers_release: tuple[int, ...]) -> bool:
    """docs/FACTS.md: releases before the fix of the ring backward (0.39.0 among them) recompute every ring step
    against the iteration-0 K/V; 0.42.1 passes the rotated chunk."""
    return diffusers_release < (0, 42, 0)
