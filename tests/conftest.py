"""Shared helpers: run the real CLI in a subprocess, know which diffusers release is under test; and the tiers.

Tiers (docs/TESTS.md): `python -m pytest -q` runs the fast default tier, the unit tests and the integration tests
marked `smoke` (real gloo ranks through diffusers' real code: one check per verdict kind, the patch, one model,
one step, one peer), in a few minutes on 2 cores. The full integration tier runs with `CPDOCTOR_TESTS=full` in the
environment (CI sets it) or `--full`; naming a file or folder under tests/integration runs all of it too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

FULL_TIER_ENV = "CPDOCTOR_TESTS"
"""`CPDOCTOR_TESTS=full python -m pytest -q`: the README's test command with the full integration tier (CI)."""
INTEGRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", help=f"run the full integration tier (as {FULL_TIER_ENV}=full does)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "smoke: an integration test of the fast default tier (the rest need the full tier)")
    config.addinivalue_line("markers", f"once: a test whose subject is the same in every CI environment (deselected where {ONCE_ENV}=1)")


ONCE_ENV = "CPDOCTOR_TESTS_ONCE_RAN"
"""Set by .ci/run in its second environment: the tests marked `once` ran in the first. A test is `once` only where
what it examines does not change with the diffusers release or torch's build (docs/TESTS.md)."""


MAX_WORKERS = 4
"""`-n auto`'s ceiling: every worker holds a warm fork server of torch and diffusers (about 0.5 GB) and starts
gloo ranks of its own; most of a test's wall time is one core busy (a parent importing, judging, waiting for a
rank), so two workers on 2 cores roughly halve the suite, and more than 4 only add memory."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """pytest-xdist's `-n auto` (pyproject's addopts): one worker per core this process may run on, at most
    MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def full_tier(config: pytest.Config) -> bool:
    """The full integration tier: asked for, or a path under tests/integration named on the command line."""
    if config.getoption("--full") or os.environ.get(FULL_TIER_ENV) == "full":
        return True
    named = [os.path.abspath(str(arg).split("::")[0]) for arg in config.args]
    return any(path == INTEGRATION or path.startswith(INTEGRATION + os.sep) for path in named)


LONG_FIRST = (
    "test_step_compile.py",
    "test_step_matrix.py",
    "test_step_conventions.py",
    "test_repro.py",
    "test_hub_cache_verdicts.py",
    "test_gpu_acceptance_dry_run.py",
)
"""The integration files that take longest (`--durations`, docs/TESTS.md), started first: the workers
take files in collection order (`--no-loadscope-reorder`), and a long file started last would leave one worker
alone at the end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: the rest keep their order
    if os.environ.get(ONCE_ENV) == "1":
        ran = [item for item in items if item.get_closest_marker("once") is not None]
        if ran:
            config.hook.pytest_deselected(items=ran)
            items[:] = [item for item in items if item.get_closest_marker("once") is None]
    if full_tier(config):
        return
    kept, left = [], []
    for item in items:
        in_integration = str(item.path).startswith(INTEGRATION + os.sep)
        (left if in_integration and item.get_closest_marker("smoke") is None else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str:
    if full_tier(config):
        return "cpdoctor tiers: the full integration tier"
    return f"cpdoctor tiers: the fast default tier (unit + integration marked smoke); the full tier: {FULL_TIER_ENV}=full or --full"


@pytest.fixture(scope="session", autouse=True)
def warm_ranks(request: pytest.FixtureRequest) -> None:
    """Ranks launched from this process (tests calling the API) fork from a server that imported torch and
    diffusers once, as the CLI's do (cpdoctor/launch/warm.py); a test that changes the environment gets
    spawned ranks, as a fresh interpreter would see it."""
    if any(str(item.path).startswith(INTEGRATION + os.sep) for item in request.session.items):
        from cpdoctor import api

        api.warm_ranks(models=True)


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


def run_cli_many(calls: list[list[str]], env: dict | None = None, timeout: float = 240) -> list[CliRun]:
    """`run_cli` for several command lines that end before any rank starts (bad input), in one interpreter
    (tests/cli_many.py): each through the CLI's own entry, with its own argv, output and exit code."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_many.py")
    proc = subprocess.run(
        [sys.executable, script, json.dumps(calls)], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [CliRun(r["code"], r["stdout"], r["stderr"]) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


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


@pytest.fixture(scope="session")
def ring_unpacks_twice() -> bool:
    """docs/FACTS.md, read from the installed ring backward's source (as text: importing diffusers here is slow): it
    unpacks `ctx.saved_tensors` and hands the same ctx to the backend's backward op (which unpacks them again), so
    non-reentrant checkpointing refuses it."""
    import ast
    import importlib.util
    import re
    from pathlib import Path

    (root,) = importlib.util.find_spec("diffusers").submodule_search_locations
    text = (Path(root) / "models" / "attention_dispatch.py").read_text()
    ring = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "TemplatedRingAttention")
    backward = next(f for f in ring.body if isinstance(f, ast.FunctionDef) and f.name == "backward")
    source = ast.get_source_segment(text, backward) or ""
    return "ctx.saved_tensors" in source and re.search(r"backward_op\(\s*ctx\b", source) is not None
