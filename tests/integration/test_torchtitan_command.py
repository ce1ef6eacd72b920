"""`cpdoctor step --ring 2 --emulate torchtitan-cpu -- torchrun --nproc-per-node {nproc} -m torchtitan.train ...
--parallelism.context_parallel_degree {cp}`: torchtitan 0.3.0's own FLUX trainer, launched as its users launch it
(its test config, its CLI), unmodified, on CPU ranks (examples/torchtitan_cpu/workspace.py sets the folder up:
torchtitan's test assets, one-layer encoder configs, torchtitan's own seed checkpoint).

Every expectation comes from torchtitan's own code run in this process: the seed `set_determinism` gives each CP
rank (read one simulated rank at a time on torch's fake process group) as `FluxTrainer.__init__` calls it
(distinct over `fsdp`, which holds the CP ranks) and with the one-line change of
examples/torchtitan_cpu/synced_seeding.diff (distinct over `batch` only). Where the seeds part the CP ranks, the
step FAILs naming the timesteps `forward_backward_step` draws from that generator, on the ranks whose seed differs;
where they agree, it PASSes against the same command without CP.

Skipped without torchtitan (docs/TORCHTITAN.md) or without its source's test assets (TORCHTITAN_SOURCE: a checkout
or a bare git directory of pytorch/torchtitan). Not in CI: two launches of the trainer take minutes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from titan_ranks import simulated_rank

pytest.importorskip("torchtitan.models.flux.trainer", reason="torchtitan is not installed (cpdoctor[titan])")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(os.environ.get("TORCHTITAN_SOURCE", "/work/.mirror/pytorch+torchtitan/repo"))
CP = 2
TITAN_DIMS = ["fsdp", "dp_replicate"]
"""What FluxTrainer.__init__ seeds distinct over with the partial_dtensor backend (torchtitan 0.3.0)."""
FIXED_DIMS = ["batch"]
"""The same with examples/torchtitan_cpu/synced_seeding.diff applied."""

if not SOURCE.exists():
    pytest.skip(f"no torchtitan source for its test assets at {SOURCE} (set TORCHTITAN_SOURCE)", allow_module_level=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "examples" / "torchtitan_cpu"))
    import workspace as ws

    return ws.prepare(SOURCE, tmp_path_factory.mktemp("titan"), fixed=True)


def seeds(distinct: list[str]) -> list[int]:
    """The seed torchtitan's `set_determinism` gives each CP rank of a dp-1 job at cp 2 (its meshes on the CPU, as the
    command's processes build them under --emulate torchtitan-cpu)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the "fake" backend of size-1 mesh dims)
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import DebugConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    parallel_dims_module.device_type = "cpu"

    out = []
    for r in range(CP):
        with simulated_rank(r, CP):
            dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=CP, tp=1, pp=1, ep=1, world_size=CP, spmd_backend="partial_dtensor")
            dims.build_mesh()
            dist_utils.set_determinism(dims, torch.device("cpu"), DebugConfig(seed=1234), distinct_seed_mesh_dims=distinct)
            out.append(torch.initial_seed())
    return out


def examine(ws, fixed: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in ([str(ws.fixed)] if fixed else []) + [str(ROOT)])
    cmd = [sys.executable, "-m", "cpdoctor", "step", "--ring", str(CP), "--emulate", "torchtitan-cpu", "--timeout", "600", "--json", "-"]
    proc = subprocess.run([*cmd, "--", *ws.command()], capture_output=True, text=True, env=env, cwd=ws.folder, timeout=3000)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    report["exit"] = proc.returncode
    return report


def test_torchtitans_own_seeding_fails_naming_the_timesteps_its_seeds_part(workspace):
    titan = seeds(TITAN_DIMS)
    parted = sorted(r for r in range(CP) if titan[r] != titan[0])
    assert parted  # torchtitan seeds its CP ranks apart
    report = examine(workspace, fixed=False)
    (finding,) = report["findings"]
    assert report["exit"] == 1 and finding["verdict"] == "FAIL", finding["diagnosis"]
    assert finding["details"]["inputs_differ"]["timesteps"] == parted, finding["diagnosis"]
    assert "torchtitan on CPU ranks" in finding["details"]["emulated"]


def test_the_one_line_change_syncs_the_seeds_and_passes(workspace):
    fixed = seeds(FIXED_DIMS)
    assert len(set(fixed)) == 1  # every CP rank of the replica seeded alike
    report = examine(workspace, fixed=True)
    (finding,) = report["findings"]
    assert report["exit"] == 0 and finding["verdict"] == "PASS", finding["diagnosis"]
    assert [r["processes"] for r in report["runs"]] == [1, CP]
