"""Wall time of whole commands, measured alternately in the same run (shared by the bench_* scripts)."""

from __future__ import annotations

import subprocess
import time


def timed(cmd: list[str]) -> float:
    """Seconds one command takes from start to exit, output discarded."""
    start = time.perf_counter()
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def alternate(first: list[str], second: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """Run each command once to warm the file cache, then `repeats` times, alternating, so load on the
    machine hits both alike. Returns the two lists of seconds."""
    timed(first), timed(second)
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(first))
        b.append(timed(second))
    return a, b
