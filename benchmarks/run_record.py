"""What every stored run records next to its figures (benchmarks/README.md, "Figures and their runs"): the machine,
the versions, the load average before and after, the repetitions and each figure's spread [min, max].

Kept free of torch and diffusers imports so a script can record the load average before it imports them.
"""

from __future__ import annotations

import os
import platform
import statistics


def machine() -> dict:
    """The CPU the figures come from: model, logical cores, cores this process may use, bf16 support."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "native_bf16": any(f in flags.split() for f in ("avx512_bf16", "amx_bf16")),
        "platform": platform.platform(),
    }


def versions() -> dict:
    """torch, diffusers and python as the run imported them (imported here, after the load was recorded)."""
    import diffusers
    import torch

    return {"torch": str(torch.__version__), "diffusers": diffusers.__version__, "python": platform.python_version()}


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages now: on a shared machine a figure means little without them."""
    return [round(x, 2) for x in os.getloadavg()]


def summary(values: list[float], digits: int = 3) -> dict:
    """A figure's median and its spread [min, max] over the repetitions."""
    return {
        "median": round(statistics.median(values), digits),
        "spread": [round(min(values), digits), round(max(values), digits)],
    }


def write_results(path: str, what: str, rows: object, load_before: list[float], script: str) -> None:
    """A results file with its run's record: what it holds, its rows, the machine, versions, the load before and
    after, and the command line that wrote it (`script` and this process's arguments)."""
    import json
    import sys

    record = {
        "what": what,
        "rows": rows,
        "machine": machine(),
        "versions": versions(),
        "load_average": {"before": load_before, "after": load_average()},
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
    }
    with open(path, "w") as fh:
        json.dump(record, fh, indent=2)


SEEDED_SPREAD = "none: seeded steps; `deterministic` says whether a second pass gave the same numbers; times: the first pass, one run each"


def write_seeded(path: str, what: str, rows: object, load_before: list[float], script: str, deterministic: bool, **extra: object) -> None:
    """The results file of a seeded examination run twice (`deterministic`: the two passes agreed exactly, the
    convention's stand-in for repetitions), with its run's record and what the script adds (`extra`)."""
    import json
    import sys

    record = {
        "what": what,
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "versions": {**versions(), **extra.pop("versions", {})},  # type: ignore[dict-item]
        "load_average": {"before": load_before, "after": load_average()},
        "deterministic": deterministic,
        "spread": SEEDED_SPREAD,
        **extra,
        "rows": rows,
    }
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1, ensure_ascii=False)
